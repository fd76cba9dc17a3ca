"""The Triton family (interpreter on CPU) is bit-identical to the torch family."""

import pytest
import torch

from fp8pass.numerics import E2M1, E4M3, E4M3_GAUDI, E5M2
from fp8pass.numerics.kernels import torch_family as T
from fp8pass.numerics.kernels import triton_family as R

FORMATS = [E4M3, E4M3_GAUDI, E5M2, E2M1]


def hard_input(dtype=torch.float32):
    torch.manual_seed(0)
    x = torch.randn(37, 304) * 10
    x[1] *= 1e-6  # a tiny row: subnormal codes
    x[2] *= 1e4  # a huge row: saturation under a shared scale
    x[3, 5] = float("nan")
    x[4, 7] = float("inf")
    x[5] = 0.0
    x[6, 8] = -0.0
    return x.to(dtype)


def same(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def same_float(a, b):
    return torch.equal(a.nan_to_num(-1.0), b.nan_to_num(-1.0))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_tensor_cast_and_amax(fmt, dtype):
    x = hard_input(dtype)
    for scale in (1.0, 3.0, 2.0**-7):
        s = torch.tensor(scale)
        a, am = T.cast_scaled(x, s, fmt, want_amax=True)
        b, bm = R.cast_scaled(x, s, fmt, want_amax=True)
        assert same(a, b)
        assert same_float(am, bm)
    finite = x.clone()
    finite[3, 5] = 1.0
    finite[4, 7] = 1.0
    assert torch.equal(T.tensor_amax(finite), R.tensor_amax(finite))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("tile", [(1, 304), (1, 16), (16, 16), (128, 128), (5, 8), (3, 7)], ids=str)
@pytest.mark.parametrize("pow2", [False, True])
def test_fused_tile_quantize(fmt, tile, pow2):
    if fmt.packed and tile[1] % 2:
        pytest.skip("E2M1 tiles must be even-width (checked in test_quantize)")
    x = hard_input()
    a, sa = T.quantize_groups(x, tile, fmt, power_of_two=pow2)
    b, sb = R.quantize_groups(x, tile, fmt, power_of_two=pow2)
    assert same_float(sa, sb)
    assert same(a, b)
    # With given scales (delayed scaling) as well.
    a2, _ = T.quantize_groups(x, tile, fmt, scales=sa * 0.5)
    b2, _ = R.quantize_groups(x, tile, fmt, scales=sa * 0.5)
    assert same(a2, b2)
    assert same_float(T.group_amax(x, tile), R.group_amax(x, tile))


def test_quantize_dispatch_uses_triton(monkeypatch):
    import fp8pass

    x = hard_input()
    monkeypatch.setenv("FP8PASS_KERNELS", "torch")
    qt = [fp8pass.quantize(x, E4M3, granularity=g) for g in ("tensor", "row", "block")]
    qn = fp8pass.quantize(x[:, :64], E2M1, granularity="block")
    monkeypatch.setenv("FP8PASS_KERNELS", "triton")
    qr = [fp8pass.quantize(x, E4M3, granularity=g) for g in ("tensor", "row", "block")]
    rn = fp8pass.quantize(x[:, :64], E2M1, granularity="block")
    for a, b in zip(qt, qr):
        assert same(a.data, b.data) and same_float(a.scale, b.scale)
    assert same(qn.data, rn.data) and same(qn.block_scale, rn.block_scale)


def test_bad_family_name(monkeypatch):
    import fp8pass

    monkeypatch.setenv("FP8PASS_KERNELS", "cuda")
    with pytest.raises(ValueError, match="auto, torch, triton"):
        fp8pass.quantize(torch.ones(4), E4M3)
