"""The experiments' shared statistics (paired per-seed gaps) and a smoke run of the parity experiment."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
from experiments.common import gap_pct, paired_gaps


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
    cmd = [sys.executable, "-m", "experiments.parity", "--steps", "2", "--seeds", "0,1",
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
    from experiments.common import finished_run
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


def test_instability_plants_have_the_defining_pre_activation_and_keep_w1_equal_w2():
    """saturated: u·x far below 0 off the trigger byte (Theorem 1's σ′ → 0); sparse: u·x ≈ 0 there.
    Both: u·x > 0 on the trigger byte, w_gate row = w_up row = α·u, and w_down's column divided by α²."""
    import torch

    from experiments.outlier_plant import fit_directions, plant
    from fp8pass.train import ModelConfig, TinyLlama, load_text_data
    torch.manual_seed(0)
    data = load_text_data()
    model = TinyLlama(ModelConfig(d_model=32, n_layers=2, n_heads=2, ffn=64))
    sat, sat_stats = fit_directions(model, data, 0, "saturated")
    sparse, sparse_stats = fit_directions(model, data, 0, "sparse")
    for s, p in zip(sat_stats, sparse_stats):
        assert s["ux_on_trigger_mean"] > 0 and p["ux_on_trigger_mean"] > 0
        assert s["others_positive_frac"] < 0.1                         # the gate is shut off the trigger...
        assert s["others_abs_mean"] > 0.5 * s["ux_on_trigger_mean"]           # ...but the linear branch is large
        assert p["others_abs_mean"] < 0.2 * p["ux_on_trigger_mean"]           # sparse: small off the trigger
    assert all(torch.linalg.vector_norm(u).item() == pytest.approx(1.0) for u in sat + sparse)
    cols = [layer.mlp.down_proj.weight[:, 0].detach().clone() for layer in model.layers]
    plant(model, sparse, 300.0, cols)
    for layer, u, col in zip(model.layers, sparse, cols):
        assert torch.equal(layer.mlp.gate_proj.weight[0], layer.mlp.up_proj.weight[0])
        assert torch.allclose(layer.mlp.gate_proj.weight[0], 300.0 * u)
        assert torch.allclose(layer.mlp.down_proj.weight[:, 0] * 300.0 ** 2, col)
    with pytest.raises(ValueError, match="unknown plant 'dense'"):
        fit_directions(model, data, 0, "dense")


def test_instability_reuses_a_finished_run_only_for_the_same_plant(tmp_path):
    import json as _json

    from experiments.instability import RESULT, finished
    job = {"name": "fp8", "seed": 0, "plant_at": 50, "alpha": 200.0, "plant": "sparse",
           "config": {"recipe": "fp8", "steps": 150, "out": str(tmp_path)}}
    assert finished(job) is None
    (tmp_path / RESULT).write_text(_json.dumps({"job": job, "result": {"final_val_loss": 2.5, "val_loss": {"25": 3.0}}}))
    assert finished(job) is None                      # no checkpoint: the run did not finish
    (tmp_path / "checkpoint.pt").write_bytes(b"")
    assert finished(job) == {"final_val_loss": 2.5, "val_loss": {25: 3.0}, "train_loss": {}, "reused": True}
    assert finished({**job, "alpha": 300.0}) is None  # another plant: train again
    assert finished({**job, "plant": "saturated"}) is None


def test_instability_fit_sample_adds_windows_for_a_rare_trigger_and_rejects_an_absent_one():
    from experiments.outlier_plant import fit_sample
    from fp8pass.train import load_text_data
    data = load_text_data()
    for seed in (0, 2):   # seed 2's batches hold only 29 '#': still enough, the recorded plants stay as they were
        common = fit_sample(data, seed, ord("#"))
        assert common.shape == (64, 128) and int((common == ord("#")).sum()) >= 8   # 4 random batches suffice
    rare = fit_sample(data, 0, ord("$"))
    assert rare.shape == (128, 128) and int((rare == ord("$")).sum()) >= 64        # + 64 windows with a '$'
    with pytest.raises(ValueError, match="does not occur"):
        fit_sample(data, 0, 0)


def test_loss_spikes_are_paired_by_seed_and_step_after_the_plant():
    from experiments.instability import loss_spikes
    base = {s: 2.0 for s in range(1, 21)}
    spiky = {**base, 12: 3.0}                                      # one step 50% above bf16
    runs = [{"name": "bf16", "seed": 0, "train_loss": base}, {"name": "fp8", "seed": 0, "train_loss": spiky},
            {"name": "bf16", "seed": 1, "train_loss": {**base, 12: 3.0}}, {"name": "fp8", "seed": 1, "train_loss": spiky}]
    out = loss_spikes(runs, "bf16", after=5, window=5)
    assert out["fp8"][0] == pytest.approx(10.0)   # 5-step mean: (4*2 + 3) / (5*2) - 1
    assert out["fp8"][1] == pytest.approx(0.0)    # seed 1's baseline spiked at the same step: no excess
    assert loss_spikes(runs, "bf16", after=15, window=5)["fp8"] == [0.0, 0.0]   # the spike was before `after`


def test_instability_mechanism_token_scale_stats_see_the_planted_channel():
    """The planted channel inflates the token scale r_t and the token form's operand keeps an outlier
    far smaller than h's (linear rather than quadratic in α)."""
    import torch

    from experiments.instability_mechanism import token_scale_stats
    from experiments.outlier_plant import fit_directions, plant
    from fp8pass.train import ModelConfig, TinyLlama, load_text_data
    torch.manual_seed(0)
    data = load_text_data()
    model = TinyLlama(ModelConfig(d_model=32, n_layers=2, n_heads=2, ffn=64))
    x = data.batch("val", 4, 64, 0, 0)[0]
    before = token_scale_stats(model, x, ord("#"))
    dirs, _ = fit_directions(model, data, 0, "saturated")
    plant(model, dirs, 100.0, [layer.mlp.down_proj.weight[:, 0].detach().clone() for layer in model.layers])
    after = token_scale_stats(model, x, ord("#"))
    for b, a in zip(before, after):
        assert a["r_inflation_median"] > 10 * b["r_inflation_median"]
        assert a["amax_h"] > 100 * b["amax_h"]
        assert a["amax_A"] < a["amax_h"] / 10
        assert a["median_ordinary_A"] < b["median_ordinary_A"] / 10


def test_moments_experiment_runs_the_papers_form_beside_the_storage_variants():
    from experiments import moments
    from fp8pass.train import TrainConfig

    cfgs = {n: TrainConfig(**moments.variant_config(n, steps=3, lr=1e-3, seed=1, out="x")) for n in moments.VARIANTS}
    assert cfgs["fp32"].recipe == "bf16"  # torch AdamW, fp32 moments
    combos = set()
    for name in moments.PAPER:
        if name == "fp32":
            continue
        c = cfgs[name]
        assert (c.recipe, c.v_sqrt, c.moment_block_size) == ("bf16-fp8adam", False, None), name  # v itself, per tensor
        combos.add((c.m_format, c.v_format))
    assert combos == {(m, v) for m in ("e4m3", "e5m2") for v in ("e4m3", "e5m2")}
    side = {n: (cfgs[n].v_sqrt, cfgs[n].moment_block_size) for n in moments.SIDE}
    assert side == {"m-e4m3_sqrtv-e5m2": (True, None), "m-e4m3_v-e5m2_b128": (False, 128),
                    "m-e4m3_sqrtv-e5m2_b128": (True, 128)}
    assert all(cfgs[n].m_format == "e4m3" and cfgs[n].v_format == "e5m2" for n in moments.SIDE)


def test_v_storage_measurement_uses_the_stored_m_and_sees_the_range_limits():
    from experiments import optim_v_storage as vs

    exact = vs.run(6, 0.95, 12, None, dict(m_format="fp32", v_format="fp32"))
    assert exact["median"] == 0 and exact["too_large"] == 0 and exact["v_alone"]["max_ratio"] == 1
    m_only = vs.run(6, 0.95, 12, None, dict(v_format="fp32"))
    assert m_only["v_alone"]["max_ratio"] == 1 and m_only["too_large"] > 0  # E4M3 m's own error is counted
    sqrt_v = vs.run(6, 0.95, 12, None, dict(v_sqrt=True))
    assert sqrt_v["v_alone"]["max_ratio"] < 2  # sqrt(v) in E5M2 spans 2^31.8 in |g|: no flush at 1e6
    v_e4m3 = vs.run(6, 0.95, 12, None, dict(v_sqrt=False, v_format="e4m3"))
    assert v_e4m3["v_alone"]["too_large"] > 0.3  # v in E4M3 spans 2^8.9 in |g|: most small v flush to 0
