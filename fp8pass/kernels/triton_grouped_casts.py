"""Triton casts of grouped (MoE) GEMM operands, one scale per expert, in two launches whatever the experts.

Rows are grouped by expert: ``offs`` (int32 [E] cumulative group ends, as ``torch._grouped_mm`` takes
them; rows past ``offs[-1]`` are padding) or, for stacked expert weights ``[E, N, K]`` seen as rows
``[E * N, K]``, groups of a uniform ``group_rows`` (= N). The expert of a row is found in the kernel
(the number of group ends <= the row, or ``row // group_rows``): no ``searchsorted``/index launches and
no host read of the group sizes.

=================================  ===================================================================
``_grouped_amax_scale_kernel``     one read of ``x``: each program's rows' max ``|x|`` (NaN-propagating);
                                   the program that arrives last (an acquire-release counter it resets)
                                   reduces each expert's rows and runs ``triton_scaling.scale_epilogue``
                                   per expert: amax [E], the scale (current: ``scale_from_amax``;
                                   delayed: ``scale_to_cast`` of the expert's state), its decode scale
``_grouped_cast_kernel``           one read of ``x``: codes of ``x[r] * scale[expert(r)]`` (padding rows
                                   scale 1), and each row's decode scale ``1 / scale[expert(r)]``
                                   (``ROW_INV``: the row- or column-wise scale vector
                                   ``torch._scaled_grouped_mm`` takes; padding rows the last expert's);
                                   for stacked weights also each expert's matrix transposed (``TRANSPOSE``:
                                   the other GEMM's layout, so no copy of the codes makes it)
=================================  ===================================================================

Current scaling needs the amax before the cast, so two reads of ``x``; delayed scaling takes the same
two launches here (its one-read form, casting with the held scales and recasting only where the
bootstrap or the overflow guard changes a scale, is the dense ``cuda.cast_delayed``'s and not done for
grouped operands yet). Round to nearest only: a stochastically rounded gradient keeps the torch cast.

The torch reference of both (:func:`reference`) is what the grouped ops computed on CUDA before these
kernels: ``group_amax`` of the row maxima, ``expert_scales``, ``(x * scale[ids]).clamp(-max, max)``
cast; codes, amaxes, scales and decode scales are bit-identical to it (tests/kernels/test_triton_grouped_casts.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..numerics.formats import Format
from ..numerics.scaling import scale_from_amax, scale_to_cast
from . import triton_scaling
from .triton_helpers import (
    INTERPRETED,
    INTERPRETING,
    cast_codes,
    check_interpretable,
    hardware_cast,
    max_propagating_nan,
)
from .triton_operand_casts import _fmt_kw  # the format's constexprs, cached (max_code is computed)
from .triton_scaling import divided_in, max_of_uncached, reciprocal_rn, scale_epilogue

__all__ = ["cast_grouped", "reference", "aligned_transpose"]

# rows x columns of a program. The interpreter runs each program as numpy calls: large tiles.
_AMAX_TILE = (64, 256) if INTERPRETING else (32, 128)
_CAST_TILE = (64, 256) if INTERPRETING else (32, 128)
_TRANSPOSE_TILE = (32, 256)  # destination columns x code columns
_RBLOCK = 1024  # the last program reduces an expert's row maxima this many at a time


@triton.jit
def _expert_of(rows, offs_ptr, E, group_rows, UNIFORM: tl.constexpr, EP: tl.constexpr):
    """The expert of each row: ``row // group_rows`` (UNIFORM), else the number of group ends <= row
    (E for padding rows past ``offs[-1]``)."""
    if UNIFORM:
        return (rows // group_rows).to(tl.int32)
    e = tl.arange(0, EP)
    ends = tl.load(offs_ptr + e, mask=e < E, other=2147483647).to(tl.int64)
    return tl.sum((ends[None, :] <= rows[:, None]).to(tl.int32), axis=1)


@triton.jit
def _column_divisor_inverse(div_ptr, e, cols, C):
    """``1 / d[e, c]`` (exact: ``d`` powers of two) of an [E, C] divisor table, [BC]: DIVIDE 1, a divisor
    per column of each expert. DIVIDE 2 (per row ``r``) is ``_row_divisor_inverse``. Smooth-SwiGLU's
    ``B = W_down / c`` of stacked ``[E, D, F]`` / ``[E, F, D]`` weights, divided in the kernels by
    ``triton_scaling.divided_in`` as torch divides in the weight's dtype."""
    return reciprocal_rn(tl.load(div_ptr + e * C + cols, mask=cols < C, other=1.0))


@triton.jit
def _row_divisor_inverse(div_ptr, rows, row_ok):
    """``1 / d[r]`` of a divisor per row (DIVIDE 2), as [BR, 1]."""
    return reciprocal_rn(tl.load(div_ptr + rows, mask=row_ok, other=1.0))[:, None]


@triton.jit
def _uniform_rows(pid_r, group_rows, blocks_per_group, BR: tl.constexpr):
    """Row block ``pid_r`` of stacked weights, each expert's ``group_rows`` rows split in ``blocks_per_group``
    blocks (its last one partial): (the expert, the block's row indices within it, its global row indices,
    which of them are rows of the expert: not all of a partial block's)."""
    e = pid_r // blocks_per_group
    local = (pid_r % blocks_per_group) * BR + tl.arange(0, BR)
    return e, local, e * group_rows + local, local < group_rows


@triton.jit
def _row_abs_max(x):
    """NaN-propagating max |x| along axis 1 of a 2-D block (the interpreter: max and a NaN test)."""
    if INTERPRETED:
        has_nan = tl.max((x != x).to(tl.int32), axis=1)
        return tl.where(has_nan > 0, float("nan"), tl.max(tl.abs(x), axis=1))
    return tl.reduce(tl.abs(x), 1, max_propagating_nan)


@triton.jit
def _grouped_amax_scale_kernel(x_ptr, R, C, offs_ptr, E, group_rows, row_max_ptr, counter_ptr, held_ptr, steps_ptr,
                               skipped_ptr, guard_ptr, amax_out, scale_out, inv_out, recast_out, div_ptr,
                               blocks_per_group, UNIFORM: tl.constexpr, DELAYED: tl.constexpr, TARGET: tl.constexpr,
                               FMT_MAX: tl.constexpr, MAX_SCALE_C: tl.constexpr, HUGE: tl.constexpr,
                               POW2: tl.constexpr, NAN_SCALE: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                               RBLOCK: tl.constexpr, DIVIDE: tl.constexpr = 0):
    """Row maxima of ``x`` [R, C], then (last program) per expert e: amax, scale, decode scale (and the
    delayed state's recast flag) at ``*_out + e``. UNIFORM: a program's rows lie in one expert (as in
    ``_grouped_cast_kernel``); DIVIDE (UNIFORM): the maxima of ``x / d`` (``_column_divisor_inverse``,
    ``_row_divisor_inverse``)."""
    pid = tl.program_id(0).to(tl.int64)
    if UNIFORM:
        ex, local, rows, row_ok = _uniform_rows(pid, group_rows, blocks_per_group, BR)
    else:
        rows = pid * BR + tl.arange(0, BR)
        row_ok = rows < R
    if DIVIDE == 2:
        inv_d = _row_divisor_inverse(div_ptr, rows, row_ok)
    acc = tl.zeros([BR, BC], tl.float32)
    for c0 in range(0, C, BC):
        cols = c0 + tl.arange(0, BC)
        mask = row_ok[:, None] & (cols[None, :] < C)
        x = tl.load(x_ptr + rows[:, None] * C + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if DIVIDE == 1:
            x = divided_in(x, _column_divisor_inverse(div_ptr, ex, cols, C)[None, :], x_ptr.dtype.element_ty)
        if DIVIDE == 2:
            x = divided_in(x, inv_d, x_ptr.dtype.element_ty)
        acc = max_propagating_nan(acc, tl.abs(x))
    tl.store(row_max_ptr + rows, _row_abs_max(acc), mask=row_ok)
    tl.debug_barrier()  # the row maxima (stored by any thread) complete before the release
    if tl.atomic_add(counter_ptr, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        tl.debug_barrier()  # every thread reads the row maxima after the acquire
        for e in range(E):
            if UNIFORM:
                start = e * group_rows
                end = start + group_rows
            else:
                start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
                end = tl.load(offs_ptr + e)
            amax = max_of_uncached(row_max_ptr + start, end - start, RBLOCK)
            scale_epilogue(amax, held_ptr + e, steps_ptr + e, skipped_ptr + e, guard_ptr, scale_out, scale_out,
                           amax_out + e, scale_out + e, inv_out + e, recast_out + e, scale_out, scale_out, 0,
                           DELAYED, TARGET, FMT_MAX, MAX_SCALE_C, HUGE, POW2, NAN_SCALE)
        tl.store(counter_ptr, 0)


@triton.jit
def _grouped_cast_kernel(x_ptr, out_ptr, out_t_ptr, R, C, offs_ptr, E, group_rows, blocks_per_group, scale_ptr,
                         inv_ptr, row_inv_ptr, pad_ptr, div_ptr, UNIFORM: tl.constexpr, EP: tl.constexpr,
                         ROW_INV: tl.constexpr, TRANSPOSE: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr,
                         MAX_CODE: tl.constexpr, NAN_CODE: tl.constexpr, HW: tl.constexpr, BR: tl.constexpr,
                         BC: tl.constexpr, DIVIDE: tl.constexpr = 0):
    """Codes of ``x[r, c] * scale[expert(r)]`` (``cast_codes``; padding rows scale 1), and with ROW_INV
    the rows' decode scales ``inv[min(expert(r), E - 1)]`` and padding flags ``expert(r) == E`` (stored
    by the first column of programs).

    UNIFORM (stacked expert weights, ``[E * G, C]`` rows with ``G = group_rows``): a program's rows lie in
    one expert (``blocks_per_group`` row blocks per expert), so its expert is one scalar, and TRANSPOSE
    also stores each expert's matrix transposed, ``out_t[e, c, g] = codes[e * G + g, c]`` (``[E, C, G]``):
    the layout the other GEMM of the weight reads (dgrad's ``[E, K, N]`` for ``[E, N, K]`` weights, the
    forward's for ``[E, K, N]`` ones) from the same read of ``x``, instead of a copy of the codes. DIVIDE
    (UNIFORM): the codes of ``x / d`` (``_column_divisor_inverse``, ``_row_divisor_inverse``), as the amax
    kernel took it."""
    pid_r, pid_c = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    cols = pid_c * BC + tl.arange(0, BC)
    if UNIFORM:
        e, local, rows, row_ok = _uniform_rows(pid_r, group_rows, blocks_per_group, BR)
        expert = tl.zeros([BR], tl.int64) + e
        s = tl.zeros([BR], tl.float32) + tl.load(scale_ptr + e)
    else:
        rows = pid_r * BR + tl.arange(0, BR)
        row_ok = rows < R
        expert = _expert_of(rows, offs_ptr, E, group_rows, UNIFORM, EP)
        s = tl.load(scale_ptr + expert, mask=expert < E, other=1.0)
    mask = row_ok[:, None] & (cols[None, :] < C)
    x = tl.load(x_ptr + rows[:, None] * C + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if DIVIDE == 1:
        x = divided_in(x, _column_divisor_inverse(div_ptr, e, cols, C)[None, :], x_ptr.dtype.element_ty)
    if DIVIDE == 2:
        x = divided_in(x, _row_divisor_inverse(div_ptr, rows, row_ok), x_ptr.dtype.element_ty)
    v = cast_codes(x * s[:, None], 0, MBITS, BIAS, MAX_CODE, NAN_CODE, 7, False, HW).to(tl.uint8)
    tl.store(out_ptr + rows[:, None] * C + cols[None, :], v, mask=mask)
    if TRANSPOSE:
        tl.store(out_t_ptr + e * C * group_rows + cols[:, None] * group_rows + local[None, :], tl.trans(v),
                 mask=tl.trans(mask))
    if ROW_INV:
        if pid_c == 0:
            tl.store(row_inv_ptr + rows, tl.load(inv_ptr + tl.minimum(expert, E - 1)), mask=row_ok)
            tl.store(pad_ptr + rows, (expert >= E).to(tl.uint8), mask=row_ok)


@triton.jit
def _aligned_transpose_kernel(codes_ptr, out_ptr, S, C, W, offs_ptr, E, scale_ptr, ends_out, empty_out, rep_inv_out,
                              div_ptr, BPP, EP: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                              DIVIDE: tl.constexpr = False):
    """``out`` [C, W]: column t holds row ``t - shift(t)`` of ``codes`` [S, C] where t is in its group's
    rows, zero codes in the gaps that start every group at a multiple of 16 (``cuda._aligned_groups``'s
    layout: group e padded by ``(-size_e) mod 16`` columns; rows past ``offs[-1]`` after the last group).
    Program ``(i, j)``: destination columns ``[i * BT, (i + 1) * BT)`` of the ``BPP`` blocks of ``BC`` code
    columns from block ``j * BPP``, a block at a time: each column's group (a ``[BT, EP]`` comparison with the padded group ends) is
    found once per program, not once per ``BT x BC`` block (at 128 experts that lookup was most of the
    kernel's instructions). Program (0, 0) writes the padded group ends ``ends_out`` [E] and ``empty_out``
    [E] (size 0); the programs of the first destination block write ``rep_inv_out[e * C + c] = 1 / scale[e]``
    (DIVIDE: ``/ d[e, c]`` too, a power of two per column of each group, exact: the GEMM's output columns
    divided by ``d``, Smooth-SwiGLU's ``dW = dB / c`` folded into the decode scales)."""
    pid_t, pid_c = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    e = tl.arange(0, EP)
    ends = tl.load(offs_ptr + e, mask=e < E, other=0).to(tl.int64)
    starts = tl.load(offs_ptr + e - 1, mask=(e > 0) & (e < E), other=0).to(tl.int64)
    sizes = ends - starts
    gaps = (-sizes) & 15
    shift_after = tl.cumsum(gaps, 0)  # zero columns inserted up to the end of each group
    dest_ends = tl.where(e < E, ends + shift_after, 9223372036854775807)
    t = pid_t * BT + tl.arange(0, BT)
    before = dest_ends[None, :] <= t[:, None]  # [BT, EP]: the groups that end at or before column t
    shift = tl.max(tl.where(before, shift_after[None, :], 0), axis=1)
    limit = tl.min(tl.where(before | (e >= E)[None, :], 9223372036854775807, ends[None, :]), axis=1)
    src = t - shift
    valid = (src < tl.minimum(limit, S)) & (t < W)
    first = pid_c * BPP  # the program's first block of BC code columns
    n_blocks = tl.minimum(BPP, tl.cdiv(C, BC) - first)
    for k in range(0, n_blocks):
        cols = (first + k) * BC + tl.arange(0, BC)  # a multiple of BC to the compiler: vector accesses
        in_c = cols < C
        v = tl.load(codes_ptr + src[:, None] * C + cols[None, :], mask=valid[:, None] & in_c[None, :], other=0)
        tl.store(out_ptr + cols[:, None] * W + t[None, :], tl.trans(v), mask=in_c[:, None] & (t[None, :] < W))
    if pid_t == 0:
        for j in range(E):  # a row of the [E, C] decode scales at a time: no [EP, BC] block in registers
            inv = tl.math.div_rn(tl.full([BC], 1.0, tl.float32), tl.load(scale_ptr + j))
            for k in range(0, n_blocks):
                cols = (first + k) * BC + tl.arange(0, BC)
                if DIVIDE:
                    tl.store(rep_inv_out + j * C + cols, inv * _column_divisor_inverse(div_ptr, j, cols, C),
                             mask=cols < C)
                else:
                    tl.store(rep_inv_out + j * C + cols, inv, mask=cols < C)
    if (pid_t == 0) & (pid_c == 0):
        tl.store(ends_out + e, dest_ends.to(tl.int32), mask=e < E)
        tl.store(empty_out + e, (sizes == 0).to(tl.uint8), mask=e < E)


# Programs the aligned transpose aims for (two per H200 SM): code columns are split among programs only
# when the destination blocks alone are fewer.
_TRANSPOSE_PROGRAMS = 264
# Software pipelining of the column loop's loads would hold several [BT, BC] blocks at once (it spilled).
_TRANSPOSE_STAGES = 1
_TRANSPOSE_WARPS = 8


def aligned_transpose(codes: torch.Tensor, scale: torch.Tensor, offs: torch.Tensor, width: int,
                      divisor: torch.Tensor | None = None):
    """The 2d x 2d grouped GEMM's operand from one launch (see ``_aligned_transpose_kernel``).

    Args:
        codes: [S, C] FP8 codes, rows grouped by ``offs`` (int32 [E] cumulative group ends).
        scale: fp32 [E] encode scales of the groups.
        width: the layout's columns, a static bound (``cuda._aligned_groups``'s).
        divisor: fp32 [E, C] powers of two, or None: the decode scales divided by them (exactly).

    Returns:
        (codes [C, width] in ``codes``'s dtype, int32 [E] padded group ends, bool [E] empty groups,
        fp32 [E * C] each group's decode scale repeated per column, divided by ``divisor``).
    """
    s, c = codes.shape
    experts = offs.numel()
    if divisor is not None and (tuple(divisor.shape) != (experts, c) or divisor.dtype != torch.float32):
        raise ValueError(f"aligned_transpose: the divisor is fp32 [E, C] = {(experts, c)}, got {divisor.dtype} "
                         f"{tuple(divisor.shape)}")
    divisor = divisor.contiguous() if divisor is not None else None
    check_interpretable(codes.device)
    out = torch.empty(c, width, dtype=codes.dtype, device=codes.device)
    ends = torch.empty(experts, dtype=torch.int32, device=codes.device)
    empty = torch.empty(experts, dtype=torch.uint8, device=codes.device)
    rep_inv = torch.empty(experts * c, dtype=torch.float32, device=codes.device)
    bt, bc = _TRANSPOSE_TILE
    t_blocks = max(triton.cdiv(width, bt), 1)
    c_blocks = max(triton.cdiv(c, bc), 1)
    splits = max(1, min(c_blocks, triton.cdiv(_TRANSPOSE_PROGRAMS, t_blocks)))
    bpp = triton.cdiv(c_blocks, splits)  # column blocks per program
    _aligned_transpose_kernel[(t_blocks, triton.cdiv(c_blocks, bpp))](
        codes.contiguous().view(torch.uint8), out.view(torch.uint8), s, c, width, offs, experts,
        scale.to(torch.float32).contiguous(), ends, empty, rep_inv, divisor if divisor is not None else rep_inv, bpp,
        EP=triton.next_power_of_2(experts), BT=bt, BC=bc, DIVIDE=divisor is not None, num_stages=_TRANSPOSE_STAGES,
        num_warps=_TRANSPOSE_WARPS)
    return out, ends, empty.view(torch.bool), rep_inv


def cast_grouped(x2d: torch.Tensor, fmt: Format, offs: torch.Tensor | None = None, group_rows: int = 0,
                 state: list[torch.Tensor] | None = None, margin: float = 0.0, power_of_two: bool = False,
                 row_inv: bool = False, transposed: bool = False, col_divisor: torch.Tensor | None = None,
                 row_divisor: torch.Tensor | None = None):
    """Codes of rows grouped by expert, each group cast with its expert's scale, in two launches.

    Args:
        x2d: [R, C] rows (fp32, bf16 or fp16), R and C > 0.
        fmt: the FP8 format.
        offs: int32 [E] cumulative group ends (rows past ``offs[-1]``: padding, scale 1), or None with
            ``group_rows``: groups of ``group_rows`` rows each (E = R / group_rows; stacked weights).
        state: [] / None (current scaling) or the per-expert delayed-scaling op list (``[E]`` scales).
        margin, power_of_two: the recipe's scale options.
        row_inv: also return each row's decode scale (fp32 [R]) and which rows are padding (bool [R]).
        transposed: (stacked weights, ``group_rows``) also write each expert's codes transposed: the
            ``[E, C, group_rows]`` codes, as a 7th element (from the same read of ``x``).
        col_divisor, row_divisor: (stacked weights of dtype fp32 or bf16; at most one) cast ``x / d``, divided
            as torch divides in ``x``'s dtype, without writing it out: ``d`` fp32 [E, C] powers of two per
            column of each expert, or [E, group_rows] per row (Smooth-SwiGLU's ``W_down / c``).

    Returns:
        (codes [R, C] in ``fmt``'s dtype, scale [E], amax [E], decode scale [E], row decode scales [R] or
        None, padding rows [R] or None; with ``transposed``, the transposed codes).
    """
    r, c = x2d.shape
    if not (r and c):
        raise ValueError(f"cast_grouped needs a non-empty [R, C] input, got {tuple(x2d.shape)}")
    if (offs is None) == (group_rows <= 0) or (offs is None and r % group_rows):
        raise ValueError(f"cast_grouped: give offs or a group_rows that divides R = {r}, got "
                         f"offs={None if offs is None else tuple(offs.shape)}, group_rows={group_rows}")
    if transposed and offs is not None:
        raise ValueError("cast_grouped: transposed takes stacked weights (group_rows), not rows grouped by offs")
    divide = 1 if col_divisor is not None else 2 if row_divisor is not None else 0
    if divide:
        want = (r // max(group_rows, 1), c) if divide == 1 else (r // max(group_rows, 1), group_rows)
        div = col_divisor if divide == 1 else row_divisor
        if (offs is not None or (col_divisor is not None and row_divisor is not None) or tuple(div.shape) != want
                or div.dtype != torch.float32 or x2d.dtype not in (torch.float32, torch.bfloat16)):
            raise ValueError(f"cast_grouped: a divisor takes stacked fp32/bf16 weights (group_rows) and one fp32 "
                             f"{'[E, C]' if divide == 1 else '[E, group_rows]'} = {want} table, got x "
                             f"{x2d.dtype}, divisor {div.dtype} {tuple(div.shape)}, offs "
                             f"{'given' if offs is not None else 'None'}")
    check_interpretable(x2d.device)
    x = x2d.contiguous()
    device = x.device
    experts = offs.numel() if offs is not None else r // group_rows
    f32 = dict(dtype=torch.float32, device=device)
    amax, scale, inv = (torch.empty(experts, **f32) for _ in range(3))
    recast = torch.empty(experts, dtype=torch.int32, device=device)
    row_max = torch.empty(r, **f32)
    held, steps, skipped, guard = (state[1], state[2], state[3], state[5]) if state else (scale,) * 4
    consts = triton_scaling.epilogue_consts(fmt, margin, power_of_two, bool(state))
    offs_arg = offs if offs is not None else recast  # never read with UNIFORM
    div_arg = div.contiguous() if divide else scale  # never read without DIVIDE
    uniform = offs is None
    br, bc = _AMAX_TILE
    # uniform groups: each program's rows in one expert (a group's last block may be partial)
    blocks_per_group = triton.cdiv(group_rows, br) if uniform else 1
    _grouped_amax_scale_kernel[(experts * blocks_per_group if uniform else triton.cdiv(r, br),)](
        x, r, c, offs_arg, experts, max(group_rows, 1), row_max, triton_scaling.counter(device), held, steps,
        skipped, guard, amax, scale, inv, recast, div_arg, blocks_per_group, UNIFORM=uniform, **consts, BR=br, BC=bc,
        RBLOCK=_RBLOCK, DIVIDE=divide)
    codes = torch.empty(r, c, dtype=fmt.torch_dtype, device=device)
    rows_inv = torch.empty(r, **f32) if row_inv else inv
    pad = torch.empty(r, dtype=torch.uint8, device=device) if row_inv else recast
    br, bc = _CAST_TILE
    blocks_per_group = triton.cdiv(group_rows, br) if uniform else 1
    row_blocks = experts * blocks_per_group if uniform else triton.cdiv(r, br)
    codes_t = torch.empty(experts, c, group_rows, dtype=fmt.torch_dtype, device=device) if transposed else codes
    _grouped_cast_kernel[(row_blocks, triton.cdiv(c, bc))](
        x, codes.view(torch.uint8), codes_t.view(torch.uint8), r, c, offs_arg, experts, max(group_rows, 1),
        blocks_per_group, scale, inv, rows_inv, pad, div_arg, UNIFORM=uniform, EP=triton.next_power_of_2(experts),
        ROW_INV=row_inv, TRANSPOSE=transposed, **_fmt_kw(fmt), HW=hardware_cast(device, fmt), BR=br, BC=bc,
        DIVIDE=divide)
    out = (codes, scale, amax, inv, (rows_inv if row_inv else None), (pad.view(torch.bool) if row_inv else None))
    return (*out, codes_t) if transposed else out


def reference(x2d: torch.Tensor, fmt: Format, offs: torch.Tensor | None = None, group_rows: int = 0,
              state: list[torch.Tensor] | None = None, margin: float = 0.0, power_of_two: bool = False,
              col_divisor: torch.Tensor | None = None, row_divisor: torch.Tensor | None = None):
    """:func:`cast_grouped` in torch ops (what the grouped ops ran on CUDA before it): the same tuple,
    row decode scales and padding rows always included; a divisor as the grouped SwiGLU multiplied by
    ``1 / c`` in the weight's dtype before."""
    r = x2d.shape[0]
    if col_divisor is not None:
        x2d = (x2d.view(-1, group_rows, x2d.shape[1]) * (1 / col_divisor[:, None, :]).to(x2d.dtype)).view(x2d.shape)
    if row_divisor is not None:
        x2d = x2d * (1 / row_divisor.reshape(-1, 1)).to(x2d.dtype)
    if offs is None:
        offs = torch.arange(group_rows, r + 1, group_rows, dtype=torch.int32, device=x2d.device)
    experts = offs.numel()
    ids = torch.searchsorted(offs, torch.arange(r, dtype=offs.dtype, device=x2d.device), right=True)
    row_max = x2d.float().abs().amax(dim=1)
    amax = torch.zeros(experts + 1, dtype=torch.float32, device=x2d.device)
    amax = amax.scatter_reduce(0, ids, row_max, "amax", include_self=True)[:experts]
    if state:
        scale = scale_to_cast(state, amax, fmt, margin, power_of_two)
    else:
        scale = scale_from_amax(amax, fmt, margin, power_of_two)
    row_scale = torch.cat([scale, scale.new_ones(1)])[ids]
    codes = (x2d.float() * row_scale[:, None]).clamp(-fmt.max, fmt.max).to(fmt.torch_dtype)
    inv = torch.reciprocal(scale)
    return codes, scale, amax, inv, inv[ids.clamp(max=experts - 1)], ids == experts
