"""The trainer's precision schedule and evaluation recipe (issue 30 items 3 and 4).

A scheduled switch is made once, logged (``precision_switch`` records), kept in the checkpoint, and a
run resumed after it continues in the switched precision bit for bit; ``eval_recipe="high"``
validation equals the eager model's loss on the same weights exactly.
"""

import json
import warnings

import pytest
import torch

import fp8pass
from fp8pass.train import ModelConfig, TinyLlama, TrainConfig, train
from fp8pass.train.data import load_text_data
from fp8pass.train.loop import evaluate

SMALL = ModelConfig(d_model=32, n_layers=2, n_heads=2, ffn=64, max_seq_len=32)
SWITCH = [{"at_step": 3, "rules": [{"pattern": "layers.0.*", "recipe": "high"}], "reason": "block 0 to high"}]
# "blocks back to FP8": block 0 starts high by a rule, and the switch gives it TE's delayed recipe (histories of
# 1024 entries beside the fp8 recipe's 16)
BACK = dict(precision_rules=[{"pattern": "layers.0.*", "recipe": "high"}],
            precision_schedule=[{"at_step": 3, "rules": [{"pattern": "layers.0.*", "recipe": "delayed"}],
                                 "reason": "block 0 to FP8"}])


@pytest.fixture
def corpus(tmp_path):
    (tmp_path / "c.txt").write_text("".join(f"x{i} = {i} * y + {i % 5}\n" for i in range(300)))
    return str(tmp_path / "c.txt")


def cfg(tmp_path, corpus, name, **kw):
    base = dict(recipe="fp8", steps=6, out=str(tmp_path / name), data=corpus, batch_size=2, seq_len=32,
                model=SMALL, eval_every=2, eval_batches=1, ckpt_every=2, monitor_every=0, warmup=1,
                schedule="constant", progress=False, compiler="aot_eager", precision="fp32")
    base.update(kw)
    return TrainConfig(**base)


def _records(run_dir, kind):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


@pytest.mark.slow
@pytest.mark.parametrize("kw", [dict(precision_schedule=SWITCH), BACK], ids=["to_high", "back_to_fp8"])
def test_resume_after_a_scheduled_switch_is_bit_identical(tmp_path, corpus, kw):
    warnings.simplefilter("ignore")
    full = train(cfg(tmp_path, corpus, "full", **kw))
    torch._dynamo.reset()
    plain = train(cfg(tmp_path, corpus, "plain", **{k: v for k, v in kw.items() if k != "precision_schedule"}))
    torch._dynamo.reset()
    # the switch acts from step index 3 on: the same losses before it, others after
    assert full.losses[:3] == plain.losses[:3] and full.losses[3] != plain.losses[3]
    part = train(cfg(tmp_path, corpus, "part", steps=4, **kw))
    torch._dynamo.reset()
    torch.manual_seed(99)
    resumed = train(cfg(tmp_path, corpus, "part", **kw), resume=True)
    assert part.losses + resumed.losses == full.losses
    # recorded once, in the metrics and in the checkpoint's model state (the resume did not switch again)
    sw = kw["precision_schedule"][0]
    reason = f"schedule[0]: {sw['reason']}"
    assert [(r["step"], r["reason"], r["rules"]) for r in _records(tmp_path / "part", "precision_switch")] == \
        [(4, reason, sw["rules"])]
    ck = torch.load(tmp_path / "part" / "checkpoint.pt", weights_only=True)
    model = TinyLlama(SMALL)
    # the run's Config; loading the history re-attaches the modules under the switched rules (1024 entries)
    fp8pass.checkpoint.attach(model, cfg(tmp_path, corpus, "part", **kw).fp8_config())
    model.load_state_dict(ck["model"])
    assert [(s.step, s.reason) for s in fp8pass.precision_switches(model)] == [(3, reason)]


def test_eval_recipe_high_validates_like_the_eager_model(tmp_path, corpus):
    warnings.simplefilter("ignore")
    c = cfg(tmp_path, corpus, "ev", steps=2, eval_recipe="high")
    res = train(c)
    (rec,) = _records(tmp_path / "ev", "eval")
    assert rec["eval_recipe"] == "high" and rec["val_loss_eval_recipe"] == res.final_val_loss_eval_recipe
    model = TinyLlama(SMALL)
    model.load_state_dict(fp8pass.checkpoint.without_scaling_state(
        torch.load(tmp_path / "ev" / "checkpoint.pt", weights_only=True)["model"]))
    eager = evaluate(lambda x, y: model(x, y), load_text_data(corpus), c)
    assert rec["val_loss_eval_recipe"] == eager  # the same weights in high precision, exactly
    assert rec["val_loss"] != eager  # the training recipe's validation: FP8


def test_bad_trainer_precision_options(tmp_path, corpus):
    with pytest.raises(ValueError, match="eval_recipe applies to the fp8 recipes"):
        cfg(tmp_path, corpus, "x", recipe="bf16", eval_recipe="high")
    with pytest.raises(ValueError, match="keeps state"):
        cfg(tmp_path, corpus, "x", eval_recipe="delayed")
    with pytest.raises(ValueError, match="a precision schedule applies to the fp8 recipes"):
        cfg(tmp_path, corpus, "x", recipe="bf16", precision_schedule=SWITCH)
    with pytest.raises(ValueError, match=r"precision_schedule: switch\[0\]: Switch takes exactly one of at_step"):
        cfg(tmp_path, corpus, "x", precision_schedule=[{"rules": SWITCH[0]["rules"]}])
    with pytest.raises(ValueError, match=r"switch\[0\]: rules\[0\]: Rule\('\*'\): unknown recipe 'bf16'"):
        cfg(tmp_path, corpus, "x", precision_schedule=[{"at_step": 1, "rules": [{"pattern": "*", "recipe": "bf16"}]}])


def test_cli_precision_schedule_and_eval_recipe(tmp_path, corpus, capsys):
    from fp8pass.cli import main

    n = torch.get_num_threads()
    (tmp_path / "p.toml").write_text(
        '[[rules]]\npattern = "layers.1.*"\nrecipe = "blockwise"\n\n'
        '[[switch]]\nat_fraction = 0.5\nreason = "bf16 forward for the second half"\n'
        'rules = [{ pattern = "*", recipe = "high" }]\n')
    out = tmp_path / "cli"
    args = ["train", "--recipe", "fp8", "--steps", "2", "--out", str(out), "--data", corpus, "--batch-size", "2",
            "--seq-len", "32", "--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--ffn", "64",
            "--eval-every", "2", "--monitor-every", "0", "--compiler", "aot_eager", "--no-progress", "--no-plots",
            "--precision-config", str(tmp_path / "p.toml"), "--eval-recipe", "high"]
    try:
        warnings.simplefilter("ignore")
        assert main(args) == 0
        saved = json.loads((out / "fp8" / "config.json").read_text())
        assert saved["eval_recipe"] == "high"
        assert saved["precision_rules"] == [{"pattern": "layers.1.*", "recipe": "blockwise"}]
        assert saved["precision_schedule"] == [{"at_fraction": 0.5, "reason": "bf16 forward for the second half",
                                                "rules": [{"pattern": "*", "recipe": "high"}]}]
        (switch,) = _records(out / "fp8", "precision_switch")
        assert (switch["step"], switch["reason"]) == (2, "schedule[0]: bf16 forward for the second half")
        (ev,) = _records(out / "fp8", "eval")
        # after the switch to "high" both validations run the same high-precision math on the same weights
        assert ev["val_loss"] == ev["val_loss_eval_recipe"]
        assert f"fp8: val loss in eval recipe 'high' {ev['val_loss_eval_recipe']:.4f}" in capsys.readouterr().out
        assert main(["train", "--resume", str(out / "fp8"), "--eval-recipe", "mxfp8"]) == 2
        assert "only --steps may change (got --eval-recipe)" in capsys.readouterr().err
        assert main(args[:-1] + ["paper"]) == 2
        assert "keeps state" in capsys.readouterr().err
    finally:
        torch.set_num_threads(n)
