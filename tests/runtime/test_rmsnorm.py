"""``fp8pass::rmsnorm`` (Config.save_norm_input_fp8): the forward is each model form's norm bit for bit
(eager below ``kernels.cpu.MIN_COMPILED`` elements, Inductor's compile of it above, where the op runs
its compiled loops); the gradients differ from the exact (fp64) ones by no more than the E4M3 rounding
of the saved x_hat allows, on both paths; the saved tensors are the codes and rstd, not the input."""

import pytest
import torch

from fp8pass import E4M3
from fp8pass.kernels import cpu as cpu_kernels
from fp8pass.op_schema import NormKnobs
from fp8pass.runtime.rmsnorm import norm_backward_math, norm_forward_math, rmsnorm_reference

EPS = 1e-5
ROWS = {"eager": 48, "compiled": 192}  # x.numel() = rows x 128: below / above MIN_COMPILED (16384)


def _tinyllama(x, w):  # fp8pass.train.model.RMSNorm
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    return (xf * w).to(x.dtype)


def _hf(x, w):  # transformers' LlamaRMSNorm
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + EPS)
    return w * hidden.to(x.dtype)


def _titan(x, w):  # fp8pass.testing.models.RMSNorm (torchtitan's form)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).type_as(x) * w


FORMS = {  # name -> (module code, knobs given x's dtype)
    "tinyllama": (_tinyllama, lambda dt: NormKnobs(EPS, None, dt, "e4m3")),
    "hf": (_hf, lambda dt: NormKnobs(EPS, dt, None, "e4m3")),
    "titan": (_titan, lambda dt: NormKnobs(EPS, dt, None, "e4m3")),
}


def _inputs(dtype, rows=48, d=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    # a residual stream whose rows differ in scale by 100x, and a weight with near-zero entries
    x = (torch.randn(2, rows // 2, d, generator=g) * torch.logspace(-1, 1, rows).reshape(2, rows // 2, 1)).to(dtype)
    w = (torch.randn(d, generator=g) * 0.5 + 1.0).to(dtype)
    dy = torch.randn(2, rows // 2, d, generator=g).to(dtype)
    return x, w, dy


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_is_the_models_norm_bit_for_bit(form, dtype):
    code, knobs = FORMS[form]
    x, w, _ = _inputs(dtype)
    y, data, scale, rstd = torch.ops.fp8pass.rmsnorm(x, w, *knobs(dtype).args())
    ref = code(x, w)
    assert y.dtype == ref.dtype and torch.equal(y, ref)
    assert data.dtype == torch.uint8 and data.shape == (48, 128)
    assert scale.shape == () and rstd.shape == (48, 1) and rstd.dtype == torch.float32


def _fused_variants() -> set:
    return {key[0] for key in cpu_kernels._FUSED}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_forward_is_inductors_norm_bit_for_bit(form, dtype):
    """Above MIN_COMPILED elements the op's forward is one compiled loop nest: ``y`` equals the same
    norm compiled by Inductor (what the fp8 backend ran before the rewrite), bit for bit."""
    code, knobs = FORMS[form]
    x, w, _ = _inputs(dtype, rows=ROWS["compiled"])
    assert x.numel() >= cpu_kernels.MIN_COMPILED and cpu_kernels.fused_enabled()
    y = torch.ops.fp8pass.rmsnorm(x, w, *knobs(dtype).args())[0]
    assert norm_forward_math in _fused_variants()
    ref = torch.compile(code, dynamic=True)(x, w)
    assert y.dtype == ref.dtype and torch.equal(y, ref)
    torch.testing.assert_close(y, code(x, w), rtol=2**-7 if dtype == torch.bfloat16 else 1e-6, atol=0)


@pytest.mark.parametrize("path", ROWS)
def test_saved_codes_are_x_hat_within_half_an_e4m3_ulp(path):
    """|x_hat' - x_hat| <= 2^-4 |x_hat| + 2^-10 / scale per element (RNE, 3 mantissa bits; the second
    term covers E4M3's subnormals), and the codes are not the exact values."""
    x, w, _ = _inputs(torch.float32, rows=ROWS[path])
    _, data, scale, rstd = torch.ops.fp8pass.rmsnorm(x, w, *NormKnobs(EPS, None, None, "e4m3").args())
    x64 = x.double().reshape(-1, 128)
    x_hat = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS)
    got = data.view(E4M3.torch_dtype).double() / scale.double()
    err = (got - x_hat).abs()
    assert err.max() > 0
    assert bool((err <= 2.0**-4 * x_hat.abs() * (1 + 1e-6) + 2.0**-10 / float(scale)).all())
    assert torch.allclose(rstd.double(), torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS), rtol=1e-6)


@pytest.mark.parametrize("path", ROWS)
def test_gradients_within_the_e4m3_bound_of_the_exact_ones(path):
    """With e = 2^-4 |x_hat| + 2^-10 / scale (the codes' error bound), g = dy * w, m = mean(g x_hat)
    and mu = mean(|g| e) (a bound on m's error), elementwise:
    |ddw_j| <= sum_rows |dy| e  and  |ddx| <= rstd (e (|m| + mu) + |x_hat| mu), against fp64 autograd
    of the exact norm (plus 1e-5 of the gradient's largest entry for the fp32 arithmetic)."""
    x, w, dy = _inputs(torch.float32, rows=ROWS[path], seed=3)
    k = NormKnobs(EPS, None, None, "e4m3")
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = torch.ops.fp8pass.rmsnorm(xg, wg, *k.args())
    out[0].backward(dy)
    scale = float(out[2].detach())
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    rstd = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS)
    (x64 * rstd * w64).backward(dy.double())
    x_hat = (x.double() * rstd.detach()).reshape(-1, 128)
    e = 2.0**-4 * x_hat.abs() + 2.0**-10 / scale
    d2 = dy.double().reshape(-1, 128)
    g = d2 * w.double()
    m = (g * x_hat).mean(-1, keepdim=True)
    mu = (g.abs() * e).mean(-1, keepdim=True)
    dx_bound = rstd.detach().reshape(-1, 1) * (e * (m.abs() + mu) + x_hat.abs() * mu)
    dw_bound = (d2.abs() * e).sum(0)
    dx_err = (xg.grad.double() - x64.grad).reshape(-1, 128).abs()
    dw_err = (wg.grad.double() - w64.grad).abs()
    assert dx_err.max() > 0 and dw_err.max() > 0  # the codes are really FP8
    assert bool((dx_err <= dx_bound + 1e-5 * x64.grad.abs().max()).all())
    assert bool((dw_err <= dw_bound + 1e-5 * w64.grad.abs().max()).all())
    if path == "compiled":  # the backward ran as a compiled loop nest (the eager path: any process state)
        assert norm_backward_math in _fused_variants()


def test_identity_format_gives_the_reference_gradients():
    """The "identity" hook saves x_hat itself: the backward formula equals autograd of the norm."""
    x, w, dy = _inputs(torch.float32, seed=4)
    k = NormKnobs(EPS, None, None, "identity")
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    torch.ops.fp8pass.rmsnorm(xg, wg, *k.args())[0].backward(dy)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    rmsnorm_reference(xr, wr, k).backward(dy)
    torch.testing.assert_close(xg.grad, xr.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(wg.grad, wr.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", FORMS)
def test_opcheck(form):
    x, w, _ = _inputs(torch.bfloat16, rows=8, d=32)
    args = (x.requires_grad_(), w.requires_grad_(), *FORMS[form][1](torch.bfloat16).args())
    torch.library.opcheck(torch.ops.fp8pass.rmsnorm.default, args)


def test_bad_arguments_are_clear_errors():
    x, w, _ = _inputs(torch.float32, rows=8, d=32)
    with pytest.raises(ValueError, match="eps must be a float >= 0"):
        torch.ops.fp8pass.rmsnorm(x, w, *NormKnobs(-1.0, None, None, "e4m3").args())
    with pytest.raises(ValueError, match="x \\[..., d\\] and weight \\[d\\]"):
        torch.ops.fp8pass.rmsnorm(x, w[:-1], *NormKnobs(EPS, None, None, "e4m3").args())
    with pytest.raises(ValueError):
        torch.ops.fp8pass.rmsnorm(x, w, *NormKnobs(EPS, None, None, "int8").args())
