"""The experiments' shared statistics (paired per-seed gaps) and a smoke run of the parity experiment."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))
from common import gap_pct, paired_gaps  # noqa: E402


def test_paired_gaps_compare_each_run_with_the_same_seeds_baseline():
    res = [{"name": "bf16", "seed": 0, "v": 2.0}, {"name": "bf16", "seed": 1, "v": 1.0},
           {"name": "fp8", "seed": 0, "v": 2.02}, {"name": "fp8", "seed": 1, "v": 1.03},
           {"name": "bad", "seed": 0, "v": float("nan")}, {"name": "bad", "seed": 1, "v": 1.0}]
    s = paired_gaps(res, "bf16", key="v")
    assert s["fp8"]["gaps_pct"] == pytest.approx([1.0, 3.0])  # not (2.02+1.03)/(2+1): per seed
    assert s["fp8"]["mean_gap_pct"] == pytest.approx(2.0)
    assert s["fp8"]["std_pct"] == pytest.approx(math.sqrt(2.0))
    assert s["fp8"]["stderr_pct"] == pytest.approx(1.0)
    assert s["bad"]["gaps_pct"] == [0.0] and s["bad"]["not_finite"] == [0]  # a diverged run is reported
    assert math.isnan(s["bad"]["stderr_pct"])
    assert "bf16" not in s and gap_pct(1.1, 1.0) == pytest.approx(10.0)


@pytest.mark.slow
def test_parity_experiment_runs_end_to_end(tmp_path):
    cmd = [sys.executable, str(ROOT / "experiments" / "parity.py"), "--steps", "2", "--seeds", "0,1",
           "--runs", "bf16,fp8-smooth", "--workers", "2", "--eval-batches", "1",
           "--out", str(tmp_path / "out"), "--runs-dir", str(tmp_path / "runs")]
    subprocess.run(cmd, check=True, cwd=ROOT, timeout=600, capture_output=True)
    rep = json.loads((tmp_path / "out" / "parity.json").read_text())
    assert sorted((r["name"], r["seed"]) for r in rep["results"]) == [
        ("bf16", 0), ("bf16", 1), ("fp8-smooth", 0), ("fp8-smooth", 1)]
    assert len(rep["summary"]["fp8-smooth"]["gaps_pct"]) == 2
    assert all(g != 0 for g in rep["summary"]["fp8-smooth"]["gaps_pct"])  # fp8 really ran (not bf16)
    assert (tmp_path / "runs" / "seed1" / "fp8-smooth" / "checkpoint.pt").exists()


def test_finished_run_is_reused_only_with_the_same_config(tmp_path):
    from common import finished_run

    from fp8pass.train import ModelConfig, TrainConfig, train
    (tmp_path / "c.txt").write_text("".join(f"x{i} = {i} * y\n" for i in range(300)))
    cfg = TrainConfig(recipe="bf16", steps=3, out=str(tmp_path / "run"), data=str(tmp_path / "c.txt"), batch_size=2,
                      seq_len=16, model=ModelConfig(d_model=16, n_layers=1, n_heads=2, ffn=32, max_seq_len=16),
                      eval_every=2, eval_batches=1, ckpt_every=3, monitor_every=0, warmup=1, progress=False)
    assert finished_run(cfg) is None
    r = train(cfg)
    done = finished_run(cfg)
    assert done["final_val_loss"] == r.final_val_loss and done["seed"] == cfg.seed and done["reused"]
    cfg.lr *= 2
    assert finished_run(cfg) is None           # another configuration: train again
    cfg.lr /= 2
    cfg.steps = 5
    assert finished_run(cfg) is None           # more steps than were run
