"""The Triton family (interpreter on CPU) is bit-identical to the torch family."""

import pytest
import torch

from fp8pass.kernels import torch_family as T
from fp8pass.kernels import triton_family as R
from fp8pass.kernels import triton_helpers
from fp8pass.numerics import E2M1, E4M3, E4M3_GAUDI, E5M2

FORMATS = [E4M3, E4M3_GAUDI, E5M2, E2M1]


def hard_input(dtype=torch.float32):
    torch.manual_seed(0)
    x = torch.randn(37, 304) * 10
    x[1] *= 1e-6  # a tiny row: subnormal codes
    x[2] *= 1e4  # a huge row: saturation under a shared scale
    x[3, 5] = float("nan")
    x[4, 7] = float("inf")
    x[5] = 0.0
    x[6, 8] = -0.0
    return x.to(dtype)


def same(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def same_float(a, b):
    return torch.equal(a.nan_to_num(-1.0), b.nan_to_num(-1.0))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_tensor_cast_and_amax(fmt, dtype):
    x = hard_input(dtype)
    for scale in (1.0, 3.0, 2.0**-7):
        s = torch.tensor(scale)
        a, am = T.cast_scaled(x, s, fmt, want_amax=True)
        b, bm = R.cast_scaled(x, s, fmt, want_amax=True)
        assert same(a, b)
        assert same_float(am, bm)
    finite = x.clone()
    finite[3, 5] = 1.0
    finite[4, 7] = 1.0
    assert torch.equal(T.tensor_amax(finite), R.tensor_amax(finite))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("tile", [(1, 304), (1, 16), (16, 16), (128, 128), (5, 8), (3, 7)], ids=str)
@pytest.mark.parametrize("pow2", [False, True])
def test_fused_tile_quantize(fmt, tile, pow2):
    if fmt.packed and tile[1] % 2:
        pytest.skip("E2M1 tiles must be even-width (checked in test_quantize)")
    x = hard_input()
    a, sa = T.quantize_groups(x, tile, fmt, power_of_two=pow2)
    b, sb = R.quantize_groups(x, tile, fmt, power_of_two=pow2)
    assert same_float(sa, sb)
    assert same(a, b)
    # With given scales (delayed scaling) as well.
    a2, _ = T.quantize_groups(x, tile, fmt, scales=sa * 0.5)
    b2, _ = R.quantize_groups(x, tile, fmt, scales=sa * 0.5)
    assert same(a2, b2)
    assert same_float(T.group_amax(x, tile), R.group_amax(x, tile))


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_tiles_in_row_chunks_are_the_whole_tile_bit_for_bit(rounding, monkeypatch):
    """A 128 x 128 tile is taken 32 rows at a time (``_row_chunk``): the same codes, scales and amaxes as
    the whole tile in one block, stochastic bits included (partial tiles in both dimensions)."""
    x = hard_input()
    seed = torch.tensor([2024], dtype=torch.int64)
    assert R._row_chunk((128, 128), False) == 32
    chunked = R.quantize_groups(x, (128, 128), E4M3, rounding=rounding, seed=seed)
    given = R.quantize_groups(x, (128, 128), E4M3, scales=chunked[1] * 0.5, rounding=rounding, seed=seed)[0]
    amax = R.group_amax(x, (128, 128))
    monkeypatch.setattr(R, "_CHUNK_ELEMENTS", 1 << 20)
    assert R._row_chunk((128, 128), False) == 0
    whole = R.quantize_groups(x, (128, 128), E4M3, rounding=rounding, seed=seed)
    assert same(chunked[0], whole[0]) and same_float(chunked[1], whole[1])
    assert same(given, R.quantize_groups(x, (128, 128), E4M3, scales=chunked[1] * 0.5, rounding=rounding, seed=seed)[0])
    assert same_float(amax, R.group_amax(x, (128, 128)))


def test_quantize_dispatch_uses_triton(monkeypatch):
    import fp8pass

    x = hard_input()
    monkeypatch.setenv("FP8PASS_KERNELS", "torch")
    qt = [fp8pass.quantize(x, E4M3, granularity=g) for g in ("tensor", "row", "block")]
    qn = fp8pass.quantize(x[:, :64], E2M1, granularity="block")
    monkeypatch.setenv("FP8PASS_KERNELS", "triton")
    qr = [fp8pass.quantize(x, E4M3, granularity=g) for g in ("tensor", "row", "block")]
    rn = fp8pass.quantize(x[:, :64], E2M1, granularity="block")
    for a, b in zip(qt, qr):
        assert same(a.data, b.data) and same_float(a.scale, b.scale)
    assert same(qn.data, rn.data) and same(qn.block_scale, rn.block_scale)


def test_bad_family_name(monkeypatch):
    import fp8pass

    monkeypatch.setenv("FP8PASS_KERNELS", "cuda")
    with pytest.raises(ValueError, match="auto, torch, triton"):
        fp8pass.quantize(torch.ones(4), E4M3)


@pytest.mark.parametrize("n", [1, 7, 2 * (1 << 16) + 3])  # the last: the final program's last byte alone
def test_packed_e2m1_odd_count_stays_in_bounds_and_is_exact(n, strict_interpreter):
    """An odd element count: ceil(n/2) bytes, the last high nibble 0, nothing read or written past the
    end (the interpreter checks every access), codes equal to the torch family's on the zero-padded x."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * 3
    s = torch.tensor(1.5)
    codes, amax = R.cast_flat(x, s, E2M1, want_amax=True)
    ref, _ = T.cast_scaled(torch.cat([x, x.new_zeros(1)]), s, E2M1)
    assert codes.numel() == (n + 1) // 2
    assert same(codes, ref)
    assert int(codes[-1]) >> 4 == 0
    assert amax == x.abs().max()


def test_packed_e2m1_odd_last_dim_is_refused_like_the_torch_family():
    x = torch.randn(4, 7)
    for fam in (T, R):
        with pytest.raises(ValueError, match="even last dimension"):
            fam.cast_scaled(x, torch.tensor(1.0), E2M1)
    with pytest.raises(ValueError, match="even last dimension"):
        R.quantize_groups(x, (1, 2), E2M1)


def test_every_kernel_widens_program_ids_to_int64():
    """Static check: each program id is widened before index math, in every Triton kernel module."""
    import inspect
    import re

    from fp8pass.kernels import triton_adam, triton_adam_split, triton_glu, triton_operand_casts, triton_scaling

    for mod in (R, triton_operand_casts, triton_adam, triton_adam_split, triton_scaling, triton_glu):
        src = inspect.getsource(mod)
        ids = re.findall(r"tl\.program_id\(\d\)(\.to\(tl\.int64\))?", src)
        assert ids and all(ids), f"{mod.__name__}: a tl.program_id(...) is used without .to(tl.int64)"


@pytest.mark.parametrize("fmt", [E4M3, E2M1], ids=lambda f: f.name)
def test_flat_kernels_address_past_2_31_exactly(fmt, strict_interpreter):
    """Programs whose first element is past 2**31 (program ids raised in the interpreter, pointers moved
    back to match): the addresses must stay exact, so the codes and amax equal the torch family's. With
    int32 offsets they wrap, and the bounds check fails."""
    shift, pid_shift = strict_interpreter
    block = R._FLAT_INTERPRET.kwargs["BLOCK"]
    programs = (1 << 31) // block + 3  # first element of the first program run: 2**31 + 3 * block
    m = block + 77  # two programs: a full one and a partial one
    per = 2 if fmt.packed else 1
    g = torch.Generator().manual_seed(5)
    x = torch.randn(m * per, generator=g) * 40
    nout = m
    out = torch.empty(nout, dtype=torch.uint8)
    partial = torch.empty(2, dtype=torch.float32)
    s = torch.tensor(0.5)
    shift.update({x: programs * block * per, out: programs * block, partial: programs})
    pid_shift[0] = programs
    n = programs * block * per + x.numel()
    assert programs * block * per > 2**31
    R._cast_tensor_kernel[(2,)](x, out, s, partial, s, n, triton_helpers.size_class(n), STOCHASTIC=False, PACKED=fmt.packed,
                                WANT_AMAX=True, **R._fmt_args(fmt))
    ref, _ = T.cast_scaled(x, s, fmt)
    assert same(out, ref)
    assert partial.max() == x.abs().max()
    amax = torch.empty(triton_cdiv(x.numel(), block), dtype=torch.float32)
    shift.clear()
    shift.update({x: programs * block, amax: programs})
    n = programs * block + x.numel()
    R._amax_kernel[(triton_cdiv(x.numel(), block),)](x, amax, n, triton_helpers.size_class(n))
    assert amax.max() == x.abs().max()


def triton_cdiv(a, b):
    return -(-a // b)


def test_tile_scales_treat_a_huge_amax_like_inf():
    """A tile whose amax is finite but >= 2**64 gets scale 1 in both families (scale_from_amax's rule)."""
    x = torch.ones(4, 256)
    x[1, 3] = 2.0**70
    (d_t, s_t), (d_r, s_r) = T.quantize_groups(x, (1, 128), E4M3)[:2], R.quantize_groups(x, (1, 128), E4M3)[:2]
    assert float(s_t.reshape(-1)[2]) == 1.0
    assert torch.equal(s_t, s_r) and torch.equal(d_t.view(torch.uint8), d_r.view(torch.uint8))
