"""The trainer's plots (issue 34): labelled axes, one colour per layer in every recipe, the dtype a run
really computed in named in the legend."""

import json

import pytest

from fp8pass.train import plots


def _run(root, name, recipe, precision):
    d = root / name
    d.mkdir()
    recs = [{"kind": "meta", "recipe": recipe, "precision": precision}]
    recs += [{"kind": "train", "step": s, "loss": 5.0 - s} for s in (1, 2)]
    recs += [{"kind": "monitor", "step": s, "layer": f"layers.{i}.mlp", "max_abs_h": 1.0 + i + s,
              "max_abs_corr": 0.1 * (i + 1)} for s in (0, 2) for i in (0, 1, 10)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return d / "metrics.jsonl"


def test_run_label_names_the_dtype_a_run_computed_in(tmp_path):
    assert plots.run_label("bf16", _run(tmp_path, "bf16", "bf16", "fp32")) == "bf16 (ran in fp32)"
    assert plots.run_label("fp8", _run(tmp_path, "fp8", "fp8", "fp32")) == "fp8 (rest in fp32)"
    assert plots.run_label("b", _run(tmp_path, "b", "bf16", "bf16")) == "b"


def test_monitor_plots_have_a_y_label_and_one_colour_per_layer(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    _run(tmp_path, "bf16", "bf16", "fp32")
    _run(tmp_path, "fp8-smooth", "fp8-smooth", "fp32")
    figures = {}
    monkeypatch.setattr(plots, "_save", lambda fig, path, plt: figures.setdefault(path.name, fig) and path)
    plots.plot_runs(tmp_path)
    assert set(figures) == {"loss.png", "max_activation.png", "alignment.png"}
    for name in ("max_activation.png", "alignment.png"):
        ax = figures[name].axes[0]
        assert ax.get_ylabel()
        colour = {}
        for line in ax.get_lines():
            recipe, layer = line.get_label().split(": ")
            colour.setdefault(layer, set()).add(line.get_color())
        assert list(colour) == ["layers.0.mlp", "layers.1.mlp", "layers.10.mlp"]  # numeric order
        assert all(len(c) == 1 for c in colour.values()) and len({c.pop() for c in colour.values()}) == 3
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert "bf16 (ran in fp32): layers.0.mlp" in labels
        assert min(t.get_fontsize() for t in ax.get_legend().get_texts()) >= 8
