"""The one-program scalar kernels (kernels/triton_scaling.py) and the SwiGLU backward kernel
compiled for the GPU (skipped without one): bit-identical to the torch math, the last-program
reduction of ``amax_and_scale`` over thousands of programs and back-to-back launches, no host sync."""

import pytest
import torch

from fp8pass.config import DelayedScaling
from fp8pass.kernels import torch_family, triton_glu
from fp8pass.kernels import triton_scaling as ts
from fp8pass.numerics import E4M3, E5M2, DelayedScalingState, saturating_cast, scale_from_amax
from fp8pass.numerics.scaling import record_update, scale_to_cast
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


def _same_bits(a, b):
    """Bit for bit, a NaN of a wider float matching any NaN (its payload is the converting unit's choice)."""
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point and a.element_size() > 1:
        nan = a.isnan()
        return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.uint8), b[~nan].view(torch.uint8))
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_smooth_scales_and_the_divided_casts_on_cuda(w_dtype):
    """Issue 28 item 3's kernel modes compiled: the scales launch (many programs, the last reduces; back to
    back, the counter reset; no host sync), the transpose-cast of W / c and dW = dB / c in the SwiGLU
    backward's launch, each the torch reference's bits (subnormal quotients and overflow included)."""
    from fp8pass.kernels import triton_operand_casts as tk
    from fp8pass.runtime.swiglu import _unsmooth_weight_grad

    g = torch.Generator(device="cuda").manual_seed(0)
    t, f, n = 300, 14336 + 5, 96
    part = torch.rand(t // 32 + 1, f, device="cuda", generator=g) * torch.exp2(
        torch.randint(-70, 70, (1, f), device="cuda", generator=g).float())
    part[:, 0] = 0.0
    maxima = torch.rand(2, 5000, device="cuda", generator=g) * 30
    w = (torch.randn(n, f, device="cuda", generator=g) * 0.02).to(w_dtype)
    w[0, :3] = torch.tensor([3e38, 1e-20, 1e-39], device="cuda").to(w_dtype)
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = [ts.smooth_scales(part, maxima, w, E4M3, 0.0, False, None, _C_MIN, _C_MAX) for _ in range(3)]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    c = channel_scales(part.amax(0))
    c[:3] = torch.tensor([2.0**-64, 2.0**64, 2.0**-64], device="cuda")
    b = w / c.to(w_dtype)
    for out in outs[:1]:
        assert _same_bits(out.c, channel_scales(part.amax(0)))
        assert _same_bits(out.a.amax, torch_family.tensor_amax(part * out.c))
        b0 = w / out.c.to(w_dtype)
        assert _same_bits(out.b.amax, torch_family.tensor_amax(b0).float())
        assert _same_bits(out.b.scale, scale_from_amax(torch_family.tensor_amax(b0).float(), E4M3).float())
        assert _same_bits(out.gate_scale, scale_from_amax(torch_family.tensor_amax(maxima[0]), E4M3).float())
    assert all(_same_bits(o.b.scale, outs[0].b.scale) for o in outs) and int(ts.counter(w.device)) == 0
    scale = torch.tensor(2.0**-3, device="cuda")
    codes, _, amax = tk.transpose_cast(w, scale, E4M3, transpose=False, divisor=c)
    assert _same_bits(codes, saturating_cast(b.float() * scale, E4M3))
    assert _same_bits(amax, torch_family.tensor_amax(b).float())
    db = (torch.randn(n, f, device="cuda", generator=g) * 1e3).to(torch.bfloat16)
    db[0, :3] = torch.tensor([3e38, 1e-20, 1e-38], device="cuda").to(torch.bfloat16)
    da = torch.randn(t, f, device="cuda", generator=g).to(torch.bfloat16)
    gc = uc = saturating_cast(torch.randn(t, f, device="cuda", generator=g), E4M3)
    one = torch.ones((), device="cuda")
    dg, du, dw = triton_glu.swiglu_backward(da, gc, one, uc, one, c, "channel", torch.bfloat16,
                                            weight_grad=(db, w_dtype))
    assert _same_bits(dw, _unsmooth_weight_grad(db, c, w_dtype))
    dg0, du0 = triton_glu.swiglu_backward(da, gc, one, uc, one, c, "channel", torch.bfloat16)
    assert _same_bits(dg, dg0) and _same_bits(du, du0)


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_fused_channel_swiglu_equals_the_launch_plan_it_replaced_on_cuda(w_dtype, monkeypatch):
    """swiglu_down (channel) compiled: outputs, saved codes/scales and gradients of the 4-launch forward
    and the fused backward equal the former plan's (separate casts, torch divisions) bit for bit."""
    import dataclasses

    from fp8pass.op_schema import GLUKnobs
    from fp8pass.runtime import swiglu

    values = dict(fwd_format="e4m3", bwd_format="e5m2", granularity="tensor", block=128, power_of_two=False,
                  grad_rounding="nearest", margin=0.0, interval=1, algo="max", out_dtype=None, fast_accum=True,
                  backward="fp8", activation="silu", smooth="channel", recast_weight=True)
    knobs = GLUKnobs(**{k.name: values[k.name] for k in dataclasses.fields(GLUKnobs)})

    def replaced_plan(g2, u2, w_down, fmt, a_state, margin, power_of_two):
        ao, s = swiglu._fused_operand(g2, u2, "channel", fmt, a_state, margin, power_of_two)
        return ao, s, None, swiglu.saved_glu_input(g2, fmt), swiglu.saved_glu_input(u2, fmt)

    g = torch.Generator(device="cuda").manual_seed(1)
    gate, up = (torch.randn(512, 1024, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    up[:, 7] *= 300
    wd = (torch.randn(256, 1024, device="cuda", generator=g) * 0.05).to(w_dtype)
    dy = torch.randn(512, 256, device="cuda", generator=g).to(torch.bfloat16)
    results = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(swiglu, "_fused_channel_operands", replaced_plan)
            monkeypatch.setattr(swiglu, "_DIVIDED_IN_KERNEL", ())
        gi, ui, wi = (x.clone().requires_grad_() for x in (gate, up, wd))
        out = torch.ops.fp8pass.swiglu_down(gi, ui, wi, [], [], [], None, *knobs.args())
        out[0].backward(dy)
        results.append([o.detach() for o in out] + [gi.grad, ui.grad, wi.grad])
    for i, (a, b) in enumerate(zip(*results)):
        assert _same_bits(a, b), i
