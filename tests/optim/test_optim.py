"""fp8pass.optim: FP8 Adam/AdamW against torch.optim.AdamW (torch kernel path)."""

import io
import math

import pytest
import torch

import fp8pass.optim as fo
from fp8pass import quantize
from fp8pass.numerics import E4M3, E5M2


@pytest.fixture
def one_thread():
    """Small ops run faster on one thread, and far faster when other jobs share the CPU cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


pytestmark = pytest.mark.usefixtures("one_thread")

SHAPES = [(300, 7), (5,), (128,), (1, 129), (64, 64)]  # partial blocks, a tensor below one block, whole blocks


def _params(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]


def _grads(params, step, seed=1):
    g = torch.Generator().manual_seed(seed * 1000 + step)
    out = []
    for p in params:
        # magnitudes spread over six decades inside each tensor, as real gradients are
        spread = torch.logspace(-6, 0, p.numel())[torch.randperm(p.numel(), generator=g)].reshape(p.shape)
        out.append((torch.randn(p.shape, generator=g) * spread * 0.1 * (1 + step % 3)).to(p.dtype))
    return out


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def _run(make_opt, steps=20, dtype=torch.float32):
    params = _params(dtype=dtype)
    opt = make_opt(params)
    for t in range(steps):
        for p, g in zip(params, _grads(params, t)):
            p.grad = g
        opt.step()
    return params, opt


@pytest.mark.parametrize("kind", ["adamw", "adam_l2", "maximize"])
def test_fp32_formats_match_torch_over_20_steps(kind):
    kw = dict(lr=1e-2, betas=(0.9, 0.95))
    if kind == "adamw":
        ref_cls, cls, kw = torch.optim.AdamW, fo.AdamW, dict(kw, weight_decay=0.1)
    elif kind == "adam_l2":
        ref_cls, cls, kw = torch.optim.Adam, fo.Adam, dict(kw, weight_decay=0.1)
    else:
        ref_cls, cls, kw = torch.optim.AdamW, fo.AdamW, dict(kw, maximize=True)
    ref, ref_opt = _run(lambda ps: ref_cls(ps, **kw))
    out, opt = _run(lambda ps: cls(ps, m_format="fp32", v_format="fp32", kernels="torch", **kw))
    for p, q in zip(out, ref):
        assert _rel(p, q) <= 1e-6
        m, v = opt.moments(p)
        assert _rel(m, ref_opt.state[q]["exp_avg"]) <= 1e-6
        assert _rel(v, ref_opt.state[q]["exp_avg_sq"]) <= 1e-6
        assert opt.state[p]["step"].item() == ref_opt.state[q]["step"].item() == 20


def _ulp(fmt, y):
    """One ulp of ``fmt`` at the (scaled) magnitudes ``y``."""
    e = torch.floor(torch.log2(y.abs().clamp_min(fmt.min_normal)))
    return torch.exp2(e - fmt.mbits)


def _assert_within_one_ulp(stored, scale, expected_value, fmt, block):
    """stored codes/scale vs the FP8 round trip (same block rule) of an fp32 expected value."""
    flat = expected_value.reshape(-1).float()
    n = flat.numel()
    pad = torch.nn.functional.pad(flat, (0, -n % block)).view(-1, block)
    amax = torch.where(pad.abs() < math.inf, pad.abs(), 0).amax(1)
    exp_scale = fo.moments.scale_from_amax(amax, fmt)
    q = quantize(flat, fmt, scale=exp_scale.reshape(1, -1), granularity="block", block=block)
    rt = q.dequantize()
    ours = stored.reshape(-1).float().view(-1)
    ours = torch.nn.functional.pad(ours, (0, -n % block)).view(-1, block) / scale[:, None]
    ours = ours.reshape(-1)[:n]
    s_full = exp_scale.repeat_interleave(block)[:n]
    tol = _ulp(fmt, torch.maximum(ours.abs(), rt.abs()) * s_full) / s_full
    assert ((ours - rt).abs() <= tol * (1 + 1e-5)).all()
    return (stored.reshape(-1).view(torch.uint8) != q.data.reshape(-1).view(torch.uint8)).float().mean().item()


@pytest.mark.parametrize("block_size", [128, None])
@pytest.mark.parametrize("v_sqrt", [True, False])
@pytest.mark.parametrize("m_format,v_format", [("e4m3", "e5m2"), ("e5m2", "e4m3")])
def test_fp8_moments_are_one_ulp_from_torch_round_trip(m_format, v_format, v_sqrt, block_size):
    """At every one of 20 steps: from the same (dequantized) state and gradient, torch's AdamW gives
    moments whose FP8 round trip (same per-block rule; one block per tensor for block_size=None) is
    within one ulp of what we store."""
    params = _params()
    opt = fo.AdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, m_format=m_format, v_format=v_format,
                   v_sqrt=v_sqrt, block_size=block_size, kernels="torch")
    mf, vf = fo.moments.MomentSpec("exp_avg", m_format).format, fo.moments.MomentSpec("exp_avg_sq", v_format).format
    mismatch = []
    for t in range(20):
        grads = _grads(params, t)
        # torch's step from our current state
        shadow = [torch.nn.Parameter(p.detach().clone()) for p in params]
        ref = torch.optim.AdamW(shadow, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
        for p, q, g in zip(params, shadow, grads):
            m, v = opt.moments(p)
            ref.state[q] = {"step": torch.tensor(float(t)), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
            q.grad = g.clone()
            p.grad = g
        ref.step()
        opt.step()
        for p, q in zip(params, shadow):
            st, rs = opt.state[p], ref.state[q]
            block = block_size or p.numel()
            assert st["exp_avg_scale"].shape == (-(-p.numel() // block),)
            mismatch.append(_assert_within_one_ulp(st["exp_avg_codes"], st["exp_avg_scale"], rs["exp_avg"], mf,
                                                   block))
            if v_sqrt:
                mismatch.append(_assert_within_one_ulp(st["exp_avg_sq_sqrt_codes"], st["exp_avg_sq_sqrt_scale"],
                                                       rs["exp_avg_sq"].double().sqrt().float(), vf, block))
            else:
                mismatch.append(_assert_within_one_ulp(st["exp_avg_sq_codes"], st["exp_avg_sq_scale"],
                                                       rs["exp_avg_sq"], vf, block))
            assert _rel(p, q) <= 1e-6  # the parameter update itself is torch's, to fp32 rounding
    # almost all codes are identical; one-ulp differences come from fp32 ties (lerp vs mul-add)
    assert sum(mismatch) / len(mismatch) < 1e-3


def test_state_bytes_per_parameter():
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    opt = fo.AdamW(model.parameters())
    model(torch.randn(4, 256)).square().mean().backward()
    opt.step()
    n = sum(p.numel() for p in model.parameters())
    per_param = fo.state_nbytes(opt) / n
    assert per_param <= 2.1
    # exactly: 1 + 1 code bytes, two fp32 scales per 128 elements, a 4-byte step per tensor
    expect = sum(2 * p.numel() + 8 * -(-p.numel() // 128) + 4 for p in model.parameters())
    assert fo.state_nbytes(opt) == expect
    ref = torch.optim.AdamW(model.parameters())
    ref.step()
    assert fo.state_nbytes(ref) / n > 7.99


def _teacher(seed=0):
    g = torch.Generator().manual_seed(seed)
    w1, w2 = torch.randn(32, 64, generator=g), torch.randn(64, 8, generator=g)
    return lambda x: torch.tanh(x @ w1 * 0.3) @ w2


def _sample(teacher, n, g):
    """Inputs and labels drawn from the teacher's softmax: a loss floor well above zero."""
    x = torch.randn(n, 32, generator=g)
    return x, torch.multinomial(torch.softmax(teacher(x), 1), 1, generator=g).squeeze(1)


def _train_tiny(make_opt, steps=300, seed=0):
    teacher = _teacher()
    x_eval, y_eval = _sample(teacher, 4096, torch.Generator().manual_seed(123))
    torch.manual_seed(seed + 1)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 128),
                                torch.nn.GELU(), torch.nn.Linear(128, 8))
    opt = make_opt(model.parameters())
    g = torch.Generator().manual_seed(seed + 2)
    for _ in range(steps):
        x, y = _sample(teacher, 128, g)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return torch.nn.functional.cross_entropy(model(x_eval), y_eval).item()


def test_tiny_model_300_steps_fp8_within_1pct_of_fp32_moments():
    kw = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    ref = _train_tiny(lambda ps: fo.AdamW(ps, m_format="fp32", v_format="fp32", **kw))
    fp8 = _train_tiny(lambda ps: fo.AdamW(ps, **kw))
    assert ref < 1.0  # it learned: chance level is ln(8) = 2.08, the teacher's entropy ~0.8
    assert abs(fp8 - ref) / ref <= 0.01


@pytest.mark.parametrize("storage", [{}, {"block_size": None, "v_sqrt": True}])
def test_state_dict_round_trip_exact_and_weights_only_load(storage):
    params, opt = _run(lambda ps: fo.AdamW(ps, lr=1e-2, **storage), steps=3)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    clone = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = fo.AdamW(clone, lr=1e-2)  # the loaded param groups' storage options win, as in torch
    opt2.load_state_dict(sd)
    for p, q in zip(params, clone):
        a, b = opt.state[p], opt2.state[q]
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
            assert torch.equal(a[k].view(torch.uint8) if a[k].dtype.itemsize == 1 else a[k],
                               b[k].view(torch.uint8) if b[k].dtype.itemsize == 1 else b[k])
    # training continues identically after the reload
    for t in range(3, 5):
        for ps in (params, clone):
            for p, g in zip(ps, _grads(ps, t)):
                p.grad = g
        opt.step()
        opt2.step()
    for p, q in zip(params, clone):
        assert torch.equal(p, q)
    # the state dict holds plain tensors only
    for st in opt.state_dict()["state"].values():
        assert all(type(v) is torch.Tensor for v in st.values())


def test_per_tensor_scales_are_one_block_of_the_whole_tensor():
    """block_size=None: one fp32 scale per tensor, bit-identical to a block as large as each tensor."""
    per_tensor, opt = _run(lambda ps: fo.AdamW(ps, lr=1e-2, block_size=None, v_sqrt=False, kernels="torch"), steps=5)
    for p in per_tensor:
        st = opt.state[p]
        assert st["exp_avg_scale"].shape == (1,) and st["exp_avg_sq_scale"].shape == (1,)
        assert st["exp_avg_codes"].shape == p.shape
    for i, shape in enumerate(SHAPES):  # one tensor at a time, with its own block size
        def only(ps, i=i):
            return fo.AdamW([ps[i]], lr=1e-2, block_size=max(ps[i].numel(), 1), v_sqrt=False, kernels="torch")
        blocked, _ = _run(only, steps=5)
        assert torch.equal(blocked[i], per_tensor[i]), shape
    m, v = opt.moments(per_tensor[0])
    assert m.shape == v.shape == SHAPES[0] and (v >= 0).all()


@pytest.mark.parametrize("options", [
    dict(v_sqrt=False), dict(v_sqrt=True, m_format="e5m2", v_format="e4m3"), dict(m_format="bf16", v_format="e5m2"),
    dict(v_sqrt=False, maximize=True), dict(v_sqrt=True, block_size=1000)])
def test_blocks_larger_than_a_chunk_take_two_passes_with_the_same_result(monkeypatch, options):
    """A scale block spanning several chunks (per tensor on a large tensor) is updated in two passes
    over its chunks; the result is bit-identical to one chunk holding the whole block."""
    from fp8pass.optim import adam as adam_mod
    from fp8pass.optim import torch_step

    def run(cls, **kw):
        options.setdefault("block_size", None)
        return _run(lambda ps: cls(ps, lr=1e-2, weight_decay=0.1, kernels="torch", **options, **kw), steps=4)

    ref_p, ref = run(fo.AdamW)
    monkeypatch.setattr(torch_step, "CHUNK", 256)  # (300, 7) and (64, 64) now span 9 and 16 chunks
    monkeypatch.setattr(adam_mod, "CHUNK", 256)
    out_p, out = run(fo.AdamW)
    for p, q in zip(out_p, ref_p):
        assert torch.equal(p, q)
        for k, t in out.state[p].items():
            u = ref.state[q][k]
            assert torch.equal(t.view(torch.uint8) if t.dtype.itemsize == 1 else t,
                               u.view(torch.uint8) if u.dtype.itemsize == 1 else u), k
    # Adam with L2 decay (the gradient reads the parameter in both passes) and bf16 parameters
    monkeypatch.setattr(torch_step, "CHUNK", 1 << 18)
    monkeypatch.setattr(adam_mod, "CHUNK", 1 << 18)
    ref_l2, _ = _run(lambda ps: fo.Adam(ps, lr=1e-2, weight_decay=0.1, block_size=None, kernels="torch"), steps=3,
                     dtype=torch.bfloat16)
    monkeypatch.setattr(torch_step, "CHUNK", 256)
    monkeypatch.setattr(adam_mod, "CHUNK", 256)
    out_l2, _ = _run(lambda ps: fo.Adam(ps, lr=1e-2, weight_decay=0.1, block_size=None, kernels="torch"), steps=3,
                     dtype=torch.bfloat16)
    assert all(torch.equal(p, q) for p, q in zip(out_l2, ref_l2))


@pytest.mark.needs_fused_fma  # the Triton kernels against the torch path, bit for bit
def test_per_tensor_scales_route_large_blocks_away_from_fused_kernels(monkeypatch):
    """kernels="compiled"/"triton" fuse whole blocks per chunk/program; blocks too large for them
    (one scale for a large tensor) take the torch path (compiled) or the split-block Triton kernels
    (triton; tested in tests/optim/test_optim_triton.py), smaller ones still reach the fused entry points."""
    from fp8pass.kernels import triton_adam
    from fp8pass.optim import adam as adam_mod
    from fp8pass.optim import compiled_step
    from fp8pass.optim.torch_step import adam_step_torch

    calls = []

    def spy(name):
        def step(p, *args, **kwargs):
            calls.append((name, p.numel()))
            return adam_step_torch(p, *args, **kwargs)
        return step

    def spy_multi(params, grads, states, hps, m_spec, v_spec, weight_seeds, **kwargs):  # the batched Triton launch
        for p, g, st, hp, ws in zip(params, grads, states, hps, weight_seeds):
            calls.append(("triton", p.numel()))
            adam_step_torch(p, g, st, m_spec, v_spec, hp, weight_seed=ws, **kwargs)

    monkeypatch.setattr(compiled_step, "adam_step_compiled", spy("compiled"))
    monkeypatch.setattr(triton_adam, "adam_step_triton", spy("triton"))
    monkeypatch.setattr(triton_adam, "adam_step_triton_multi", spy_multi)
    monkeypatch.setattr(adam_mod, "CHUNK", 256)
    monkeypatch.setattr(adam_mod, "TRITON_MAX_BLOCK", 256)
    ref, _ = _run(lambda ps: fo.AdamW(ps, lr=1e-2, block_size=None, kernels="torch"), steps=2)
    small = sorted(math.prod(s) for s in SHAPES if math.prod(s) <= 256)
    for kernels in ("compiled", "triton"):
        calls.clear()
        out, _ = _run(lambda ps: fo.AdamW(ps, lr=1e-2, block_size=None, kernels=kernels), steps=2)
        assert sorted(n for name, n in calls if name == kernels) == sorted(small * 2), kernels
        assert all(torch.equal(p, q) for p, q in zip(out, ref))


def test_bf16_params_state_dict_keeps_fp32_scales():
    params, opt = _run(lambda ps: fo.AdamW(ps, lr=1e-2), steps=2, dtype=torch.bfloat16)
    opt2 = fo.AdamW([torch.nn.Parameter(p.detach().clone()) for p in params], lr=1e-2)
    opt2.load_state_dict(opt.state_dict())
    for q in opt2.param_groups[0]["params"]:
        assert opt2.state[q]["exp_avg_scale"].dtype == torch.float32
        assert opt2.state[q]["exp_avg_codes"].dtype == torch.float8_e4m3fn


def test_to_and_from_torch_state_dicts():
    params, opt = _run(lambda ps: fo.AdamW(ps, lr=1e-2, weight_decay=0.1), steps=4)
    tsd = fo.to_torch_state_dict(opt.state_dict())
    shadow = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ref = torch.optim.AdamW(shadow, lr=1e-2, weight_decay=0.1)
    ref.load_state_dict(tsd)
    for p, q in zip(params, shadow):
        m, v = opt.moments(p)
        assert torch.equal(ref.state[q]["exp_avg"], m) and torch.equal(ref.state[q]["exp_avg_sq"], v)
        assert ref.state[q]["step"].item() == 4
    assert "m_format" not in ref.param_groups[0] and ref.param_groups[0]["weight_decay"] == 0.1
    # and back: a torch state dict loads into fp8pass (quantized), directly or through the helper
    tparams, topt = _run(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1), steps=4)
    mine = [torch.nn.Parameter(p.detach().clone()) for p in tparams]
    opt3 = fo.AdamW(mine, lr=1e-2, weight_decay=0.1)
    opt3.load_state_dict(topt.state_dict())
    for p, q in zip(tparams, mine):
        st = opt3.state[q]
        _assert_within_one_ulp(st["exp_avg_codes"], st["exp_avg_scale"], topt.state[p]["exp_avg"], E4M3, 128)
        _assert_within_one_ulp(st["exp_avg_sq_codes"], st["exp_avg_sq_scale"], topt.state[p]["exp_avg_sq"], E5M2, 128)
    per_tensor = fo.from_torch_state_dict(topt.state_dict(), v_sqrt=False, block_size=None)
    assert per_tensor["state"][0]["exp_avg_sq_scale"].shape == (1,)
    back = fo.to_torch_state_dict(per_tensor)["state"][0]
    assert _rel(back["exp_avg"], topt.state[tparams[0]]["exp_avg"]) < 0.07  # E4M3: 2^-4 relative at most
    sd = fo.from_torch_state_dict(topt.state_dict(), v_sqrt=False, block_size=64)
    assert sd["param_groups"][0]["block_size"] == 64
    assert sd["state"][0]["exp_avg_sq_codes"].dtype == torch.float8_e5m2
    assert sd["state"][0]["exp_avg_sq_scale"].shape == (-(-300 * 7 // 64),)
    with pytest.raises(ValueError, match="already a torch"):
        fo.to_torch_state_dict(tsd)
    with pytest.raises(ValueError, match="not a torch"):
        fo.from_torch_state_dict(opt.state_dict())


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_to_fp8_converts_in_place_fresh_and_mid_training(cls):
    params = _params()
    opt = cls(params, lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    calls = []
    opt.register_step_post_hook(lambda o, a, k: calls.append(1))
    for t in range(3):
        for p, g in zip(params, _grads(params, t)):
            p.grad = g
        opt.step()
        sched.step()
    before = {id(p): (opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone()) for p in params}
    same = fo.to_fp8(opt)
    assert same is opt
    assert isinstance(opt, fo.AdamW if cls is torch.optim.AdamW else fo.Adam)
    assert opt.param_groups[0]["decoupled_weight_decay"] == (cls is torch.optim.AdamW)
    for p in params:
        st = opt.state[p]
        assert "exp_avg" not in st and st["exp_avg_codes"].dtype == torch.float8_e4m3fn
        _assert_within_one_ulp(st["exp_avg_codes"], st["exp_avg_scale"], before[id(p)][0], E4M3, 128)
    for t in range(3, 5):
        for p, g in zip(params, _grads(params, t)):
            p.grad = g
        opt.step()
        sched.step()
    assert len(calls) == 5  # the hook registered on the torch optimizer still runs
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5**5)
    assert all(opt.state[p]["step"].item() == 5 for p in params)
    # a fresh optimizer converts too
    fresh = fo.to_fp8(torch.optim.AdamW(_params(), lr=1e-3), v_sqrt=True)
    ps = fresh.param_groups[0]["params"]
    for p, g in zip(ps, _grads(ps, 0)):
        p.grad = g
    fresh.step()
    assert fresh.state[ps[0]]["exp_avg_sq_sqrt_codes"].dtype == torch.float8_e5m2


def test_to_fp8_rejects_other_optimizers_and_amsgrad():
    with pytest.raises(TypeError, match="torch.optim.Adam or torch.optim.AdamW"):
        fo.to_fp8(torch.optim.SGD(_params(), lr=0.1))
    with pytest.raises(ValueError, match="amsgrad"):
        fo.to_fp8(torch.optim.AdamW(_params(), amsgrad=True))


def test_bad_inputs_give_clear_errors():
    ps = _params()
    with pytest.raises(ValueError, match="amsgrad"):
        fo.AdamW(ps, amsgrad=True)
    with pytest.raises(ValueError, match="m_format"):
        fo.AdamW(ps, m_format="int8")
    with pytest.raises(ValueError, match="block_size"):
        fo.AdamW(ps, block_size=0)
    with pytest.raises(ValueError, match="or None .one scale per tensor"):
        fo.AdamW(ps, block_size="tensor")
    with pytest.raises(ValueError, match="needs the parameter's numel"):
        fo.moment_specs({"m_format": "e4m3", "v_format": "e5m2", "block_size": None, "v_sqrt": True})
    with pytest.raises(ValueError, match="rounding"):
        fo.AdamW(ps, rounding="up")
    with pytest.raises(ValueError, match="differentiable"):
        fo.AdamW(ps, differentiable=True)
    with pytest.raises(ValueError, match="betas"):
        fo.AdamW(ps, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="decouples"):
        fo.AdamW(ps, decoupled_weight_decay=False)
    with pytest.raises(ValueError, match="complex"):
        fo.AdamW([torch.nn.Parameter(torch.randn(4, dtype=torch.complex64))])
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = fo.AdamW(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()


def test_nan_and_inf_gradients_stay_in_their_elements():
    def run(poison):
        p = torch.nn.Parameter(torch.randn(4, 128, generator=torch.Generator().manual_seed(0)))
        opt = fo.AdamW([p], lr=1e-2)
        for t in range(3):
            g = torch.randn(4, 128, generator=torch.Generator().manual_seed(t + 1))
            if t == 1:
                g[1, 5] = poison
            p.grad = g
            opt.step()
        return p.detach(), opt.state[p]

    clean_p, clean = run(0.0)
    for poison in (float("nan"), float("inf")):
        p, st = run(poison)
        assert torch.isnan(p[1, 5])  # as in torch: the element's update is NaN
        mask = torch.ones_like(p, dtype=torch.bool)
        mask[1, 5] = False
        assert torch.isfinite(p[mask]).all()
        for k in ("exp_avg_scale", "exp_avg_sq_scale"):
            assert torch.isfinite(st[k]).all()
            assert torch.equal(st[k][[0, 2, 3]], clean[k][[0, 2, 3]])  # other blocks untouched
        assert torch.equal(p[[0, 2, 3]], clean_p[[0, 2, 3]])
        # same block, other elements: scaled from the finite values, so they keep their precision
        m_codes = st["exp_avg_codes"].float()
        assert torch.isnan(m_codes[1, 5]) or poison == float("inf")
        rel = (p[1][mask[1]] - clean_p[1][mask[1]]).abs().max() / clean_p[1].abs().max()
        assert rel < 1e-2


def test_zero_gradients_and_params_without_grad():
    a = torch.nn.Parameter(torch.randn(300))
    b = torch.nn.Parameter(torch.randn(10))
    opt = fo.AdamW([a, b], lr=1e-2, weight_decay=0.1)
    ref_a = torch.nn.Parameter(a.detach().clone())
    ref = torch.optim.AdamW([ref_a], lr=1e-2, weight_decay=0.1)
    b0 = b.detach().clone()
    for _ in range(3):
        a.grad = torch.zeros_like(a)
        ref_a.grad = torch.zeros_like(a)
        opt.step()
        ref.step()
    assert torch.equal(a, ref_a)  # decay only, exactly as torch
    st = opt.state[a]
    assert (st["exp_avg_codes"].float() == 0).all() and (st["exp_avg_scale"] == 1).all()
    assert b not in opt.state or not opt.state[b]
    assert torch.equal(b, b0)


def test_closure_and_capturable_and_tensor_lr():
    params = _params()
    opt = fo.AdamW(params, lr=1e-2)
    loss = opt.step(lambda: sum((p * p).sum() for p in params).backward() or torch.tensor(1.0))
    assert loss.item() == 1.0
    a, _ = _run(lambda ps: fo.AdamW(ps, lr=1e-2), steps=5)
    b, _ = _run(lambda ps: fo.AdamW(ps, lr=torch.tensor(1e-2), capturable=True), steps=5)
    for p, q in zip(a, b):
        assert _rel(p, q) < 1e-5  # bias corrections in fp32 on the device instead of float64


def test_stochastic_rounding_is_unbiased_and_reproducible():
    def once(seed, **kw):
        p = torch.nn.Parameter(torch.zeros(4096))
        opt = fo.AdamW([p], lr=0.0, weight_decay=0.0, betas=(0.5, 0.5), block_size=4096,
                       generator=torch.Generator().manual_seed(seed), **kw)
        p.grad = torch.linspace(0.01, 1.0, 4096)
        opt.step()
        return opt.moments(p)[0], opt.state[p]["exp_avg_codes"]

    m_near, _ = once(0)
    exact = torch.linspace(0.01, 1.0, 4096) * 0.5
    draws = torch.stack([once(s, rounding="stochastic")[0] for s in range(24)])
    # every draw is one of the two neighbours: within one ulp of the exact value
    fmt_ulp = _ulp(E4M3, exact * (448 / exact.max())) / (448 / exact.max())
    assert ((draws - exact).abs() <= fmt_ulp).all()
    bias_sr = (draws.mean(0) - exact).mean().abs()
    assert bias_sr < 0.3 * (m_near - exact).abs().mean()
    a = once(7, rounding="stochastic")[1]
    b = once(7, rounding="stochastic")[1]
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_stochastic_flush_to_zero_is_unbiased_below_the_smallest_subnormal():
    from fp8pass.optim.torch_step import cast_moment

    spec = fo.MomentSpec("exp_avg", "e4m3")
    y = torch.full((4096,), 0.3 * E4M3.min_subnormal)  # already scaled
    y[0] = 100.0
    assert (cast_moment(y, spec, "nearest", False, None).float()[1:] == 0).all()  # plain RNE flushes all
    codes = cast_moment(y, spec, "nearest", True, torch.Generator().manual_seed(0)).float()
    assert codes[0] == 96.0  # values above the subnormal range still round to nearest (100 -> 96)
    assert set(codes[1:].unique().tolist()) == {0.0, E4M3.min_subnormal}
    assert abs(codes[1:].mean().item() - y[1].item()) < 0.1 * y[1].item()


@pytest.mark.slow
def test_compiled_path_is_bit_identical_to_eager():
    """kernels="compiled" (Inductor-fused chunks + eager tail) against the eager torch path (compiles ~1 min)."""
    from fp8pass.optim.torch_step import CHUNK

    def run(kernels):
        g = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(CHUNK + 300, generator=g) * 0.02)]
        opt = fo.AdamW(params, lr=1e-2, weight_decay=0.1, kernels=kernels)
        for t in range(3):
            grad = torch.randn(CHUNK + 300, generator=g) * torch.logspace(-6, 0, CHUNK + 300) * 1e-2
            grad[7] = float("nan") if t == 1 else grad[7]
            params[0].grad = grad
            opt.step()
        return params[0], opt.state[params[0]]

    pa, sa = run("torch")
    pb, sb = run("compiled")
    assert torch.equal(pa.isnan(), pb.isnan()) and torch.equal(pa[~pa.isnan()], pb[~pb.isnan()])
    for k in sa:
        a, b = sa[k], sb[k]
        if a.dtype.itemsize == 1:
            nan = a.float().isnan() & b.float().isnan()
            assert ((a.view(torch.uint8) == b.view(torch.uint8)) | nan).all(), k
        else:
            assert torch.equal(a, b), k


def test_auto_compiles_large_cpu_tensors_and_falls_back_to_eager_if_compiling_fails(monkeypatch):
    from fp8pass.optim import adam as adam_mod
    from fp8pass.optim import compiled_step

    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(compiled_step, "_compiled", broken)
    monkeypatch.setattr(compiled_step, "_BROKEN", [])
    monkeypatch.delenv("FP8PASS_KERNELS", raising=False)
    n = adam_mod.AUTO_COMPILE_NUMEL

    def run(kernels):
        p = torch.nn.Parameter(torch.randn(n, generator=torch.Generator().manual_seed(0)))
        opt = fo.AdamW([p], lr=1e-2, kernels=kernels)
        for t in range(2):
            p.grad = torch.randn(n, generator=torch.Generator().manual_seed(t + 1))
            opt.step()
        return p

    ref = run("torch")
    with pytest.warns(RuntimeWarning, match="torch.compile of the Adam chunk update failed"):
        out = run("auto")
    assert len(calls) == 1  # tried once, then eager for good
    assert torch.equal(out, ref)


def test_one_scale_per_tensor_on_a_sharded_parameter_is_a_clear_error():
    """No FSDP2 shard holds the whole tensor's amax: per-tensor scales on a Shard(0) parameter are
    refused with the fix named; replicated parameters (every rank holds the whole tensor) are fine."""
    import types

    dist_tensor = pytest.importorskip("torch.distributed.tensor")
    from fp8pass.optim.sharded import _scale_placements

    def fake(placement, shape=(64, 64)):
        return types.SimpleNamespace(device_mesh=types.SimpleNamespace(shape=(2,)), placements=(placement,),
                                     shape=torch.Size(shape), numel=lambda: math.prod(shape))

    group = {"m_format": "e4m3", "v_format": "e5m2", "block_size": None, "v_sqrt": False}
    spec = fo.moment_specs(group, 64 * 64)[0]
    with pytest.raises(ValueError, match="one scale per tensor .* sharded 2 ways.*block_size that divides"):
        _scale_placements(fake(dist_tensor.Shard(0)), spec)
    assert _scale_placements(fake(dist_tensor.Replicate()), spec) == [dist_tensor.Replicate()]
    assert _scale_placements(fake(dist_tensor.Shard(0)), fo.moment_specs({**group, "block_size": 128}, 4096)[0]) \
        == [dist_tensor.Shard(0)]


# Shapes of a tiny Llama's parameters and the edges of the compiled path: whole blocks, partial last
# blocks, fewer than two blocks (eager), several chunks plus one block (that block goes eager).
COMPILED_SHAPES = [(96, 256), (256, 96), (256,), (300, 7), (1, 129), (3, 128), (5,), (2 * 2048 + 1, 128)]


def _assert_same_state(pa, oa, pb, ob):
    for p, q in zip(pa, pb):
        assert torch.equal(p.isnan(), q.isnan()) and torch.equal(p[~p.isnan()], q[~q.isnan()])
        for k, a in oa.state[p].items():
            b = ob.state[q][k]
            nan = a.float().isnan() & b.float().isnan()
            bits = (lambda t: t.view(torch.uint8)) if a.dtype.itemsize == 1 else (lambda t: t)
            assert (nan | (bits(a) == bits(b))).all(), k


def _run_shapes(kernels, shapes, steps=3, dtype=torch.float32, cls=fo.AdamW, **kw):
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter((torch.randn(s, generator=g) * 0.02).to(dtype)) for s in shapes]
    opt = cls(params, lr=1e-2, weight_decay=0.1, kernels=kernels, **kw)
    for t in range(steps):
        for p in params:
            grad = torch.randn(p.shape, generator=g) * torch.logspace(-6, 0, p.numel()).reshape(p.shape) * 1e-2
            if t == 1:
                grad.view(-1)[7 % p.numel()] = float("nan")  # a NaN stays in its element
            p.grad = grad.to(dtype)
        opt.step()
    return params, opt


def test_compiled_path_is_bit_identical_on_every_shape_with_one_graph():
    """kernels="compiled" against the eager path on every shape of a model, and one compiled graph
    (dynamic in the block count) serves them all: no recompilation per shape."""
    from torch._dynamo.utils import counters

    from fp8pass.optim import compiled_step

    # From a fresh Dynamo state: after another option set's graph (another test in this worker), a new
    # size recompiled once here (a guard of the shared `_chunk` code failing); one training uses one set.
    torch._dynamo.reset()
    compiled_step._compiled.cache_clear()
    compiled_step._MARKED.clear()
    pa, oa = _run_shapes("torch", COMPILED_SHAPES)
    _run_shapes("compiled", [(4, 128)], steps=1)  # compiled (or loaded) here: the count below is steady state
    graphs = counters["stats"]["unique_graphs"]
    pb, ob = _run_shapes("compiled", COMPILED_SHAPES)
    assert counters["stats"]["unique_graphs"] == graphs
    _assert_same_state(pa, oa, pb, ob)


@pytest.mark.slow
@pytest.mark.parametrize("options", [
    dict(v_sqrt=True, m_format="e5m2", v_format="e4m3", maximize=True),
    dict(m_format="bf16", v_format="e5m2", cls=fo.Adam, dtype=torch.bfloat16),  # L2 decay, bf16 params
    dict(block_size=32)])
def test_compiled_path_is_bit_identical_for_every_option(options):
    """Each configuration compiles its own graph (~10 s each on a loaded CPU)."""
    pa, oa = _run_shapes("torch", COMPILED_SHAPES, **options)
    pb, ob = _run_shapes("compiled", COMPILED_SHAPES, **options)
    _assert_same_state(pa, oa, pb, ob)


def test_auto_compiles_when_the_optimizer_is_large_not_the_tensor(monkeypatch):
    """kernels="auto" on CPU: many small tensors holding >= AUTO_COMPILE_NUMEL elements in all go
    through the compiled path (one graph serves them all); a smaller optimizer stays eager."""
    from fp8pass.optim import adam as adam_mod
    from fp8pass.optim import compiled_step

    seen = []

    def spy(p, *args, **kwargs):
        seen.append(p.numel())
        return fo.torch_step.adam_step_torch(p, *args, **kwargs)

    monkeypatch.setattr(compiled_step, "adam_step_compiled", spy)
    monkeypatch.delenv("FP8PASS_KERNELS", raising=False)
    monkeypatch.setattr(adam_mod, "AUTO_COMPILE_NUMEL", 4 * 4096)
    params = [torch.nn.Parameter(torch.randn(64, 64)) for _ in range(4)]  # 4 x 4096: exactly the threshold
    opt = fo.AdamW(params, kernels="auto")
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    assert seen == [4096] * 4
    seen.clear()
    opt = fo.AdamW(params[:3], kernels="auto")
    opt.step()
    assert seen == []
    opt.add_param_group({"params": [params[3]]})  # the count follows new groups
    opt.step()
    assert seen == [4096] * 4


def test_compiled_step_reads_nothing_back_to_the_host(monkeypatch):
    """capturable=True on the compiled CPU path: no .item(), .tolist() or bool(tensor) in a step."""
    params = [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(0))) for s in [(64, 128), (384,)]]
    opt = fo.AdamW(params, lr=1e-2, kernels="compiled", capturable=True)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # state creation and compilation may read the host

    def refuse(*a, **k):
        raise AssertionError("host read in the optimizer step")

    before = [p.detach().clone() for p in params]
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    opt.step()
    monkeypatch.undo()
    assert all(not torch.equal(b, p) for b, p in zip(before, params))
