"""Casts against ml_dtypes, the independent oracle: every fp16/bf16 pattern, >= 10^7 fp32 midpoints."""

import ml_dtypes
import numpy as np
import pytest
import torch

from fp8pass.kernels import triton_family
from fp8pass.numerics import E2M1, E4M3, E4M3_GAUDI, E5M2, decode, encode, saturating_cast, unpack_e2m1

ORACLE = {E4M3: ml_dtypes.float8_e4m3fn, E4M3_GAUDI: ml_dtypes.float8_e4m3fn, E5M2: ml_dtypes.float8_e5m2,
          E2M1: ml_dtypes.float4_e2m1fn}
FORMATS = list(ORACLE)


def oracle_codes(x32: np.ndarray, fmt) -> np.ndarray:
    """ml_dtypes does not saturate: clamp to +-max first, then cast (its cast is RNE)."""
    return np.clip(x32, -fmt.max, fmt.max).astype(ORACLE[fmt]).view(np.uint8)


def codes_of(data: torch.Tensor, fmt) -> np.ndarray:
    if fmt.packed:
        return unpack_e2m1(data).numpy()
    return data.view(torch.uint8).numpy()


def all_patterns(dtype) -> torch.Tensor:
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    return x[torch.isfinite(x)]


def midpoint_sweep(fmt, n_random: int, seed: int = 0) -> torch.Tensor:
    """fp32 values on and around every rounding midpoint of ``fmt``, and beyond max.

    For each pair of neighbouring grid points (subnormals included): the exact midpoint, the 64 fp32
    values on each side of it, and uniform random values in the interval; both signs.
    """
    g = torch.Generator().manual_seed(seed)
    mags = torch.tensor(sorted({abs(v) for v in decode_all(fmt)}), dtype=torch.float64)
    lo, hi = mags[:-1], mags[1:]
    mids = ((lo + hi) / 2).float()
    # Beyond max: the saturating region up to 2 * max.
    extra_mid = torch.tensor([fmt.max * 1.03125, fmt.max * 1.5, fmt.max * 2], dtype=torch.float32)
    centers = torch.cat([mids, extra_mid])
    offs = torch.arange(-64, 65, dtype=torch.int32)
    near = (centers.view(torch.int32)[:, None] + offs[None, :]).flatten().view(torch.float32)
    idx = torch.randint(0, lo.numel(), (n_random,), generator=g)
    u = torch.rand(n_random, generator=g, dtype=torch.float64)
    rand = (lo[idx] + u * (hi[idx] - lo[idx])).float()
    tiny = torch.rand(1000, generator=g) * fmt.min_subnormal
    vals = torch.cat([near, rand, tiny, torch.tensor([0.0, fmt.max, fmt.min_subnormal / 2])])
    vals = vals[vals >= 0]
    return torch.cat([vals, -vals])


def decode_all(fmt):
    if fmt.packed:
        return decode(torch.arange(0, 256, dtype=torch.int32).to(torch.uint8), fmt).tolist()
    vals = torch.arange(0, 256, dtype=torch.int32).to(torch.uint8).view(fmt.torch_dtype).float()
    vals = vals[torch.isfinite(vals) & (vals.abs() <= fmt.max)]
    return vals.tolist()


def cast_paths(x: torch.Tensor, fmt):
    """The three implementations: torch fast path, integer reference, Triton (interpreter on CPU)."""
    yield "saturating_cast", saturating_cast(x, fmt)
    yield "encode", encode(x, fmt).to(torch.uint8) if not fmt.packed else None
    data, _ = triton_family.cast_scaled(x.float().contiguous(), torch.tensor(1.0), fmt)
    yield "triton", data


def check_against_oracle(x: torch.Tensor, fmt):
    ref = oracle_codes(x.float().numpy(), fmt)
    finite = np.isfinite(x.float().numpy())
    for name, data in cast_paths(x, fmt):
        if data is None:
            # packed formats: compare the unpacked integer reference directly
            data = encode(x, fmt).to(torch.uint8) & 0xF
            got = data.numpy()
        else:
            got = codes_of(data, fmt)
        bad = np.flatnonzero((got != ref) & finite)
        assert bad.size == 0, (
            f"{fmt} {name}: {bad.size} mismatches, e.g. x={x.float().numpy()[bad[:5]]} "
            f"ours={got[bad[:5]]} oracle={ref[bad[:5]]}"
        )


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_every_finite_half_pattern(fmt, dtype):
    check_against_oracle(all_patterns(dtype), fmt)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_fp32_midpoints(fmt):
    # 3.4M values per format, 13.6M over the four formats: >= 10^7 fp32 values in all.
    x = midpoint_sweep(fmt, n_random=1_700_000)
    assert x.numel() >= 3_400_000
    check_against_oracle(x, fmt)


@pytest.mark.parametrize("fmt", [E4M3, E5M2, E2M1], ids=lambda f: f.name)
def test_fp64_has_no_double_rounding(fmt):
    # Just above a midpoint by less than fp32 resolution: fp64 -> fp32 -> fmt would round to the
    # midpoint and then tie to even; the exact answer is the upper neighbour.
    grid = sorted({abs(v) for v in decode_all(fmt)})
    lo, hi = torch.tensor(grid[:-1], dtype=torch.float64), torch.tensor(grid[1:], dtype=torch.float64)
    mid = (lo + hi) / 2
    above, below = mid * (1 + 2.0**-40), mid * (1 - 2.0**-40)

    def values(x):  # pad to an even count so E2M1 can pack
        padded = torch.cat([x, x.new_zeros(x.numel() % 2)])
        return decode(saturating_cast(padded, fmt), fmt).double()[: x.numel()]

    assert torch.equal(values(above), hi) and torch.equal(values(below), lo)
    assert torch.equal(values(-above), -hi)


@pytest.mark.parametrize("fmt", [E4M3, E5M2, E2M1], ids=lambda f: f.name)
def test_special_values(fmt):
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e30, -1e30, 1.0])
    vals = decode(saturating_cast(x, fmt), fmt)
    if fmt.nan_code is not None:
        assert torch.isnan(vals[0])
    else:
        assert vals[0] == 0  # E2M1 has no NaN: quantize() marks the group's scale NaN instead
    assert vals[1] == fmt.max and vals[2] == -fmt.max
    assert vals[3] == 0 and torch.signbit(vals[3]) and not torch.signbit(vals[4])
    assert vals[5] == fmt.max and vals[6] == -fmt.max


def test_gaudi_clamps_to_240():
    x = torch.tensor([239.0, 241.0, 250.0, 448.0, -1000.0])
    vals = decode(saturating_cast(x, E4M3_GAUDI), E4M3_GAUDI)
    assert vals.tolist() == [240.0, 240.0, 240.0, 240.0, -240.0]
    assert E4M3_GAUDI.max_code == 0x77 and E4M3.max_code == 0x7E and E5M2.max_code == 0x7B


def test_e8m0_scales_against_ml_dtypes():
    from fp8pass.numerics import E8M0

    # Every power of two E8M0 holds, and values between them (rounded down), against ml_dtypes.
    p = torch.exp2(torch.arange(-127, 128, dtype=torch.float64)).float()
    codes = saturating_cast(p, E8M0)
    ref = p.numpy().astype(ml_dtypes.float8_e8m0fnu).view(np.uint8)
    np.testing.assert_array_equal(codes.numpy(), ref)
    assert torch.equal(decode(codes, E8M0), p)
    between = p[:-1] * 1.75
    assert torch.equal(decode(saturating_cast(between, E8M0), E8M0), p[:-1])
    special = saturating_cast(torch.tensor([0.0, float("nan"), -1.0, float("inf")]), E8M0)
    assert special.tolist() == [0, 255, 255, 255]
