"""Delayed-scaling state follows its model to the GPU, and reduces/records there without a host sync."""

import pytest
import torch

import fp8pass
from fp8pass.monitor import scaling_telemetry

pytestmark = pytest.mark.gpu


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))


def test_model_compiled_on_cpu_then_moved_to_cuda_uses_cuda_state():
    model = _model()
    cm = torch.compile(model, backend=fp8pass.backend(fp8pass.Config(grad_stochastic_rounding=False)))
    cm(torch.randn(16, 64)).sum().backward()  # state made on CPU
    st = fp8pass.runtime.state._REGISTRY[model[0].weight]
    scale_obj = st.input.scale
    model.cuda()
    cm(torch.randn(16, 64, device="cuda")).sum().backward()  # recompiles for CUDA; state moves
    assert st.input.scale is scale_obj and scale_obj.device.type == "cuda"
    assert int(st.input.steps) == 2 and int(st.grad_output.steps) == 2


def test_guarded_delayed_step_has_no_host_sync():
    model = _model().cuda()
    cfg = fp8pass.Config(recipe=fp8pass.DelayedScaling(on_overflow="current"), grad_stochastic_rounding=False)
    cm = torch.compile(model, backend=fp8pass.backend(cfg))
    x = torch.randn(16, 64, device="cuda")
    cm(x).sum().backward()  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        cm(x * 1e4).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert scaling_telemetry(model).overflows["0.weight.input"] == 1
