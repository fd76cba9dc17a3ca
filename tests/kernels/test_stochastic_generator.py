"""Per-model stochastic-rounding streams (issue 33, item 8): a compiled model's stochastic gradient
casts draw from streams of its own (``fp8pass.runtime.sr``), seeded by ``Config.sr_seed`` and saved
with its scaling state, so models trained together in one process each reproduce their solo run."""

import io

import pytest
import torch
from torch import nn

import fp8pass
from fp8pass.checkpoint import attach
from fp8pass.runtime import sr

D, H = 32, 64  # FP8 linears need dims >= Config.min_dim (16) and divisible by 16


class MLP(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.up = nn.Linear(D, H, bias=False)
        self.down = nn.Linear(H, D, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _cfg(seed, recipe=None, **kw):
    kw.setdefault("compiler", "aot_eager")
    return fp8pass.Config(recipe=recipe or fp8pass.CurrentScaling(), sr_seed=seed, **kw)


class Run:
    """A model, its compiled form and its own data: one SGD step per :meth:`step`."""

    def __init__(self, init: int, cfg: fp8pass.Config, data_seed: int, model: nn.Module | None = None):
        self.model = model if model is not None else MLP(init)
        self.compiled = torch.compile(self.model, backend=fp8pass.backend(cfg))
        self.data = torch.Generator().manual_seed(data_seed)
        self.grads: list[list[torch.Tensor]] = []

    def step(self):
        x = torch.randn(16, D, generator=self.data)
        for p in self.model.parameters():
            p.grad = None
        self.compiled(x).square().mean().backward()
        self.grads.append([p.grad.clone() for p in self.model.parameters()])
        with torch.no_grad():
            for p in self.model.parameters():
                p -= 0.1 * p.grad

    def weights(self):
        return [p.detach().clone() for p in self.model.parameters()]


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_two_models_trained_interleaved_each_reproduce_their_solo_run(kernels, recipe):
    make = (lambda: fp8pass.DelayedScaling()) if recipe == "delayed" else (lambda: fp8pass.CurrentScaling())
    torch._dynamo.reset()
    alone = Run(0, _cfg(11, make()), data_seed=100)
    for _ in range(3):
        alone.step()
    torch._dynamo.reset()
    torch.manual_seed(1234)  # the global generator is in another state: it must not matter
    a, b = Run(0, _cfg(11, make()), data_seed=100), Run(1, _cfg(22, make()), data_seed=200)
    for _ in range(3):
        b.step()  # b's casts first: with a shared generator they would shift a's bits
        a.step()
        torch.randn(7)  # and the user's own draws in between
    assert all(_same(ga, gb) for ga, gb in zip(alone.grads, a.grads))
    assert _same(alone.weights(), a.weights())
    # the streams did advance (one draw per backward of each FP8 weight) and were used
    streams = [sr._REGISTRY[p].stream for p in a.model.parameters()]
    assert [int(s[1]) for s in streams] == [3, 3]
    assert len({int(s[0]) for s in streams}) == 2  # each weight has its own key


def test_a_different_sr_seed_rounds_differently_and_nearest_rounding_has_no_stream(kernels):
    torch._dynamo.reset()
    r1, r2 = Run(0, _cfg(1), data_seed=5), Run(0, _cfg(2), data_seed=5)
    r1.step()
    r2.step()
    # the same weights and data: only the rounding bits of the gradient casts differ
    assert not _same(r1.grads[0], r2.grads[0])
    cos = torch.nn.functional.cosine_similarity(r1.grads[0][0].flatten(), r2.grads[0][0].flatten(), dim=0)
    assert cos > 0.95  # both are the same gradient up to rounding noise
    torch._dynamo.reset()
    near = Run(0, _cfg(1, grad_stochastic_rounding=False), data_seed=5)
    near.step()
    assert all(sr._REGISTRY.get(p) is None for p in near.model.parameters())
    assert not any(".fp8_sr." in k for k in near.model.state_dict())


def test_without_sr_seed_the_seed_comes_from_torch_global_generator_once(kernels):
    def first_grads():
        torch._dynamo.reset()
        torch.manual_seed(3)
        r = Run(0, _cfg(None), data_seed=5)
        r.step()
        return r.grads[0], [int(sr._REGISTRY[p].stream[0]) for p in r.model.parameters()]

    (g1, k1), (g2, k2) = first_grads(), first_grads()
    assert k1 == k2 and _same(g1, g2)


def test_save_and_load_resumes_the_same_streams(kernels):
    torch._dynamo.reset()
    full = Run(0, _cfg(7), data_seed=9)
    for _ in range(2):
        full.step()
    buf = io.BytesIO()
    torch.save(full.model.state_dict(), buf)
    data_state = full.data.get_state()
    for _ in range(2):
        full.step()

    torch._dynamo.reset()
    model = MLP(5)  # other weights, not yet compiled: everything comes from the checkpoint
    attach(model, _cfg(7))
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    assert sorted(k for k in sd if ".fp8_sr." in k) == ["down.weight.fp8_sr.stream", "up.weight.fp8_sr.stream"]
    assert all(int(sd[k][1]) == 2 for k in sd if ".fp8_sr." in k)
    model.load_state_dict(sd)
    resumed = Run(0, _cfg(7), data_seed=0, model=model)
    resumed.data.set_state(data_state)
    for _ in range(2):
        resumed.step()
    assert all(_same(a, b) for a, b in zip(full.grads[2:], resumed.grads))
    assert _same(full.weights(), resumed.weights())


def test_a_loaded_stream_replaces_the_live_one_of_a_compiled_model(kernels):
    """Loading into a model that has trained (its graphs hold the stream tensors) rewinds its streams."""
    torch._dynamo.reset()
    run = Run(0, _cfg(7), data_seed=9)
    run.step()
    sd = {k: v.clone() for k, v in run.model.state_dict().items()}
    data_state = run.data.get_state()
    run.step()
    second = run.grads[1]
    with torch.no_grad():
        run.model.load_state_dict(sd)
    run.data.set_state(data_state)
    run.step()
    assert _same(second, run.grads[2])


def test_single_file_checkpoint_carries_the_streams(tmp_path, kernels):
    torch._dynamo.reset()
    run = Run(0, _cfg(3), data_seed=1)
    run.step()
    path = tmp_path / "ck.pt"
    fp8pass.checkpoint.save(path, run.model)
    model = MLP(0)
    fp8pass.checkpoint.load(path, model, config=_cfg(3))
    assert {n: sr._REGISTRY[p].stream.tolist() for n, p in model.named_parameters()} == \
        {n: sr._REGISTRY[p].stream.tolist() for n, p in run.model.named_parameters()}


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True, 2**63, [1]])
def test_sr_seed_is_validated(bad):
    with pytest.raises(ValueError, match=r"Config\.sr_seed must be an int"):
        fp8pass.Config(sr_seed=bad)


@pytest.mark.parametrize("stream,match", [
    (torch.tensor([-1, 0]), r"up\.weight\.fp8_sr\.stream: a stream key in \[0, 2147483648\), got -1"),
    (torch.tensor([2**31, 0]), r"a stream key in \[0, 2147483648\)"),
    (torch.tensor([5, -3]), r"a draw count in \[0, 4611686018427387904\), got -3"),
    (torch.tensor([5, 0, 1]), r"shape \(3,\)"),
    (torch.tensor([5.0, 0.0]), r"expected an integer tensor"),
    (torch.tensor([5, 0], dtype=torch.int32), r"expected an int64 tensor"),
])
def test_a_bad_saved_stream_is_refused_naming_its_key(stream, match):
    model = MLP(0)
    attach(model, _cfg(1))
    sd = dict(model.state_dict(), **{"up.weight.fp8_sr.stream": stream})
    with pytest.raises(RuntimeError, match=match):
        model.load_state_dict(sd)
    assert sr._REGISTRY.get(model.up.weight) is None  # nothing was loaded
    with pytest.raises(fp8pass.checkpoint.CheckpointError, match=match):
        fp8pass.checkpoint.check_model_state_dict(sd)


def test_the_stream_seed_is_the_same_hash_on_both_kernel_paths(monkeypatch):
    """``sr_draw_``: torch ops on the CPU family, one Triton launch on the CUDA path; the same seeds."""
    cases = torch.tensor([[0, 0], [2**31 - 1, 5], [123456789, 2**40 + 7], [42, 2**62 - 3]])
    seeds, pairs = {}, {}
    for family in ("torch", "triton"):
        monkeypatch.setenv("FP8PASS_KERNELS", family)
        streams = cases.clone()
        seeds[family] = [int(torch.ops.fp8pass.sr_draw_(s)) for s in streams]
        assert torch.equal(streams[:, 1], cases[:, 1] + 1)  # each advanced by one draw
        pairs[family] = [torch.ops.fp8pass.sr_draw_(s, 2).tolist() for s in streams]  # two draws, one launch
        assert torch.equal(streams[:, 1], cases[:, 1] + 3)
    assert seeds["torch"] == seeds["triton"]
    assert len(set(seeds["torch"])) == 4 and all(0 <= s < 2**31 for s in seeds["torch"])
    assert pairs["torch"] == pairs["triton"]
    # draws 1 and 2 of each stream: what two single draws would have given
    single = [sr.mix_seed(c[:1], c[1:] + torch.tensor([1, 2])).tolist() for c in cases]
    assert pairs["torch"] == single


def test_stream_keys_differ_per_ordinal_and_seed():
    keys = {sr.stream_key(s, i) for s in range(4) for i in range(64)}
    assert len(keys) == 256 and all(0 <= k < sr.KEY_LIMIT for k in keys)
    assert sr.stream_key(9, 3) == sr.stream_key(9, 3)


@pytest.mark.parametrize("compiled_before_load", [True, False])
def test_dcp_checkpoint_carries_the_streams(tmp_path, compiled_before_load):
    """``fp8pass.distributed.save_checkpoint`` / ``load_checkpoint`` (one process): the loaded model
    draws what the saved one would have drawn next, also when it had not compiled before the load."""
    torch._dynamo.reset()
    run = Run(0, _cfg(8), data_seed=3)
    run.step()
    fp8pass.distributed.save_checkpoint(tmp_path / "ck", run.model)
    data_state = run.data.get_state()
    run.step()

    torch._dynamo.reset()
    model = MLP(4)
    other = Run(0, _cfg(8), data_seed=0, model=model)
    if compiled_before_load:
        other.step()  # the model's own streams exist (and have advanced): the load must replace them
    fp8pass.distributed.load_checkpoint(tmp_path / "ck", model, config=_cfg(8))
    assert [sr._REGISTRY[p].stream.tolist() for p in model.parameters()] == \
        [[int(s[0]), 1] for s in (sr._REGISTRY[p].stream for p in run.model.parameters())]
    other.data.set_state(data_state)
    other.step()
    assert _same(run.grads[1], other.grads[-1])


E = 4  # experts of the grouped model


class GroupedSwiGLU(nn.Module):
    """torchtitan-style MoE experts (``torch._grouped_mm`` over rows sorted by expert, SwiGLU, bf16
    compute over fp32 master weights): one ``fp8_grouped_linear`` per projection and one
    ``fp8_grouped_swiglu_down`` once compiled. Every batch of 16 rows is split 5, 7, 0 (an empty
    expert) and 4."""

    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w1 = nn.Parameter(torch.randn(E, H, D, generator=g) * D ** -0.5)
        self.w3 = nn.Parameter(torch.randn(E, H, D, generator=g) * D ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E, D, H, generator=g) * H ** -0.5)
        self.register_buffer("counts", torch.tensor([5, 7, 0, 4]), persistent=False)

    def forward(self, x):
        offs = torch.cumsum(self.counts, dim=0, dtype=torch.int32)
        gmm = torch._grouped_mm
        h = torch.nn.functional.silu(gmm(x.bfloat16(), self.w1.bfloat16().transpose(-2, -1), offs=offs))
        h = h * gmm(x.bfloat16(), self.w3.bfloat16().transpose(-2, -1), offs=offs)
        return gmm(h, self.w2.bfloat16().transpose(-2, -1), offs=offs).type_as(x)


def test_grouped_experts_trained_interleaved_each_reproduce_their_solo_run(kernels):
    """The grouped MoE ops' stochastic gradient casts draw from one stream per expert stack."""
    def run(init, seed, data_seed):
        return Run(0, _cfg(seed), data_seed=data_seed, model=GroupedSwiGLU(init))

    torch._dynamo.reset()
    alone = run(0, 11, 100)
    for _ in range(2):
        alone.step()
    torch._dynamo.reset()
    torch.manual_seed(1234)
    a, b = run(0, 11, 100), run(1, 22, 200)
    for _ in range(2):
        b.step()
        a.step()
        torch.randn(7)
    assert all(_same(ga, gb) for ga, gb in zip(alone.grads, a.grads))
    assert _same(alone.weights(), a.weights())
    streams = {n: sr._REGISTRY[p].stream for n, p in a.model.named_parameters()}
    assert sorted(streams) == ["w1", "w2", "w3"]
    assert [int(s[1]) for s in streams.values()] == [2, 2, 2]  # one draw per backward of each stack
    assert len({int(s[0]) for s in streams.values()}) == 3
    assert sorted(k for k in a.model.state_dict() if ".fp8_sr." in k) == \
        ["w1.fp8_sr.stream", "w2.fp8_sr.stream", "w3.fp8_sr.stream"]


@pytest.mark.parametrize("name", ["e5m2", "e4m3"])
def test_row_casts_take_a_streams_seed_on_both_kernel_modules(name):
    """The grouped ops' stochastic per-expert gradient cast (``cast_rows``) with a stream's seed: the
    codes of that seed (not of torch's generator) on the CPU module, compiled or eager, with the GEMM
    values or without, and the same codes on the CUDA module's eager cast."""
    from fp8pass.kernels import cpu, cuda
    from fp8pass.numerics import get_format

    fmt = get_format(name)
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(64, cpu.MIN_COMPILED // 32, generator=g) * 20).to(torch.bfloat16)
    rs = torch.rand(64, generator=g) * 8 + 0.5
    seed = torch.tensor([123456789])
    want = cpu._cast_rows_sr_math(x, rs, seed.reshape(()).to(torch.int32), fmt.max, fmt.mbits, fmt.emin,
                                  fmt.torch_dtype).view(torch.uint8)
    torch.manual_seed(0)
    got = cpu.cast_rows(x, rs, fmt, "stochastic", seed=seed)  # compiled loop (>= MIN_COMPILED elements)
    torch.manual_seed(1)  # the global generator's state does not matter
    assert torch.equal(cpu.cast_rows(x, rs, fmt, "stochastic", seed=seed).view(torch.uint8), want)
    assert torch.equal(got.view(torch.uint8), want)
    assert torch.equal(cpu.cast_rows(x[:4], rs[:4], fmt, "stochastic", seed=seed).view(torch.uint8), want[:4])  # eager
    values = cpu.cast_rows(x, rs, fmt, "stochastic", up=torch.bfloat16, keep_codes=False, seed=seed)
    assert torch.equal(values.view(torch.int16), cpu.upcast(got, torch.bfloat16).view(torch.int16))
    assert torch.equal(cuda.cast_rows(x, rs, fmt, "stochastic", seed=seed).view(torch.uint8), want)
    other = cpu.cast_rows(x, rs, fmt, "stochastic", seed=seed + 1)
    assert not torch.equal(other.view(torch.uint8), want)


# ---- row, block and MX granularity, and NVFP4: every stochastic gradient cast draws from the stream ----

KINDS = ("row", "block", "mx", "nvfp4")
DRAWS = {"row": 1, "block": 1, "mx": 2, "nvfp4": 2}  # seeds per backward: MX and NVFP4 cast dy twice


def _kind_cfg(seed, kind: str) -> fp8pass.Config:
    if kind == "nvfp4":
        return _cfg(seed, fp8pass.NVFP4Scaling())  # RHT, 2-D weight blocks, stochastic gradients
    return _cfg(seed, fp8pass.CurrentScaling(granularity=kind, block=32 if kind == "mx" else 16))


@pytest.mark.parametrize("family,kind", [("torch", k) for k in KINDS] + [("triton", "row")] + [
    pytest.param("triton", k, marks=pytest.mark.slow) for k in ("block", "mx", "nvfp4")])  # 10-25 s each
def test_other_granularities_and_nvfp4_trained_interleaved_reproduce_their_solo_run(monkeypatch, family, kind):
    monkeypatch.setenv("FP8PASS_KERNELS", family)
    torch._dynamo.reset()
    alone = Run(0, _kind_cfg(11, kind), data_seed=100)
    for _ in range(2):
        alone.step()
    torch._dynamo.reset()
    torch.manual_seed(1234)  # the global generator is in another state: it must not matter
    a, b = Run(0, _kind_cfg(11, kind), data_seed=100), Run(1, _kind_cfg(22, kind), data_seed=200)
    for _ in range(2):
        b.step()
        a.step()
        torch.randn(7)
    assert all(_same(ga, gb) for ga, gb in zip(alone.grads, a.grads))
    assert _same(alone.weights(), a.weights())
    # every backward drew its seeds from each weight's stream: 1 (row, block) or 2 (MX, NVFP4) per step
    assert [int(sr._REGISTRY[p].stream[1]) for p in a.model.parameters()] == [2 * DRAWS[kind]] * 2
    torch._dynamo.reset()
    other = Run(0, _kind_cfg(12, kind), data_seed=100)
    other.step()
    assert not _same(other.grads[0], alone.grads[0])  # another sr_seed, other rounding bits


@pytest.mark.parametrize("kind", ["mx", "nvfp4"])
def test_other_granularities_and_nvfp4_trained_in_two_threads_reproduce_their_solo_run(kind):
    import threading

    torch._dynamo.reset()
    solo = {}
    for init, seed, data in ((0, 11, 100), (1, 22, 200)):
        r = Run(init, _kind_cfg(seed, kind), data_seed=data)
        for _ in range(2):
            r.step()
        solo[seed] = r
    torch._dynamo.reset()
    runs = {seed: Run(init, _kind_cfg(seed, kind), data_seed=data) for init, seed, data in ((0, 11, 100), (1, 22, 200))}
    errors = []

    def train(r):
        try:
            for _ in range(2):
                r.step()
        except Exception as e:  # reported below: a thread's exception does not fail the test by itself
            errors.append(e)

    threads = [threading.Thread(target=train, args=(r,)) for r in runs.values()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for seed, r in runs.items():
        assert all(_same(ga, gb) for ga, gb in zip(solo[seed].grads, r.grads))
        assert _same(solo[seed].weights(), r.weights())


@pytest.mark.parametrize("kind", ["row", "mx", "nvfp4"])
@pytest.mark.parametrize("via", ["state_dict", "scaling_state_dict"])
def test_other_granularities_and_nvfp4_resume_the_same_streams(kind, via):
    """A model resumed from its state (``model.state_dict()`` or ``fp8pass.scaling_state_dict`` + the
    weights) draws the bits the uninterrupted run drew."""
    torch._dynamo.reset()
    full = Run(0, _kind_cfg(7, kind), data_seed=9)
    full.step()
    weights = {k: v.clone() for k, v in full.model.state_dict().items() if ".fp8_" not in k}
    saved = ({k: v.clone() for k, v in full.model.state_dict().items()} if via == "state_dict"
             else fp8pass.scaling_state_dict(full.model))
    data_state = full.data.get_state()
    full.step()

    torch._dynamo.reset()
    model = MLP(5)
    if via == "state_dict":
        attach(model, _kind_cfg(7, kind))
        model.load_state_dict(saved)
    else:
        assert sorted(saved) == ["down.weight.sr.stream", "up.weight.sr.stream"]
        model.load_state_dict(weights)
        fp8pass.load_scaling_state_dict(model, saved, config=_kind_cfg(7, kind))
    assert [int(sr._REGISTRY[p].stream[1]) for p in model.parameters()] == [DRAWS[kind]] * 2
    resumed = Run(0, _kind_cfg(7, kind), data_seed=0, model=model)
    resumed.data.set_state(data_state)
    resumed.step()
    assert _same(full.grads[1], resumed.grads[0])
    assert _same(full.weights(), resumed.weights())


def test_scaling_state_dict_carries_streams_beside_delayed_state_and_load_checks_them():
    torch._dynamo.reset()
    run = Run(0, _cfg(3, fp8pass.DelayedScaling()), data_seed=1)
    run.step()
    sd = fp8pass.scaling_state_dict(run.model)
    assert sorted(k for k in sd if k.endswith(".sr.stream")) == ["down.weight.sr.stream", "up.weight.sr.stream"]
    assert any(k.endswith(".grad_output.scale") for k in sd)
    stream = sr._REGISTRY[run.model.up.weight].stream
    assert torch.equal(sd["up.weight.sr.stream"], stream) and sd["up.weight.sr.stream"] is not stream  # a copy
    before = stream.clone()
    bad = dict(sd, **{"up.weight.sr.stream": torch.tensor([5, -1])})
    with pytest.raises(fp8pass.checkpoint.CheckpointError, match=r"up\.weight\.sr\.stream: a draw count"):
        fp8pass.load_scaling_state_dict(run.model, bad, config=_cfg(3, fp8pass.DelayedScaling()))
    assert torch.equal(stream, before)
    without = {k: v for k, v in sd.items() if k != "down.weight.sr.stream"}
    with pytest.raises(KeyError, match=r"missing keys \(weights with a stochastic-rounding stream.*down\.weight"):
        fp8pass.load_scaling_state_dict(run.model, without, config=_cfg(3, fp8pass.DelayedScaling()))
    with pytest.raises(KeyError, match=r"unexpected keys.*nope\.weight\.sr\.stream"):
        fp8pass.load_scaling_state_dict(run.model, dict(sd, **{"nope.weight.sr.stream": torch.tensor([1, 0])}),
                                        config=_cfg(3, fp8pass.DelayedScaling()))
    rewound = dict(sd, **{"up.weight.sr.stream": torch.tensor([int(before[0]), 0])})
    with pytest.raises(ValueError, match=r"CurrentScaling, which keeps no scaling state besides the stochastic-"
                                         r"rounding streams.*down\.weight\.grad_output"):
        fp8pass.load_scaling_state_dict(run.model, rewound, config=_cfg(3))
    assert torch.equal(stream, before)  # the streams load last: nothing was loaded
    fp8pass.load_scaling_state_dict(run.model, without, config=_cfg(3, fp8pass.DelayedScaling()), strict=False)
    # the streams are in the file the trainer validates too
    fp8pass.checkpoint.check_scaling_state_dict(sd, {n: p.shape for n, p in run.model.named_parameters()},
                                                    kinds=("delayed",))
    with pytest.raises(fp8pass.checkpoint.CheckpointError, match=r"up\.weight\.sr\.stream: a stream key"):
        fp8pass.checkpoint.check_scaling_state_dict({"up.weight.sr.stream": torch.tensor([-2, 0])},
                                                        {"up.weight": (64, 32)}, kinds=())


def test_the_public_op_with_a_stream_draws_from_it_at_every_granularity():
    """``torch.ops.fp8pass.fp8_linear`` given ``sr_stream``: the stream's bits, not torch's generator's."""
    from fp8pass.op_schema import LinearKnobs

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(16, 64, generator=g), torch.randn(32, 64, generator=g)
    dy = torch.randn(16, 32, generator=g)
    for gran, draws in (("tensor", 1), ("row", 1), ("block", 1), ("mx", 2)):
        knobs = LinearKnobs("e4m3", "e5m2", gran, 32, False, "stochastic", 0.0, 1, "max", None, True)
        grads = []
        for rng in (1, 2):
            torch.manual_seed(rng)
            stream = torch.tensor([77, 0])
            wp = w.clone().requires_grad_()
            torch.ops.fp8pass.fp8_linear(x, wp, None, [], [], [], stream, *knobs.args())[0].backward(dy)
            grads.append(wp.grad)
            assert stream.tolist() == [77, draws], gran
        assert torch.equal(grads[0], grads[1]), gran


@pytest.mark.parametrize("family,case", [("torch", c) for c in ("tensor", "row", "block", "mx", "e2m1")] + [
    ("triton", c) for c in ("tensor", "mx", "e2m1")])  # Triton: the flat cast, the tile cast, packed tiles
def test_quantize_with_a_seed(monkeypatch, family, case):
    """``fp8pass.quantize(seed=)``: the seed's codes whatever torch's generator did, other codes for
    another seed, unbiased (the mean of many stochastic casts is the value)."""
    monkeypatch.setenv("FP8PASS_KERNELS", family)
    fmt = "e2m1" if case == "e2m1" else "e5m2"
    gran = "block" if case == "e2m1" else case
    kw = dict(granularity=gran, rounding="stochastic", block=(1, 16) if gran == "block" else None)
    x = torch.full((16, 64), 1.1) * torch.linspace(0.5, 1.5, 64)  # between grid points, no tile max clipped
    q = fp8pass.quantize(x, fmt, seed=torch.tensor([5]), **kw)
    torch.manual_seed(9)
    assert torch.equal(fp8pass.quantize(x, fmt, seed=torch.tensor([5]), **kw).data.view(torch.uint8),
                       q.data.view(torch.uint8))
    assert not torch.equal(fp8pass.quantize(x, fmt, seed=torch.tensor([6]), **kw).data.view(torch.uint8),
                           q.data.view(torch.uint8))
    mean = torch.stack([fp8pass.quantize(x, fmt, seed=torch.tensor([s]), **kw).dequantize() for s in range(24)]).mean(0)
    near = fp8pass.quantize(x, fmt, granularity=gran, block=kw["block"]).dequantize()
    assert (mean - x).abs().mean() < 0.5 * (near - x).abs().mean()  # unbiased: far closer than nearest rounding


def test_quantize_refuses_a_bad_seed():
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match="generator= or seed=.*not both"):
        fp8pass.quantize(x, "e5m2", rounding="stochastic", generator=torch.Generator(), seed=torch.tensor([1]))
    for bad in (3, torch.tensor([1, 2]), torch.tensor([1], dtype=torch.int32), torch.tensor(1.0)):
        with pytest.raises(TypeError, match="seed must be an int64 tensor of one element"):
            fp8pass.quantize(x, "e5m2", rounding="stochastic", seed=bad)
    with pytest.raises(ValueError, match="seed is on meta, x on cpu"):
        fp8pass.quantize(x, "e5m2", rounding="stochastic", seed=torch.tensor([1], device="meta"))


def test_a_backward_given_fewer_seeds_than_casts_refuses():
    with pytest.raises(ValueError, match=r"casts the gradient 2 times and needs 2 stochastic-rounding seeds"):
        sr.seed_of(torch.tensor([3]), 1)
    assert sr.seed_of(None, 1) is None
    with pytest.raises(ValueError, match=r"n must be in \[1, 2\], got 3"):
        torch.ops.fp8pass.sr_draw_(torch.tensor([1, 0]), 3)


def test_the_torch_familys_seeded_cast_is_the_cpu_modules_one():
    """One counter hash for the CPU's stochastic casts: a seeded per-tensor cast of the torch family
    (``quantize``, row/block/MX's element cast) gives the CPU module's fused cast's codes."""
    from fp8pass.kernels import cpu, torch_family
    from fp8pass.numerics import get_format

    x = torch.randn(4096, generator=torch.Generator().manual_seed(1)) * 30
    seed, scale = torch.tensor([424242]), torch.tensor(3.5)
    for name in ("e4m3", "e5m2"):
        fmt = get_format(name)
        want, _ = cpu.cast_stochastic(x, scale, fmt, seed=seed)
        got, _ = torch_family.cast_scaled(x, scale, fmt, "stochastic", seed=seed)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


class GLU(nn.Module):
    """A SwiGLU MLP: ``swiglu_down`` once compiled (its row/block gradient cast takes the down weight's seed)."""

    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.gate, self.up = nn.Linear(D, H, bias=False), nn.Linear(D, H, bias=False)
        self.down = nn.Linear(H, D, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)

    def forward(self, x):
        return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


@pytest.mark.parametrize("kind", ["row", "block"])
def test_glus_of_other_granularities_trained_interleaved_reproduce_their_solo_run(kind):
    def run(init, seed, data):
        return Run(0, _kind_cfg(seed, kind), data_seed=data, model=GLU(init))

    torch._dynamo.reset()
    report = fp8pass.explain(GLU(0), torch.randn(16, D), config=_kind_cfg(11, kind))
    assert len(report.swiglus) == 1  # the GLU is rewritten as one (swiglu_down), not three linears
    alone = run(0, 11, 100)
    for _ in range(2):
        alone.step()
    torch._dynamo.reset()
    torch.manual_seed(1234)
    a, b = run(0, 11, 100), run(1, 22, 200)
    for _ in range(2):
        b.step()
        a.step()
        torch.randn(7)
    assert all(_same(ga, gb) for ga, gb in zip(alone.grads, a.grads))
    assert [int(sr._REGISTRY[p].stream[1]) for p in a.model.parameters()] == [2, 2, 2]
