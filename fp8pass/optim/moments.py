"""How one Adam moment is stored: FP8 codes + per-block fp32 scales, or a plain bf16/fp32 tensor.

Layout of an FP8 moment of a parameter ``p`` (state keys ``<name>_codes`` and ``<name>_scale``):

* ``codes``: ``p.shape``, dtype ``float8_e4m3fn`` or ``float8_e5m2`` (one byte per element).
* ``scale``: fp32 ``[ceil(p.numel() / block)]``, one encode scale per block of ``block`` consecutive
  elements of ``p`` flattened in row-major order; the last block may be partial (its missing elements
  count as zeros, which change no amax). A tensor smaller than one block is one partial block.
* value = ``decode(codes) / scale`` (the numerics convention ``data = cast(x * scale)``), with
  ``scale = fmt.max / amax_block`` (``scale_from_amax``: 1 for an all-zero block).

The second moment is stored as ``v`` itself (the paper's form, the default) or as ``sqrt(v)`` (keys
``exp_avg_sq_sqrt_codes`` / ``_scale``); see docs/optim.md for what was measured for each. bf16/fp32 moments are one tensor
``<name>`` of ``p.shape`` in that dtype, exactly like torch's AdamW state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..numerics import E4M3, E5M2, Format, decode, quantize, scale_from_amax

__all__ = [
    "MOMENT_FORMATS", "MomentSpec", "num_blocks", "finite_block_amax", "init_moment", "read_moment", "write_moment",
]

MOMENT_FORMATS = ("e4m3", "e5m2", "bf16", "fp32")
_FP8 = {"e4m3": E4M3, "e5m2": E5M2}
_DENSE = {"bf16": torch.bfloat16, "fp32": torch.float32}


def num_blocks(numel: int, block: int) -> int:
    return -(-numel // block)


@dataclass(frozen=True)
class MomentSpec:
    """Storage of one moment.

    Args:
        name: "exp_avg" or "exp_avg_sq" (torch's state names).
        fmt: one of MOMENT_FORMATS.
        block: elements per scale block (FP8 formats).
        sqrt: store ``sqrt(value)`` instead of the value (FP8 formats only; ignored otherwise).
    """

    name: str
    fmt: str
    block: int = 128
    sqrt: bool = False

    @property
    def fp8(self) -> bool:
        return self.fmt in _FP8

    @property
    def format(self) -> Format:
        return _FP8[self.fmt]

    @property
    def dtype(self) -> torch.dtype:
        return self.format.torch_dtype if self.fp8 else _DENSE[self.fmt]

    @property
    def stores_sqrt(self) -> bool:
        return self.fp8 and self.sqrt

    @property
    def codes_key(self) -> str:
        return f"{self.name}_sqrt_codes" if self.stores_sqrt else f"{self.name}_codes"

    @property
    def scale_key(self) -> str:
        return f"{self.name}_sqrt_scale" if self.stores_sqrt else f"{self.name}_scale"

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.codes_key, self.scale_key) if self.fp8 else (self.name,)


def finite_block_amax(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """max |x| over the finite values of each row of ``blocks`` [nb, block] (0 if none is finite).

    NaN/Inf are left out so that one non-finite element (a NaN gradient propagates into its moment,
    as in torch) cannot turn its block's scale into 1 and flush the block's other elements, and can
    never reach the scale of another block: NaN keeps its FP8 NaN code, +-Inf saturates to +-max.
    ``out`` (same shape as ``blocks``) is a workspace for ``|x|``.
    """
    a = torch.abs(blocks, out=out) if out is not None else blocks.abs()
    return a.nan_to_num_(nan=0.0, posinf=0.0).amax(dim=1)


def init_moment(state: dict, spec: MomentSpec, p: torch.Tensor) -> None:
    """Zero state for ``spec`` of parameter ``p`` (zero codes, scale 1: the all-zero block's scale)."""
    if spec.fp8:
        state[spec.codes_key] = torch.zeros(p.shape, dtype=spec.dtype, device=p.device)
        state[spec.scale_key] = torch.ones(num_blocks(p.numel(), spec.block), dtype=torch.float32, device=p.device)
    else:
        state[spec.name] = torch.zeros(p.shape, dtype=spec.dtype, device=p.device)


def read_moment(state: dict, spec: MomentSpec) -> torch.Tensor:
    """The moment's value as a new fp32 tensor of the parameter's shape (``v`` even when sqrt(v) is stored)."""
    if not spec.fp8:
        return state[spec.name].to(torch.float32, copy=True)
    codes = state[spec.codes_key]
    flat = decode(codes.reshape(-1), spec.format, torch.float32)
    n, b = flat.numel(), spec.block
    pad = num_blocks(n, b) * b - n
    vals = torch.nn.functional.pad(flat, (0, pad)).view(-1, b) / state[spec.scale_key][:, None]
    vals = vals.reshape(-1)[:n]
    if spec.stores_sqrt:
        vals = vals * vals
    return vals.reshape(codes.shape)


def write_moment(state: dict, spec: MomentSpec, value: torch.Tensor, rounding: str = "nearest",
                 generator: torch.Generator | None = None) -> None:
    """Store an fp32 moment value (``v``, not its root) into ``state`` with ``spec``'s storage.

    Used by conversions and ``load_state_dict``; the optimizer's step has its own fused paths.
    """
    if not spec.fp8:
        state[spec.name] = value.detach().to(spec.dtype, copy=True)
        return
    x = value.detach().to(torch.float32).reshape(-1)
    if spec.stores_sqrt:
        x = x.sqrt()
    n, b = x.numel(), spec.block
    blocks = torch.nn.functional.pad(x, (0, num_blocks(n, b) * b - n)).view(-1, b)
    scale = scale_from_amax(finite_block_amax(blocks), spec.format).reshape(1, -1)
    q = quantize(x, spec.format, scale=scale, granularity="block", block=b, rounding=rounding, generator=generator)
    state[spec.codes_key] = q.data.reshape(value.shape).contiguous()
    state[spec.scale_key] = q.scale.reshape(-1).contiguous()
