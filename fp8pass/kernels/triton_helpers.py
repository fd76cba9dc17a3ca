"""Shared in-kernel helpers of every Triton kernel in fp8pass (public: import them, do not copy them).

=========================  ====================================================================================
``cast_codes``             the one exact in-kernel FP8/FP4 cast (RNE or stochastic): the hardware conversion on
                           sm_89+ (``hardware_cast``), else the integer encoder ``encode``
``encode``                 the integer encoder (algorithm: ``fp8pass.numerics.casts.encode``)
``stochastic_grid``        stochastic rounding on the fp32 bits, so an exact conversion can follow
``on_grid_codes``          the codes of a value already on the grid: the hardware conversion or ``encode``
``philox4`` and friends    Philox4x32-10 bits keyed by an int64 element index, one call per four elements
``hash_bits``              ``numerics.casts.hash_bits`` (murmur3's finalizer of a counter), bit for bit
``stochastic_round_bf16``  ``numerics.casts.stochastic_round_bf16`` of fp32 values, as bf16 bits (int16)
``tile_scale``             ``scale_from_amax`` of one amax, in a kernel
``max_propagating_nan``    max that keeps NaN (``abs_max`` / ``abs_max_2d``: max |x| of a block)
``autotune``, ``size_class``  autotuning that never benchmarks under the interpreter, keyed on bit lengths
``INTERPRETING``           whether kernels run in Triton's interpreter (``INTERPRETED``: the same as a constexpr)
``hardware_cast``          the cast kernels' HW constexpr for a device and format
``random_seed``            a Philox seed drawn on the device (no host synchronisation)
``stream_seed``            a seed from a model's stochastic-rounding stream, advanced on the device (runtime.sr)
``decode_codes``           the exact fp32 value of 8-bit codes: the hardware conversion on sm_89+, else integer ops
``decode_table``           the fp32 value of every code of an FP8 dtype (a kernel decodes by one gather)
=========================  ====================================================================================
"""

from __future__ import annotations

import functools
import inspect
import os

import torch
import triton
import triton.language as tl

from ..numerics.casts import HASH_CONSTANTS
from ..numerics.formats import Format
from ..numerics.scaling import HUGE_AMAX

__all__ = ["INTERPRETING", "INTERPRETED", "HW_FORMATS", "autotune", "size_class", "check_interpretable", "encode",
           "max_propagating_nan", "abs_max", "abs_max_2d", "stochastic_grid", "on_grid_codes", "cast_codes",
           "random_bits", "hash_bits", "stochastic_round_bf16", "philox4", "random_bits4", "philox_pick", "philox_at", "random_bits_at", "tile_scale",
           "hardware_cast", "hardware_rne", "random_seed", "stream_seed", "decode_codes", "decode_table"]


def _interpreting() -> bool:
    """Whether ``triton.jit`` builds interpreted kernels in this process (TRITON_INTERPRET=1)."""
    try:
        from triton import knobs

        return bool(knobs.runtime.interpret)
    except (ImportError, AttributeError):  # triton < 3.4 reads the variable directly
        return os.environ.get("TRITON_INTERPRET", "0") == "1"


INTERPRETING = _interpreting()
INTERPRETED = tl.constexpr(INTERPRETING)  # the same, readable inside kernels

def _quick_bench(kernel_call, quantiles):
    """Autotuning benchmark: a few ms per config (triton's default spends ~125 ms on each)."""
    from triton.testing import do_bench

    return do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)


def autotune(configs: list, key: list[str], interpret: triton.Config, **kwargs):
    """``triton.autotune`` over ``configs`` keyed on ``key``; under the interpreter only ``interpret``.

    One config means no benchmarking, so the CPU tests never time anything; the choice is explicit
    (``INTERPRETING``), never inferred from the absence of CUDA.
    """
    if "do_bench" in inspect.signature(triton.autotune).parameters:
        kwargs.setdefault("do_bench", _quick_bench)
    return triton.autotune(configs=[interpret] if INTERPRETING else configs, key=key, **kwargs)


def size_class(n: int) -> int:
    """The autotuning key of a size: its bit length (one tuning per power-of-two range)."""
    return int(n).bit_length()


def check_interpretable(device: torch.device) -> None:
    """A clear error when a compiled Triton kernel would get CPU tensors (it would fault instead)."""
    if torch.device(device).type == "cpu" and not INTERPRETING:
        raise RuntimeError(
            "Triton kernels on CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 before "
            "triton is first imported (or use the torch kernels: FP8PASS_KERNELS=torch, kernels='torch')")


@triton.jit
def encode(v, rbits, MBITS: tl.constexpr, BIAS: tl.constexpr, MAX_CODE: tl.constexpr,
            NAN_CODE: tl.constexpr, SIGN_SHIFT: tl.constexpr, STOCHASTIC: tl.constexpr):
    """Saturating RNE / stochastic codes of fp32 ``v`` (see casts.encode for the math)."""
    bits = v.to(tl.int32, bitcast=True)
    negative = bits < 0
    mag = bits & 0x7FFFFFFF
    efield = mag >> 23
    mant = mag & 0x7FFFFF
    is_normal = efield > 0
    sig = tl.where(is_normal, mant | 0x800000, mant)
    e = tl.where(is_normal, efield - 127, -126)
    emin = 1 - BIAS
    shift = (23 - MBITS) + tl.maximum(emin - e, 0)
    one = tl.full(v.shape, 1, tl.int32)
    if STOCHASTIC:
        pre = tl.maximum(shift - 30, 0)
        sig = sig >> pre
        shift = shift - pre
        n = sig >> shift
        rem = sig - (n << shift)
        u = rbits & ((one << shift) - 1)
        n = n + ((rem + u) >> shift)
    else:
        shift = tl.minimum(shift, 25)
        n = sig >> shift
        rem = sig - (n << shift)
        half = one << (shift - 1)
        up = (rem > half) | ((rem == half) & ((n & 1) == 1))
        n = n + up.to(tl.int32)
    eb = tl.maximum(e, emin)
    carry = n >> (MBITS + 1)
    n = n >> carry
    eb = eb + carry
    code = tl.where(n < (1 << MBITS), n, ((eb + BIAS) << MBITS) | (n - (1 << MBITS)))
    code = tl.minimum(code, MAX_CODE)
    code = tl.where(efield == 255, MAX_CODE, code)
    code = tl.where(v != v, NAN_CODE, code)
    return code | (negative.to(tl.int32) << SIGN_SHIFT)


@triton.jit
def max_propagating_nan(a, b):
    """maximum(a, b), NaN if either is NaN: one ``max.NaN.f32`` (FMNMX.NAN) on sm_80+ (the plain
    ``tl.maximum`` returns the other operand, so a max tree would drop a NaN)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def abs_max(x):
    """max |x| over a 1-D block, NaN if x holds NaN: one NaN-propagating max per element (|x| is a free
    operand modifier), one reduction tree; reference: ``torch_family.tensor_amax``. The interpreter
    takes the max and a NaN test instead: it runs a custom ``tl.reduce`` combine as Python calls, 300x
    slower (17 s for a 512 x 512 amax)."""
    if INTERPRETED:
        return tl.where(tl.max((x != x).to(tl.int32)) > 0, float("nan"), tl.max(tl.abs(x)))
    return tl.reduce(tl.abs(x), 0, max_propagating_nan)


@triton.jit
def abs_max_2d(x):
    """max |x| of a 2-D block, NaN if it holds NaN (one NaN-propagating max per element; the interpreter
    takes the max and a NaN test: its custom ``tl.reduce`` combines are Python calls, far slower)."""
    if INTERPRETED:
        has_nan = tl.max(tl.max((x != x).to(tl.int32), axis=1), axis=0)
        return tl.where(has_nan > 0, float("nan"), tl.max(tl.max(tl.abs(x), axis=1), axis=0))
    return tl.reduce(tl.reduce(tl.abs(x), 1, max_propagating_nan), 0, max_propagating_nan)


@triton.jit
def stochastic_grid(v, rbits, MBITS: tl.constexpr, BIAS: tl.constexpr):
    """Stochastic rounding of fp32 ``v`` done on its bits, for a conversion that then only has to be exact.

    ``encode``'s stochastic algorithm (casts.encode) with the same bits ``u = rbits mod 2**s``: with
    ``s`` the bits of the significand the format drops at v's exponent,

        s <= 23 (|v| >= the smallest subnormal q):  t = (bits(v) + u) & ~(2**s - 1)
            adds u below the kept bits and truncates: t is v rounded up iff rem + u >= 2**s, a value on
            the format's grid (a carry out of the mantissa moves into the exponent field, which is
            exactly the reference's carry), or beyond max (the conversion saturates it), sign kept;
        s > 23 (|v| < q, zeros and fp32 subnormals):  n = ((sig >> (s - s')) + u) >> s',  s' = min(s, 30)
            n in {0, 1} is the code (0 or q), as the reference computes it.

    Returns (t as fp32, tiny = s > 23, n). Inf and NaN pass through as t unchanged.
    """
    bits = v.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    # s = 23 - MBITS + max(emin - e, 0) with e = field - 127, capped at 54: from 24 + 30 on every
    # significand bit is dropped (the reference's pre-shift leaves 0), fp32 subnormals included
    shift = tl.minimum(tl.maximum((151 - BIAS - MBITS) - (mag >> 23), 23 - MBITS), 54)
    s = tl.minimum(shift, 30)
    keep = -1 << s  # the bits the format keeps
    u = rbits & ~keep
    t = tl.where(mag >= 0x7F800000, bits, (bits + u) & keep)
    sig = (mag & 0x7FFFFF) | 0x800000  # with the implicit bit (wrong for subnormals, whose shift is 54)
    n = ((sig >> (shift - s)) + u) >> s
    return t.to(tl.float32, bitcast=True), shift > 23, n


@triton.jit
def on_grid_codes(w, MBITS: tl.constexpr, BIAS: tl.constexpr, MAX_CODE: tl.constexpr, NAN_CODE: tl.constexpr,
                  SIGN_SHIFT: tl.constexpr, HW: tl.constexpr):
    """Codes (int32) of fp32 ``w`` that is on the format's grid (or beyond its max, Inf, NaN), so that any
    rounding gives them: HW = 1 the hardware conversion (fp32 -> float8e4nv / float8e5, saturating), else
    the integer encoder. NaN's sign is the caller's to fix (``cast_codes``)."""
    if HW == 1:
        if MBITS == 3:
            c = w.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
        else:
            c = w.to(tl.float8e5).to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        c = encode(w, 0, MBITS, BIAS, MAX_CODE, NAN_CODE, SIGN_SHIFT, False)
    return c


@triton.jit
def cast_codes(v, rbits, MBITS: tl.constexpr, BIAS: tl.constexpr, MAX_CODE: tl.constexpr,
                NAN_CODE: tl.constexpr, SIGN_SHIFT: tl.constexpr, STOCHASTIC: tl.constexpr, HW: tl.constexpr):
    """Codes (int32) of fp32 ``v``: saturating RNE or stochastic, as ``casts.saturating_cast`` /
    ``casts.encode`` compute them (bit for bit, stochastic codes for the same random bits).

    HW = 0: the integer encoder ``encode`` (the interpreter, E2M1, formats clamped below their
    encoding's max such as E4M3_GAUDI, GPUs without the conversion).
    HW = 1 (the launchers set it for CUDA tensors on sm_89+, E4M3/E5M2: ``hardware_cast``): Triton's
    fp32 -> float8e4nv / float8e5 conversion, one ``cvt.rn.satfinite.{e4m3,e5m2}x2.f32`` per two
    elements (SASS ``F2FP.SATFINITE``): round to nearest even; finite values beyond max and +-Inf to
    +-max; -0 to -0; fp32 subnormals to +-0, as the reference. Its one difference: NaN becomes the
    canonical NaN 0x7F whatever the sign, where the reference keeps it (0xFF for -NaN); OR-ing v's sign
    bit into bit 7 fixes that and changes nothing else (every other code carries v's sign already).
    Stochastic rounding first moves v onto the grid (``stochastic_grid``), so the conversion is exact.
    HW = 2: HW = 1's algorithm with the conversion done by ``encode`` (exact for on-grid values): the
    interpreter's check of the stochastic path (tests/kernels/test_cast_hw.py).
    """
    if HW:
        w = v
        if STOCHASTIC:
            w, tiny, n = stochastic_grid(v, rbits, MBITS, BIAS)
        c = on_grid_codes(w, MBITS, BIAS, MAX_CODE, NAN_CODE, SIGN_SHIFT, HW)
        if STOCHASTIC:
            c = tl.where(tiny, n, c)
        return c | ((v.to(tl.int32, bitcast=True) >> 24) & 0x80)
    else:
        return encode(v, rbits, MBITS, BIAS, MAX_CODE, NAN_CODE, SIGN_SHIFT, STOCHASTIC)


@triton.jit
def decode_codes(c, MBITS: tl.constexpr, BIAS: tl.constexpr, IEEE_SPECIALS: tl.constexpr, HW: tl.constexpr):
    """fp32 value of 8-bit codes ``c`` (int32 0..255), exact. HW (sm_89+ GPUs): the hardware
    conversion to fp16 (every E4M3 and E5M2 value is an fp16 value: exact, Inf/NaN kept), then to fp32.
    Otherwise by integer assembly of the fp32 bits (the interpreter, older GPUs)."""
    if HW:
        if IEEE_SPECIALS:
            val = c.to(tl.uint8).to(tl.float8e5, bitcast=True).to(tl.float32)
        else:
            val = c.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
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
        val = tl.where((c & 0x80) != 0, -val, val)
    return val


@triton.jit
def random_bits(seed, offs):
    """30 random bits per element: Philox keyed by ``seed`` with the element's int64 index as counter
    (low word, high word), so no two elements of a tensor share bits; for indices below 2**32 these
    are exactly ``tl.randint(seed, offs)``'s bits."""
    lo = offs.to(tl.uint32)
    hi = (offs >> 32).to(tl.uint32)
    zero = lo * 0
    r, _, _, _ = tl.philox(seed, lo, hi, zero, zero)
    return (r & 0x3FFFFFFF).to(tl.int32)


_GOLDEN_C, _MIX1_C, _MIX2_C = (tl.constexpr(c) for c in HASH_CONSTANTS)


@triton.jit
def hash_bits(counter, seed):
    """``numerics.casts.hash_bits``: 32 random bits (int32) of int32 ``counter`` under int32 ``seed``,
    the same int32 ops (products wrap mod 2**32; ``(h >> k) & mask`` is the logical shift)."""
    h = counter * _GOLDEN_C + seed
    h = (h ^ ((h >> 16) & 0xFFFF)) * _MIX1_C
    h = (h ^ ((h >> 13) & 0x7FFFF)) * _MIX2_C
    return h ^ ((h >> 16) & 0xFFFF)


@triton.jit
def stochastic_round_bf16(x, seed, counter):
    """``numerics.casts.stochastic_round_bf16`` of fp32 ``x``, element-wise with its int32 ``counter``:
    the bf16 bits as int16 (store them through an int16 view). The low 16 hash bits are added to the
    fp32 bits (sign-magnitude: the magnitude grows for either sign) and the upper half is kept; NaN
    becomes 0x7FC0 (torch's scalar conversion's NaN; its vectorised CPU one may give another NaN)."""
    bits = x.to(tl.int32, bitcast=True)
    up = (bits + (hash_bits(counter, seed) & 0xFFFF)) >> 16
    return tl.where(x != x, 0x7FC0, up).to(tl.int16)


@triton.jit
def philox4(seed, k):
    """The four 32-bit outputs of Philox4x32-10 at counter ``k`` (int64: low word, high word, 0, 0) under
    ``seed``: ``tl.philox(seed, lo, hi, 0, 0)`` bit for bit (tests/kernels/test_cast_hw.py), with each round's
    two 32 x 32-bit products taken as 64-bit ones, which ptxas issues as one IMAD.WIDE.U32 each where
    ``tl.philox``'s umulhi + mul pairs are often two IMADs."""
    s = seed.to(tl.uint64, bitcast=True)
    k0 = (s & 0xFFFFFFFF).to(tl.uint32)
    k1 = (s >> 32).to(tl.uint32)
    c0 = k.to(tl.uint32)
    c1 = (k >> 32).to(tl.uint32)
    c2 = c0 * 0
    c3 = c0 * 0
    for _ in tl.static_range(10):
        p0 = c0.to(tl.uint64) * 0xD2511F53
        p2 = c2.to(tl.uint64) * 0xCD9E8D57
        c0 = (p2 >> 32).to(tl.uint32) ^ c1 ^ k0
        c2 = (p0 >> 32).to(tl.uint32) ^ c3 ^ k1
        c1 = p2.to(tl.uint32)
        c3 = p0.to(tl.uint32)
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1, c2, c3


@triton.jit
def random_bits4(seed, k):
    """30 random bits for each of elements ``4k .. 4k+3`` from one Philox call per ``k``: element
    ``4k + j`` takes output j. Returns ``k.shape + [2, 2]``, reshaped by the caller to ``4 * k``'s
    elements in order (index [.., a, b] is element 4k + 2a + b)."""
    r0, r1, r2, r3 = philox4(seed, k)
    r = tl.join(tl.join(r0, r2), tl.join(r1, r3))
    return (r & 0x3FFFFFFF).to(tl.int32)


@triton.jit
def philox_pick(seed, quad, lane):
    """Output ``lane`` (0..3) of Philox at counter ``quad``: element ``4 * quad + lane``'s 32 random bits.
    Elements whose ``quad`` is the same value (e.g. a per-register constant plus a shared base) share
    one Philox call: LLVM merges the identical calls."""
    r0, r1, r2, r3 = philox4(seed, quad)
    r = tl.where(lane == 0, r0, tl.where(lane == 1, r1, tl.where(lane == 2, r2, r3)))
    return r.to(tl.int32, bitcast=True)


@triton.jit
def philox_at(seed, offs):
    """32 random bits of element ``offs`` (int64 flat index): output ``offs % 4`` of Philox at counter
    ``offs // 4``, the bits ``random_bits4`` gives that element. In a flat block (offsets a multiple of
    the block plus an arange) LLVM sees the four elements of a quad share ``offs // 4``: one call each."""
    return philox_pick(seed, offs >> 2, offs & 3)


@triton.jit
def random_bits_at(seed, offs):
    """``philox_at``'s bits, 30 of them (``encode`` uses at most 30)."""
    return philox_at(seed, offs) & 0x3FFFFFFF


HUGE_AMAX_C = tl.constexpr(HUGE_AMAX)  # amaxes from here up scale like Inf (scaling.amax_is_usable)


@triton.jit
def tile_scale(amax, FMAX: tl.constexpr, MAX_SCALE_C: tl.constexpr, POW2: tl.constexpr,
                NAN_SCALE: tl.constexpr):
    """:func:`fp8pass.numerics.scale_from_amax` of one amax (a tile's, a tensor's): ``FMAX / amax`` (FMAX: the
    format's max over ``2**margin``), capped at ``MAX_SCALE``, optionally floored to a power of two; 1 for
    an amax that is 0, NaN, Inf or >= ``HUGE_AMAX`` (NaN for a NaN amax in formats without a NaN code)."""
    scale = tl.minimum(tl.math.div_rn(FMAX + amax * 0.0, amax), MAX_SCALE_C)
    if POW2:
        scale = (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    ok = (amax > 0) & (amax < HUGE_AMAX_C)
    fallback = 1.0
    if NAN_SCALE:
        fallback = tl.where(amax != amax, float("nan"), 1.0)
    return tl.where(ok, scale, fallback)


# (mbits, bias, max) of the formats whose RNE cast the hardware does exactly: cvt.rn.satfinite saturates
# to the format's own largest finite value, so a format clamped lower (E4M3_GAUDI) keeps the encoder.
HW_FORMATS = {(3, 7, 448.0), (2, 15, 57344.0)}


@functools.lru_cache(maxsize=None)
def _has_fp8_cvt(index: int) -> bool:
    """NVIDIA sm_89+ (Ada, Hopper, Blackwell): fp32 -> e4m3/e5m2 ``cvt.rn.satfinite`` in hardware."""
    return torch.version.hip is None and torch.cuda.get_device_capability(index) >= (8, 9)


def hardware_cast(device: torch.device, fmt: Format) -> int:
    """The cast kernels' HW constexpr (``cast_codes``) on ``device``: 1 for compiled kernels on an sm_89+
    NVIDIA GPU and E4M3 / E5M2 with their hardware max (either rounding), else 0. Never 1 under the
    interpreter (its fp32 -> fp8 conversion is not the hardware's: docs/background.md, Traps)."""
    device = torch.device(device)
    if device.type != "cuda" or INTERPRETING or fmt.torch_dtype is None:
        return 0
    if (fmt.mbits, fmt.bias, float(fmt.max)) not in HW_FORMATS:
        return 0
    return int(_has_fp8_cvt(device.index if device.index is not None else torch.cuda.current_device()))


def hardware_rne(device: torch.device, fmt: Format, rounding: str = "nearest") -> bool:
    """Whether a round-to-nearest-even cast on ``device`` takes the hardware conversion (``hardware_cast``)."""
    return rounding == "nearest" and bool(hardware_cast(device, fmt))


def random_seed(generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """A Philox seed as an int64 [1] tensor on ``device``, drawn without a host synchronisation:
    from ``generator`` (on its own device) or from ``device``'s default generator."""
    device = torch.device(device)
    where = generator.device if generator is not None else device
    seed = torch.randint(0, 2**31 - 1, (1,), generator=generator, device=where, dtype=torch.int64)
    return seed if where == device else seed.to(device, non_blocking=True)


@triton.jit
def _stream_seed_kernel(stream_ptr, seed_ptr, N: tl.constexpr, NP: tl.constexpr):
    """``runtime.sr.mix_seed`` of ``[key, draws + j]`` into ``seed_ptr[j]`` for ``j < N``, then
    ``draws += N`` (NP: N rounded up to a power of two)."""
    key = tl.load(stream_ptr)
    draws = tl.load(stream_ptr + 1)
    j = tl.arange(0, NP)
    m = tl.full([], 0xFFFFFFFF, tl.int64)
    h = (key * 0x27D4EB2D + ((draws + j) & m) * 0x165667B1 + 0x3C6EF372) & m
    h = (((h >> 16) ^ h) * 0x45D9F3B) & m
    h = (((h >> 16) ^ h) * 0x45D9F3B) & m
    tl.store(seed_ptr + j, ((h >> 16) ^ h) & 0x7FFFFFFF, mask=j < N)
    tl.store(stream_ptr + 1, draws + N)


def stream_seed(stream: torch.Tensor, n: int = 1) -> torch.Tensor:
    """The seeds (int64 [n], on the stream's device) of a stochastic-rounding stream's next ``n``
    draws, and the stream advanced: one launch, no host synchronisation (``fp8pass.runtime.sr``)."""
    check_interpretable(stream.device)
    seed = torch.empty(n, dtype=torch.int64, device=stream.device)
    _stream_seed_kernel[(1,)](stream, seed, N=n, NP=triton.next_power_of_2(n))
    return seed


_DECODE_TABLES: dict[tuple, torch.Tensor] = {}


def decode_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """fp32 [256]: the value of every code of the FP8 ``dtype`` (torch's conversion), made once per device."""
    key = (dtype, device)
    if key not in _DECODE_TABLES:
        _DECODE_TABLES[key] = torch.arange(256, dtype=torch.uint8, device=device).view(dtype).to(torch.float32)
    return _DECODE_TABLES[key]
