"""Smooth-SwiGLU: function preservation with quantization off, FP8 semantics of each mode, the
delayed-scaling outlier spike that plain FP8 cannot absorb, fused gate/up, and the inference fold."""

import pytest
import torch
import torch.nn.functional as F

import fp8pass
from fp8pass import E4M3, ops, quantize
from fp8pass.op_schema import GLUKnobs
from fp8pass.runtime import LinearScalingState, channel_scales, fold_channel_scales

MODES = ["channel", "token", None]
ACTS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh"), "relu": F.relu}


def _mlp_ref(x, wg, wu, wd, act=F.silu):
    return F.linear(act(F.linear(x, wg)) * F.linear(x, wu), wd)


def _weights(seed, t=24, d=16, f=40, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, t // 2, d, generator=g).to(dtype)
    wg = (torch.randn(f, d, generator=g) / 4).to(dtype)
    wu = (torch.randn(f, d, generator=g) / 4).to(dtype)
    wd = (torch.randn(d, f, generator=g) / 6).to(dtype)
    dy = torch.randn(2, t // 2, d, generator=g).to(dtype)
    return x, wg, wu, wd, dy


def _grads(fn, x, ws, dy):
    leaves = [x.clone().requires_grad_()] + [w.clone().requires_grad_() for w in ws]
    y = fn(*leaves)
    y.backward(dy)
    return [y.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("activation", list(ACTS))
@pytest.mark.parametrize("smooth", MODES)
def test_function_preserving_with_quantization_off(smooth, activation):
    """Identity format: every mode and activation is the plain GLU MLP, output and all four gradients
    (so the backward's hand-written derivatives are autograd's)."""
    x, wg, wu, wd, dy = _weights(0)
    # an outlier channel, so that the smoothing scales are far from 1
    wg[3] *= 30
    wu[3] *= 30
    got = _grads(lambda *a: ops.swiglu_mlp(*a, smooth=smooth, fwd_format="identity", bwd_format="identity",
                                           activation=activation), x, (wg, wu, wd), dy)
    ref = _grads(lambda *a: _mlp_ref(*a, act=ACTS[activation]), x, (wg, wu, wd), dy)
    for g, r in zip(got, ref):
        assert ((g - r).norm() / r.norm()) <= 1e-6
        assert (g - r).abs().max() <= 1e-6 * r.abs().max()


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu"])
def test_activation_derivatives_match_autograd_in_float64(activation):
    """The backward's closed-form derivatives equal autograd's exactly enough to see any slip
    (float64, values around the kinks and tails, 0 included for relu)."""
    from fp8pass.runtime.swiglu import glu_activation_grad

    g = torch.cat([torch.linspace(-8, 8, 1601, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)])
    gg = g.clone().requires_grad_()
    ACTS[activation](gg).sum().backward()
    act, dact = glu_activation_grad(g, activation)
    torch.testing.assert_close(act, ACTS[activation](g), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(dact, gg.grad, rtol=1e-12, atol=1e-14)


def _knobs(activation, smooth):
    return GLUKnobs("e4m3", "e5m2", "tensor", 128, False, "nearest", 0.0, 1, "max", None, True, "fp8", activation, smooth)


def test_unknown_activation_is_a_clear_error():
    x, wg, wu, wd, _ = _weights(0)
    with pytest.raises(ValueError, match="unknown GLU activation 'swish'.*'gelu_tanh'"):
        ops.swiglu_mlp(x, wg, wu, wd, activation="swish")
    with pytest.raises(ValueError, match="unknown GLU activation"):
        torch.ops.fp8pass.swiglu_down(F.linear(x, wg), F.linear(x, wu), wd, [], [], [], None,
                                      *_knobs("gelu_new", "channel").args())


@pytest.mark.parametrize("smooth,activation", [(m, "silu") for m in MODES] + [("channel", "gelu_tanh"),
                                                                            ("token", "gelu"), (None, "relu")])
def test_fp8_modes_compute_their_documented_operands(smooth, activation):
    """The down GEMM's left operand is exactly quantize(A) for the mode's A; output = its GEMM."""
    x, wg, wu, wd, _ = _weights(1)
    gate, up = F.linear(x, wg), F.linear(x, wu)
    mode = "none" if smooth is None else smooth
    out = torch.ops.fp8pass.swiglu_down(gate, up, wd, [], [], [], None, *_knobs(activation, mode).args())
    act = ACTS[activation]
    h = act(gate) * up
    h2 = h.reshape(-1, h.shape[-1])
    if smooth == "channel":
        c = out[7]
        assert torch.equal(c, torch.exp2(-torch.floor(torch.log2(h2.abs().amax(0)))))
        a, b = h2 * c, wd / c
        assert (a.abs().amax(0) >= 1).all() and (a.abs().amax(0) < 2).all()
    elif smooth == "token":
        r = out[7]
        assert torch.equal(r, up.reshape(-1, up.shape[-1]).abs().amax(1, keepdim=True))
        a, b = act(gate).reshape(-1, h.shape[-1]) * (up.reshape(-1, h.shape[-1]) / r), wd
    else:
        a, b = h2, wd
    qa, qb = quantize(a, E4M3), quantize(b, E4M3)
    assert torch.equal(out[3], qa.data.view(torch.uint8))
    assert torch.equal(out[5], qb.data.view(torch.uint8))
    ref = qa.dequantize(torch.float64) @ qb.dequantize(torch.float64).T
    if smooth == "token":
        ref = ref * r.double()
    torch.testing.assert_close(out[0].reshape(ref.shape).double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("smooth,activation", [(m, "silu") for m in MODES] + [("channel", "gelu_tanh"),
                                                                            ("token", "gelu"), ("channel", "relu")])
def test_fp8_gradients_within_bound_of_fp32(smooth, activation):
    """E4M3 forward / E5M2 backward: relative errors are those of 3-4 chained FP8 roundings
    (u = 1/16 E4M3, 1/8 E5M2): we require < 0.25 relative Frobenius error, and > 1e-3 (not exact)."""
    x, wg, wu, wd, dy = _weights(2, t=64, f=64)
    got = _grads(lambda *a: ops.swiglu_mlp(*a, smooth=smooth, activation=activation), x, (wg, wu, wd), dy)
    ref = _grads(lambda *a: _mlp_ref(*a, act=ACTS[activation]), x, (wg, wu, wd), dy)
    for g, r in zip(got, ref):
        err = float((g - r).norm() / r.norm())
        assert 1e-3 < err < 0.25


def test_delayed_scaling_spike_saturates_plain_fp8_not_smoothed():
    """docs/background.md, Smooth-SwiGLU: after batches that never excite an aligned channel, one batch along it makes
    h's amax jump ~100x; with delayed scales plain FP8 saturates, channel smoothing does not."""
    g = torch.Generator().manual_seed(3)
    d, f = 32, 64
    v = torch.randn(d, generator=g)
    v /= v.norm()
    wg = torch.randn(f, d, generator=g) / d**0.5
    wu = torch.randn(f, d, generator=g) / d**0.5
    wg[5] = wu[5] = 12 * v
    wd = torch.randn(d, f, generator=g) / f**0.5
    recipe = fp8pass.DelayedScaling(history_len=4)
    errs = {}
    for smooth in ("channel", None):
        states = {k: LinearScalingState(recipe) for k in ("gate", "up", "down")}
        for i in range(6):
            x = torch.randn(64, d, generator=g)
            x -= (x @ v)[:, None] * v  # orthogonal to the outlier direction
            ops.swiglu_mlp(x, wg, wu, wd, smooth=smooth, recipe=recipe, states=states)
        spike = torch.randn(64, d, generator=g) + 8 * v
        y = ops.swiglu_mlp(spike, wg, wu, wd, smooth=smooth, recipe=recipe, states=states)
        ref = _mlp_ref(spike, wg, wu, wd)
        errs[smooth] = float((y - ref).norm() / ref.norm())
    assert errs[None] > 0.5
    assert errs["channel"] < 0.15


def test_fused_gate_up_weight_equals_separate():
    x, wg, wu, wd, _ = _weights(4)
    sep = ops.swiglu_mlp(x, wg, wu, wd, smooth="token", fwd_format="identity", bwd_format="identity")
    fused = ops.swiglu_mlp(x, torch.cat([wg, wu]), None, wd, smooth="token", fwd_format="identity",
                           bwd_format="identity")
    torch.testing.assert_close(fused, sep, rtol=1e-6, atol=1e-6)


def test_fold_channel_scales_leaves_the_function_unchanged():
    x, wg, wu, wd, _ = _weights(5)
    h = F.silu(F.linear(x, wg)) * F.linear(x, wu)
    c = channel_scales(h.reshape(-1, h.shape[-1]).abs().amax(0) * 1000)
    new_up, new_down = fold_channel_scales(wu, wd, c)
    assert torch.equal(_mlp_ref(x, wg, new_up, new_down), _mlp_ref(x, wg, wu, wd))
    assert not torch.equal(new_up, wu)
    with pytest.raises(ValueError, match="scales"):
        fold_channel_scales(wu, wd, c[:-1])


def test_channel_scales_edge_cases():
    c = channel_scales(torch.tensor([0.0, float("inf"), float("nan"), 3.0, 0.25, 1e-30]))
    assert c[:3].tolist() == [1.0, 1.0, 1.0]
    assert c[3] == 0.5 and c[4] == 4.0 and c[5] == 2.0**64  # clamped so W / c stays finite


def test_swiglu_bad_inputs():
    x, wg, wu, wd, _ = _weights(6)
    with pytest.raises(ValueError, match="smooth mode"):
        ops.swiglu_mlp(x, wg, wu, wd, smooth="row")
    with pytest.raises(ValueError, match="w_down"):
        ops.swiglu_mlp(x, wg, wu, wd.T)


@pytest.mark.parametrize("family,size", [("torch", "eager"), ("torch", "compiled"), ("triton", "eager")])
def test_recast_weight_gives_the_same_bits_and_saves_no_weight_codes(family, size, monkeypatch):
    """recast_weight=True: backward casts W_down (/ c) again with the forward's scale instead of
    keeping its codes. Outputs and gradients equal the saved-codes path bit for bit (every smooth
    mode, current and delayed scaling, an fp32 and a bf16 weight, the CPU kernels and the CUDA module's
    path on CPU), and no tensor of W_down's shape is saved, only W_down itself."""
    from fp8pass.config import DelayedScaling

    monkeypatch.setenv("FP8PASS_KERNELS", family)
    # "compiled": W_down [64, 256] and gate [512, 256] reach the compiled CPU loops (MIN_COMPILED)
    x, wg, wu, wd, dy = _weights(7) if size == "eager" else _weights(7, t=512, d=64, f=256)
    gate, up = F.linear(x, wg).detach(), F.linear(x, wu).detach()
    for w_dtype in (torch.float32, torch.bfloat16):
        for mode in ("channel", "none", "token"):
            for delayed in (False, True):
                results = []
                for recast in (False, True):
                    states = [[], [], []]
                    if delayed:
                        st = LinearScalingState(DelayedScaling(), "cpu")
                        for s in (st.input, st.weight):  # a history, so the held scales cast
                            s.record(torch.tensor(3.0))
                        states = list(st.op_args())
                    k = _knobs("silu", mode).replace(recast_weight=recast)
                    g, u, w = (t.clone().requires_grad_() for t in (gate, up, wd.to(w_dtype)))
                    saved = []
                    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                        out = torch.ops.fp8pass.swiglu_down(g, u, w, *states, None, *k.args())
                    out[0].backward(dy.to(out[0].dtype))
                    codes_of_w = [t for t in saved if t.shape == w.shape and t.dtype == torch.uint8]
                    assert len(codes_of_w) == (0 if recast else 1), (mode, delayed, recast)
                    assert any(t is w for t in saved) == recast
                    results.append([out[0].detach(), g.grad, u.grad, w.grad])
                for a, b in zip(*results):
                    assert torch.equal(a, b), (family, w_dtype, mode, delayed)


@pytest.mark.parametrize("recipe", [None, "delayed"])
def test_eager_swiglu_mlp_shares_the_input_cast_bit_for_bit(recipe, monkeypatch):
    """ops.swiglu_mlp casts x once for the gate and up projections (fp8_cast_input + two
    fp8_linear_precast) and recasts W_down in backward: over 3 steps, outputs, gradients and delayed
    states equal the per-linear path's (two fp8_linear, W_down's codes kept) bit for bit."""
    from fp8pass.config import DelayedScaling

    def run(shared):
        if not shared:
            monkeypatch.setattr(ops, "_shared_input_linears", lambda *a, **k: None)
            monkeypatch.setattr(ops, "weight_may_be_regathered", lambda w: True)  # recast_weight off too
        _, wg, wu, wd, _ = _weights(11)
        rec = DelayedScaling() if recipe == "delayed" else None
        states = None
        if rec is not None:
            states = {k: LinearScalingState(rec, "cpu") for k in ("gate", "up", "down")}
        g = torch.Generator().manual_seed(3)
        got = []
        leaves = [t.clone().requires_grad_() for t in (wg, wu, wd)]
        for _ in range(3):
            x = torch.randn(2, 12, 16, generator=g, requires_grad=True)
            y = ops.swiglu_mlp(x, *leaves, smooth="channel", recipe=rec, states=states)
            (y ** 2).sum().backward()
            got += [y.detach(), x.grad.clone()] + [t.grad.clone() for t in leaves]
            for t in leaves:
                t.grad = None
        if states:
            got += [t.clone() for s in states.values() for role in s.op_args() for t in role]
        monkeypatch.undo()
        return got

    shared, per_linear = run(True), run(False)
    assert len(shared) == len(per_linear)
    for a, b in zip(shared, per_linear):
        assert torch.equal(a, b)


@pytest.mark.parametrize("smooth", ["channel", "token", "none"])
@pytest.mark.parametrize("activation,family", [("silu", "torch"), ("gelu", "torch"), ("silu", "triton")])
def test_recompute_output_is_the_documented_math_and_saves_no_operand_codes(smooth, activation, family,
                                                                             monkeypatch):
    """recompute_output=True: backward rebuilds A = act(gate) * up (smoothed with forward's scales)
    from the saved E4M3 gate/up and casts it with forward's A scale. The backward equals the saved-A
    backward fed exactly those codes, bit for bit; forward and dgate/dup are unchanged; A's codes are
    not among the saved tensors (gate's and up's are: 2 tensors of [tokens, ffn] bytes, not 3). The
    CPU kernels and the CUDA module's path (Triton's interpreter on CPU)."""
    monkeypatch.setenv("FP8PASS_KERNELS", family)
    x, wg, wu, wd, dy = _weights(5)
    gate, up = F.linear(x, wg).detach(), F.linear(x, wu).detach()
    rows, f = gate.numel() // gate.shape[-1], gate.shape[-1]
    got = {}
    for recompute in (False, True):
        k = _knobs(activation, smooth).replace(recompute_output=recompute)
        g, u, w = (t.clone().requires_grad_() for t in (gate, up, wd))
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = torch.ops.fp8pass.swiglu_down(g, u, w, [], [], [], None, *k.args())
        out[0].backward(dy)
        codes = [t for t in saved if t is not None and t.dtype == torch.uint8 and t.shape == (rows, f)]
        assert len(codes) == (2 if recompute else 3)
        got[recompute] = (out, g.grad, u.grad, w.grad)
    out = got[True][0]
    for a, b in zip([got[False][0][0], *got[False][1:3]], [out[0], *got[True][1:3]]):
        assert torch.equal(a, b)
    # the documented A', cast with forward's scale, through the saved-A backward
    g8, u8 = (out[i].view(torch.float8_e4m3fn).float() / out[i + 1] for i in (8, 10))
    act, s = ACTS[activation](g8), out[7]
    a = act * (u8 / s) if smooth == "token" else act * u8 * s if smooth == "channel" else act * u8
    a_codes = (a * out[4]).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    knobs = _knobs(activation, smooth).args()
    ref = torch.ops.fp8pass.swiglu_down_backward(dy, a_codes, *out[4:12], [], None, gate.dtype, wd.dtype, *knobs)
    assert torch.equal(ref[2], got[True][3])
    assert not torch.equal(got[False][3], got[True][3])  # A' is not A: gate/up's rounding reaches dW_down


def test_recompute_output_gradients_within_fp8_bound_of_fp32():
    """With A recomputed, every gradient stays within the bound test_fp8_gradients_within_bound_of_fp32
    holds the saved-A op to (< 0.25 relative Frobenius error against fp32), on a shape that runs the
    compiled CPU loops; dW_down's error grows by at most half of the saved-A path's."""
    x, wg, wu, wd, dy = _weights(2, t=512, d=64, f=256)
    ref = _grads(lambda *a: _mlp_ref(*a), x, (wg, wu, wd), dy)
    errs = {}
    for recompute in (False, True):
        k = _knobs("silu", "channel").replace(recompute_output=recompute)

        def mlp(x, wg, wu, wd):
            out = torch.ops.fp8pass.swiglu_down(F.linear(x, wg), F.linear(x, wu), wd, [], [], [], None, *k.args())
            return out[0]

        got = _grads(mlp, x, (wg, wu, wd), dy)
        errs[recompute] = [float((g - r).norm() / r.norm()) for g, r in zip(got, ref)]
        assert all(1e-3 < e < 0.25 for e in errs[recompute]), errs
    assert errs[True][4] < 1.5 * errs[False][4], errs


def test_backward_without_a_codes_needs_the_recompute_knob():
    x, wg, wu, wd, dy = _weights(5)
    out = torch.ops.fp8pass.swiglu_down(F.linear(x, wg), F.linear(x, wu), wd, [], [], [], None,
                                        *_knobs("silu", "channel").args())
    with pytest.raises(ValueError, match="a_data is None but the knobs do not recompute A"):
        torch.ops.fp8pass.swiglu_down_backward(dy, None, *out[4:12], [], None, torch.float32, torch.float32,
                                               *_knobs("silu", "channel").args())
