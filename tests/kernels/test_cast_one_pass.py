"""One read per cast on the Triton path (issue 15): delayed-scaled casts take their amax from the cast
itself, stochastic casts write the transposed copy in the same kernel. Triton kernels run here under
the interpreter (the conftest sets TRITON_INTERPRET=1) against their torch references."""

import dataclasses

import pytest
import torch

import fp8pass
from fp8pass import E4M3, E5M2, DelayedScaling, DelayedScalingState, kernels
from fp8pass.kernels import cuda, torch_family, triton_family, triton_operand_casts
from fp8pass.numerics import saturating_cast
from fp8pass.numerics.scaling import scale_from_amax, scale_to_cast
from fp8pass.runtime import casting


def _x(r=37, c=70, seed=0):
    torch.manual_seed(seed)
    x = torch.randn(r, c) * 3
    x[1, 2] = 1e-6
    return x


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_stochastic_transpose_cast_matches_the_flat_stochastic_cast_bit_for_bit(fmt):
    x, s = _x(), torch.tensor(16.0)
    torch.manual_seed(5)
    codes, codes_t, amax = triton_operand_casts.transpose_cast(x, s, fmt, transpose=True, rounding="stochastic")
    torch.manual_seed(5)  # the same seed: the same random bits per flat index
    ref, ref_amax = triton_family.cast_scaled(x, s, fmt, "stochastic", None, want_amax=True)
    assert torch.equal(codes.view(torch.uint8), ref.view(torch.uint8))
    assert torch.equal(codes_t.view(torch.uint8), ref.view(torch.uint8).t())
    assert float(amax) == float(ref_amax) == float(x.abs().max())
    near, _, _ = triton_operand_casts.transpose_cast(x, s, fmt, transpose=False)
    assert torch.equal(near.view(torch.uint8), saturating_cast(x * s, fmt).view(torch.uint8))
    assert not torch.equal(near.view(torch.uint8), codes.view(torch.uint8))  # stochastic really rounds


def test_conditional_cast_writes_only_when_the_flag_is_set():
    x, s = _x(), torch.tensor(4.0)
    out = torch.full((37, 70), 0x11, dtype=torch.uint8).view(E4M3.torch_dtype)
    out_t = torch.full((70, 37), 0x11, dtype=torch.uint8).view(E4M3.torch_dtype)
    triton_operand_casts.transpose_cast(x, s, E4M3, True, only_if=torch.tensor(False), out=(out, out_t))
    assert (out.view(torch.uint8) == 0x11).all() and (out_t.view(torch.uint8) == 0x11).all()
    triton_operand_casts.transpose_cast(x, s, E4M3, True, only_if=torch.tensor(True), out=(out, out_t))
    ref = saturating_cast(x * s, E4M3).view(torch.uint8)
    assert torch.equal(out.view(torch.uint8), ref) and torch.equal(out_t.view(torch.uint8), ref.t())


def _state(kind: str, fmt) -> DelayedScalingState:
    st = DelayedScalingState(DelayedScaling(on_overflow="current" if "guard" in kind else "saturate"), fmt)
    if kind != "empty":
        st.record(torch.tensor({"held": 4.0, "guard-within": 100.0, "guard-outgrown": 0.01}[kind]))
    return st


@pytest.mark.parametrize("kind", ["empty", "held", "guard-within", "guard-outgrown"])
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_delayed_cast_reads_once_and_equals_the_two_read_reference(monkeypatch, kind, fmt):
    x = _x()
    st = _state(kind, fmt)
    ops = st.op_tensors()
    want_scale = scale_to_cast(ops, torch_family.tensor_amax(x), fmt).reshape(())
    want = saturating_cast(x * want_scale, fmt).view(torch.uint8)

    def no_amax_pass(real):
        def amax(t):  # the partial maxima of the cast's tiles are reduced here; x itself never is
            assert t.numel() < x.numel(), "a separate amax pass over x ran"
            return real(t)
        return amax

    monkeypatch.setattr(torch_family, "tensor_amax", no_amax_pass(torch_family.tensor_amax))
    monkeypatch.setattr(triton_family, "tensor_amax", no_amax_pass(triton_family.tensor_amax))
    launches = []
    real = triton_operand_casts.transpose_cast
    monkeypatch.setattr(triton_operand_casts, "transpose_cast", lambda *a, **k: launches.append(k.get("only_if")) or real(
        *a, **k))
    data, data_t, sc = cuda.cast_delayed(x, ops, fmt, 0.0, False, "nearest", transpose=True)
    scale, amax = sc.scale, sc.amax
    assert torch.equal(data.view(torch.uint8), want) and torch.equal(data_t.view(torch.uint8), want.t())
    assert float(scale) == float(want_scale) and float(amax) == float(x.abs().max())
    assert float(sc.inv_scale) == float(torch.reciprocal(want_scale))
    assert launches[0] is None and len(launches) == 2  # one full read; the recast is conditional
    recast = bool(launches[1])
    assert recast == (kind in ("empty", "guard-outgrown"))  # the first step and a fired guard only
    if kind == "empty":
        assert float(scale) == float(scale_from_amax(x.abs().max(), fmt))


def test_cast_operand_on_the_triton_kernels_equals_the_torch_kernels(monkeypatch):
    x = _x(64, 48)
    results = {}
    for family in ("torch", "triton"):
        monkeypatch.setenv("FP8PASS_KERNELS", family)
        st = _state("held", E4M3)
        op = casting.cast_operand(x, E4M3, state=st.op_tensors(), transpose=True)
        results[family] = op
    a, b = results["torch"], results["triton"]
    assert kernels.for_device("cpu").__name__.endswith(".cuda")
    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
    assert torch.equal(a.scale, b.scale) and float(a.amax) == float(b.amax)
    assert b.data_t is not None and torch.equal(b.data_t.view(torch.uint8), b.data.view(torch.uint8).t())


def test_compiled_delayed_step_with_one_read_casts_equals_the_two_read_casts(monkeypatch):
    """Forward and backward of a compiled fp8 model (delayed scaling with the overflow guard, nearest
    rounding) on the Triton kernels: the one-read casts give the outputs and gradients of the two-read
    path (amax pass and scale by torch ops, then the cast) bit for bit over three steps, the guard firing in one."""
    monkeypatch.setenv("FP8PASS_KERNELS", "triton")
    outs = {}
    for one_read in (True, False):
        if not one_read:
            monkeypatch.setattr(cuda, "OFFERS", dataclasses.replace(cuda.OFFERS, scale_on_device=False))
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.SiLU(), torch.nn.Linear(64, 16))
        cfg = fp8pass.Config(recipe=DelayedScaling(on_overflow="current"), grad_stochastic_rounding=False,
                             compiler="aot_eager")
        cm = torch.compile(model, backend=fp8pass.backend(cfg))
        res = []
        for k in range(3):
            x = (torch.randn(8, 32) * (1 + 30 * k)).requires_grad_()  # step 2 outgrows: the guard fires
            y = cm(x)
            y.backward(torch.ones_like(y))
            res.append((y.detach(), x.grad, model[0].weight.grad.clone()))
        outs[one_read] = res
    for (ya, ga, wa), (yb, gb, wb) in zip(outs[True], outs[False]):
        assert torch.equal(ya, yb) and torch.equal(ga, gb) and torch.equal(wa, wb)


@pytest.mark.parametrize("delayed", [False, True])
def test_stochastic_gradient_cast_writes_both_layouts_in_one_kernel(monkeypatch, delayed):
    """A stochastically rounded operand cast for the GPU GEMMs (transpose=True) gets its transposed
    copy from the same kernel: the [C, R] codes are the [R, C] codes transposed, and both are the flat
    stochastic cast's codes for the same seed."""
    monkeypatch.setenv("FP8PASS_KERNELS", "triton")
    x = _x()
    st = _state("held", E5M2).op_tensors() if delayed else None
    torch.manual_seed(7)
    op = casting.cast_operand(x, E5M2, state=st, rounding="stochastic", transpose=True)
    torch.manual_seed(7)
    ref, _ = triton_family.cast_scaled(x, op.scale, E5M2, "stochastic", None, want_amax=True)
    assert op.data_t is not None
    assert torch.equal(op.data.view(torch.uint8), ref.view(torch.uint8))
    assert torch.equal(op.data_t.view(torch.uint8), ref.view(torch.uint8).t())
    assert float(op.amax) == float(x.abs().max())
