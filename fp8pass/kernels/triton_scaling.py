"""Triton kernels for the scalar work around an FP8 cast: scales from amaxes, delayed-scaling records.

Each is one launch of one program where torch needs 10-50 small kernels (``scale_from_amax`` is 9
elementwise ops on a scalar, ``scale_to_cast`` 20, a delayed-scaling record ~45): on a GPU every
launch costs ~5 us of host time, far more than the work, so these decide whether an FP8 linear is
host-bound (docs/runtime.md, Launches).

=========================  ===========================================================================
``_operand_scale_kernel``  the amax of a tensor from its cast's per-tile partial maxima, and the
                           scale to cast it with: current scaling ``fmt.max / 2**margin / amax``
                           (:func:`fp8pass.numerics.scale_from_amax`), or delayed scaling's
                           :func:`fp8pass.numerics.scaling.scale_to_cast` of a state; its decode
                           scale ``1 / scale`` (what ``torch._scaled_mm`` takes), whether the scale
                           differs from the state's held one (the recast flag), and the decode
                           scales of other given scales (a backward's saved operands)
``_amax_scale_kernel``     ``max |x|`` and current scaling's scale in one launch: every program stores
                           its partial max, the last to arrive (an acquire-release counter per
                           stream, which it resets) reduces them and runs the same scale epilogue
                           (``scale_epilogue``, which the transpose-cast's delayed mode runs too)
``_record_kernel``         :func:`fp8pass.numerics.scaling.record_update` of many delayed-scaling
                           states at once, in place (one program per state; the states' tensors are
                           found through an offset table cached on the device)
``_channel_scales_kernel`` Smooth-SwiGLU's power-of-two channel scales from per-tile column maxima;
                           ``SCALES`` (:func:`smooth_scales`): in the same launch the scales of every
                           tensor the SwiGLU forward casts (A, ``W_down / c``, the saved gate and up),
                           the last program to arrive reducing the programs' maxima
=========================  ===========================================================================

Bit-identical to the torch references (tests/kernels/test_triton_scaling.py): divisions are correctly rounded
(``div_rn``), as torch's tensor divisions are.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..numerics.formats import Format, get_format
from ..numerics.scaling import HUGE_AMAX, MAX_SCALE, NO_PENDING, OVERFLOW_FACTOR
from .triton_helpers import INTERPRETED, INTERPRETING, abs_max_2d, check_interpretable, max_propagating_nan, tile_scale

__all__ = ["OperandScale", "operand_scale", "amax_and_scale", "record_states", "channel_scales", "SmoothScales",
           "smooth_scales", "rounded_to", "reciprocal_rn", "divided_in", "epilogue_args", "epilogue_consts", "scale_epilogue",
           "max_of_uncached", "scale_by_last_program", "counter"]

_PARTIALS_BLOCK = 1024


@triton.jit
def _max_of(ptr, n, BLOCK: tl.constexpr):
    """NaN-propagating max of ``n`` fp32 values at ``ptr`` (amaxes: >= 0 or NaN); 0 for ``n == 0``."""
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc = max_propagating_nan(acc, tl.load(ptr + offs, mask=offs < n, other=0.0))
    has_nan = tl.max((acc != acc).to(tl.int32))
    return tl.where(has_nan > 0, float("nan"), tl.max(acc))


@triton.jit
def scale_epilogue(amax, held_ptr, steps_ptr, skipped_ptr, guard_ptr, inv0_in, inv1_in, amax_out, scale_out, inv_out,
                    recast_out, inv0_out, inv1_out, N_INVERT: tl.constexpr, DELAYED: tl.constexpr,
                    TARGET: tl.constexpr, FMT_MAX: tl.constexpr, MAX_SCALE_C: tl.constexpr, HUGE: tl.constexpr,
                    POW2: tl.constexpr, NAN_SCALE: tl.constexpr):
    """From a tensor's ``amax``: its scale, ``1 / scale``, the recast flag and ``1 / inv_in``, stored.

    Current scaling (``DELAYED`` False): ``scale = scale_from_amax(amax)`` (``TARGET = fmt.max / 2**margin``,
    capped at ``MAX_SCALE``, power-of-two floor, 1 (or NaN for E2M1) for a zero / non-finite amax).
    Delayed: the held scale, unless the history is empty (``steps <= skipped``) or the overflow guard
    is on and ``amax * held > fmt.max`` for a usable amax: then the current scale (``scale_to_cast``).
    """
    scale = tile_scale(amax, TARGET, MAX_SCALE_C, POW2, NAN_SCALE)
    one = tl.full([], 1.0, tl.float32)
    if DELAYED:
        held = tl.load(held_ptr)
        valid = tl.load(steps_ptr) > tl.load(skipped_ptr)
        outgrew = (amax < HUGE) & (amax * held > FMT_MAX)
        scale = tl.where(valid & ~((tl.load(guard_ptr) != 0) & outgrew), held, scale)
        tl.store(recast_out, (scale != held).to(tl.int32))
    tl.store(amax_out, amax)
    tl.store(scale_out, scale)
    tl.store(inv_out, tl.math.div_rn(one, scale))
    if N_INVERT > 0:
        tl.store(inv0_out, tl.math.div_rn(one, tl.load(inv0_in)))
    if N_INVERT > 1:
        tl.store(inv1_out, tl.math.div_rn(one, tl.load(inv1_in)))


@triton.jit
def _operand_scale_kernel(partial_ptr, n_partial, held_ptr, steps_ptr, skipped_ptr, guard_ptr, inv0_in, inv1_in,
                          amax_out, scale_out, inv_out, recast_out, inv0_out, inv1_out, N_INVERT: tl.constexpr,
                          DELAYED: tl.constexpr, TARGET: tl.constexpr, FMT_MAX: tl.constexpr,
                          MAX_SCALE_C: tl.constexpr, HUGE: tl.constexpr, POW2: tl.constexpr,
                          NAN_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    """One program: ``amax = max(partials)``, then :func:`scale_epilogue`."""
    amax = _max_of(partial_ptr, n_partial, BLOCK)
    scale_epilogue(amax, held_ptr, steps_ptr, skipped_ptr, guard_ptr, inv0_in, inv1_in, amax_out, scale_out,
                    inv_out, recast_out, inv0_out, inv1_out, N_INVERT, DELAYED, TARGET, FMT_MAX, MAX_SCALE_C, HUGE,
                    POW2, NAN_SCALE)


@triton.jit
def _amax_scale_kernel(x_ptr, n, partial_ptr, counter_ptr, held_ptr, steps_ptr, skipped_ptr, guard_ptr, inv0_in,
                       inv1_in, amax_out, scale_out, inv_out, recast_out, inv0_out, inv1_out, N_INVERT: tl.constexpr,
                       DELAYED: tl.constexpr, TARGET: tl.constexpr, FMT_MAX: tl.constexpr,
                       MAX_SCALE_C: tl.constexpr, HUGE: tl.constexpr, POW2: tl.constexpr, NAN_SCALE: tl.constexpr,
                       BLOCK: tl.constexpr, RBLOCK: tl.constexpr):
    """``max |x|`` and current scaling's scale of ``x`` in one launch.

    Each program takes every ``num_programs``-th block of ``BLOCK`` elements (so the programs, and the
    partial maxima the last one reduces, are few) and stores its NaN-propagating max. The program
    that increments ``*counter`` last (acquire-release: it sees every partial) reduces them, runs
    :func:`scale_epilogue` and resets ``*counter`` to 0 for the next launch on the stream.
    """
    pid = tl.program_id(0).to(tl.int64)
    nprog = tl.num_programs(0)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(pid * BLOCK, n, nprog.to(tl.int64) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc = max_propagating_nan(acc, tl.abs(tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)))
    has_nan = tl.max((acc != acc).to(tl.int32))
    tl.store(partial_ptr + pid, tl.where(has_nan > 0, float("nan"), tl.max(acc)))
    scale_by_last_program(partial_ptr, nprog, counter_ptr, held_ptr, steps_ptr, skipped_ptr, guard_ptr, inv0_in,
                          inv1_in, amax_out, scale_out, inv_out, recast_out, inv0_out, inv1_out, N_INVERT, DELAYED,
                          TARGET, FMT_MAX, MAX_SCALE_C, HUGE, POW2, NAN_SCALE, RBLOCK)


@triton.jit
def scale_by_last_program(partial_ptr, n_partial, counter_ptr, held_ptr, steps_ptr, skipped_ptr, guard_ptr, inv0_in,
                          inv1_in, amax_out, scale_out, inv_out, recast_out, inv0_out, inv1_out,
                          N_INVERT: tl.constexpr, DELAYED: tl.constexpr, TARGET: tl.constexpr,
                          FMT_MAX: tl.constexpr, MAX_SCALE_C: tl.constexpr, HUGE: tl.constexpr, POW2: tl.constexpr,
                          NAN_SCALE: tl.constexpr, RBLOCK: tl.constexpr):
    """Called by every one of ``n_partial`` programs after it stored its partial max at ``partial_ptr``: the
    last to increment ``*counter`` (acquire-release: it sees every partial) reduces them, runs
    :func:`scale_epilogue` and resets ``*counter`` to 0 for the next launch on the stream."""
    # the partial's store (by whichever thread made it) completes before this program's release
    tl.debug_barrier()
    if tl.atomic_add(counter_ptr, 1, sem="acq_rel") == n_partial - 1:
        tl.debug_barrier()  # every thread of the last program reads the partials after its acquire
        amax = max_of_uncached(partial_ptr, n_partial, RBLOCK)
        scale_epilogue(amax, held_ptr, steps_ptr, skipped_ptr, guard_ptr, inv0_in, inv1_in, amax_out, scale_out,
                        inv_out, recast_out, inv0_out, inv1_out, N_INVERT, DELAYED, TARGET, FMT_MAX, MAX_SCALE_C,
                        HUGE, POW2, NAN_SCALE)
        tl.store(counter_ptr, 0)


@triton.jit
def max_of_uncached(ptr, n, BLOCK: tl.constexpr):
    """:func:`_max_of` reading through L2 only (``.cg``): values other programs just wrote."""
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc = max_propagating_nan(acc, tl.load(ptr + offs, mask=offs < n, other=0.0, cache_modifier=".cg"))
    has_nan = tl.max((acc != acc).to(tl.int32))
    return tl.where(has_nan > 0, float("nan"), tl.max(acc))


@dataclass
class OperandScale:
    """What :func:`operand_scale` computed, each a 0-dim tensor on the device (no host read).

    Attributes:
        amax: fp32 max |x|.
        scale: fp32 encode scale to cast with.
        inv_scale: fp32 ``1 / scale`` (``torch._scaled_mm``'s decode scale).
        recast: int32, delayed scaling: 1 where ``scale`` is not the state's held scale (the cast made
            with the held scale must be redone); None for current scaling.
        inverted: fp32 ``1 / s`` of each scale given in ``invert``.
    """

    amax: torch.Tensor
    scale: torch.Tensor
    inv_scale: torch.Tensor
    recast: torch.Tensor | None
    inverted: tuple[torch.Tensor, ...]


def epilogue_args(fmt: Format, margin: float, power_of_two: bool, state: list[torch.Tensor] | None,
                  invert: tuple[torch.Tensor, ...], device: torch.device) -> tuple[OperandScale, list, dict]:
    """The outputs, runtime arguments and constexprs of :func:`scale_epilogue` (after its ``amax``):
    ``(OperandScale of new tensors, [held, steps, skipped, guard, inv0_in, inv1_in, amax_out, scale_out,
    inv_out, recast_out, inv0_out, inv1_out], {N_INVERT, DELAYED, TARGET, FMT_MAX, MAX_SCALE_C, HUGE,
    POW2, NAN_SCALE})``; unused pointer slots hold the scale output (never read or written)."""
    if len(invert) > 2:
        raise ValueError(f"a scale launch inverts at most 2 scales, got {len(invert)}")
    # separate tensors, not views of one buffer: ops return them as outputs that must not alias
    amax, scale, inv = (torch.empty((), dtype=torch.float32, device=device) for _ in range(3))
    recast = torch.empty((), dtype=torch.int32, device=device) if state else None
    inverted = tuple(torch.empty((), dtype=torch.float32, device=device) for _ in invert)
    ins = [s.to(torch.float32) for s in invert] + [scale] * (2 - len(invert))
    outs = list(inverted) + [scale] * (2 - len(invert))
    held, steps, skipped, guard = (state[1], state[2], state[3], state[5]) if state else (scale,) * 4
    args = [held, steps, skipped, guard, ins[0], ins[1], amax, scale, inv, scale if recast is None else recast,
            outs[0], outs[1]]
    consts = dict(N_INVERT=len(invert), **epilogue_consts(fmt, margin, power_of_two, bool(state)))
    return OperandScale(amax, scale, inv, recast, inverted), args, consts


def epilogue_consts(fmt: Format, margin: float, power_of_two: bool, delayed: bool) -> dict:
    """The format and recipe constexprs of :func:`scale_epilogue` (all but ``N_INVERT``)."""
    return dict(DELAYED=delayed, TARGET=_fp32(fmt.max / (2.0**margin) if margin else fmt.max),
                FMT_MAX=float(fmt.max), MAX_SCALE_C=MAX_SCALE, HUGE=HUGE_AMAX, POW2=bool(power_of_two),
                NAN_SCALE=fmt.nan_code is None)


def operand_scale(partials: torch.Tensor, fmt: Format, margin: float = 0.0, power_of_two: bool = False,
                  state: list[torch.Tensor] | None = None, invert: tuple[torch.Tensor, ...] = ()) -> OperandScale:
    """The amax of a tensor from its per-tile maxima and the scale to cast it with, in one launch.

    Args:
        partials: fp32 per-tile maxima of ``|x|`` (from the cast or amax kernel; NaN propagates).
        fmt: the format the tensor is cast to.
        margin, power_of_two: the recipe's scale options.
        state: a delayed-scaling op list (``DelayedScalingState.OP_FIELDS``): the scale to cast with is
            then :func:`~fp8pass.numerics.scaling.scale_to_cast`'s; None: current scaling.
        invert: up to two fp32 scalar scales whose reciprocals to compute too (the saved operands of a
            backward), so that their GEMMs need no ``reciprocal`` launches of their own.
    """
    check_interpretable(partials.device)
    sc, args, consts = epilogue_args(fmt, margin, power_of_two, state, invert, partials.device)
    _operand_scale_kernel[(1,)](partials, partials.numel(), *args, **consts, BLOCK=_PARTIALS_BLOCK)
    return sc


# The amax + scale kernel's programs: enough to fill an H200 (132 SMs) several times over, few enough
# that the last program reduces their partial maxima in one vector step.
_MAX_PROGRAMS = 1024
_AMAX_BLOCK = 1 << 16 if INTERPRETING else 4096  # the interpreter runs programs as numpy calls: large blocks
_COUNTERS: dict[tuple, torch.Tensor] = {}


def counter(device: torch.device) -> torch.Tensor:
    """The int32 arrival counter of ``_amax_scale_kernel`` for the current stream of ``device``: zeroed
    once, and left at zero by every launch (its last program resets it). One per stream, so that
    kernels running concurrently on two streams never share one."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return _COUNTERS[key]


def amax_and_scale(x: torch.Tensor, fmt: Format, margin: float = 0.0, power_of_two: bool = False,
                   invert: tuple[torch.Tensor, ...] = ()) -> OperandScale:
    """Current scaling of ``x`` per tensor in one launch and one read: ``max |x|``, the scale, its decode
    scale, and ``1 / s`` of each ``invert`` scale (see :func:`operand_scale`; ``recast`` is None)."""
    device = x.device
    check_interpretable(device)
    sc, args, consts = epilogue_args(fmt, margin, power_of_two, None, invert, device)
    flat = x.contiguous().view(-1)
    n = flat.numel()
    programs = max(1, min(triton.cdiv(n, _AMAX_BLOCK), _MAX_PROGRAMS))
    partials = torch.empty(programs, dtype=torch.float32, device=device)
    _amax_scale_kernel[(programs,)](flat, n, partials, counter(device), *args, **consts, BLOCK=_AMAX_BLOCK,
                                    RBLOCK=triton.next_power_of_2(_MAX_PROGRAMS))
    return sc


def _fp32(x: float) -> float:
    """``x`` rounded once to fp32 (as ``torch.full_like(fp32_tensor, x)`` rounds it)."""
    return struct.unpack("f", struct.pack("f", x))[0]


# Columns of the record kernel's offset table: element offsets of each state's tensors from state 0's.
_RECORD_FIELDS = (0, 1, 2, 3, 4, 6, 7)  # history, scale, steps, skipped, overflows, pending, accumulate
_ALGOS = {"max": 0, "most_recent": 1}


@triton.jit
def _record_kernel(amax_ptr, a1_ptr, a2_ptr, a3_ptr, table_ptr, hist0, scale0, steps0, skipped0, over0, pend0, acc0,
                   H, interval, N_DIRECT: tl.constexpr, TARGET: tl.constexpr, FMT_MAX: tl.constexpr, MAX_SCALE_C: tl.constexpr, HUGE: tl.constexpr,
                   OVERFLOW: tl.constexpr, NO_PENDING_C: tl.constexpr, ALGO_MAX: tl.constexpr,
                   POW2: tl.constexpr, NAN_SCALE: tl.constexpr, BH: tl.constexpr):
    """Program ``i`` records ``amax[i]`` into state ``i`` (``record_update``, in place).

    ``a = max(pending, amax)`` (NaN-sticky). With ``accumulate`` set only ``pending = a`` changes.
    Otherwise: a usable ``a`` (``< HUGE``) is pushed to the front of the history, else ``skipped``
    counts it; ``steps += 1``; ``overflows`` counts a usable ``a`` past ``OVERFLOW`` times the range
    of the scale it was cast with (history non-empty before); the scale is recomputed from the
    history's max (or newest entry) every ``interval`` steps and on the first usable amax, never
    while every amax so far was skipped; ``pending`` empties.
    """
    i = tl.program_id(0).to(tl.int64)
    row = table_ptr + i * 7
    h_ptr = hist0 + tl.load(row + 0)
    s_ptr, n_ptr, k_ptr = scale0 + tl.load(row + 1), steps0 + tl.load(row + 2), skipped0 + tl.load(row + 3)
    o_ptr, p_ptr, a_ptr = over0 + tl.load(row + 4), pend0 + tl.load(row + 5), acc0 + tl.load(row + 6)
    pending = tl.load(p_ptr)
    if N_DIRECT == 0:  # the amaxes stacked in one tensor
        a = tl.load(amax_ptr + i)
    else:  # up to four amaxes passed one by one (no stack launch): state i takes the i-th
        a = tl.load(amax_ptr)
        if N_DIRECT > 1:
            a = tl.where(i == 1, tl.load(a1_ptr), a)
        if N_DIRECT > 2:
            a = tl.where(i == 2, tl.load(a2_ptr), a)
        if N_DIRECT > 3:
            a = tl.where(i == 3, tl.load(a3_ptr), a)
    amax = max_propagating_nan(pending, a)
    usable = amax < HUGE
    j = tl.arange(0, BH)
    hist = tl.load(h_ptr + j, mask=j < H, other=0.0)
    prev = tl.load(h_ptr + j - 1, mask=(j >= 1) & (j < H), other=0.0)
    new_hist = tl.where(usable, tl.where(j == 0, amax, prev), hist)
    scale, steps, skipped, over = tl.load(s_ptr), tl.load(n_ptr), tl.load(k_ptr), tl.load(o_ptr)
    had_valid = steps > skipped
    new_steps = steps + 1
    new_skipped = skipped + (~usable).to(skipped.dtype)
    new_over = over + (had_valid & usable & (amax * scale > OVERFLOW * FMT_MAX)).to(over.dtype)
    if ALGO_MAX:
        reduced = tl.max(tl.where(j < H, new_hist, 0.0))
    else:
        reduced = tl.sum(tl.where(j == 0, new_hist, 0.0))
    recomputed = tile_scale(reduced, TARGET, MAX_SCALE_C, POW2, NAN_SCALE)
    update = (((new_steps % interval) == 0) | (usable & ~had_valid)) & (new_steps > new_skipped)
    new_scale = tl.where(update, recomputed, scale)
    if tl.load(a_ptr) == 0:
        tl.store(h_ptr + j, new_hist, mask=j < H)
        tl.store(s_ptr, new_scale)
        tl.store(n_ptr, new_steps)
        tl.store(k_ptr, new_skipped)
        tl.store(o_ptr, new_over)
        tl.store(p_ptr, tl.full([], NO_PENDING_C, tl.float32))
    else:
        tl.store(p_ptr, amax)


_TABLES: dict[tuple, torch.Tensor] = {}
_MAX_TABLES = 256


def _offset_table(states: list[list[torch.Tensor]]) -> torch.Tensor:
    """int64 [N, 7] element offsets of every state's tensors from state 0's, on their device; made
    once per set of tensors (their storage never moves: recording writes in place) and cached."""
    key = tuple(s[f].data_ptr() for s in states for f in _RECORD_FIELDS)
    table = _TABLES.get(key)
    if table is None:
        rows = [[(s[f].data_ptr() - states[0][f].data_ptr()) // s[f].element_size() for f in _RECORD_FIELDS]
                for s in states]
        if len(_TABLES) >= _MAX_TABLES:
            _TABLES.clear()
        # one host-to-device copy per new set of states, never per step
        table = _TABLES[key] = torch.tensor(rows, dtype=torch.int64).to(states[0][0].device)
    return table


def record_states(states: list[list[torch.Tensor]], amax: torch.Tensor | list[torch.Tensor], fmt: Format | str,
                  margin: float, interval: int, algo: str, power_of_two: bool) -> None:
    """Record ``amax[i]`` into ``states[i]`` in place: one launch for all (see ``_record_kernel``).

    Args:
        states: delayed-scaling op lists (``DelayedScalingState.OP_FIELDS``) of single (not per-expert)
            states of one format and one history length, each given once.
        amax: fp32 [N] (or a scalar for one state), the amaxes to record; or a list of up to four fp32
            scalars, one per state, read where they are (no launch to stack them).
        fmt, margin, interval, algo, power_of_two: the recipe.
    """
    fmt = get_format(fmt)
    if not states:
        return
    h = states[0][0].shape[-1]
    if any(s[0].shape != (h,) or s[1].dim() != 0 for s in states):
        raise ValueError("record_states takes single states of one history length (history [H], scalar scale)")
    direct = isinstance(amax, (list, tuple))
    if direct and (len(amax) > 4 or any(a.numel() != 1 or a.dtype != torch.float32 for a in amax)):
        raise ValueError("record_states: a list of amaxes holds at most 4 fp32 scalars (stack more into one tensor)")
    n_amax = len(amax) if direct else amax.numel()
    if n_amax != len(states):
        raise ValueError(f"record_states: {len(states)} states but {n_amax} amaxes")
    if algo not in _ALGOS:
        raise ValueError(f"unknown delayed-scaling algo {algo!r}; expected one of {sorted(_ALGOS)}")
    device = states[0][0].device
    check_interpretable(device)
    first = states[0]
    target = _fp32(fmt.max / (2.0**margin) if margin else fmt.max)
    ptrs = list(amax) + [amax[0]] * (4 - len(amax)) if direct else [amax.reshape(-1)] * 4
    _record_kernel[(len(states),)](
        *ptrs, _offset_table(states), first[0], first[1], first[2], first[3], first[4], first[6],
        first[7].view(torch.uint8), h, int(interval), N_DIRECT=len(amax) if direct else 0, TARGET=target, FMT_MAX=float(fmt.max), MAX_SCALE_C=MAX_SCALE,
        HUGE=HUGE_AMAX, OVERFLOW=OVERFLOW_FACTOR, NO_PENDING_C=NO_PENDING, ALGO_MAX=algo == "max",
        POW2=bool(power_of_two), NAN_SCALE=fmt.nan_code is None, BH=triton.next_power_of_2(max(h, 1)))


@triton.jit
def rounded_to(x, DTYPE: tl.constexpr):
    """fp32 ``x`` rounded to nearest even in ``DTYPE`` (fp32, bf16 or fp16), kept as fp32 (NaN stays NaN).
    bf16 on a GPU and fp16 everywhere: the conversion, which rounds to nearest even (``cvt.rn``; numpy's
    in the interpreter); bf16 in the interpreter, which truncates fp32 -> bf16: on the bits."""
    if DTYPE == tl.bfloat16:
        if INTERPRETED:
            bits = x.to(tl.int32, bitcast=True)
            rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
            x = tl.where(x != x, x, rounded)
        else:
            x = x.to(tl.bfloat16).to(tl.float32)
    elif DTYPE == tl.float16:
        x = x.to(tl.float16).to(tl.float32)
    return x


@triton.jit
def reciprocal_rn(d):
    """``1 / d`` of a power of two ``d`` in ``[2**-126, 2**126]`` (the channel scales' range), exact: its
    exponent field negated (``254 - E``), one integer subtraction instead of an IEEE division."""
    return (0x7F000000 - d.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)


@triton.jit
def divided_in(x, inv_d, DTYPE: tl.constexpr):
    """``x / d`` as torch divides two ``DTYPE`` tensors (fp32 or bf16) for a power of two ``d``, given as
    ``inv_d = reciprocal_rn(d)``: the fp32 quotient, correctly rounded, then rounded once to ``DTYPE``;
    returned as fp32 (``W_down / c`` and ``dB / c``). ``1 / d`` is exact, so ``x * (1 / d)`` is the
    correctly rounded ``x / d`` (subnormal and overflowing quotients too) for one multiply, not an
    IEEE division per element."""
    return rounded_to(x * inv_d, DTYPE)


@triton.jit
def _channel_scales_kernel(part_ptr, rows, F, c_ptr, gu_ptr, n_gu, w_ptr, N, prog_max_ptr, counter_ptr, held_ptr,
                           steps_ptr, skipped_ptr, guard_ptr, amax_out, scale_out, inv_out, recast_out, b_amax_out,
                           b_scale_out, b_inv_out, g_scale_out, u_scale_out, C_MIN: tl.constexpr,
                           C_MAX: tl.constexpr, BR: tl.constexpr, BF: tl.constexpr, SCALES: tl.constexpr = False,
                           WITH_B: tl.constexpr = False, DELAYED: tl.constexpr = False, TARGET: tl.constexpr = 1.0,
                           G_TARGET: tl.constexpr = 1.0, FMT_MAX: tl.constexpr = 1.0,
                           MAX_SCALE_C: tl.constexpr = 1.0, HUGE: tl.constexpr = 1.0, POW2: tl.constexpr = False,
                           NAN_SCALE: tl.constexpr = False, GBLOCK: tl.constexpr = 1024, RBLOCK: tl.constexpr = 1024,
                           WBR: tl.constexpr = 32):
    """``c[f] = 2**-floor(log2 amax_f)`` (clamped; 1 for a zero or non-finite amax) with ``amax_f`` the
    NaN-propagating max over ``rows`` of ``part[:, f]``; ``2**floor(log2 a)`` is ``a`` with its mantissa
    bits cleared (reference: ``swiglu.channel_scales``).

    SCALES (Smooth-SwiGLU's forward, ``part`` the column maxima of ``|h|``, ``h = silu(gate) * up``): also
    the scales of every tensor the forward casts, so that the cast is the next launch. Each program
    stores four partial maxima (``prog_max[k * programs + pid]``): ``|A| = |h| c`` over its columns
    (``max_t fl(|h_tf| c_f) = fl(amax_f c_f)``: multiplying by ``c_f > 0`` is monotone), with WITH_B
    ``|B|``, ``B = W_down / c`` in W_down's dtype (``w`` [N, F], as torch divides), and its share of the
    ``n_gu`` per-tile maxima of ``|gate|`` and ``|up|`` (``gu`` [2, n_gu]). The last program to arrive
    (acquire-release counter, reset by it) reduces them: A's amax and scale (current or delayed:
    :func:`scale_epilogue`), B's (current), and the scales of the saved gate and up copies
    (``scale_from_amax`` with ``G_TARGET = fmt.max``, no margin, no power of two).
    """
    pid = tl.program_id(0).to(tl.int64)
    cols = pid * BF + tl.arange(0, BF)
    acc = tl.zeros([BF], tl.float32)
    for start in range(0, rows, BR):
        r = start + tl.arange(0, BR)
        p = tl.load(part_ptr + r[:, None] * F + cols[None, :], mask=(r[:, None] < rows) & (cols[None, :] < F),
                    other=0.0)
        has_nan = tl.max((p != p).to(tl.int32), axis=0)
        acc = max_propagating_nan(acc, tl.where(has_nan > 0, float("nan"), tl.max(p, axis=0)))
    floor2 = (acc.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    c = tl.minimum(tl.maximum(tl.math.div_rn(tl.full([BF], 1.0, tl.float32), floor2), C_MIN), C_MAX)
    c = tl.where((acc > 0) & (acc < float("inf")), c, 1.0)
    tl.store(c_ptr + cols, c, mask=cols < F)
    if SCALES:
        nprog = tl.num_programs(0)
        a_max = _vector_max(acc * c)  # masked columns: amax 0, c 1
        b_max = tl.full([], 0.0, tl.float32)
        if WITH_B:
            inv_c = reciprocal_rn(c)[None, :]
            b_acc = tl.zeros([WBR, BF], tl.float32)
            for start in range(0, N, WBR):  # WBR rows of W_down a step: bytes in flight on few programs
                r = start + tl.arange(0, WBR)
                w = tl.load(w_ptr + r[:, None] * F + cols[None, :], mask=(r[:, None] < N) & (cols[None, :] < F),
                            other=0.0).to(tl.float32)
                b_acc = max_propagating_nan(b_acc, tl.abs(divided_in(w, inv_c, w_ptr.dtype.element_ty)))
            b_max = abs_max_2d(b_acc)
        g_acc = tl.zeros([GBLOCK], tl.float32)
        u_acc = tl.zeros([GBLOCK], tl.float32)
        for start in range(pid * GBLOCK, n_gu, nprog.to(tl.int64) * GBLOCK):
            offs = start + tl.arange(0, GBLOCK)
            g_acc = max_propagating_nan(g_acc, tl.load(gu_ptr + offs, mask=offs < n_gu, other=0.0))
            u_acc = max_propagating_nan(u_acc, tl.load(gu_ptr + n_gu + offs, mask=offs < n_gu, other=0.0))
        tl.store(prog_max_ptr + pid, a_max)
        tl.store(prog_max_ptr + nprog + pid, b_max)
        tl.store(prog_max_ptr + 2 * nprog + pid, _vector_max(g_acc))
        tl.store(prog_max_ptr + 3 * nprog + pid, _vector_max(u_acc))
        tl.debug_barrier()  # the partials (stored by any thread) complete before this program's release
        if tl.atomic_add(counter_ptr, 1, sem="acq_rel") == nprog - 1:
            tl.debug_barrier()  # every thread of the last program reads the partials after its acquire
            amax = max_of_uncached(prog_max_ptr, nprog, RBLOCK)
            scale_epilogue(amax, held_ptr, steps_ptr, skipped_ptr, guard_ptr, scale_out, scale_out, amax_out,
                           scale_out, inv_out, recast_out, scale_out, scale_out, 0, DELAYED, TARGET, FMT_MAX,
                           MAX_SCALE_C, HUGE, POW2, NAN_SCALE)
            if WITH_B:
                scale_epilogue(max_of_uncached(prog_max_ptr + nprog, nprog, RBLOCK), b_scale_out, b_scale_out,
                               b_scale_out, b_scale_out, b_scale_out, b_scale_out, b_amax_out, b_scale_out, b_inv_out,
                               b_scale_out, b_scale_out, b_scale_out, 0, False, TARGET, FMT_MAX, MAX_SCALE_C, HUGE,
                               POW2, NAN_SCALE)
            g_amax = max_of_uncached(prog_max_ptr + 2 * nprog, nprog, RBLOCK)
            u_amax = max_of_uncached(prog_max_ptr + 3 * nprog, nprog, RBLOCK)
            tl.store(g_scale_out, tile_scale(g_amax, G_TARGET, MAX_SCALE_C, False, NAN_SCALE))
            tl.store(u_scale_out, tile_scale(u_amax, G_TARGET, MAX_SCALE_C, False, NAN_SCALE))
            tl.store(counter_ptr, 0)


@triton.jit
def _vector_max(x):
    """NaN-propagating max of a 1-D block."""
    has_nan = tl.max((x != x).to(tl.int32))
    return tl.where(has_nan > 0, float("nan"), tl.max(x))


def channel_scales(partials: torch.Tensor, c_min: float, c_max: float) -> torch.Tensor:
    """fp32 [F] Smooth-SwiGLU channel scales from per-tile column maxima ``partials`` [tiles, F], one launch."""
    rows, f = partials.shape
    check_interpretable(partials.device)
    c = torch.empty(f, dtype=torch.float32, device=partials.device)
    if f:
        _channel_scales_kernel[(triton.cdiv(f, _CHANNEL_BLOCK),)](
            partials, rows, f, c, *([c, 0, c, 0, c, c] + [c] * 13), C_MIN=c_min, C_MAX=c_max, BR=16, BF=_CHANNEL_BLOCK)
    return c


_CHANNEL_BLOCK = 128


@dataclass
class SmoothScales:
    """What :func:`smooth_scales` computed (tensors on the device, no host read): the channel scales
    ``c`` [F]; ``a``: A's :class:`OperandScale`; ``b``: B's (``W_down / c``), or None; ``gate_scale``,
    ``up_scale``: fp32 scalar scales of the saved gate and up copies."""

    c: torch.Tensor
    a: OperandScale
    b: OperandScale | None
    gate_scale: torch.Tensor
    up_scale: torch.Tensor


def smooth_scales(partials: torch.Tensor, input_maxima: torch.Tensor, w_down: torch.Tensor | None, fmt: Format,
                  margin: float, power_of_two: bool, state: list[torch.Tensor] | None, c_min: float,
                  c_max: float) -> SmoothScales:
    """Smooth-SwiGLU's channel scales and the scales of every tensor its forward casts, one launch.

    Args:
        partials: fp32 [token tiles, F], per-tile column maxima of ``|silu(gate) * up|``
            (``triton_operand_casts.swiglu_colamax``).
        input_maxima: fp32 [2, n], per-tile maxima of ``|gate|`` and ``|up|`` (the same pass).
        w_down: [N, F] fp32 or bf16, whose ``W_down / c`` (B) gets its amax and scale here too; None: not.
        fmt, margin, power_of_two: A's and B's format and scale options; the gate and up copies take
            ``fmt`` with plain current scaling (``swiglu.saved_glu_input``).
        state: A's delayed-scaling op list, or None (current scaling).
        c_min, c_max: the clamp of ``c``.
    """
    rows, f = partials.shape
    device = partials.device
    check_interpretable(device)
    if f == 0 or input_maxima.shape[1] == 0:
        raise ValueError("smooth_scales needs a non-empty [tokens, F] SwiGLU input")
    if w_down is not None and (w_down.dtype not in (torch.float32, torch.bfloat16) or w_down.shape[1] != f):
        raise ValueError(f"smooth_scales: w_down must be fp32 or bf16 [N, {f}], got {w_down.dtype} "
                         f"{tuple(w_down.shape)}")
    c = torch.empty(f, dtype=torch.float32, device=device)
    a, args, consts = epilogue_args(fmt, margin, power_of_two, state or None, (), device)
    held, steps, skipped, guard, _, _, amax_out, scale_out, inv_out, recast_out, _, _ = args
    b = None
    if w_down is not None:
        b = OperandScale(*(torch.empty((), dtype=torch.float32, device=device) for _ in range(3)), None, ())
    g_scale, u_scale = (torch.empty((), dtype=torch.float32, device=device) for _ in range(2))
    programs = triton.cdiv(f, _CHANNEL_BLOCK)
    prog_max = torch.empty(4 * programs, dtype=torch.float32, device=device)
    w = w_down.contiguous() if w_down is not None else c
    bo = b if b is not None else a
    _channel_scales_kernel[(programs,)](
        partials, rows, f, c, input_maxima.contiguous(), input_maxima.shape[1], w, 0 if w_down is None else w.shape[0],
        prog_max, counter(device), held, steps, skipped, guard, amax_out, scale_out, inv_out, recast_out, bo.amax,
        bo.scale, bo.inv_scale, g_scale, u_scale, C_MIN=c_min, C_MAX=c_max, BR=16, BF=_CHANNEL_BLOCK, SCALES=True,
        WBR=32, num_warps=8,  # 8 KB of W_down in flight per step, no spills (triton 3.6 spills at 64 rows)
        WITH_B=w_down is not None, G_TARGET=float(fmt.max), GBLOCK=_PARTIALS_BLOCK,
        RBLOCK=triton.next_power_of_2(min(programs, 1024)),
        **{k: consts[k] for k in ("DELAYED", "TARGET", "FMT_MAX", "MAX_SCALE_C", "HUGE", "POW2", "NAN_SCALE")})
    return SmoothScales(c, a, b, g_scale, u_scale)
