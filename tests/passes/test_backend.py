"""The fp8 backend end to end: numerics vs eager, scaling state across steps/recompiles/reset and
checkpoints, explain, registration. Compiled with aot_eager (AOT autograd, no code generation) to
stay fast on CPU; tests/passes/test_backend.py::test_inductor_* covers Inductor (slow)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import torch
from test_patterns import VARIANTS

import fp8pass
from fp8pass.checkpoint import without_scaling_state
from fp8pass.config import Config, CurrentScaling
from fp8pass.testing.models import D, Fused, GeGLU, MatmulWT, ReGLU, SiluMul, tiny_titan_llama

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _eager_casts(monkeypatch):
    monkeypatch.setenv("FP8PASS_CPU_FUSED", "0")  # the runtime's eager casts: same bits, no compile
    torch._dynamo.reset()


def _cfg(**kw):
    kw.setdefault("compiler", "aot_eager")
    kw.setdefault("grad_stochastic_rounding", False)
    return Config(**kw)


def _run(model, x, cfg):
    be = fp8pass.backend(cfg)
    y = torch.compile(model, backend=be, fullgraph=True)(x)
    y.float().pow(2).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return y.detach(), grads, be


def _ref(model, x):
    y = model(x)
    y.float().pow(2).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return y.detach(), grads


@pytest.mark.parametrize("model,glus", [
    (SiluMul(), 1), (MatmulWT(bias=True), 1), (Fused("chunk"), 1), (GeGLU(), 1),
    (torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.Linear(D, D), SiluMul()), 1),  # chained sites
], ids=["silu", "matmul_bias", "fused", "geglu", "chain"])
def test_identity_format_matches_eager(model, glus):
    x = torch.randn(2, 5, D)
    y0, g0 = _ref(model, x)
    # the rewrite's semantics: running the rewritten graph directly is enough, except for one
    # case that goes through AOT autograd as real compiles do
    compiler = "aot_eager" if glus and isinstance(model, torch.nn.Sequential) else "eager"
    y, g, be = _run(model, x, _cfg(fwd_format="identity", bwd_format="identity", compiler=compiler))
    assert len(be.report().swiglus) == glus
    # every GLU (GeGLU too) is rewritten whole: no high-precision linear left, one swiglu_down each
    after = be.records[0].report.graph_after
    assert after.count("torch._C._nn.linear(") == 0
    assert after.count("fp8pass.swiglu_down.default") == glus
    assert (y - y0).abs().max() <= 1e-6 * max(1.0, y0.abs().max())
    for a, b in zip(g, g0):
        assert (a - b).abs().max() <= 1e-6 * max(1.0, b.abs().max())


@pytest.mark.parametrize("cls,kw", VARIANTS, ids=lambda v: getattr(v, "__name__", str(v)))
def test_every_glu_form_rewritten_exactly(cls, kw):
    """Identity format: the rewritten graph of every matched form computes eager's math (<= 1e-6)."""
    torch.manual_seed(0)
    model = cls(**kw)
    x = torch.randn(3, 4, D)
    y0, g0 = _ref(model, x)
    y, g, be = _run(model, x, _cfg(fwd_format="identity", bwd_format="identity", compiler="eager"))
    rep = be.report()
    assert len(rep.swiglus) == 1 and rep.swiglus[0].variant == model.variant
    assert (y - y0).abs().max() <= 1e-6 * max(1.0, y0.abs().max())
    for a, b in zip(g, g0):
        assert (a - b).abs().max() <= 1e-6 * max(1.0, b.abs().max())


@pytest.mark.parametrize("smooth,model_cls", [("channel", SiluMul), ("token", SiluMul), (None, SiluMul),
                                             ("channel", GeGLU), ("token", ReGLU)],
                         ids=["channel", "token", "none", "geglu_channel", "reglu_token"])
def test_fp8_within_bound_of_eager(smooth, model_cls):
    torch.manual_seed(0)
    model = model_cls()
    x = torch.randn(4, 8, D)
    y0, g0 = _ref(model, x)
    y, g, be = _run(model, x, _cfg(smooth_swiglu=smooth, recipe=CurrentScaling(),
                                   compiler="aot_eager" if smooth == "channel" else "eager"))
    rep = be.report()
    assert rep.linears == ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]
    # E4M3 operands (rel. step 2**-3): output error a few % of its norm; E5M2 grads ~ 2x that
    assert (y - y0).norm() / y0.norm() < 0.08
    for a, b in zip(g, g0):
        assert (a - b).norm() / b.norm() < 0.15
    assert (y - y0).abs().max() > 0  # really quantized


def test_state_survives_dynamic_shapes_and_grad_mode_recompiles():
    m = SiluMul()
    be = fp8pass.backend(_cfg())
    cm = torch.compile(m, backend=be, dynamic=True)
    for n in (4, 7):
        cm(torch.randn(n, D)).sum().backward()
    with torch.no_grad():  # grad-mode change: a recompile, forward records only
        cm(torch.randn(5, D))
    cm(torch.randn(9, D)).sum().backward()
    sd = fp8pass.scaling_state_dict(m)
    assert int(sd["gate_proj.weight.input.steps"]) == 4
    assert int(sd["gate_proj.weight.grad_output.steps"]) == 3
    assert int(sd["down_proj.weight.grad_output.steps"]) == 3
    assert len(be.records) <= 3  # one dynamic graph per grad mode (+ at most one re-specialization)


def test_checkpoint_resume_gives_same_next_step():
    def make():
        torch.manual_seed(0)
        return SiluMul()

    cfg = _cfg()
    x = torch.randn(2, 8, D)
    a = make()
    ca = torch.compile(a, backend=fp8pass.backend(cfg), fullgraph=True)
    for scale in (10.0, 3.0):  # large early amaxes: the delayed scales remember them
        ca(x * scale).sum().backward()
    weights = without_scaling_state(a.state_dict())  # the state travels separately here
    ck = {"model": {k: v.clone() for k, v in weights.items()}, "fp8": fp8pass.scaling_state_dict(a)}
    out_a = ca(x)
    b = make()
    b.load_state_dict(ck["model"])
    fp8pass.load_scaling_state_dict(b, ck["fp8"], config=cfg)
    assert fp8pass.scaling_state_dict(ca).keys() == ck["fp8"].keys()  # compiled wrapper: same keys
    cb = torch.compile(b, backend=fp8pass.backend(cfg), fullgraph=True)
    fp8pass.load_scaling_state_dict(cb, ck["fp8"], config=cfg)  # into the live state, via the wrapper
    out_b = cb(x)
    assert torch.equal(out_a, out_b)
    # without the scaling state the first step scales differently
    c = make()
    c.load_state_dict(ck["model"])
    out_c = torch.compile(c, backend=fp8pass.backend(cfg), fullgraph=True)(x)
    assert not torch.equal(out_a, out_c)
    # the state dict carries the scaling state: a model that never saw fp8pass takes the weights alone
    with pytest.raises(RuntimeError, match="fp8_scaling"):
        make().load_state_dict(a.state_dict(), strict=True)
    make().load_state_dict(without_scaling_state(a.state_dict()), strict=True)
    with pytest.raises(KeyError, match="name no parameter"):
        fp8pass.load_scaling_state_dict(b, {"nope.input.scale": torch.ones(())})


def test_tied_weights_share_state():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(D, D, bias=False)
            self.b = torch.nn.Linear(D, D, bias=False)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(self.a(x))

    m = Tied()
    x = torch.randn(4, D)
    torch.compile(m, backend=fp8pass.backend(_cfg()), fullgraph=True)(x).sum().backward()
    sd = fp8pass.scaling_state_dict(m)
    # one forward record per state and graph (the max over the weight's two uses: docs/scaling.md);
    # the backward of each use records its grad_output
    assert int(sd["a.weight.input.steps"]) == 1 and int(sd["a.weight.grad_output.steps"]) == 2
    assert float(sd["a.weight.weight.amax_history"][0]) == float(m.a.weight.detach().abs().max())
    assert float(sd["a.weight.input.amax_history"][0]) >= float(x.abs().max())
    assert float(sd["a.weight.input.amax_history"][1]) == 0.0


def test_bad_inputs_run_unchanged():
    m64 = SiluMul().double()
    x = torch.randn(3, D, dtype=torch.float64)
    y, _, be = _run(m64, x, _cfg())
    assert torch.equal(y, m64(x).detach()) and be.report().linears == []
    frozen = SiluMul().requires_grad_(False)
    be = fp8pass.backend(_cfg())
    with torch.no_grad():
        y = torch.compile(frozen.eval(), backend=be)(torch.randn(3, D))
    assert y.shape == (3, D) and len(be.report().swiglus) == 1
    plain = torch.nn.Sequential(torch.nn.LayerNorm(D), torch.nn.GELU())
    be = fp8pass.backend(_cfg())
    x = torch.randn(3, D)
    assert torch.equal(torch.compile(plain, backend=be)(x), plain(x))
    assert be.records[0].report.graph_before == be.records[0].report.graph_after


def test_graph_break_warns_and_errors():
    from test_patterns import Broken

    with pytest.warns(RuntimeWarning, match="graph break splits"):
        torch.compile(Broken("down"), backend=fp8pass.backend(_cfg()))(torch.randn(3, D))
    torch._dynamo.reset()
    with pytest.raises(Exception, match="graph break"):
        torch.compile(Broken("down"), backend=fp8pass.backend(_cfg(on_graph_break="error")))(torch.randn(3, D))


def test_explain_report():
    rep = fp8pass.explain(tiny_titan_llama(n_layers=2), torch.randint(0, 128, (2, 8)))
    assert len(rep.swiglus) == 2 and rep.swiglus[0].variant == "swiglu"
    assert "layers.0.attention.wq.weight" in rep.linears and len(rep.linears) == 14
    assert rep.skipped[0][0] == "output.weight"
    assert "swiglu_down" in rep.graph_after and "swiglu_down" not in rep.graph_before
    text = str(rep)
    assert "layers.1.feed_forward.w2.weight" in text and "keep_high_precision" in text
    assert "GLU MLPs (Smooth-SwiGLU, per channel):" in text
    plain = fp8pass.explain(tiny_titan_llama(n_layers=2), torch.randint(0, 128, (2, 8)),
                            config=Config.from_recipe("mxfp8"))
    assert "GLU MLPs (FP8, no smoothing):" in str(plain)  # not "Smooth-SwiGLU" when smoothing is off
    from test_patterns import Broken

    rep = fp8pass.explain(Broken("act"), torch.randn(3, D))
    assert rep.num_graphs == 2 and any("Dynamo graph break" in b for b in rep.graph_breaks)
    assert any("GLU" in b for b in rep.graph_breaks)


def test_inspect_cli(tmp_path, capsys):
    from fp8pass.cli import main

    out = tmp_path / "g.svg"
    assert main(["inspect", "fp8pass.testing.models:tiny_titan_llama_with_inputs", "--draw", str(out)]) == 0
    text = capsys.readouterr().out
    assert "2 GLU MLP(s) fused" in text and "layers.1.feed_forward.w2.weight" in text
    assert out.read_text().lstrip().startswith("<?xml") and out.stat().st_size > 1000
    assert main(["inspect", "fp8pass.testing.models"]) == 2  # no factory named: a clear usage error
    assert "MODULE:FACTORY" in capsys.readouterr().err


def test_config_validation():
    with pytest.raises(ValueError, match="smooth_swiglu"):
        Config(smooth_swiglu="row")
    with pytest.raises(TypeError, match="recipe"):
        Config(recipe="delayed")
    with pytest.raises(TypeError, match="fp8pass.Config"):
        fp8pass.backend({"recipe": None})
    assert Config(keep_high_precision="lm_head").keep_high_precision == ("lm_head",)


def test_mode_and_options_reach_inductor():
    from fp8pass.compile_backend import _inductor_patches

    p = _inductor_patches("max-autotune-no-cudagraphs", None, None)
    assert p.get("max_autotune") is True
    assert _inductor_patches(None, {"epilogue-fusion": False}, None) == {"epilogue_fusion": False}
    with pytest.raises(RuntimeError, match="unknown Inductor option"):
        _inductor_patches(None, {"no_such_option": 1}, None)


def test_mode_and_options_passed_through_torch_compile(monkeypatch):
    seen = []

    def spy(gm, inputs, config_patches=None, **kw):
        seen.append(config_patches)
        return gm.forward

    import torch._inductor.compile_fx as cfx

    monkeypatch.setattr(cfx, "compile_fx", spy)
    m = torch.nn.Linear(D, D)
    x = torch.randn(2, D)
    torch.compile(m, backend=fp8pass.backend(Config()), mode="max-autotune-no-cudagraphs")(x)
    torch._dynamo.reset()
    torch.compile(m, backend=fp8pass.backend(Config()), options={"epilogue_fusion": False})(x)
    assert seen[0]["max_autotune"] is True and seen[1] == {"epilogue_fusion": False}


def test_entry_point_resolves_without_import(tmp_path):
    """A dist-info with pyproject's entry points (what pip install writes); fp8pass not imported."""
    eps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    lines = ["[torch_dynamo_backends]"] + [f"{k} = {v}" for k, v in eps["torch_dynamo_backends"].items()]
    dist = tmp_path / "fp8pass_probe-0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fp8pass-probe\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text("\n".join(lines) + "\n")
    code = (
        "import sys, torch\n"
        "m = torch.nn.Linear(16, 16)\n"
        "assert 'fp8pass' not in sys.modules\n"
        "from torch._dynamo.backends.registry import lookup_backend\n"
        "fn = lookup_backend('fp8')\n"
        "assert fn.__module__ == 'fp8pass.compile_backend', fn\n"
        "import fp8pass  # importing afterwards registers nothing twice\n"
        "assert lookup_backend('fp8') is fn\n"
        "print('ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}:{ROOT}")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


@pytest.mark.slow
def test_inductor_compile_matches_aot_eager():
    torch.manual_seed(0)
    model = tiny_titan_llama(n_layers=1)
    ids = torch.randint(0, 128, (2, 8))
    y_ind = torch.compile(model, backend=fp8pass.backend(Config(grad_stochastic_rounding=False,
                                                                recipe=CurrentScaling())), fullgraph=True)(ids)
    torch._dynamo.reset()
    y_aot = torch.compile(model, backend=fp8pass.backend(_cfg(recipe=CurrentScaling())), fullgraph=True)(ids)
    assert (y_ind - y_aot).abs().max() < 1e-4


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_eager_compiler_trains_like_aot_eager_bit_for_bit(recipe):
    """Config(compiler="eager") runs the rewritten graph as it is, under autograd: the forward's
    ``delayed_record_many_`` got amaxes that require grad, its write-back gave the state tensors a
    grad_fn, and the second step's backward failed ("derivative for _foreach_copy_ is not
    implemented"). Records run without autograd: three training steps (inputs without grad) equal
    aot_eager's bit for bit: losses, gradients, weights and scaling state."""
    def train(compiler):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(D, 2 * D), torch.nn.Linear(2 * D, D))
        rec = CurrentScaling() if recipe == "current" else fp8pass.DelayedScaling()
        be = fp8pass.backend(_cfg(compiler=compiler, recipe=rec))
        compiled = torch.compile(model, backend=be)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(1)
        got = []
        for _ in range(3):
            loss = compiled(torch.randn(4, 8, D, generator=g)).float().pow(2).mean()
            loss.backward()
            got += [loss.detach()] + [p.grad.clone() for p in model.parameters()]
            opt.step()
            opt.zero_grad(set_to_none=True)
        got += [p.detach().clone() for p in model.parameters()]
        states = fp8pass.scaling_state_dict(model)
        assert (len(states) > 0) == (recipe == "delayed")
        assert not any(t.requires_grad for t in states.values())
        return got, states, be.report().linears

    eager, eager_states, linears = train("eager")
    aot, aot_states, _ = train("aot_eager")
    assert linears == ["0.weight", "1.weight"]
    assert len(eager) == len(aot)
    for i, (a, b) in enumerate(zip(eager, aot)):
        assert torch.equal(a, b), i
    assert eager_states.keys() == aot_states.keys()
    for k in eager_states:
        assert torch.equal(eager_states[k], aot_states[k]), k
