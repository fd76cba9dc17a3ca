"""Fused Triton kernel of the FP8 Adam step: dequantize -> update -> requantize in one pass.

One program per block of ``BLOCK`` elements (the scale block): it reads the parameter, the gradient,
both moments' codes and block scales, applies exactly the update of ``torch_step`` (same fp32 ops in
the same order, IEEE ``sqrt_rn`` / ``div_rn``, FMA contraction off), takes the new block amaxes over
the finite values, and writes the parameter, the codes and the scales. Per element that is 2 bytes of
moments read and written instead of torch AdamW's 8, and no fp32 moment ever reaches memory.

Codes are computed with integer operations (the algorithm of ``fp8pass.numerics.casts.encode``), never
with Triton's fp32 -> fp8 conversion, which the interpreter gets wrong (docs/background.md, Traps); decoding is
integer too, so the kernel also runs on GPUs without native FP8 types. ``torch_step.adam_step_torch`` is
the reference: the tests compare the two bit for bit under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..numerics.kernels.triton_family import _encode  # the one exact in-kernel cast
from ..numerics.scaling import MAX_SCALE
from .moments import MomentSpec

__all__ = ["adam_step_triton"]

_KIND = {"e4m3": 0, "e5m2": 0, "bf16": 1, "fp32": 2}


@triton.jit
def _decode(c, MBITS: tl.constexpr, BIAS: tl.constexpr, IEEE_SPECIALS: tl.constexpr):
    """fp32 value of 8-bit codes ``c`` (int32 0..255): exact, by integer assembly of the fp32 bits."""
    mag = c & 0x7F
    e = mag >> MBITS
    mant = mag & ((1 << MBITS) - 1)
    normal = (((e - BIAS + 127) << 23) | (mant << (23 - MBITS))).to(tl.float32, bitcast=True)
    # subnormal: mant * 2**(1 - BIAS - MBITS), assembled as bits of 2**(1 - BIAS - MBITS) times mant
    quantum = tl.full(c.shape, (127 + 1 - BIAS - MBITS) << 23, tl.int32).to(tl.float32, bitcast=True)
    val = tl.where(e == 0, mant.to(tl.float32) * quantum, normal)
    if IEEE_SPECIALS:  # E5M2: exponent all ones is Inf (mantissa 0) or NaN
        emax_field = (1 << (7 - MBITS)) - 1
        val = tl.where(e == emax_field, tl.where(mant == 0, float("inf"), float("nan")), val)
    else:  # E4M3FN: only S.1111.111 is NaN
        val = tl.where(mag == 0x7F, float("nan"), val)
    return tl.where((c & 0x80) != 0, -val, val)


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
def _load_moment(ptr, scale_ptr, offs, mask, pid, KIND: tl.constexpr, SQRT: tl.constexpr,
                 MBITS: tl.constexpr, BIAS: tl.constexpr, IEEE_SPECIALS: tl.constexpr):
    if KIND == 0:
        c = tl.load(ptr + offs, mask=mask, other=0).to(tl.int32)
        x = tl.math.div_rn(_decode(c, MBITS, BIAS, IEEE_SPECIALS), tl.load(scale_ptr + pid))
        if SQRT:
            x = x * x
    else:
        x = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def _store_moment(x, ptr, scale_ptr, offs, mask, pid, rbits, KIND: tl.constexpr, MBITS: tl.constexpr,
                  BIAS: tl.constexpr, MAX_CODE: tl.constexpr, NAN_CODE: tl.constexpr, FMAX: tl.constexpr,
                  MIN_SUB: tl.constexpr, SCALE_CAP: tl.constexpr, STOCHASTIC: tl.constexpr,
                  SFLUSH: tl.constexpr):
    if KIND == 0:
        a = tl.abs(x)
        a = tl.where(mask & (a < float("inf")), a, 0.0)  # finite values only (moments.finite_block_amax)
        amax = tl.max(a, axis=0)
        # numerics.scale_from_amax: FMAX / amax capped, 1 for an all-zero block
        scale = tl.minimum(tl.math.div_rn(FMAX + amax * 0.0, amax), SCALE_CAP)
        scale = tl.where(amax > 0, scale, 1.0)
        y = x * scale
        code = _encode(y, rbits, MBITS, BIAS, MAX_CODE, NAN_CODE, 7, STOCHASTIC)
        if SFLUSH:
            if not STOCHASTIC:
                sr = _encode(y, rbits, MBITS, BIAS, MAX_CODE, NAN_CODE, 7, True)
                code = tl.where(tl.abs(y) < MIN_SUB, sr, code)
        tl.store(ptr + offs, code.to(tl.uint8), mask=mask)
        tl.store(scale_ptr + pid, scale)
    else:
        _store_float(ptr + offs, x, mask)


@triton.jit
def _adam_kernel(p_ptr, g_ptr, m_ptr, ms_ptr, v_ptr, vs_ptr, hp_ptr, n, seed,
                 M_KIND: tl.constexpr, M_MBITS: tl.constexpr, M_BIAS: tl.constexpr, M_MAX_CODE: tl.constexpr,
                 M_NAN_CODE: tl.constexpr, M_FMAX: tl.constexpr, M_MIN_SUB: tl.constexpr, M_IEEE: tl.constexpr,
                 V_KIND: tl.constexpr, V_MBITS: tl.constexpr, V_BIAS: tl.constexpr, V_MAX_CODE: tl.constexpr,
                 V_NAN_CODE: tl.constexpr, V_FMAX: tl.constexpr, V_MIN_SUB: tl.constexpr, V_IEEE: tl.constexpr,
                 V_SQRT: tl.constexpr, MAXIMIZE: tl.constexpr, COUPLED_WD: tl.constexpr,
                 STOCHASTIC: tl.constexpr, SFLUSH: tl.constexpr, SCALE_CAP: tl.constexpr,
                 BLOCK: tl.constexpr, BP: tl.constexpr):
    """Adam(W) on one scale block (math: torch_step module doc)."""
    pid = tl.program_id(0)
    lane = tl.arange(0, BP)
    offs = pid * BLOCK + lane
    mask = (lane < BLOCK) & (offs < n)
    b1 = tl.load(hp_ptr + 0)
    omb1 = tl.load(hp_ptr + 1)
    b2 = tl.load(hp_ptr + 2)
    omb2 = tl.load(hp_ptr + 3)
    inv_bc2s = tl.load(hp_ptr + 4)
    eps = tl.load(hp_ptr + 5)
    step_size = tl.load(hp_ptr + 6)
    decay = tl.load(hp_ptr + 7)
    l2 = tl.load(hp_ptr + 8)

    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if MAXIMIZE:
        g = -g
    if COUPLED_WD:
        g = g + p * l2
    m = _load_moment(m_ptr, ms_ptr, offs, mask, pid, M_KIND, False, M_MBITS, M_BIAS, M_IEEE)
    v = _load_moment(v_ptr, vs_ptr, offs, mask, pid, V_KIND, V_SQRT, V_MBITS, V_BIAS, V_IEEE)
    m = m * b1 + g * omb1
    v = v * b2 + (g * g) * omb2
    r = tl.math.sqrt_rn(v)
    p = p * decay
    p = p - tl.math.div_rn(m, r * inv_bc2s + eps) * step_size
    _store_float(p_ptr + offs, p, mask)

    rbits = (tl.randint(seed, offs) & 0x3FFFFFFF).to(tl.int32)
    _store_moment(m, m_ptr, ms_ptr, offs, mask, pid, rbits, M_KIND, M_MBITS, M_BIAS, M_MAX_CODE, M_NAN_CODE,
                  M_FMAX, M_MIN_SUB, SCALE_CAP, STOCHASTIC, SFLUSH)
    rbits = (tl.randint(seed + 1, offs) & 0x3FFFFFFF).to(tl.int32)
    if V_SQRT:
        v = r
    _store_moment(v, v_ptr, vs_ptr, offs, mask, pid, rbits, V_KIND, V_MBITS, V_BIAS, V_MAX_CODE, V_NAN_CODE,
                  V_FMAX, V_MIN_SUB, SCALE_CAP, STOCHASTIC, SFLUSH)


def _fmt_args(spec: MomentSpec, prefix: str) -> dict:
    kind = _KIND[spec.fmt]
    args = dict(KIND=kind, MBITS=3, BIAS=7, MAX_CODE=0x7E, NAN_CODE=0x7F, FMAX=448.0, MIN_SUB=2.0**-9, IEEE=False)
    if spec.fp8:
        f = spec.format
        args.update(MBITS=f.mbits, BIAS=f.bias, MAX_CODE=f.max_code, NAN_CODE=f.nan_code, FMAX=float(f.max),
                    MIN_SUB=float(f.min_subnormal), IEEE=f.name == "e5m2")
    return {f"{prefix}_{k}": v for k, v in args.items()}


def _storage(state: dict, spec: MomentSpec):
    """(element pointer tensor, scale tensor) for the kernel; FP8 codes are passed as uint8."""
    if spec.fp8:
        return state[spec.codes_key].view(torch.uint8), state[spec.scale_key]
    t = state[spec.name]
    return t, t  # the scale pointer is unused for bf16/fp32 moments


def adam_step_triton(p: torch.Tensor, grad: torch.Tensor, state: dict, m_spec: MomentSpec,
                     v_spec: MomentSpec, hp: torch.Tensor, maximize: bool = False, coupled_wd: bool = False,
                     rounding: str = "nearest", stochastic_flush: bool = False,
                     generator: torch.Generator | None = None) -> None:
    """Same contract as ``torch_step.adam_step_torch``, in one kernel launch (contiguous tensors)."""
    if not (p.is_contiguous() and grad.is_contiguous()):
        raise ValueError("the Triton Adam kernel needs contiguous parameters and gradients; "
                         "use kernels='torch' for non-contiguous ones")
    n = p.numel()
    block = m_spec.block
    m_ptr, ms_ptr = _storage(state, m_spec)
    v_ptr, vs_ptr = _storage(state, v_spec)
    needs_random = rounding == "stochastic" or stochastic_flush
    seed = int(torch.randint(0, 2**31 - 2, (), generator=generator).item()) if needs_random else 0
    grid = (-(-n // block),)
    _adam_kernel[grid](
        p, grad, m_ptr, ms_ptr, v_ptr, vs_ptr, hp, n, seed,
        **_fmt_args(m_spec, "M"), **_fmt_args(v_spec, "V"),
        V_SQRT=v_spec.stores_sqrt, MAXIMIZE=maximize, COUPLED_WD=coupled_wd,
        STOCHASTIC=rounding == "stochastic", SFLUSH=stochastic_flush, SCALE_CAP=MAX_SCALE,
        BLOCK=block, BP=triton.next_power_of_2(block),
        enable_fp_fusion=False,  # no FMA: bit-identical to the torch path's single-rounding ops
    )
