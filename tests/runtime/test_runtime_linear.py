"""fp8_linear: bit-exact casts, FP8 GEMM results within the derived error bound, delayed scaling,
shapes, saved bytes, and errors. Bound (docs/runtime.md): for ``C = A B^T`` with quantized
``Â = A + e_A``, ``|e_A| <= u_A |A| + eta_A`` (``u`` = 2**-(mbits+1) the unit roundoff, ``eta`` half the
smallest subnormal step over the scale), ``|Ĉ - C| <= |e_A| |B̂|^T + |A| |e_B|^T + out rounding``."""

import pytest
import torch
import torch.nn.functional as F

import fp8pass
from fp8pass import E4M3, E5M2, ops, quantize
from fp8pass.kernels import cpu
from fp8pass.runtime import LinearScalingState


def _bound(a, b, fa, fb, sa, sb, out_u):
    """Elementwise bound on |Â B̂^T - A B^T| (fp64), with scales sa/sb (tensors broadcastable)."""
    a, b = a.double(), b.double()
    def err(t, f, s):
        return t.abs() * 2.0 ** -(f.mbits + 1) + 2.0 ** (f.emin - f.mbits - 1) / s.double()
    ea, eb = err(a, fa, sa), err(b, fb, sb)
    bhat = b.abs() + eb
    core = ea @ bhat.T + a.abs() @ eb.T
    ref = (a @ b.T).abs()
    return core + out_u * (ref + core) + 1e-30


def _assert_gemm(c, a, b):
    """``c`` equals ``a @ b.T`` up to fp32 accumulation: ``|err| <= 2 K 2**-24 (|a| |b|^T)``."""
    a, b = a.double(), b.double()
    tol = 2 * a.shape[1] * 2.0**-24 * (a.abs() @ b.abs().T) + 1e-30
    assert ((c.double() - a @ b.T).abs() <= tol).all()


def _data(seed, t=64, k=96, n=48, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, k, generator=g) * 3).to(dtype)
    w = (torch.randn(n, k, generator=g) / 10).to(dtype)
    dy = torch.randn(t, n, generator=g).to(dtype)
    return x, w, dy


def _grads(fn, x, w, dy, b=None):
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    args = (x, w) if b is None else (x, w, b.clone().requires_grad_())
    y = fn(*args)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_forward_and_backward_within_derived_bound(dtype):
    x, w, dy = _data(0, dtype=dtype)
    y, dx, dw = _grads(ops.fp8_linear, x, w, dy)
    assert y.dtype == dx.dtype == dw.dtype == dtype
    out_u = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
    sx = E4M3.max / x.float().abs().max()
    sw = E4M3.max / w.float().abs().max()
    sg = E5M2.max / dy.float().abs().max()
    xd, wd, gd = x.double(), w.double(), dy.double()
    assert ((y.double() - xd @ wd.T).abs() <= _bound(x, w, E4M3, E4M3, sx, sw, out_u)).all()
    assert ((dx.double() - gd @ wd).abs() <= _bound(dy, w.T, E5M2, E4M3, sg, sw, out_u)).all()
    assert ((dw.double() - gd.T @ xd).abs() <= _bound(dy.T, x.T, E5M2, E4M3, sg, sx, out_u)).all()
    # and the bound is not vacuous: FP8 is visibly less exact than fp32 here
    assert (y.double() - xd @ wd.T).abs().max() > 1e-3


def test_fp32_results_equal_the_dequantized_reference():
    """The op's GEMMs are exactly the math of fp8pass.quantize's codes (fp32 accumulation)."""
    x, w, dy = _data(1)
    y, dx, dw = _grads(ops.fp8_linear, x, w, dy)
    qx, qw, qg = quantize(x, E4M3), quantize(w, E4M3), quantize(dy, E5M2)
    xd, wd, gd = (q.dequantize(torch.float64) for q in (qx, qw, qg))
    _assert_gemm(y, xd, wd)
    _assert_gemm(dx, gd, wd.T)
    _assert_gemm(dw, gd.T, xd.T)
    out = torch.ops.fp8pass.fp8_linear(x, w, None, [], [], [], None, "e4m3", "e5m2", "tensor", 128, False, "nearest",
                                       0.0, 1, "max", None, True, "fp8")
    assert torch.equal(out[3].view(-1), qx.data.view(torch.uint8).view(-1))
    assert torch.equal(out[5], qw.data.view(torch.uint8))


@pytest.mark.parametrize("gran", ["row", "block"])
def test_row_and_block_scaling_match_quantize(gran):
    x, w, dy = _data(2, t=40, k=256, n=136)
    recipe = fp8pass.CurrentScaling(gran, block=128)
    y, dx, dw = _grads(lambda a, b: ops.fp8_linear(a, b, recipe=recipe), x, w, dy)
    blk = lambda weight: None if gran == "row" else ((128, 128) if weight else (1, 128))  # noqa: E731
    gr = "row" if gran == "row" else "block"
    deq = lambda t, f, wt: quantize(t, f, granularity=gr, block=blk(wt)).dequantize(torch.float64)  # noqa: E731
    xd, wd, gd = deq(x, E4M3, False), deq(w, E4M3, True), deq(dy, E5M2, False)
    _assert_gemm(y, xd, wd)
    _assert_gemm(dx, gd, wd.T)
    _assert_gemm(dw, gd.T, xd.T)


def test_identity_format_is_the_unquantized_linear():
    x, w, dy = _data(3)
    b = torch.randn(48)
    got = _grads(lambda a, c, d: ops.fp8_linear(a, c, d, fwd_format="identity", bwd_format="identity"), x, w, dy, b)
    ref = _grads(F.linear, x, w, dy, b)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6)


def test_bias_in_high_precision_and_its_grad():
    x, w, dy = _data(4, dtype=torch.bfloat16)
    b = (torch.randn(48) * 100).to(torch.bfloat16).requires_grad_()
    y = ops.fp8_linear(x, w, b)
    y.backward(dy)
    torch.testing.assert_close(b.grad.float(), dy.float().sum(0), rtol=1e-2, atol=1e-2)
    # the bias is added unquantized inside the fp32 accumulation: one bf16 rounding of the exact result
    xq, wq = (quantize(t, E4M3).dequantize(torch.float64) for t in (x, w))
    ref = xq @ wq.T + b.detach().double()
    assert ((y.double() - ref).abs() <= 2.0**-8 * ref.abs() + 1e-3).all()


def test_shapes_noncontiguous_and_empty():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 5, 7, 32, generator=g)
    w = torch.randn(16, 32, generator=g)
    y = ops.fp8_linear(x, w)
    assert y.shape == (2, 5, 7, 16)
    xt = torch.randn(32, 10, generator=g).t()  # non-contiguous [10, 32]
    assert not xt.is_contiguous()
    torch.testing.assert_close(ops.fp8_linear(xt, w), ops.fp8_linear(xt.contiguous(), w))
    xe = torch.randn(0, 32, requires_grad=True)
    we = w.clone().requires_grad_()
    ye = ops.fp8_linear(xe, we)
    assert ye.shape == (0, 16)
    ye.sum().backward()
    assert xe.grad.shape == (0, 32) and torch.equal(we.grad, torch.zeros_like(we))


def test_saves_only_one_byte_codes_for_backward():
    x, w, _ = _data(6, t=128, k=128, n=64, dtype=torch.bfloat16)
    x.requires_grad_()
    w.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        ops.fp8_linear(x, w)
    big = [t for t in saved if t.numel() > 1]
    assert len(big) == 2 and all(t.element_size() == 1 for t in big)
    assert {tuple(t.shape) for t in big} == {(128, 128), (64, 128)}


def test_delayed_scaling_bootstrap_history_and_grad_record():
    recipe = fp8pass.DelayedScaling(history_len=4)
    st = LinearScalingState(recipe)
    x, w, dy = _data(7)
    # step 1: empty history -> current scale; amaxes recorded afterwards
    y1, _, _ = _grads(lambda a, b: ops.fp8_linear(a, b, recipe=recipe, state=st), x, w, dy)
    torch.testing.assert_close(y1, ops.fp8_linear(x, w))
    assert int(st.input.steps) == int(st.weight.steps) == int(st.grad_output.steps) == 1
    assert st.input.amax_history[0] == x.abs().max() and st.grad_output.amax_history[0] == dy.abs().max()
    # step 2 with a 4x larger input: delayed scale (from step 1) saturates the large values
    y2, _, _ = _grads(lambda a, b: ops.fp8_linear(a, b, recipe=recipe, state=st), 4 * x, w, dy)
    out = torch.ops.fp8pass.fp8_linear(4 * x, w, None, [], [], [], None, "e4m3", "e5m2", "tensor", 128, False,
                                       "nearest", 0.0, 1, "max", None, True, "fp8")
    qx = quantize(4 * x, E4M3, scale=E4M3.max / x.abs().max())
    assert qx.data.float().abs().max() == E4M3.max  # saturated codes, as delayed scaling implies
    assert not torch.allclose(y2, out[0])
    assert st.input.amax_history[0] == 4 * x.abs().max() and st.input.amax_history[1] == x.abs().max()
    torch.testing.assert_close(st.input.scale, E4M3.max / (4 * x.abs().max()))


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_no_grad_records_nothing_and_keeps_no_backward(mode):
    recipe = fp8pass.DelayedScaling()
    st = LinearScalingState(recipe)
    x, w, _ = _data(8)
    w.requires_grad_()
    ctx = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with ctx:
        y = ops.fp8_linear(x, w, recipe=recipe, state=st)
    assert y.grad_fn is None and not y.requires_grad
    assert int(st.grad_output.steps) == 0
    assert int(st.input.steps) == 1  # forward amaxes are still recorded (the scales in use)


def test_stochastic_grad_rounding_is_unbiased_and_bounded():
    x, w, dy = _data(9, t=32, k=32, n=16)
    dy = dy * 0.37
    torch.manual_seed(0)
    runs = [_grads(lambda a, b: ops.fp8_linear(a, b, grad_rounding="stochastic"), x, w, dy)[1] for _ in range(64)]
    assert not torch.equal(runs[0], runs[1])
    qw = quantize(w, E4M3).dequantize(torch.float64)
    exact = dy.double() @ qw  # dx with exact grad_output and the E4M3 weight
    mean_err = (torch.stack(runs).double().mean(0) - exact).abs().mean()
    one_err = (runs[0].double() - exact).abs().mean()
    assert mean_err < one_err / 3  # averaging SR draws converges (RNE errors would not average out)


def test_compiled_cpu_cast_is_bit_exact_with_numerics():
    g = torch.Generator().manual_seed(10)
    n = cpu.MIN_COMPILED * 2
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-20, 12, (n,), generator=g).float())
    # exact ties of both formats, saturation, inf, nan, signed zero
    x[:8] = torch.tensor([1.0625, 1.1875, 2.125, 500.0, -1e9, float("inf"), float("nan"), -0.0])
    s = torch.tensor(1.0)
    for fmt in (E4M3, E5M2):
        for src in (torch.float32, torch.bfloat16):
            xs = x.to(src)
            codes, amax, up = cpu.cast(xs, s, fmt, up=torch.bfloat16)
            ref = fp8pass.numerics.saturating_cast(xs.float(), fmt)
            ok = ~ref.float().isnan()  # NaN stays NaN (its sign bit may differ)
            assert torch.equal(codes.view(torch.uint8)[ok], ref.view(torch.uint8)[ok]), (fmt, src)
            assert torch.equal(codes.float().isnan(), ~ok)
            assert torch.equal(up[ok], ref.to(torch.bfloat16)[ok]) and up[~ok].isnan().all()
            assert amax.isnan()
            big = torch.randn(n, generator=g).to(torch.float8_e4m3fn)
            assert torch.equal(cpu.upcast(big, torch.bfloat16), big.to(torch.bfloat16))


@pytest.mark.parametrize("fmt", [E5M2, E4M3])
@pytest.mark.parametrize("n", [1000, cpu.MIN_COMPILED * 2])  # the eager twin and the compiled loop
def test_compiled_stochastic_cast_rounds_to_a_neighbour_without_bias(fmt, n):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-24, 14, (n,), generator=g).float())
    scale = torch.tensor(1.0)
    grid = torch.unique(torch.arange(256, dtype=torch.uint8).view(fmt.torch_dtype).float())
    grid = grid[torch.isfinite(grid)]
    v = x.clamp(-fmt.max, fmt.max)
    hi = grid[torch.searchsorted(grid, v).clamp(max=grid.numel() - 1)]
    lo = torch.where(hi == v, hi, grid[(torch.searchsorted(grid, v) - 1).clamp(min=0)])
    draws = []
    for k in range(48):
        codes, amax = cpu.cast_stochastic(x, scale, fmt, torch.Generator().manual_seed(k))
        got = codes.float()
        assert ((got == lo) | (got == hi)).all()  # only the two grid neighbours (saturating)
        assert amax == x.abs().max()
        draws.append(got)
    mean = torch.stack(draws).double().mean(0)
    gap = (hi - lo).double()
    inside = gap > 0
    # E[draw] = v: the per-element error of a 48-draw mean is at most gap/(2*sqrt(48)) in std;
    # averaged over thousands of elements the normalised bias must vanish.
    bias = ((mean - v.double())[inside] / gap[inside]).mean()
    assert abs(bias) < 4 * 0.5 / (48 * inside.sum().item()) ** 0.5 + 1e-3
    a = cpu.cast_stochastic(x, scale, fmt, torch.Generator().manual_seed(1))[0]
    b = cpu.cast_stochastic(x, scale, fmt, torch.Generator().manual_seed(1))[0]
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # reproducible from the generator


def test_compiled_stochastic_cast_specials_and_the_eager_twin_agree():
    n = cpu.MIN_COMPILED * 2
    x = torch.randn(n, generator=torch.Generator().manual_seed(2)) * 30
    x[:7] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e9, -0.0, 0.0, 1.25])
    seed = torch.tensor(123, dtype=torch.int32)
    args = (E5M2.max, E5M2.mbits, E5M2.emin, E5M2.torch_dtype)
    compiled = cpu._compiled_cast_stochastic(*args, torch.float32)(x, torch.tensor(1.0), seed)[0]
    eager = cpu._stochastic_cast_math(x, torch.tensor(1.0), seed, *args)[0]
    assert torch.equal(compiled.view(torch.uint8), eager.view(torch.uint8))
    head = compiled[:7].float()
    assert torch.isnan(head[0]) and head[1] == E5M2.max and head[2] == -E5M2.max and head[3] == E5M2.max
    assert head[4] == 0 and head[5] == 0 and head[6] == 1.25  # zeros and grid points are exact
    # far below the smallest subnormal: rounds to 0 or to it, with the right probability
    tiny = torch.full((1 << 16,), E5M2.min_subnormal / 8)
    got = cpu.cast_stochastic(tiny, torch.tensor(1.0), E5M2, torch.Generator().manual_seed(0))[0].float()
    assert set(got.unique().tolist()) <= {0.0, E5M2.min_subnormal}
    assert abs(got.mean().item() / (E5M2.min_subnormal / 8) - 1) < 0.05
    for v in (3e-20, 1e-30, 1e-40):  # 2^40+ below it (shift counts past the int width): always 0
        far = cpu.cast_stochastic(torch.full((1 << 16,), v), torch.tensor(1.0), E5M2)[0].float()
        assert (far == 0).all()


def test_uniform_bits_are_uniform_and_uncorrelated():
    h = cpu.uniform_bits(1 << 20, torch.tensor(99, dtype=torch.int32))
    for shift in (0, 12, 26):
        counts = torch.bincount(((h >> shift) & 15).long(), minlength=16).float()
        assert (counts / counts.mean() - 1).abs().max() < 0.02
    u = (h.double() + 2.0 ** 31) / 2.0 ** 32
    assert abs(u.mean().item() - 0.5) < 2e-3
    assert abs(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1].item()) < 5e-3
    other = cpu.uniform_bits(1 << 20, torch.tensor(100, dtype=torch.int32))
    assert (h == other).float().mean() < 1e-3  # another seed, another stream


def test_bad_inputs_raise_clear_errors():
    x, w, _ = _data(11)
    with pytest.raises(ValueError, match="input features"):
        ops.fp8_linear(x[:, :10], w)
    with pytest.raises(ValueError, match="granularity"):
        ops.fp8_linear(x, w, recipe=fp8pass.CurrentScaling("tile"))
    with pytest.raises(TypeError, match="float16/bfloat16"):
        ops.fp8_linear(x.int(), w)
    with pytest.raises(ValueError, match="FP8 format"):
        ops.fp8_linear(x, w, fwd_format="e2m1")
    with pytest.raises(ValueError, match="grad_rounding"):
        ops.fp8_linear(x, w, grad_rounding="up")
    with pytest.raises(TypeError, match="recipe"):
        ops.fp8_linear(x, w, recipe="fp8")
    with pytest.raises(ValueError, match="already has delayed-scaling state"):
        ops.fp8_linear(x, w, recipe=fp8pass.DelayedScaling(history_len=4))
        ops.fp8_linear(x, w, recipe=fp8pass.DelayedScaling(history_len=8))


@pytest.mark.parametrize("up", [torch.bfloat16, torch.float16, torch.float32])
def test_compiled_upcast_every_code(up):
    """The compiled fp8 -> bf16/fp16/fp32 upcast gives every code's exact value (NaN for NaN codes),
    in one loop (E4M3) or through fp32 (E5M2 to a 2-byte dtype), flat and as a transposed 2-D view."""
    n = cpu.MIN_COMPILED
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        codes = torch.arange(256, dtype=torch.uint8).repeat(n // 256).view(dtype)
        for c in (codes, codes.view(128, -1).t()):
            got, ref = cpu.upcast(c, up), c.to(up)
            assert got.dtype == up and got.shape == c.shape
            nan = ref.isnan()
            assert torch.equal(got.isnan(), nan)
            bits = torch.int32 if up == torch.float32 else torch.int16
            assert torch.equal(got.contiguous().view(bits)[~nan], ref.contiguous().view(bits)[~nan])


def test_many_format_dtype_variants_stay_compiled():
    """Each (format, dtype) kernel is its own compiled function: no shared recompile limit is hit
    (which would silently switch every cast to the slow eager twins)."""
    n = cpu.MIN_COMPILED
    for fmt in (E4M3, E5M2, fp8pass.E4M3_GAUDI):
        for src in (torch.bfloat16, torch.float32, torch.float16):  # 9 variants > Dynamo's limit of 8
            codes, _, upc = cpu.cast(torch.randn(n).to(src), torch.tensor(1.0), fmt, torch.bfloat16)
            assert torch.equal(upc, codes.to(torch.bfloat16))
    assert cpu.fused_enabled()


def test_gemm_dtype_follows_cpu_capability_and_override(monkeypatch):
    """bf16 GEMMs only where oneDNN has native bf16 (else ~100x slower than fp32); the env var forces."""
    from fp8pass.runtime.linear import _up

    monkeypatch.delenv("FP8PASS_CPU_GEMM_DTYPE", raising=False)
    bf = torch.empty(1, dtype=torch.bfloat16)
    monkeypatch.setattr(cpu, "native_bf16", lambda: True)   # AVX512-BF16 / AMX
    assert cpu.fast_matmul_dtype() == torch.bfloat16
    assert cpu.gemm_dtype(torch.bfloat16) == cpu.gemm_dtype(torch.bfloat16, bf, bf) == torch.bfloat16
    assert cpu.gemm_dtype(torch.float32) == torch.float32  # a bf16 GEMM output would round fp32 results
    assert _up("cpu", torch.bfloat16) == torch.bfloat16
    monkeypatch.setattr(cpu, "native_bf16", lambda: False)  # AVX2 only
    assert cpu.fast_matmul_dtype() == torch.float32
    assert cpu.gemm_dtype(torch.bfloat16, bf, bf) == torch.float32
    assert _up("cpu", torch.bfloat16) == torch.float32
    assert cpu.cpu_capability()["fast_matmul_dtype"] == "float32"
    monkeypatch.setenv("FP8PASS_CPU_GEMM_DTYPE", "bf16")    # forced, whatever the CPU
    assert cpu.gemm_dtype(torch.bfloat16) == torch.bfloat16
    assert cpu.gemm_dtype(torch.float16) == torch.float32
    monkeypatch.setattr(cpu, "native_bf16", lambda: True)
    monkeypatch.setenv("FP8PASS_CPU_GEMM_DTYPE", "FP32")
    assert cpu.gemm_dtype(torch.bfloat16) == torch.float32
    monkeypatch.setenv("FP8PASS_CPU_GEMM_DTYPE", "fp16")
    with pytest.raises(ValueError, match="FP8PASS_CPU_GEMM_DTYPE='fp16'; valid: auto, bf16, fp32"):
        cpu.gemm_dtype(torch.bfloat16)


@pytest.mark.parametrize("recipe", [None, fp8pass.DelayedScaling()], ids=["current", "delayed"])
def test_fp8_linear_is_the_same_with_fp32_and_bf16_gemms(monkeypatch, recipe):
    """FP8 codes are exact in bf16 and fp32 and both GEMMs accumulate in fp32: forward and backward
    agree to the rounding of the bf16 outputs (the fp32 sums may differ in their last bits only)."""
    monkeypatch.setenv("FP8PASS_KERNELS", "torch")
    seen = []
    real_gemm = cpu.gemm_tensor_scaled

    def spy(a, a_scale, b, b_scale, out_dtype, bias=None, **decode_scales):
        seen.append(cpu.gemm_dtype(out_dtype, a, b))
        return real_gemm(a, a_scale, b, b_scale, out_dtype, bias, **decode_scales)

    monkeypatch.setattr(cpu, "gemm_tensor_scaled", spy)
    x, w, dy = _data(7, t=128, k=256, n=96, dtype=torch.bfloat16)
    results = {}
    for choice in ("fp32", "bf16"):
        monkeypatch.setenv("FP8PASS_CPU_GEMM_DTYPE", choice)
        seen.clear()
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = ops.fp8_linear(xr, wr, recipe=recipe, state=LinearScalingState(recipe) if recipe else None)
        y.backward(dy)
        assert set(seen) == {torch.float32 if choice == "fp32" else torch.bfloat16}  # fwd, dgrad, wgrad
        assert len(seen) == 3
        results[choice] = (y.detach(), xr.grad, wr.grad)
    for a, b in zip(results["fp32"], results["bf16"]):
        assert a.dtype == b.dtype == torch.bfloat16
        a, b = a.float(), b.float()
        ulp = torch.finfo(torch.bfloat16).eps * torch.maximum(a.abs(), b.abs())  # one bf16 step (or less)
        assert ((a - b).abs() <= ulp).all()
        assert (a == b).float().mean() > 0.9  # mostly bit-identical: only rounding ties of the sums differ


@pytest.mark.parametrize("fmt", ["e4m3", "identity"])
def test_rewrite_under_autocast_keeps_every_dtype(fmt):
    """Under ``autocast(bf16)`` the rewritten graph computes in the original's dtypes: every node the
    rewrite kept produces the dtype it had in Dynamo's graph, the outputs too, and the FP8 ops emit
    bf16 (the replaced ``F.linear``'s dtype), not the fp32 of their inputs; gradients keep the
    parameters' dtype."""

    from fp8pass.testing.models import dynamo_graph_under_autocast, tiny_titan_llama

    model = tiny_titan_llama()
    tokens = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    gm, inputs = dynamo_graph_under_autocast(model, tokens)
    cfg = fp8pass.Config(recipe=fp8pass.CurrentScaling(), fwd_format=fmt, bwd_format=fmt, compiler="eager")
    new_gm, record = fp8pass.backend(cfg).transform(gm, list(inputs))
    # current scaling keeps no scaling state; each FP8 weight's stochastic-rounding stream (runtime/sr.py)
    # is the graph's only extra input (none under the identity format)
    assert [s.kind for s in record.extra_inputs] == ([] if fmt == "identity" else ["sr"] * 14)
    streams = [torch.zeros(2, dtype=torch.int64) for _ in record.extra_inputs]
    # 12 linears of 6 distinct inputs (per layer: q/k/v's, o's, w1/w3's)
    assert new_gm.code.count("fp8pass.fp8_linear_precast.default(") == 12 and new_gm.code.count("swiglu_down.default(") == 2
    assert new_gm.code.count("fp8pass.fp8_cast_input.default(") == 6
    before = {n.name: n.meta["example_value"].dtype for n in gm.graph.nodes
              if isinstance(n.meta.get("example_value"), torch.Tensor)}
    got: dict[str, torch.dtype] = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if isinstance(out, torch.Tensor):
                got[n.name] = out.dtype
            if n.op == "call_function" and "fp8pass" in str(n.target) and "record" not in str(n.target):
                # an input cast's first output is the codes (bytes; the identity format: the values)
                want = (torch.bfloat16 if fmt == "identity" else torch.uint8) if "cast_input" in str(n.target) \
                    else torch.bfloat16
                assert out[0].dtype == want, n.name
            return out

    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = Recorder(new_gm).run(*inputs, *streams)
    kept = [name for name in got if name in before]
    assert len(kept) > 20
    assert {name: got[name] for name in kept} == {name: before[name] for name in kept}
    ref = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
    assert [o.dtype for o in out] == [r.meta["example_value"].dtype for r in ref] == [torch.bfloat16]
    out[0].float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("gemm", ["fp32", "bf16"])
def test_autocast_output_dtype_and_gemm_dtype_are_the_ops_choice(monkeypatch, gemm):
    """Under autocast(bf16): outputs in bf16 (as F.linear's), gradients in the inputs' fp32, and every
    GEMM inside the ops (forward and backward, linear and GLU tail) in the dtype the op chose
    (``FP8PASS_CPU_GEMM_DTYPE``: fp32 as on AVX2-only CPUs, or bf16), never recast by autocast."""
    from torch.profiler import profile

    monkeypatch.setenv(cpu.GEMM_DTYPE_ENV, gemm)
    x, w, _ = _data(3, t=32, k=64, n=64)
    x.requires_grad_()
    w.requires_grad_()
    with profile(record_shapes=True) as prof:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = ops.fp8_linear(x, w)
            z = ops.swiglu_mlp(x, w, w, w)
        (y.float().sum() + z.float().sum()).backward()
    assert y.dtype == z.dtype == torch.bfloat16 and x.grad.dtype == w.grad.dtype == torch.float32
    want = {"fp32": "float", "bf16": "c10::BFloat16"}[gemm]
    gemms = [e.dtypes()[1 if e.name() == "aten::addmm" else 0] for e in prof.profiler.kineto_results.events()
             if e.name() in ("aten::mm", "aten::addmm")]
    assert len(gemms) == 12 and set(gemms) == {want}  # 4 FP8 GEMMs x 3 per op call


def test_dense_backward_keeps_no_zero_gradients_of_the_saved_codes():
    """fp8_linear, fp8_linear_precast and swiglu_down: autograd hands their backward None for the
    saved codes, scales and amaxes (never differentiated) instead of zero-filled tensors as large as
    x and W; a backward through the amaxes only (y unused) gives zero input gradients."""
    from fp8pass.op_schema import GLUKnobs, LinearKnobs
    from fp8pass.testing.models import FillRecorder

    lk = LinearKnobs("e4m3", "e5m2", "tensor", 128, False, "nearest", 0.0, 1, "max", None, True).args()
    gk = GLUKnobs("e4m3", "e5m2", "tensor", 128, False, "nearest", 0.0, 1, "max", None, True, "fp8", "silu", "channel").args()
    x, w, dy = _data(31, t=64, k=96, n=48)

    def linear(xi, wi):
        return torch.ops.fp8pass.fp8_linear(xi, wi, None, [], [], [], None, *lk)

    def precast(xi, wi):
        xd, xs, _, xu = torch.ops.fp8pass.fp8_cast_input(xi.detach(), [], *lk)
        return torch.ops.fp8pass.fp8_linear_precast(xi, xd, xs, xu, wi, None, [], [], None, *lk)

    def glu(xi, wi):  # gate = up = x [64, 96], W_down [48, 96]
        return torch.ops.fp8pass.swiglu_down(xi, xi * 0.5, wi, [], [], [], None, *gk)

    big = {tuple(x.shape), tuple(w.shape)}
    for op in (linear, precast, glu):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = op(xi, wi)
        with FillRecorder() as mode:
            out[0].backward(dy)
        assert not big & set(mode.shapes), (op.__name__, mode.shapes)
        assert torch.isfinite(xi.grad).all() and torch.isfinite(wi.grad).all() and xi.grad.abs().sum() > 0
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = op(xi, wi)
        (out[1].sum() + out[2].sum()).backward()  # amaxes/scales only: the op's backward sees dy None
        for t in (xi, wi):
            assert t.grad is None or torch.equal(t.grad, torch.zeros_like(t)), op.__name__


@pytest.mark.parametrize("recipe", [None, "delayed"])
@pytest.mark.parametrize("rows", [6, 2048])  # eager casts / compiled CPU loops
def test_fp8_linears_cast_a_shared_input_once_bit_for_bit(recipe, rows):
    """ops.fp8_linears (q/k/v-style: three weights, one with a bias) equals one ops.fp8_linear per
    weight bit for bit over 3 steps (outputs, every gradient, delayed states), and saves x's codes for
    backward once instead of three times."""
    from fp8pass.config import DelayedScaling

    g = torch.Generator().manual_seed(21)
    ws = [torch.randn(n, 64, generator=g) / 8 for n in (64, 32, 32)]
    b = torch.randn(32, generator=g)
    xs = [torch.randn(rows, 64, generator=g).bfloat16() * (k + 1) for k in range(3)]

    def run(shared):
        w = [t.clone().requires_grad_() for t in ws]
        bias = b.clone().requires_grad_()
        rec = DelayedScaling() if recipe == "delayed" else None
        states = [LinearScalingState(rec, "cpu") for _ in w] if rec else [None] * 3
        got, n_codes = [], []
        for x0 in xs:
            x = x0.clone().requires_grad_()
            saved = []
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                if shared:
                    ys = ops.fp8_linears(x, w, [None, bias, None], rec, states=states)
                else:
                    ys = [ops.fp8_linear(x, wi, bi, rec, state=st) for wi, bi, st in zip(w, [None, bias, None], states)]
            n_codes.append(len({t.data_ptr() for t in saved if t.shape == x.shape and t.dtype == torch.uint8}))
            sum((y.float() * (i + 1)).sum() for i, y in enumerate(ys)).backward()
            got += [y.detach() for y in ys] + [x.grad]
        got += [t.grad for t in w] + [bias.grad]
        if rec:
            got += [t for st in states for t in st.state_dict().values()]
        return got, n_codes

    (a, codes_a), (c, codes_c) = run(True), run(False)
    assert codes_a == [1, 1, 1] and codes_c == [3, 3, 3]
    assert len(a) == len(c)
    for u, v in zip(a, c):
        assert torch.equal(u, v)


def test_fp8_linears_rejects_mismatched_lists():
    x, w = torch.randn(4, 16), torch.randn(8, 16)
    with pytest.raises(ValueError, match="at least one weight"):
        ops.fp8_linears(x, [])
    with pytest.raises(ValueError, match="one \\(or None\\) per weight"):
        ops.fp8_linears(x, [w, w], [None])
