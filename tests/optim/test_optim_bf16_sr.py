"""fp8pass.optim.AdamW(bf16_stochastic_round=True): bf16 weights, no fp32 master, stochastic rounding (issue 31)."""

import io

import pytest
import torch

import fp8pass.optim as fo
from fp8pass.numerics.casts import stochastic_round_bf16, uniform_bits
from fp8pass.optim.torch_step import adam_step_torch, host_hyper_params


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


SHAPES = [(300, 7), (5,), (128,), (1, 129)]  # partial blocks, a tensor below one block, whole blocks


def _params(seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]


def _grads(params, step):
    g = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(p.shape, generator=g) * 0.1).to(p.dtype) for p in params]


def _sr_reference(x32: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
    """The rounding written out: add the low 16 hash bits of counter i to fp32 bits, keep the top 16."""
    xi = x32.reshape(-1).view(torch.int32)
    i = torch.arange(xi.numel(), dtype=torch.int32)
    h = i * -1640531535 + seed  # murmur3's finalizer of i * golden + seed (numerics.casts constants)
    h = (h ^ ((h >> 16) & 0xFFFF)) * -2048144789
    h = (h ^ ((h >> 13) & 0x7FFFF)) * -1028477387
    h = h ^ ((h >> 16) & 0xFFFF)
    return ((xi + (h & 0xFFFF)) & -65536).view(torch.float32).view(x32.shape).to(torch.bfloat16)


def test_stochastic_round_bf16_is_unbiased_and_stays_on_the_two_neighbours():
    n = 1 << 16
    lo = torch.tensor(1.0, dtype=torch.bfloat16)
    step = 2.0**-7  # bf16 step in [1, 2)
    for frac in (0.0, 0.01, 0.3, 0.5, 0.97):
        for sign in (1.0, -1.0):
            x = torch.full((n,), sign * (1.0 + frac * step), dtype=torch.float32)
            y = stochastic_round_bf16(x, torch.tensor(12345, dtype=torch.int32)).float()
            neighbours = torch.tensor([sign * float(lo), sign * (float(lo) + step)])
            assert bool(((y == neighbours[0]) | (y == neighbours[1])).all())
            se = y.std().item() / n**0.5 if frac else 0.0
            assert abs(y.mean().item() - x[0].item()) <= 4 * se + 1e-12, (frac, sign)
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 3.0, -2.5, 1e-40])
    out = stochastic_round_bf16(specials, torch.tensor(7, dtype=torch.int32))
    assert torch.equal(out[:4].float(), specials[:4]) and torch.signbit(out[1])
    assert torch.isnan(out[4]) and out[5].item() == 3.0 and out[6].item() == -2.5  # on the grid: unchanged
    down = torch.tensor(1e-40).view(torch.int32).item() & -65536  # an fp32 subnormal: bf16 has the same range
    assert out[7].float().view(torch.int32).item() in (down, down + 65536)
    x = torch.randn(1000)
    seed = torch.tensor(-99, dtype=torch.int32)
    assert torch.equal(stochastic_round_bf16(x, seed).view(torch.int16), _sr_reference(x, seed).view(torch.int16))
    assert torch.equal(uniform_bits(5, seed)[:3], uniform_bits(3, seed))  # counters, not a stream


def test_step_is_bit_identical_to_fp32_math_then_stochastic_rounding():
    """Each step equals: the fp32 update of the bf16 weight (fp8pass's fp32-parameter path, itself
    checked against torch.optim.AdamW) rounded by the written-out reference, with the seeds the
    optimizer draws from its generator, one per parameter in order."""
    params = _params()
    opt = fo.AdamW(params, lr=1e-2, weight_decay=0.1, bf16_stochastic_round=True, kernels="torch",
                   generator=torch.Generator().manual_seed(5))
    ref32 = [torch.nn.Parameter(p.detach().float()) for p in params]
    ref_opt = fo.AdamW(ref32, lr=1e-2, weight_decay=0.1, kernels="torch")
    seeds = torch.Generator().manual_seed(5)
    for step in range(4):
        grads = _grads(params, step)
        for p, r, g in zip(params, ref32, grads):
            p.grad = g
            r.grad = g.float()  # exact: the step widens a bf16 gradient the same way
            r.data.copy_(p.detach().float())  # the reference starts each step from the bf16 weight
        opt.step()
        ref_opt.step()
        for p, r in zip(params, ref32):
            seed = torch.randint(-2**31, 2**31 - 1, (), generator=seeds, dtype=torch.int32)
            assert p.dtype == torch.bfloat16
            assert torch.equal(p.detach().view(torch.int16), _sr_reference(r.detach(), seed).view(torch.int16)), step
        for p, r in zip(params, ref32):  # the moments are those of the fp32 path, code for code
            for k, v in opt.state[p].items():
                assert torch.equal(v, ref_opt.state[r][k]), (step, k)
    assert any(not torch.equal(p.detach(), r.detach().bfloat16()) for p, r in zip(params, ref32))  # not RNE


def test_many_rounded_updates_average_to_the_fp32_master_trajectory():
    """4096 copies of one weight with one gradient stream: every copy's bits are independent, so the
    mean weight after 60 steps estimates the rounded trajectory's expectation, which is the fp32-master
    run's weight (updates below half a bf16 step: round-to-nearest never moves the weight)."""
    n, steps, w0 = 4096, 60, 1.0
    w = torch.nn.Parameter(torch.full((n,), w0, dtype=torch.bfloat16))
    master = torch.nn.Parameter(torch.full((n,), w0, dtype=torch.float32))
    nearest = torch.nn.Parameter(torch.full((n,), w0, dtype=torch.bfloat16))
    kw = dict(lr=1e-3, weight_decay=0.0, kernels="torch")
    opts = [fo.AdamW([w], bf16_stochastic_round=True, generator=torch.Generator().manual_seed(0), **kw),
            fo.AdamW([master], **kw), fo.AdamW([nearest], **kw)]
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        grad = torch.randn((), generator=g).abs() + 0.5  # same gradient for every copy, varying in time
        for p in (w, master, nearest):
            p.grad = torch.full_like(p, float(grad))
        for o in opts:
            o.step()
    mean, se = w.detach().float().mean().item(), w.detach().float().std().item() / n**0.5
    target = master[0].item()
    assert w0 - target > 0.05  # the fp32-master run moved by many half-steps of bf16 (0.0039)...
    assert nearest[0].item() == w0  # ...which round-to-nearest bf16 loses entirely
    assert abs(mean - target) <= 4 * se, (mean, target, se)
    assert se > 0


def test_bad_inputs_give_clear_errors():
    with pytest.raises(ValueError, match="bf16_stochastic_round=True updates bf16 weights.*float32"):
        fo.AdamW([torch.nn.Parameter(torch.randn(4))], bf16_stochastic_round=True)
    opt = fo.AdamW([torch.nn.Parameter(torch.randn(4, dtype=torch.bfloat16))], bf16_stochastic_round=True)
    with pytest.raises(ValueError, match="float16"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(4, dtype=torch.float16))]})
    opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(4))], "bf16_stochastic_round": False})  # allowed
    with pytest.raises(ValueError, match="must be True or False"):
        fo.AdamW([torch.nn.Parameter(torch.randn(4, dtype=torch.bfloat16))], bf16_stochastic_round="yes")
    with pytest.raises(ValueError, match="bf16_stochastic_round=True updates bf16 weights"):
        fo.to_fp8(torch.optim.AdamW([torch.nn.Parameter(torch.randn(4))]), bf16_stochastic_round=True)
    p = torch.randn(8)
    m, v = fo.moment_specs(opt.defaults, 8)
    state = {}
    from fp8pass.optim.moments import init_moment
    for spec in (m, v):
        init_moment(state, spec, p)
    hp = host_hyper_params(1e-3, 0.9, 0.999, 1e-8, 0.0, 1, True)
    with pytest.raises(ValueError, match="needs a bf16 parameter"):
        adam_step_torch(p, torch.randn(8), state, m, v, hp, weight_seed=torch.tensor(1, dtype=torch.int32))
    with pytest.raises(TypeError, match="rounds fp32 values"):
        stochastic_round_bf16(torch.randn(3, dtype=torch.bfloat16), torch.tensor(1, dtype=torch.int32))


def _trained(seed_gen=5, steps=2):
    params = _params()
    opt = fo.AdamW(params, lr=1e-2, bf16_stochastic_round=True, kernels="torch",
                   generator=torch.Generator().manual_seed(seed_gen))
    for s in range(steps):
        for p, g in zip(params, _grads(params, s)):
            p.grad = g
        opt.step()
    return params, opt


def test_state_dict_round_trip_continues_bit_identically():
    params, opt = _trained()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    sd = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    assert all(g["bf16_stochastic_round"] is True for g in sd["param_groups"])
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = fo.AdamW(twins, lr=1e-2, bf16_stochastic_round=True, kernels="torch")
    opt2.load_state_dict(sd)
    state = opt.generator.get_state()
    opt2.generator = torch.Generator()
    opt2.generator.set_state(state)
    for s in range(2, 4):
        grads = _grads(params, s)
        for p, q, g in zip(params, twins, grads):
            p.grad, q.grad = g, g.clone()
        opt.step()
        opt2.step()
        for p, q in zip(params, twins):
            assert torch.equal(p.detach().view(torch.int16), q.detach().view(torch.int16))
            for k, v in opt.state[p].items():
                assert torch.equal(v, opt2.state[q][k]), k


def test_converts_to_and_from_torch_adamw_state_over_bf16_params():
    params, opt = _trained()
    tsd = fo.to_torch_state_dict(opt.state_dict())
    assert all("bf16_stochastic_round" not in g for g in tsd["param_groups"])
    torch_opt = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in params], lr=1e-2)
    torch_opt.load_state_dict(tsd)
    for i, p in enumerate(params):
        m32, v32 = opt.moments(p)
        st = torch_opt.state[torch_opt.param_groups[0]["params"][i]]
        assert st["exp_avg"].dtype == torch.bfloat16  # torch keeps moments in the parameter's dtype
        assert torch.equal(st["exp_avg"], m32.bfloat16()) and torch.equal(st["exp_avg_sq"], v32.bfloat16())
    # back: a torch AdamW state over bf16 parameters loads into the option (moments quantized)
    back = fo.AdamW([torch.nn.Parameter(p.detach().clone()) for p in params], lr=1e-2, bf16_stochastic_round=True)
    back.load_state_dict(torch_opt.state_dict())
    assert back.param_groups[0]["bf16_stochastic_round"] is True
    for i, q in enumerate(back.param_groups[0]["params"]):  # within an e4m3 / e5m2 half-step of torch's
        st = torch_opt.state[torch_opt.param_groups[0]["params"][i]]
        for got, want, rel in zip(back.moments(q), (st["exp_avg"].float(), st["exp_avg_sq"].float()), (2**-4, 2**-3)):
            assert torch.allclose(got, want, rtol=rel + 2**-8, atol=want.abs().max().item() * 2**-16)
    sd = fo.from_torch_state_dict(torch_opt.state_dict(), bf16_stochastic_round=True)
    assert all(g["bf16_stochastic_round"] is True for g in sd["param_groups"])


def test_compiled_kernels_take_the_torch_path_bit_identically():
    a_params, a = _trained()
    params = _params()
    b = fo.AdamW(params, lr=1e-2, bf16_stochastic_round=True, kernels="compiled",
                 generator=torch.Generator().manual_seed(5))
    for s in range(2):
        for p, g in zip(params, _grads(params, s)):
            p.grad = g
        b.step()
    for p, q in zip(a_params, params):
        assert torch.equal(p.detach().view(torch.int16), q.detach().view(torch.int16))


def test_trainer_knob_builds_a_bf16_model_and_rejects_torch_adamw_recipes(tmp_path):
    from fp8pass.train.loop import TrainConfig
    from fp8pass.train.recipes import build_optimizer, get_recipe

    with pytest.raises(ValueError, match="use an -fp8adam recipe"):
        TrainConfig(recipe="bf16", out=str(tmp_path), bf16_stochastic_round=True)
    with pytest.raises(ValueError, match="must be True or False"):
        TrainConfig(recipe="bf16-fp8adam", out=str(tmp_path), bf16_stochastic_round=1)
    model = torch.nn.Linear(8, 8).to(torch.bfloat16)
    with pytest.raises(ValueError, match="use an -fp8adam recipe"):
        build_optimizer(model, get_recipe("bf16"), lr=1e-3, weight_decay=0.1, bf16_stochastic_round=True)
    opt = build_optimizer(model, get_recipe("bf16-fp8adam"), lr=1e-3, weight_decay=0.1, bf16_stochastic_round=True)
    assert all(g["bf16_stochastic_round"] for g in opt.param_groups)
    with pytest.raises(ValueError, match="bf16_stochastic_round=True updates bf16 weights"):
        build_optimizer(torch.nn.Linear(8, 8), get_recipe("bf16-fp8adam"), lr=1e-3, weight_decay=0.1,
                        bf16_stochastic_round=True)


def test_triton_kernels_hand_the_option_to_the_torch_path(monkeypatch):
    """No Triton variant yet: such groups take the torch path (same bits), never the fused kernel."""
    import fp8pass.kernels.triton_adam as ta

    monkeypatch.setattr(ta, "adam_step_triton_multi", lambda *a, **k: pytest.fail("the fused kernel ran"))
    a_params, _ = _trained()
    params = _params()
    b = fo.AdamW(params, lr=1e-2, bf16_stochastic_round=True, kernels="triton",
                 generator=torch.Generator().manual_seed(5))
    for s in range(2):
        for p, g in zip(params, _grads(params, s)):
            p.grad = g
        b.step()
    for p, q in zip(a_params, params):
        assert torch.equal(p.detach().view(torch.int16), q.detach().view(torch.int16))
