"""Per-expert FP8 casts of grouped operands (the grouped ops' :mod:`.grouped_linear`, :mod:`.grouped_swiglu`).

Rows grouped by expert (``offs``, int32 [E] cumulative group ends, as ``torch._grouped_mm`` takes them;
rows past ``offs[-1]`` are padding) are cast with one scale per expert from their own amax
(:func:`cast_grouped_rows`; an empty group has amax 0 and scale 1, padding rows scale 1); stacked expert
weights [E, ...] likewise (:func:`cast_experts`). Delayed scaling reads a stack of E states per role
(history [E, H], scale [E], ...); an expert whose history is still empty casts with its current amax's
scale (``torch.where``, no host sync). On CUDA the gradient is E4M3 (:func:`grad_format`). On CPU the
cast loop can also write the GEMM operand (the codes' values in the GEMM dtype) so it is not upcast in a
second pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kernels
from ..kernels import cpu
from ..numerics import Format, get_format, scale_from_amax
from ..numerics.scaling import scale_to_cast

__all__ = ["grad_format", "scaled_grouped_mm_grad_format", "group_ids", "group_amax", "expert_scales", "GroupedOperand", "gemm_up", "with_ones",
           "cast_grouped_rows", "cast_experts", "casts_both_layouts", "held_scales"]


def grad_format(bwd_format: str, device) -> str:
    """The format the gradient of a grouped op is cast to on ``device``: the recipe's where the grouped
    GEMMs take upcast codes (CPU), :func:`scaled_grouped_mm_grad_format` where they take the FP8 codes
    themselves (CUDA: ``torch._scaled_grouped_mm``). Its delayed-scaling state records in this format."""
    if kernels.for_device(device).OFFERS.upcast_gemm_operands:
        return bwd_format
    return scaled_grouped_mm_grad_format(bwd_format)


def scaled_grouped_mm_grad_format(bwd_format: str) -> str:
    """``torch._scaled_grouped_mm`` takes E4M3 operands only: an E5M2 gradient is cast to E4M3 instead,
    with the same per-expert scales (given to the GEMM row-wise); E4M3 formats and identity stay."""
    if bwd_format == "identity" or get_format(bwd_format).torch_dtype == torch.float8_e4m3fn:
        return bwd_format
    return "e4m3"


def group_ids(offs: torch.Tensor, rows: int) -> torch.Tensor:
    """Expert index of every row (int64 [rows]); rows past ``offs[-1]`` get E (no expert)."""
    r = torch.arange(rows, device=offs.device, dtype=offs.dtype)
    return torch.searchsorted(offs, r, right=True)


def group_amax(row_amax: torch.Tensor, ids: torch.Tensor, experts: int) -> torch.Tensor:
    """Per-expert max of per-row amaxes, fp32 [E] (0 for empty groups; padding rows left out)."""
    out = torch.zeros(experts + 1, dtype=torch.float32, device=row_amax.device)
    out = out.scatter_reduce(0, ids, row_amax, "amax", include_self=True)
    return out[:experts]


def expert_scales(amax: torch.Tensor, state: list[torch.Tensor], fmt: Format, margin, power_of_two):
    """fp32 [E] scales: current from ``amax``, or the delayed state's (current while its history is empty)."""
    if not state:
        return scale_from_amax(amax, fmt, margin, power_of_two)
    return scale_to_cast(state, amax, fmt, margin, power_of_two)


@dataclass
class GroupedOperand:
    data: torch.Tensor | None  # codes (or the values themselves for the identity format); None when not kept
    scale: torch.Tensor  # fp32 [E] encode scales
    amax: torch.Tensor  # fp32 [E]
    values: torch.Tensor | None = None  # CPU: the codes' values in the GEMM dtype, made by the cast's own loop
    row_inv: torch.Tensor | None = None  # fp32 [rows]: each row's decode scale, where the cast made them (CUDA)
    row_pad: torch.Tensor | None = None  # bool [rows]: rows past offs[-1], made with row_inv
    data_t: torch.Tensor | None = None  # stacked weights: each expert's codes transposed, where the cast wrote them

    def gemm_input(self, kern, out_dtype):
        """The codes as the device's GEMM takes them. CPU: the values the cast wrote beside the codes,
        else one upcast here (once, also when the operand feeds two GEMMs)."""
        if self.values is not None:
            return self.values
        if not kern.OFFERS.upcast_gemm_operands:
            return self.data
        return kern.upcast(self.data, kern.gemm_dtype(out_dtype, self.data))


def gemm_up(kern, fmt, out_dtype):
    """The dtype the CPU GEMM takes FP8 codes in (for casts that also write the GEMM operand), or None
    (no FP8 codes, or a device whose GEMM takes the codes themselves)."""
    if fmt is None or not kern.OFFERS.upcast_gemm_operands or not kern.fused_enabled():
        return None
    return kern.gemm_dtype(out_dtype, torch.empty(0, dtype=fmt.torch_dtype))


def with_ones(t):
    """``t`` [E, ...] with a row of ones appended: the value for padding rows (group id E)."""
    return torch.cat([t, t.new_ones(1, *t.shape[1:])])


def _cast(kern, x2d, row_scale, fmt, rounding, up, keep_codes, seed=None):
    """(codes or None, GEMM values or None) of the rows, from one cast loop."""
    if up is None:
        return kern.cast_rows(x2d, row_scale, fmt, rounding, seed=seed), None
    out = kern.cast_rows(x2d, row_scale, fmt, rounding, up=up, keep_codes=keep_codes, seed=seed)
    return out if keep_codes else (None, out)


# --- delayed scaling on CPU: cast with the held scales and take the row amaxes in the same loop.
# Current scaling needs the amax before the cast (two reads of x); a delayed scale is known before x is
# read, so the amax to record comes out of the cast's own loop. Only when every expert casts with its
# held scale (each history non-empty, overflow guard off): then ``scale_to_cast`` returns exactly the
# held scales, and the codes, values and amaxes are those of the two-pass path, bit for bit.


def held_scales(state: list[torch.Tensor]) -> torch.Tensor | None:
    """fp32 [E]: the delayed state's held scales when every expert casts with them, else None (the
    bootstrap or the overflow guard then need the current amax first). Reads two flags on the host:
    free on CPU, the only device this is used on."""
    steps, skipped, guard = state[2], state[3], state[5]
    if bool(guard.any()) or not bool((steps > skipped).all()):
        return None
    return state[1].to(torch.float32).clone()


def _triton_grouped(x, fmt, rounding) -> bool:
    """Whether the device's grouped cast kernels (``OFFERS.grouped_casts``) cast ``x``: FP8 codes, round to
    nearest, a non-empty input (the torch ops below do the rest: identity, stochastic, empty)."""
    return (fmt is not None and rounding == "nearest" and x.numel() > 0
            and kernels.for_device(x.device).OFFERS.grouped_casts)


def _fused_rows(kern, x2d, rounding, up) -> bool:
    """Whether ``cpu.cast_rows_with_amax`` applies: the CPU torch kernels writing GEMM values, nearest
    rounding, a non-empty fp16/bf16/fp32 2-D input."""
    return (kern is cpu and up is not None and rounding == "nearest" and x2d.numel() > 0
            and x2d.dtype != torch.float64)


def cast_grouped_rows(x2d, offs, fmt, state, margin, power_of_two, rounding="nearest", gemm_out=None,
                      keep_codes=True, ids=None, seed=None) -> GroupedOperand:
    """Cast rows grouped by expert, each group with its expert's scale (padding rows get scale 1).

    Args:
        x2d: [S, K] rows; offs: int32 [E] cumulative group ends.
        fmt: FP8 Format, or None (identity format: the values themselves, scales 1).
        state: [] (current scaling) or the per-expert delayed state (the op list, ``DelayedScalingState.OP_FIELDS``).
        margin, power_of_two, rounding: cast options.
        gemm_out: the dtype of the GEMM this operand feeds: on CPU the cast loop then also writes the
            GEMM operand (``values``), so it is not upcast in a second pass; None: codes only.
        keep_codes: False for an operand only the GEMMs read (a gradient): ``data`` is then None.
        ids: :func:`group_ids` of the rows where the caller has them (computed here when needed).
        seed: stochastic rounding's seed (int64 [1], the weight's stream draw, ``runtime.sr``), or None
            (one drawn from torch's generator).
    """
    experts = offs.numel()
    if _triton_grouped(x2d, fmt, rounding):
        codes, scale, amax, _, row_inv, row_pad = kernels.for_device(x2d.device).cast_grouped(
            x2d, fmt, offs=offs, state=state, margin=margin, power_of_two=power_of_two, row_inv=True)
        return GroupedOperand(codes, scale, amax, row_inv=row_inv, row_pad=row_pad)
    ids = group_ids(offs, x2d.shape[0]) if ids is None else ids
    kern = kernels.for_device(x2d.device)
    up = gemm_up(kern, fmt, gemm_out) if gemm_out is not None else None
    if state and fmt is not None and _fused_rows(kern, x2d, rounding, up):
        scale = held_scales(state)
        if scale is not None:
            codes, values, row_amax = cpu.cast_rows_with_amax(x2d, with_ones(scale)[ids], fmt, up, keep_codes)
            return GroupedOperand(codes, scale, group_amax(row_amax, ids, experts), values)
    amax = group_amax(kern.row_amax(x2d), ids, experts)
    if fmt is None:
        return GroupedOperand(x2d.clone(), torch.ones(experts, dtype=torch.float32, device=x2d.device), amax)
    scale = expert_scales(amax, state, fmt, margin, power_of_two)
    codes, values = _cast(kern, x2d, with_ones(scale)[ids], fmt, rounding, up, keep_codes or up is None, seed)
    return GroupedOperand(codes, scale, amax, values)


def casts_both_layouts(w, fmt) -> bool:
    """Whether :func:`cast_experts` of ``w`` writes each expert's codes in both layouts (``data_t``): the
    device's grouped cast kernels (CUDA), which store the transposed tile from the same read. The fake
    kernels ask this too, so their saved codes have the strides the real ones have."""
    return w.dim() == 3 and _triton_grouped(w, fmt, "nearest")


def cast_experts(w, fmt, state, margin, power_of_two, gemm_out=None, col_divisor=None,
                 row_divisor=None) -> GroupedOperand:
    """Cast stacked expert weights [E, ...] with one scale per expert (``gemm_out``: as :func:`cast_grouped_rows`);
    where :func:`casts_both_layouts`, also each expert's codes transposed (``data_t``, [E, C, R] of [E, R, C]):
    every expert weight feeds a GEMM in each layout (forward and dgrad), and the grouped FP8 GEMM takes
    only one, so one of them would otherwise be a copy of the codes. ``col_divisor`` [E, C] / ``row_divisor``
    [E, R] (only where :func:`casts_both_layouts`; fp32 powers of two): cast ``w / d`` as torch divides in
    ``w``'s dtype, without writing it out (Smooth-SwiGLU's ``W_down / c``)."""
    if casts_both_layouts(w, fmt):  # the rows of every expert's matrix
        rows = w.reshape(w.shape[0] * w.shape[1], w.shape[2])
        codes, scale, amax, _, row_inv, _, codes_t = kernels.for_device(w.device).cast_grouped(
            rows, fmt, group_rows=w.shape[1], state=state, margin=margin, power_of_two=power_of_two, row_inv=True,
            transposed=True, col_divisor=col_divisor, row_divisor=row_divisor)
        return GroupedOperand(codes.view(w.shape), scale, amax, row_inv=row_inv, data_t=codes_t)
    if col_divisor is not None or row_divisor is not None:
        raise ValueError("cast_experts: a divisor needs the device's grouped cast kernels (casts_both_layouts)")
    kern = kernels.for_device(w.device)
    up = gemm_up(kern, fmt, gemm_out) if gemm_out is not None else None
    if state and fmt is not None and w.dim() == 3 and _fused_rows(kern, w, "nearest", up):
        scale = held_scales(state)
        if scale is not None:  # the rows of every expert's matrix, each with its expert's scale
            rows = w.reshape(w.shape[0] * w.shape[1], w.shape[2])
            codes, values, row_amax = cpu.cast_rows_with_amax(rows, scale.repeat_interleave(w.shape[1]), fmt, up, True)
            return GroupedOperand(codes.view(w.shape), scale, row_amax.view(w.shape[:2]).amax(dim=1),
                                  values.view(w.shape))
    flat = w.reshape(w.shape[0], -1)
    amax = kern.row_amax(flat)
    if fmt is None:
        return GroupedOperand(w.clone(), torch.ones(w.shape[0], dtype=torch.float32, device=w.device), amax)
    scale = expert_scales(amax, state, fmt, margin, power_of_two)
    codes, values = _cast(kern, flat, scale, fmt, "nearest", up, True)
    return GroupedOperand(codes.view(w.shape), scale, amax, values.view(w.shape) if values is not None else None)
