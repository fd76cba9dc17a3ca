"""Saturating casts onto a format's grid: round-to-nearest-even and stochastic rounding (torch family).

The cast is defined on integers so that it is exact in any arithmetic: a finite input
``v = sig * 2**(e - P)`` (``sig`` its significand with the implicit one, ``P`` the source mantissa
width) is counted in units of the target's quantum ``2**(max(e, emin) - mbits)``::

    s = P - mbits + max(0, emin - e)          # bits of sig that the target cannot hold
    n = sig >> s                               # whole quanta
    r = sig & (2**s - 1)                       # the dropped remainder
    nearest:    n += r > 2**(s-1) or (r == 2**(s-1) and n odd)
    stochastic: n += (r + u) >= 2**s,  u uniform in [0, 2**s)   -> E[n * quantum] == v exactly

The result is encoded as sign | exponent field | mantissa and clamped to the format's largest code,
which saturates (Inf and values beyond ``max`` become +-max). NaN becomes the format's NaN code; E2M1
has none and encodes NaN as 0 (the caller marks the group's scale NaN instead, see quantized.py).

``saturating_cast`` uses torch's native fp32 -> float8 conversion for round-to-nearest-even where the
format has a dtype (it is the fast path on CPU and is checked bit-exact against this algorithm and
ml_dtypes in the tests); every other case runs the integer algorithm.
"""

from __future__ import annotations

import torch

from .formats import E2M1, Format, get_format

__all__ = [
    "ROUNDINGS", "check_rounding", "encode", "decode", "saturating_cast", "e8m0_encode", "pack_e2m1", "unpack_e2m1",
    "hash_bits", "uniform_bits", "stochastic_round_bf16", "HASH_CONSTANTS",
]

ROUNDINGS = ("nearest", "stochastic")

# (int dtype, mantissa bits, exponent bias, exponent field mask) of the float dtypes cast exactly.
_SOURCE = {
    torch.float32: (torch.int32, 23, 127, 0xFF),
    torch.float64: (torch.int64, 52, 1023, 0x7FF),
}


def check_rounding(rounding: str) -> str:
    if rounding not in ROUNDINGS:
        raise ValueError(f"unknown rounding {rounding!r}; valid roundings: {', '.join(ROUNDINGS)}")
    return rounding


# murmur3's finalizer constants (0x9E3779B1, 0x85EBCA6B, 0xC2B2AE35) as int32: int32 products wrap
# mod 2**32 in eager torch, in Inductor's vectorised loops and in Triton alike, so all give the same bits.
_GOLDEN, _MIX1, _MIX2 = -1640531535, -2048144789, -1028477387
HASH_CONSTANTS = (_GOLDEN, _MIX1, _MIX2)  # for kernels that compute hash_bits themselves (triton_helpers)


def hash_bits(counters: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
    """32 uniform random bits (int32) per int32 counter: murmur3's finalizer of ``counter * golden + seed``.

    The definition of the counter-based bits of :func:`uniform_bits` (element ``i`` takes counter ``i``);
    written with plain int32 tensor ops so that Inductor compiles it into a fused loop
    (``optim.compiled_step``). Logical right shifts are spelled ``(h >> k) & mask`` because int32 ``>>``
    is arithmetic.
    """
    h = counters * _GOLDEN + seed
    h = (h ^ ((h >> 16) & 0xFFFF)) * _MIX1
    h = (h ^ ((h >> 13) & 0x7FFFF)) * _MIX2
    return h ^ ((h >> 16) & 0xFFFF)


def uniform_bits(n: int, seed: torch.Tensor, device=None, start: int = 0) -> torch.Tensor:
    """32 uniform random bits (int32) per element ``i < n``: :func:`hash_bits` of counter ``start + i``.

    ``seed``: an int32 scalar tensor. Counter-based, so it fuses into a cast loop
    (``kernels.cpu.cast_stochastic``), needs no generator, and any range of counters can be drawn on
    its own (``start``: a chunk of a larger tensor draws exactly the bits of its elements): the
    stochastic casts given a ``seed`` tensor (a model's stream draw, ``fp8pass.runtime.sr``) draw
    these bits. torch's generators (mt19937 eager, Philox in Inductor's scalar CPU code) cost 10-25x
    the cast itself at gradient sizes (measured: 4-12 ms vs 0.4 ms for 720K elements). The bits are
    uniform and uncorrelated enough for unbiased rounding (tested), not for cryptography.
    """
    return hash_bits(torch.arange(start, start + n, dtype=torch.int32, device=device), seed)


def stochastic_round_bf16(x: torch.Tensor, seed: torch.Tensor, start: int = 0,
                          bits: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 ``x`` rounded stochastically to bf16, unbiased: ``E[result] == x`` exactly.

    bf16 is fp32's upper half, so the 16 dropped bits are the fraction of a bf16 step: adding 16
    uniform bits to them carries into the kept half with probability fraction / 2**16, in sign-magnitude
    (the int32 add grows the magnitude of either sign). The bits are the low 16 of
    :func:`uniform_bits` ``(x.numel(), seed, start=start)``, element ``i`` of ``x`` (row-major) taking
    counter ``start + i``, so a kernel computing the same hash of the same counters gives the same
    bf16 values, and a tensor rounded chunk by chunk (each chunk with its first element's counter as
    ``start``) equals the tensor rounded at once. NaN stays NaN; +-Inf stays +-Inf; a value within a
    bf16 step of fp32's max may round to +-Inf (as torch's own fp32 -> bf16 cast does beyond bf16's max).

    Args:
        x: fp32 tensor.
        seed: int32 scalar tensor on ``x``'s device (no host read).
        start: the counter of ``x``'s first element.
        bits: instead of drawing them, the 32 hash bits of ``x``'s elements (int32, ``x``'s shape):
            a caller that computes :func:`hash_bits` itself (the compiled optimizer chunk).
    """
    if x.dtype != torch.float32:
        raise TypeError(f"stochastic_round_bf16 rounds fp32 values, got {x.dtype}")
    xi = x.contiguous().view(torch.int32)
    if bits is None:
        bits = uniform_bits(x.numel(), seed, x.device, start).view(x.shape)
    up = ((xi + (bits & 0xFFFF)) & -65536).view(torch.float32)  # -65536 == 0xFFFF0000: keep the upper half
    return torch.where(torch.isnan(x), x, up).to(torch.bfloat16)  # exact: the low half is zero


def _seeded_bits(shape: torch.Size, seed: torch.Tensor, idt: torch.dtype, device) -> torch.Tensor:
    """Non-negative random integers of ``idt`` (at least 30 bits for int32, 62 for int64) per element
    of ``shape`` (row-major counters) from a seed tensor (int64 [1]; its low 32 bits key the bits)."""
    n = 1
    for d in shape:
        n *= d
    s = seed.reshape(()).to(torch.int32)
    lo = uniform_bits(n, s, device)
    if idt == torch.int32:
        return (lo & 0x7FFFFFFF).view(shape)
    hi = uniform_bits(2 * n, s, device)[n:]  # the next n counters: the upper 30 bits of each element
    return ((lo.long() & 0xFFFFFFFF) | ((hi.long() & 0x3FFFFFFF) << 32)).view(shape)


def _source_float(x: torch.Tensor) -> torch.Tensor:
    """fp16/bf16 widen exactly to fp32; fp32/fp64 are taken as they are."""
    if x.dtype in _SOURCE:
        return x
    if x.dtype in (torch.float16, torch.bfloat16) or x.dtype.is_floating_point:
        return x.float()
    raise TypeError(f"expected a floating-point tensor, got dtype {x.dtype}")


def encode(
    x: torch.Tensor,
    fmt: Format | str,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
    seed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Round ``x`` onto ``fmt``'s grid (saturating) and return the codes as int16 (sign in bit ``bits-1``).

    Args:
        x: floating-point tensor; fp16/bf16 are widened to fp32 first (exact), fp64 is cast exactly.
        fmt: target format (Format or name).
        rounding: "nearest" (ties to even) or "stochastic".
        generator: torch.Generator for the stochastic bits (reproducible), on ``x``'s device.
        seed: instead of ``generator``, an int64 [1] tensor on ``x``'s device: the stochastic bits are
            :func:`uniform_bits` of it, counted over ``x``'s elements in row-major order (no generator,
            no host read).
    """
    fmt = get_format(fmt)
    check_rounding(rounding)
    v = _source_float(x)
    idt, pbits, pbias, emask = _SOURCE[v.dtype]
    bits = v.contiguous().view(idt)
    negative = bits < 0
    mag = bits & ((1 << (pbits + (emask.bit_length()))) - 1)  # drop the sign bit
    efield = mag >> pbits
    mant = mag & ((1 << pbits) - 1)
    is_normal = efield > 0
    sig = torch.where(is_normal, mant | (1 << pbits), mant)
    e = torch.where(is_normal, efield - pbias, torch.full_like(efield, 1 - pbias))
    # Bits to drop; beyond pbits + 2 the value is below half the smallest subnormal and rounds to 0
    # (or to the smallest subnormal under stochastic rounding, with the right probability).
    shift = (pbits - fmt.mbits) + torch.clamp(fmt.emin - e, min=0)
    if rounding == "nearest":
        shift = torch.clamp(shift, max=pbits + 2)
        n = sig >> shift
        rem = sig - (n << shift)
        half = 1 << (shift - 1)
        n = n + ((rem > half) | ((rem == half) & ((n & 1) == 1))).to(n.dtype)
    else:
        # Keep shifts inside the integer width: for tiny inputs drop low bits of sig first, which
        # changes the round-up probability by less than 2**-(width - pbits - 3) of one quantum.
        cap = (31 if idt == torch.int32 else 63) - 1
        pre = torch.clamp(shift - cap, min=0)
        sig = sig >> pre
        shift = shift - pre
        n = sig >> shift
        rem = sig - (n << shift)
        if seed is not None:
            u = _seeded_bits(v.shape, seed, idt, v.device)
        else:
            u = torch.randint(0, 1 << cap, v.shape, generator=generator, device=v.device, dtype=idt)
        n = n + ((rem + (u & ((1 << shift) - 1))) >> shift)
    # Normalise a carry out of the mantissa, then assemble exponent field and mantissa.
    eb = torch.clamp(e, min=fmt.emin)
    carry = n >> (fmt.mbits + 1)
    n = n >> carry
    eb = eb + carry
    subnormal = n < (1 << fmt.mbits)
    code = torch.where(
        subnormal, n, ((eb + fmt.bias) << fmt.mbits) | (n - (1 << fmt.mbits))
    )
    # Inf (and anything beyond max) saturates; codes are monotone in magnitude.
    code = torch.clamp(code, max=fmt.max_code)
    code = torch.where(efield == emask, torch.full_like(code, fmt.max_code), code)
    nan = torch.isnan(v)
    if fmt.nan_code is not None:
        code = torch.where(nan, torch.full_like(code, fmt.nan_code), code)
    else:
        code = torch.where(nan, torch.zeros_like(code), code)
    if fmt.signed:
        code = code | (negative.to(code.dtype) << (fmt.bits - 1))
    return code.to(torch.int16)


def _codes_to_storage(code: torch.Tensor, fmt: Format) -> torch.Tensor:
    if fmt.torch_dtype is not None:
        return code.to(torch.uint8).view(fmt.torch_dtype)
    if fmt.packed:
        return pack_e2m1(code.to(torch.uint8))
    return code.to(torch.uint8)


def saturating_cast(
    x: torch.Tensor,
    fmt: Format | str,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
    seed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Cast ``x`` (already scaled) to ``fmt``: fp8 dtype codes, or packed uint8 for E2M1.

    Values beyond ``fmt.max`` clamp to +-max, NaN stays NaN (E2M1: becomes 0), -0 stays -0.
    ``generator`` / ``seed``: the stochastic bits' source (:func:`encode`).
    """
    fmt = get_format(fmt)
    check_rounding(rounding)
    if fmt.name == "e8m0":
        return e8m0_encode(x)
    if rounding == "nearest" and fmt.torch_dtype is not None and x.dtype != torch.float64:
        # Native RNE conversion from fp32 (exact widening first for fp16/bf16); it overflows to NaN,
        # so clamp first. clamp keeps NaN and -0.
        v = _source_float(x)
        return torch.clamp(v, -fmt.max, fmt.max).to(fmt.torch_dtype)
    return _codes_to_storage(encode(x, fmt, rounding, generator, seed), fmt)


def e8m0_encode(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 codes (uint8) of positive scales, rounded down to a power of two: ``floor(log2(s)) + 127``.

    MX block scales are powers of two by construction (``2**floor(log2(amax)) / 2**emax_elem``), so
    rounding down is exact for them and, for any other scale, never makes ``x * scale`` overflow.
    Values below 2**-127 (zero and fp32 subnormals included) take code 0 (2**-127); NaN, negative
    values and Inf take 255 (NaN) - a scale must be positive and finite.
    """
    v = scale.to(torch.float32)
    code = (v.view(torch.int32) >> 23) & 0xFF
    bad = torch.isnan(v) | (v < 0) | torch.isinf(v)
    code = torch.where(bad, torch.full_like(code, 0xFF), code)
    return code.to(torch.uint8)


def _e2m1_values(device: torch.device) -> torch.Tensor:
    mags = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], device=device)
    return torch.cat([mags, -mags])


def decode(data: torch.Tensor, fmt: Format | str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Exact values of stored codes (fp8 dtype tensor, or packed uint8 for E2M1) in ``dtype``."""
    fmt = get_format(fmt)
    if fmt.torch_dtype is not None:
        return data.view(fmt.torch_dtype).to(dtype)
    if fmt is E2M1 or fmt.packed:
        codes = unpack_e2m1(data)
        return _e2m1_values(data.device)[codes.long()].to(dtype)
    if fmt.name == "e8m0":
        out = torch.exp2(data.to(torch.float32) - fmt.bias)
        return torch.where(data == fmt.nan_code, torch.nan, out).to(dtype)
    raise ValueError(f"cannot decode format {fmt}")


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes (uint8, last dim even) two per byte: element 2k low nibble, 2k+1 high."""
    if codes.shape[-1] % 2:
        raise ValueError(f"E2M1 packing needs an even last dimension, got shape {tuple(codes.shape)}")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_e2m1: uint8 [..., n/2] -> uint8 codes [..., n]."""
    p = packed.view(torch.uint8)
    return torch.stack([p & 0xF, p >> 4], dim=-1).flatten(-2)
