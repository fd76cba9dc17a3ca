"""Grouped (MoE expert) FP8 ops against per-group references built from ``fp8pass.quantize``.

Casts are compared bit for bit (codes and scales). GEMM results are compared with the bound of an
fp32 GEMM of the same dequantized operands: both sides multiply exact FP8 values (products exact in
fp32) and differ only in the order of the fp32 accumulation and in where the scales enter (the op
applies ``1/(sa*sb)`` once to the accumulator, the reference divides each operand first: one fp32
rounding per element), so ``|op - ref| <= (K + 2) 2**-24 (|A| |B|^T)`` elementwise.
"""

from dataclasses import fields

import pytest
import torch

import fp8pass
from fp8pass import E4M3, E5M2, quantize
from fp8pass.kernels import cpu
from fp8pass.numerics import DelayedScalingState
from fp8pass.runtime import LinearScalingState, grouped_state_for

LIN = torch.ops.fp8pass.fp8_grouped_linear
GLU = torch.ops.fp8pass.fp8_grouped_swiglu_down
FP8 = ("e4m3", "e5m2", False, "nearest", 0.0, 1, "max", None, True)  # ..., out_dtype (None: the input's), fast_accum
FP8_E4M3_GRADS = ("e4m3", "e4m3") + FP8[2:]
IDENT = ("identity", "identity", False, "nearest", 0.0, 1, "max", None, True)
OFFS = [10, 10, 33, 40]  # expert 1 empty; rows 40..43 are padding past offs[-1]


def _groups(offs):
    start = 0
    for e, end in enumerate(offs):
        yield e, start, end
        start = end


def _data(seed, rows=44, k=32, n=48, experts=4, transposed=False, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    # each expert's rows at a different magnitude, so per-expert scales differ
    mag = torch.tensor([1.0, 3.0, 0.05, 20.0])[:experts]
    ids = torch.searchsorted(torch.tensor(OFFS), torch.arange(rows), right=True).clamp(max=experts - 1)
    x = (torch.randn(rows, k, generator=g) * mag[ids, None]).to(dtype)
    shape = (experts, k, n) if transposed else (experts, n, k)
    w = (torch.randn(*shape, generator=g) / 10 * mag[:, None, None]).to(dtype)
    dy = torch.randn(rows, n, generator=g).to(dtype)
    return x, w, torch.tensor(OFFS, dtype=torch.int32), dy


def _w_nk(w, e, transposed):
    """Expert e's weight as [N, K] (the layout is [E, K, N] when transposed)."""
    return w[e].t() if transposed else w[e]


def _assert_gemm(c, a, b):
    """``c`` equals ``a @ b.T`` (fp64) within the fp32-accumulation bound of the module doc."""
    a, b = a.double(), b.double()
    tol = (a.shape[1] + 2) * 2.0**-24 * (a.abs() @ b.abs().T) + 1e-30
    assert ((c.double() - a @ b.T).abs() <= tol).all()


def _q(t, fmt, scale=None):
    return quantize(t, fmt, scale=scale)


@pytest.mark.parametrize("transposed", [False, True])
def test_forward_codes_and_result_match_per_group_quantize(transposed):
    x, w, offs, _ = _data(0, transposed=transposed)
    y, x_amax, w_amax, x_data, x_scale, w_data, w_scale = LIN(x, w, offs, transposed, [], [], [], None, *FP8)
    x_codes = x_data.view(torch.float8_e4m3fn)
    w_codes = w_data.view(torch.float8_e4m3fn)
    for e, lo, hi in _groups(OFFS):
        wq = _q(w[e], E4M3)
        assert torch.equal(w_codes[e].view(torch.uint8), wq.data.view(torch.uint8))
        assert w_scale[e] == wq.scale and w_amax[e] == w[e].abs().max()
        if hi == lo:  # empty group: amax 0 -> scale 1, no output rows
            assert x_amax[e] == 0 and x_scale[e] == 1
            continue
        xq = _q(x[lo:hi], E4M3)
        assert torch.equal(x_codes[lo:hi].view(torch.uint8), xq.data.view(torch.uint8))
        assert x_scale[e] == xq.scale and x_amax[e] == x[lo:hi].abs().max()
        wv = wq.data.float() / wq.scale
        _assert_gemm(y[lo:hi], xq.data.float() / xq.scale, wv.t() if transposed else wv)
    assert torch.equal(y[OFFS[-1]:], torch.zeros_like(y[OFFS[-1]:]))
    assert len(set(x_scale[[0, 2, 3]].tolist())) == 3  # per-expert magnitudes -> per-expert scales


@pytest.mark.parametrize("transposed", [False, True])
def test_backward_matches_per_group_reference(transposed):
    x, w, offs, dy = _data(1, transposed=transposed)
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    LIN(xx, ww, offs, transposed, [], [], [], None, *FP8)[0].backward(dy)
    for e, lo, hi in _groups(OFFS):
        if hi == lo:
            assert torch.equal(ww.grad[e], torch.zeros_like(ww.grad[e]))
            continue
        xq, wq, gq = _q(x[lo:hi], E4M3), _q(_w_nk(w, e, transposed), E4M3), _q(dy[lo:hi], E5M2)
        xv, wv, gv = (q.data.float() / q.scale for q in (xq, wq, gq))
        _assert_gemm(xx.grad[lo:hi], gv, wv.t())  # dx = dy W
        dw = ww.grad[e].t() if transposed else ww.grad[e]
        _assert_gemm(dw, gv.t(), xv.t())  # dW = dy^T x
    assert torch.equal(xx.grad[OFFS[-1]:], torch.zeros_like(xx.grad[OFFS[-1]:]))


@pytest.mark.parametrize("transposed", [False, True])
def test_identity_format_is_the_exact_grouped_matmul(transposed):
    x, w, offs, dy = _data(2, transposed=transposed)
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = LIN(xx, ww, offs, transposed, [], [], [], None, *IDENT)[0]
    y.backward(dy)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = torch.cat([xr[lo:hi] @ _w_nk(wr, e, transposed).t() for e, lo, hi in _groups(OFFS)]
                    + [torch.zeros(x.shape[0] - OFFS[-1], y.shape[1])])
    ref.backward(dy)
    torch.testing.assert_close(y, ref, rtol=2**-22, atol=0)  # fp32 rounding: same products, same sums
    torch.testing.assert_close(xx.grad, xr.grad, rtol=2**-22, atol=1e-30)
    torch.testing.assert_close(ww.grad, wr.grad, rtol=2**-22, atol=1e-30)
    # bf16: torch._grouped_mm (fp32 accumulation, one rounding) to one bf16 rounding
    xb, wb = x.bfloat16(), w.bfloat16()
    yb = LIN(xb, wb, offs, transposed, [], [], [], None, *IDENT)[0]
    gm = torch._grouped_mm(xb, wb if transposed else wb.transpose(1, 2), offs=offs)
    n = OFFS[-1]
    torch.testing.assert_close(yb[:n].float(), gm[:n].float(), rtol=2**-8, atol=0)
    assert torch.equal(yb[n:], torch.zeros_like(yb[n:]))


def test_delayed_scaling_per_expert_state_evolves_like_separate_states():
    recipe = fp8pass.DelayedScaling(history_len=4)
    x, w, offs, dy = _data(3)
    w = w.clone().requires_grad_()
    st = grouped_state_for(w, recipe)
    assert st is grouped_state_for(w, recipe) and st.experts == 4
    assert {k: tuple(v.amax_history.shape) for k, v in st.roles().items()} == {
        "input": (4, 4), "weight": (4, 4), "grad_output": (4, 4)}
    alone = [DelayedScalingState(recipe, E4M3) for _ in range(4)]
    codes = []
    for step, factor in enumerate((torch.tensor([1.0, 1.0, 1.0, 1.0]), torch.tensor([0.5, 1.0, 8.0, 2.0]))):
        ids = torch.searchsorted(offs, torch.arange(x.shape[0], dtype=torch.int32), right=True).clamp(max=3)
        xs = (x * factor[ids, None]).requires_grad_()
        out = LIN(xs, w, offs, False, *st.op_args(), None, *FP8)
        st.record_forward(out[1], out[2])
        out[0].backward(dy)
        codes.append((xs.detach(), out[3].view(torch.float8_e4m3fn)))
        for e, lo, hi in _groups(OFFS):
            alone[e].record(xs[lo:hi].abs().max() if hi > lo else torch.zeros(()))
    for e in range(4):  # the stacked state equals each expert's own DelayedScalingState
        assert torch.equal(st.input.amax_history[e], alone[e].amax_history)
        assert st.input.scale[e] == alone[e].scale and st.input.steps[e] == 2
    assert len(set(st.input.scale.tolist())) == 4
    # step 2 cast each expert with the scale recorded at step 1 (not its current amax's)
    xs2, c2 = codes[1]
    lo, hi = 0, 10
    first = DelayedScalingState(recipe, E4M3)
    first.record(x[lo:hi].abs().max())
    assert torch.equal(c2[lo:hi].view(torch.uint8), _q(xs2[lo:hi], E4M3, first.scale).data.view(torch.uint8))
    # grad_output recorded per expert by the backward (dy's per-group amax; empty expert: 0)
    assert torch.equal(st.grad_output.amax_history[:, 0],
                       torch.stack([dy[lo:hi].abs().max() if hi > lo else torch.zeros(()) for _, lo, hi in
                                    _groups(OFFS)]))
    sd = st.state_dict()
    other = LinearScalingState(recipe, experts=4)
    other.load_state_dict(sd)
    assert torch.equal(other.input.scale, st.input.scale)
    with pytest.raises(ValueError, match="amax_history"):
        LinearScalingState(recipe, experts=3).load_state_dict(sd)


def test_delayed_record_broadcasts_over_experts_and_keeps_scalar_behaviour():
    recipe = fp8pass.DelayedScaling(history_len=3, interval=2)
    stacked = DelayedScalingState(recipe, E5M2, experts=3)
    alone = [DelayedScalingState(recipe, E5M2) for _ in range(3)]
    amaxes = torch.tensor([[1.0, float("nan"), 4.0], [2.0, 3.0, 0.0], [0.5, 7.0, float("inf")]])
    with pytest.warns(RuntimeWarning, match="non-finite"):
        for row in amaxes:
            fp8pass.runtime.record(stacked.op_tensors(), row,
                                   E5M2, recipe)
            for e in range(3):
                alone[e].record(row[e])
    for e in range(3):
        for k in ("amax_history", "scale", "steps", "skipped"):
            assert torch.equal(getattr(stacked, k)[e], getattr(alone[e], k)), (e, k)


def test_opcheck_both_ops():
    x, w, offs, _ = _data(4, k=16, n=32)
    st = LinearScalingState(fp8pass.DelayedScaling(), experts=4)
    for states, fmts in (([[], [], []], FP8), (list(st.op_args()), FP8), ([[], [], []], IDENT)):
        torch.library.opcheck(LIN.default, (x.clone().requires_grad_(), w.clone().requires_grad_(), offs, False,
                                            *states, None, *fmts))
    g = torch.Generator().manual_seed(5)
    gate, up = torch.randn(44, 16, generator=g), torch.randn(44, 16, generator=g)
    wd = torch.randn(4, 16, 16, generator=g)
    for smooth in ("channel", "token", "none"):
        torch.library.opcheck(GLU.default, (gate.clone().requires_grad_(), up.clone().requires_grad_(),
                                            wd.clone().requires_grad_(), offs, True, [], [], [], None, *FP8, "silu",
                                            smooth))
        # the fused gate_up form (up=None)
        torch.library.opcheck(GLU.default, (torch.cat((gate, up), 1).requires_grad_(), None,
                                            wd.clone().requires_grad_(), offs, True, [], [], [], None, *FP8, "silu",
                                            smooth))


def test_compiled_aot_eager_equals_eager_with_state_records():
    recipe = fp8pass.DelayedScaling(history_len=4)
    x, w, offs, dy = _data(6, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(6)
    wd = (torch.randn(4, 24, 24, generator=g) / 5).bfloat16()

    def model(x, w, wd, st, st2):
        out = LIN(x, w, offs, False, *st.op_args(), None, *FP8)
        st.record_forward(out[1], out[2])
        gate, up = out[0].chunk(2, dim=-1)
        o2 = GLU(gate, up, wd, offs, False, *st2.op_args(), None, *FP8, "silu", "channel")
        st2.record_forward(o2[1], o2[2])
        return o2[0]

    results = []
    for compiled in (False, True):
        st, st2 = LinearScalingState(recipe, experts=4), LinearScalingState(recipe, experts=4)
        fn = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
        grads = []
        for _ in range(2):
            xx, ww, wdd = (t.clone().requires_grad_() for t in (x, w, wd))
            y = fn(xx, ww, wdd, st, st2)
            y.backward(dy[:, :24])
            grads.append((y, xx.grad, ww.grad, wdd.grad))
        results.append((grads, st.state_dict(), st2.state_dict()))
    (ge, se, se2), (gc, sc, sc2) = results
    for a, b in zip(ge, gc):
        for t, u in zip(a, b):
            assert torch.equal(t, u)
    for d, e in ((se, sc), (se2, sc2)):
        assert d.keys() == e.keys() and all(torch.equal(d[k], e[k]) for k in d)
    assert int(sc["grad_output.steps"][0]) == 2


def _glu_ref(gate, up, wd, transposed):
    """Plain per-group GLU MLP tail in fp32 autograd (silu)."""
    h = torch.nn.functional.silu(gate) * up
    parts = [h[lo:hi] @ (wd[e] if transposed else wd[e].t()) for e, lo, hi in _groups(OFFS)]
    return torch.cat(parts + [h.new_zeros(h.shape[0] - OFFS[-1], parts[0].shape[1])])


@pytest.mark.parametrize("smooth", ["channel", "token", "none"])
@pytest.mark.parametrize("transposed", [False, True])
def test_swiglu_identity_format_is_the_plain_glu_for_every_smoothing(smooth, transposed):
    # the smoothing scales cancel exactly (powers of two for channel; r multiplies back for token)
    g = torch.Generator().manual_seed(7)
    gate, up, dy = (torch.randn(44, 24, generator=g) for _ in range(3))
    dy = dy[:, :16]
    wd = torch.randn(4, 24, 16, generator=g) if transposed else torch.randn(4, 16, 24, generator=g)
    offs = torch.tensor(OFFS, dtype=torch.int32)
    a = [t.clone().requires_grad_() for t in (gate, up, wd)]
    y = GLU(*a, offs, transposed, [], [], [], None, *IDENT, "silu", smooth)[0]
    y.backward(dy)
    r = [t.clone().requires_grad_() for t in (gate, up, wd)]
    ref = _glu_ref(*r, transposed)
    ref.backward(dy)
    rtol = 2**-20 if smooth == "token" else 2**-22  # token: an extra division and product by r
    torch.testing.assert_close(y, ref, rtol=rtol, atol=1e-6)
    for t, u in zip(a, r):
        torch.testing.assert_close(t.grad, u.grad, rtol=rtol, atol=1e-6)
    assert torch.equal(a[0].grad[OFFS[-1]:], torch.zeros_like(a[0].grad[OFFS[-1]:]))


@pytest.mark.parametrize("transposed", [False, True])
def test_swiglu_channel_fp8_codes_and_result_match_per_expert_reference(transposed):
    g = torch.Generator().manual_seed(8)
    gate, up = torch.randn(44, 24, generator=g), torch.randn(44, 24, generator=g) * 3
    wd = torch.randn(4, 24, 16, generator=g) if transposed else torch.randn(4, 16, 24, generator=g)
    offs = torch.tensor(OFFS, dtype=torch.int32)
    y, _, _, a_data, a_scale, b_data, b_scale, c = GLU(gate, up, wd, offs, transposed, [], [], [], None, *FP8,
                                                       "silu", "channel")
    h = torch.nn.functional.silu(gate) * up
    for e, lo, hi in _groups(OFFS):
        w_df = wd[e].t() if transposed else wd[e]  # [D, F]
        if hi == lo:
            assert torch.equal(c[e], torch.ones_like(c[e]))
            continue
        ce = fp8pass.runtime.channel_scales(h[lo:hi].abs().amax(0))
        assert torch.equal(c[e], ce)
        aq, bq = _q(h[lo:hi] * ce, E4M3), _q(w_df / ce, E4M3)
        assert torch.equal(a_data[lo:hi], aq.data.view(torch.uint8)) and a_scale[e] == aq.scale
        b_codes = b_data[e].t() if transposed else b_data[e]
        assert torch.equal(b_codes, bq.data.view(torch.uint8)) and b_scale[e] == bq.scale
        _assert_gemm(y[lo:hi], aq.data.float() / aq.scale, bq.data.float() / bq.scale)


def test_channel_outlier_in_one_expert_changes_only_its_scales():
    g = torch.Generator().manual_seed(9)
    gate, up = torch.randn(44, 24, generator=g), torch.randn(44, 24, generator=g)
    wd = torch.randn(4, 16, 24, generator=g)
    offs = torch.tensor(OFFS, dtype=torch.int32)
    base = GLU(gate, up, wd, offs, False, [], [], [], None, *FP8, "silu", "channel")[7]
    up2 = up.clone()
    up2[3, 5] = 1000.0  # row 3 belongs to expert 0
    out = GLU(gate, up2, wd, offs, False, [], [], [], None, *FP8, "silu", "channel")[7]
    assert out[0, 5] < base[0, 5] / 100  # the outlier channel is scaled down in expert 0
    assert torch.equal(out[1:], base[1:])  # the other experts' scales are unchanged
    assert torch.equal(out[0, :5], base[0, :5]) and torch.equal(out[0, 6:], base[0, 6:])


def test_stochastic_grad_rounding_picks_a_neighbour_of_the_nearest_code():
    x, w, offs, dy = _data(10, rows=44, k=64, n=512)  # dy has 44 x 512 elements: the compiled cast path
    scale = torch.tensor([3.0, 1.0, 0.25, 7.0])
    ids = torch.searchsorted(offs, torch.arange(44, dtype=torch.int32), right=True)
    row_scale = torch.cat([scale, torch.ones(1)])[ids]
    sr = cpu.cast_rows(dy, row_scale, E5M2, "stochastic").view(torch.uint8).int()
    rn = cpu.cast_rows(dy, row_scale, E5M2, "nearest")
    ref = quantize(dy * row_scale[:, None], E5M2, scale=1.0).data
    assert torch.equal(rn.view(torch.uint8), ref.view(torch.uint8))  # per-row cast == per-tensor cast
    # same sign: the code bytes of the two neighbours differ by one
    assert ((sr - rn.view(torch.uint8).int()).abs() <= 1).all()
    assert (sr != rn.view(torch.uint8).int()).any()  # it does round some values up/down differently


def test_saves_only_one_byte_codes():
    x, w, offs, _ = _data(11, dtype=torch.bfloat16)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        LIN(x.requires_grad_(), w.requires_grad_(), offs, False, [], [], [], None, *FP8)
    big = [t for t in saved if t.numel() > 4]
    assert {tuple(t.shape) for t in big} == {tuple(x.shape), tuple(w.shape)}
    assert all(t.element_size() == 1 for t in big)


def test_gemm_dtype_follows_the_bf16_capability(monkeypatch):
    bf, f32 = torch.empty(1, dtype=torch.bfloat16), torch.empty(1)
    monkeypatch.delenv("FP8PASS_CPU_GEMM_DTYPE", raising=False)  # auto: decided by the capability
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    assert cpu.gemm_dtype(torch.bfloat16, bf, bf) == torch.bfloat16
    assert cpu.gemm_dtype(torch.float32, bf, bf) == torch.float32
    assert cpu.gemm_dtype(torch.bfloat16, f32, bf) == torch.float32  # identity-format values stay fp32
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert cpu.gemm_dtype(torch.bfloat16, bf, bf) == torch.float32
    x, w, offs, _ = _data(12, dtype=torch.bfloat16)
    y = LIN(x, w, offs, False, [], [], [], None, *FP8)[0]  # still correct on the fp32 path
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()


def test_bad_arguments_raise_clear_errors():
    x, w, offs, _ = _data(13)
    with pytest.raises(ValueError, match="offs must be int32"):
        LIN(x, w, offs.long(), False, [], [], [], None, *FP8)
    with pytest.raises(ValueError, match="expects K"):
        LIN(x, w, offs, True, [], [], [], None, *FP8)
    with pytest.raises(ValueError, match="offs must be non-decreasing"):
        LIN(x, w, torch.tensor([10, 5, 33, 40], dtype=torch.int32), False, [], [], [], None, *FP8)
    with pytest.raises(ValueError, match="x_state"):
        LIN(x, w, offs, False, list(LinearScalingState(fp8pass.DelayedScaling()).op_args()[0]), [], [], None, *FP8)
    with pytest.raises(ValueError, match="smooth"):
        GLU(x, x, w, offs, True, [], [], [], None, *FP8, "silu", "rows")
    with pytest.raises(ValueError, match="GLU activation"):
        GLU(x, x, w, offs, True, [], [], [], None, *FP8, "swish", "none")
    with pytest.raises(ValueError, match="grad_rounding"):
        LIN(x, w, offs, False, [], [], [], None, *FP8[:3], "up", *FP8[4:])
    with pytest.raises(TypeError, match="out_dtype"):
        LIN(x, w, offs, False, [], [], [], None, *FP8[:-2], torch.int32, True)
    for _ in range(2):  # a bad knob tuple is not cached as valid (Knobs.of): it raises on every call
        with pytest.raises(ValueError, match="algo"):
            LIN(x, w, offs, False, [], [], [], None, *FP8[:6], "median", None, True)
    with pytest.raises(ValueError, match="grouped_state_for"):
        grouped_state_for(w[0], fp8pass.DelayedScaling())


def test_knobs_are_the_schemas_last_arguments():
    """Each grouped op (and its backward) ends with its knob dataclass's fields, in order."""
    from fp8pass.op_schema import GroupedGLUKnobs, GroupedLinearKnobs

    for op, knobs in ((LIN, GroupedLinearKnobs), (GLU, GroupedGLUKnobs),
                      (torch.ops.fp8pass.fp8_grouped_linear_backward, GroupedLinearKnobs),
                      (torch.ops.fp8pass.fp8_grouped_swiglu_down_backward, GroupedGLUKnobs)):
        names = [a.name for a in op.default._schema.arguments]
        assert names[-knobs.count():] == [f.name for f in fields(knobs)]
    assert FP8 == GroupedLinearKnobs(*FP8).args()


@pytest.mark.parametrize("transposed_view", [False, True])
def test_scaled_grouped_mm_call_passes_torchs_own_checks(monkeypatch, transposed_view):
    """The CUDA forward's ``torch._scaled_grouped_mm`` call (never run: no GPU so far) meets the
    contract torch's meta function checks (the checks of ``_scaled_grouped_mm_cuda`` in Blas.cpp):
    E4M3 operands, ``a`` row-major, ``b`` column-major [E, K, N], 16-byte aligned strides, fp32 scales
    of [S] and [E, N], bf16 out. Run on meta tensors, so the arguments are checked, not the math."""
    from fp8pass.kernels import cuda

    monkeypatch.setattr(cuda, "_scaled_grouped_mm_ok", lambda a, b, out_dtype: True)
    meta = dict(device="meta")
    a = torch.empty(160, 64, dtype=torch.float8_e4m3fn, **meta)
    # [E, N, K]: an nn.Linear-layout stack, or (w_transposed) the transposed view of an [E, K, N] one
    b = (torch.empty(4, 64, 96, dtype=torch.float8_e4m3fn, **meta).transpose(1, 2) if transposed_view
         else torch.empty(4, 96, 64, dtype=torch.float8_e4m3fn, **meta))
    scale = torch.empty(4, dtype=torch.float32, **meta)
    offs = torch.empty(4, dtype=torch.int32, **meta)
    out = cuda.grouped_gemm(a, scale, b, scale, offs, torch.bfloat16)
    assert out.shape == (160, 96) and out.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="column major"):  # the check is live: a row-major b fails it
        torch._scaled_grouped_mm(a, torch.empty(4, 64, 96, dtype=torch.float8_e4m3fn, **meta),
                                 torch.empty(160, **meta), torch.empty(4, 96, **meta), offs=offs,
                                 out_dtype=torch.bfloat16)


def test_cuda_kernel_module_fallback_agrees_on_cpu(monkeypatch):
    """FP8PASS_KERNELS=triton runs the CUDA kernel module on CPU tensors: its per-row casts and its
    grouped GEMMs (the emulation of ``_scaled_grouped_mm`` taken without it) against the CPU module.
    The CUDA path casts the E5M2 gradient to E4M3 (``_scaled_grouped_mm`` takes E4M3 only), so it
    equals the CPU module run with E4M3 gradients: same codes, same exact products, fp32 sums."""
    x, w, offs, dy = _data(14)
    g = torch.Generator().manual_seed(14)
    gate, up = torch.randn(44, 24, generator=g), torch.randn(44, 24, generator=g)
    wd = torch.randn(4, 24, 16, generator=g)
    results = []
    for family, knobs in (("torch", FP8_E4M3_GRADS), ("triton", FP8)):
        monkeypatch.setenv("FP8PASS_KERNELS", family)
        a = [t.clone().requires_grad_() for t in (x, w)]
        out = LIN(*a, offs, False, [], [], [], None, *knobs)
        out[0].backward(dy)
        b = [t.clone().requires_grad_() for t in (gate, up, wd)]
        out2 = GLU(*b, offs, True, [], [], [], None, *knobs, "silu", "channel")
        out2[0].backward(dy[:, :16])
        results.append((out, out2, [t.grad for t in a + b]))
    (o1, p1, g1), (o2, p2, g2) = results
    for i in (3, 4, 5, 6):  # codes and scales bit-identical
        assert torch.equal(o1[i], o2[i]) and torch.equal(p1[i], p2[i])
    for u, v in [(o1[0], o2[0]), (p1[0], p2[0])] + list(zip(g1, g2)):
        torch.testing.assert_close(v, u, rtol=1e-5, atol=1e-5)  # same exact products, fp32 sums


@pytest.mark.parametrize("w_transposed", [False, True])
def test_cuda_path_saves_weight_codes_in_the_dgrad_layout(monkeypatch, w_transposed):
    """On the CUDA path the weight cast writes each expert's codes in both GEMMs' layouts (no copy of
    the codes for either GEMM): the saved codes have the weight's shape and values, and are ``[E, K, N]``
    rows in memory (a transposed view for an ``[E, N, K]`` weight, the weight's own layout for an
    ``[E, K, N]`` one); the fake kernels give the same strides (opcheck), for both grouped ops."""
    from benchmarks import gpu_launches as gl

    x, w, offs, dy = _data(16)
    wt = w.transpose(1, 2).contiguous() if w_transposed else w
    g = torch.Generator().manual_seed(16)
    gate, up = torch.randn(44, 24, generator=g), torch.randn(44, 24, generator=g)
    wd = torch.randn(4, 24, 16, generator=g) if w_transposed else torch.randn(4, 16, 24, generator=g)
    lin_args = (offs, w_transposed, [], [], [], None, *FP8)
    glu_args = (offs, w_transposed, [], [], [], None, *FP8, "silu", "channel")
    monkeypatch.setenv("FP8PASS_KERNELS", "torch")
    ref = LIN(x, wt, *lin_args[:-len(FP8)], *FP8_E4M3_GRADS)[5]
    monkeypatch.setenv("FP8PASS_KERNELS", "triton")
    for op, inputs, rest in ((LIN, (x, wt), lin_args), (GLU, (gate, up, wd), glu_args)):
        saved = op(*inputs, *rest)[5]
        weight = inputs[-1]
        assert saved.shape == weight.shape and saved.dtype == torch.uint8
        k_n = saved if w_transposed else saved.transpose(1, 2)  # [E, K, N] rows, as the dgrad GEMM reads them
        assert k_n.is_contiguous()
        if op is LIN:
            assert torch.equal(saved, ref)
        torch.library.opcheck(op.default, tuple(t.clone().requires_grad_() for t in inputs) + rest,
                              test_utils=("test_schema", "test_faketensor"))
    with gl.pretend_cuda_gemms(), gl.LaunchCounter() as c:  # the GEMMs as on a GPU: no copy of the codes
        xx, ww = (t.bfloat16().requires_grad_() for t in (x, wt))
        LIN(xx, ww, *lin_args)[0].backward(dy.bfloat16())
    assert c.aten["aten._scaled_grouped_mm.default"] == 3 and "aten.clone.default" not in c.aten, c.aten


@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("w_transposed", [False, True])
def test_cuda_path_divides_by_channel_scales_in_its_kernels_with_the_torch_ops_bits(monkeypatch, w_transposed,
                                                                                   w_dtype):
    """Channel smoothing on the CUDA path: ``B = W_down / c`` in the weight's cast (a divisor per column
    of ``[E, D, F]``, per row of ``[E, F, D]``) and ``dW = dB / c`` in the wgrad's decode scales give the
    outputs, saved codes and gradients of the torch ops they replace (multiply by ``1 / c`` in the
    weight's dtype, before the cast and after the GEMM), bit for bit."""
    from fp8pass.runtime import grouped_swiglu

    monkeypatch.setenv("FP8PASS_KERNELS", "triton")
    g = torch.Generator().manual_seed(17)
    gate, up = (torch.randn(44, 24, generator=g).bfloat16() for _ in range(2))
    gate[3] *= 40.0  # channel maxima far apart: c spans several powers of two
    wd = (torch.randn(4, *((24, 16) if w_transposed else (16, 24)), generator=g) / 8).to(w_dtype)
    dy = torch.randn(44, 16, generator=g).bfloat16()
    results = []
    for in_kernels in (True, False):
        if not in_kernels:
            monkeypatch.setattr(grouped_swiglu, "_divides_in_kernels", lambda *a: False)
        ts = [t.clone().requires_grad_() for t in (gate, up, wd)]
        out = GLU(*ts, torch.tensor(OFFS, dtype=torch.int32), w_transposed, [], [], [], None, *FP8, "silu", "channel")
        out[0].backward(dy)
        results.append([o.detach() for o in out] + [t.grad for t in ts])
    assert results[1][7].unique().numel() > 2  # the smoothing scales differ per channel
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("smooth", ["channel", "none"])
def test_cpu_fused_glu_path_gives_the_generic_paths_bits(monkeypatch, smooth):
    """Large enough for the compiled CPU kernels: the fused GLU operand/backward (no fp32 [S, F]
    temporaries) against the generic path (h, c gathered per row, A = h c, then cast)."""
    from fp8pass.runtime import grouped_swiglu

    g = torch.Generator().manual_seed(15)
    offs = torch.tensor([700, 700, 1500, 2000], dtype=torch.int32)
    gate, up = (torch.randn(2048, 96, generator=g).bfloat16() for _ in range(2))
    up[5, 7] = 300.0  # an outlier channel in expert 0
    wd = (torch.randn(4, 64, 96, generator=g) / 8).bfloat16()
    dy = torch.randn(2048, 64, generator=g).bfloat16()
    results = []
    for fast in (True, False):
        monkeypatch.setattr(grouped_swiglu, "cpu_fast", lambda t, fast=fast: fast)
        a = [t.clone().requires_grad_() for t in (gate, up, wd)]
        out = GLU(*a, offs, False, [], [], [], None, *FP8, "silu", smooth)
        out[0].backward(dy)
        results.append(([o.detach() for o in out], [t.grad for t in a]))
    (o1, g1), (o2, g2) = results
    for u, v in zip(o1 + g1, o2 + g2):
        assert torch.equal(u, v)


@pytest.mark.parametrize("smooth", ["channel", "none", "token"])
@pytest.mark.parametrize("rows", [44, 2048])  # generic eager path / compiled CPU loops
def test_fused_gate_up_input_gives_the_split_inputs_bits(smooth, rows):
    """``up=None`` with ``gate`` the fused [S, 2F] projection output (gate first, up second) computes
    what the ``chunk(2, -1)`` pieces give: the same outputs, and d(gate_up) equals the ``cat`` of
    dgate and dup that autograd builds from the chunk's backward, bit for bit; ``w_down``'s gradient too."""
    g = torch.Generator().manual_seed(16)
    offs = torch.tensor([r * rows // 44 for r in OFFS], dtype=torch.int32)
    gate_up = torch.randn(rows, 2 * 48, generator=g).bfloat16()
    gate_up[3, 60] = 200.0  # an outlier up channel
    wd = (torch.randn(4, 32, 48, generator=g) / 8).bfloat16()
    dy = torch.randn(rows, 32, generator=g).bfloat16()
    results = []
    for joined in (True, False):
        gu, w = gate_up.clone().requires_grad_(), wd.clone().requires_grad_()
        args = (gu, None) if joined else gu.chunk(2, dim=-1)
        out = GLU(*args, w, offs, False, [], [], [], None, *FP8, "silu", smooth)
        out[0].backward(dy)
        results.append(([o.detach() for o in out], [gu.grad, w.grad]))
    (o1, g1), (o2, g2) = results
    assert g1[0].shape == gate_up.shape and g1[0].abs().sum() > 0
    for u, v in zip(o1 + g1, o2 + g2):
        assert torch.equal(u, v)


def test_fused_gate_up_input_must_have_an_even_width():
    x, w, offs, _ = _data(17)
    with pytest.raises(ValueError, match="fused gate_up output"):
        GLU(torch.randn(44, 95), None, torch.randn(4, 32, 47), offs, False, [], [], [], None, *FP8, "silu", "channel")
    with pytest.raises(ValueError, match="channels"):  # halves of 2 x 40 against an F = 47 weight
        GLU(torch.randn(44, 80), None, torch.randn(4, 32, 47), offs, False, [], [], [], None, *FP8, "silu", "channel")


@pytest.mark.parametrize("fmt", [E5M2, E4M3])
def test_gradient_values_cast_equals_the_codes_values_for_every_bf16(fmt):
    """cast_rows(..., keep_codes=False) computes the GEMM values without the codes (Veltkamp split +
    subnormal rounding): bit for bit the values of the codes, for every bf16 bit pattern (NaN, Inf,
    +-0, subnormals, ties) at several row scales, eager and compiled."""
    x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(256, 256)
    rs = torch.tensor([1.0, 2.0**-20, 3.0, 2.0**10, 1e-30, 7.3e5, 1.37, 2.0**-126]).repeat(32)
    for src in (x, x.float()):
        for eager in (True, False):
            # 31 x 256 < MIN_COMPILED elements: the eager twin (rows 127 and 255 hold Inf and the NaNs)
            inp = src[list(range(0, 256, 9)) + [127, 255]] if eager else src
            got = cpu.cast_rows(inp, rs[:inp.shape[0]], fmt, up=torch.bfloat16, keep_codes=False)
            codes = cpu._cast_rows_math(inp, rs[:inp.shape[0]], fmt.max, fmt.torch_dtype)
            ref = codes.float().bfloat16()
            same = (got.view(torch.int16) == ref.view(torch.int16)) | (got.isnan() & ref.isnan())
            assert same.all(), (eager, src.dtype, inp[~same][:4], got[~same][:4], ref[~same][:4])
            assert got.isnan().sum() == inp.isnan().sum() > 0


def test_backward_keeps_no_zero_gradients_of_the_saved_codes():
    """The codes outputs are never differentiated: autograd must not zero-fill gradients for them
    (a memset of every saved byte, weights included, per step); y's gradient alone still works, and
    a backward through the amaxes only gives zero input gradients."""
    from fp8pass.testing.models import FillRecorder

    x, w, offs, dy = _data(16)
    g = torch.Generator().manual_seed(16)
    wd = torch.randn(4, 24, 24, generator=g)
    a = [t.clone().requires_grad_() for t in (x, w, wd)]
    out = LIN(a[0], a[1], offs, False, [], [], [], None, *FP8)
    gate, up = out[0].chunk(2, dim=-1)
    o2 = GLU(gate, up, a[2], offs, False, [], [], [], None, *FP8, "silu", "channel")
    with FillRecorder() as mode:
        o2[0].backward(dy[:, :24])
    big = {tuple(x.shape), tuple(w.shape), tuple(wd.shape), (x.shape[0], 24)}
    assert not big & set(mode.shapes), mode.shapes
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in a)
    b = [t.clone().requires_grad_() for t in (x, w)]
    out = LIN(*b, offs, False, [], [], [], None, *FP8)
    (out[1].sum() + out[2].sum()).backward()  # no gradient reaches y: the op sees dy None
    assert all(torch.equal(t.grad, torch.zeros_like(t)) for t in b)


class _StackedExperts(torch.nn.Module):
    """Fixed-capacity experts (``bmm`` over [E, C, D]): fused gate/up [E, D, 2F] and down [E, D, F]."""

    def __init__(self, experts=4, d=32, ffn=48):
        super().__init__()
        g = torch.Generator().manual_seed(17)
        self.gate_up = torch.nn.Parameter(torch.randn(experts, d, 2 * ffn, generator=g) / d ** 0.5)
        self.down = torch.nn.Parameter(torch.randn(experts, d, ffn, generator=g) / ffn ** 0.5)

    def forward(self, x):
        gate, up = torch.bmm(x, self.gate_up).chunk(2, dim=-1)
        return torch.bmm(torch.nn.functional.silu(gate) * up, self.down.transpose(1, 2))


def _rel(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("fmt", ["e4m3", "identity"])
def test_rewrite_under_autocast_keeps_node_dtypes_and_gradients(fmt):
    """Under ``autocast(bf16)`` the rewritten MoE graph computes in the original's dtypes: every kept
    node has the dtype it had in Dynamo's graph, the grouped ops output bf16 (the replaced bmm's
    dtype, not their fp32 inputs'), the parameters' gradients stay fp32, and they match the eager
    autocast model within the format's error (identity: bf16 rounding; e4m3: FP8 quantization)."""
    model = _StackedExperts()
    x = torch.randn(4, 40, 32, generator=torch.Generator().manual_seed(18))
    dy = torch.randn(4, 40, 32, generator=torch.Generator().manual_seed(19))
    from fp8pass.testing.models import dynamo_graph_under_autocast

    gm, inputs = dynamo_graph_under_autocast(model, x)
    cfg = fp8pass.Config(recipe=fp8pass.CurrentScaling(), fwd_format=fmt, bwd_format=fmt, compiler="eager",
                         min_dim=16, smooth_swiglu="channel", grad_stochastic_rounding=False)
    new_gm, record = fp8pass.backend(cfg).transform(gm, list(inputs))
    assert record.extra_inputs == []
    assert new_gm.code.count("fp8pass.fp8_grouped_linear.default(") == 1
    assert new_gm.code.count("fp8pass.fp8_grouped_swiglu_down.default(") == 1
    assert "torch.bmm(" not in new_gm.code
    before = {n.name: n.meta["example_value"].dtype for n in gm.graph.nodes
              if isinstance(n.meta.get("example_value"), torch.Tensor)}
    got, grouped = {}, []

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if isinstance(out, torch.Tensor):
                got[n.name] = out.dtype
            if n.op == "call_function" and "fp8_grouped" in str(n.target):
                grouped.append(out[0].dtype)
            return out

    with torch.autocast("cpu", dtype=torch.bfloat16):
        (out,) = Recorder(new_gm).run(*inputs)
    assert grouped == [torch.bfloat16, torch.bfloat16]
    kept = [name for name in got if name in before]
    # x, both weights (the chunk's pieces went: the GLU op takes the fused output whole)
    assert len(kept) >= 3 and {k: got[k] for k in kept} == {k: before[k] for k in kept}
    assert "chunk" not in new_gm.code
    ref_out = [n for n in gm.graph.nodes if n.op == "output"][0].args[0][0]
    assert out.dtype == ref_out.meta["example_value"].dtype == torch.bfloat16
    (out.float() * dy).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    assert all(g.dtype == torch.float32 for g in grads)
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = model(x)
    (eager.float() * dy).sum().backward()
    bound = 2.0 ** -6 if fmt == "identity" else 0.1  # a few bf16 roundings; E4M3/E5M2 quantization
    assert _rel(out, eager) <= bound
    for g, p in zip(grads, model.parameters()):
        assert 0 < _rel(g, p.grad) <= bound, (fmt, _rel(g, p.grad))


@pytest.mark.parametrize("gemm", ["fp32", "bf16"])
def test_autocast_outputs_and_gemm_dtype_are_the_ops_choice(monkeypatch, gemm):
    """Called under autocast(bf16) with ``out_dtype=bf16`` (what the rewrite passes): outputs bf16,
    gradients in the inputs' fp32, and every per-expert GEMM inside the ops (forward and backward)
    in the dtype :func:`cpu.gemm_dtype` chose (``FP8PASS_CPU_GEMM_DTYPE``), never recast by autocast."""
    from torch.profiler import profile

    monkeypatch.setenv(cpu.GEMM_DTYPE_ENV, gemm)
    x, w, offs, dy = _data(20, n=48)
    g = torch.Generator().manual_seed(20)
    wd = torch.randn(4, 32, 24, generator=g) / 5
    a = [t.clone().requires_grad_() for t in (x, w, wd)]
    knobs = FP8[:-2] + (torch.bfloat16, True)
    with profile(record_shapes=True) as prof:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = LIN(a[0], a[1], offs, False, [], [], [], None, *knobs)
            gate, up = out[0].chunk(2, dim=-1)
            y = GLU(gate, up, a[2], offs, False, [], [], [], None, *knobs, "silu", "channel")[0]
            (y.float() * dy[:, :32]).sum().backward()
    assert out[0].dtype == y.dtype == torch.bfloat16
    assert all(t.grad.dtype == torch.float32 for t in a)
    want = {"fp32": "float", "bf16": "c10::BFloat16"}[gemm]
    gemms = [e.dtypes()[1] for e in prof.profiler.kineto_results.events() if e.name() == "aten::addmm_"]
    assert len(gemms) == 6 * 3 and set(gemms) == {want}  # 3 non-empty experts x 3 GEMMs x 2 ops


@pytest.mark.parametrize("transposed", [False, True])
def test_delayed_cast_with_amax_in_one_loop_gives_the_two_pass_bits(monkeypatch, transposed):
    """CPU, delayed scaling with every history non-empty: the rows (x, dy) and the expert weights are
    cast with the held scales and their amaxes taken in the same loop (no separate amax pass). Every
    output, gradient and recorded state equals the two-pass path's (amax, then cast) bit for bit, over
    steps whose held scale differs from the current one; the guard and empty histories take two passes."""
    from fp8pass.runtime import grouped_casting

    recipe = fp8pass.DelayedScaling(history_len=3)
    g = torch.Generator().manual_seed(21)
    offs = torch.tensor([300, 300, 700, 1020], dtype=torch.int32)  # an empty expert, 4 padding rows
    x = torch.randn(1024, 96, generator=g).bfloat16()
    w = (torch.randn(4, *((96, 128) if transposed else (128, 96)), generator=g) / 8).bfloat16()
    gate_up_dy = torch.randn(1024, 128, generator=g).bfloat16()
    wd = (torch.randn(4, *((64, 48) if transposed else (48, 64)), generator=g) / 8).bfloat16()
    dy = torch.randn(1024, 48, generator=g).bfloat16()
    runs, row_amax_of, held_scales = [], cpu.row_amax, grouped_casting.held_scales
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(grouped_casting, "held_scales", lambda state: None)
        row_amax = []
        monkeypatch.setattr(cpu, "row_amax", lambda t, calls=row_amax: calls.append(t.shape) or row_amax_of(t))
        st, st2 = LinearScalingState(recipe, experts=4), LinearScalingState(recipe, experts=4)
        outs = []
        for step, factor in enumerate((1.0, 4.0, 0.25)):  # the held scale lags the current amax
            a = [t.clone().requires_grad_() for t in (x * factor, w, wd)]
            out = LIN(a[0], a[1], offs, transposed, *st.op_args(), None, *FP8)
            st.record_forward(out[1], out[2])
            gate, up = out[0].chunk(2, dim=-1)
            o2 = GLU(gate, up, a[2], offs, transposed, *st2.op_args(), None, *FP8, "silu", "none")
            st2.record_forward(o2[1], o2[2])
            ((o2[0].float() * dy).sum() + (out[0].float() * gate_up_dy).sum()).backward()
            outs += [o.detach() for o in out + o2] + [t.grad for t in a]
            outs += [t.clone() for s in (st, st2) for t in s.op_args()[0] + s.op_args()[1] + s.op_args()[2]]
        runs.append((outs, row_amax))
    (fused_out, fused_amax), (plain_out, plain_amax) = runs
    assert len(fused_out) == len(plain_out)
    for u, v in zip(fused_out, plain_out):
        assert u.dtype == v.dtype and torch.equal(u.view(torch.uint8) if u.element_size() == 1 else u,
                                                  v.view(torch.uint8) if v.element_size() == 1 else v)
    # step 1 bootstraps (empty histories: two passes); later steps take no separate amax pass of x, W,
    # dy (the GLU's A amax comes from its channel pass either way)
    assert len(fused_amax) == 5 and len(plain_amax) == 3 * 5  # x, W_gu, W_down, dy of down, dy of gate/up
    state = LinearScalingState(recipe, experts=4).input.op_tensors()
    assert held_scales(state) is None  # empty history
    state[2].fill_(1)
    state[5].fill_(False)
    assert torch.equal(held_scales(state), state[1])
    state[5].fill_(True)  # overflow guard on: the current amax decides, two passes
    assert held_scales(state) is None


# ---- the CUDA path's grouped GEMMs: torch._scaled_grouped_mm for all three, no host sync ----------

def _exact_codes(shape, seed):
    """E4M3 codes of values in +-[1/8, 4]: every product and every sum of up to 2**10 of them is exact
    in fp32, so GEMMs of these codes are bit-identical whatever the summation order."""
    g = torch.Generator().manual_seed(seed)
    mag = 2.0 ** torch.randint(-3, 3, shape, generator=g) * (1 + torch.randint(0, 8, shape, generator=g) / 8)
    return (mag * (torch.randint(0, 2, shape, generator=g) * 2 - 1)).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("offs", [OFFS, [0, 16, 16, 44], [3, 20, 37, 41]])
def test_grouped_gemms_of_the_cuda_module_are_the_per_group_gemms(offs):
    """``cuda.grouped_gemm`` (2d x 3d) and ``grouped_gemm_wgrad`` (2d x 2d, groups along the contraction,
    re-laid at 16-token boundaries) against one GEMM per group: bit-identical on exact codes, with empty
    groups, rows past offs[-1] and group sizes that are not multiples of 16; per-expert scales."""
    from fp8pass.kernels import cuda

    rows, k, n = 44, 32, 48
    a, b = _exact_codes((rows, k), 0), _exact_codes((4, n, k), 1)
    dy = _exact_codes((rows, n), 2)
    sa, sb, sg = torch.tensor([2.0, 0.5, 4.0, 1.0]), torch.tensor([1.0, 8.0, 0.25, 2.0]), torch.tensor([0.5, 1, 2, 4.])
    o = torch.tensor(offs, dtype=torch.int32)
    y = cuda.grouped_gemm(a, sa, b, sb, o, torch.float32)
    dx = cuda.grouped_gemm(dy, sg, b.transpose(1, 2), sb, o, torch.float32)  # the dgrad's transposed view
    dw = cuda.grouped_gemm_wgrad(dy, sg, a, sa, o, torch.float32)
    for e, lo, hi in _groups(offs):
        af, dyf, bf = a[lo:hi].float() / sa[e], dy[lo:hi].float() / sg[e], b[e].float() / sb[e]
        assert torch.equal(y[lo:hi], af @ bf.t()) and torch.equal(dx[lo:hi], dyf @ bf)
        assert torch.equal(dw[e], dyf.t() @ af)  # zeros for an empty group
    assert not y[offs[-1]:].any() and not dx[offs[-1]:].any()


def test_cuda_path_calls_scaled_grouped_mm_three_times_without_sync_and_is_near_fp32(monkeypatch):
    """The CUDA path of fp8_grouped_linear with ``torch._scaled_grouped_mm`` as on an sm90 GPU
    (``pretend_cuda_gemms``: torch's meta function checks every call's layouts and scale shapes, the
    result is the module's own emulation): three grouped GEMMs, no host sync, the same bits as the
    fallback CPU tensors take; and against the fp32 autograd of the exact grouped matmul within the
    bound of E4M3 operands (each within 2**-4 relative of its value, the E5M2 gradient too, cast to
    E4M3 here): ``|g - ref| <= 2**-3 (|A| |B|^T) + 2**-8 |ref|`` (the second term: bf16 outputs)."""

    from benchmarks import gpu_launches as gl

    monkeypatch.setenv("FP8PASS_KERNELS", "triton")
    x, w, offs, dy = (t.bfloat16() if t.is_floating_point() else t for t in _data(15))

    def run():
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = LIN(xx, ww, offs, False, [], [], [], None, *FP8)[0]
        y.backward(dy)
        return y, xx.grad, ww.grad

    plain = run()
    with gl.pretend_cuda_gemms(), gl.LaunchCounter() as c:
        called = run()
    assert c.syncs == {} and c.aten["aten._scaled_grouped_mm.default"] == 3
    for u, v in zip(plain, called):
        assert torch.equal(u, v)
    xr, wr = x.float().requires_grad_(), w.float().requires_grad_()
    ref = torch.cat([xr[lo:hi] @ wr[e].t() for e, lo, hi in _groups(OFFS)] + [xr.new_zeros(4, 48)])
    ref.backward(dy.float())
    y, dx, dw = (t.float() for t in plain)
    for e, lo, hi in _groups(OFFS):
        xe, we, ge = x[lo:hi].float(), w[e].float(), dy[lo:hi].float()
        for got, want, bound in ((y[lo:hi], ref[lo:hi], xe.abs() @ we.abs().t()),
                                 (dx[lo:hi], xr.grad[lo:hi], ge.abs() @ we.abs()),
                                 (dw[e], wr.grad[e], ge.abs().t() @ xe.abs())):
            assert ((got - want).abs() <= 2.0**-3 * bound + 2.0**-8 * want.abs() + 1e-30).all()
    assert not dx[OFFS[-1]:].any()


def test_gradient_format_of_the_grouped_ops_per_device(monkeypatch):
    """CPU keeps the recipe's gradient format; the CUDA module's grouped GEMMs take E4M3 only, so an
    E5M2 gradient is cast to E4M3 there (its delayed state records in E4M3 too); explain says so."""
    from fp8pass.report.report import ExpertsEntry, Report, expert_grads_line
    from fp8pass.runtime.grouped_casting import grad_format

    cpu_t = torch.zeros(1)
    assert grad_format("e5m2", cpu_t.device) == "e5m2"
    monkeypatch.setenv("FP8PASS_KERNELS", "triton")
    assert [grad_format(f, cpu_t.device) for f in ("e5m2", "e4m3", "e4m3_gaudi", "identity")] == \
        ["e4m3", "e4m3", "e4m3_gaudi", "identity"]
    assert "on CUDA E4M3 per expert" in expert_grads_line("e5m2") and "takes E4M3 only" in expert_grads_line("e5m2")
    assert expert_grads_line("e4m3") == "  grads: E4M3 per expert (CPU and CUDA)"
    report = str(Report(experts=[ExpertsEntry("moe", ("moe.w13", "moe.w2"), "grouped linears")],
                        config=fp8pass.Config()))
    assert expert_grads_line("e5m2") in report.splitlines()  # the default recipe's E5M2 gradients
    recipe = fp8pass.DelayedScaling(history_len=4)
    x, w, offs, dy = _data(16)
    w = w.clone().requires_grad_()
    st = grouped_state_for(w, recipe)
    LIN(x, w, offs, False, *st.op_args(), None, *FP8)[0].backward(dy)
    for e, lo, hi in _groups(OFFS):  # the gradient's held scales are E4M3's (448 / amax), not E5M2's
        alone = DelayedScalingState(recipe, E4M3)
        alone.record(dy[lo:hi].abs().max() if hi > lo else torch.zeros(()))
        assert st.grad_output.scale[e] == alone.scale


@pytest.mark.parametrize("fast_accum", [True, False])
def test_grouped_forward_gemm_accumulates_fast_and_gradient_gemms_precisely(monkeypatch, fast_accum):
    """``fast_accum`` (``Config.fast_accum``) reaches the forward ``_scaled_grouped_mm`` only: dgrad and
    wgrad accumulate precisely, as the dense ops do (tests/runtime/test_gemm_accumulation.py)."""

    from benchmarks import gpu_launches as gl

    monkeypatch.setenv("FP8PASS_KERNELS", "triton")
    x, w, offs, dy = (t.bfloat16() if t.is_floating_point() else t for t in _data(15))
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    with gl.pretend_cuda_gemms() as gemms:
        y = LIN(xx, ww, offs, False, [], [], [], None, *FP8[:-1], fast_accum)[0]
        forward = list(gemms)
        y.backward(dy)
    assert forward == [("_scaled_grouped_mm", fast_accum)]
    assert gemms[1:] == [("_scaled_grouped_mm", False)] * 2
