"""Grouped (MoE) ops on CUDA (skipped without a GPU): ``_scaled_grouped_mm`` (or its emulation) vs CPU."""

import pytest
import torch

import fp8pass  # noqa: F401  (registers the ops)

pytestmark = pytest.mark.gpu
FP8 = ("e4m3", "e5m2", False, "nearest", 0.0, 1, "max", None, True)  # ..., out_dtype (None: the input's), fast_accum
# CUDA casts the E5M2 gradient to E4M3 (_scaled_grouped_mm takes E4M3 only): the CPU reference does too
FP8_E4M3_GRADS = ("e4m3", "e4m3") + FP8[2:]
LIN = torch.ops.fp8pass.fp8_grouped_linear
GLU = torch.ops.fp8pass.fp8_grouped_swiglu_down


def _run(op, tensors, dy, device):
    ts = [t.to(device).requires_grad_(t.is_floating_point()) for t in tensors]
    out = op(*ts)
    out[0].backward(dy.to(device))
    return [o.cpu() for o in out], [t.grad.cpu() for t in ts if t.is_floating_point()]


# (16-aligned groups: _scaled_grouped_mm on sm90+), (ragged groups and an empty one, padding rows)
@pytest.mark.parametrize("offs", [[32, 64, 128, 160], [7, 7, 90, 150]])
@pytest.mark.parametrize("transposed", [False, True])
def test_grouped_linear_cuda_matches_cpu(offs, transposed):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(160, 64, generator=g).bfloat16()
    w = (torch.randn(4, *((64, 96) if transposed else (96, 64)), generator=g) / 8).bfloat16()
    dy = torch.randn(160, 96, generator=g).bfloat16()
    o = torch.tensor(offs, dtype=torch.int32)
    def f(a, b):
        return LIN(a, b, o.to(a.device), transposed, [], [], [], None, *(FP8 if a.is_cuda else FP8_E4M3_GRADS))

    (c, cg), (d, dg) = (_run(f, (x, w), dy, dev) for dev in ("cpu", "cuda"))
    assert torch.equal(c[3], d[3]) and torch.equal(c[5], d[5])  # identical codes
    assert torch.equal(c[4], d[4]) and torch.equal(c[6], d[6])  # identical per-expert scales
    torch.testing.assert_close(d[0].float(), c[0].float(), rtol=2**-7, atol=1e-2)
    assert torch.equal(d[0][offs[-1]:], torch.zeros_like(d[0][offs[-1]:]))
    for a, b in zip(cg, dg):
        torch.testing.assert_close(b.float(), a.float(), rtol=2**-6, atol=2e-2)


@pytest.mark.parametrize("smooth", ["channel", "token", "none"])
def test_grouped_swiglu_cuda_matches_cpu_and_compiles(smooth):
    g = torch.Generator().manual_seed(1)
    gate, up = (torch.randn(160, 96, generator=g).bfloat16() for _ in range(2))
    wd = (torch.randn(4, 64, 96, generator=g) / 8).bfloat16()
    dy = torch.randn(160, 64, generator=g).bfloat16()
    o = torch.tensor([32, 64, 128, 160], dtype=torch.int32)

    def f(a, b, w):
        return GLU(a, b, w, o.to(a.device), False, [], [], [], None, *(FP8 if a.is_cuda else FP8_E4M3_GRADS), "silu",
                   smooth)

    (c, cg), (d, dg) = (_run(f, (gate, up, wd), dy, dev) for dev in ("cpu", "cuda"))
    assert torch.equal(c[7], d[7])  # smoothing scales
    torch.testing.assert_close(d[0].float(), c[0].float(), rtol=2**-6, atol=2e-2)
    for a, b in zip(cg, dg):
        torch.testing.assert_close(b.float(), a.float(), rtol=2**-5, atol=5e-2)
    comp = torch.compile(f, backend="inductor")(gate.cuda(), up.cuda(), wd.cuda())[0]
    assert torch.equal(comp.cpu(), d[0])


def test_grouped_swiglu_fused_gate_up_on_cuda_gives_the_split_bits():
    """``up=None`` (gate the fused [S, 2F]) on CUDA: the outputs and d(gate_up) equal the chunk(2)
    pieces' outputs and the cat of their gradients, bit for bit (the CPU test's property, on the GPU path)."""
    g = torch.Generator().manual_seed(2)
    gate_up = torch.randn(160, 192, generator=g).bfloat16().cuda()
    wd = (torch.randn(4, 64, 96, generator=g) / 8).bfloat16().cuda()
    dy = torch.randn(160, 64, generator=g).bfloat16().cuda()
    o = torch.tensor([32, 64, 128, 160], dtype=torch.int32, device="cuda")
    results = []
    for joined in (True, False):
        gu, w = gate_up.clone().requires_grad_(), wd.clone().requires_grad_()
        args = (gu, None) if joined else gu.chunk(2, dim=-1)
        out = GLU(*args, w, o, False, [], [], [], None, *FP8, "silu", "channel")
        out[0].backward(dy)
        results.append([out[0].detach(), gu.grad, w.grad])
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fmt_name", ["e4m3", "e5m2"])
@pytest.mark.parametrize("offs", [[7, 7, 90, 150], [32, 64, 128, 160], list(range(10, 130, 10))])
def test_grouped_cast_kernels_compiled_match_the_torch_reference(fmt_name, offs):
    """kernels/triton_grouped_casts.py compiled (hardware RNE conversion on sm_89+) against its torch
    reference on the same GPU, bit for bit: codes, amaxes, scales, decode scales, padding rows; and the
    wgrad layout against cuda._aligned_groups / _scattered_transpose."""
    from fp8pass.kernels import cuda
    from fp8pass.kernels import triton_grouped_casts as tgc
    from fp8pass.numerics import get_format

    fmt = get_format(fmt_name)
    g = torch.Generator().manual_seed(len(offs))
    x = (torch.randn(160, 192, generator=g) * 10.0 ** torch.randint(-3, 4, (160, 1), generator=g)).bfloat16().cuda()
    x[3, 5] = float("nan")
    o = torch.tensor(offs, dtype=torch.int32, device="cuda")
    out = tgc.cast_grouped(x, fmt, o, row_inv=True)
    for a, b in zip(out, tgc.reference(x, fmt, o)):
        assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 and a.dtype != torch.bool else a,
                           b.view(torch.uint8) if b.element_size() == 1 and b.dtype != torch.bool else b) or \
            torch.equal(a.float().nan_to_num(7.0), b.float().nan_to_num(7.0))
    ends, where, width, sizes = cuda._aligned_groups(o, x.shape[0])
    lay, ends_k, empty, rep = tgc.aligned_transpose(out[0], out[1], o, width)
    assert torch.equal(lay.view(torch.uint8), cuda._scattered_transpose(out[0], where, width).view(torch.uint8))
    assert torch.equal(ends_k, ends) and torch.equal(empty, sizes == 0)
    assert torch.equal(rep, cuda._repeated_inverse(out[1], x.shape[1]).view(-1))


@pytest.mark.parametrize("fmt_name", ["e4m3", "e5m2"])
@pytest.mark.parametrize("group_rows", [96, 100])  # whole row blocks; a partial last block per expert
def test_stacked_weight_cast_in_both_layouts_compiled(fmt_name, group_rows):
    """The stacked-weight cast's TRANSPOSE store compiled (``tl.trans`` through shared memory on the GPU):
    the six results as the torch reference's, and each expert's codes transposed, bit for bit."""
    from fp8pass.kernels import triton_grouped_casts as tgc
    from fp8pass.numerics import get_format

    fmt = get_format(fmt_name)
    g = torch.Generator().manual_seed(group_rows)
    w = (torch.randn(4 * group_rows, 320, generator=g) / 8).bfloat16().cuda()
    out = tgc.cast_grouped(w, fmt, group_rows=group_rows, row_inv=True, transposed=True)
    for a, b in zip(out[:6], tgc.reference(w, fmt, group_rows=group_rows)):
        assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 and a.dtype != torch.bool else a,
                           b.view(torch.uint8) if b.element_size() == 1 and b.dtype != torch.bool else b)
    want = out[0].view(4, group_rows, 320).transpose(1, 2).contiguous()
    assert torch.equal(out[6].view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("w_transposed", [False, True])
def test_grouped_swiglu_divides_by_channel_scales_in_kernels_with_the_torch_ops_bits(monkeypatch, w_transposed):
    """On the GPU: ``W_down / c`` in the weight's cast and ``dW = dB / c`` in the wgrad GEMM's decode scales
    (``_scaled_grouped_mm``'s epilogue) give the torch ops' bits (multiply by ``1 / c`` before the cast and
    after the GEMM), outputs, saved codes and gradients."""
    from fp8pass.runtime import grouped_swiglu

    g = torch.Generator().manual_seed(3)
    gate, up = (torch.randn(160, 96, generator=g).bfloat16().cuda() for _ in range(2))
    gate[3] *= 40.0
    wd = (torch.randn(4, *((96, 64) if w_transposed else (64, 96)), generator=g) / 8).bfloat16().cuda()
    dy = torch.randn(160, 64, generator=g).bfloat16().cuda()
    o = torch.tensor([32, 64, 128, 160], dtype=torch.int32, device="cuda")
    results = []
    for in_kernels in (True, False):
        if not in_kernels:
            monkeypatch.setattr(grouped_swiglu, "_divides_in_kernels", lambda *a: False)
        ts = [t.clone().requires_grad_() for t in (gate, up, wd)]
        out = GLU(*ts, o, w_transposed, [], [], [], None, *FP8, "silu", "channel")
        out[0].backward(dy)
        results.append([t.detach() for t in out] + [t.grad for t in ts])
    for a, b in zip(*results):
        assert torch.equal(a, b)
