"""Triton kernels of the runtime ops under the interpreter, against the torch reference.

TRITON_INTERPRET=1 is set by conftest.py for the CPU suite on every host (CUDA hosts too); the same
kernels compiled for a GPU are checked in tests/gpu."""

import pytest
import torch

pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402

from fp8pass import E4M3, E4M3_GAUDI, E5M2, quantize  # noqa: E402
from fp8pass.kernels import triton_operand_casts as tk  # noqa: E402
from fp8pass.numerics import saturating_cast  # noqa: E402
from fp8pass.runtime.swiglu import channel_scales, swiglu_operand, token_scales  # noqa: E402


def _hard_values(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-24, 14, (n,), generator=g).float())
    # ties, the mantissa carry the interpreter gets wrong (docs/background.md, Traps), saturation, specials
    special = [1.0625, 1.1875, 2.125, 1.9977, 31.7, 500.0, -1e9, float("inf"), -float("inf"), -0.0, 0.0,
               2.0**-10, 3 * 2.0**-11, 2.0**-7 * 1.5, 57344.0 * 1.2]
    x[: len(special)] = torch.tensor(special)
    return x


@pytest.mark.parametrize("fmt", [E4M3, E5M2, E4M3_GAUDI])
@pytest.mark.parametrize("shape", [(37, 50), (64, 32), (3, 7)])
def test_transpose_cast_bit_exact(fmt, shape):
    x = _hard_values(shape[0] * shape[1], 0).reshape(shape)
    x[0, 1] = float("nan")
    scale = torch.tensor(0.75)
    codes, codes_t, amax = tk.transpose_cast(x, scale, fmt)
    ref = saturating_cast(x * scale, fmt)
    ok = ~ref.float().isnan()
    assert torch.equal(codes.view(torch.uint8)[ok], ref.view(torch.uint8)[ok])
    assert codes.float()[~ok].isnan().all()
    assert torch.equal(codes_t.view(torch.uint8), codes.view(torch.uint8).t())
    assert amax.isnan()
    x[0, 1] = 1.0
    _, _, amax = tk.transpose_cast(x, scale, fmt)
    assert amax == x.abs().max()


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_transposed_only_cast_writes_the_same_transposed_codes_and_no_row_major_codes(rounding):
    x = _hard_values(37 * 50, 3).reshape(37, 50)
    scale = torch.tensor(0.75)
    torch.manual_seed(5)  # the stochastic seed is drawn from the default generator: the same bits twice
    _, both_t, _ = tk.transpose_cast(x, scale, E4M3, rounding=rounding)
    torch.manual_seed(5)
    codes, only_t, amax = tk.transpose_cast(x, scale, E4M3, rounding=rounding, row_major=False)
    assert codes is None and torch.equal(only_t.view(torch.uint8), both_t.view(torch.uint8))
    assert amax == x.abs().max()
    assert tk.transpose_cast(x[:0], scale, E4M3, row_major=False)[0] is None  # empty: the same contract
    with pytest.raises(ValueError, match="transposed codes alone"):
        tk.transpose_cast(x, scale, E4M3, transpose=False, row_major=False)


@pytest.mark.parametrize("mode", ["none", "channel", "token"])
def test_swiglu_cast_matches_torch_reference(mode):
    g = torch.Generator().manual_seed(1)
    gate = torch.randn(45, 70, generator=g) * 3
    up = torch.randn(45, 70, generator=g) * 2
    up[:, 5] *= 100  # an outlier channel
    a_ref, s = swiglu_operand(gate, up, mode)
    if mode == "channel":
        colamax = tk.swiglu_colamax(gate, up)
        torch.testing.assert_close(colamax, (F.silu(gate) * up).abs().amax(0), rtol=1e-6, atol=0)
        assert torch.equal(channel_scales(colamax), s)  # powers of two: equal unless at a binade edge
    if mode == "token":
        assert torch.equal(token_scales(up), s)
    codes, amax, scale = tk.swiglu_cast(gate, up, mode, E4M3, None, None if mode == "none" else s)
    ref = quantize(a_ref, E4M3)
    torch.testing.assert_close(amax, a_ref.abs().max(), rtol=1e-6, atol=0)
    torch.testing.assert_close(scale, ref.scale, rtol=1e-6, atol=0)
    # silu's exp differs in the last fp32 bit between torch and Triton, so a value sitting on a
    # rounding boundary may land one code away; the codes agree everywhere else.
    diff = (codes.float() - ref.data.float()).abs()
    step = torch.maximum(codes.float().abs(), ref.data.float().abs()) * 2.0**-3 + 2.0**-9
    assert (diff <= step).all()
    assert (diff > 0).float().mean() < 0.002
    # with the tensor's own scale given, the same codes come out in one pass
    codes2, _, _ = tk.swiglu_cast(gate, up, mode, E4M3, scale, None if mode == "none" else s)
    assert torch.equal(codes2.view(torch.uint8), codes.view(torch.uint8))


def test_swiglu_cast_bit_exact_where_the_math_is_the_same():
    """Zero gates have silu exactly 0 and gate = large makes silu(g) == g exactly in fp32: then
    A = g * u * c is the same product in both, and the codes must be bit-identical."""
    g = torch.Generator().manual_seed(2)
    gate = torch.full((16, 40), 120.0)
    up = torch.randn(16, 40, generator=g) * 3
    a_ref, c = swiglu_operand(gate, up, "channel")
    codes, _, _ = tk.swiglu_cast(gate, up, "channel", E4M3, torch.tensor(2.5), c)
    ref = saturating_cast(a_ref * 2.5, E4M3)
    assert torch.equal(codes.view(torch.uint8), ref.view(torch.uint8))


@pytest.mark.parametrize("mode", ["none", "channel", "token"])
def test_swiglu_amax_pass(mode):
    g = torch.Generator().manual_seed(3)
    gate, up = torch.randn(33, 65, generator=g), torch.randn(33, 65, generator=g)
    a_ref, s = swiglu_operand(gate, up, mode)
    amax = tk.swiglu_amax(gate, up, mode, None if mode == "none" else s)
    torch.testing.assert_close(amax, a_ref.abs().max(), rtol=1e-6, atol=0)


def test_gpu_code_path_on_cpu_matches_torch_path(monkeypatch):
    """FP8PASS_KERNELS=triton runs the CUDA module (Triton casts, fused SwiGLU cast, transpose-cast
    of grad_output, fallback GEMMs) on CPU tensors: same codes, same results as the torch path."""
    from fp8pass import ops

    g = torch.Generator().manual_seed(4)
    x = torch.randn(24, 32, generator=g)
    wg, wu = torch.randn(48, 32, generator=g) / 5, torch.randn(48, 32, generator=g) / 5
    wd = torch.randn(32, 48, generator=g) / 7
    dy = torch.randn(24, 32, generator=g)

    def run(smooth, activation="silu"):
        leaves = [t.clone().requires_grad_() for t in (x, wg, wu, wd)]
        y = ops.swiglu_mlp(*leaves, smooth=smooth, activation=activation)
        y.backward(dy)
        lin = torch.ops.fp8pass.fp8_linear(x, wg, None, [], [], [], None, "e4m3", "e5m2", "tensor", 128, False,
                                           "nearest", 0.0, 1, "max", None, True, "fp8")
        return [y.detach()] + [t.grad for t in leaves], lin

    for smooth in ("channel", "token", None):
        monkeypatch.setenv("FP8PASS_KERNELS", "torch")
        ref, ref_lin = run(smooth)
        monkeypatch.setenv("FP8PASS_KERNELS", "triton")
        got, got_lin = run(smooth)
        assert torch.equal(got_lin[3], ref_lin[3]) and torch.equal(got_lin[5], ref_lin[5])
        torch.testing.assert_close(got_lin[0], ref_lin[0], rtol=1e-5, atol=1e-5)
        for a, b in zip(got, ref):
            # silu's last-bit differences can move a few codes of A by one step (see above)
            assert float((a - b).norm() / b.norm()) < 0.02
    # other GLU activations take the torch operand/derivative math on the GPU path too (no fused
    # kernel): the same A as the torch path, so only GEMM accumulation order can differ
    for smooth, act in (("channel", "gelu_tanh"), ("token", "relu")):
        monkeypatch.setenv("FP8PASS_KERNELS", "torch")
        ref, _ = run(smooth, act)
        monkeypatch.setenv("FP8PASS_KERNELS", "triton")
        got, _ = run(smooth, act)
        for a, b in zip(got, ref):
            assert float((a - b).norm() / b.norm()) < 1e-5


@pytest.mark.parametrize("shape", [(37, 50), (1, 129), (130, 3)])
def test_transpose_cast_stays_in_bounds(shape, strict_interpreter):
    """Partial tiles at both edges: every load and store (both layouts) inside the tensors."""
    x = _hard_values(shape[0] * shape[1], 1).reshape(shape)
    codes, codes_t, amax = tk.transpose_cast(x, torch.tensor(2.0), E4M3)
    assert torch.equal(codes.view(torch.uint8), saturating_cast(x * 2.0, E4M3).view(torch.uint8))
    assert torch.equal(codes_t.view(torch.uint8), codes.view(torch.uint8).t())
    assert amax == x.abs().max()


def test_swiglu_colamax_propagates_nan():
    gate, up = torch.randn(70, 20), torch.randn(70, 20)
    gate[65, 3] = float("nan")  # in the third row tile
    col = tk.swiglu_colamax(gate, up)
    assert col[3].isnan() and not col[torch.arange(20) != 3].isnan().any()


from fp8pass.kernels import cuda as cuda_kernels  # noqa: E402

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def test_scaled_mm_plan():
    """torch._scaled_mm needs K and N multiples of 16 (M is free): the plan pads K and N with zero codes;
    two E5M2 operands, other dtypes, empty dims and CPU tensors take the fallback."""
    plan = cuda_kernels.scaled_mm_plan
    e4, e5 = FP8
    assert plan(4095, 4096, 4096, e4, e4, torch.bfloat16, "cuda") == (0, 0)
    assert plan(7, 32, 48, e4, e5, torch.float32, "cuda") == (0, 0)
    assert plan(4096, 4095, 4096, e5, e4, torch.bfloat16, "cuda") == (1, 0)
    assert plan(100, 72, 40, e4, e4, torch.float16, "cuda") == (8, 8)
    assert plan(64, 64, 64, e5, e5, torch.bfloat16, "cuda") is None
    assert plan(64, 64, 64, e4, e4, torch.bfloat16, "cpu") is None
    assert plan(64, 64, 64, torch.bfloat16, e4, torch.bfloat16, "cuda") is None
    assert plan(0, 64, 64, e4, e4, torch.bfloat16, "cuda") is None
    assert plan(64, 64, 64, e4, e4, torch.int32, "cuda") is None


def _fake_scaled_mm(a, b, scale_a, scale_b, bias=None, out_dtype=None, use_fast_accum=False):
    """torch._scaled_mm's checks (K, N multiples of 16; a row-major, b column-major; bias dtype) and
    its math, on CPU, so the padding around it is tested without a GPU."""
    assert a.shape[1] % 16 == 0 and b.shape[0] % 16 == 0 and b.shape[1] % 16 == 0, (a.shape, b.shape)
    assert a.is_contiguous() and b.t().is_contiguous()
    assert not (a.dtype == b.dtype == torch.float8_e5m2)
    assert bias is None or (bias.dtype == torch.bfloat16 and out_dtype == torch.bfloat16)
    out = (a.float() @ b.float()) * (scale_a * scale_b)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


@pytest.mark.parametrize("mkn", [(33, 72, 40), (16, 32, 48), (5, 17, 3)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemm_pads_for_scaled_mm(mkn, bias, monkeypatch):
    m, k, n = mkn
    g = torch.Generator().manual_seed(7)
    a = (torch.randn(m, k, generator=g) * 8).to(torch.float8_e4m3fn)
    b = (torch.randn(n, k, generator=g) * 8).to(torch.float8_e5m2)
    sa, sb = torch.tensor(4.0), torch.tensor(0.5)
    bv = torch.randn(n, generator=g) if bias else None
    ref = cuda_kernels.gemm_tensor_scaled(a, sa, b, sb, torch.bfloat16, bv)  # CPU: the fallback
    real_plan = cuda_kernels.scaled_mm_plan
    monkeypatch.setattr(cuda_kernels, "scaled_mm_plan", lambda *args: real_plan(*args[:-1], "cuda"))
    monkeypatch.setattr(torch, "_scaled_mm", _fake_scaled_mm)
    got = cuda_kernels.gemm_tensor_scaled(a, sa, b, sb, torch.bfloat16, bv)
    assert got.shape == (m, n) and got.is_contiguous()
    torch.testing.assert_close(got.float(), ref.float(), rtol=2**-7, atol=1e-2)


@pytest.mark.parametrize("dtypes", [(FP8[0], FP8[0]), (FP8[1], FP8[0]), (FP8[0], FP8[1])])  # fwd, dgrad, wgrad
@pytest.mark.parametrize("mkn,bias,out_dtype", [((33, 72, 40), True, torch.bfloat16),
                                                ((16, 32, 48), True, torch.bfloat16),
                                                ((5, 17, 3), False, torch.float32)])
def test_scaled_mm_call_passes_torchs_own_checks(dtypes, mkn, bias, out_dtype, monkeypatch):
    """The padded ``torch._scaled_mm`` call on meta tensors: torch's own meta function (the checks of
    the CUDA op: dtypes, K and N multiples of 16, row-/column-major operands, scalar fp32 scales, bias
    dtype) accepts the arguments gemm_tensor_scaled builds, for the three GEMMs' operand pairs."""
    m, k, n = mkn
    meta = dict(device="meta")
    a = torch.empty(m, k, dtype=dtypes[0], **meta)
    b = torch.empty(n, k, dtype=dtypes[1], **meta)
    scale = torch.empty((), dtype=torch.float32, **meta)
    real_plan = cuda_kernels.scaled_mm_plan
    monkeypatch.setattr(cuda_kernels, "scaled_mm_plan", lambda *args: real_plan(*args[:-1], "cuda"))
    calls = []
    real_mm = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a_, **k_: calls.append(1) or real_mm(*a_, **k_))
    out = cuda_kernels.gemm_tensor_scaled(a, scale, b, scale, out_dtype,
                                          torch.empty(n, dtype=torch.float32, **meta) if bias else None)
    assert calls == [1] and out.shape == (m, n) and out.dtype == out_dtype


def test_shared_input_cast_on_the_gpu_code_path(monkeypatch):
    """FP8PASS_KERNELS=triton (the CUDA module on CPU tensors): fp8_cast_input + fp8_linear_precast
    (codes, no GEMM values: x_alt holds them column-major; the weight recast in backward with the forward's scale) give
    what fp8_linear gives on the same path, bit for bit, with current and delayed scaling."""
    import fp8pass  # noqa: F401  (registers the ops)
    from fp8pass.config import DelayedScaling
    from fp8pass.kernels import cuda
    from fp8pass.numerics import DelayedScalingState, get_format
    from fp8pass.op_schema import LinearKnobs

    monkeypatch.setenv("FP8PASS_KERNELS", "triton")
    calls = []
    for fn in ("gemm_tensor_scaled", "cast_delayed"):
        real = getattr(cuda, fn)
        monkeypatch.setattr(cuda, fn, lambda *a, _real=real, _fn=fn, **kw: calls.append(_fn) or _real(*a, **kw))
    row_major_writes = []  # the weight recast of the precast backward writes W^T alone (issue 28)
    real_tc = cuda.transpose_cast
    monkeypatch.setattr(cuda, "transpose_cast",
                        lambda *a, **kw: row_major_writes.append(kw.get("row_major", True)) or real_tc(*a, **kw))
    g = torch.Generator().manual_seed(12)
    x = torch.randn(2, 24, 64, generator=g)
    w = torch.randn(40, 64, generator=g) / 8
    dy = torch.randn(2, 24, 40, generator=g)
    knobs = LinearKnobs("e4m3", "e5m2", "tensor", 128, False, "nearest", 0.0, 1, "max", None, True).args()

    def states():
        out = []
        for fmt in ("e4m3", "e4m3", "e5m2"):
            st = DelayedScalingState(DelayedScaling(), get_format(fmt))
            st.record(torch.tensor(2.5))
            out.append(st.op_tensors())
        return out

    for delayed in (False, True):
        results = []
        for precast in (True, False):
            xs, ws, gs = states() if delayed else ([], [], [])
            xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
            if precast:
                xd, xsc, _, xa = torch.ops.fp8pass.fp8_cast_input(xi.detach(), xs, *knobs)
                # the GEMM takes the codes on this path; x_alt holds them column-major (what backward keeps)
                assert xa.dtype == torch.uint8 and xa.stride() == (1, xd.shape[0]) and torch.equal(xa, xd)
                y = torch.ops.fp8pass.fp8_linear_precast(xi, xd, xsc, xa, wi, None, ws, gs, None, *knobs)[0]
            else:
                y = torch.ops.fp8pass.fp8_linear(xi, wi, None, xs, ws, gs, None, *knobs)[0]
            y.backward(dy)
            results.append((y.detach(), xi.grad, wi.grad))
        for a, b in zip(*results):
            assert torch.equal(a, b), delayed
        assert "gemm_tensor_scaled" in calls and ("cast_delayed" in calls) == delayed  # the CUDA module ran
        calls.clear()
        assert row_major_writes == [False]  # one recast (precast backward), no row-major codes written
        row_major_writes.clear()
