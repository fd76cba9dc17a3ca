"""The CPU kernels of the training step, rewritten for speed (issue 15), against the formulations they
replaced: same bits, compiled loop and eager twin alike."""

import dataclasses

import pytest
import torch

from fp8pass.kernels import cpu, run_fused
from fp8pass.numerics import get_format
from fp8pass.runtime import swiglu as sw
from fp8pass.runtime.casting import cast_operand, dequantize

FORMATS = ["e4m3", "e5m2", "e4m3_gaudi"]
SLOW = pytest.mark.slow


def _sweep(values, default):
    """``values`` as parameters, all but ``default`` under the ``slow`` marker (the default suite keeps
    one case of each sweep; ``python -m pytest -m slow tests/kernels/test_step_kernels.py`` runs the rest)."""
    return [v if v == default else pytest.param(v, marks=SLOW) for v in values]


def _stochastic_reference(x, scale, seed, fmax, mbits, emin, dtype):
    """The stochastic cast as first written: ``n * 2**(max(e, emin) - mbits)`` in fp32, signed,
    clamped, NaN passed through, then torch's fp32 -> fp8 conversion."""
    xf = x.float()
    v = xf * scale
    bits = v.view(torch.int32)
    mag = bits & 0x7FFFFFFF
    efield = mag >> 23
    normal = efield > 0
    e = torch.where(normal, efield - 127, -126)
    sig = torch.where(normal, (mag & 0x7FFFFF) | 0x800000, mag & 0x7FFFFF)
    s = 23 - mbits + torch.clamp(emin - e, min=0)
    s_cap = torch.clamp(s, max=30)
    sig = sig >> torch.clamp(s - s_cap, max=31)
    mask = (1 << s_cap) - 1
    u = cpu.uniform_bits(v.numel(), seed, v.device) & mask
    n = (sig >> s_cap) + (((sig & mask) + u) >> s_cap)
    out = n.to(torch.float32) * torch.exp2((torch.clamp(e, min=emin) - mbits).to(torch.float32))
    out = torch.where(bits < 0, -out, out).clamp(-fmax, fmax)
    return torch.where(torch.isnan(v), v, out).to(dtype), xf.abs().amax()


def _wide_inputs(n, src, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-45, 20, (n,), generator=g).float())
    x[:12] = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 1e9, -0.0, 0.0, 1e-40,
                           -1e-42, 3e38, 464.0, -479.0])
    return x.to(src)


@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", _sweep(FORMATS, "e4m3"))
def test_stochastic_cast_codes_equal_the_float_formulation(name, src):
    fmt = get_format(name)
    args = (fmt.max, fmt.mbits, fmt.emin, fmt.torch_dtype)
    x = _wide_inputs(cpu.MIN_COMPILED * 4, src)
    seed = torch.tensor(77, dtype=torch.int32)
    for scale in (torch.tensor(1.0), torch.tensor(3.0), torch.tensor(2.0 ** -20)):
        ref, ref_amax = _stochastic_reference(x, scale, seed, *args)
        eager, amax = cpu._stochastic_cast_math(x, scale, seed, *args)
        compiled, c_amax = cpu._compiled_cast_stochastic(*args, src)(x, scale, seed)
        assert eager.dtype == compiled.dtype == fmt.torch_dtype
        ref_bytes = ref.view(torch.uint8)
        assert torch.equal(eager.view(torch.uint8), ref_bytes)
        assert torch.equal(compiled.view(torch.uint8), ref_bytes)
        assert torch.isnan(amax) and torch.isnan(c_amax) and torch.isnan(ref_amax)  # x holds a NaN
        if scale == 1:  # the inputs reach every code up to fmax's, both signs, and NaN
            assert torch.unique(ref_bytes).numel() >= 2 * (fmt.max_code + 1) + 1


@pytest.mark.parametrize("activation", _sweep(["silu", "gelu", "relu"], "silu"))
@pytest.mark.parametrize("smooth", _sweep(["channel", "token", "none"], "channel"))
@pytest.mark.parametrize("rows", [8, cpu.MIN_COMPILED // 32])  # eager below MIN_COMPILED, compiled above
def test_glu_backward_from_saved_codes_equals_dequantize_then_math(rows, smooth, activation):
    g = torch.Generator().manual_seed(3)
    f = 96
    gate = (torch.randn(rows, f, generator=g) * 3).bfloat16()
    up = torch.randn(rows, f, generator=g).bfloat16()
    da = torch.randn(rows, f, generator=g).bfloat16()
    gate[0, 0], up[1, 1] = float("nan"), float("inf")
    fmt = get_format("e4m3")
    go, uo = cast_operand(gate, fmt), cast_operand(up, fmt)
    s = {"channel": torch.exp2(torch.randint(-3, 3, (f,), generator=g).float()),
         "token": torch.rand(rows, 1, generator=g) + 0.5, "none": torch.ones(())}[smooth]
    g2, u2 = dequantize(go.data, go.scale, None), dequantize(uo.data, uo.scale, None)
    for out_dtype in (torch.bfloat16, torch.float32):
        if activation == "silu":
            ref = run_fused(sw._swiglu_backward_math, (da, g2, u2, s), (smooth,))
            got = run_fused(sw._swiglu_backward_from_saved, (da, go.data, go.scale, uo.data, uo.scale, s),
                            (smooth, out_dtype))
        else:
            ref = sw._glu_backward_math(da, g2, u2, s, smooth, activation)
            got = sw._glu_backward_from_saved(da, go.data, go.scale, uo.data, uo.scale, s, smooth, activation,
                                              out_dtype)
        for r, o in zip(ref, got):
            assert o.dtype == out_dtype
            r = r.to(out_dtype)
            nan = torch.isnan(r)
            assert torch.equal(nan, torch.isnan(o))  # NaN payloads may differ, nothing else
            assert torch.equal(torch.where(nan, 0, r).view(torch.uint8), torch.where(nan, 0, o).view(torch.uint8))


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [8, cpu.MIN_COMPILED // 32])
def test_unsmoothed_weight_gradient_equals_convert_then_divide(rows, w_dtype):
    g = torch.Generator().manual_seed(5)
    db = torch.randn(rows, 96, generator=g).bfloat16()
    db[0, 0] = float("inf")
    c = torch.exp2(torch.randint(-60, 60, (96,), generator=g).float())
    got = run_fused(sw._unsmooth_weight_grad, (db, c), (w_dtype,))
    ref = db.to(w_dtype) / c.to(w_dtype)  # what swiglu_down_backward computed before, in two passes
    assert got.dtype == w_dtype and torch.equal(got, ref)


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [8, cpu.MIN_COMPILED // 32])
def test_smoothed_weight_operand_equals_casting_the_divided_weight(rows, w_dtype):
    g = torch.Generator().manual_seed(6)
    w = (torch.randn(rows, 96, generator=g) / 7).to(w_dtype)
    c = torch.exp2(torch.randint(-4, 4, (96,), generator=g).float())
    fmt = get_format("e4m3")
    got = sw._smoothed_weight_operand(w, c, fmt, 0.0, False, torch.bfloat16)
    ref = cast_operand(w / c.to(w_dtype), fmt, up=torch.bfloat16)  # what swiglu_down cast before
    assert torch.equal(got.data.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(got.scale, ref.scale) and torch.equal(got.amax, ref.amax) and torch.equal(got.up, ref.up)
    assert torch.equal(got.up, cpu.upcast(got.data, torch.bfloat16))  # the values beside the codes are theirs
    assert got.data.dtype == fmt.torch_dtype and (got.data.float() != 0).float().mean() > 0.9


def _bits(t):
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


@pytest.mark.parametrize("name", _sweep(FORMATS, "e5m2"))
@pytest.mark.parametrize("up", [torch.bfloat16, torch.float32])
def test_cast_values_equals_the_upcast_codes_bit_for_bit(name, up):
    """cpu.cast_values (one loop, no codes) and cpu.cast's values beside its codes (one loop) give the
    values ``upcast(cast(x))`` gives, for every bf16 bit
    pattern (NaN, Inf, +-0, subnormals, ties) and random fp32 over 40 octaves, at several scales,
    compiled (65536 elements) and eager (below MIN_COMPILED), with the same amax."""
    fmt = get_format(name)
    every_bf16 = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    torch.manual_seed(0)
    wide = (torch.randn(70000) * torch.logspace(-20, 20, 70000, base=2.0)).reshape(700, 100)
    for src in (every_bf16, every_bf16.float(), wide, wide.bfloat16()):
        for scale in (1.0, 2.0 ** -20, 3.0, 7.3e5, 1e-30):
            s = torch.tensor(scale)
            for x in (src, src.reshape(-1)[:1000]):  # compiled, eager
                codes, amax, with_codes = cpu.cast(x, s, fmt, up)
                assert torch.equal(codes.view(torch.uint8), cpu.cast(x, s, fmt)[0].view(torch.uint8))
                ref = cpu.upcast(codes, up)
                got, got_amax = cpu.cast_values(x, s, fmt, up)
                for values in (got, with_codes):  # cast_values, and cast's values beside its codes
                    assert values.dtype == up and values.shape == x.shape
                    same = (_bits(values) == _bits(ref)) | (values.isnan() & ref.isnan())
                    assert same.all(), (name, src.dtype, scale, x[~same][:4], values[~same][:4], ref[~same][:4])
                assert torch.equal(got_amax, amax) or (got_amax.isnan() and amax.isnan())


def test_weight_casts_of_the_precast_linear_write_no_codes_on_cpu(monkeypatch):
    """fp8_linear_precast casts W (forward, delayed and current) and recasts it (backward) with
    cast_values only: cpu.cast never sees a tensor of W's shape, and y, dx, dW equal fp8_linear's bit for bit."""
    import fp8pass  # noqa: F401  (registers the ops)
    from fp8pass.op_schema import LinearKnobs

    seen = []
    real_cast = cpu.cast
    monkeypatch.setattr(cpu, "cast", lambda x, *a, **kw: seen.append(tuple(x.shape)) or real_cast(x, *a, **kw))
    torch.manual_seed(1)
    x = torch.randn(4, 64, 128, dtype=torch.bfloat16)
    w = torch.randn(160, 128) * 0.05  # above MIN_COMPILED: the compiled loop
    dy = torch.randn(4, 64, 160, dtype=torch.bfloat16)
    knobs = LinearKnobs("e4m3", "e5m2", "tensor", 128, False, "nearest", 0.0, 1, "max", torch.bfloat16, True).args()
    outs = []
    for precast in (True, False):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        if precast:
            xd, xs, _, xu = torch.ops.fp8pass.fp8_cast_input(xi.detach(), [], *knobs)
            y = torch.ops.fp8pass.fp8_linear_precast(xi, xd, xs, xu, wi, None, [], [], None, *knobs)[0]
            weight_casts = [s for s in seen if s == tuple(w.shape)]
        else:
            y = torch.ops.fp8pass.fp8_linear(xi, wi, None, [], [], [], None, *knobs)[0]
        y.backward(dy)
        if precast:
            weight_casts += [s for s in seen if s == tuple(w.shape)]
            assert weight_casts == [] and len(seen) > 0
        outs.append((y.detach(), xi.grad, wi.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_gradient_casts_write_no_codes_on_cpu(monkeypatch):
    """With nearest rounding the backward casts dy straight to the GEMM values (cast_values): no codes
    of dy's shape are written or upcast, and dx, dW equal the codes-then-upcast path's bit for bit.
    (Stochastic rounding keeps codes + upcast: a values-only loop measured slower.)"""
    import fp8pass  # noqa: F401  (registers the ops)
    from fp8pass.op_schema import LinearKnobs

    torch.manual_seed(2)
    x = torch.randn(4, 64, 128, dtype=torch.bfloat16)
    w = torch.randn(160, 128) * 0.05
    dy = torch.randn(4, 64, 160, dtype=torch.bfloat16)  # 40960 elements: the compiled loops
    knobs = LinearKnobs("e4m3", "e5m2", "tensor", 128, False, "nearest", 0.0, 1, "max", torch.bfloat16, True).args()

    def grads():
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = torch.ops.fp8pass.fp8_linear(xi, wi, None, [], [], [], None, *knobs)[0]
        y.backward(dy)
        return xi.grad, wi.grad

    seen = []
    for fn in ("cast", "upcast"):
        real = getattr(cpu, fn)

        def spy(t, *a, _real=real, _fn=fn, **kw):
            if _fn != "upcast" or t.element_size() == 1:  # upcast of values already in the GEMM dtype: a no-op
                seen.append(tuple(t.shape))
            return _real(t, *a, **kw)

        monkeypatch.setattr(cpu, fn, spy)
    got = grads()
    assert seen and (256, 160) not in seen  # x's and W's casts were seen, never dy's
    monkeypatch.setattr(cpu, "OFFERS", dataclasses.replace(cpu.OFFERS, values_without_codes=False))  # codes, then upcast
    seen.clear()
    ref = grads()
    assert (256, 160) in seen
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


@pytest.mark.parametrize("rows", [8, cpu.MIN_COMPILED // 32])  # eager below MIN_COMPILED, compiled above
@pytest.mark.parametrize("smooth", ["channel", "none"])
def test_saved_gate_and_up_from_the_operand_loops_amax_equal_casting_them_alone(rows, smooth):
    """swiglu_down saves gate/up with the amax the operand loop computed beside A: the same codes and
    scales as cast_operand of gate and up by themselves (which reads them once more for the amax),
    with NaN/Inf inside and in a bf16 and an fp32 input."""
    import fp8pass  # noqa: F401  (registers the ops)
    from fp8pass.kernels import torch_family
    from fp8pass.op_schema import GLUKnobs

    g = torch.Generator().manual_seed(8)
    for dtype in (torch.bfloat16, torch.float32):
        gate = (torch.randn(rows, 96, generator=g) * 3).to(dtype)
        up = torch.randn(rows, 96, generator=g).to(dtype)
        up[1, 2] = -7e4  # the largest |up| is negative
        w = torch.randn(40, 96, generator=g) * 0.1
        knobs = GLUKnobs("e4m3", "e5m2", "tensor", 128, False, "nearest", 0.0, 1, "max", None, True, "fp8", "silu", smooth).args()
        out = torch.ops.fp8pass.swiglu_down(gate, up, w, [], [], [], None, *knobs)
        fmt = get_format("e4m3")
        for t, codes, scale in ((gate, out[8], out[9]), (up, out[10], out[11])):
            ref = cast_operand(t, fmt)
            assert torch.equal(codes, ref.data.view(torch.uint8)) and torch.equal(scale, ref.scale)
        empty = torch.ops.fp8pass.swiglu_down(gate[:0], up[:0], w, [], [], [], None, *knobs)  # no tokens
        assert empty[0].shape == (0, 40) and torch.equal(empty[9], torch.ones(()))  # amax 0: scale 1
        gate[0, 0], up[3, 3] = float("nan"), float("inf")
        _, _, g_amax, u_amax = sw.operand_and_input_amax(gate, up, smooth, "silu")
        assert torch.isnan(g_amax) and torch.isnan(torch_family.tensor_amax(gate))
        assert torch.equal(u_amax, torch_family.tensor_amax(up)) and torch.isinf(u_amax)


@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
@pytest.mark.parametrize("keep_codes", [True, False])
def test_stochastic_row_cast_with_values_gives_the_fused_loops_bits(name, keep_codes):
    """``cast_rows(stochastic, up=bf16)`` gives the bits of its one-loop eager twin for the same seed:
    E5M2 through the codes loop and :func:`cpu.upcast` (no fused E5M2 -> bf16 conversion), E4M3 in one
    loop; the codes equal those of ``cast_rows`` without ``up`` for the same generator state."""
    fmt = get_format(name)
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(64, cpu.MIN_COMPILED // 32, generator=g) * 20).to(torch.bfloat16)
    rs = torch.rand(64, generator=g) * 8 + 0.5
    got = cpu.cast_rows(x, rs, fmt, "stochastic", torch.Generator().manual_seed(7), up=torch.bfloat16,
                        keep_codes=keep_codes)
    seed = torch.randint(0, 2 ** 31 - 1, (), generator=torch.Generator().manual_seed(7), dtype=torch.int32)
    codes, values = cpu._cast_rows_sr_up_math(x, rs, seed, fmt.max, fmt.mbits, fmt.emin, fmt.torch_dtype,
                                              torch.bfloat16, True)
    alone = cpu.cast_rows(x, rs, fmt, "stochastic", torch.Generator().manual_seed(7))
    assert torch.equal(alone.view(torch.uint8), codes.view(torch.uint8))
    got_values = got[1] if keep_codes else got
    assert torch.equal(got_values.view(torch.int16), values.view(torch.int16))
    if keep_codes:
        assert torch.equal(got[0].view(torch.uint8), codes.view(torch.uint8))
