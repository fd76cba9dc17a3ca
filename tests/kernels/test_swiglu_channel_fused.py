"""Smooth-SwiGLU (channel) on the CUDA code path in few launches (issue 28, item 3), under the interpreter.

The forward casts A, B = W_down / c and the saved gate/up copies in four launches (column maxima with
the inputs' maxima; ``c`` and every scale; A, gate and up codes in one pass; B with the division in
the cast), backward recasts B the same way and makes dW = dB / c in the SwiGLU backward's launch.
Each new kernel mode is checked bit for bit against the torch reference, and the op against the
launch plan it replaces (whose equality with the torch path tests/kernels/test_runtime_triton.py asserts).
"""

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from fp8pass import E4M3, E5M2  # noqa: E402
from fp8pass.config import DelayedScaling  # noqa: E402
from fp8pass.kernels import (
    torch_family,  # noqa: E402
    triton_glu,  # noqa: E402
)
from fp8pass.kernels import triton_operand_casts as tk  # noqa: E402
from fp8pass.kernels import triton_scaling as ts  # noqa: E402
from fp8pass.numerics import DelayedScalingState, saturating_cast, scale_from_amax  # noqa: E402
from fp8pass.numerics.scaling import scale_to_cast  # noqa: E402
from fp8pass.op_schema import GLUKnobs  # noqa: E402
from fp8pass.runtime import swiglu  # noqa: E402

_C_MIN, _C_MAX = swiglu._C_MIN, swiglu._C_MAX


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same(a, b) -> bool:
    """Bit for bit; a NaN of a wider float matches any NaN (its payload is the converting unit's choice)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point and a.element_size() > 1:
        nan = a.isnan()
        return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(-1).view(torch.uint8),
                                                           b[~nan].view(-1).view(torch.uint8))
    return torch.equal(_bits(a), _bits(b))


def _knobs(smooth="channel", **over) -> GLUKnobs:
    base = dict(fwd_format="e4m3", bwd_format="e5m2", granularity="tensor", block=128, power_of_two=False,
                grad_rounding="nearest", margin=0.0, interval=1, algo="max", out_dtype=None, fast_accum=True,
                activation="silu", smooth=smooth)
    names = {f.name for f in dataclasses.fields(GLUKnobs)}
    return GLUKnobs(**{k: v for k, v in {**base, **over}.items() if k in names})


def _hard_weight(n, f, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, f, generator=g) * torch.exp2(torch.randint(-20, 20, (n, f), generator=g).float())
    # divided by c = 2**-64, 2**64, 2**64: overflow to Inf, underflow to -0, a subnormal quotient. (No
    # subnormal inputs: Triton's interpreter misreads bf16 subnormals, which a GPU converts exactly.)
    w[0, :4] = torch.tensor([3.0e38, -2e-38, 1e-20, 0.0])
    return w.to(dtype)


def _channel_partials(rows, f, seed):
    """Column maxima of |h| per token tile with the columns c is hard on: zero, Inf, NaN, tiny, huge,
    just below a power of two."""
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(rows, f, generator=g) * torch.exp2(torch.randint(-80, 80, (1, f), generator=g).float())
    p[:, 0] = 0.0
    p[1, 1] = float("inf")
    p[0, 3] = 2.0 - 2.0**-22
    p[:, 4] = 1e-30
    p[:, 5] = 3e30
    return p


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16, None])
@pytest.mark.parametrize("margin,p2,delayed", [(0.0, False, False), (1.0, True, False), (0.0, False, True)])
def test_smooth_scales_are_the_torch_references(w_dtype, margin, p2, delayed):
    """One launch: c, A's amax (max_f fl(amax_f c_f)) and scale (current or delayed), B = W_down / c's
    amax, scale and decode scale, the gate and up copies' scales: each the torch reference's bits."""
    f = 150  # two programs, the second partly masked
    part = _channel_partials(5, f, 0)
    g = torch.Generator().manual_seed(1)
    maxima = torch.rand(2, 37, generator=g) * 40
    maxima[1, 30] = 9e3
    w = None if w_dtype is None else _hard_weight(24, f, w_dtype, 2)
    state = None
    if delayed:
        st = DelayedScalingState(DelayedScaling(), E4M3)
        st.record(torch.tensor(0.5))
        state = list(st.op_tensors())
    got = ts.smooth_scales(part, maxima, w, E4M3, margin, p2, state, _C_MIN, _C_MAX)
    c = swiglu.channel_scales(part.amax(0))
    assert _same(got.c, c)
    a_amax = torch_family.tensor_amax(part * c)
    assert _same(got.a.amax, a_amax)
    a_scale = scale_to_cast(state, a_amax, E4M3, margin, p2) if delayed else scale_from_amax(a_amax, E4M3, margin, p2)
    assert _same(got.a.scale, a_scale.reshape(()).float())
    assert _same(got.a.inv_scale, torch.reciprocal(a_scale.reshape(()).float()))
    if delayed:
        assert int(got.a.recast) == int(a_scale != st.scale)
    for k, t in ((0, got.gate_scale), (1, got.up_scale)):
        assert _same(t, scale_from_amax(torch_family.tensor_amax(maxima[k]), E4M3, 0.0, False).float())
    if w is None:
        assert got.b is None
        return
    b = w / c.to(w.dtype)
    b_amax = torch_family.tensor_amax(b).float()
    assert _same(got.b.amax, b_amax)
    b_scale = scale_from_amax(b_amax, E4M3, margin, p2).float()
    assert _same(got.b.scale, b_scale)
    assert _same(got.b.inv_scale, torch.reciprocal(b_scale))


def test_smooth_scales_propagate_nan():
    part = _channel_partials(3, 20, 3)
    part[2, 7] = float("nan")
    maxima = torch.ones(2, 5)
    maxima[1, 4] = float("nan")
    w = _hard_weight(6, 20, torch.float32, 4)
    w[3, 9] = float("nan")
    got = ts.smooth_scales(part, maxima, w, E4M3, 0.0, False, None, _C_MIN, _C_MAX)
    assert got.c[7] == 1.0 and got.a.amax.isnan() and got.b.amax.isnan()
    assert got.gate_scale == 448.0 and got.up_scale == 1.0  # scale_from_amax(NaN) = 1 for E4M3


@pytest.mark.parametrize("shape", [(45, 70), (3, 7), (64, 128)])
def test_colamax_input_maxima_and_the_cast_of_gate_and_up_are_exact(shape):
    """The column-maxima pass's per-tile max |gate| and |up| reduce to the tensors' amax (NaN too); the
    cast pass's gate and up codes are saturating_cast(x * scale)'s, and its A codes swiglu_cast's."""
    g = torch.Generator().manual_seed(5)
    gate = (torch.randn(shape, generator=g) * 3).to(torch.bfloat16)
    up = (torch.randn(shape, generator=g) * 2).to(torch.bfloat16)
    up[0, -1] = -600.0
    part, maxima = tk.swiglu_colamax(gate, up, partials=True, input_maxima=True)
    assert _same(part, tk.swiglu_colamax(gate, up, partials=True))
    assert maxima.shape == (2, -(-shape[0] // 32) * -(-shape[1] // 64))
    assert _same(torch_family.tensor_amax(maxima[0]), torch_family.tensor_amax(gate).float())
    assert _same(torch_family.tensor_amax(maxima[1]), torch_family.tensor_amax(up).float())
    c = swiglu.channel_scales(part.amax(0))
    scale, g_scale, u_scale = torch.tensor(3.5), torch.tensor(0.75), torch.tensor(60.0)  # u * 60: saturates
    a, gc, uc = tk.swiglu_cast_with_inputs(gate, up, "channel", E4M3, scale, c, g_scale, u_scale)
    assert _same(a, tk.swiglu_cast(gate, up, "channel", E4M3, scale, c)[0])
    assert _same(gc, saturating_cast(gate.float() * g_scale, E4M3))
    assert _same(uc, saturating_cast(up.float() * u_scale, E4M3))
    gate[1, 2] = float("nan")
    _, maxima = tk.swiglu_colamax(gate, up, partials=True, input_maxima=True)
    assert maxima[0].isnan().sum() == 1 and not maxima[1].isnan().any()


@pytest.mark.parametrize("shape", [(45, 70), (3, 7), (64, 128)])
def test_the_cast_pass_writes_a_transposed_bit_for_bit(shape):
    """TRANSPOSE: the launch's A^T codes ([F, T], contiguous) are its row-major A codes transposed, bit
    for bit (partial tiles, saturation, NaN), and the other outputs are what they are without it."""
    g = torch.Generator().manual_seed(6)
    gate = (torch.randn(shape, generator=g) * 3).to(torch.bfloat16)
    up = (torch.randn(shape, generator=g) * 2).to(torch.bfloat16)
    gate[0, -1], up[0, -1] = 4.0, -600.0  # A * 2 saturates there
    gate[-1, 0] = float("nan")
    c = torch.exp2(torch.randint(-2, 3, (shape[1],), generator=g).float())
    c[-1] = 1.0
    scale, g_scale, u_scale = torch.tensor(2.0), torch.tensor(0.75), torch.tensor(2.0)
    a, gc, uc, a_t = tk.swiglu_cast_with_inputs(gate, up, "channel", E4M3, scale, c, g_scale, u_scale,
                                                transpose=True)
    assert a_t.shape == (shape[1], shape[0]) and a_t.is_contiguous()
    assert _same(a_t, a.t().contiguous())
    assert a.view(torch.uint8)[0, -1] == 0xFE and a.view(torch.uint8)[-1, 0] & 0x7F == 0x7F  # -448, NaN
    for x, y in zip((a, gc, uc), tk.swiglu_cast_with_inputs(gate, up, "channel", E4M3, scale, c, g_scale, u_scale)):
        assert _same(x, y)


def test_the_fused_op_saves_a_column_major_as_its_fake_declares(monkeypatch):
    """On the fused channel path the op's saved A codes are [T, F] laid out column-major (strides
    (1, T): a view of the contiguous A^T the wgrad GEMM reads), and its fake function says so."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setenv("FP8PASS_KERNELS", "triton")
    g = torch.Generator().manual_seed(12)
    gate, up = (torch.randn(40, 24, generator=g).to(torch.bfloat16) for _ in range(2))
    wd = torch.randn(16, 24, generator=g)
    args = ([], [], [], None, *_knobs().args())
    real = torch.ops.fp8pass.swiglu_down(gate, up, wd, *args)[3]
    with FakeTensorMode() as mode:
        fake = torch.ops.fp8pass.swiglu_down(*(mode.from_tensor(x) for x in (gate, up, wd)), *args)[3]
    assert real.shape == fake.shape == (40, 24) and real.stride() == fake.stride() == (1, 40)


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_transpose_cast_with_a_column_divisor_casts_w_over_c(w_dtype, fmt):
    """codes, transposed codes and amax of W / c (divided in W's dtype, as torch divides) bit for bit,
    overflow to Inf and subnormal quotients included; NaN in W stays NaN."""
    w = _hard_weight(37, 150, w_dtype, 6)
    c = swiglu.channel_scales(_channel_partials(2, 150, 7).amax(0))
    c[0], c[1], c[2] = 2.0**-64, 2.0**64, 2.0**64
    scale = torch.tensor(2.0**-3)
    codes, codes_t, amax = tk.transpose_cast(w, scale, fmt, divisor=c)
    b = w / c.to(w_dtype)
    assert b[0, 0].isinf() and b[0, 1] == 0 and 0 < b[0, 2].abs() < torch.finfo(torch.float32).tiny
    assert _same(codes, saturating_cast(b.float() * scale, fmt))
    assert _same(codes_t, codes.t().contiguous())
    assert _same(amax, torch_family.tensor_amax(b).float())
    w[5, 5] = float("nan")
    _, _, amax = tk.transpose_cast(w, scale, fmt, divisor=c)
    assert amax.isnan()
    with pytest.raises(ValueError, match="divisor"):
        tk.transpose_cast(w.half(), scale, fmt, divisor=c)


@pytest.mark.parametrize("db_dtype,w_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                              (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_swiglu_backward_makes_dw_over_c_bit_for_bit(db_dtype, w_dtype):
    """weight_grad: the extra programs of the SwiGLU backward give _unsmooth_weight_grad's dW bits; the
    dgate/dup programs are the launch without it."""
    g = torch.Generator().manual_seed(8)
    t, f, n = 40, 70, 45
    gate, up = torch.randn(t, f, generator=g), torch.randn(t, f, generator=g) * 3
    gs, us = torch.tensor(100.0), torch.tensor(64.0)
    gc, uc = saturating_cast(gate * gs, E4M3), saturating_cast(up * us, E4M3)
    da = torch.randn(t, f, generator=g).to(torch.bfloat16)
    c = swiglu.channel_scales(_channel_partials(2, f, 9).amax(0))
    c[:3] = torch.tensor([2.0**-64, 2.0**64, 2.0**-30])
    db = (torch.randn(n, f, generator=g) * 1e5).to(db_dtype)
    # Inf, a subnormal quotient (fp32 only: Triton's interpreter also stores bf16 subnormals wrongly),
    # a scaled-up tiny one; no subnormal input (see _hard_weight)
    db[0, :3] = torch.tensor([3e38, 1e-20 if w_dtype == torch.float32 else 1e-10, 2e-38]).to(db_dtype)
    db[1, 3] = float("nan")
    dg, du, dw = triton_glu.swiglu_backward(da, gc, gs, uc, us, c, "channel", torch.bfloat16,
                                            weight_grad=(db, w_dtype))
    want = swiglu._unsmooth_weight_grad(db, c, w_dtype)
    assert dw[0, 0].isinf() and dw[1, 3].isnan()
    assert (0 < dw[0, 1].abs() < torch.finfo(torch.float32).tiny) == (w_dtype == torch.float32)
    assert _same(dw, want)
    dg0, du0 = triton_glu.swiglu_backward(da, gc, gs, uc, us, c, "channel", torch.bfloat16)
    assert _same(dg, dg0) and _same(du, du0)
    with pytest.raises(ValueError, match="weight_grad"):
        triton_glu.swiglu_backward(da, gc, gs, uc, us, c, "none", torch.bfloat16, weight_grad=(db, w_dtype))


def _replaced_plan(g2, u2, w_down, fmt, a_state, margin, power_of_two):
    """The launch plan before issue 28 item 3: A by _fused_operand, the copies by saved_glu_input (A^T
    by a copy, what the wgrad GEMM made of the row-major codes before)."""
    ao, s = swiglu._fused_operand(g2, u2, "channel", fmt, a_state, margin, power_of_two)
    ao.data_t = ao.data.t().contiguous()
    return ao, s, None, swiglu.saved_glu_input(g2, fmt), swiglu.saved_glu_input(u2, fmt)


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_channel_path_equals_the_launch_plan_it_replaces(w_dtype, monkeypatch):
    """swiglu_down (channel, silu, per tensor) on the CUDA code path: outputs, saved codes and scales,
    and gradients equal the former plan's (separate amax/scale/cast launches, W_down / c written out,
    dW = dB / c by a torch division) bit for bit: current and delayed A, recast of W_down or its codes
    kept, margin and power-of-two scales, bf16 gate/up. fp16 weights keep the division outside."""
    monkeypatch.setenv("FP8PASS_KERNELS", "triton")
    g = torch.Generator().manual_seed(10)
    t, f, n = 50, 96, 40
    gate = (torch.randn(t, f, generator=g) * 3).to(torch.bfloat16)
    up = (torch.randn(t, f, generator=g) * 2).to(torch.bfloat16)
    up[:, 7] *= 300  # an outlier channel
    up[:, 8] = 0.0  # a zero channel
    wd = (torch.randn(n, f, generator=g) * 0.05).to(w_dtype)
    dy = torch.randn(t, n, generator=g).to(torch.bfloat16)
    cases = [(False, dict()), (True, dict()), (True, dict(margin=1.0, power_of_two=True)), ("delayed", dict())]
    for recast, over in cases:
        results = []
        for fused in (True, False):
            if not fused:
                monkeypatch.setattr(swiglu, "_fused_channel_operands", _replaced_plan)
                monkeypatch.setattr(swiglu, "_DIVIDED_IN_KERNEL", ())
            states = [[], [], []]
            if recast == "delayed":
                st = DelayedScalingState(DelayedScaling(), E4M3)
                st.record(torch.tensor(3.0))
                states[0] = list(st.op_tensors())
            k = _knobs(recast_weight=bool(recast), **over)
            gi, ui, wi = (x.clone().requires_grad_() for x in (gate, up, wd))
            out = torch.ops.fp8pass.swiglu_down(gi, ui, wi, *states, None, *k.args())
            out[0].backward(dy)
            results.append([o.detach() for o in out] + [gi.grad, ui.grad, wi.grad])
            monkeypatch.undo()
            monkeypatch.setenv("FP8PASS_KERNELS", "triton")
        for i, (a, b) in enumerate(zip(*results)):
            assert _same(a, b), (w_dtype, recast, over, i)


def test_the_fused_plan_takes_the_launches_the_budget_counts(monkeypatch):
    """Forward 4 launches before the GEMM (was 12 with the saved copies), backward recast 1 (was 2), dW
    inside the SwiGLU backward (was a division): no torch division on this path. dy and the recast B
    are cast in both layouts and the cast pass writes A^T beside A, so no GEMM copies an operand
    (steady state: the first call's per-device constants made before counting)."""
    from benchmarks import gpu_launches as gl

    monkeypatch.setenv("FP8PASS_KERNELS", "triton")
    g = torch.Generator().manual_seed(11)
    gate, up = (torch.randn(64, 64, generator=g).to(torch.bfloat16).requires_grad_() for _ in range(2))
    wd = torch.randn(48, 64, generator=g).requires_grad_()
    dy = torch.randn(64, 48, generator=g).to(torch.bfloat16)
    k = _knobs(recast_weight=True)
    with gl.pretend_cuda_gemms():
        for step in range(2):
            gate.grad = up.grad = wd.grad = None
            with gl.LaunchCounter() as c:
                out = torch.ops.fp8pass.swiglu_down(gate, up, wd, [], [], [], None, *k.args())
                out[0].backward(dy)
    assert c.syncs == {}
    assert dict(c.triton) == {"_swiglu_colamax_kernel": 1, "_channel_scales_kernel": 1, "_swiglu_cast_kernel": 1,
                              "_transpose_cast_kernel": 3, "_amax_scale_kernel": 1, "_swiglu_backward_kernel": 1}
    assert {op: n for op, n in c.aten.items() if "copy" not in op} == {"aten._scaled_mm.default": 3}
    assert not any("copy" in op or "contiguous" in op for op in c.aten)


def test_no_tokens_take_the_former_plan_with_unit_channel_scales(monkeypatch):
    """T = 0 (a rank or micro-batch with no tokens): the column-maxima pass gives zeros, c = 1, W_down's
    gradient is 0 (this failed before: the empty partials lost their token axis)."""
    monkeypatch.setenv("FP8PASS_KERNELS", "triton")
    gate, up = (torch.zeros(0, 16, requires_grad=True) for _ in range(2))
    wd = torch.randn(8, 16, requires_grad=True)
    out = torch.ops.fp8pass.swiglu_down(gate, up, wd, [], [], [], None, *_knobs(recast_weight=True).args())
    out[0].sum().backward()
    assert out[0].shape == (0, 8) and torch.equal(out[7], torch.ones(16))
    assert torch.equal(wd.grad, torch.zeros(8, 16))
