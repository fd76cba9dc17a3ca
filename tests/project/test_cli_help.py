"""What a newcomer reads first (issue 34): the top-level --help, the train flags' help, and the
error for Config(recipe="paper")."""

import pytest

import fp8pass
from fp8pass.cli import main


def test_top_level_help_is_for_users(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert 'torch.compile(model, backend="fp8")' in out and "python -m fp8pass selfcheck" in out
    assert "On a CPU, FP8 is emulated" in out
    assert "``" not in out and "Subcommands are added by" not in out  # no RST, no developer's note


def test_every_train_flag_says_what_it_does(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "--steps STEPS optimizer steps per recipe (default 120)" in out
    assert "--seq-len SEQ_LEN sequence length in bytes (at most the model's max_seq_len) (default 128)" in out
    assert "(default {" not in out
    # no flag's help is only its default any more
    import re
    assert not re.search(r"\s[A-Z_]+\s\(default [^)]*\)\s+--", out), re.findall(r"--\S+ [A-Z_]+ \(default [^)]*\)", out)


def test_a_named_recipe_passed_as_config_recipe_points_at_from_recipe():
    with pytest.raises(TypeError) as e:
        fp8pass.Config(recipe="paper")
    assert str(e.value) == (
        "Config(recipe=...) takes a scaling object; 'paper' is a named recipe: use "
        "fp8pass.Config.from_recipe('paper') (other Config fields as keyword overrides); or pass "
        "fp8pass.DelayedScaling(...), fp8pass.CurrentScaling(...) or fp8pass.NVFP4Scaling(...)")
    with pytest.raises(TypeError, match=r"'papr' is no named recipe either \(fp8pass.Config.from_recipe\(name\) "
                                        r"takes paper, reference, "):
        fp8pass.Config(recipe="papr")
    assert fp8pass.Config.from_recipe("paper").recipe is not None
