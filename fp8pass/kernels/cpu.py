"""CPU kernels of the runtime ops (torch family): fused casts and the bf16 GEMM of FP8 operands.

CPU FP8 GEMMs are bf16 matmuls of the upcast FP8 codes: every E4M3/E5M2 value is exact in bf16, the
products of two of them are exact in fp32, and oneDNN's bf16 matmul accumulates in fp32. On CPUs
without native bf16 matmuls (AVX2 only) they are fp32 matmuls of the same exact values instead, since
a bf16 matmul there is ~100x slower (:func:`gemm_dtype`; ``FP8PASS_CPU_GEMM_DTYPE`` overrides). The
scales enter as the GEMM's ``alpha`` (applied to the fp32 accumulator, one rounding to the output dtype).
``torch._scaled_mm`` is never used on CPU (docs/background.md, Traps: ~10,000x slower).

Eager elementwise casts cost several passes over memory (widen, multiply, clamp, convert) and the
fp8 -> bf16 conversion is scalar code in eager torch; they would decide the CPU speed ratio. Each
cast below is therefore one Inductor-compiled loop (``dynamic=True``, so shapes never recompile):

=====================  ==================================================================
``cast``               one read of ``x``: codes ``sat(x * s)`` and ``max |x|`` (and, asked, their
                       values in the GEMM dtype from the same loop)
``cast_stochastic``    the same with stochastic rounding (gradients), random bits made in-loop
``upcast``             codes -> fp32 -> bf16 in one loop (vectorised; the direct conversion is not);
                       E5M2 codes -> fp32 in the loop, -> bf16 after it (see ``upcast``)
``cast_values``        the values of ``cast``'s codes in the GEMM dtype and ``max |x|``, no codes
                       written (operands only GEMMs read, e.g. weights recast each step)
=====================  ==================================================================

Inductor converts fp32 -> fp8 with c10's round-to-nearest-even, bit-identical to
``fp8pass.numerics.saturating_cast`` (tested; NaN stays NaN, its sign bit may differ). ``FP8PASS_CPU_FUSED=0`` (or a machine where Inductor
cannot compile) selects the eager twins, which compute the same bits more slowly.
"""

from __future__ import annotations

import functools
import math
import os
import types
import warnings

import torch

from ..numerics.casts import uniform_bits
from ..numerics.formats import Format
from . import torch_family
from .interface import Offers

__all__ = ["OFFERS", "fused_enabled", "run_fused", "cast", "codes_values_amax_math", "rne_values_math", "rne_constants",
           "cast_values", "cast_stochastic", "uniform_bits", "upcast", "native_bf16", "fast_matmul_dtype",
           "cpu_capability", "gemm_dtype", "gemm_tensor_scaled", "row_amax", "cast_rows", "cast_rows_with_amax",
           "grouped_gemm", "grouped_gemm_wgrad"]

# The CPU emulates FP8 GEMMs with bf16/fp32 GEMMs of upcast codes, so its casts can write the GEMM's
# values directly (with or without codes); scales are torch ops on the host's device, one layout per cast.
OFFERS = Offers(scale_on_device=False, transpose_cast=False, values_without_codes=True, upcast_gemm_operands=True)

_BROKEN: list[str] = []  # set once when Inductor fails, so we warn once and stay eager


def fused_enabled() -> bool:
    """Whether the compiled CPU kernels are used (FP8PASS_CPU_FUSED=0 turns them off)."""
    return os.environ.get("FP8PASS_CPU_FUSED", "1") != "0" and not _BROKEN


def _eager_cast(x: torch.Tensor, scale: torch.Tensor, fmax: float, dtype):
    xf = x.float()
    return (xf * scale).clamp_(-fmax, fmax).to(dtype), xf.abs().amax()


# Below this many elements a compiled kernel is not worth its launch; eager computes the same bits.
MIN_COMPILED = 1 << 14


def compile_variant(fn, tag: str):
    """``torch.compile`` a fresh copy of ``fn`` (its own code object).

    Dynamo keeps compiled entries, and its recompile limit, per code object: closures of one function
    for many formats/dtypes would share one limit (8) and hit it. A copy per variant never does.
    """
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{tag}")
    fresh = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    return torch.compile(fresh, dynamic=True, fullgraph=True)


def _tag(*parts) -> str:
    return "_".join(str(p).replace("torch.", "").replace(".", "_") for p in parts)


@functools.cache
def _compiled_cast(fmax: float, dtype: torch.dtype, src: torch.dtype):
    def cast_kernel(x, scale):
        xf = x.float()
        return (xf * scale).clamp(-fmax, fmax).to(dtype), xf.abs().amax()

    return compile_variant(cast_kernel, _tag(fmax, dtype, src))


@functools.cache
def _compiled_upcast(dtype: torch.dtype, src: torch.dtype):
    def upcast_kernel(codes):
        # Through fp32 (exact both ways): Inductor has no float8 -> bf16 vector conversion.
        return codes.to(torch.float32).to(dtype)

    return compile_variant(upcast_kernel, _tag(dtype, src))


def _run_compiled(fn, eager, *args):
    if fused_enabled():
        try:
            return fn(*args)
        except Exception as err:  # no C++ compiler, unsupported torch: stay correct, get slower
            _BROKEN.append(repr(err))
            warnings.warn(f"fp8pass: compiled CPU casts unavailable ({err!r:.200}); using eager casts",
                          RuntimeWarning, stacklevel=3)
    return eager(*args)


_FUSED: dict = {}


def run_fused(fn, tensors: tuple, static: tuple = ()):
    """``fn(*tensors, *static)``; CPU tensors above :data:`MIN_COMPILED` elements run it as one
    Inductor-compiled loop nest (one variant per function, static arguments and tensor dtypes), so an
    elementwise chain reads and writes memory once instead of once per eager op."""
    first = tensors[0]
    if first.device.type != "cpu" or first.numel() < MIN_COMPILED or not fused_enabled():
        return fn(*tensors, *static)
    key = (fn, static, tuple(t.dtype for t in tensors))
    if key not in _FUSED:
        _FUSED[key] = compile_variant(fn, _tag(*static, *key[2]))
    return _run_compiled(_FUSED[key], fn, *tensors, *static)


def cast(x: torch.Tensor, scale: torch.Tensor, fmt: Format, up: torch.dtype | None = None, want_amax: bool = True):
    """Codes ``saturating_cast(x * scale, fmt)`` (RNE) for a scalar fp32 ``scale``, with ``max |x|``.

    Args:
        x: bf16/fp16/fp32 tensor, any shape (made contiguous).
        scale: fp32 scalar tensor.
        fmt: an FP8 format with a torch dtype.
        up: also return the codes converted to this dtype (the GEMM operand), or None.
        want_amax: unused here (the loop computes ``max |x|`` at no cost); the CUDA module's ``cast``
            skips its reduction when False.

    Returns:
        (codes, amax fp32 scalar, upcast or None).
    """
    x = x.contiguous()
    scale = scale.to(torch.float32).reshape(())
    if x.numel() == 0:
        codes = torch.empty(x.shape, dtype=fmt.torch_dtype, device=x.device)
        zero = torch.zeros((), dtype=torch.float32, device=x.device)
        return codes, zero, (codes.to(up) if up is not None else None)
    if x.dtype == torch.float64:
        codes, amax = torch_family.cast_scaled(x, scale, fmt, want_amax=True)
        return codes, amax.float(), (codes.to(up) if up is not None else None)
    if up is not None:  # codes and GEMM values from one loop
        args = (fmt.max, *rne_constants(fmt), fmt.torch_dtype, up)
        eager = lambda a, s: codes_values_amax_math(a, s, *args)  # noqa: E731
        if x.numel() < MIN_COMPILED:
            codes, values, amax = eager(x, scale)
        else:  # 1-D, so that no shape ever recompiles
            codes, values, amax = _run_compiled(_compiled_codes_values(*args, x.dtype), eager, x.reshape(-1), scale)
        return codes.view(x.shape), amax.float(), values.view(x.shape)
    eager = lambda a, s: _eager_cast(a, s, fmt.max, fmt.torch_dtype)  # noqa: E731
    if x.numel() < MIN_COMPILED:
        codes, amax = eager(x, scale)
    else:  # 1-D, so that no shape ever recompiles
        codes, amax = _run_compiled(_compiled_cast(fmt.max, fmt.torch_dtype, x.dtype), eager, x.reshape(-1), scale)
    return codes.view(x.shape), amax.float(), None


def codes_values_amax_math(x, scale, fmax: float, split: float, step: float, tiny: float, dtype, up):
    """:func:`cast`'s codes, their values in ``up`` and ``max |x|`` from one read of ``x``.

    The values are rounded arithmetically (:func:`_rne_round`), not converted from the codes: a
    float8 -> bf16 conversion in the same loop made it slower than two loops, this is 12-25% faster
    than cast + upcast (docs/results/step.md). Bit-identical to upcasting the codes (tested).
    """
    xf = x.float()
    v = (xf * scale).clamp(-fmax, fmax)
    return v.to(dtype), _rne_round(v, split, step, tiny).to(up), xf.abs().amax()


@functools.cache
def _compiled_codes_values(fmax: float, split: float, step: float, tiny: float, dtype, up, src: torch.dtype):
    def cast_codes_values_kernel(x, scale):
        return codes_values_amax_math(x, scale, fmax, split, step, tiny, dtype, up)

    return compile_variant(cast_codes_values_kernel, _tag("codes_values", fmax, dtype, src, up))


@functools.cache
def _compiled_cast_values(fmax: float, split: float, step: float, tiny: float, src: torch.dtype, up: torch.dtype):
    def cast_values_kernel(x, scale):
        return _rne_values_amax_math(x, scale, fmax, split, step, tiny, up)

    return compile_variant(cast_values_kernel, _tag("values", fmax, src, up))


def cast_values(x: torch.Tensor, scale: torch.Tensor, fmt: Format, up: torch.dtype):
    """``upcast(cast(x, scale, fmt)[0], up)`` and ``max |x|`` without the codes: one compiled loop.

    For operands whose codes nobody reads (a weight recast each step, used by CPU GEMMs only): the
    codes' 1-byte write and the second loop that upcasts them are skipped. Bit-identical values
    (:func:`_rne_values_math`'s rounding, tested against codes + upcast).

    Args:
        x: bf16/fp16/fp32 tensor, any shape (made contiguous). fp64 goes through :func:`cast`.
        scale: fp32 scalar tensor.
        fmt: an FP8 format with a torch dtype.
        up: the GEMM dtype (:func:`gemm_dtype`), bf16 or fp32.

    Returns:
        (values shaped like ``x`` in ``up``, amax fp32 scalar).
    """
    x = x.contiguous()
    if x.dtype == torch.float64 or x.numel() == 0:
        _, amax, values = cast(x, scale, fmt, up)
        return values, amax
    scale = scale.to(torch.float32).reshape(())
    args = (fmt.max, *rne_constants(fmt))
    eager = lambda a, s: _rne_values_amax_math(a, s, *args, up)  # noqa: E731
    if x.numel() < MIN_COMPILED:
        values, amax = eager(x, scale)
    else:  # 1-D, so that no shape ever recompiles
        values, amax = _run_compiled(_compiled_cast_values(*args, x.dtype, up), eager, x.reshape(-1), scale)
    return values.view(x.shape), amax.float()


def _stochastic_cast_math(x, scale, seed, fmax: float, mbits: int, emin: int, dtype):
    """``numerics.casts``' stochastic rounding of ``x * scale`` (1-D), on fp32's integer significand.

    ``s`` dropped bits, ``n = sig >> s``, round up when ``(sig mod 2^s) + u >= 2^s`` with ``u`` uniform
    on ``[0, 2^s)``: E[result] = x * scale exactly. ``s`` is capped at 30 (the int32 sum must not
    overflow): inputs more than 2^7 below the smallest subnormal then drop their lowest significand
    bits first, a bias below 2^-23 of that subnormal. Saturates to +-fmax; NaN stays NaN.

    The FP8 code is assembled in integers, ``code = (max(e - emin, 0) << mbits) + n`` (a carry out of
    ``n`` moves into the exponent field, as it should; below the smallest normal ``code = n``), then
    ``min(code, code of fmax)``, NaN's code and the sign bit: no float scaling, no fp32 -> fp8
    conversion, half the time of computing ``n * 2**(e - mbits)`` and converting it, same bits.
    """
    xf = x.float()
    bits = (xf * scale).view(torch.int32)
    mag = bits & 0x7FFFFFFF
    efield = mag >> 23
    ebias = torch.clamp(efield, min=1)  # fp32 subnormals: the smallest normal's exponent, no implicit bit
    sig = mag - ((ebias - 1) << 23)  # the significand with its implicit bit
    s = (23 - mbits) + torch.clamp((emin + 127) - ebias, min=0)
    s_cap = torch.clamp(s, max=30)
    sig = sig >> torch.clamp(s - s_cap, max=31)  # sig < 2**24: any shift >= 24 gives 0; >= 32 is undefined in C
    mask = (1 << s_cap) - 1
    u = uniform_bits(mag.numel(), seed, x.device) & mask
    n = (sig >> s_cap) + (((sig & mask) + u) >> s_cap)
    code = (torch.clamp(efield - (emin + 127), min=0) << mbits) + n
    code = torch.clamp(code, max=_max_code(fmax, dtype))
    code = torch.where(mag > 0x7F800000, _NAN_CODE, code) | ((bits >> 24) & 0x80)
    return code.to(torch.uint8).view(dtype), xf.abs().amax()


_NAN_CODE = 0x7F  # E4M3FN's NaN; for E5M2 a NaN too (exponent all ones, mantissa 11): what c10 writes


_LAYOUT = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}  # (mbits, emin) of the code layout


def _max_code(fmax: float, dtype: torch.dtype) -> int:
    """Sign-less code of ``fmax`` in ``dtype``'s layout, a Python int.

    From the dtype, not from the format's ``mbits``/``emin``: under ``torch.compile(dynamic=True)`` those
    are symbolic ints, and Inductor computed a clamp to an expression of them, and every op after it,
    in float (garbage for the bitwise ops).
    """
    mbits, emin = _LAYOUT[dtype]
    frac, exp = math.frexp(fmax)  # fmax = frac * 2**exp, frac in [0.5, 1)
    return ((exp - emin) << mbits) | int((frac * 2 - 1) * 2 ** mbits)


@functools.cache
def _compiled_cast_stochastic(fmax: float, mbits: int, emin: int, dtype: torch.dtype, src: torch.dtype):
    def cast_stochastic_kernel(x, scale, seed):
        return _stochastic_cast_math(x, scale, seed, fmax, mbits, emin, dtype)

    return compile_variant(cast_stochastic_kernel, _tag("sr", fmax, dtype, src))


def stochastic_seed(seed: torch.Tensor | None, generator: torch.Generator | None, device) -> torch.Tensor:
    """The int32 scalar seed of a stochastic cast: ``seed`` (int64 [1], < 2**31: exact) or one draw
    from ``generator`` (torch's default generator when None)."""
    if seed is None:
        return torch.randint(0, 2 ** 31 - 1, (), generator=generator, dtype=torch.int32, device=device)
    return seed.reshape(()).to(torch.int32)


def cast_stochastic(x: torch.Tensor, scale: torch.Tensor, fmt: Format, generator: torch.Generator | None = None,
                    seed: torch.Tensor | None = None):
    """Codes of ``x * scale`` stochastically rounded onto ``fmt`` (saturating), with ``max |x|``.

    One compiled loop (eager below ``MIN_COMPILED`` elements, same bits). The random bits come from
    :func:`uniform_bits` seeded by one draw from ``generator`` (torch's default generator when None),
    so ``torch.manual_seed`` and checkpointed RNG states reproduce them; or from ``seed`` (an int64
    [1] tensor, a model's stream draw, ``fp8pass.runtime.sr``) without a draw.

    Returns:
        (codes shaped like ``x``, amax fp32 scalar).
    """
    x = x.contiguous()
    if x.dtype == torch.float64 or x.numel() == 0 or x.numel() >= 2 ** 31:
        codes, amax = torch_family.cast_scaled(x, scale, fmt, "stochastic", generator, want_amax=True)
        return codes, (amax if amax is not None else torch.zeros((), device=x.device)).float()
    scale = scale.to(torch.float32).reshape(())
    seed = stochastic_seed(seed, generator, x.device)
    args = (fmt.max, fmt.mbits, fmt.emin, fmt.torch_dtype)
    eager = lambda a, s, sd: _stochastic_cast_math(a, s, sd, *args)  # noqa: E731
    if x.numel() < MIN_COMPILED:
        codes, amax = eager(x.reshape(-1), scale, seed)
    else:
        codes, amax = _run_compiled(_compiled_cast_stochastic(*args, x.dtype), eager, x.reshape(-1), scale, seed)
    return codes.view(x.shape), amax.float()


def upcast(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 codes -> ``dtype`` (exact); a view with its last two dims transposed is upcast through its
    contiguous base (2-D ``.t()`` and 3-D ``.transpose(1, 2)`` of expert weights alike)."""
    if codes.dtype == dtype:
        return codes
    if not codes.dtype.is_floating_point or codes.element_size() != 1:
        return codes.to(dtype)
    if codes.dim() >= 2 and not codes.is_contiguous() and codes.transpose(-2, -1).is_contiguous():
        return upcast(codes.transpose(-2, -1), dtype).transpose(-2, -1)
    codes = codes.contiguous()
    if codes.numel() == 0:
        return codes.to(dtype)
    if codes.numel() < MIN_COMPILED:
        return codes.to(dtype)
    flat = codes.reshape(-1)
    if _upcasts_outside_the_loop(codes.dtype, dtype):
        wide = _run_compiled(_compiled_upcast(torch.float32, codes.dtype), lambda c: c.to(torch.float32), flat)
        return wide.to(dtype).view(codes.shape)
    out = _run_compiled(_compiled_upcast(dtype, codes.dtype), lambda c: c.to(dtype), flat)
    return out.view(codes.shape)


# A loop that writes 2-byte values runs 32 fp32 lanes, and ATen's vector library converts E5M2 codes to
# 32 fp32 lanes element by element (it has that conversion for E4M3 only; 16 lanes exist for both).
# E5M2 codes are therefore upcast to fp32 in the compiled loop (16 lanes) and to bf16/fp16 by one
# eager conversion: a whole tiny fp8 step 3% faster (`benchmarks/step_ab.py e5m2-upcast`; timed alone
# the two kernels mislead, docs/results/step.md). E4M3 stays in one loop (equal or faster alone).
_UPCAST_OUTSIDE_THE_LOOP = (torch.float8_e5m2,)


def _upcasts_outside_the_loop(codes_dtype: torch.dtype, up: torch.dtype) -> bool:
    """Whether ``codes_dtype`` -> ``up`` goes through fp32 outside the compiled loop (see above). The
    stochastic row cast, which would also write such values, then writes the codes only and leaves the
    values to :func:`upcast` (E5M2 gradients: 3.5 -> 1.8 ms for 2048 x 256); the nearest-rounded casts
    with codes and values keep one loop (split, they measured mixed; docs/results/moe.md)."""
    return codes_dtype in _UPCAST_OUTSIDE_THE_LOOP and up.itemsize == 2


GEMM_DTYPE_ENV = "FP8PASS_CPU_GEMM_DTYPE"
_GEMM_DTYPE_CHOICES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def native_bf16() -> bool:
    """Whether oneDNN runs bf16 matmuls natively on this CPU (AVX512-BF16/AMX, or its AVX512
    emulation). Without it (AVX2-only CPUs) a bf16 matmul is a reference loop, ~100x slower than fp32."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def fast_matmul_dtype() -> torch.dtype:
    """bf16 or fp32: the high-precision dtype this CPU's matmuls are fast in.

    bf16 where :func:`native_bf16`, fp32 elsewhere. ``FP8PASS_CPU_GEMM_DTYPE=bf16|fp32|auto`` (default
    auto) overrides the choice, for the FP8 path's GEMMs and for the baselines that compare with it.
    """
    choice = os.environ.get(GEMM_DTYPE_ENV, "auto").strip().lower()
    if choice == "auto":
        return torch.bfloat16 if native_bf16() else torch.float32
    if choice not in _GEMM_DTYPE_CHOICES:
        raise ValueError(f"{GEMM_DTYPE_ENV}={choice!r}; valid: auto, {', '.join(_GEMM_DTYPE_CHOICES)}")
    return _GEMM_DTYPE_CHOICES[choice]


def cpu_capability() -> dict:
    """What decides CPU speed here: the SIMD level torch dispatches to and the fast matmul dtype."""
    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "native_bf16": native_bf16(),
            "fast_matmul_dtype": str(fast_matmul_dtype()).removeprefix("torch."),
            GEMM_DTYPE_ENV: os.environ.get(GEMM_DTYPE_ENV, "auto")}


def gemm_dtype(out_dtype: torch.dtype, *operands: torch.Tensor) -> torch.dtype:
    """The dtype CPU GEMMs upcast FP8 codes to: the one place that choice is made.

    bf16 for bf16 outputs on machines with fast bf16 matmuls (:func:`fast_matmul_dtype`: oneDNN's
    native bf16, or ``FP8PASS_CPU_GEMM_DTYPE=bf16``), since FP8 codes are exact in
    bf16 and oneDNN accumulates in fp32. fp32 otherwise: for fp32/fp16 outputs (a bf16 GEMM output
    would round to bf16 before the output dtype) and on machines without bf16 support, where a bf16
    matmul is a slow reference loop. fp64 / fp32 when an operand already is (the identity testing
    format's operands are values, not codes, and must not be rounded).
    """
    if any(t.dtype == torch.float64 for t in operands):
        return torch.float64
    if any(t.dtype == torch.float32 for t in operands):
        return torch.float32
    if out_dtype == torch.bfloat16 and fast_matmul_dtype() == torch.bfloat16:
        return torch.bfloat16
    return torch.float32


def gemm_tensor_scaled(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    a_inv: torch.Tensor | None = None,
    b_inv: torch.Tensor | None = None,
    fast_accum: bool = False,
) -> torch.Tensor:
    """``(a / a_scale) @ (b / b_scale).T (+ bias)`` for 2-D operands with scalar scales.

    ``fast_accum`` (the CUDA GEMM's fast accumulation) changes nothing here: these GEMMs always
    accumulate in fp32.

    ``a_inv``/``b_inv`` (decode scales, which the CUDA GEMM takes) are not read: ``alpha`` is computed
    from the encode scales in double, one rounding.

    ``a`` [M, K] and ``b`` [N, K] are FP8 codes (any strides) or, with the identity testing format,
    high-precision values with scale 1. The GEMM runs in bf16 when the output is bf16 (fp32
    accumulation, one rounding), otherwise in fp32 (:func:`gemm_dtype`); ``alpha = 1 / (a_scale * b_scale)``.
    """
    dtype = gemm_dtype(out_dtype, a, b)
    a_up = upcast(a, dtype)
    b_up = upcast(b, dtype)
    alpha = 1.0 / (float(a_scale) * float(b_scale))
    m, n = a_up.shape[0], b_up.shape[0]
    if bias is None:
        if alpha == 1.0:
            out = torch.mm(a_up, b_up.t())
        else:
            out = torch.addmm(a_up.new_zeros(()).expand(m, n), a_up, b_up.t(), beta=0, alpha=alpha)
    else:
        out = torch.addmm(bias.to(dtype), a_up, b_up.t(), alpha=alpha)
    return out.to(out_dtype)


# --- grouped (MoE expert) kernels: rows of ``a`` grouped by expert, one scale per expert ---------


def _row_amax_math(x2d):
    return x2d.float().abs().amax(dim=1)


@functools.cache
def _compiled_row_amax(src: torch.dtype):
    return compile_variant(_row_amax_math, _tag("rowamax", src))


def row_amax(x2d: torch.Tensor) -> torch.Tensor:
    """``max_j |x_ij|`` per row, fp32 [rows] (0 for rows without columns)."""
    if x2d.shape[1] == 0 or x2d.shape[0] == 0:
        return torch.zeros(x2d.shape[0], dtype=torch.float32, device=x2d.device)
    x2d = x2d.contiguous()
    if x2d.numel() < MIN_COMPILED or x2d.dtype == torch.float64:
        return _row_amax_math(x2d)
    return _run_compiled(_compiled_row_amax(x2d.dtype), _row_amax_math, x2d)


def _cast_rows_math(x2d, row_scale, fmax: float, dtype):
    return (x2d.float() * row_scale[:, None]).clamp(-fmax, fmax).to(dtype)


def _cast_rows_sr_math(x2d, row_scale, seed, fmax: float, mbits: int, emin: int, dtype):
    # The per-row scale broadcast to elements; Inductor fuses the expand, eager materialises it.
    scale = row_scale[:, None].expand(x2d.shape).reshape(-1)
    return _stochastic_cast_math(x2d.reshape(-1), scale, seed, fmax, mbits, emin, dtype)[0].view(x2d.shape)


def _gemm_values(codes, up):
    # Through fp32 (exact both ways), as ``upcast``: Inductor vectorises float8 -> fp32, not float8 -> bf16.
    return codes.to(torch.float32).to(up)


def _rne_values_math(x2d, row_scale, fmax: float, split: float, step: float, tiny: float, up):
    """The values of the codes ``saturating_cast(x[i] * row_scale[i])`` (RNE) without the codes:
    Inductor's fp32 -> E5M2 conversion is ~2.5x slower than this (measured), and a gradient's codes
    are never kept. Normal range: Veltkamp's split ``t - (t - v)`` with ``t = v (2^(23 - mbits) + 1)``
    rounds ``v`` to ``mbits + 1`` significant bits, ties to even; below ``tiny = 2^emin``: RNE onto
    multiples of the smallest subnormal ``step``. NaN stays NaN; +-0 keep their sign. Bit-identical to
    :func:`_gemm_values` of the codes (tested on every bf16 and random fp32 bit patterns). The constants
    come in as floats: ints would be symbolic under ``dynamic=True`` and recomputed per element."""
    return _rne_round((x2d.float() * row_scale[:, None]).clamp(-fmax, fmax), split, step, tiny).to(up)


def _rne_round(v, split: float, step: float, tiny: float):
    """``v`` (fp32, already within +-fmax) rounded to the FP8 grid: the rounding of :func:`_rne_values_math`."""
    t = v * split
    normal = t - (t - v)
    sub = torch.round(v * (1 / step)) * step
    return torch.where(v.abs() < tiny, sub, normal)


def rne_values_math(x, scale, fmax: float, split: float, step: float, tiny: float, up):
    """:func:`_rne_values_math` for a scalar ``scale``: the GEMM values of ``x``'s codes, no codes."""
    return _rne_round((x.float() * scale).clamp(-fmax, fmax), split, step, tiny).to(up)


def _rne_values_amax_math(x, scale, fmax: float, split: float, step: float, tiny: float, up):
    """:func:`rne_values_math` with ``max |x|`` (:func:`cast_values`)."""
    xf = x.float()
    return rne_values_math(xf, scale, fmax, split, step, tiny, up), xf.abs().amax()


def rne_constants(fmt: Format) -> tuple[float, float, float]:
    """(split, step, tiny) of :func:`_rne_values_math` for ``fmt``."""
    return float(2 ** (23 - fmt.mbits) + 1), 2.0 ** (fmt.emin - fmt.mbits), 2.0 ** fmt.emin


def _cast_rows_up_math(x2d, row_scale, fmax: float, dtype, up, keep_codes: bool):
    codes = _cast_rows_math(x2d, row_scale, fmax, dtype)
    return (codes, _gemm_values(codes, up)) if keep_codes else _gemm_values(codes, up)


def _cast_rows_sr_up_math(x2d, row_scale, seed, fmax: float, mbits: int, emin: int, dtype, up, keep_codes: bool):
    codes = _cast_rows_sr_math(x2d, row_scale, seed, fmax, mbits, emin, dtype)
    return (codes, _gemm_values(codes, up)) if keep_codes else _gemm_values(codes, up)


@functools.cache
def _compiled_cast_rows(fmax: float, dtype: torch.dtype, src: torch.dtype, up=None, keep_codes=True):
    if up is None:
        def cast_rows_kernel(x2d, row_scale):
            return _cast_rows_math(x2d, row_scale, fmax, dtype)
    else:
        def cast_rows_kernel(x2d, row_scale):
            return _cast_rows_up_math(x2d, row_scale, fmax, dtype, up, keep_codes)

    return compile_variant(cast_rows_kernel, _tag("rows", fmax, dtype, src, up, keep_codes))


@functools.cache
def _compiled_rne_values(fmax: float, split: float, step: float, tiny: float, src: torch.dtype, up: torch.dtype):
    def rne_values_kernel(x2d, row_scale):
        return _rne_values_math(x2d, row_scale, fmax, split, step, tiny, up)

    return compile_variant(rne_values_kernel, _tag("rne", fmax, src, up))


@functools.cache
def _compiled_cast_rows_sr(fmax: float, mbits: int, emin: int, dtype: torch.dtype, src: torch.dtype, up=None,
                           keep_codes=True):
    if up is None:
        def cast_rows_sr_kernel(x2d, row_scale, seed):
            return _cast_rows_sr_math(x2d, row_scale, seed, fmax, mbits, emin, dtype)
    else:
        def cast_rows_sr_kernel(x2d, row_scale, seed):
            return _cast_rows_sr_up_math(x2d, row_scale, seed, fmax, mbits, emin, dtype, up, keep_codes)

    return compile_variant(cast_rows_sr_kernel, _tag("rows_sr", fmax, dtype, src, up, keep_codes))


def cast_rows(x2d: torch.Tensor, row_scale: torch.Tensor, fmt: Format, rounding: str = "nearest",
              generator: torch.Generator | None = None, up: torch.dtype | None = None, keep_codes: bool = True,
              seed: torch.Tensor | None = None):
    """Codes ``saturating_cast(x[i] * row_scale[i])`` of a 2-D tensor, one fp32 scale per row.

    Bit-identical to :func:`cast` / :func:`cast_stochastic` of each row with its scalar scale (the
    same math; stochastic rounding draws its bits from one seed of ``generator``, like
    :func:`cast_stochastic` of the flattened tensor). One compiled loop above ``MIN_COMPILED`` elements.

    Args:
        up: also give the codes' values in this dtype (the GEMM operand, :func:`gemm_dtype`) from the
            same loop: ``(codes, values)``, or only ``values`` when ``keep_codes`` is False (an operand
            that is used by GEMMs only, never saved). Same values as :func:`upcast` of the codes, one
            pass over memory fewer.
        seed: stochastic rounding's seed (int64 [1], a stream's draw, ``runtime.sr``) instead of a draw
            from ``generator``.
    """
    x2d = x2d.contiguous()
    row_scale = row_scale.to(torch.float32).contiguous()
    if x2d.numel() == 0:
        codes = torch.empty(x2d.shape, dtype=fmt.torch_dtype, device=x2d.device)
        if up is None:
            return codes
        return (codes, codes.to(up)) if keep_codes else codes.to(up)
    eager_only = x2d.numel() < MIN_COMPILED or x2d.dtype == torch.float64
    if rounding == "nearest" and up is not None and not keep_codes:  # values only: no conversion to codes
        args = (fmt.max, *rne_constants(fmt))
        eager = lambda a, s: _rne_values_math(a, s, *args, up)  # noqa: E731
        if eager_only:
            return eager(x2d, row_scale)
        return _run_compiled(_compiled_rne_values(*args, x2d.dtype, up), eager, x2d, row_scale)
    if rounding == "nearest":
        args = (fmt.max, fmt.torch_dtype)
        if up is None:
            eager = lambda a, s: _cast_rows_math(a, s, *args)  # noqa: E731
        else:
            eager = lambda a, s: _cast_rows_up_math(a, s, *args, up, keep_codes)  # noqa: E731
        if eager_only:
            return eager(x2d, row_scale)
        return _run_compiled(_compiled_cast_rows(*args, x2d.dtype, up, keep_codes), eager, x2d, row_scale)
    if x2d.numel() >= 2 ** 31:
        raise ValueError("cast_rows: stochastic rounding supports fewer than 2**31 elements")
    if up is not None and _upcasts_outside_the_loop(fmt.torch_dtype, up) and not eager_only:
        codes = cast_rows(x2d, row_scale, fmt, rounding, generator, seed=seed)  # the same seed, the same bits
        values = upcast(codes, up)
        return (codes, values) if keep_codes else values
    seed = stochastic_seed(seed, generator, x2d.device)
    args = (fmt.max, fmt.mbits, fmt.emin, fmt.torch_dtype)
    if up is None:
        eager = lambda a, s, sd: _cast_rows_sr_math(a, s, sd, *args)  # noqa: E731
    else:
        eager = lambda a, s, sd: _cast_rows_sr_up_math(a, s, sd, *args, up, keep_codes)  # noqa: E731
    if eager_only:
        return eager(x2d, row_scale, seed)
    return _run_compiled(_compiled_cast_rows_sr(*args, x2d.dtype, up, keep_codes), eager, x2d, row_scale, seed)


def _cast_rows_up_amax_math(x2d, row_scale, fmax: float, dtype, up):
    return _cast_rows_up_math(x2d, row_scale, fmax, dtype, up, True), _row_amax_math(x2d)


def _rne_values_amax_rows_math(x2d, row_scale, fmax: float, split: float, step: float, tiny: float, up):
    return _rne_values_math(x2d, row_scale, fmax, split, step, tiny, up), _row_amax_math(x2d)


def cast_rows_with_amax(x2d: torch.Tensor, row_scale: torch.Tensor, fmt: Format, up: torch.dtype,
                        keep_codes: bool = True):
    """:func:`cast_rows` (nearest rounding, with ``up``) and :func:`row_amax` of the same rows from one
    loop: for a scale known before ``x`` is read (delayed scaling's held scale), the amax to record
    comes out of the cast's own read. The same bits as the two calls (their own math, traced together).

    Args:
        x2d: non-empty 2-D fp16/bf16/fp32 tensor; row_scale: fp32 [rows].
        up: the GEMM dtype of the values; keep_codes: also return the codes.

    Returns:
        (codes or None, values in ``up``, row amax fp32 [rows]).
    """
    x2d, row_scale = x2d.contiguous(), row_scale.to(torch.float32).contiguous()
    if keep_codes:
        (codes, values), amax = run_fused(_cast_rows_up_amax_math, (x2d, row_scale), (fmt.max, fmt.torch_dtype, up))
        return codes, values, amax
    values, amax = run_fused(_rne_values_amax_rows_math, (x2d, row_scale), (fmt.max, *rne_constants(fmt), up))
    return None, values, amax


def group_bounds(offs: torch.Tensor, rows: int) -> list[tuple[int, int]]:
    """Host ``[(start, end)]`` row ranges of the groups from ``offs`` (cumulative ends), checked."""
    ends = offs.tolist()
    bounds, start = [], 0
    for end in ends:
        if end < start or end > rows:
            raise ValueError(f"grouped GEMM: offs must be non-decreasing ends within [0, {rows}], got {ends}")
        bounds.append((start, end))
        start = end
    return bounds


def _alphas(a_scale: torch.Tensor, b_scale: torch.Tensor) -> list[float]:
    # As gemm_tensor_scaled: 1 / (sa * sb) in double, one rounding of the fp32 accumulator.
    return (1.0 / (a_scale.double() * b_scale.double())).tolist()


def grouped_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                 offs: torch.Tensor, out_dtype: torch.dtype, fast_accum: bool = False, a_row_inv=None,
                 b_row_inv=None, a_row_pad=None) -> torch.Tensor:
    """Per group ``out[g] = (a[g] / a_scale[e]) @ (b[e] / b_scale[e]).T``; rows past ``offs[-1]`` are 0.

    Args:
        a: [S, K] codes, rows grouped by expert (group e = rows ``offs[e-1]:offs[e]``).
        a_scale, b_scale: fp32 [E] encode scales.
        b: [E, N, K] codes (any strides; a transposed view is upcast through its base).
        offs: int32 [E] cumulative group ends.
        out_dtype: dtype of the [S, N] result.
        a_row_inv, b_row_inv, a_row_pad: the rows' decode scales and a's padding rows where a cast made
            them (the CUDA module's); the CPU casts make none, and the GEMMs here scale by
            ``a_scale``/``b_scale`` alone and find the groups from ``offs``.

    ``a`` is upcast to :func:`gemm_dtype` once, each expert's ``b[e]`` just before its GEMM (experts
    without rows never are: a whole-stack upcast is one large fresh buffer, whose first-touch page
    faults made the GEMM ~9% slower, 8 x 5632 x 1024 at 1 thread); then a GEMM per group written in
    place with ``alpha`` on the fp32 accumulator. A loop of E matmuls measured as fast as
    ``torch._grouped_mm`` on the same bf16 operands (8 experts, 8192 x 1024 x 5632) and rounds only once.
    """
    dtype = gemm_dtype(out_dtype, a, b)
    bounds = group_bounds(offs, a.shape[0])
    a_up = upcast(a, dtype)
    out = torch.empty(a.shape[0], b.shape[1], dtype=dtype, device=a.device)
    out[bounds[-1][1] if bounds else 0:].zero_()
    for e, ((lo, hi), alpha) in enumerate(zip(bounds, _alphas(a_scale, b_scale))):
        if hi > lo:
            out[lo:hi].addmm_(a_up[lo:hi], upcast(b[e], dtype).t(), beta=0, alpha=alpha)
    return out.to(out_dtype)


def grouped_gemm_wgrad(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                       offs: torch.Tensor, out_dtype: torch.dtype, a_div: torch.Tensor | None = None,
                       b_div: torch.Tensor | None = None) -> torch.Tensor:
    """Per expert ``out[e] = (a[g] / a_scale[e]).T @ (b[g] / b_scale[e])``: [E, M, N] from a [S, M], b [S, N].

    The weight-gradient GEMM (contraction over each group's rows); experts without rows get zeros.
    ``a_div`` [E, M] / ``b_div`` [E, N]: fp32 powers of two the output's rows / columns are divided by
    (as the CUDA module's decode scales do; the grouped ops on CPU fold ``1 / c`` into the operand's
    values instead).
    """
    dtype = gemm_dtype(out_dtype, a, b)
    bounds = group_bounds(offs, a.shape[0])
    out = torch.empty(len(bounds), a.shape[1], b.shape[1], dtype=dtype, device=a.device)
    for e, ((lo, hi), alpha) in enumerate(zip(bounds, _alphas(a_scale, b_scale))):
        if hi > lo:  # each group's rows upcast just before its GEMM (as grouped_gemm's b)
            out[e].addmm_(upcast(a[lo:hi], dtype).t(), upcast(b[lo:hi], dtype), beta=0, alpha=alpha)
        else:
            out[e].zero_()
    if a_div is not None:
        out /= a_div[:, :, None].to(out.dtype)
    if b_div is not None:
        out /= b_div[:, None, :].to(out.dtype)
    return out.to(out_dtype)
