"""The memory the FP8 AdamW kernels read and write: how a moment is stored, the order of a step's scalars.

Layout of an FP8 moment of a parameter ``p`` (state keys ``<name>_codes`` and ``<name>_scale``):

* ``codes``: ``p.shape``, dtype ``float8_e4m3fn`` or ``float8_e5m2`` (one byte per element).
* ``scale``: fp32 ``[ceil(p.numel() / block)]``, one encode scale per block of ``block`` consecutive
  elements of ``p`` flattened in row-major order; the last block may be partial (its missing elements
  count as zeros, which change no amax). A tensor smaller than one block is one partial block.
* value = ``decode(codes) / scale`` (the numerics convention ``data = cast(x * scale)``), with
  ``scale = fmt.max / amax_block`` (``scale_from_amax``: 1 for an all-zero block).

The second moment is stored as ``v`` itself (the paper's form, the default) or as ``sqrt(v)`` (keys
``exp_avg_sq_sqrt_codes`` / ``_scale``). bf16/fp32 moments are one tensor ``<name>`` of ``p.shape`` in
that dtype, exactly like torch's AdamW state.

The torch reference (``fp8pass.optim.torch_step``) and the Triton kernels (:mod:`.triton_adam`) both
take this layout from here; ``fp8pass.optim.moments`` reads and writes moments in it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..numerics.formats import E4M3, E5M2, Format

__all__ = ["MOMENT_FORMATS", "MomentSpec", "WeightSeed", "num_blocks", "init_moment", "HP_FIELDS"]

# The fp32 scalars of one Adam(W) step, in the order the kernels and the torch path take them.
HP_FIELDS = ("beta1", "one_minus_beta1", "beta2", "one_minus_beta2", "inv_bc2_sqrt", "eps", "step_size",
             "decay", "l2")

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


class WeightSeed(NamedTuple):
    """Where the random bits of a bf16 parameter's stochastic weight update come from
    (``bf16_stochastic_round``): element ``i`` of the flattened tensor rounds with the low 16 bits of
    ``numerics.casts.hash_bits(counter + i, seed)``, in the torch path, the compiled one and the Triton
    kernels alike.

    Args:
        seed: int32 0-dim tensor on the parameter's device (a view of the step's one draw of seeds:
            ``optim.torch_step.draw_weight_seeds``); never read on the host.
        counter: the counter of the tensor's first element (0 for a whole parameter).
    """

    seed: torch.Tensor
    counter: int = 0


def init_moment(state: dict, spec: MomentSpec, p: torch.Tensor) -> None:
    """Zero state for ``spec`` of parameter ``p`` (zero codes, scale 1: the all-zero block's scale)."""
    if spec.fp8:
        state[spec.codes_key] = torch.zeros(p.shape, dtype=spec.dtype, device=p.device)
        state[spec.scale_key] = torch.ones(num_blocks(p.numel(), spec.block), dtype=torch.float32, device=p.device)
    else:
        state[spec.name] = torch.zeros(p.shape, dtype=spec.dtype, device=p.device)
