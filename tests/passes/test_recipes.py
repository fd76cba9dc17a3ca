"""Named recipes (fp8pass.recipes): their values, Config.from_recipe, training each from the CLI."""

import json
import math

import pytest
import torch

import fp8pass
from fp8pass import Config, CurrentScaling, DelayedScaling, NVFP4Scaling
from fp8pass.cli import main
from fp8pass.recipes import NAMED_RECIPES, get_named_recipe
from fp8pass.train import TrainConfig
from fp8pass.train.logging import read_metrics
from fp8pass.train.recipes import RECIPES, fp8_config, get_recipe

NAMES = ("paper", "reference", "delayed", "blockwise", "mxfp8", "nvfp4", "nvfp4-hcp")


def test_every_named_recipe_is_there_with_a_source():
    assert tuple(NAMED_RECIPES) == NAMES
    assert all(r.source for r in NAMED_RECIPES.values())
    assert all(n in RECIPES and RECIPES[n].named and RECIPES[n].fp8 for n in NAMES)


def test_paper_and_reference_values():
    p = Config.from_recipe("paper")
    assert p.recipe == DelayedScaling() and p.smooth_swiglu == "channel"
    assert (p.fwd_format, p.bwd_format, p.grad_stochastic_rounding) == ("e4m3", "e5m2", True)
    m = get_named_recipe("paper").moments
    assert (m.m_format, m.v_format, m.v_sqrt, m.block_size) == ("e4m3", "e5m2", False, None)
    r = Config.from_recipe("reference")
    assert r.recipe == DelayedScaling(power_of_two=True) and r.smooth_swiglu == "token"
    assert (r.fwd_format, r.bwd_format) == ("e4m3_gaudi", "e5m2")
    assert fp8pass.get_format(r.fwd_format).max == 240
    assert get_named_recipe("reference").moments == m


def test_other_recipes_values():
    d = Config.from_recipe("delayed")
    assert d.recipe == DelayedScaling(history_len=1024, algo="max") and d.smooth_swiglu is None
    b = Config.from_recipe("blockwise")
    assert b.recipe == CurrentScaling(granularity="block", block=128)
    # NVIDIA's rule (the last ~15% of the block linears, attention projections quantized) for nvfp4; the
    # seed document's (the last 4 blocks and the post-QK projections) for nvfp4-hcp
    assert Config.from_recipe("nvfp4").recipe == NVFP4Scaling(keep_last_blocks=None, keep_last_fraction=0.15,
                                                              protect_post_qk=False)
    hcp_recipe = Config.from_recipe("nvfp4-hcp").recipe
    assert (hcp_recipe.keep_last_blocks, hcp_recipe.protect_post_qk) == (4, True)
    hcp = hcp_recipe.hcp
    assert hcp is not None and (hcp.mode, hcp.second_order, hcp.backward) == ("concat", True, True)
    assert all(get_named_recipe(n).moments is None for n in ("delayed", "blockwise", "mxfp8", "nvfp4", "nvfp4-hcp"))
    mx = Config.from_recipe("mxfp8")
    assert mx.recipe == CurrentScaling(granularity="mx") and (mx.fwd_format, mx.bwd_format) == ("e4m3", "e4m3")


def test_from_recipe_overrides_and_errors():
    c = Config.from_recipe("paper", compiler="aot_eager", min_dim=32)
    assert (c.compiler, c.min_dim, c.smooth_swiglu) == ("aot_eager", 32, "channel")
    with pytest.raises(ValueError, match="unknown named recipe 'papper'; valid: paper, reference"):
        Config.from_recipe("papper")
    with pytest.raises(TypeError):
        Config.from_recipe("paper", no_such_field=1)


def test_train_config_takes_the_recipes_moments_unless_set():
    c = TrainConfig(recipe="paper")
    assert (c.m_format, c.v_format, c.v_sqrt, c.moment_block_size) == ("e4m3", "e5m2", False, None)
    assert get_recipe("paper").fp8_adam and not get_recipe("delayed").fp8_adam
    c = TrainConfig(recipe="paper", v_sqrt=True, moment_block_size=64)
    assert (c.v_sqrt, c.moment_block_size) == (True, 64)
    legacy = TrainConfig(recipe="fp8-smooth-fp8adam")
    assert (legacy.v_sqrt, legacy.moment_block_size) == (False, 128)
    with pytest.raises(ValueError, match="fixes its own scaling"):
        TrainConfig(recipe="paper", scaling="current")


def test_named_config_round_trips_through_config_json():
    c = TrainConfig(recipe="reference", v_sqrt=True).resolved()
    back = TrainConfig.from_dict(json.loads(json.dumps(c.to_dict())))
    assert back == c
    assert fp8_config(get_recipe(back.recipe), back.scaling, back.smooth, "aot_eager") == \
        Config.from_recipe("reference", compiler="aot_eager")


@pytest.fixture
def corpus(tmp_path):
    text = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(300))
    (tmp_path / "corpus.txt").write_text(text)
    return str(tmp_path / "corpus.txt")


@pytest.fixture
def restore_num_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("name", NAMES)
def test_each_named_recipe_trains_from_the_cli(name, tmp_path, corpus, restore_num_threads, capsys):
    """Tiny shapes, 2 steps (the 30-step comparison is docs/results/recipes.md); then (paper, nvfp4-hcp) resume 1 step.
    NVFP4 keeps the last 4 blocks in high precision (the seed's rule): 5 layers leave one in NVFP4."""
    torch._dynamo.reset()
    out = tmp_path / "runs"
    args = ["train", "--recipe", name, "--steps", "2", "--out", str(out), "--data", corpus, "--batch-size", "2",
            "--seq-len", "32", "--d-model", "32", "--n-layers", "5" if name.startswith("nvfp4") else "2", "--n-heads", "2", "--ffn", "64",
            "--eval-every", "2", "--eval-batches", "1", "--ckpt-every", "2", "--monitor-every", "0",
            "--warmup", "1", "--compiler", "aot_eager", "--no-progress", "--no-plots"]
    assert main(args) == 0
    losses = [r["loss"] for r in read_metrics(out / name / "metrics.jsonl", "train")]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    saved = json.loads((out / name / "config.json").read_text())
    assert saved["recipe"] == name
    cfg = TrainConfig.from_dict(saved)
    assert cfg.v_sqrt is False  # v itself: the paper's form, and the optimizer's default since issue 18
    assert fp8_config(get_recipe(cfg.recipe), cfg.scaling, cfg.smooth, "aot_eager") == \
        Config.from_recipe(name, compiler="aot_eager")
    if name not in ("paper", "nvfp4-hcp"):  # resume (compiles again) for the FP8-moment and stateful ones
        return
    torch._dynamo.reset()
    assert main(["train", "--resume", str(out / name), "--steps", "3", "--no-progress", "--no-plots"]) == 0
    assert len(read_metrics(out / name / "metrics.jsonl", "train")) == 3


def test_cli_rejects_scaling_flags_for_named_recipes(tmp_path, corpus, capsys):
    assert main(["train", "--recipe", "paper", "--scaling", "current", "--out", str(tmp_path), "--data", corpus]) == 2
    assert "do not apply to the named recipe 'paper'" in capsys.readouterr().err


def test_keep_first_and_last_layers_by_count():
    """Config.keep_first_layers / keep_last_layers: exact counts of FP8 linears on a 4-block model."""
    from fp8pass.testing.models import tiny_titan_llama

    x = torch.randint(0, 128, (2, 8))
    torch._dynamo.reset()
    base = fp8pass.explain(tiny_titan_llama(n_layers=4), x)
    assert len(base.linears) == 28 and len(base.swiglus) == 4
    torch._dynamo.reset()
    rep = fp8pass.explain(tiny_titan_llama(n_layers=4), x,
                          config=Config(keep_first_layers=1, keep_last_layers=2))
    assert len(rep.linears) == 7 and {f.split(".")[1] for f in rep.linears} == {"1"}
    assert len(rep.swiglus) == 1
    reasons = dict(rep.skipped)
    assert "keep_first_layers=1" in reasons["layers.0.attention.wq.weight"]
    assert "block 4 of 4, keep_last_layers=2" in reasons["layers.3.attention.wq.weight"]
    torch._dynamo.reset()
    assert len(fp8pass.explain(tiny_titan_llama(n_layers=4), x, config=Config(keep_last_layers=9)).linears) == 0
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="keep_first_layers must be an int >= 0"):
            Config(keep_first_layers=bad)


def test_format_advisor_on_planted_ranges():
    """Values 2**-k: E4M3 at scale 448 (amax 1) keeps 2**-18 (448 * 2**-18 > 2**-10, half its smallest
    subnormal) and loses 2**-19 and below; E5M2 (scale 57344, smallest subnormal 2**-16) loses 2**-33
    and below."""
    from fp8pass.monitor import format_advice, measure_formats

    def planted(n):
        return torch.tensor([2.0 ** -k for k in range(n)]) * torch.tensor([1.0, -1.0]).repeat(n)[:n]

    adv = format_advice({"narrow": planted(16), "wide": planted(30), "huge": planted(40)})
    rec = adv.recommended()
    assert rec == {"narrow": "e4m3", "wide": "e5m2", "huge": "high"}
    wide = {r.role: r for r in adv.roles}["wide"]
    assert wide.stats["e4m3"].underflow == 11 / 30 and wide.stats["e5m2"].underflow == 0
    assert wide.binades == 29 and wide.stats["e4m3"].saturate == 0
    huge = {r.role: r for r in adv.roles}["huge"].stats
    assert huge["e4m3"].underflow == 21 / 40 and huge["e5m2"].underflow == 7 / 40
    lag = measure_formats(planted(30), "e4m3", scale=448.0 * 4)         # a scale lagging a 4x jump
    assert lag.saturate == 2 / 30 and lag.scale == 1792.0
    p2 = measure_formats(planted(30), "e4m3", power_of_two=True)
    assert p2.scale == 256.0 and p2.underflow == 12 / 30                 # 256 * 2**-18 = 2**-10: a tie, to 0
    assert str(adv).count("\n") == 3
    with pytest.raises(ValueError, match="finite values"):
        measure_formats(torch.tensor([1.0, float("nan")]), "e4m3")


def test_format_advisor_on_a_model_covers_every_rewritten_role():
    from fp8pass.monitor import advise
    from fp8pass.testing.models import tiny_titan_llama

    torch._dynamo.reset()
    model = tiny_titan_llama(n_layers=2)
    adv = advise(model, torch.randint(0, 128, (2, 8)))
    roles = [r.role for r in adv.roles]
    assert len(roles) == 3 * 14 and "layers.0.attention.wq.input" in roles
    assert "layers.1.feed_forward.w2.grad_output" in roles and not any(r.startswith("output.") for r in roles)
    assert set(adv.recommended().values()) <= {"e4m3", "e5m2", "high"}
    assert all(p.grad is None for p in model.parameters())                 # gradients left as they were


def test_one_registry_resolves_every_name():
    from fp8pass import recipes
    from fp8pass.train import recipes as train_recipes

    assert train_recipes.RECIPES is recipes.RECIPES and train_recipes.get_recipe is recipes.get_recipe
    trainer = ("bf16", "fp8", "fp8-smooth", "fp8-smooth-fp8adam", "bf16-fp8adam")
    assert tuple(RECIPES) == trainer + NAMES
    assert [n for n in trainer if RECIPES[n].fp8_adam] == ["fp8-smooth-fp8adam", "bf16-fp8adam"]
    assert not any(RECIPES[n].named for n in trainer)
    with pytest.raises(ValueError, match="unknown recipe 'fp9'; valid: bf16, fp8, fp8-smooth, .*, nvfp4-hcp$"):
        get_recipe("fp9")
    # a trainer recipe fixes no Config: Config.from_recipe says whose it is and which names it takes
    with pytest.raises(ValueError, match=r"'fp8-smooth' is a recipe of the trainer .*; valid: paper, reference, "):
        Config.from_recipe("fp8-smooth")


def test_a_registered_recipe_is_known_everywhere_at_once():
    from fp8pass.recipes import Recipe, register_recipe

    recipe = Recipe("test-current", "a test", fp8=True, fields=lambda: dict(recipe=CurrentScaling(), smooth_swiglu=None))
    register_recipe(recipe)
    try:
        assert "test-current" in NAMED_RECIPES and get_named_recipe("test-current") is recipe
        assert Config.from_recipe("test-current", min_dim=32) == Config(recipe=CurrentScaling(), smooth_swiglu=None,
                                                                         min_dim=32)
        assert fp8pass.Rule("*", "test-current").scaling == CurrentScaling()
        with pytest.raises(ValueError, match="recipe 'test-current' is registered already"):
            register_recipe(recipe)
    finally:
        del RECIPES["test-current"]
    assert "test-current" not in NAMED_RECIPES
    with pytest.raises(ValueError, match="unknown recipe 'test-current'"):
        fp8pass.Rule("*", "test-current")
    with pytest.raises(ValueError, match="other than 'high'"):
        register_recipe(Recipe("high", "no", fp8=False))
