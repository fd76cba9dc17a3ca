"""Precision switches inside a run (issue 30 item 4): ``fp8pass.switch_precision``.

A switch re-plans each compiled graph at the model's next call and compiles it again only when its
rewrite changed (counted by ``Backend.compiles``); the weights that stay FP8 keep their scaling state
(the same state objects, their histories continued, not restarted); the history travels in
``model.state_dict()``; bad input fails with a message saying what to do.
"""

import warnings

import pytest
import torch

import fp8pass
from fp8pass import Config, DelayedScaling, Rule
from fp8pass.checkpoint import CheckpointError
from fp8pass.runtime.state import _REGISTRY
from fp8pass.train import ModelConfig, TinyLlama

X = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
Y = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
LAYER0 = [f"layers.0.{m}.weight" for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                          "self_attn.o_proj")]


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setenv("FP8PASS_CPU_FUSED", "0")  # the runtime's eager casts: same bits, no compile
    torch._dynamo.reset()


def _model(seed=0):
    torch.manual_seed(seed)
    return TinyLlama(ModelConfig(d_model=64, n_layers=2, n_heads=2, ffn=128))


def _step(fwd, model, lr=1e-2):
    fwd(X, Y).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
            p.grad = None


def _fp8_calls(be) -> int:
    code = be.records[-1].report.graph_after
    return code.count("torch.ops.fp8pass.fp8_linear") + code.count("torch.ops.fp8pass.swiglu")


def test_switch_recompiles_once_and_keeps_the_state_of_untouched_weights():
    cfg = Config(compiler="aot_eager", sr_seed=0)
    a, b = _model(), _model()
    be_a, be_b = fp8pass.backend(cfg), fp8pass.backend(cfg)
    fa, fb = torch.compile(a, backend=be_a), torch.compile(b, backend=be_b)
    for _ in range(2):
        _step(fa, a)
        _step(fb, b)
    assert (be_a.compiles, be_a.compiles) == (1, 1)
    fp8_before = _fp8_calls(be_a)
    state = {n: _REGISTRY[p] for n, p in a.named_parameters() if p in _REGISTRY}
    hist = {n: {r: s.amax_history.clone() for r, s in st.roles().items()} for n, st in state.items()}

    sw = fp8pass.switch_precision(fa, [Rule("layers.1.*", "high")], reason="layer 1 high", step=2)
    assert (sw.step, sw.reason, sw.rules) == (2, "layer 1 high", (Rule("layers.1.*", "high"),))
    assert be_a.compiles == 1  # nothing happens before the model's next call
    dynamo_graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert dynamo_graphs >= 2  # the counter counts: fa's graph and fb's
    _step(fa, a)
    _step(fb, b)
    assert be_a.compiles == 2  # one recompile of the model's one graph, by the backend:
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == dynamo_graphs  # Dynamo sees no change
    assert _fp8_calls(be_a) < fp8_before
    skipped = dict(be_a.records[-1].report.skipped)
    assert skipped["layers.1.self_attn.q_proj.weight"] == "kept in high precision by rules[0] 'layers.1.*' -> high"

    params, twin = dict(a.named_parameters()), dict(b.named_parameters())
    for n in LAYER0:  # layer 0 stays FP8: the same state objects, their histories continued, not restarted
        st = _REGISTRY[params[n]]
        assert st is state[n]
        for role, s in st.roles().items():
            assert int(s.steps) == 3
            assert torch.equal(s.amax_history[..., 1:3], hist[n][role][..., 0:2])
        # the step after the switch recorded in layer 0's forward roles what the unswitched twin recorded
        # (the same inputs and weights; only layer 1 changed precision)
        other = _REGISTRY[twin[n]]
        assert torch.equal(st.weight.amax_history, other.weight.amax_history)
        assert torch.equal(st.input.amax_history, other.input.amax_history)
        assert torch.equal(st.weight.scale, other.weight.scale) and torch.equal(st.input.scale, other.input.scale)
    # layer 1 left FP8: its state stays as it was at the switch (ready if it comes back)
    left = _REGISTRY[params["layers.1.self_attn.q_proj.weight"]]
    assert int(left.input.steps) == 2
    for _ in range(2):
        _step(fa, a)
    assert be_a.compiles == 2  # no compile after the switch's one
    assert int(left.input.steps) == 2
    # a weight keeps its delayed recipe: another one is refused, naming the weight, and nothing is recorded
    with pytest.raises(ValueError, match=r"gives layers.0.self_attn.q_proj.weight the delayed recipe "
                                         r"DelayedScaling\(history_len=1024.*a weight keeps one delayed recipe"):
        fp8pass.switch_precision(fa, [Rule("layers.0.*", "delayed")])
    assert len(fp8pass.precision_switches(a)) == 1


class BreakingLayer(torch.nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.q_proj = torch.nn.Linear(d, d, bias=False)
        self.o_proj = torch.nn.Linear(d, d, bias=False)

    def forward(self, x):
        x = self.q_proj(x)
        torch._dynamo.graph_break()  # each layer's halves are frames Dynamo reuses for every layer
        return self.o_proj(x)


class Stack(torch.nn.Module):
    def __init__(self, n=4):
        super().__init__()
        self.layers = torch.nn.ModuleList(BreakingLayer() for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_switch_compiles_only_the_graphs_whose_rewrite_changed():
    """Graph breaks: Dynamo reuses each layer's two frames for all four layers. Switching one layer costs
    one compile per graph of that layer; switching it back to the plan it had costs none."""
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(2, 3, 32)
    be = fp8pass.backend(Config(min_dim=16, compiler="eager", grad_stochastic_rounding=False))
    fwd = torch.compile(model, backend=be)
    for _ in range(2):
        fwd(x).sum().backward()
    assert be.compiles == 3  # the model's frame and the layer's two halves
    fp8pass.switch_precision(model, [Rule("layers.1.*", "high")])
    for _ in range(2):
        fwd(x).sum().backward()
    assert be.compiles == 5  # layer 1's two graphs, once
    kept = {w for r in be.records[-8:] for w, why in r.report.skipped if "rules[0]" in why}
    assert kept == {"layers.1.q_proj.weight", "layers.1.o_proj.weight"}
    fp8pass.switch_precision(model, [Rule("layers.1.*", DelayedScaling())])  # back to its first plan
    fwd(x).sum().backward()
    assert be.compiles == 5
    assert [len(s.rules) for s in fp8pass.precision_switches(model)] == [1, 1]


def test_history_in_state_dict_and_in_place_compile(tmp_path):
    """model.compile(backend="fp8") in place: the switch applies, and the history saves and loads with the
    model's state dict (so checkpoints carry it) into a fresh model."""
    m = _model()
    m.compile(backend="fp8")
    with pytest.raises(ValueError, match="not compiled with the fp8 backend"):
        fp8pass.switch_precision(_model(1), [Rule("*", "high")])
    fp8pass.switch_precision(m, [Rule("layers.0.*", "blockwise", backward="high")], reason="a", step=0)
    fp8pass.switch_precision(m, [Rule("*.o_proj", fp8pass.CurrentScaling(granularity="row")),
                                 Rule("*", Config.from_recipe("paper", smooth_swiglu="token"))], reason="b")
    sd = m.state_dict()
    assert sd["fp8_precision_switches"].dtype == torch.uint8
    fresh = _model(1)
    fp8pass.checkpoint.attach(fresh)  # what fp8pass.checkpoint.load / the trainer do before loading
    fresh.load_state_dict(sd)
    got, want = fp8pass.precision_switches(fresh), fp8pass.precision_switches(m)
    assert [(s.step, s.reason) for s in got] == [(0, "a"), (None, "b")]
    cfg = Config()
    for g, w in zip(got, want):  # the same rules: names as names, objects as equal objects
        assert [r.pattern for r in g.rules] == [r.pattern for r in w.rules]
        assert [r.site_config(cfg) if r.recipe != "high" else r for r in g.rules] == \
               [r.site_config(cfg) if r.recipe != "high" else r for r in w.rules]
    assert got[0].rules[0] == Rule("layers.0.*", "blockwise", backward="high")
    # explain plans with the switches' rules first (newest first)
    rep = fp8pass.explain(m, X)
    assert "(rules[0] '*.o_proj' -> CurrentScaling(" in rep.decided_by["layers.0.self_attn.o_proj.weight"]
    assert "(rules[1] '*' -> Config(DelayedScaling, e4m3/e5m2))" in rep.decided_by["layers.0.self_attn.q_proj.weight"]
    assert any("2 precision switch(es)" in n for n in rep.notes)
    # fp8pass.checkpoint.save / load carry it; a damaged one is refused naming the key, before anything loads
    fp8pass.checkpoint.save(tmp_path / "ck.pt", m)
    again = _model(2)
    fp8pass.checkpoint.load(tmp_path / "ck.pt", again)
    assert [(s.step, s.reason) for s in fp8pass.precision_switches(again)] == [(0, "a"), (None, "b")]
    bad = {**sd, "fp8_precision_switches": torch.tensor([1, 2, 3], dtype=torch.uint8)}
    with pytest.raises(CheckpointError, match="fp8_precision_switches: not the JSON of a precision-switch history"):
        fp8pass.load_checkpoint_state(_model(2), None, {"model": bad, "optimizer": None,
                                                        "rng": fp8pass.checkpoint.torch_rng_state()})
    # a model that is not to train in FP8 loads the state dict without it
    assert "fp8_precision_switches" not in fp8pass.checkpoint.without_scaling_state(sd)


def test_bad_switches_fail_clearly():
    m = _model()
    f = torch.compile(m, backend=fp8pass.backend(Config(compiler="aot_eager")))
    with pytest.raises(TypeError, match="non-empty list of fp8pass.Rule"):
        fp8pass.switch_precision(f, Rule("*", "high"))
    with pytest.raises(TypeError, match="non-empty list of fp8pass.Rule"):
        fp8pass.switch_precision(f, [])
    with pytest.raises(TypeError, match=r"rules\[1\] must be an fp8pass.Rule"):
        fp8pass.switch_precision(f, [Rule("*", "high"), ("*", "high")])
    with pytest.raises(ValueError, match="unknown recipe 'bf16'"):
        fp8pass.switch_precision(f, [Rule("*", "bf16")])
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        fp8pass.switch_precision(f, [Rule("*", "high")], step=-1)
    with pytest.raises(ValueError, match="TinyLlama is not compiled with the fp8 backend"):
        fp8pass.switch_precision(torch.compile(_model(), backend="aot_eager"), [Rule("*", "high")])
    with pytest.raises(TypeError, match="takes the model"):
        fp8pass.switch_precision(lambda x: x, [Rule("*", "high")])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fp8pass.switch_precision(f, [Rule("layers.9.*", "high")])
    assert any("'layers.9.*' matches no module or parameter of TinyLlama" in str(w.message) for w in caught)
    assert fp8pass.precision_switches(f)[0].rules == (Rule("layers.9.*", "high"),)


def test_schedule_makes_each_due_switch_once():
    from fp8pass import Switch

    cfg = Config(schedule=[Switch([Rule("*", "high")], at_fraction=0.5, reason="tail in high precision"),
                           Switch([Rule("layers.0.*", "paper")], at_step=1)])
    f = torch.compile(_model(), backend=fp8pass.backend(cfg))  # found on the wrapper before its first call
    assert fp8pass.apply_schedule(f, 0, 10) == []
    (made,) = fp8pass.apply_schedule(f, 1, 10)
    assert (made.step, made.reason, made.rules) == (1, "schedule[1]", (Rule("layers.0.*", "paper"),))
    assert fp8pass.apply_schedule(f, 4, 10) == []  # made once; the fraction's step (5) not reached
    (tail,) = fp8pass.apply_schedule(f, 7, 10)
    assert (tail.step, tail.reason) == (7, "schedule[0]: tail in high precision")
    assert [s.reason for s in fp8pass.precision_switches(f)] == ["schedule[1]", "schedule[0]: tail in high precision"]
    # a model restored from a state dict holds the history: nothing due is made again
    fresh = _model()
    fp8pass.checkpoint.attach(fresh)
    fresh.load_state_dict(f._orig_mod.state_dict())
    g = torch.compile(fresh, backend=fp8pass.backend(cfg))
    assert fp8pass.apply_schedule(g, 9, 10) == []

    with pytest.raises(ValueError, match=r"needs the run's number of steps"):
        fp8pass.apply_schedule(torch.compile(_model(), backend=fp8pass.backend(cfg)), 5)
    with pytest.raises(ValueError, match="pass schedule="):
        fp8pass.apply_schedule(torch.compile(_model(), backend="fp8"), 0)
    with pytest.raises(ValueError, match="not compiled with the fp8 backend"):
        fp8pass.apply_schedule(_model(), 3, schedule=cfg.schedule)
    with pytest.raises(TypeError, match=r"Config.schedule\[0\] must be an fp8pass.Switch"):
        Config(schedule=[{"at_step": 1}])
    with pytest.raises(ValueError, match="exactly one of at_step"):
        Switch([Rule("*", "high")], at_step=1, at_fraction=0.5)
    with pytest.raises(ValueError, match=r"Switch.at_fraction must be a number in \[0, 1\]"):
        Switch([Rule("*", "high")], at_fraction=1.5)
