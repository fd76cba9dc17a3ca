"""Runtime ops on CUDA (skipped without a GPU): the Triton/_scaled_mm path against the CPU path."""

import pytest
import torch

from fp8pass import ops

pytestmark = pytest.mark.gpu
ARGS = ("e4m3", "e5m2", "tensor", 128, False, "nearest", 0.0, 1, "max", None, True, "fp8")  # ..., fast_accum, backward


def _both(fn, *tensors):
    cpu = fn(*[t.clone().requires_grad_(t.requires_grad) for t in tensors])
    gpu = fn(*[t.cuda().requires_grad_(t.requires_grad) for t in tensors])
    return cpu, gpu


@pytest.mark.parametrize("shape", [(256, 128, 64), (100, 72, 40)])  # _scaled_mm and fallback shapes
def test_linear_cuda_matches_cpu(shape):
    t, k, n = shape
    g = torch.Generator().manual_seed(0)
    x = torch.randn(t, k, generator=g, dtype=torch.bfloat16)
    w = (torch.randn(n, k, generator=g) / 8).to(torch.bfloat16)
    c = torch.ops.fp8pass.fp8_linear(x, w, None, [], [], [], None, *ARGS)
    d = torch.ops.fp8pass.fp8_linear(x.cuda(), w.cuda(), None, [], [], [], None, *ARGS)
    assert torch.equal(c[3], d[3].cpu()) and torch.equal(c[5], d[5].cpu())  # identical codes
    torch.testing.assert_close(d[0].cpu().float(), c[0].float(), rtol=2**-7, atol=1e-2)
    dy = torch.randn(t, n, generator=g, dtype=torch.bfloat16)
    grads = []
    for dev in ("cpu", "cuda"):
        xx, ww = x.to(dev).requires_grad_(), w.to(dev).requires_grad_()
        ops.fp8_linear(xx, ww).backward(dy.to(dev))
        grads.append((xx.grad.cpu().float(), ww.grad.cpu().float()))
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=2**-6, atol=2e-2)


@pytest.mark.parametrize("smooth,activation", [("channel", "silu"), ("token", "silu"), (None, "silu"),
                                               ("channel", "gelu_tanh"), ("token", "relu")])
def test_swiglu_cuda_matches_cpu_and_compiles(smooth, activation):
    """silu takes the fused Triton cast; other activations the torch operand math on CUDA."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(128, 64, generator=g, dtype=torch.bfloat16)
    ws = [(torch.randn(*s, generator=g) / 8).to(torch.bfloat16) for s in ((160, 64), (160, 64), (64, 160))]
    ref = ops.swiglu_mlp(x, *ws, smooth=smooth, activation=activation).float()
    f = lambda a, *w: ops.swiglu_mlp(a, *w, smooth=smooth, activation=activation)  # noqa: E731
    eager = f(x.cuda(), *[w.cuda() for w in ws])
    comp = torch.compile(f, backend="inductor")(x.cuda(), *[w.cuda() for w in ws])
    assert torch.equal(eager, comp)
    assert float((eager.cpu().float() - ref).norm() / ref.norm()) < 0.02
