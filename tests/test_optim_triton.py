"""The fused multi-tensor Triton Adam kernel against the torch path, bit for bit, under the interpreter
(TRITON_INTERPRET=1, set by conftest.py for the CPU suite)."""

import pytest
import torch

triton = pytest.importorskip("triton")

import fp8pass.optim as fo  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN injection


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


SHAPES = [(3, 100), (5,)]  # three blocks with a partial tail, and a tensor below one block


def _run(kernels, cls, dtype, poison, steps=3, **kw):
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]
    opt = cls(params, lr=1e-2, kernels=kernels, **kw)
    for t in range(steps):
        for i, p in enumerate(params):
            spread = torch.logspace(-6, 0, p.numel()).reshape(p.shape)
            p.grad = (torch.randn(p.shape, generator=g) * spread * 0.1 * (t + 1)).to(dtype)
            if poison and t == 1 and i == 0:
                p.grad[0, 5] = float("nan")
                p.grad[2, 3] = float("inf")
        opt.step()
    return params, opt


def _same(a, b):
    """Bit-identical, except that NaNs may differ in their sign bit (x86 makes negative default NaNs)."""
    if a.dtype.itemsize == 1:  # FP8 codes: NaN is S.1111.111 (E4M3) / S.11111.xx (E5M2)
        ua, ub = a.view(torch.uint8).int(), b.view(torch.uint8).int()
        nan = a.float().isnan() & b.float().isnan()
        return bool(((ua == ub) | nan).all())
    return bool(((a == b) | (a.float().isnan() & b.float().isnan())).all())


CASES = {
    "default": (fo.AdamW, torch.float32, {}),
    "v stored as v": (fo.AdamW, torch.float32, dict(v_sqrt=False)),
    "swapped formats": (fo.AdamW, torch.float32, dict(m_format="e5m2", v_format="e4m3")),
    "bf16 and fp32 moments": (fo.AdamW, torch.float32, dict(m_format="bf16", v_format="fp32")),
    "block 100, maximize": (fo.AdamW, torch.float32, dict(block_size=100, maximize=True)),
    "Adam L2, bf16 params": (fo.Adam, torch.bfloat16, dict(weight_decay=0.1)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_triton_kernel_is_bit_identical_to_torch_path(case):
    cls, dtype, kw = CASES[case]
    poison = case == "default"
    a, oa = _run("torch", cls, dtype, poison, **kw)
    b, ob = _run("triton", cls, dtype, poison, **kw)
    for p, q in zip(a, b):
        assert _same(p.detach(), q.detach())
        assert oa.state[p].keys() == ob.state[q].keys()
        for k in oa.state[p]:
            assert _same(oa.state[p][k], ob.state[q][k]), k
    if poison:
        assert torch.isnan(b[0][0, 5]) and torch.isfinite(ob.state[b[0]]["exp_avg_scale"]).all()


def test_triton_stochastic_rounding_within_one_ulp_of_nearest():
    a, oa = _run("triton", fo.AdamW, torch.float32, False, steps=1)
    b, ob = _run("triton", fo.AdamW, torch.float32, False, steps=1, rounding="stochastic",
                 stochastic_flush=False, generator=torch.Generator().manual_seed(3))
    for p, q in zip(a, b):
        for k in ("exp_avg_codes", "exp_avg_sq_codes"):
            ca = oa.state[p][k].view(torch.uint8).int() & 0x7F
            cb = ob.state[q][k].view(torch.uint8).int() & 0x7F
            assert ((ca - cb).abs() <= 1).all()  # codes are monotone in magnitude: one code = one ulp
        assert (oa.state[p]["exp_avg_codes"].view(torch.uint8) != ob.state[q]["exp_avg_codes"].view(
            torch.uint8)).any() or p.numel() < 10


def test_triton_kernel_rejects_non_contiguous():
    from fp8pass.optim.moments import MomentSpec, init_moment
    from fp8pass.optim.torch_step import hyper_params
    from fp8pass.optim.triton_step import adam_step_triton

    p = torch.randn(16, 16).t()
    st = {}
    ms, vs = MomentSpec("exp_avg", "e4m3"), MomentSpec("exp_avg_sq", "e5m2", sqrt=True)
    init_moment(st, ms, p)
    init_moment(st, vs, p)
    with pytest.raises(ValueError, match="contiguous"):
        adam_step_triton(p, torch.randn(16, 16).t(), st, ms, vs, hyper_params(1e-3, 0.9, 0.99, 1e-8, 0, 1, True, "cpu"))


def _grads(params, g, t):
    for p in params:
        spread = torch.logspace(-6, 0, p.numel()).reshape(p.shape) if p.numel() else torch.zeros(p.shape)
        p.grad = (torch.randn(p.shape, generator=g) * spread * 0.1 * (t + 1)).to(p.dtype)


def _run_many(kernels, shapes, dtypes, steps=2, **kw):
    g = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(d)) for s, d in zip(shapes, dtypes)]
    opt = fo.AdamW(params, lr=1e-2, kernels=kernels, **kw)
    for t in range(steps):
        _grads(params, g, t)
        opt.step()
    return params, opt


def _check_same(a, oa, b, ob):
    for p, q in zip(a, b):
        assert _same(p.detach(), q.detach())
        for k in oa.state[p]:
            assert _same(oa.state[p][k], ob.state[q][k]), k


MANY = [(3, 100), (0,), (7,), (2, 3, 40), (129,), (64, 64)]


@pytest.mark.parametrize("kw", [{}, dict(v_sqrt=False, m_format="e5m2", v_format="e4m3"),
                                dict(m_format="bf16", v_format="fp32"), dict(capturable=True)],
                         ids=["default", "swapped", "dense moments", "capturable"])
def test_multi_tensor_one_launch_per_dtype_pair(kw, monkeypatch):
    """All parameters of a group go through one launch per (device, param dtype, grad dtype), bit for
    bit the torch path: here six fp32 tensors (one empty, one below a block) and two bf16 ones."""
    from fp8pass.optim import triton_step

    launches = []
    real = triton_step._launch
    monkeypatch.setattr(triton_step, "_launch", lambda items, *a, **k: (launches.append(len(items)),
                                                                        real(items, *a, **k)))
    shapes = MANY + [(5, 30), (300,)]
    dtypes = [torch.float32] * len(MANY) + [torch.bfloat16] * 2
    a, oa = _run_many("torch", shapes, dtypes, **kw)
    b, ob = _run_many("triton", shapes, dtypes, **kw)
    _check_same(a, oa, b, ob)
    assert launches == [5, 2] * 2  # per step: the five non-empty fp32 tensors, the two bf16 ones


@pytest.mark.parametrize("kw", [{}, dict(v_sqrt=False), dict(m_format="e5m2", v_format="e4m3", maximize=True)])
def test_blocks_wider_than_a_span_two_passes(kw):
    """A block of 5000 elements (wider than MAX_SPAN = 4096 lanes) is walked in spans, once for its
    amax and once to write: the same bits as the torch path."""
    from fp8pass.optim.triton_step import MAX_SPAN

    assert 5000 > MAX_SPAN
    shapes = [(3, 4000), (4500,)]  # 3 blocks (last partial), one partial block
    a, oa = _run_many("torch", shapes, [torch.float32] * 2, block_size=5000, **kw)
    b, ob = _run_many("triton", shapes, [torch.float32] * 2, block_size=5000, **kw)
    _check_same(a, oa, b, ob)


def test_step_has_no_host_sync(monkeypatch):
    """Stochastic rounding draws its seed on the device: no .item()/.tolist() in the Triton step."""
    g = torch.Generator().manual_seed(2)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in MANY]
    opt = fo.AdamW(params, kernels="triton", capturable=True, rounding="stochastic", stochastic_flush=True,
                   generator=torch.Generator().manual_seed(3))
    _grads(params, g, 0)
    opt.step()  # state creation may sync; the steady-state step must not

    def refuse(*a, **k):
        raise AssertionError("host synchronisation in the optimizer step")

    _grads(params, g, 1)
    monkeypatch.setattr(torch.Tensor, "item", refuse)
    monkeypatch.setattr(torch.Tensor, "tolist", refuse)
    before = [p.detach().clone() for p in params]
    opt.step()
    monkeypatch.undo()
    assert all(p.numel() == 0 or not torch.equal(b, p) for b, p in zip(before, params))  # the step did update


def test_stochastic_streams_differ_between_tensors_and_steps():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1000, generator=g)
    params = [torch.nn.Parameter(x.clone()) for _ in range(2)]
    opt = fo.AdamW(params, kernels="triton", rounding="stochastic", generator=torch.Generator().manual_seed(4))
    for p in params:
        p.grad = torch.full_like(p, 1e-3) * torch.linspace(0.5, 1.5, 1000)
    opt.step()
    ca, cb = (opt.state[p]["exp_avg_codes"].view(torch.uint8) for p in params)
    assert not torch.equal(ca, cb)  # same values, independent draws per tensor


def test_live_tuning_is_refused():
    from fp8pass.optim import triton_step

    with pytest.raises(RuntimeError, match="autotuned on live tensors"):
        triton_step._refuse_live_tuning({})


def test_compiled_kernels_refuse_cpu_tensors(monkeypatch):
    from fp8pass.numerics.kernels import triton_family

    monkeypatch.setattr(triton_family, "INTERPRETING", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        triton_family.check_interpretable(torch.device("cpu"))
