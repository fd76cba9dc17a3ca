"""The one-program scalar kernels (kernels/triton_scaling.py) and the SwiGLU backward kernel
compiled for the GPU (skipped without one): bit-identical to the torch math, the last-program
reduction of ``amax_and_scale`` over thousands of programs and back-to-back launches, no host sync."""

import pytest
import torch

from fp8pass.config import DelayedScaling
from fp8pass.numerics import E4M3, E5M2, DelayedScalingState, saturating_cast, scale_from_amax
from fp8pass.kernels import torch_family
from fp8pass.numerics.scaling import record_update, scale_to_cast
from fp8pass.kernels import triton_glu, triton_scaling as ts
from fp8pass.runtime.swiglu import _C_MAX, _C_MIN, _glu_backward_from_saved, channel_scales

pytestmark = pytest.mark.gpu


def _bits(t):
    return t.float().cpu().view(torch.int32)


@pytest.mark.parametrize("n", [0, 1, 4095, 1 << 20, (1 << 26) + 3])
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_amax_and_scale_on_cuda(n, fmt):
    g = torch.Generator(device="cuda").manual_seed(n)
    x = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
    if n > 10:
        x[n // 3] = -300.0  # the max in a program that is neither first nor last
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = [ts.amax_and_scale(x, fmt, 0.0, False, invert=(torch.full((), 3.0, device="cuda"),))
                for _ in range(3)]  # back to back: the counter is reset by each launch
    finally:
        torch.cuda.set_sync_debug_mode(0)
    amax = torch_family.tensor_amax(x)
    for out in outs:
        assert torch.equal(_bits(out.amax), _bits(amax))
        assert torch.equal(_bits(out.scale), _bits(scale_from_amax(amax, fmt)))
        assert torch.equal(_bits(out.inv_scale), _bits(torch.reciprocal(out.scale)))
    assert int(ts.counter(x.device)) == 0


def test_amax_and_scale_propagates_nan_on_cuda():
    x = torch.randn(1 << 22, device="cuda")
    x[12345] = float("nan")
    out = ts.amax_and_scale(x, E4M3)
    assert torch.isnan(out.amax) and float(out.scale) == 1.0


def test_operand_scale_and_record_on_cuda():
    recipe = DelayedScaling(history_len=8, on_overflow="current")
    states = [DelayedScalingState(recipe, E4M3, "cuda") for _ in range(6)]
    for i, s in enumerate(states):
        s.record(torch.tensor(float(i + 1), device="cuda"))
    partials = torch.tensor([2.0, 5000.0, 1.0], device="cuda")
    for s in states:
        ops = s.op_tensors()
        out = ts.operand_scale(partials, E4M3, state=ops)
        ref = scale_to_cast(ops, partials.max(), E4M3)
        assert torch.equal(_bits(out.scale), _bits(ref)) and int(out.recast) == int(not torch.equal(ref, ops[1]))
    amax = torch.tensor([3.0, float("nan"), 2.0**70, 0.0, 7.0, 1e-3], device="cuda")
    refs = []
    for s, a in zip(states, amax):
        t = s.op_tensors()
        refs.append(record_update(a, t[0], t[1], t[2], t[3], t[4], t[6], t[7], recipe, E4M3))
    ts.record_states([s.op_tensors() for s in states], amax, E4M3, 0.0, 1, "max", False)
    for s, ref in zip(states, refs):
        t = s.op_tensors()
        for got, want in zip((t[0], t[1], t[2], t[3], t[4], t[6]), ref):
            assert torch.equal(got.cpu(), want.cpu())


def test_channel_scales_and_swiglu_backward_on_cuda():
    g = torch.Generator(device="cuda").manual_seed(0)
    part = torch.rand(33, 1000, device="cuda", generator=g) * 100
    assert torch.equal(_bits(ts.channel_scales(part, _C_MIN, _C_MAX)), _bits(channel_scales(part.amax(0))))
    t, f = 300, 700
    gate, up = torch.randn(t, f, device="cuda", generator=g) * 3, torch.randn(t, f, device="cuda", generator=g)
    gs, us = 448.0 / gate.abs().max(), 448.0 / up.abs().max()
    gc, uc = saturating_cast(gate * gs, E4M3), saturating_cast(up * us, E4M3)
    da = (torch.randn(t, f, device="cuda", generator=g) * 1e-2).to(torch.bfloat16)
    s = channel_scales(up.abs().amax(0))
    want = _glu_backward_from_saved(da, gc, gs, uc, us, s, "channel", "silu", torch.bfloat16)
    got = triton_glu.swiglu_backward(da, gc, gs, uc, us, s, "channel", torch.bfloat16)
    for a, b in zip(got, want):
        assert ((a.float() - b.float()).abs() <= torch.finfo(torch.bfloat16).eps * b.float().abs()).all()
