"""fp8pass.optim.AdamW(bf16_stochastic_round=True): bf16 weights, no fp32 master, stochastic rounding (issue 31)."""

import io

import pytest
import torch

import fp8pass.optim as fo
from fp8pass.kernels.adam_layout import WeightSeed
from fp8pass.numerics.casts import stochastic_round_bf16, uniform_bits
from fp8pass.optim import torch_step
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
    assert torch.equal(uniform_bits(5, seed)[2:], uniform_bits(3, seed, start=2))
    whole = stochastic_round_bf16(x, seed)
    chunks = torch.cat([stochastic_round_bf16(x[s : s + 300], seed, start=s) for s in range(0, 1000, 300)])
    assert torch.equal(whole.view(torch.int16), chunks.view(torch.int16))  # a chunk with its first counter


@pytest.mark.parametrize("chunk", [torch_step.CHUNK, 256], ids=["one chunk", "chunks of 256"])
def test_step_is_bit_identical_to_fp32_math_then_stochastic_rounding(chunk, monkeypatch):
    """Each step equals: the fp32 update of the bf16 weight (fp8pass's fp32-parameter path, itself
    checked against torch.optim.AdamW) rounded by the written-out reference, with the seeds the
    optimizer draws from its generator: one draw of all the parameters' seeds per step, parameter j
    taking seed j. The torch path rounds each chunk as it updates it: chunks of 256 elements (the
    (300, 7) parameter is 9 of them) give the bits of the whole tensor rounded at once."""
    monkeypatch.setattr(torch_step, "CHUNK", chunk)
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
        step_seeds = torch.randint(-2**31, 2**31 - 1, (len(params),), generator=seeds, dtype=torch.int32)
        for p, r, seed in zip(params, ref32, step_seeds):
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
        adam_step_torch(p, torch.randn(8), state, m, v, hp, weight_seed=WeightSeed(torch.tensor(1, dtype=torch.int32)))
    with pytest.raises(TypeError, match="must be a kernels.adam_layout.WeightSeed"):
        adam_step_torch(p.bfloat16(), torch.randn(8), state, m, v, hp, weight_seed=torch.tensor(1, dtype=torch.int32))
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


def _run(kernels, shapes=SHAPES, steps=2, **kw):
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(torch.bfloat16)) for s in shapes]
    opt = fo.AdamW(params, lr=1e-2, weight_decay=0.1, bf16_stochastic_round=True, kernels=kernels,
                   generator=torch.Generator().manual_seed(5), **kw)
    for _ in range(steps):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=g) * 0.1).to(torch.bfloat16)
        opt.step()
    return params, opt


def _check_same(a, oa, b, ob):
    for p, q in zip(a, b):
        assert torch.equal(p.detach().view(torch.int16), q.detach().view(torch.int16))
        assert oa.state[p].keys() == ob.state[q].keys()
        for k, v in oa.state[p].items():
            w = ob.state[q][k]
            assert torch.equal(v.view(torch.uint8), w.view(torch.uint8)) if v.dtype.itemsize == 1 \
                else torch.equal(v, w), k


# (300, 7): the compiled chunk in pieces of 512 elements (4 blocks) and a partial last block; (64, 64):
# whole pieces; the small ones are below two blocks (the eager path)
COMPILED_SHAPES = [(300, 7), (64, 64), (5,), (1, 129)]


def test_compiled_path_rounds_in_the_compiled_chunk_bit_identically(monkeypatch):
    """kernels="compiled" rounds the weight inside the compiled chunk update (several chunks per
    tensor, each with its first counter), and equals the eager torch path bit for bit."""
    from fp8pass.optim import compiled_step

    a, oa = _run("torch", COMPILED_SHAPES, steps=3)
    monkeypatch.setattr(compiled_step, "CHUNK", 512)
    flags, pieces = [], []
    compiled, call = compiled_step._compiled, compiled_step._call
    monkeypatch.setattr(compiled_step, "_compiled", lambda *a: (flags.append(a[-1]), compiled(*a))[1])
    monkeypatch.setattr(compiled_step, "_call", lambda fn, args, *a: (pieces.append(args[0].numel()), call(fn, args, *a)))
    b, ob = _run("compiled", COMPILED_SHAPES, steps=3)
    assert flags == [True] * 6  # the two tensors of >= 2 blocks, 3 steps, compiled with the option on
    assert pieces == [512] * (4 + 8) * 3  # (300, 7): 4 pieces and a tail of 52 (eager); (64, 64): 8 pieces
    _check_same(a, oa, b, ob)


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


# The Triton kernels under the interpreter: the row-scale division (triton_adam._div_by_row) equals IEEE
# division through a fused tl.fma
_triton = pytest.mark.needs_fused_fma

# a partial last block (2100 = 16 x 128 + 52), a tensor below a block, whole blocks, one block and one
# element, an odd size: all in one launch
TRITON_SHAPES = [(300, 7), (5,), (128,), (1, 129), (3, 41)]


@_triton
@pytest.mark.parametrize("kw", [{}, dict(m_format="bf16", v_format="fp32"), dict(block_size=100, v_sqrt=True),
                                dict(rounding="stochastic", stochastic_flush=True)],
                         ids=["default", "dense moments", "block 100, sqrt v", "stochastic moments"])
def test_triton_kernel_rounds_the_weight_bit_identically_to_the_torch_path(kw, monkeypatch):
    """kernels="triton": every bf16 parameter of the group in one fused launch per step, weight and
    moments bit-identical to the torch path (the same seeds and counters), never the torch path.
    With stochastic moments the moments' bits differ by design (Philox vs torch's generator): only the
    weights' rounding bits must then agree, checked on the step's first update."""
    from fp8pass.kernels import triton_adam
    from fp8pass.optim import adam

    if kw.get("rounding") == "stochastic":  # moments rounded from different bits: compare one step
        a, oa = _run("torch", TRITON_SHAPES, steps=1, m_format="bf16", v_format="fp32")
        b, ob = _run("triton", TRITON_SHAPES, steps=1, m_format="bf16", v_format="fp32")
        _check_same(a, oa, b, ob)
    a, oa = _run("torch", TRITON_SHAPES, **kw)
    launches = []
    launch = triton_adam._launch
    monkeypatch.setattr(triton_adam, "_launch", lambda items, *a, **k: (
        launches.append(sorted(it[0].numel() for it in items)), launch(items, *a, **k)))
    monkeypatch.setattr(adam, "adam_step_torch", lambda *a, **k: pytest.fail("a tensor took the torch path"))
    b, ob = _run("triton", TRITON_SHAPES, **kw)
    assert launches == [sorted(n for n in (2100, 5, 128, 129, 123))] * 2
    if kw.get("rounding") != "stochastic":
        _check_same(a, oa, b, ob)


@_triton
def test_triton_kernel_uses_each_tensors_seed_and_first_counter():
    """The kernel entry point: per tensor its WeightSeed (seed, counter of its first element), several
    tensors and seeds in one launch; each equals adam_step_torch with the same WeightSeed, and a tensor
    with counter c equals the elements [c, c + n) of a larger tensor rounded at once."""
    from fp8pass.kernels.triton_adam import adam_step_triton_multi
    from fp8pass.optim.moments import MomentSpec, init_moment

    g = torch.Generator().manual_seed(1)
    m, v = MomentSpec("exp_avg", "e4m3", 64), MomentSpec("exp_avg_sq", "e5m2", 64)
    sizes, counters = (200, 64, 7, 130), (0, 1024, 2**31 - 5, 3)  # the third one's counters wrap past 2**31
    seeds = torch_step.draw_weight_seeds(len(sizes), torch.Generator().manual_seed(4), "cpu")
    hp = host_hyper_params(1e-2, 0.9, 0.999, 1e-8, 0.1, 3, True)

    def fresh(tensors):
        states = []
        for p in tensors:
            st = {}
            init_moment(st, m, p)
            init_moment(st, v, p)
            states.append(st)
        return [p.clone() for p in tensors], states

    weights = [torch.randn(n, generator=g).bfloat16() for n in sizes]
    grads = [(torch.randn(n, generator=g) * 0.1).bfloat16() for n in sizes]
    wseeds = [WeightSeed(seeds[j], c) for j, c in enumerate(counters)]
    (pa, sa), (pb, sb) = fresh(weights), fresh(weights)
    for p, gr, st, ws in zip(pa, grads, sa, wseeds):
        adam_step_torch(p, gr, st, m, v, hp, weight_seed=ws)
    adam_step_triton_multi(pb, grads, sb, [hp] * len(sizes), m, v, weight_seeds=wseeds)
    for p, q, s1, s2 in zip(pa, pb, sa, sb):
        assert torch.equal(p.view(torch.int16), q.view(torch.int16))
        for k in s1:
            assert torch.equal(s1[k].view(torch.uint8) if s1[k].dtype.itemsize == 1 else s1[k],
                               s2[k].view(torch.uint8) if s2[k].dtype.itemsize == 1 else s2[k])
    # counter 1024 of the second tensor: its elements are elements 1024.. of a larger tensor rounded at
    # once (whole blocks there too, so the same moments), with the same seed
    big_w = torch.cat([torch.randn(1024, generator=g).bfloat16(), weights[1]])
    big_g = torch.cat([torch.randn(1024, generator=g).bfloat16(), grads[1]])
    (big,), (big_st,) = fresh([big_w])
    adam_step_triton_multi([big], [big_g], [big_st], [hp], m, v, weight_seeds=[WeightSeed(seeds[1], 0)])
    assert torch.equal(big[1024:].view(torch.int16), pb[1].view(torch.int16))
    assert not torch.equal(big[:64].view(torch.int16), pb[1].view(torch.int16))
    with pytest.raises(ValueError, match="needs a bf16 parameter"):
        adam_step_triton_multi([torch.zeros(4)], [torch.zeros(4)], [sa[0]], [hp], m, v, weight_seeds=wseeds[:1])


@_triton
def test_wide_blocks_take_the_split_kernels_bit_identically(monkeypatch):
    """One scale per tensor, tensors wider than TRITON_MAX_BLOCK (made 256 here): the split-block
    kernels round the weight with the same bits, in one pair of launches for all wide tensors."""
    from fp8pass.kernels import triton_adam, triton_adam_split
    from fp8pass.optim import adam

    shapes = [(3, 100), (5,), (1000,), (16, 16), (7, 37)]  # 300, 1000, 259 wide; 5, 256 in the fused kernel
    a, oa = _run("torch", shapes, block_size=None)
    monkeypatch.setattr(adam, "TRITON_MAX_BLOCK", 256)
    monkeypatch.setattr(triton_adam, "MAX_SPAN", 128)
    launches = []
    split = triton_adam_split._launch_split
    monkeypatch.setattr(triton_adam_split, "_launch_split", lambda items, *a, **k: (
        launches.append(sorted(it[0].numel() for it in items)), split(items, *a, **k)))
    monkeypatch.setattr(adam, "adam_step_torch", lambda *a, **k: pytest.fail("a tensor took the torch path"))
    b, ob = _run("triton", shapes, block_size=None)
    assert launches == [[259, 300, 1000]] * 2
    _check_same(a, oa, b, ob)


@_triton
def test_triton_step_has_no_host_sync(monkeypatch):
    params, opt = _run("triton", TRITON_SHAPES, steps=1, capturable=True)

    def refuse(*a, **k):
        raise AssertionError("host synchronisation in the optimizer step")

    for p in params:
        p.grad = torch.full_like(p, 0.01)
    before = [p.detach().clone() for p in params]
    monkeypatch.setattr(torch.Tensor, "item", refuse)
    monkeypatch.setattr(torch.Tensor, "tolist", refuse)
    opt.step()
    monkeypatch.undo()
    assert all(not torch.equal(b, p) for b, p in zip(before, params))
