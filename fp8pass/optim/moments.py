"""Reading and writing one Adam moment: FP8 codes + per-block fp32 scales, or a plain bf16/fp32 tensor.

The layout (state keys, block scales, ``sqrt(v)`` storage) is declared once, beside the kernels that
read it: :mod:`fp8pass.kernels.adam_layout`; its names are re-exported here for the optimizer's users.
docs/optim.md says what was measured for each moment format.
"""

from __future__ import annotations

import torch

from ..kernels.adam_layout import MOMENT_FORMATS, MomentSpec, init_moment, num_blocks
from ..numerics import decode, scale_from_amax
from ..quantized import quantize

__all__ = [
    "MOMENT_FORMATS", "MomentSpec", "num_blocks", "finite_block_amax", "init_moment", "read_moment", "write_moment",
]


def finite_block_amax(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """max |x| over the finite values of each row of ``blocks`` [nb, block] (0 if none is finite).

    NaN/Inf are left out so that one non-finite element (a NaN gradient propagates into its moment,
    as in torch) cannot turn its block's scale into 1 and flush the block's other elements, and can
    never reach the scale of another block: NaN keeps its FP8 NaN code, +-Inf saturates to +-max.
    ``out`` (same shape as ``blocks``) is a workspace for ``|x|``.
    """
    a = torch.abs(blocks, out=out) if out is not None else blocks.abs()
    return a.nan_to_num_(nan=0.0, posinf=0.0).amax(dim=1)


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
