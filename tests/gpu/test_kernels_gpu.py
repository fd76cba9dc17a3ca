"""Every Triton kernel compiled for the GPU against its torch reference (skipped without CUDA).

Run alone (the CPU suite interprets Triton): ``python -m pytest tests/gpu``. Bit-identical unless said:
the casts (RNE), fused amax + cast, row/block tiles, NVFP4, transpose-cast and the Adam step. Bounded:
stochastic rounding (statistics, neighbours, one code from RNE) and the Smooth-SwiGLU operand, whose
``tl.exp`` is approximate on GPUs (at most one code step, < 0.2% of codes; exact where silu is exact).
"""

import pytest
import torch

import fp8pass
from fp8pass.kernels import torch_family as T
from fp8pass.kernels import triton_family as R
from fp8pass.kernels import triton_helpers
from fp8pass.numerics import E2M1, E4M3, E4M3_GAUDI, E5M2, saturating_cast

pytestmark = pytest.mark.gpu
FORMATS = [E4M3, E4M3_GAUDI, E5M2, E2M1]


def same(a, b):
    """Bit-identical codes (compared on a's device: the large tensors never leave the GPU)."""
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8).to(a.device))


def hard(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-20, 12, (n,), generator=g).float())
    x[:6] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1.0625, 2.0**-10])
    return x


# -- casts --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_cast_and_fused_amax_bit_exact(fmt, dtype):
    x = hard(3 * 2**20 + 17).to(dtype)
    s = torch.tensor(0.75)
    a, am = T.cast_scaled(x, s, fmt, want_amax=True)
    b, bm = R.cast_scaled(x.cuda(), s.cuda(), fmt, want_amax=True)
    assert same(a, b)
    assert torch.equal(am.nan_to_num(-1), bm.cpu().nan_to_num(-1))
    finite = x[6:]
    assert torch.equal(T.tensor_amax(finite), R.tensor_amax(finite.cuda()).cpu())


@pytest.mark.parametrize("n", [1, 7, 2 * 8192 + 3])
def test_packed_e2m1_odd_count(n):
    x = torch.randn(n) * 3
    codes, _ = R.cast_flat(x.cuda(), torch.tensor(1.5, device="cuda"), E2M1)
    ref, _ = T.cast_scaled(torch.cat([x, x.new_zeros(1)]), torch.tensor(1.5), E2M1)
    assert codes.numel() == (n + 1) // 2 and same(codes, ref)


def _grid(fmt):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    if fmt.packed:
        return fp8pass.numerics.decode(codes, fmt).unique()
    v = codes.view(fmt.torch_dtype).float()
    return v[v.isfinite() & (v.abs() <= fmt.max)].unique()


@pytest.mark.parametrize("fmt", [E4M3, E5M2, E2M1], ids=lambda f: f.name)
def test_stochastic_cast_neighbours_unbiased_reproducible(fmt):
    """Each value lands on one of its two grid neighbours, the mean converges to it, the same
    generator seed gives the same codes (the seed is drawn on the GPU)."""
    base = torch.tensor([0.3, 1.1, 1.3, 2.6, 5.1] + ([] if fmt.packed else [100.3, 0.0037]))
    base = torch.cat([base, -base])
    n = 1 << 15
    x = base.repeat(n, 1).cuda()
    q = fp8pass.quantize(x, fmt, scale=1.0, rounding="stochastic", generator=torch.Generator("cuda").manual_seed(0))
    vals = q.dequantize(torch.float64).cpu()
    grid = _grid(fmt).double()
    idx = torch.searchsorted(grid, base.double(), right=True)
    lower, upper = grid[idx - 1], grid[idx.clamp(max=grid.numel() - 1)]
    assert bool(((vals == lower) | (vals == upper)).all())
    assert bool(((vals.mean(0) - base.double()).abs() <= 5 * (upper - lower) / (2 * n**0.5)).all())
    again = fp8pass.quantize(x, fmt, scale=1.0, rounding="stochastic", generator=torch.Generator("cuda").manual_seed(0))
    assert same(q.data, again.data)


@pytest.mark.parametrize("fmt", [E4M3, E2M1], ids=lambda f: f.name)
@pytest.mark.parametrize("granularity,block", [("row", None), ("block", (1, 16)), ("block", (128, 128)),
                                               ("block", (16, 16))])
def test_row_and_block_tiles_bit_exact(fmt, granularity, block):
    if fmt.packed and granularity == "row":
        pytest.skip("E2M1 is quantized in 1x16 blocks (NVFP4), not rows")
    x = hard(384 * 1000, 3).reshape(384, 1000)
    x[7, 9] = float("nan")
    a = fp8pass.quantize(x, fmt, granularity=granularity, block=block)
    b = fp8pass.quantize(x.cuda(), fmt, granularity=granularity, block=block)
    assert same(a.data, b.data)
    assert torch.equal(a.scale.nan_to_num(-1), b.scale.cpu().nan_to_num(-1))
    if a.block_scale is not None:  # NVFP4: E4M3 block scales and the fp32 tensor scale
        assert same(a.block_scale, b.block_scale)


def test_nvfp4_bit_exact():
    x = torch.randn(512, 2048) * torch.logspace(-3, 3, 2048)
    a = fp8pass.quantize(x, E2M1, granularity="block")
    b = fp8pass.quantize(x.cuda(), E2M1, granularity="block")
    assert same(a.data, b.data) and same(a.block_scale, b.block_scale) and torch.equal(a.scale, b.scale.cpu())
    torch.testing.assert_close(b.dequantize(torch.float32).cpu(), a.dequantize(torch.float32), rtol=0, atol=0)


def test_tiles_stochastic_unbiased():
    x = torch.randn(8, 64)
    n = 400
    q = fp8pass.quantize(x.repeat(n, 1).cuda(), E4M3, granularity="block", block=(1, 16), rounding="stochastic",
                         generator=torch.Generator("cuda").manual_seed(4))
    mean = q.dequantize(torch.float64).cpu().view(n, *x.shape).mean(0)
    near = fp8pass.quantize(x, E4M3, granularity="block", block=(1, 16)).dequantize(torch.float64)
    rel = ((mean - x.double()).abs() / x.abs().double().clamp(min=1e-3)).mean()
    rel_near = ((near - x.double()).abs() / x.abs().double().clamp(min=1e-3)).mean()
    assert rel < rel_near / 3


# -- the hardware conversion (cvt.rn.satfinite, issue 28) ---------------------------------------------------


def _every_class() -> torch.Tensor:
    """Every bf16 bit pattern (NaN of both signs, +-Inf, -0, subnormals) as fp32, then fp32 subnormals,
    NaN with a low-bit payload and the largest finite, each with both signs."""
    bf16 = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    bits = torch.tensor([1, 0x007FFFFF, 0x00400000, 0x7F800001, 0x7FC00000, 0x7F7FFFFF, 0x7F800000, 0],
                        dtype=torch.int32)
    fp32 = torch.cat([bits, bits | torch.iinfo(torch.int32).min]).view(torch.float32)
    return torch.cat([bf16, fp32])


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
@pytest.mark.parametrize("scale", [1.0, 2.0**-12, 2.0**20, 0.7])
def test_hardware_cast_bit_exact_every_input_class(fmt, scale):
    """The flat, transpose and tile kernels through the hardware conversion (sm_89+) give the torch
    reference's codes for every input class, -NaN keeping its sign, Inf saturating to +-max."""
    from fp8pass.kernels import triton_operand_casts as tk

    assert triton_helpers.hardware_cast(torch.device("cuda"), fmt) == int(torch.cuda.get_device_capability() >= (8, 9))
    x = _every_class()
    ref = saturating_cast(x * scale, fmt)
    s = torch.tensor(scale, device="cuda")
    a, _ = R.cast_scaled(x.cuda(), s, fmt)
    assert same(a, ref)
    assert bool((a.view(torch.uint8).cpu()[(x.view(torch.int32) < 0) & x.isnan()] == 0xFF).all())
    b, _ = R.cast_scaled(x[: 1 << 16].bfloat16().cuda(), s, fmt)  # the bf16 patterns are exact in bf16
    assert same(b, ref[: 1 << 16])
    x2, ref2 = x[: 1 << 16].view(256, 256), ref[: 1 << 16].view(256, 256)
    codes, codes_t, _ = tk.transpose_cast(x2.bfloat16().cuda(), s, fmt)
    assert same(codes, ref2) and same(codes_t, ref2.t().contiguous())
    codes, _ = R.quantize_groups(x2.cuda(), (1, 128), fmt, scales=torch.full((256, 2), scale, device="cuda"))
    assert same(codes, ref2)


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_hardware_stochastic_cast_is_the_integer_encoder(fmt):
    """Stochastic rounding on the fp32 bits, then the hardware conversion (HW=1), gives the integer
    encoder's codes (HW=0) for the same seed, for every input class and several scales."""
    import triton

    x = torch.cat([_every_class() * s for s in (1.0, 2.0**-12, 2.0**20, 0.7)]).cuda()
    n = x.numel()
    seed = torch.tensor([987654321], device="cuda")
    s = torch.ones(1, device="cuda")
    codes = []
    for hw in (0, 1):
        out = torch.empty(n, dtype=torch.uint8, device="cuda")
        partial = torch.empty(triton.cdiv(n, R._MIN_FLAT_BLOCK), device="cuda")
        R._cast_tensor_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](
            x, out, s, partial, seed, n, triton_helpers.size_class(n), STOCHASTIC=True, PACKED=False, WANT_AMAX=False,
            HW=hw, **R._fmt_args(fmt))
        codes.append(out)
    assert torch.equal(codes[0], codes[1])


# -- runtime kernels ------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
@pytest.mark.parametrize("shape", [(4095, 4096), (37, 50), (1, 129), (2048, 5632)])
def test_transpose_cast_bit_exact(fmt, shape):
    from fp8pass.kernels import triton_operand_casts as tk

    x = hard(shape[0] * shape[1], 5).reshape(shape).bfloat16()
    codes, codes_t, amax = tk.transpose_cast(x.cuda(), torch.tensor(0.5, device="cuda"), fmt)
    ref = saturating_cast(x.float() * 0.5, fmt)  # CPU reference, NaN codes included
    assert same(codes, ref) and same(codes_t, ref.t().contiguous())
    assert torch.equal(amax.cpu().nan_to_num(-1), T.tensor_amax(x).nan_to_num(-1))


@pytest.mark.parametrize("mode", ["none", "channel", "token"])
def test_swiglu_kernels_bounded(mode):
    """silu's tl.exp is approximate on the GPU: codes within one step of the CPU reference, < 0.2% differ."""
    from fp8pass.kernels import triton_operand_casts as tk
    from fp8pass.runtime.swiglu import swiglu_operand

    g = torch.Generator().manual_seed(1)
    gate = torch.randn(2048, 1408, generator=g) * 3
    up = torch.randn(2048, 1408, generator=g) * 2
    up[:, 5] *= 100
    a_ref, s = swiglu_operand(gate, up, mode)
    ref = fp8pass.quantize(a_ref, E4M3)
    sc = None if mode == "none" else s.cuda()
    codes, amax, scale = tk.swiglu_cast(gate.cuda(), up.cuda(), mode, E4M3, None, sc)
    torch.testing.assert_close(amax.cpu(), a_ref.abs().max(), rtol=1e-6, atol=0)
    torch.testing.assert_close(scale.cpu(), ref.scale, rtol=1e-6, atol=0)
    got, want = codes.cpu().float(), ref.data.float()
    diff = (got - want).abs()
    assert (diff <= torch.maximum(got.abs(), want.abs()) * 2.0**-3 + 2.0**-9).all()
    assert (diff > 0).float().mean() < 0.002
    torch.testing.assert_close(tk.swiglu_amax(gate.cuda(), up.cuda(), mode, sc).cpu(), a_ref.abs().max(),
                               rtol=1e-6, atol=0)
    if mode == "channel":
        torch.testing.assert_close(tk.swiglu_colamax(gate.cuda(), up.cuda()).cpu(),
                                   (torch.nn.functional.silu(gate) * up).abs().amax(0), rtol=1e-6, atol=0)


def test_swiglu_cast_exact_where_silu_is_exact():
    from fp8pass.kernels import triton_operand_casts as tk
    from fp8pass.runtime.swiglu import swiglu_operand

    gate = torch.full((64, 256), 120.0)  # silu(120) == 120 in fp32
    up = torch.randn(64, 256)
    a_ref, c = swiglu_operand(gate, up, "channel")
    codes, _, _ = tk.swiglu_cast(gate.cuda(), up.cuda(), "channel", E4M3, torch.tensor(2.5, device="cuda"), c.cuda())
    assert same(codes, saturating_cast(a_ref * 2.5, E4M3))


@pytest.mark.parametrize("mkn", [(4095, 4096, 4096), (100, 72, 40), (4096, 4095, 1000)])
def test_scaled_mm_whenever_fp8(mkn):
    """M arbitrary, K and N padded to 16: torch._scaled_mm against the dequantized fp32 product."""
    from fp8pass.kernels import cuda

    m, k, n = mkn
    a = (torch.randn(m, k, device="cuda") * 4).to(torch.float8_e4m3fn)
    b = (torch.randn(n, k, device="cuda") * 4).to(torch.float8_e5m2)
    sa, sb = torch.tensor(8.0, device="cuda"), torch.tensor(2.0, device="cuda")
    assert cuda.scaled_mm_plan(m, k, n, a.dtype, b.dtype, torch.bfloat16, "cuda") is not None
    out = cuda.gemm_tensor_scaled(a, sa, b, sb, torch.bfloat16)
    ref = (a.float() / 8.0) @ (b.float() / 2.0).t()
    torch.testing.assert_close(out.float(), ref, rtol=2**-7, atol=1e-2 * ref.abs().max().item())


# -- Adam -------------------------------------------------------------------------------------------------


def _same_state(a, b):
    if a.dtype.itemsize == 1:
        ua, ub = a.view(torch.uint8).int().cpu(), b.view(torch.uint8).int().cpu()
        return bool(((ua == ub) | (a.float().isnan().cpu() & b.float().isnan().cpu())).all())
    a, b = a.cpu(), b.cpu()
    return bool(((a == b) | (a.float().isnan() & b.float().isnan())).all())


SHAPES = [(3, 100), (7,), (257, 129), (4096,), (0,)]


def _adam_run(device, dtype, steps=3, **kw):
    import fp8pass.optim as fo

    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype).to(device)) for s in SHAPES]
    opt = fo.AdamW(params, lr=1e-2, kernels="triton" if device == "cuda" else "torch", **kw)
    for t in range(steps):
        for i, p in enumerate(params):
            spread = torch.logspace(-6, 0, p.numel()).reshape(p.shape) if p.numel() else torch.zeros(p.shape)
            grad = torch.randn(p.shape, generator=g) * spread * 0.1 * (t + 1)
            if t == 1 and i == 0:
                grad[0, 5] = float("nan")
            p.grad = grad.to(dtype).to(device)
        opt.step()
    return params, opt


ADAM_CASES = [  # the four FP8 moment format pairs, dense moments, v stored as v, bf16 parameters
    ("e4m3", "e5m2", True, torch.float32), ("e4m3", "e4m3", True, torch.float32),
    ("e5m2", "e5m2", True, torch.float32), ("e5m2", "e4m3", True, torch.float32),
    ("bf16", "fp32", True, torch.float32), ("e4m3", "e5m2", False, torch.float32),
    ("e4m3", "e5m2", True, torch.bfloat16),
]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("m_fmt,v_fmt,v_sqrt,dtype", ADAM_CASES, ids=lambda v: str(v))
def test_adam_bit_identical_to_torch_path(m_fmt, v_fmt, v_sqrt, dtype):
    """The multi-tensor kernel (autotuned on scratch first) equals the CPU torch path bit for bit."""
    kw = dict(m_format=m_fmt, v_format=v_fmt, v_sqrt=v_sqrt)
    a, oa = _adam_run("cpu", dtype, **kw)
    b, ob = _adam_run("cuda", dtype, **kw)
    for p, q in zip(a, b):
        assert _same_state(p.detach(), q.detach())
        for k in oa.state[p]:
            if k != "step":
                assert _same_state(oa.state[p][k], ob.state[q][k]), k


def test_adam_wide_blocks_and_stochastic():
    a, oa = _adam_run("cpu", torch.float32, block_size=5000)
    b, ob = _adam_run("cuda", torch.float32, block_size=5000)
    for p, q in zip(a, b):
        assert _same_state(p.detach(), q.detach())
    c, oc = _adam_run("cuda", torch.float32, steps=1, rounding="stochastic",
                      generator=torch.Generator("cuda").manual_seed(3))
    d, od = _adam_run("cuda", torch.float32, steps=1)
    for p, q in zip(c, d):
        if p.numel():
            ca = oc.state[p]["exp_avg_codes"].view(torch.uint8).int() & 0x7F
            cb = od.state[q]["exp_avg_codes"].view(torch.uint8).int() & 0x7F
            assert ((ca - cb).abs() <= 1).all()


@pytest.mark.parametrize("m_fmt,v_fmt", [("e4m3", "e5m2"), ("e5m2", "e4m3")])
def test_adam_per_tensor_scale_split_kernels_bit_identical_to_torch_path(m_fmt, v_fmt):
    """The paper's per-tensor moment scale (block_size=None): a tensor above TRITON_MAX_BLOCK elements
    ((257, 129) here, then a 2M-element one) goes through the split-block kernels (amax by atomic max
    over spans, then the write), the others through the fused kernel; bit-identical to the CPU torch path."""
    kw = dict(m_format=m_fmt, v_format=v_fmt, block_size=None)
    a, oa = _adam_run("cpu", torch.float32, **kw)
    b, ob = _adam_run("cuda", torch.float32, **kw)
    for p, q in zip(a, b):
        assert _same_state(p.detach(), q.detach())
        for k in oa.state[p]:
            if k != "step":
                assert _same_state(oa.state[p][k], ob.state[q][k]), k
    import fp8pass.optim as fo

    g = torch.Generator().manual_seed(1)
    big = [torch.randn(2048, 1024, generator=g) for _ in range(2)]
    grads = [torch.randn(2048, 1024, generator=g) * torch.logspace(-6, 0, 2048 * 1024).view(2048, 1024)
             for _ in range(2)]
    outs = []
    for device, kernels in (("cpu", "torch"), ("cuda", "triton")):
        p = torch.nn.Parameter(big[0].to(device))
        opt = fo.AdamW([p], lr=1e-2, kernels=kernels, **kw)
        for grad in grads:
            p.grad = grad.to(device)
            opt.step()
        outs.append((p.detach(), opt.state[p]))
    (p, sp), (q, sq) = outs
    assert _same_state(p, q)
    for k in sp:
        if k != "step":
            assert _same_state(sp[k], sq[k]), k


def test_adam_kernel_step_has_no_host_sync():
    from fp8pass.kernels.triton_adam import adam_step_triton_multi
    from fp8pass.optim.moments import MomentSpec, init_moment
    from fp8pass.optim.torch_step import hyper_params

    ms, vs = MomentSpec("exp_avg", "e4m3"), MomentSpec("exp_avg_sq", "e5m2", sqrt=True)
    params = [torch.randn(s, device="cuda") for s in ((1000, 300), (77,), (4096,))]
    states = [{} for _ in params]
    for p, st in zip(params, states):
        init_moment(st, ms, p)
        init_moment(st, vs, p)
    hp = hyper_params(1e-3, 0.9, 0.99, 1e-8, 0.1, 1, True, "cuda")
    args = dict(rounding="stochastic", generator=torch.Generator("cuda").manual_seed(0))
    adam_step_triton_multi(params, [torch.randn_like(p) for p in params], states, [hp] * 3, ms, vs, **args)
    grads = [torch.randn_like(p) for p in params]  # new addresses: the table is uploaded asynchronously
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    before = [p.clone() for p in params]
    try:
        adam_step_triton_multi(params, grads, states, [hp] * 3, ms, vs, **args)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(not torch.equal(b, p) for b, p in zip(before, params))  # the step ran and updated


@pytest.mark.parametrize("capturable", [False, True], ids=["host step", "capturable"])
def test_adamw_step_has_no_host_sync(capturable):
    """The optimizer's steady-state step (hyper-parameters as kernel arguments, or computed on the device)
    under ``set_sync_debug_mode("error")``: no synchronising copy or read."""
    import fp8pass.optim as fo

    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).cuda()) for s in SHAPES if s != (0,)]
    opt = fo.AdamW(params, lr=1e-2, capturable=capturable)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # state, launch table and autotuning outside the check
    for p in params:
        p.grad.copy_(torch.randn_like(p))
    before = [p.detach().clone() for p in params]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(not torch.equal(b, p) for b, p in zip(before, params))


def test_capturable_adamw_step_replays_in_a_cuda_graph():
    """capturable=True: one step captured in a CUDA graph and replayed gives, bit for bit, the eager steps."""
    import fp8pass.optim as fo

    g = torch.Generator().manual_seed(1)
    init = [torch.randn(s, generator=g) for s in SHAPES if s != (0,)]
    grads = [[torch.randn(x.shape, generator=g).cuda() for x in init] for _ in range(5)]
    eager = [torch.nn.Parameter(x.cuda()) for x in init]
    graphed = [torch.nn.Parameter(x.cuda()) for x in init]
    opt_e, opt_g = (fo.AdamW(ps, lr=1e-2, capturable=True) for ps in (eager, graphed))
    for ps, opt in ((eager, opt_e), (graphed, opt_g)):  # step 1 eagerly: state, table, autotuning
        for p, gr in zip(ps, grads[0]):
            p.grad = gr.clone()
        opt.step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt_g.step()  # captured, not run
    for step_grads in grads[1:]:
        for p, q, gr in zip(eager, graphed, step_grads):
            p.grad.copy_(gr)
            q.grad.copy_(gr)
        opt_e.step()
        graph.replay()
    torch.cuda.synchronize()
    for p, q in zip(eager, graphed):
        assert torch.equal(p, q)
        for k, v in opt_e.state[p].items():
            assert _same_state(v, opt_g.state[q][k]), k


# -- past 2**31 elements ----------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", [E4M3, E2M1], ids=lambda f: f.name)
def test_cast_past_2_31_elements_exact(fmt):
    """A cast over 2**31 + 1000 elements: int64 offsets, every code and the amax exact."""
    n = 2**31 + 1000
    x = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    x.view(torch.int16).random_(-32768, 32767)
    x = torch.where(x.isfinite(), x, 1.0)
    s = torch.tensor(2.0**-100, device="cuda")
    codes, amax = R.cast_scaled(x, s, fmt, want_amax=True)
    assert amax == x.abs().max().float()
    per = 2 if fmt.packed else 1
    step = 2**28
    for i in range(0, n, step):
        ref, _ = T.cast_scaled(x[i : i + step], s, fmt)  # the torch family on the GPU: the reference
        assert same(codes[i // per : (i + step) // per], ref), i
    del x, codes


def test_transpose_cast_past_2_31_elements_exact():
    from fp8pass.kernels import triton_operand_casts as tk

    r, c = 65600, 32768  # 2.15e9 elements
    x = torch.randn(r, c, device="cuda", dtype=torch.bfloat16)
    codes, codes_t, amax = tk.transpose_cast(x, torch.tensor(100.0, device="cuda"), E4M3)
    assert amax == x.abs().max().float()
    for i in range(0, r, 8192):
        ref = saturating_cast(x[i : i + 8192].float() * 100.0, E4M3)
        assert same(codes[i : i + 8192], ref), i
        assert same(codes_t[:, i : i + 8192], ref.t().contiguous()), i


@pytest.mark.parametrize("block", [128, 5000, 1 << 20], ids=["fused", "fused one pass", "split kernels"])
def test_adam_bf16_stochastic_weight_bit_identical_to_torch_path(block):
    """bf16_stochastic_round's kernels (fused, and the split ones for a block above TRITON_MAX_BLOCK) with
    the same WeightSeeds as the CPU torch path: weights and moments bit for bit, several tensors per launch."""
    from fp8pass.kernels.adam_layout import WeightSeed
    from fp8pass.kernels.triton_adam import adam_step_triton_multi
    from fp8pass.kernels.triton_adam_split import adam_step_triton_split
    from fp8pass.optim.moments import MomentSpec, init_moment
    from fp8pass.optim.torch_step import adam_step_torch, draw_weight_seeds, host_hyper_params

    g = torch.Generator().manual_seed(2)
    sizes = (3 * 2**20 + 77, 300 * 7, 5, 20000)
    seeds = draw_weight_seeds(len(sizes), torch.Generator().manual_seed(4), "cpu")
    counters = (0, 17, 2**31 - 100, 5)
    ms, vs = MomentSpec("exp_avg", "e4m3", block), MomentSpec("exp_avg_sq", "e5m2", block, sqrt=True)
    weights = [torch.randn(n, generator=g).bfloat16() for n in sizes]
    out = {}
    for device in ("cpu", "cuda"):
        params = [w.to(device) for w in weights]
        states = [{} for _ in params]
        for p, st in zip(params, states):
            init_moment(st, ms, p)
            init_moment(st, vs, p)
        wseeds = [WeightSeed(seeds.to(device)[j], c) for j, c in enumerate(counters)]
        for t in range(2):
            grads = [(torch.randn(n, generator=torch.Generator().manual_seed(10 * t + i)) * 0.1).bfloat16().to(device)
                     for i, n in enumerate(sizes)]
            hp = host_hyper_params(1e-2, 0.9, 0.999, 1e-8, 0.1, t + 1, True)
            if device == "cpu":
                for p, gr, st, ws in zip(params, grads, states, wseeds):
                    adam_step_torch(p, gr, st, ms, vs, hp, weight_seed=ws)
            elif block > (1 << 13):
                adam_step_triton_split(params, grads, states, [hp] * len(sizes), [ms] * len(sizes), [vs] * len(sizes),
                                       weight_seeds=wseeds)
            else:
                adam_step_triton_multi(params, grads, states, [hp] * len(sizes), ms, vs, weight_seeds=wseeds)
        out[device] = params, states
    for (p, sp), (q, sq) in zip(zip(*out["cpu"]), zip(*out["cuda"])):
        assert same(q, p)
        for k in sp:
            assert _same_state(sp[k], sq[k]), k


# -- RMSNorm (Config.save_norm_input_fp8) -------------------------------------------------------------


@pytest.mark.parametrize("d", [777, 4096, 8192])  # 8192: the wide path (two reads per block)
@pytest.mark.parametrize("x_dtype,hat", [(torch.float32, None), (torch.bfloat16, torch.bfloat16)], ids=["fp32", "bf16"])
def test_rmsnorm_kernels_compiled(d, x_dtype, hat):
    """Given the kernel's rstd, y, the scale and the codes are torch's ops on the GPU bit for bit; rstd and
    the gradients agree with the reference to fp32 rounding (tests/kernels/test_triton_norm.py's bounds)."""
    from fp8pass.kernels import triton_norm
    from fp8pass.numerics import scale_from_amax
    from fp8pass.runtime.rmsnorm import norm_backward_math

    g = torch.Generator().manual_seed(d)
    rows = 3000
    x = (torch.randn(rows, d, generator=g) * torch.logspace(-2, 2, rows).reshape(rows, 1)).to(x_dtype).cuda()
    w = (torch.randn(d, generator=g) * 0.5 + 1.0).to(x_dtype).cuda()
    out_dtype = x_dtype
    y, codes, scale, rstd = triton_norm.rmsnorm_forward(x, w, 1e-5, hat, out_dtype, E4M3)
    exact = torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(rstd.double(), exact, rtol=4 * 2.0**-24, atol=0)
    x_hat = x.float() * rstd
    want_y = (x_hat if hat is None else x_hat.to(hat)) * w
    assert torch.equal(y, want_y.to(out_dtype))
    want_scale = scale_from_amax(x_hat.abs().max(), E4M3)
    assert torch.equal(scale, want_scale)
    assert torch.equal(codes, saturating_cast(x_hat * want_scale, E4M3).view(torch.uint8))
    dy = torch.randn(rows, d, generator=g).to(out_dtype).cuda()
    dx, dw = triton_norm.rmsnorm_backward(dy, codes, scale, rstd, w, x_dtype, E4M3)
    values = codes.view(torch.float8_e4m3fn).float()
    want_dx, want_dw = norm_backward_math(dy, values, scale, rstd, w, x_dtype)
    xh = values * scale.reciprocal()
    gg = dy.float() * w.float()
    row_scale = (rstd * (gg.abs() + xh.abs() * (gg * xh).abs().mean(-1, keepdim=True))).double()
    assert ((dx.double() - want_dx.double()).abs() <= max(torch.finfo(x_dtype).eps, 2.0**-20) * row_scale).all()
    col_scale = (dy.float() * xh).abs().sum(0).double()
    assert ((dw.double() - want_dw.double()).abs() <= max(torch.finfo(x_dtype).eps, 2.0**-20) * col_scale).all()


def test_rmsnorm_op_never_syncs():
    from fp8pass.op_schema import NormKnobs

    x = torch.randn(512, 2048, device="cuda", requires_grad=True)
    w = torch.ones(2048, device="cuda", requires_grad=True)
    knobs = NormKnobs(1e-5, None, torch.float32, "e4m3").args()
    dy = torch.randn(512, 2048, device="cuda")
    torch.ops.fp8pass.rmsnorm(x, w, *knobs)[0].backward(dy)  # compile the kernels first
    torch.cuda.synchronize()
    first = x.grad.clone(), w.grad.clone()
    torch.cuda.set_sync_debug_mode("error")  # a host sync in the step below raises
    try:
        torch.ops.fp8pass.rmsnorm(x, w, *knobs)[0].backward(dy)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    # the second step ran the same (deterministic) kernels: the accumulated gradients are exactly doubled
    assert torch.equal(x.grad, 2 * first[0]) and torch.equal(w.grad, 2 * first[1])
    assert first[0].abs().max() > 0 and first[1].abs().max() > 0
