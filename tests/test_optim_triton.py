"""The fused Triton Adam kernel against the torch path, bit for bit, under TRITON_INTERPRET=1 on CPU."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
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
        for k in ("exp_avg_codes", "exp_avg_sq_sqrt_codes"):
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
