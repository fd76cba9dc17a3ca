"""Per-model stochastic-rounding streams (issue 33, item 8): a compiled model's stochastic gradient
casts draw from streams of its own (``fp8pass.runtime.sr``), seeded by ``Config.sr_seed`` and saved
with its scaling state, so models trained together in one process each reproduce their solo run."""

import io

import pytest
import torch
from torch import nn

import fp8pass
from fp8pass.runtime import sr
from fp8pass.scaling_state import attach

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
    with pytest.raises(fp8pass.integrity.CheckpointError, match=match):
        fp8pass.scaling_checks.check_model_state_dict(sd)


def test_the_stream_seed_is_the_same_hash_on_both_kernel_paths(monkeypatch):
    """``sr_draw_``: torch ops on the CPU family, one Triton launch on the CUDA path; the same seeds."""
    cases = torch.tensor([[0, 0], [2**31 - 1, 5], [123456789, 2**40 + 7], [42, 2**62 - 1]])
    seeds = {}
    for family in ("torch", "triton"):
        monkeypatch.setenv("FP8PASS_KERNELS", family)
        streams = cases.clone()
        seeds[family] = [int(torch.ops.fp8pass.sr_draw_(s)) for s in streams]
        assert torch.equal(streams[:, 1], cases[:, 1] + 1)  # each advanced by one draw
    assert seeds["torch"] == seeds["triton"]
    assert len(set(seeds["torch"])) == 4 and all(0 <= s < 2**31 for s in seeds["torch"])


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
