"""The fused SwiGLU backward from saved FP8 gate/up (kernels/triton_glu.py) against the torch
reference ``swiglu._glu_backward_from_saved``, in Triton's interpreter."""

import pytest
import torch

from fp8pass.kernels import triton_glu
from fp8pass.numerics import E4M3, E5M2, saturating_cast
from fp8pass.runtime.swiglu import _glu_backward_from_saved, channel_scales, token_scales


def _saved(t, fmt, gen):
    scale = torch.tensor(fmt.max / float(t.abs().max()))
    return saturating_cast(t.float() * scale, fmt), scale


@pytest.mark.parametrize("smooth", ["channel", "token", "none"])
@pytest.mark.parametrize("fmt,out_dtype", [(E4M3, torch.bfloat16), (E4M3, torch.float32), (E5M2, torch.bfloat16)])
def test_swiglu_backward_kernel_matches_the_torch_reference(smooth, fmt, out_dtype):
    gen = torch.Generator().manual_seed(0)
    t, f = 70, 150  # not multiples of the tile: masked edges
    gate = torch.randn(t, f, generator=gen) * 3
    up = torch.randn(t, f, generator=gen)
    gate[0, :4] = torch.tensor([0.0, -0.0, 60.0, -60.0])  # silu exact there
    da = (torch.randn(t, f, generator=gen) * 1e-2).to(out_dtype)
    s = {"channel": channel_scales((torch.nn.functional.silu(gate) * up).abs().amax(0)),
         "token": token_scales(up), "none": torch.ones(())}[smooth]
    (gc, gs), (uc, us) = _saved(gate, fmt, gen), _saved(up, fmt, gen)
    want_g, want_u = _glu_backward_from_saved(da, gc, gs, uc, us, s, smooth, "silu", out_dtype)
    got_g, got_u = triton_glu.swiglu_backward(da, gc, gs, uc, us, s, smooth, out_dtype)
    assert got_g.dtype == got_u.dtype == out_dtype
    for got, want in ((got_g, want_g), (got_u, want_u)):
        # exp differs in its last fp32 bits between implementations (numpy's here, ex2.approx on GPUs,
        # torch's own): a few fp32 ulp before the rounding to the output dtype, at most one step after it
        ulps = 1 if out_dtype != torch.float32 else 8
        step = ulps * torch.finfo(out_dtype).eps * want.float().abs()
        assert ((got.float() - want.float()).abs() <= step).all()
    # where exp is exact (g = 0: sig = 1/2) the kernel's values are the reference's bit for bit
    assert torch.equal(got_g[0, :2], want_g[0, :2]) and torch.equal(got_u[0, :2], want_u[0, :2])


def test_swiglu_backward_rejects_bad_arguments():
    x = torch.zeros(2, 2)
    c = torch.zeros(2, 2, dtype=torch.uint8).view(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="smooth mode"):
        triton_glu.swiglu_backward(x, c, torch.ones(()), c, torch.ones(()), x, "row", torch.float32)
    with pytest.raises(TypeError, match="one FP8 dtype"):
        triton_glu.swiglu_backward(x, c, torch.ones(()), c.view(torch.uint8), torch.ones(()), x, "none", torch.float32)
