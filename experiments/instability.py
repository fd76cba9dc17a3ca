"""Experiment 2: plain FP8 SwiGLU fails on an aligned, large-norm channel; Smooth-SwiGLU does not.

A short CPU run does not grow outlier channels by itself (the paper saw them after ~200B tokens), so
the channel is **planted**, as the issue allows, and the method is part of the result:

- At step ``--plant-at`` (default 50), in every layer, channel 0 of the SwiGLU gets
  ``w_gate[0] = w_up[0] = α·u`` (w1 = w2: the aligned state Theorem 1 predicts) with ``u`` a unit
  direction fitted on that layer's MLP inputs so that u·x > 0 on the tokens of byte ``#`` (0.5% of
  the stdlib's bytes) and < 0 on nearly all others (logistic regression without bias, 300 Adam
  steps). Then h₀ = (α u·x)·Swish(α u·x) ≈ α²(u·x)² on ``#`` tokens and ≈ 0 elsewhere: a
  token-sparse, quadratic outlier with ‖w1‖‖w2‖ = α².
- ``w_down[:, 0]`` is divided by α² at the same moment, so that in exact arithmetic the model's
  function barely changes: any loss difference after the plant comes from how each precision
  represents the outlier, not from a changed model.
- The planted entries are frozen: their gradients are zeroed before clipping (else their huge
  gradients, ∝ h₀, would dominate the global norm and clipping would stall every other weight) and
  they are re-pinned after every optimizer step (Adam's momentum would otherwise move the tiny
  ``w_down`` column by ~lr and blow up the bf16 model too); every other weight trains.

Phase A trains bf16, fp8 (plain SwiGLU), fp8-smooth (channel, the paper) and fp8-smooth with the
token form (reference code), each on several seeds (same seed = same initialisation, data, plant and
validation batches), and reports each fp8 run's final validation-loss gap to the same seed's bf16
run: mean over seeds and standard error (one run carries ~1-2% of chaotic noise here, see
docs/results/parity.md). Phase B is a forward-only sweep: the seed-0 bf16 run's final weights
re-planted with α from 10 to 1000, validation loss per precision, to show where each form breaks.

Run: ``python experiments/instability.py`` (defaults: 4 seeds, 150 steps, lr 1.5e-3, α = 300, 2
worker processes; 11 min on the idle 2-core machine).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fp8pass  # noqa: E402
from fp8pass.train import ModelConfig, TinyLlama, TrainConfig, load_text_data, train  # noqa: E402
from fp8pass.train.logging import read_metrics  # noqa: E402
from fp8pass.train.plots import plot_runs  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import paired_gaps, plot_seeds, run_dir, run_parallel  # noqa: E402

BYTE = ord("#")
GOAL_PCT = 1.0  # Smooth-SwiGLU (both forms) within 1% of bf16
RUNS = (("bf16", "bf16", "channel"), ("fp8", "fp8", "channel"), ("fp8-smooth-channel", "fp8-smooth", "channel"),
        ("fp8-smooth-token", "fp8-smooth", "token"))


@torch.no_grad()
def mlp_inputs(model, tokens):
    xs = {}
    hooks = [layer.mlp.register_forward_pre_hook(
        lambda mod, a, i=i: xs.__setitem__(i, a[0].detach().reshape(-1, a[0].shape[-1]).float()))
        for i, layer in enumerate(model.layers)]
    try:
        model(tokens)
    finally:
        for h in hooks:
            h.remove()
    return xs


def fit_directions(model, data, seed):
    """Per layer, a unit u with u·x > 0 on ``#`` tokens and < 0 elsewhere (no bias)."""
    tokens = torch.cat([data.batch("train", 16, 128, seed + 777, s)[0] for s in range(4)])
    labels = (tokens.reshape(-1) == BYTE).float()
    weight = torch.where(labels > 0, 1.0 / labels.mean(), 1.0)
    dirs, stats = [], []
    for i, x in sorted(mlp_inputs(model, tokens).items()):
        u = torch.zeros(x.shape[1], requires_grad=True)
        opt = torch.optim.Adam([u], lr=0.05)
        for _ in range(300):
            loss = torch.nn.functional.binary_cross_entropy_with_logits(x @ u, labels, weight=weight)
            opt.zero_grad()
            loss.backward()
            opt.step()
        u = (u / u.norm()).detach()
        z = x @ u
        stats.append({"layer": i, "ux_on_#_mean": z[labels > 0].mean().item(),
                      "others_positive_frac": (z[labels == 0] > 0).float().mean().item()})
        dirs.append(u)
    return dirs, stats


def plant(model, dirs, alpha, down_cols):
    with torch.no_grad():
        for layer, u, col in zip(model.layers, dirs, down_cols):
            layer.mlp.gate_proj.weight[0] = alpha * u
            layer.mlp.up_proj.weight[0] = alpha * u
            layer.mlp.down_proj.weight[:, 0] = col / alpha ** 2


class Planter:
    """Trainer callback: plant at ``at``, then re-pin after every step."""

    def __init__(self, data, at, alpha, seed, log_to):
        self.data, self.at, self.alpha, self.seed, self.log_to = data, at, alpha, seed, log_to
        self.dirs = None

    def __call__(self, step, model, log, final=False):
        if step < self.at:
            return
        if self.dirs is None:
            self.dirs, stats = fit_directions(model, self.data, self.seed)
            self.cols = [layer.mlp.down_proj.weight[:, 0].detach().clone() for layer in model.layers]
            log({"kind": "plant", "step": step, "alpha": self.alpha, "directions": stats})
            self.log_to.update(directions=stats)
        plant(model, self.dirs, self.alpha, self.cols)

    def zero_grads(self, step, model):
        if self.dirs is None:
            return
        for layer in model.layers:
            mlp = layer.mlp
            for w, idx in ((mlp.gate_proj.weight, 0), (mlp.up_proj.weight, 0)):
                if w.grad is not None:
                    w.grad[idx] = 0
            if mlp.down_proj.weight.grad is not None:
                mlp.down_proj.weight.grad[:, 0] = 0


@torch.no_grad()
def val_loss(fwd, data, seed, batches=8):
    tot = 0.0
    for i in range(batches):
        x, y = data.batch("val", 16, 128, seed, i)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            tot += fwd(x, y).item()
    return tot / batches


def sweep(weights, dirs, cols, data, alphas, seed):
    """Validation loss of the same weights, planted with each α, per precision (own model copies)."""
    out = []
    for alpha in alphas:
        row = {"alpha": alpha}
        for name, recipe, smooth in RUNS:
            m = TinyLlama(ModelConfig())
            m.load_state_dict(weights)
            plant(m, dirs, alpha, cols)
            if recipe == "bf16":
                fwd = m
            else:
                cfg = fp8pass.Config(smooth_swiglu=smooth if recipe == "fp8-smooth" else None, compiler="eager")
                fwd = torch.compile(m, backend=fp8pass.backend(cfg))
                val_loss(fwd, data, seed, 2)          # fill the delayed-scaling histories first
            row[name] = val_loss(fwd, data, seed)
            torch._dynamo.reset()
        print("sweep", {k: round(v, 4) for k, v in row.items()}, flush=True)
        out.append(row)
    return out


def train_one(job: dict) -> dict:
    """One (recipe, seed) run with the plant, in a worker process; saves the plant for the sweep."""
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    data = load_text_data()
    info = {}
    planter = Planter(data, job["plant_at"], job["alpha"], job["seed"], info)
    cfg = TrainConfig(**job["config"])
    t = time.perf_counter()
    r = train(cfg, data=data, callbacks=[planter], grad_callbacks=[planter.zero_grads])
    if planter.dirs is not None:
        torch.save({"dirs": planter.dirs, "cols": planter.cols}, Path(cfg.out) / "plant.pt")
    tr = read_metrics(Path(cfg.out) / "metrics.jsonl", "train")
    ev = read_metrics(Path(cfg.out) / "metrics.jsonl", "eval")
    at = job["plant_at"]
    return {"name": job["name"], "seed": cfg.seed, "status": r.status, "final_val_loss": r.final_val_loss,
            "wall_s": time.perf_counter() - t, **info,
            "val_loss": {int(e["step"]): e["val_loss"] for e in ev},
            "train_loss_before_plant_mean10": sum(x["loss"] for x in tr if at - 10 < x["step"] <= at) / 10,
            "train_loss_max_after_plant": max((x["loss"] for x in tr if x["step"] > at), default=float("nan")),
            "grad_norm_max_after_plant": max((x["grad_norm"] for x in tr if x["step"] > at), default=float("nan"))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/results")
    ap.add_argument("--runs", default="runs/instability", help="run directories: RUNS/seedS/NAME")
    ap.add_argument("--seeds", default="0,1,2,3")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--plant-at", type=int, default=50)
    ap.add_argument("--alpha", type=float, default=300.0)
    ap.add_argument("--sweep", default="10,30,100,300,1000", help="α values (> 0) of the forward-only sweep")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--skip-train", action="store_true", help="reuse the runs in --runs (phase B only)")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    alphas = [float(a) for a in args.sweep.split(",")]
    if any(a <= 0 for a in alphas):
        ap.error("--sweep takes α > 0 (α = 0 would divide w_down by 0)")
    seeds = [int(x) for x in args.seeds.split(",")]
    names = [name for name, _, _ in RUNS]
    out, runs = Path(args.out), Path(args.runs)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    report = {"args": vars(args), "goal_pct": GOAL_PCT}
    jobs = [{"name": name, "seed": seed, "plant_at": args.plant_at, "alpha": args.alpha,
             "config": {"recipe": recipe, "smooth": smooth, "steps": args.steps, "lr": args.lr, "seed": seed,
                        "out": str(run_dir(runs, seed, name)), "eval_every": 25, "ckpt_every": args.steps,
                        "monitor_every": 25, "progress": False}}
            for seed in seeds for name, recipe, smooth in RUNS]
    jobs.sort(key=lambda j: j["name"] == "bf16")  # fp8 runs (slower) first
    if not args.skip_train:
        report["runs"] = run_parallel(train_one, jobs, args.workers, lambda r: print(
            f"{r['name']:20s} seed {r['seed']}  {r['status']:8s} val {r['final_val_loss']:.4f}  "
            f"{r['wall_s']:.0f}s", flush=True))
        report["summary"] = paired_gaps(report["runs"], "bf16")
        for name, s in report["summary"].items():
            print(f"  {name:20s} gap to bf16: mean {s['mean_gap_pct']:+.2f}%  s.e. {s['stderr_pct']:.2f}  "
                  f"per seed {', '.join(f'{g:+.2f}' for g in s['gaps_pct'])}")

    # Phase B: the seed-0 bf16 run's final weights, its plant directions and pre-plant w_down columns.
    first = run_dir(runs, seeds[0], "bf16")
    if (first / "plant.pt").exists():
        plant_info = torch.load(first / "plant.pt", weights_only=True)
        weights = torch.load(first / "checkpoint.pt", weights_only=True)["model"]
        report["sweep"] = sweep(weights, plant_info["dirs"], plant_info["cols"], load_text_data(), alphas, seeds[0])
    report["wall_s"] = time.perf_counter() - t0
    (out / "instability.json").write_text(json.dumps(report, indent=1, default=float))
    if "summary" in report:
        plot_seeds(runs, names, seeds, report["summary"], GOAL_PCT, out / "instability_seeds.png",
                   title=f"planted channel (α = {args.alpha:g} at step {args.plant_at}); band: min-max over seeds")
    written = plot_runs(runs / f"seed{seeds[0]}", out_dir=runs / f"seed{seeds[0]}")
    if written:
        import shutil
        shutil.copy(runs / f"seed{seeds[0]}" / "loss.png", out / "instability_loss.png")
        if (runs / f"seed{seeds[0]}" / "max_activation.png").exists():
            shutil.copy(runs / f"seed{seeds[0]}" / "max_activation.png", out / "instability_max_activation.png")
    if "sweep" in report:
        plot_sweep(report["sweep"], out / "instability_sweep.png")
    print(f"wall {report['wall_s'] / 60:.1f} min")
    return 0


def plot_sweep(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("sweep plot skipped: matplotlib is not installed")
        return
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    xs = [r["alpha"] for r in rows]
    for name, _, _ in RUNS:
        ax.plot(xs, [r[name] for r in rows], "o-", label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("α (planted ‖w1‖ = ‖w2‖ = α)")
    ax.set_ylabel("validation loss")
    ax.set_title("same weights, planted outlier of growing norm")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
