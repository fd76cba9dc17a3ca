"""Forward GEMMs accumulate fast on CUDA, gradient GEMMs precisely (``Config.fast_accum``; issue 28 item 4).

The CUDA code path runs on CPU (``FP8PASS_KERNELS=triton``); ``benchmarks/gpu_launches.pretend_cuda_gemms``
routes the GEMMs to ``torch._scaled_mm`` as on a GPU and records the ``use_fast_accum`` of each call.
"""


import pytest
import torch

import fp8pass
from benchmarks import gpu_launches as gl
from fp8pass import ops


def _compiled_step(fast_accum):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
    cfg = fp8pass.Config(recipe=fp8pass.CurrentScaling(), compiler="aot_eager", fast_accum=fast_accum, min_dim=16)
    cm = torch.compile(model, backend=fp8pass.backend(cfg))
    with gl.pretend_cuda_gemms() as gemms:
        y = cm(torch.randn(16, 32))
        forward = list(gemms)
        y.sum().backward()
    return forward, gemms[len(forward):]


@pytest.mark.parametrize("fast_accum", [True, False])
def test_the_backend_accumulates_forward_gemms_fast_and_gradient_gemms_precisely(monkeypatch, fast_accum):
    monkeypatch.setenv("FP8PASS_KERNELS", "triton")
    forward, backward = _compiled_step(fast_accum)
    assert forward == [("_scaled_mm", fast_accum)] * 2
    assert backward == [("_scaled_mm", False)] * 4  # dgrad and wgrad of both linears


def test_the_ops_accumulate_their_forward_gemm_fast(monkeypatch):
    monkeypatch.setenv("FP8PASS_KERNELS", "triton")
    torch.manual_seed(0)
    x = torch.randn(16, 32, requires_grad=True)
    w = torch.randn(48, 32, requires_grad=True)
    with gl.pretend_cuda_gemms() as gemms:
        ops.fp8_linear(x, w).sum().backward()
    assert [fast for _, fast in gemms] == [True, False, False]
    g, u, d = (torch.randn(64, 32) * 0.1 for _ in range(3))
    d = torch.randn(32, 64) * 0.1
    with gl.pretend_cuda_gemms() as gemms:
        ops.swiglu_mlp(x, g.requires_grad_(), u.requires_grad_(), d.requires_grad_()).sum().backward()
    fast = [f for _, f in gemms]
    assert fast.count(True) == 3 and fast[:3] == [True] * 3 and len(fast) == 9  # gate, up, down forward


def test_config_checks_fast_accum():
    with pytest.raises(ValueError, match="Config.fast_accum must be True or False, got .yes."):
        fp8pass.Config(fast_accum="yes")


@pytest.mark.parametrize("case", ["fp8_linear delayed", "fp8_linear current", "swiglu_mlp channel"])
def test_gemm_operands_are_cast_in_the_layout_scaled_mm_takes(case):
    """The casts write each GEMM operand in the layout ``_scaled_mm`` takes (A row-major, B column-major:
    the transpose-cast's second copy; the saved x and W kept column-major for the backward GEMMs), so no
    copy or transpose kernel runs between a cast and its GEMM."""
    counted = gl.count(case)
    copies = {op: n for op, n in counted.aten.items()
              if any(k in op for k in ("clone", "copy", "contiguous", "_to_copy", "transpose", "permute"))}
    assert copies == {}
    assert counted.aten["aten._scaled_mm.default"] == (3 if case.startswith("fp8_linear") else 9)
