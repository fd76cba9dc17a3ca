"""The RMSNorm kernels (kernels/triton_norm.py) against the op's torch math (runtime/rmsnorm.py), in Triton's
interpreter: given the kernel's ``rstd``, ``y``, the scale and the codes are the reference's bit for bit; ``rstd``
and the gradients agree to fp32 rounding; the op takes them on the CUDA code path in four launches."""

import pytest
import torch

from fp8pass.kernels import triton_norm
from fp8pass.numerics import E2M1, E4M3, E5M2, saturating_cast, scale_from_amax
from fp8pass.op_schema import NormKnobs
from fp8pass.runtime.rmsnorm import _y_dtype, norm_backward_math

EPS = 1e-5
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16

# (rows, d, x dtype, weight dtype, hat dtype, out dtype, format): TinyLlama's, HF Llama's and torchtitan's
# forms, fp16, a row wider than one power of two, one feature, one row, E5M2
CASES = [
    (64, 128, F32, F32, None, F32, E4M3),
    (37, 100, BF16, BF16, BF16, None, E4M3),
    (40, 96, BF16, F32, BF16, None, E4M3),
    (5, 3000, F16, F32, None, F16, E4M3),
    (7, 1, F32, F32, None, None, E4M3),
    (1, 64, F32, BF16, None, BF16, E5M2),
]


def _inputs(rows, d, x_dtype, w_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, d, generator=g) * torch.logspace(-2, 2, rows).reshape(rows, 1)).to(x_dtype)
    w = (torch.randn(d, generator=g) * 0.5 + 1.0).to(w_dtype)
    return x, w


def _forward_given_rstd(x, w, rstd, hat, out):
    """The reference's ops (norm_forward_math after its reduction) applied to ``x`` and the kernel's ``rstd``."""
    x_hat = x.float() * rstd
    y = (x_hat if hat is None else x_hat.to(hat)) * w
    return (y if out is None else y.to(out)), x_hat


@pytest.fixture(params=["one step", "wide"])
def row_steps(request, monkeypatch):
    """Rows in one loop step (registers), or "wide": in 32-column steps (the path of rows wider than 4096
    features on a GPU: two reads per block, the backward's column sums kept in memory)."""
    if request.param == "wide":
        monkeypatch.setattr(triton_norm, "_MAX_CHUNK", 32)
        monkeypatch.setattr(triton_norm, "_STEP", 64)
    return request.param


def test_wide_rows_take_the_wide_path(row_steps):
    assert triton_norm._block(37, 100)[2] == (row_steps == "wide")


@pytest.mark.parametrize("rows,d,x_dtype,w_dtype,hat,out,fmt", CASES)
def test_forward_is_the_reference_given_the_kernels_rstd(rows, d, x_dtype, w_dtype, hat, out, fmt, row_steps):
    x, w = _inputs(rows, d, x_dtype, w_dtype)
    out_dtype = _y_dtype(x_dtype, w_dtype, NormKnobs(EPS, hat, out, fmt.name))
    assert triton_norm.norm_supported(d, fmt, x_dtype, w_dtype, hat, out_dtype)
    y, codes, scale, rstd = triton_norm.rmsnorm_forward(x, w, EPS, hat, out_dtype, fmt)
    x64 = x.double()
    exact = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS)
    assert rstd.shape == (rows, 1) and rstd.dtype == F32
    torch.testing.assert_close(rstd.double(), exact, rtol=4 * 2.0**-24, atol=0)  # reductions' order: a few ulp
    want_y, x_hat = _forward_given_rstd(x, w, rstd, hat, out)
    assert y.dtype == want_y.dtype == out_dtype and torch.equal(y, want_y)
    want_scale = scale_from_amax(x_hat.abs().max(), fmt)
    assert scale.dtype == F32 and torch.equal(scale, want_scale)
    want_codes = saturating_cast(x_hat * want_scale, fmt).view(torch.uint8)
    assert codes.dtype == torch.uint8 and torch.equal(codes, want_codes)


def test_non_finite_rows_are_cast_as_the_reference_casts_them(row_steps):
    """An Inf in a row makes its rstd 0 and its x_hat NaN (Inf * 0); the amax is then NaN, the scale 1 and
    every finite row's codes saturate as the reference's do."""
    x, w = _inputs(8, 32, F32, F32)
    x[3, 5] = float("inf")
    x[6, 0] = float("nan")
    y, codes, scale, rstd = triton_norm.rmsnorm_forward(x, w, EPS, None, F32, E4M3)
    want_y, x_hat = _forward_given_rstd(x, w, rstd, None, None)
    torch.testing.assert_close(y, want_y, rtol=0, atol=0, equal_nan=True)
    want_scale = scale_from_amax(x_hat.abs().max(), E4M3)
    assert torch.equal(scale, want_scale)
    assert torch.equal(codes, saturating_cast(x_hat * want_scale, E4M3).view(torch.uint8))


@pytest.mark.parametrize("rows,d,x_dtype,w_dtype,hat,out,fmt", CASES)
def test_backward_is_the_reference_to_fp32_rounding(rows, d, x_dtype, w_dtype, hat, out, fmt, row_steps):
    x, w = _inputs(rows, d, x_dtype, w_dtype, seed=1)
    out_dtype = _y_dtype(x_dtype, w_dtype, NormKnobs(EPS, hat, out, fmt.name))
    _, codes, scale, rstd = triton_norm.rmsnorm_forward(x, w, EPS, hat, out_dtype, fmt)
    dy = torch.randn(rows, d, generator=torch.Generator().manual_seed(2)).to(out_dtype)
    dx, dw = triton_norm.rmsnorm_backward(dy, codes, scale, rstd, w, x_dtype, fmt)
    values = codes.view(fmt.torch_dtype).float()
    want_dx, want_dw = norm_backward_math(dy, values, scale, rstd, w, x_dtype)
    assert dx.dtype == x_dtype and dw.dtype == w_dtype and dx.shape == (rows, d) and dw.shape == (d,)
    # the row means and dw's column sums are reduced in another order: fp32 rounding of the sums, then the
    # rounding to the output dtype (one step of it at most)
    x_hat = values / scale
    g = dy.float() * w.float()
    row_scale = (rstd * (g.abs() + x_hat.abs() * (g * x_hat).abs().mean(-1, keepdim=True))).double()
    step = max(torch.finfo(x_dtype).eps, 2.0**-20)
    assert ((dx.double() - want_dx.double()).abs() <= step * row_scale).all()
    col_scale = (dy.float() * x_hat).abs().sum(0).double()
    step = max(torch.finfo(w_dtype).eps, 2.0**-20)
    assert ((dw.double() - want_dw.double()).abs() <= step * col_scale).all()
    assert (dx != 0).any() and (dw != 0).any()


def test_no_rows(row_steps):
    x, w = torch.empty(0, 64), torch.ones(64)
    y, codes, scale, rstd = triton_norm.rmsnorm_forward(x, w, EPS, None, F32, E4M3)
    assert y.shape == codes.shape == (0, 64) and rstd.shape == (0, 1)
    assert torch.equal(scale, scale_from_amax(torch.zeros(()), E4M3))
    dx, dw = triton_norm.rmsnorm_backward(torch.empty(0, 64), codes, scale, rstd, w, F32, E4M3)
    assert dx.shape == (0, 64) and torch.equal(dw, torch.zeros(64))


def test_the_kernels_stay_in_bounds(strict_interpreter, row_steps):
    """Rows and features not multiples of the blocks: every masked-in access inside its tensor."""
    x, w = _inputs(13, 77, BF16, F32)
    y, codes, scale, rstd = triton_norm.rmsnorm_forward(x, w, EPS, BF16, BF16, E4M3)
    assert torch.equal(y, _forward_given_rstd(x, w, rstd, BF16, BF16)[0])
    dy = torch.randn(13, 77, generator=torch.Generator().manual_seed(6)).to(BF16)
    dx, dw = triton_norm.rmsnorm_backward(dy, codes, scale, rstd, w, BF16, E4M3)
    want_dx, want_dw = norm_backward_math(dy, codes.view(E4M3.torch_dtype).float(), scale, rstd, w, BF16)
    torch.testing.assert_close(dx, want_dx, rtol=2**-7, atol=2**-7 * float(want_dx.abs().max()))
    torch.testing.assert_close(dw, want_dw, rtol=1e-5, atol=1e-5 * float(want_dw.abs().max()))


def test_what_the_kernels_refuse():
    ok = dict(fmt=E4M3, x_dtype=F32, weight_dtype=F32, hat_dtype=None, out_dtype=F32)
    assert triton_norm.norm_supported(1 << 20, **ok)
    assert not triton_norm.norm_supported(0, **ok)
    assert not triton_norm.norm_supported(64, **dict(ok, fmt=E2M1))
    assert not triton_norm.norm_supported(64, **dict(ok, x_dtype=torch.float64))
    assert not triton_norm.norm_supported(64, **dict(ok, hat_dtype=torch.float64))


@pytest.mark.parametrize("dtype", [F32, torch.float64])
def test_the_op_takes_the_kernels_on_the_cuda_path(dtype, monkeypatch):
    """``fp8pass::rmsnorm`` with ``FP8PASS_KERNELS=triton``: the kernels where they take the norm (4 launches,
    no other op), its torch ops where not (fp64 tensors); both give the CPU path's values to fp32
    rounding."""
    from benchmarks.gpu_launches import LaunchCounter

    d = 96
    x, w = _inputs(6, d, dtype, dtype, seed=4)
    dy = torch.randn(6, d, generator=torch.Generator().manual_seed(5), dtype=dtype)
    knobs = NormKnobs(EPS, None, dtype, "e4m3").args()

    def run(xg, wg):
        y = torch.ops.fp8pass.rmsnorm(xg, wg, *knobs)[0]
        y.backward(dy)
        return y.detach(), xg.grad, wg.grad

    want = run(x.clone().requires_grad_(), w.clone().requires_grad_())
    monkeypatch.setenv("FP8PASS_KERNELS", "triton")
    leaves = x.clone().requires_grad_(), w.clone().requires_grad_()
    with LaunchCounter() as counted:
        got = run(*leaves)
    kernels = {"_rmsnorm_forward_kernel", "_rmsnorm_cast_kernel", "_rmsnorm_backward_kernel", "_column_sum_kernel"}
    if dtype == F32:
        assert set(counted.triton) == kernels and counted.total == 4
    else:
        assert not set(counted.triton) & kernels
    assert counted.summary()["syncs"] == 0
    for g, wnt in zip(got, want):
        torch.testing.assert_close(g, wnt, rtol=1e-5, atol=1e-5 * float(wnt.abs().max()))
