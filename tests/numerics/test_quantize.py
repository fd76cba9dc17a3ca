"""quantize() / Quantized: granularities, shapes, dtypes, edge inputs, NVFP4, clear errors."""

import ml_dtypes
import numpy as np
import pytest
import torch

import fp8pass
from fp8pass import E2M1, E4M3, E5M2, E8M0
from fp8pass.numerics import decode


def ref_cast(v: np.ndarray, fmt) -> np.ndarray:
    t = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2, "e2m1": ml_dtypes.float4_e2m1fn}[fmt.name]
    return np.clip(v, -fmt.max, fmt.max).astype(t).astype(np.float32)


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
@pytest.mark.parametrize("gran,block", [("tensor", None), ("row", None), ("block", None), ("block", (128, 128)),
                                        ("block", (3, 5))])
def test_matches_an_independent_numpy_reference(fmt, gran, block, kernels):
    torch.manual_seed(0)
    x = torch.randn(2, 70, 300) * torch.logspace(-3, 3, 300)
    q = fp8pass.quantize(x, fmt, granularity=gran, block=block)
    m = x.reshape(-1, 300).numpy().astype(np.float32)
    if gran == "tensor":
        groups = np.full_like(m, np.abs(m).max())
    elif gran == "row":
        groups = np.repeat(np.abs(m).max(1, keepdims=True), 300, 1)
    else:
        br, bc = block or (1, 128)
        groups = np.zeros_like(m)
        for i in range(0, m.shape[0], br):
            for j in range(0, m.shape[1], bc):
                groups[i:i + br, j:j + bc] = np.abs(m[i:i + br, j:j + bc]).max()
    scale = (np.float32(fmt.max) / groups).astype(np.float32)
    expect = ref_cast((m * scale).astype(np.float32), fmt) / scale
    np.testing.assert_array_equal(q.dequantize().reshape(-1, 300).numpy(), expect)


def nvfp4_reference(x: np.ndarray, block):
    """NVFP4 written independently: g = 6*448/amax, d_b = e4m3(amax_b/6*g), q = e2m1(x*g/d_b)."""
    amax = np.abs(x).max()
    g = np.float32(6 * 448) / np.float32(amax)
    out = np.zeros_like(x)
    br, bc = block
    for i in range(0, x.shape[0], br):
        for j in range(0, x.shape[1], bc):
            t = x[i:i + br, j:j + bc]
            d = ref_cast(np.float32(np.abs(t).max() / np.float32(6.0) * g), E4M3)
            enc = np.float32(g / d) if d > 0 else np.float32(0)
            out[i:i + br, j:j + bc] = ref_cast((t * enc).astype(np.float32), E2M1) * d / g
    return out


@pytest.mark.parametrize("block", [(1, 16), (16, 16)])
def test_nvfp4_matches_reference_on_adversarial_blocks(block, kernels):
    torch.manual_seed(1)
    x = torch.randn(48, 64)
    x[0, 3] = 1e4  # one huge value in a block
    x[5, :32] = 0.0  # all-zero blocks
    x[20:36, 16:32] *= 1e-5  # tiny blocks: E4M3 block scales near their subnormals
    q = fp8pass.quantize(x, E2M1, granularity="block", block=block)
    assert q.data.dtype == torch.uint8 and q.data.shape == (48, 32)
    assert q.block_scale.dtype == torch.float8_e4m3fn
    np.testing.assert_array_equal(q.dequantize().numpy(), nvfp4_reference(x.numpy(), block))


def test_nvfp4_nan_poisons_only_its_block(kernels):
    x = torch.randn(4, 32)
    x[1, 3] = float("nan")
    d = fp8pass.quantize(x, E2M1, granularity="block").dequantize()
    assert torch.isnan(d[1, :16]).all() and torch.isfinite(d[1, 16:]).all() and torch.isfinite(d[0]).all()


@pytest.mark.parametrize("gran", ["tensor", "row", "block"])
def test_zero_nan_inf_empty(gran, kernels):
    z = fp8pass.quantize(torch.zeros(4, 256), E4M3, granularity=gran)
    assert torch.all(z.scale == 1) and torch.all(z.dequantize() == 0)
    x = torch.randn(4, 256)
    x[1, 2] = float("nan")
    x[2, 3] = float("inf")
    q = fp8pass.quantize(x, E4M3, granularity=gran)
    d = q.dequantize()
    assert torch.isnan(d[1, 2]) and torch.isfinite(q.scale).all()
    inf_group_scale = q.scale if gran == "tensor" else q.scale[2, 0]
    assert inf_group_scale == 1.0  # an Inf amax falls back to scale 1 ...
    assert d[2, 3] == E4M3.max  # ... and the Inf saturates to max
    e = fp8pass.quantize(torch.empty(0, 256), E4M3, granularity=gran)
    assert e.dequantize().shape == (0, 256)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_dtypes_noncontiguous_3d(dtype, kernels):
    torch.manual_seed(2)
    base = torch.randn(3, 64, 40, dtype=torch.float64).to(dtype)
    x = base.transpose(1, 2)  # non-contiguous [3, 40, 64]
    assert not x.is_contiguous()
    for gran in ("tensor", "row", "block"):
        q = fp8pass.quantize(x, E4M3, granularity=gran, block=16)
        qc = fp8pass.quantize(x.contiguous(), E4M3, granularity=gran, block=16)
        assert torch.equal(q.data.view(torch.uint8), qc.data.view(torch.uint8))
        assert q.dequantize(dtype).dtype == dtype and q.dequantize().shape == x.shape
        rel = ((q.dequantize() - x.float()).abs().max() / x.float().abs().max()).item()
        assert rel <= 2.0**-4 + 1e-6  # half an E4M3 ulp of the group max, at most
    if gran == "row":
        assert q.scale.shape == (3, 40, 1)


def test_scale_shapes_and_given_scales():
    x = torch.randn(10, 300)
    assert fp8pass.quantize(x, E4M3).scale.shape == ()
    assert fp8pass.quantize(x, E4M3, granularity="row").scale.shape == (10, 1)
    q = fp8pass.quantize(x, E4M3, granularity="block", block=(4, 128))
    assert q.scale.shape == (3, 3)
    again = fp8pass.quantize(x, E4M3, granularity="block", block=(4, 128), scale=q.scale)
    assert torch.equal(again.data.view(torch.uint8), q.data.view(torch.uint8))
    r = fp8pass.quantize(x, E4M3, granularity="row", scale=torch.full((10,), 2.0))
    assert torch.equal(r.dequantize(), decode(r.data, E4M3) / 2.0)
    p2 = fp8pass.quantize(x, E4M3, granularity="row", power_of_two=True)
    assert torch.all(torch.log2(p2.scale) == torch.log2(p2.scale).round())


def test_bad_inputs_have_clear_errors():
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match="valid formats: e2m1, e4m3, e4m3_gaudi, e5m2, e8m0"):
        fp8pass.quantize(x, "e3m4")
    with pytest.raises(ValueError, match="valid roundings: nearest, stochastic"):
        fp8pass.quantize(x, E4M3, rounding="up")
    with pytest.raises(ValueError, match="valid: tensor, row, block"):
        fp8pass.quantize(x, E4M3, granularity="channel")
    with pytest.raises(ValueError, match="block must be"):
        fp8pass.quantize(x, E4M3, granularity="block", block=(0, 4))
    with pytest.raises(ValueError, match="must be even"):
        fp8pass.quantize(torch.randn(4, 31), E2M1)
    with pytest.raises(ValueError, match="must be even"):
        fp8pass.quantize(x, E2M1, granularity="block", block=(1, 7))
    with pytest.raises(ValueError, match="shape"):
        fp8pass.quantize(x, E4M3, granularity="block", scale=torch.ones(2, 2))
    with pytest.raises(ValueError, match="one per row"):
        fp8pass.quantize(x, E4M3, granularity="row", scale=torch.ones(3))
    with pytest.raises(TypeError, match="float16/bfloat16/float32/float64"):
        fp8pass.quantize(torch.ones(4, dtype=torch.int32), E4M3)
    with pytest.raises(TypeError, match="torch.Tensor"):
        fp8pass.quantize([1.0, 2.0], E4M3)
    with pytest.raises(ValueError, match="block-scale format"):
        fp8pass.quantize(x, E8M0)


def test_format_objects():
    assert (E4M3.max, E4M3.ebits, E4M3.mbits, E4M3.torch_dtype) == (448.0, 4, 3, torch.float8_e4m3fn)
    assert E4M3.min_normal == 2.0**-6 and E4M3.min_subnormal == 2.0**-9
    assert (E5M2.max, E5M2.min_normal, E5M2.min_subnormal) == (57344.0, 2.0**-14, 2.0**-16)
    assert (E2M1.max, E2M1.min_subnormal, E2M1.packed) == (6.0, 0.5, True)
    assert fp8pass.E4M3_GAUDI.max == 240.0
    assert fp8pass.get_format("float8_e5m2") is E5M2
    codes = torch.tensor([127, 0, 130, 255], dtype=torch.uint8)
    v = decode(codes, E8M0)
    assert v[:3].tolist() == [1.0, 2.0**-127, 8.0] and torch.isnan(v[3])


def test_nbytes_counts_codes_and_scales():
    q = fp8pass.quantize(torch.randn(128, 256), E4M3, granularity="block", block=(128, 128))
    assert q.nbytes == 128 * 256 + 2 * 4
    n = fp8pass.quantize(torch.randn(16, 32), E2M1, granularity="block")
    assert n.nbytes == 16 * 16 + 4 + 16 * 2
