"""``python -m fp8pass inspect``: one-line errors, bare-model factories, a drawing that stays readable."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fp8pass
from fp8pass.cli import example_inputs_for, main
from fp8pass.report.draw import MAX_PIXELS, draw_graph, layer_patterns
from fp8pass.testing.models import SiluMul, TitanLlama

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("target, message", [
    ("nosuchmod:f", "inspect: cannot import 'nosuchmod': No module named 'nosuchmod'"),
    ("fp8pass.testing.models:nosuchfactory", "inspect: module 'fp8pass.testing.models' has no 'nosuchfactory'"),
    ("fp8pass.testing.models:D", "inspect: fp8pass.testing.models:D() raised TypeError: 'int' object is not callable"),
    ("fp8pass.testing.models", "inspect: expected MODULE:FACTORY, e.g. mypkg.models:tiny_llama, got 'fp8pass.testing.models'"),
])
def test_errors_are_one_line(target, message, capsys):
    assert main(["inspect", target]) == 2
    assert capsys.readouterr().err == message + "\n"


def test_missing_module_from_the_command_line_has_no_traceback():
    out = subprocess.run([sys.executable, "-m", "fp8pass", "inspect", "nosuchmod:f"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == "inspect: cannot import 'nosuchmod': No module named 'nosuchmod'"
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("factory, fused", [("tiny_titan_llama", "2 GLU MLP(s) fused"), ("SiluMul", "1 GLU MLP(s) fused")])
def test_a_factory_may_return_a_bare_model(factory, fused, capsys):
    assert main(["inspect", f"fp8pass.testing.models:{factory}"]) == 0
    assert fused in capsys.readouterr().out


def test_example_inputs_for_a_bare_model():
    (tokens,) = example_inputs_for(TitanLlama(vocab=50))
    assert tokens.dtype == torch.int64 and int(tokens.max()) < 50
    (x,) = example_inputs_for(SiluMul())
    assert x.shape == (2, 8, 32) and x.dtype == torch.float32
    assert example_inputs_for(torch.nn.ReLU()) is None


def test_drawing_folds_repeated_blocks_and_fits_the_pixel_budget(tmp_path):
    from PIL import Image

    torch.manual_seed(0)
    report = fp8pass.explain(TitanLlama(n_layers=8), torch.randint(0, 128, (1, 8)))
    boxes = layer_patterns(report)
    assert [(b.title, b.repeat) for b in boxes] == [("layers.0-7", 8), ("output", 1)]
    fp8_rows = [label for label, kind in boxes[0].rows if kind != "kept"]
    assert fp8_rows == ["attention.wq: FP8 linear", "attention.wk: FP8 linear", "attention.wv: FP8 linear",
                        "attention.wo: FP8 linear", "swiglu: feed_forward.w1/feed_forward.w3 -> feed_forward.w2"]
    out = tmp_path / "g.png"
    draw_graph(report, str(out))
    assert max(Image.open(out).size) <= MAX_PIXELS
    assert layer_patterns(fp8pass.explain(TitanLlama(n_layers=3), torch.randint(0, 128, (1, 8))))[0].repeat == 3
