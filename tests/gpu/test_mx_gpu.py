"""MXFP8 on a real GPU: quantize(granularity="mx") bit-identical to the CPU, the MX linear (bf16 GEMM
of the exact dequantized operands) against the CPU's."""

import pytest
import torch

import fp8pass
from fp8pass import E2M1, E4M3, E5M2, CurrentScaling, quantize

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("fmt", [E4M3, E5M2, E2M1], ids=lambda f: f.name)
@pytest.mark.parametrize("block", [None, (32, 1)], ids=["rows", "cols"])
def test_gpu_mx_quantize_bit_exact(fmt, block):
    torch.manual_seed(0)
    x = torch.randn(256, 1000) * torch.logspace(-30, 30, 1000)
    x[3, 5], x[7, 100], x[9] = float("nan"), float("inf"), 0.0
    a = quantize(x, fmt, granularity="mx", block=block)
    b = quantize(x.cuda(), fmt, granularity="mx", block=block)
    assert torch.equal(a.block_scale, b.block_scale.cpu())
    assert torch.equal(a.data.view(torch.uint8), b.data.cpu().view(torch.uint8))


def test_gpu_mx_linear_matches_cpu():
    torch.manual_seed(1)
    x, w, dy = torch.randn(256, 512), torch.randn(384, 512) * 0.05, torch.randn(256, 384)
    grads = {}
    for dev in ("cpu", "cuda"):
        xr = x.to(dev).bfloat16().requires_grad_()
        wr = w.to(dev).bfloat16().requires_grad_()
        y = fp8pass.ops.fp8_linear(xr, wr, None, CurrentScaling(granularity="mx"), bwd_format="e4m3")
        y.backward(dy.to(dev).bfloat16())
        grads[dev] = [t.float().cpu() for t in (y, xr.grad, wr.grad)]
    for a, b in zip(grads["cpu"], grads["cuda"]):
        torch.testing.assert_close(a, b, rtol=2**-7, atol=1e-3)  # same exact operands; bf16 output rounding
