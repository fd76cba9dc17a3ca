"""The precision audit on a GPU (skipped without one): its ``torch._scaled_mm`` GEMMs are the ones that run."""

import pytest
import torch

import fp8pass
from fp8pass import Config, CurrentScaling, Rule
from fp8pass.monitor import precision_audit

pytestmark = pytest.mark.gpu


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64)).cuda().bfloat16()


def test_audited_scaled_mm_gemms_are_the_ones_that_run(monkeypatch):
    """Layer 2 backward="high": 4 ``_scaled_mm`` calls per step (2 forward, layer 0's dgrad and wgrad),
    as the audit says; on an sm89+ GPU no fallback."""
    torch._dynamo.reset()
    model = _mlp()
    calls = []
    real = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    cfg = Config(recipe=CurrentScaling(), compiler="aot_eager", rules=[Rule("2", CurrentScaling(), backward="high")])
    torch.compile(model, backend=fp8pass.backend(cfg))(torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)) \
        .float().sum().backward()
    records = precision_audit(model)
    assert sum(r.kernel == "torch._scaled_mm" for r in records) == len(calls) == 4
    assert not any(r.fallback for r in records)
    assert {r.gemm: r.precision for r in records if r.weight == "2.weight"} == {
        "forward": "fp8", "dgrad": "high", "wgrad": "high"}


def test_e5m2_by_e5m2_is_a_fallback_error_naming_the_weight():
    torch._dynamo.reset()
    e5m2 = Config(recipe=CurrentScaling(), fwd_format="e5m2", bwd_format="e5m2")
    cfg = Config(recipe=CurrentScaling(), compiler="aot_eager", on_fallback="error", rules=[Rule("2", e5m2)])
    with pytest.raises(Exception, match=r"2\.weight \(forward: both operands E5M2"):
        torch.compile(_mlp(), backend=fp8pass.backend(cfg))(torch.randn(32, 64, device="cuda", dtype=torch.bfloat16))
