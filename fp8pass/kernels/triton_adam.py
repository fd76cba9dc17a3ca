"""Fused multi-tensor Triton kernel of the FP8 Adam step: dequantize -> update -> requantize, one pass.

One launch updates many parameters (``adam_step_triton_multi``; ``adam_step_triton`` is the one-tensor
case). A table on the device, built once per set of tensors and cached, holds per tensor the element
offsets of its parameter, gradient, moments and block scales from the launch's base tensors, its
hyper-parameter row (when they come from the device: ``capturable``; else they are the launch's fp32
arguments), its size, its first scale block, its first Philox counter and, for each blocks-per-program
config NB, its first tile. Each program takes a tile of ``NB`` consecutive scale blocks of one tensor:
the tensor (a binary search over the first tiles), its offsets, the tile's place and the
hyper-parameters are found once per program, on scalars; element indices are int32 from the tile's
start, and the only per-row values are the scales. It reads the parameter, the gradient, both moments'
codes and block scales, applies exactly the update of ``torch_step`` (same fp32 ops in the same order,
IEEE ``sqrt_rn`` / ``div_rn``, FMA contraction off; the division of the codes by their row's scale is
``_div_by_row``, bit-identical to IEEE division), takes the new block amaxes over the finite values, and
writes the parameter, the codes and the scales. A block of up to ``ONE_PASS_MAX`` elements is one
program's tile, however wide (blocks above ``MAX_SPAN``: one block per program on ``span / 1024`` warps,
32 lanes per thread), read once; a wider one is walked in spans of ``MAX_SPAN`` twice: once for its
amaxes, once to write (the same ops, so the same values). Per element that
is 2 bytes of moments read and written instead of torch AdamW's 16, and no fp32 moment ever reaches
memory. Blocks wider than ``adam.TRITON_MAX_BLOCK`` (one scale for a large tensor) would be one serial
program each: the optimizer gives them to ``triton_adam_split``, whose kernels run their spans in parallel
with this module's jit helpers.

On GPUs with FP8 conversions (sm_89+: ``triton_helpers.hardware_cast``) the codes are decoded by the
hardware (E4M3/E5M2 -> fp16 -> fp32, exact) and encoded by it (``triton_helpers.cast_codes``: the
reference's saturating RNE, NaN sign included; stochastic rounding, ``_sr16_codes``, moves the value
onto the grid with integer operations first, then converts). Elsewhere both are integer operations (the
algorithm of ``fp8pass.numerics.casts.encode``): Triton's fp32 -> fp8 conversion is wrong in the
interpreter (docs/background.md, Traps).
``torch_step.adam_step_torch`` is the reference: the tests compare the two bit for bit (under
``TRITON_INTERPRET=1`` on CPU, on CUDA in tests/gpu). Stochastic rounding draws one seed per launch on
the device (no host synchronisation) and one 32-bit Philox output per element, shared by the moments:
element j of a tensor takes output j % 4 of Philox at counter (its tensor's first counter + j) // 4
(``_span_bits``: one call per four elements), m rounds with its high 16 bits and v with its low 16
(``_sr16_codes``: casts.encode's stochastic rounding with the 16 bits at the top of the dropped bits, so
the probability of rounding up is exact to 2**-16 of a code step). The torch path draws its own bits
(torch's generator, full resolution): the two are not bit-identical under stochastic rounding.

Autotuning (``triton.autotune`` over blocks per program and warps, keyed on the launch's size class, the
block size, the formats and the dtypes) never benchmarks live tensors: the kernel updates in place, so
the first launch of a key tunes on scratch tensors of the same dtypes (at most 2**24 elements) and only
then runs on the real ones; a tuning attempt on live tensors raises. Under the interpreter there is one
fixed config and no tuning.
"""

from __future__ import annotations

import collections
import functools

import torch
import triton
import triton.language as tl

from ..numerics.scaling import MAX_SCALE
from .adam_layout import HP_FIELDS, MomentSpec, WeightSeed, init_moment
from .triton_helpers import (  # the exact in-kernel casts and the shared helpers
    INTERPRETED,
    INTERPRETING,
    autotune,
    cast_codes,
    check_interpretable,
    decode_codes,
    hardware_cast,
    on_grid_codes,
    philox4,
    philox_at,
    random_seed,
    size_class,
    stochastic_round_bf16,
)

__all__ = ["adam_step_triton", "adam_step_triton_multi", "MAX_SPAN", "ONE_PASS_MAX"]

_KIND = {"e4m3": 0, "e5m2": 0, "bf16": 1, "fp32": 2}
# Lanes of one pass over a block: wider blocks are walked in spans of this many elements (8 per thread
# with 4 warps: the update's live values of a thread then fit its registers).
MAX_SPAN = 1024
# Blocks up to this width are one program's single pass (the optimizer's widest: adam.TRITON_MAX_BLOCK).
# Walking a wide block in spans computes the update twice (once for the amaxes); one pass holds the whole
# block in registers instead (32 lanes per thread at 8192 on 8 warps: ~206-233 registers on sm_90, no
# spills; 16 lanes per thread on 16 warps would cap them at 128 and spill).
ONE_PASS_MAX = 8192
# Blocks per program of the configs (each has its table column of first tiles: a program's tile never
# straddles two tensors, so everything but the elements themselves is known once per program).
_NBS = (1, 2, 4, 8, 16, 32)
# Columns of the launch table (int64, one row per tensor). "key": the Philox counter of the tensor's
# first element (a multiple of 4); "wseed": the offset of its bf16 weight seed from the launch's first
# (bf16_stochastic_round), "wkey": the weight-hash counter of its first element (WeightSeed.counter);
# "tileN": the launch's first tile of NB=N blocks in this tensor.
_COLS = ("p", "g", "m", "m_scale", "v", "v_scale", "hp", "numel", "first_block", "key", "wseed", "wkey")
_WSEED_COL = tl.constexpr(_COLS.index("wseed"))
_WKEY_COL = tl.constexpr(_COLS.index("wkey"))
_TILE_COLS = tuple(f"tile{nb}" for nb in _NBS)
_W = len(_COLS) + len(_TILE_COLS)
# The kernels' fp32 hyper-parameter arguments, in the order of torch_step.HP_FIELDS.
_HP_ARGS = tuple(f"{name}_arg" for name in ("b1", "omb1", "b2", "omb2", "inv_bc2s", "eps", "step_size", "decay",
                                             "l2"))
_TUNING_SCRATCH = 2**24


@triton.jit
def _store_float(ptr, x, mask):
    """Store fp32 ``x`` in ``ptr``'s dtype; bf16 is rounded to nearest-even with integer ops (the
    interpreter's fp32 -> bf16 conversion is not RNE); NaN becomes 0x7FC0, as in torch."""
    if ptr.dtype.element_ty == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
        rounded = tl.where(x != x, 0x7FC0, rounded)
        tl.store(ptr.to(tl.pointer_type(tl.int16)), rounded.to(tl.int16), mask=mask)
    else:
        tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _div_by_row(a, s, inv_s):
    """``a / s`` correctly rounded (``div_rn``) for the decoded codes ``a`` of a row and its scale ``s``,
    from the row's ``inv_s = div_rn(1, s)``: q = a * inv_s is within an ulp, the residual a - q*s is
    exact (one FMA) and q + residual * inv_s rounds to the quotient (Markstein's correction; no IEEE
    division per element). Where the residual is 0 (exact quotients, +-0) or not finite (a Inf/NaN,
    or a*inv_s overflowing: the quotient is then Inf too) q is the result. Checked against IEEE division
    for every E4M3 and E5M2 code and 866k scales over the whole fp32 range (tests/optim/test_optim_triton.py
    repeats it on fewer scales through this function)."""
    q = a * inv_s
    r = tl.fma(-q, s, a)
    return tl.where((r != 0) & (tl.abs(r) < float("inf")), tl.fma(r, inv_s, q), q)


@triton.jit
def _load_moment(ptr, scale, inv_scale, e, mask, KIND: tl.constexpr, SQRT: tl.constexpr, MBITS: tl.constexpr,
                 BIAS: tl.constexpr, IEEE_SPECIALS: tl.constexpr, HW: tl.constexpr):
    """fp32 moment values at ``ptr + e`` ([NB, SPAN]); FP8 codes are divided by their row's ``scale`` [NB]
    (``inv_scale`` = its correctly rounded reciprocal, for ``_div_by_row``)."""
    if KIND == 0:
        c = tl.load(ptr + e, mask=mask, other=0).to(tl.int32)
        x = _div_by_row(decode_codes(c, MBITS, BIAS, IEEE_SPECIALS, HW), scale[:, None], inv_scale[:, None])
        if SQRT:
            x = x * x
    else:
        x = tl.load(ptr + e, mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def _block_scale(amax, FMAX: tl.constexpr, SCALE_CAP: tl.constexpr):
    """numerics.scale_from_amax per block: FMAX / amax capped, 1 for an all-zero block."""
    scale = tl.minimum(tl.math.div_rn(FMAX + amax * 0.0, amax), SCALE_CAP)
    return tl.where(amax > 0, scale, 1.0)


@triton.jit
def _finite_amax(x):
    """Per-row max |x| over the finite values (moments.finite_block_amax). Masked-off lanes need no mask:
    they update zeros (loads' ``other``), so their moments are 0, or non-finite for non-finite
    hyper-parameters, and leave the max as it is."""
    a = tl.abs(x)
    return tl.max(tl.where(a < float("inf"), a, 0.0), axis=1)


@triton.jit
def _sr16_codes(y, r16, MBITS: tl.constexpr, BIAS: tl.constexpr, MAX_CODE: tl.constexpr, NAN_CODE: tl.constexpr,
                HW: tl.constexpr):
    """Stochastic codes of fp32 ``y`` from 16 random bits ``r16`` (int32, 0..65535): exactly
    ``encode(y, rbits, STOCHASTIC)`` (casts.encode) with ``rbits = r16 << (s - 16)``, the 16 bits at the
    top of the s bits the format drops at y's exponent (s = min(shift, 30)): the round-up probability
    is resolved to 2**-16 of a code step. That placement makes the rounding a fixed-point sum in units
    of the step: |y| >= 2**emin (FP8 normal range, Inf): add ``r16`` under the kept bits and truncate
    on the fp32 bits (s = 23 - MBITS), then an exact conversion; |y| below it (subnormal codes, and
    values under the smallest one): the code is ``(floor(|y| * 2**16 / q) + r16) >> 16`` (q the smallest
    subnormal; the product is exact). NaN gives NAN_CODE; the sign is y's. HW = 1: the hardware
    conversion (sm_89+), else ``encode`` (exact for the on-grid value)."""
    bits = y.to(tl.int32, bitcast=True)
    t = ((bits + (r16 << (7 - MBITS))) & (-1 << (23 - MBITS))).to(tl.float32, bitcast=True)
    c = on_grid_codes(t, MBITS, BIAS, MAX_CODE, NAN_CODE, 7, HW)
    # |y| / q * 2**16 (exact, < 2**(16 + MBITS) where used); NaN -> NAN_CODE * 2**16, so that n = NAN_CODE
    # (the GPU's min returns the operand that is not NaN; the interpreter's propagates it)
    steps = tl.minimum(tl.abs(y * (2.0 ** (16 + MBITS + BIAS - 1))), NAN_CODE * 65536.0)
    if INTERPRETED:
        steps = tl.where(y != y, NAN_CODE * 65536.0, steps)
    n = (steps.to(tl.int32) + r16) >> 16
    c = tl.where(tl.abs(y) >= 2.0 ** (1 - BIAS), c, n)  # NaN takes n
    return c | ((bits >> 24) & 0x80)


@triton.jit
def _store_moment(x, ptr, e, mask, scale, r16, KIND: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr,
                  MAX_CODE: tl.constexpr, NAN_CODE: tl.constexpr, MIN_SUB: tl.constexpr,
                  STOCHASTIC: tl.constexpr, SFLUSH: tl.constexpr, HW: tl.constexpr):
    if KIND == 0:
        y = x * scale[:, None]
        if STOCHASTIC:
            code = _sr16_codes(y, r16, MBITS, BIAS, MAX_CODE, NAN_CODE, HW)
        else:
            code = cast_codes(y, 0, MBITS, BIAS, MAX_CODE, NAN_CODE, 7, False, HW)
            if SFLUSH:
                sr = _sr16_codes(y, r16, MBITS, BIAS, MAX_CODE, NAN_CODE, HW)
                code = tl.where(tl.abs(y) < MIN_SUB, sr, code)
        tl.store(ptr + e, code.to(tl.uint8), mask=mask)
    else:
        _store_float(ptr + e, x, mask)


@triton.jit
def _span_update(p_ptr, g_ptr, m_ptr, m_scale, m_inv, v_ptr, v_scale, v_inv, e, mask, b1, omb1, b2, omb2, inv_bc2s, eps,
                 step_size, decay, l2,
                 M_KIND: tl.constexpr, M_MBITS: tl.constexpr, M_BIAS: tl.constexpr, M_IEEE: tl.constexpr,
                 V_KIND: tl.constexpr, V_MBITS: tl.constexpr, V_BIAS: tl.constexpr, V_IEEE: tl.constexpr,
                 V_SQRT: tl.constexpr, MAXIMIZE: tl.constexpr, COUPLED_WD: tl.constexpr, M_HW: tl.constexpr,
                 V_HW: tl.constexpr):
    """The Adam(W) update of one [NB, SPAN] span (math: torch_step module doc): new p, m and v as
    stored (sqrt(v) for a sqrt-storing v). ``m_scale`` / ``v_scale``: the rows' old scales [NB];
    ``m_inv`` / ``v_inv``: their reciprocals (``_div_by_row``)."""
    p = tl.load(p_ptr + e, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + e, mask=mask, other=0.0).to(tl.float32)
    if MAXIMIZE:
        g = -g
    if COUPLED_WD:
        g = g + p * l2
    m = _load_moment(m_ptr, m_scale, m_inv, e, mask, M_KIND, False, M_MBITS, M_BIAS, M_IEEE, M_HW)
    v = _load_moment(v_ptr, v_scale, v_inv, e, mask, V_KIND, V_SQRT, V_MBITS, V_BIAS, V_IEEE, V_HW)
    m = m * b1 + g * omb1
    v = v * b2 + (g * g) * omb2
    r = tl.math.sqrt_rn(v)
    p = p * decay
    p = p - tl.math.div_rn(m, r * inv_bc2s + eps) * step_size
    if V_SQRT:
        v = r
    return p, m, v


@triton.jit
def _span_bits(seed, key, e, RAND4: tl.constexpr, NB: tl.constexpr, SPAN: tl.constexpr):
    """The 32 random bits of each element of a span (int32 [NB, SPAN]): Philox under ``seed``, element
    index ``e`` taking output (key + e) % 4 of the call at counter (key + e) // 4 (``key``: the launch
    counter of the tile's e = 0). RAND4: ``key`` and each quad's first ``e`` are multiples of 4, so one
    call serves four lanes; its counters come from ``e`` itself (reshaped and split), which keeps the
    calls in the lanes' own layout; otherwise one call per lane (``philox_at``)."""
    if RAND4:
        first, _ = tl.split(tl.split(tl.reshape(e, [NB, SPAN // 4, 2, 2]))[0])  # e of each quad's lane 0
        r0, r1, r2, r3 = philox4(seed, key // 4 + (first >> 2))
        bits = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), [NB, SPAN]).to(tl.int32, bitcast=True)
    else:
        bits = philox_at(seed, key + e)
    return bits


@triton.jit
def _write_span(p, m, v, p_ptr, m_ptr, v_ptr, e, mask, m_scale, v_scale, seed, key, wseed, wkey,
                M_KIND: tl.constexpr, M_MBITS: tl.constexpr, M_BIAS: tl.constexpr, M_MAX_CODE: tl.constexpr,
                M_NAN_CODE: tl.constexpr, M_MIN_SUB: tl.constexpr,
                V_KIND: tl.constexpr, V_MBITS: tl.constexpr, V_BIAS: tl.constexpr, V_MAX_CODE: tl.constexpr,
                V_NAN_CODE: tl.constexpr, V_MIN_SUB: tl.constexpr, STOCHASTIC: tl.constexpr, SFLUSH: tl.constexpr,
                M_HW: tl.constexpr, V_HW: tl.constexpr, RAND4: tl.constexpr, NB: tl.constexpr,
                SPAN: tl.constexpr, BF16_SR: tl.constexpr):
    """Store a span's new parameter and moments (codes with the given per-row scales). Random bits: one
    32-bit draw per element (``_span_bits``), its high 16 bits for m, its low 16 for v (``_sr16_codes``).
    BF16_SR: the bf16 parameter is rounded stochastically (``triton_helpers.stochastic_round_bf16``),
    element ``e`` with the hash of counter ``wkey + e`` under ``wseed`` (the torch path's bits)."""
    if not BF16_SR:
        _store_float(p_ptr + e, p, mask)
    r_m = 0
    r_v = 0
    if STOCHASTIC or SFLUSH:
        bits = _span_bits(seed, key, e, RAND4, NB, SPAN)
        r_m = (bits.to(tl.uint32, bitcast=True) >> 16).to(tl.int32)
        r_v = bits & 0xFFFF
    _store_moment(m, m_ptr, e, mask, m_scale, r_m, M_KIND, M_MBITS, M_BIAS, M_MAX_CODE, M_NAN_CODE, M_MIN_SUB,
                  STOCHASTIC, SFLUSH, M_HW)
    _store_moment(v, v_ptr, e, mask, v_scale, r_v, V_KIND, V_MBITS, V_BIAS, V_MAX_CODE, V_NAN_CODE, V_MIN_SUB,
                  STOCHASTIC, SFLUSH, V_HW)
    if BF16_SR:  # last: the hash's temporaries are not live beside the moments' (sm_90 spilled otherwise)
        tl.store((p_ptr + e).to(tl.pointer_type(tl.int16)), stochastic_round_bf16(p, wseed, wkey + e), mask=mask)


@triton.jit
def _program_tensor(table_ptr, pid, n_tensors, COL: tl.constexpr, W: tl.constexpr, SEARCH_STEPS: tl.constexpr):
    """Table row of the tensor that program ``pid`` works on: the last t with table[t, COL] <= pid
    (a binary search on scalars: once per program)."""
    lo = pid * 0
    hi = lo + n_tensors
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        right = tl.load(table_ptr + mid * W + COL) <= pid
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    return table_ptr + lo * W


@triton.jit
def _tensor_offsets(t, ALIGNED: tl.constexpr):
    """Element offsets of a tensor's parameter, gradient and moments (table columns 0, 1, 2, 4), and its size."""
    p_off = tl.load(t + 0)
    g_off = tl.load(t + 1)
    m_off = tl.load(t + 2)
    v_off = tl.load(t + 4)
    numel = tl.load(t + 7)
    if ALIGNED:  # every tensor starts 16 elements apart from its base and has a multiple of 16 elements
        p_off = tl.multiple_of(p_off, 16)
        g_off = tl.multiple_of(g_off, 16)
        m_off = tl.multiple_of(m_off, 16)
        v_off = tl.multiple_of(v_off, 16)
        numel = tl.multiple_of(numel, 16)
    return p_off, g_off, m_off, v_off, numel


@triton.jit
def _hyper_params(hp_ptr, t, host, HP_TABLE: tl.constexpr):
    """The fp32 scalars of ``torch_step.HP_FIELDS``: the launch's fp32 arguments ``host`` (a tuple), or
    with ``HP_TABLE`` the row of table row ``t``'s tensor in the device tensor ``hp_ptr`` (scalar loads)."""
    if HP_TABLE:
        hp = hp_ptr + tl.load(t + 6)
        out = (tl.load(hp + 0), tl.load(hp + 1), tl.load(hp + 2), tl.load(hp + 3), tl.load(hp + 4), tl.load(hp + 5),
               tl.load(hp + 6), tl.load(hp + 7), tl.load(hp + 8))
    else:
        out = host
    return out


@triton.jit
def _weight_seed(wseed_ptr, t, start, BF16_SR: tl.constexpr):
    """(seed, hash counter of element ``start``) of table row ``t``'s bf16 weight (``BF16_SR``), as
    int32 (the counters wrap mod 2**32, as the torch path's int32 ones do); (0, 0) otherwise."""
    wseed = 0
    wkey = 0
    if BF16_SR:
        wseed = tl.load(wseed_ptr + tl.load(t + _WSEED_COL))
        wkey = (tl.load(t + _WKEY_COL) + start).to(tl.int32)
    return wseed, wkey


# 8 blocks of 128 (the default width) on 2 warps: 16 elements per thread, as at NB 16 and 32, which
# spreads each program's fixed work (table search, row scales, amax trees, division slow paths) over
# twice the elements of 4 warps (SASS per element on sm_90: docs/optim.md)
_TILE_SHAPES = ((1, 4), (2, 4), (4, 4), (8, 2), (16, 4), (32, 8))  # (NB, warps) for blocks up to MAX_SPAN
# one block of 2048 / 4096 / 8192 lanes per program (with (1, 4)): 32 lanes per thread, as few per-program
# costs per element as registers allow
_WIDE_SHAPES = ((1, 2), (1, 8))
_ADAM_CONFIGS = [triton.Config({"NB": nb, "TILE_COL": len(_COLS) + _NBS.index(nb)}, num_warps=w)
                 for nb, w in _TILE_SHAPES + _WIDE_SHAPES]
_ADAM_INTERPRET = triton.Config({"NB": 8, "TILE_COL": len(_COLS) + _NBS.index(8)}, num_warps=4)


def _prune_adam_configs(configs, named_args, **kwargs):
    """Tiles of 1024-4096 elements per program: three configs for the default 128-element blocks, so a
    first step compiles few variants; a block of 2048-8192 lanes: one per program, 32 lanes per thread;
    blocks walked in spans (two passes, more live values) take one or two spans per program on 4 warps
    (four spill on sm_90 with stochastic rounding)."""
    span, nbs = kwargs["SPAN"], [c.kwargs["NB"] for c in configs]
    shape = [(c.kwargs["NB"], c.num_warps) for c in configs]
    if kwargs["BLOCK"] > span:
        kept = [c for c, (nb, w) in zip(configs, shape) if nb <= 2 and w == 4]
    elif span > 1024:
        kept = [c for c, (nb, w) in zip(configs, shape) if nb == 1 and w == span // 1024]
    else:
        kept = [c for c, (nb, w) in zip(configs, shape) if (nb, w) in _TILE_SHAPES
                and (1024 <= nb * span <= 4096 or (span >= 1024 and nb == 1))]
    return kept or [configs[nbs.index(min(nbs))]]


_TUNING = [False]  # True while the kernel is tuned on scratch tensors


def _refuse_live_tuning(nargs, reset_only=False):
    """Autotuning runs the kernel several times: on live tensors that would apply the update twice."""
    if not _TUNING[0]:
        raise RuntimeError("fp8pass.optim: the in-place Adam kernel was about to be autotuned on live tensors; "
                           "this is a bug in fp8pass (tuning happens on scratch tensors first), please report it")


@autotune(_ADAM_CONFIGS, interpret=_ADAM_INTERPRET,
          key=["rows_class", "BLOCK", "M_KIND", "V_KIND", "V_SQRT", "STOCHASTIC", "SFLUSH", "BF16_SR"],
          prune_configs_by={"early_config_prune": _prune_adam_configs}, pre_hook=_refuse_live_tuning)
@triton.jit
def _adam_kernel(p_ptr, g_ptr, m_ptr, ms_ptr, v_ptr, vs_ptr, hp_ptr, seed_ptr, wseed_ptr, table_ptr, n_tensors,
                 rows_class,
                 b1_arg, omb1_arg, b2_arg, omb2_arg, inv_bc2s_arg, eps_arg, step_size_arg, decay_arg, l2_arg,
                 M_KIND: tl.constexpr, M_MBITS: tl.constexpr, M_BIAS: tl.constexpr, M_MAX_CODE: tl.constexpr,
                 M_NAN_CODE: tl.constexpr, M_FMAX: tl.constexpr, M_MIN_SUB: tl.constexpr, M_IEEE: tl.constexpr,
                 M_HW: tl.constexpr,
                 V_KIND: tl.constexpr, V_MBITS: tl.constexpr, V_BIAS: tl.constexpr, V_MAX_CODE: tl.constexpr,
                 V_NAN_CODE: tl.constexpr, V_FMAX: tl.constexpr, V_MIN_SUB: tl.constexpr, V_IEEE: tl.constexpr,
                 V_HW: tl.constexpr,
                 V_SQRT: tl.constexpr, MAXIMIZE: tl.constexpr, COUPLED_WD: tl.constexpr,
                 STOCHASTIC: tl.constexpr, SFLUSH: tl.constexpr, SCALE_CAP: tl.constexpr,
                 HP_TABLE: tl.constexpr, BLOCK: tl.constexpr, SPAN: tl.constexpr, SEARCH_STEPS: tl.constexpr,
                 ALIGNED: tl.constexpr, W: tl.constexpr, BF16_SR: tl.constexpr, NB: tl.constexpr,
                 TILE_COL: tl.constexpr):
    """Adam(W) on a tile of NB consecutive scale blocks ("rows") of one of the launch's tensors (see the
    module doc). Everything but the elements is computed once per program, on scalars: the tensor (a
    binary search over the table's first tiles for this NB), its offsets, the tile's place in it and the
    hyper-parameters; per row only the scales; element indices are int32 from the tile's start."""
    pid = tl.program_id(0).to(tl.int64)  # compared with and offset by the table's int64 entries
    t = _program_tensor(table_ptr, pid, n_tensors, TILE_COL, W, SEARCH_STEPS)
    p_off, g_off, m_off, v_off, numel = _tensor_offsets(t, ALIGNED)
    blk0 = (pid - tl.load(t + TILE_COL)) * NB  # the tile's first block in its tensor (int64)
    start = blk0 * BLOCK
    left = tl.minimum(numel - start, NB * BLOCK).to(tl.int32)  # the tile's elements
    if ALIGNED:
        left = tl.multiple_of(left, 16)
    rows = tl.arange(0, NB)
    row_ok = rows * BLOCK < left
    ms = ms_ptr + tl.load(t + 3) + blk0 + rows
    vs = vs_ptr + tl.load(t + 5) + blk0 + rows
    b1, omb1, b2, omb2, inv_bc2s, eps, step_size, decay, l2 = _hyper_params(
        hp_ptr, t, (b1_arg, omb1_arg, b2_arg, omb2_arg, inv_bc2s_arg, eps_arg, step_size_arg, decay_arg, l2_arg),
        HP_TABLE)
    seed = 0
    key = 0
    if STOCHASTIC or SFLUSH:
        seed = tl.load(seed_ptr)
        key = tl.load(t + 9) + start  # Philox counter of the tile's first element (element e: key + e)
    wseed, wkey = _weight_seed(wseed_ptr, t, start, BF16_SR)
    p_t, g_t = p_ptr + p_off + start, g_ptr + g_off + start
    m_t, v_t = m_ptr + m_off + start, v_ptr + v_off + start
    lane = tl.arange(0, SPAN)
    rand4: tl.constexpr = BLOCK % 4 == 0  # quads of Philox counters never straddle two blocks

    m_old = tl.load(ms, mask=row_ok, other=1.0) if M_KIND == 0 else tl.zeros([NB], dtype=tl.float32) + 1.0
    v_old = tl.load(vs, mask=row_ok, other=1.0) if V_KIND == 0 else tl.zeros([NB], dtype=tl.float32) + 1.0
    m_inv = tl.math.div_rn(1.0 + m_old * 0.0, m_old)
    v_inv = tl.math.div_rn(1.0 + v_old * 0.0, v_old)
    m_scale = tl.zeros([NB], dtype=tl.float32) + 1.0
    v_scale = tl.zeros([NB], dtype=tl.float32) + 1.0
    if BLOCK > SPAN:  # pass 1 over a wide block: its amaxes only
        m_amax = tl.zeros([NB], dtype=tl.float32)
        v_amax = tl.zeros([NB], dtype=tl.float32)
        for s0 in range(0, BLOCK, SPAN):
            e = rows[:, None] * BLOCK + (s0 + lane)[None, :]
            mask = ((s0 + lane) < BLOCK)[None, :] & (e < left)
            p, m, v = _span_update(p_t, g_t, m_t, m_old, m_inv, v_t, v_old, v_inv, e, mask, b1, omb1, b2, omb2,
                                   inv_bc2s, eps, step_size, decay, l2, M_KIND, M_MBITS, M_BIAS, M_IEEE, V_KIND,
                                   V_MBITS, V_BIAS, V_IEEE, V_SQRT, MAXIMIZE, COUPLED_WD, M_HW, V_HW)
            m_amax = tl.maximum(m_amax, _finite_amax(m))
            v_amax = tl.maximum(v_amax, _finite_amax(v))
        m_scale = _block_scale(m_amax, M_FMAX, SCALE_CAP)
        v_scale = _block_scale(v_amax, V_FMAX, SCALE_CAP)

    for s0 in range(0, BLOCK, SPAN):  # the update, written (one span when the block fits a tile)
        e = rows[:, None] * BLOCK + (s0 + lane)[None, :]
        mask = ((s0 + lane) < BLOCK)[None, :] & (e < left)
        p, m, v = _span_update(p_t, g_t, m_t, m_old, m_inv, v_t, v_old, v_inv, e, mask, b1, omb1, b2, omb2, inv_bc2s,
                               eps, step_size, decay, l2, M_KIND, M_MBITS, M_BIAS, M_IEEE, V_KIND, V_MBITS, V_BIAS,
                               V_IEEE, V_SQRT, MAXIMIZE, COUPLED_WD, M_HW, V_HW)
        if BLOCK <= SPAN:
            m_scale = _block_scale(_finite_amax(m), M_FMAX, SCALE_CAP)
            v_scale = _block_scale(_finite_amax(v), V_FMAX, SCALE_CAP)
        _write_span(p, m, v, p_t, m_t, v_t, e, mask, m_scale, v_scale, seed, key, wseed, wkey, M_KIND, M_MBITS,
                    M_BIAS, M_MAX_CODE, M_NAN_CODE, M_MIN_SUB, V_KIND, V_MBITS, V_BIAS, V_MAX_CODE, V_NAN_CODE,
                    V_MIN_SUB, STOCHASTIC, SFLUSH, M_HW, V_HW, rand4, NB, SPAN, BF16_SR)
    # the new scales: the pointers are formed again here (a reload of two table entries), not kept
    # live across the span loops (sm_90 spilled one to the stack for the wide blocks)
    if M_KIND == 0:
        tl.store(ms_ptr + tl.load(t + 3) + blk0 + rows, m_scale, mask=row_ok)
    if V_KIND == 0:
        tl.store(vs_ptr + tl.load(t + 5) + blk0 + rows, v_scale, mask=row_ok)


@functools.lru_cache(maxsize=None)
def _fmt_args(spec: MomentSpec, prefix: str) -> dict:
    kind = _KIND[spec.fmt]
    args = dict(KIND=kind, MBITS=3, BIAS=7, MAX_CODE=0x7E, NAN_CODE=0x7F, FMAX=448.0, MIN_SUB=2.0**-9, IEEE=False)
    if spec.fp8:
        f = spec.format
        args.update(MBITS=f.mbits, BIAS=f.bias, MAX_CODE=f.max_code, NAN_CODE=f.nan_code, FMAX=float(f.max),
                    MIN_SUB=float(f.min_subnormal), IEEE=f.name == "e5m2")
    return {f"{prefix}_{k}": v for k, v in args.items()}


def _storage(state: dict, spec: MomentSpec):
    """(element tensor, scale tensor) for the kernel; FP8 codes are passed as uint8."""
    if spec.fp8:
        return state[spec.codes_key].view(torch.uint8), state[spec.scale_key]
    t = state[spec.name]
    return t, t  # the scale pointer is never read for bf16/fp32 moments


def _offset(t: torch.Tensor, base: torch.Tensor) -> int:
    """Elements from ``base``'s first element to ``t``'s (both of one dtype)."""
    delta = t.data_ptr() - base.data_ptr()
    if delta % t.element_size():
        raise ValueError("the Triton Adam kernel needs element-aligned tensors; use kernels='torch' for these")
    return delta // t.element_size()


# Launch tables on the device, keyed by their content (relative offsets and sizes): rebuilt only when
# the tensors move (a new gradient allocation at another address, a new parameter set).
_TABLES: collections.OrderedDict = collections.OrderedDict()
_MAX_TABLES = 32


def _table(rows: list[tuple[int, ...]], device: torch.device) -> torch.Tensor:
    key = (device, tuple(rows))
    table = _TABLES.get(key)
    if table is None:
        host = torch.tensor(rows, dtype=torch.int64)
        if device.type == "cuda":  # pinned: an asynchronous copy, no host synchronisation
            host = host.pin_memory()
        table = host.to(device, non_blocking=True)
        _TABLES[key] = table
        if len(_TABLES) > _MAX_TABLES:
            _TABLES.popitem(last=False)
    else:
        _TABLES.move_to_end(key)
    return table


_TUNED: set = set()


def _tensor_rows(items, m_spec: MomentSpec, v_spec: MomentSpec, blocks) -> tuple[list, int, int, bool]:
    """Launch-table rows (the columns of ``_COLS``) of ``items``, one scale-block width per item.

    Returns:
        (rows, number of scale blocks, number of elements, whether every tensor starts a multiple of
        16 elements from its base tensor and has a multiple of 16 elements).
    """
    p0, g0, st0, hp0, ws0 = items[0]
    m0, ms0 = _storage(st0, m_spec)
    v0, vs0 = _storage(st0, v_spec)
    on_device = isinstance(hp0, torch.Tensor)  # else one set of host values for the launch: no table column
    rows, first_block, n_elems, key, aligned = [], 0, 0, 0, True
    for (p, g, st, hp, ws), block in zip(items, blocks):
        m, ms = _storage(st, m_spec)
        v, vs = _storage(st, v_spec)
        offs = (_offset(p, p0), _offset(g, g0), _offset(m, m0), _offset(ms, ms0), _offset(v, v0), _offset(vs, vs0),
                _offset(hp, hp0) if on_device else 0)
        aligned = aligned and p.numel() % 16 == 0 and all(o % 16 == 0 for o in (offs[0], offs[1], offs[2], offs[4]))
        weight = (_offset(ws.seed, ws0.seed), ws.counter) if ws is not None else (0, 0)
        rows.append((*offs, p.numel(), first_block, key, *weight))
        first_block += -(-p.numel() // block)
        n_elems += p.numel()
        key += -(-p.numel() // 4) * 4  # each tensor's Philox counters start at a multiple of 4
    return rows, first_block, n_elems, aligned


def _with_tiles(rows: list, blocks) -> tuple[list, dict]:
    """``rows`` with the fused kernel's columns of first tiles (one per NB of ``_NBS``), and the number
    of tiles (programs) per NB."""
    n_tiles = dict.fromkeys(_NBS, 0)
    out = []
    for row, block in zip(rows, blocks):
        n_blocks = -(-row[_COLS.index("numel")] // block)
        out.append((*row, *(n_tiles[nb] for nb in _NBS)))
        for nb in _NBS:
            n_tiles[nb] += -(-n_blocks // nb)
    return out, n_tiles


def _base_args(items, m_spec: MomentSpec, v_spec: MomentSpec) -> tuple:
    """The launch's base tensors: parameter, gradient, m, m's scales, v, v's scales, hyper-parameters
    (with host values, a 4-byte fp32 allocation that the kernel never reads)."""
    p0, g0, st0, hp0, _ = items[0]
    if not isinstance(hp0, torch.Tensor):
        hp0 = torch.empty(1, dtype=torch.float32, device=p0.device)
    return (p0, g0, *_storage(st0, m_spec), *_storage(st0, v_spec), hp0)


def _weight_seed_base(items, unused: torch.Tensor) -> torch.Tensor:
    """The weight-seed pointer of a launch: the first tensor's seed (bf16_stochastic_round; the table
    holds each tensor's offset from it), else ``unused``."""
    ws0 = items[0][4]
    return unused if ws0 is None else ws0.seed


def _hp_args(items) -> dict:
    """The hyper-parameters of a launch: its fp32 scalar arguments (host values; zeros, unread, when
    they come from the device tensor) and ``HP_TABLE``."""
    hp = items[0][3]
    on_device = isinstance(hp, torch.Tensor)
    vals = (0.0,) * len(HP_FIELDS) if on_device else hp
    return dict(zip(_HP_ARGS, vals), HP_TABLE=on_device)


def _launch_seed(opts: dict, device: torch.device, unused: torch.Tensor) -> torch.Tensor:
    """The seed pointer of a launch: drawn on the device for stochastic rounding, else ``unused``."""
    if opts["rounding"] != "stochastic" and not opts["stochastic_flush"]:
        return unused
    gen = opts["generator"]
    return random_seed(gen if gen is not None and gen.device == device else None, device)


def _step_meta(m_spec: MomentSpec, v_spec: MomentSpec, opts: dict, device: torch.device | None = None) -> dict:
    """The compile-time arguments of the update shared by the Adam kernels (formats and flags): M_HW /
    V_HW = 1 where ``device`` converts the moment's FP8 format in hardware (``decode_codes``, ``cast_codes``)."""
    hw = {f"{prefix}_HW": hardware_cast(device, spec.format) if spec.fp8 and device is not None else 0
          for prefix, spec in (("M", m_spec), ("V", v_spec))}
    return dict(**_fmt_args(m_spec, "M"), **_fmt_args(v_spec, "V"), **hw, V_SQRT=v_spec.stores_sqrt,
                MAXIMIZE=opts["maximize"], COUPLED_WD=opts["coupled_wd"],
                STOCHASTIC=opts["rounding"] == "stochastic", SFLUSH=opts["stochastic_flush"], SCALE_CAP=MAX_SCALE)


def _span(block: int) -> int:
    """Lanes of one pass over a block of ``block`` elements (the kernel's SPAN)."""
    return triton.next_power_of_2(block) if block <= ONE_PASS_MAX else MAX_SPAN


def _launch(items, m_spec: MomentSpec, v_spec: MomentSpec, opts: dict, rows_class: int | None = None) -> None:
    """One kernel launch over ``items``: (param, grad, state, hp, weight seed or None) of one device, one
    pair of dtypes and one kind of weight rounding."""
    p0, g0, m0, ms0, v0, vs0, hp0 = _base_args(items, m_spec, v_spec)
    device = p0.device
    block = m_spec.block
    rows, n_rows, n_elems, aligned = _tensor_rows(items, m_spec, v_spec, [block] * len(items))
    rows, n_tiles = _with_tiles(rows, [block] * len(items))
    table = _table(rows, device)
    seed = _launch_seed(opts, device, hp0)
    wseed = _weight_seed_base(items, hp0)
    rows_class = size_class(n_rows) if rows_class is None else rows_class
    span = _span(block)
    meta = dict(**_step_meta(m_spec, v_spec, opts, device), **_hp_args(items), BLOCK=block, SPAN=span,
                SEARCH_STEPS=max(1, len(items).bit_length()), ALIGNED=aligned and block % 16 == 0, W=_W,
                BF16_SR=items[0][4] is not None)
    key = (device, p0.dtype, g0.dtype, m0.dtype, v0.dtype, seed.dtype, rows_class, block, m_spec.fmt, v_spec.fmt,
           v_spec.stores_sqrt, meta["STOCHASTIC"], meta["SFLUSH"], meta["HP_TABLE"], meta["BF16_SR"])
    if not INTERPRETING and key not in _TUNED and not _TUNING[0]:
        _tune_on_scratch(items[0], m_spec, v_spec, opts, rows_class, min(n_elems, _TUNING_SCRATCH))
        _TUNED.add(key)
    _adam_kernel[lambda cfg: (n_tiles[cfg["NB"]],)](
        p0, g0, m0, ms0, v0, vs0, hp0, seed, wseed, table, len(items), rows_class, **meta,
        enable_fp_fusion=False,  # no FMA: bit-identical to the torch path's single-rounding ops
    )


def _tune_on_scratch(item, m_spec, v_spec, opts, rows_class: int, numel: int) -> None:
    """Autotune the kernel for this key on scratch tensors shaped like ``item`` (never on live ones)."""
    p, g, _, hp, ws = item
    if isinstance(hp, torch.Tensor):
        hp = hp.clone()
    if ws is not None:
        ws = WeightSeed(torch.zeros((), dtype=torch.int32, device=p.device))
    sp = torch.zeros(numel, dtype=p.dtype, device=p.device)
    sg = torch.full((numel,), 1e-3, dtype=g.dtype, device=g.device)
    st: dict = {}
    init_moment(st, m_spec, sp)
    init_moment(st, v_spec, sp)
    _TUNING[0] = True
    try:
        _launch([(sp, sg, st, hp, ws)], m_spec, v_spec, opts, rows_class)
    finally:
        _TUNING[0] = False


def adam_step_triton_multi(params, grads, states, hps, m_spec: MomentSpec, v_spec: MomentSpec,
                           maximize: bool = False, coupled_wd: bool = False, rounding: str = "nearest",
                           stochastic_flush: bool = False, generator: torch.Generator | None = None,
                           weight_seeds=None) -> None:
    """``torch_step.adam_step_torch`` for many parameters: one kernel launch per (device, parameter
    dtype, gradient dtype, weight rounding) among them.

    Args:
        params, grads, states, hps: per parameter its tensor, dense gradient, state dict (moments in the
            layout of ``m_spec`` / ``v_spec``) and hyper-parameters: the values of
            ``torch_step.host_hyper_params`` (passed as fp32 kernel arguments: one launch per distinct
            set), or an fp32 tensor (``hyper_params``; a row of ``device_hyper_params``) read by the kernel.
        m_spec, v_spec, maximize, coupled_wd, rounding, stochastic_flush: as in ``adam_step_torch``.
        generator: for stochastic rounding, used for the tensors on its device (the device's default
            generator for the others).
        weight_seeds: per parameter a ``WeightSeed`` (a bf16 parameter stored by stochastic rounding,
            ``adam_step_torch``'s ``weight_seed``: the same bits) or None (rounded to nearest); None: all None.
    """
    opts = dict(maximize=maximize, coupled_wd=coupled_wd, rounding=rounding, stochastic_flush=stochastic_flush,
                generator=generator)
    for items, _ in _launch_groups(params, grads, states, hps, [m_spec.block] * len(params), weight_seeds):
        _launch(items, m_spec, v_spec, opts)


def _launch_groups(params, grads, states, hps, blocks, weight_seeds=None) -> list[tuple[list, list]]:
    """The non-empty tensors grouped by launch (device, parameter dtype, gradient dtype, the host
    hyper-parameter values where they are such, and whether the weight is rounded stochastically):
    per group its items (param, grad, state, hp: a tensor on the param's device, or the tuple of host
    values; weight seed or None) and their scale-block widths."""
    if weight_seeds is None:
        weight_seeds = [None] * len(params)
    groups: dict = {}
    for p, g, st, hp, ws, block in zip(params, grads, states, hps, weight_seeds, blocks):
        _check(p, g, ws)
        if p.numel():
            on_device = isinstance(hp, torch.Tensor)
            hp = hp.to(p.device) if on_device else tuple(float(x) for x in hp)
            kind = (p.device, p.dtype, g.dtype, None if on_device else hp, ws is None)
            items, widths = groups.setdefault(kind, ([], []))
            items.append((p, g, st, hp, ws))
            widths.append(block)
    return list(groups.values())


def _check(p: torch.Tensor, grad: torch.Tensor, weight_seed: WeightSeed | None = None) -> None:
    if not (p.is_contiguous() and grad.is_contiguous()):
        raise ValueError("the Triton Adam kernel needs contiguous parameters and gradients; "
                         "use kernels='torch' for non-contiguous ones")
    if weight_seed is not None:
        if p.dtype != torch.bfloat16:
            raise ValueError(f"a weight seed (bf16 stochastic rounding of the weight) needs a bf16 parameter, "
                             f"got {p.dtype}")
        if not isinstance(weight_seed, WeightSeed) or weight_seed.seed.dtype != torch.int32 \
                or weight_seed.seed.device != p.device:
            raise ValueError("a weight seed must be a WeightSeed whose seed is an int32 tensor on the "
                             "parameter's device (torch_step.draw_weight_seeds)")
    check_interpretable(p.device)


def adam_step_triton(p: torch.Tensor, grad: torch.Tensor, state: dict, m_spec: MomentSpec,
                     v_spec: MomentSpec, hp: torch.Tensor, maximize: bool = False, coupled_wd: bool = False,
                     rounding: str = "nearest", stochastic_flush: bool = False,
                     generator: torch.Generator | None = None, weight_seed: WeightSeed | None = None) -> None:
    """Same contract as ``torch_step.adam_step_torch``, in one kernel launch (contiguous tensors)."""
    adam_step_triton_multi([p], [grad], [state], [hp], m_spec, v_spec, maximize, coupled_wd, rounding,
                           stochastic_flush, generator, [weight_seed])
