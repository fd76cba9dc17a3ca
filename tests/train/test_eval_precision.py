"""Evaluation precision (issue 30 item 3): ``Config(eval_recipe=...)``.

The model's graphs compiled in eval mode (``model.eval()``) run the eval recipe on the same weights:
with ``"high"`` the compiled evaluation loss is the eager model's bit for bit, while the training
graphs stay FP8; evaluation changes no scaling state; switching modes compiles each graph once.
"""


import pytest
import torch

import fp8pass
from fp8pass import Config, Rule
from fp8pass.runtime.state import _REGISTRY
from fp8pass.train import ModelConfig, TinyLlama

X = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
Y = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setenv("FP8PASS_CPU_FUSED", "0")
    torch._dynamo.reset()


def _model():
    torch.manual_seed(0)
    return TinyLlama(ModelConfig(d_model=64, n_layers=2, n_heads=2, ffn=128))


def _states(model) -> dict:
    return {n: [t.clone() for s in _REGISTRY[p].roles().values() for t in (s.amax_history, s.scale, s.steps)]
            for n, p in model.named_parameters() if p in _REGISTRY}


def test_eval_recipe_high_gives_the_eager_loss_exactly():
    model = _model()
    be = fp8pass.backend(Config(compiler="aot_eager", eval_recipe="high"))
    fwd = torch.compile(model, backend=be)
    fwd(X, Y).backward()  # a training step's graph: FP8
    assert be.compiles == 1
    before = _states(model)
    assert before  # the training graph made the weights' delayed-scaling state

    model.eval()
    with torch.no_grad():
        compiled = fwd(X, Y)
        eager = model(X, Y)
    assert torch.equal(compiled, eager)  # the eval recipe "high": the model's own math, bit for bit
    assert "fp8pass" not in be.records[-1].report.graph_after
    after = _states(model)
    assert all(torch.equal(a, b) for n in before for a, b in zip(before[n], after[n]))  # no state changed

    model.train()
    with torch.no_grad():
        train_recipe = fwd(X, Y)
    assert not torch.equal(train_recipe, eager)  # training mode still runs FP8
    n = be.compiles
    for mode in (False, True, False):  # modes alternate without compiling again
        model.train(mode)
        with torch.no_grad():
            fwd(X, Y)
    assert be.compiles == n


def test_eval_recipe_blockwise_and_switches():
    """An FP8 eval recipe: its ops in the eval graph; the model's precision switches leave evaluation alone."""
    model = _model()
    be = fp8pass.backend(Config(compiler="aot_eager", eval_recipe="blockwise"))
    fwd = torch.compile(model, backend=be)
    fwd(X, Y).backward()
    fp8pass.switch_precision(model, [Rule("*", "high")], reason="all high")
    fwd(X, Y).backward()
    assert "fp8pass" not in be.records[-1].report.graph_after
    model.eval()
    with torch.no_grad():
        fwd(X, Y)
    code = be.records[-1].report.graph_after
    assert "torch.ops.fp8pass.fp8_linear" in code and "granularity = 'block'" in code
    assert "granularity = 'tensor'" not in code and "delayed_record" not in code


@pytest.mark.parametrize("recipe,message", [
    ("bf16", r"Config.eval_recipe: unknown recipe 'bf16'; valid: 'high' or a named recipe"),
    ("paper", r"keeps state .* that evaluation batches would change; use 'high', a current-scaling recipe"),
    (fp8pass.DelayedScaling(), "keeps state"),
    ("nvfp4-hcp", "keeps state"),
    (3, "Config.eval_recipe: .*recipe must be 'high', a named recipe name"),
])
def test_bad_eval_recipes_fail_when_the_config_is_made(recipe, message):
    with pytest.raises((ValueError, TypeError), match=message):
        Config(eval_recipe=recipe)
