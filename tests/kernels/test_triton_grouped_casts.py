"""The grouped (MoE) operand casts (kernels/triton_grouped_casts.py) against their torch reference, bit
for bit, in Triton's interpreter: codes, per-expert amaxes, scales and decode scales, and the rows'
decode scales, for grouped rows (empty groups, padding rows, NaN and Inf) and stacked expert weights,
current and delayed scaling."""

import pytest
import torch

from fp8pass.config import DelayedScaling
from fp8pass.kernels import triton_grouped_casts as tgc
from fp8pass.numerics import E4M3, E5M2, DelayedScalingState


def _bits(t):
    if t.dtype == torch.bool:
        return t
    return t.view(torch.uint8) if t.element_size() == 1 else t.float().view(torch.int32)


def _assert_same(out, ref):
    names = ("codes", "scale", "amax", "inv", "row_inv", "padding rows")
    for name, a, b in zip(names, out, ref):
        assert a.shape == b.shape and torch.equal(_bits(a), _bits(b)), (name, a, b)


def _rows(rows, cols, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen) * 10.0 ** torch.randint(-3, 4, (rows, 1), generator=gen)
    return x.to(dtype)


OFFS = [[7, 7, 20, 33], [0, 0, 40, 40], [40], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]  # empty groups, padding rows


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("offs", OFFS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_rows_current_scaling_are_the_torch_references_bits(fmt, offs, dtype):
    x = _rows(40, 48, dtype, seed=len(offs))
    offs = torch.tensor(offs, dtype=torch.int32)
    _assert_same(tgc.cast_grouped(x, fmt, offs, row_inv=True), tgc.reference(x, fmt, offs))


@pytest.mark.parametrize("margin,p2", [(0.0, False), (1.0, True)])
def test_nan_inf_and_zero_groups_scale_as_the_reference(margin, p2):
    x = _rows(40, 300, torch.bfloat16, seed=1)  # 300 columns: more than one column block of the amax kernel
    x[5, 3] = float("nan")
    x[25, 299] = float("inf")
    x[33:] = 0.0  # the last group all zeros: amax 0, scale 1
    offs = torch.tensor([7, 20, 33, 40], dtype=torch.int32)
    out = tgc.cast_grouped(x, E4M3, offs, margin=margin, power_of_two=p2, row_inv=True)
    _assert_same(out, tgc.reference(x, E4M3, offs, margin=margin, power_of_two=p2))
    # a NaN row, an Inf and an all-zero group: amax NaN / Inf / 0, the reference's scales
    assert out[2][0].isnan() and out[2][2].isinf() and out[2][3] == 0 and out[1][3] == 1


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_stacked_expert_weights_are_the_torch_references_bits(fmt):
    w = _rows(4 * 24, 40, torch.bfloat16, seed=2)  # [E * N, K] rows of 4 experts' [24, 40] weights
    _assert_same(tgc.cast_grouped(w, fmt, group_rows=24, row_inv=True), tgc.reference(w, fmt, group_rows=24))


@pytest.mark.parametrize("group_rows", [24, 100])  # within one row block; two, the second partial
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_stacked_weights_in_both_layouts_from_one_cast(fmt, group_rows):
    """``transposed``: the same six results, and each expert's codes transposed ([E, K, N] of [E, N, K])."""
    w = _rows(3 * group_rows, 40, torch.bfloat16, seed=group_rows)
    w[group_rows + 5, 7] = float("nan")
    out = tgc.cast_grouped(w, fmt, group_rows=group_rows, row_inv=True, transposed=True)
    _assert_same(out[:6], tgc.reference(w, fmt, group_rows=group_rows))
    want = out[0].view(3, group_rows, 40).transpose(1, 2)
    assert out[6].shape == (3, 40, group_rows) and out[6].is_contiguous()
    assert torch.equal(_bits(out[6]), _bits(want.contiguous()))


@pytest.mark.parametrize("group_rows", [40, 100])  # one row block per expert; two, the second partial
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("per", ["column", "row"])
def test_stacked_weights_divided_by_channel_scales_in_the_cast(per, dtype, group_rows):
    """``W / c`` (Smooth-SwiGLU's ``B``, c powers of two per column or row of each expert) cast without
    writing ``B``: amaxes, scales and codes (both layouts) as the torch reference that divides in the
    weight's dtype first."""
    g = torch.Generator().manual_seed(7)
    cols = 48
    w = _rows(3 * group_rows, cols, dtype, seed=9)
    w[group_rows + 10, 1] = float("inf")
    d = torch.exp2(torch.randint(-30, 31, (3, cols if per == "column" else group_rows), generator=g).float())
    kw = {"col_divisor" if per == "column" else "row_divisor": d}
    out = tgc.cast_grouped(w, E4M3, group_rows=group_rows, row_inv=True, transposed=True, **kw)
    ref = tgc.reference(w, E4M3, group_rows=group_rows, **kw)
    _assert_same(out[:6], ref)
    # a NaN weight: a NaN code (its sign is the multiply's: devices differ) and expert 0's amax NaN
    w[4, 4] = float("nan")
    nan = tgc.cast_grouped(w, E4M3, group_rows=group_rows, **kw)
    assert nan[0].view(torch.uint8)[4, 4] & 0x7F == 0x7F and nan[2][0].isnan()
    assert torch.equal(_bits(out[6]), _bits(out[0].view(3, group_rows, cols).transpose(1, 2).contiguous()))
    plain = tgc.reference(w, E4M3, group_rows=group_rows)
    assert not torch.equal(_bits(ref[0]), _bits(plain[0]))  # the divisor changes the codes


def test_delayed_scaling_per_expert_held_bootstrap_and_guard():
    """Expert 0: empty history (the current scale); 1: held; 2: held but outgrown, guard on (current);
    3: no rows (held). As ``scale_to_cast`` decides per expert."""
    state = DelayedScalingState(DelayedScaling(history_len=4, on_overflow="current"), E4M3, experts=4)
    state.scale.copy_(torch.tensor([2.0, 4.0, 1.0e5, 8.0]))
    state.steps.copy_(torch.tensor([0, 3, 3, 3]))
    x = (torch.randn(30, 32, generator=torch.Generator().manual_seed(3)) / 10).bfloat16()  # |x| < 1: 4 x 1 fits
    offs = torch.tensor([10, 20, 30, 30], dtype=torch.int32)
    ops = state.op_tensors()
    out = tgc.cast_grouped(x, E4M3, offs, state=ops, row_inv=True)
    _assert_same(out, tgc.reference(x, E4M3, offs, state=ops))
    assert out[1][1] == 4.0 and out[1][3] == 8.0 and out[1][0] != 2.0 and out[1][2] != 1.0e5


def test_bad_arguments_raise_clear_errors():
    x = torch.ones(8, 4)
    with pytest.raises(ValueError, match="non-empty"):
        tgc.cast_grouped(x[:0], E4M3, torch.tensor([0], dtype=torch.int32))
    with pytest.raises(ValueError, match="group_rows that divides"):
        tgc.cast_grouped(x, E4M3, group_rows=3)
    with pytest.raises(ValueError, match="give offs or"):
        tgc.cast_grouped(x, E4M3, torch.tensor([8], dtype=torch.int32), group_rows=4)
    with pytest.raises(ValueError, match="a divisor takes stacked fp32/bf16 weights"):
        tgc.cast_grouped(x, E4M3, group_rows=4, col_divisor=torch.ones(2, 5))  # [E, C] is [2, 4]
    with pytest.raises(ValueError, match="a divisor takes stacked fp32/bf16 weights"):
        tgc.cast_grouped(x.half(), E4M3, group_rows=4, row_divisor=torch.ones(2, 4))
    with pytest.raises(ValueError, match="transposed takes stacked weights"):
        tgc.cast_grouped(x, E4M3, torch.tensor([8], dtype=torch.int32), transposed=True)


@pytest.mark.parametrize("blocks", ["one block", "column loop", "column splits"])
@pytest.mark.parametrize("offs,rows", [([7, 7, 20, 33], 40), ([0, 0, 40, 40], 40), ([16, 32], 32), ([40], 40),
                                       (list(range(1, 11)), 41), ([0], 5)])
def test_aligned_transpose_is_the_torch_layout(offs, rows, blocks, monkeypatch):
    """The wgrad operand layout (groups at multiples of 16, zeros between, padding rows last), its group
    ends, empty groups and repeated decode scales: those of ``cuda._aligned_groups`` and friends. A
    program takes its code columns in blocks: one block; 4 blocks of 8 columns in a loop (the last one
    partial); the blocks split among programs."""
    from fp8pass.kernels import cuda

    if blocks != "one block":
        monkeypatch.setattr(tgc, "_TRANSPOSE_TILE", (32, 8))
        monkeypatch.setattr(tgc, "_TRANSPOSE_PROGRAMS", 1 if blocks == "column loop" else 8)
    offs = torch.tensor(offs, dtype=torch.int32)
    gen = torch.Generator().manual_seed(rows)
    codes = torch.randint(0, 255, (rows, 28), dtype=torch.uint8, generator=gen).view(torch.float8_e4m3fn)
    scale = torch.rand(offs.numel(), generator=gen) * 100
    ends, where, width, sizes = cuda._aligned_groups(offs, rows)
    out, ends_k, empty, rep_inv = tgc.aligned_transpose(codes, scale, offs, width)
    assert torch.equal(out.view(torch.uint8), cuda._scattered_transpose(codes, where, width).view(torch.uint8))
    assert torch.equal(ends_k, ends) and torch.equal(empty, sizes == 0)
    assert torch.equal(_bits(rep_inv), _bits(cuda._repeated_inverse(scale, 28).view(-1)))
    # a divisor per column of each group (the smoothed wgrad's dW = dB / c): the decode scales divided, exactly
    div = torch.exp2(torch.randint(-40, 41, (offs.numel(), 28), generator=gen).float())
    _, _, _, rep_div = tgc.aligned_transpose(codes, scale, offs, width, divisor=div)
    assert torch.equal(_bits(rep_div), _bits(cuda._repeated_inverse(scale, 28, div).view(-1)))
    assert torch.equal(_bits(rep_div), _bits((cuda._repeated_inverse(scale, 28) / div).view(-1)))
