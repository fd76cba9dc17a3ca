"""Experiment 2: plain FP8 SwiGLU fails on an aligned, large-norm channel; Smooth-SwiGLU does not.

A short CPU run does not grow outlier channels by itself (the paper saw them after ~200B tokens), so
the channel is **planted** (experiments/outlier_plant.py), as the issue allows, and the method is
part of the result:

- At step ``--plant-at`` (default 50), in every layer, channel 0 of the SwiGLU gets
  ``w_gate[0] = w_up[0] = α·u`` (w1 = w2: the aligned state Theorem 1 predicts) with ``u`` a unit
  direction fitted on that layer's MLP inputs so that u·x > 0 on the tokens of a trigger byte
  (``--trigger``; default ``#``, 0.5% of the stdlib's bytes and in every batch; ``$`` is in ~2.5% of
  the batches, so delayed scales meet a sudden spike). Then h₀ = (α u·x)·Swish(α u·x) ≈ α²(u·x)² on
  the trigger's tokens: a token-sparse, quadratic outlier with ‖w1‖‖w2‖ = α². ``--plant`` chooses
  what u·x does on the other tokens:

  - ``saturated`` (default): u·x < 0, far from 0, on nearly all of them (logistic regression without
    bias, 300 Adam steps). The gate is shut there (h₀ ≈ 0) but the linear branch α·u·x is large on
    every token: the saturated neuron of Theorem 1's premise (σ′ → 0 on every sample).
  - ``sparse``: u·x ≈ 0 on them (weighted ridge regression onto 1 on the trigger, 0 elsewhere).

  The per-token Smooth-SwiGLU form takes its scale from the linear branch. ``saturated`` makes the
  planted channel's linear branch dominate that scale on every token; ``sparse`` less so (but a
  small u·x times a large α still does: docs/results/instability.md measures it).
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
docs/results/parity.md), and the largest excursion of each run's training loss over that bf16 run's. Phase B is a forward-only sweep: the seed-0 bf16 run's final weights
re-planted with α from 10 to 1000, validation loss per precision, to show where each form breaks.

Run: ``python -m experiments.instability`` (defaults: saturated plant, 4 seeds, 150 steps, lr 1.5e-3,
α = 300, trigger ``#``, 2 worker processes; 11 min on the idle 2-core machine). The commands of the
other recorded settings are in docs/results/instability.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch

import fp8pass
from experiments.common import paired_gaps, plot_seeds, run_dir, run_parallel
from experiments.outlier_plant import PLANTS, Planter, plant
from fp8pass.train import ModelConfig, TinyLlama, TrainConfig, load_text_data, train
from fp8pass.train.logging import read_metrics
from fp8pass.train.plots import plot_runs

GOAL_PCT = 1.0  # Smooth-SwiGLU (both forms) within 1% of bf16
RUNS = (("bf16", "bf16", "channel"), ("fp8", "fp8", "channel"), ("fp8-smooth-channel", "fp8-smooth", "channel"),
        ("fp8-smooth-token", "fp8-smooth", "token"))


@torch.no_grad()
def val_loss(fwd, data, seed, batches=8):
    tot = 0.0
    for i in range(batches):
        x, y = data.batch("val", 16, 128, seed, i)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            tot += fwd(x, y).item()
    return tot / batches


def forward_for(model, recipe, smooth, data, seed):
    """The callable that evaluates ``model`` in a recipe's precision: the model itself for bf16, else
    compiled with the fp8 backend, its delayed-scaling histories filled on 2 validation batches."""
    if recipe == "bf16":
        return model
    cfg = fp8pass.Config(smooth_swiglu=smooth if recipe == "fp8-smooth" else None, compiler="eager")
    fwd = torch.compile(model, backend=fp8pass.backend(cfg))
    val_loss(fwd, data, seed, 2)
    return fwd


def sweep(weights, dirs, cols, data, alphas, seed):
    """Validation loss of the same weights, planted with each α, per precision (own model copies)."""
    out = []
    for alpha in alphas:
        row = {"alpha": alpha}
        for name, recipe, smooth in RUNS:
            m = TinyLlama(ModelConfig())
            m.load_state_dict(weights)
            plant(m, dirs, alpha, cols)
            row[name] = val_loss(forward_for(m, recipe, smooth, data, seed), data, seed)
            torch._dynamo.reset()
        print("sweep", {k: round(v, 4) for k, v in row.items()}, flush=True)
        out.append(row)
    return out


RESULT = "instability_result.json"  # in each run directory: the job and its result, for reuse


def finished(job: dict) -> dict | None:
    """The result of ``job`` if its run directory holds one for exactly this job (plant included)."""
    path = Path(job["config"]["out"]) / RESULT
    if not path.exists() or not (path.parent / "checkpoint.pt").exists():
        return None
    saved = json.loads(path.read_text())
    if saved["job"] != job:
        return None
    r = saved["result"]
    for key in ("val_loss", "train_loss"):
        r[key] = {int(k): v for k, v in r.get(key, {}).items()}
    return {**r, "reused": True}


def train_one(job: dict) -> dict:
    """One (recipe, seed) run with the plant, in a worker process; saves the plant for the sweep.
    A run already finished in its directory for the same job is reused (:func:`finished`)."""
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    done = finished(job)
    if done is not None:
        return done
    data = load_text_data()
    info = {}
    planter = Planter(data, job["plant_at"], job["alpha"], job["seed"], info, job["plant"], ord(job["trigger"]))
    cfg = TrainConfig(**job["config"])
    t = time.perf_counter()
    r = train(cfg, data=data, callbacks=[planter], grad_callbacks=[planter.zero_grads])
    if planter.dirs is not None:
        torch.save({"dirs": planter.dirs, "cols": planter.cols}, Path(cfg.out) / "plant.pt")
    tr = read_metrics(Path(cfg.out) / "metrics.jsonl", "train")
    ev = read_metrics(Path(cfg.out) / "metrics.jsonl", "eval")
    at = job["plant_at"]
    result = {"name": job["name"], "seed": cfg.seed, "status": r.status, "final_val_loss": r.final_val_loss,
              "wall_s": time.perf_counter() - t, **info,
              "val_loss": {int(e["step"]): e["val_loss"] for e in ev},
              "train_loss": {int(x["step"]): x["loss"] for x in tr},
              "train_loss_before_plant_mean10": sum(x["loss"] for x in tr if at - 10 < x["step"] <= at) / 10,
              "train_loss_max_after_plant": max((x["loss"] for x in tr if x["step"] > at), default=float("nan")),
              "grad_norm_max_after_plant": max((x["grad_norm"] for x in tr if x["step"] > at), default=float("nan"))}
    (Path(cfg.out) / RESULT).write_text(json.dumps({"job": job, "result": result}, default=float))
    return result


def loss_spikes(runs: list[dict], baseline: str, after: int, window: int = 5) -> dict:
    """Per run name, per seed (ascending): the largest excess (%) of the ``window``-step mean training loss over
    the same seed's baseline run at the same steps (same batches), after step ``after``. A loss spike
    shows here even when the run recovers before its final validation."""
    base = {r["seed"]: r["train_loss"] for r in runs if r["name"] == baseline}
    out = {}
    for r in sorted(runs, key=lambda r: r["seed"]):
        if r["name"] == baseline or r["seed"] not in base or not r.get("train_loss"):
            continue
        b, x = base[r["seed"]], r["train_loss"]
        steps = sorted(k for k in x if k > after and k in b)
        means = [(sum(x[k] for k in steps[i:i + window]), sum(b[k] for k in steps[i:i + window]))
                 for i in range(len(steps) - window + 1)]
        out.setdefault(r["name"], []).append(max((100 * (a - c) / c for a, c in means), default=float("nan")))
    return out


def build_jobs(args, seeds, runs) -> list[dict]:
    jobs = [{"name": name, "seed": seed, "plant_at": args.plant_at, "alpha": args.alpha, "plant": args.plant,
             "trigger": args.trigger,
             "config": {"recipe": recipe, "smooth": smooth, "steps": args.steps, "lr": args.lr, "seed": seed,
                        "out": str(run_dir(runs, seed, name)), "eval_every": 25, "ckpt_every": args.steps,
                        "monitor_every": 25, "progress": False}}
            for seed in seeds for name, recipe, smooth in RUNS]
    return sorted(jobs, key=lambda j: j["name"] == "bf16")  # fp8 runs (slower) first


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/results")
    ap.add_argument("--runs", default=None, help="run directories: RUNS/seedS/NAME (default runs/TAG)")
    ap.add_argument("--plant", choices=list(PLANTS), default="saturated",
                    help="; ".join(f"{k}: {v}" for k, v in PLANTS.items()))
    ap.add_argument("--trigger", default="#", help="the byte on which the planted channel fires "
                    "('#': in every batch; '$': in ~2.5%% of batches, so delayed scales meet a sudden spike)")
    ap.add_argument("--tag", default=None, help="prefix of the result files (default: instability, "
                    "instability_sparse for --plant sparse)")
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
    if len(args.trigger) != 1 or ord(args.trigger) > 255:
        ap.error(f"--trigger takes one byte (a character with code < 256), got {args.trigger!r}")
    seeds = [int(x) for x in args.seeds.split(",")]
    tag = args.tag or ("instability" if args.plant == "saturated" else f"instability_{args.plant}")
    args.runs = args.runs or f"runs/{tag}"
    names = [name for name, _, _ in RUNS]
    out, runs = Path(args.out), Path(args.runs)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    report = {"args": vars(args), "goal_pct": GOAL_PCT}
    jobs = build_jobs(args, seeds, runs)
    if not args.skip_train:
        report["runs"] = run_parallel(train_one, jobs, args.workers, lambda r: print(
            f"{r['name']:20s} seed {r['seed']}  {r['status']:8s} val {r['final_val_loss']:.4f}  "
            f"{r['wall_s']:.0f}s" + (" (reused)" if r.get("reused") else ""), flush=True))
        report["summary"] = paired_gaps(report["runs"], "bf16")
        report["spikes"] = loss_spikes(report["runs"], "bf16", args.plant_at)
        for name, s in report["summary"].items():
            print(f"  {name:20s} gap to bf16: mean {s['mean_gap_pct']:+.2f}%  s.e. {s['stderr_pct']:.2f}  "
                  f"per seed {', '.join(f'{g:+.2f}' for g in s['gaps_pct'])}  "
                  f"largest train-loss excess {', '.join(f'{g:+.1f}' for g in report['spikes'].get(name, []))}%")

    # Phase B: the seed-0 bf16 run's final weights, its plant directions and pre-plant w_down columns.
    first = run_dir(runs, seeds[0], "bf16")
    if (first / "plant.pt").exists():
        plant_info = torch.load(first / "plant.pt", weights_only=True)
        weights = torch.load(first / "checkpoint.pt", weights_only=True)["model"]
        report["sweep"] = sweep(weights, plant_info["dirs"], plant_info["cols"], load_text_data(), alphas, seeds[0])
    report["wall_s"] = time.perf_counter() - t0
    (out / f"{tag}.json").write_text(json.dumps(report, indent=1, default=float))
    if "summary" in report:
        plot_seeds(runs, names, seeds, report["summary"], GOAL_PCT, out / f"{tag}_seeds.png",
                   title=f"{args.plant} plant, α = {args.alpha:g}, trigger {args.trigger!r}, at step {args.plant_at}; band: min-max over seeds")
    written = plot_runs(runs / f"seed{seeds[0]}", out_dir=runs / f"seed{seeds[0]}")
    if written:
        import shutil
        shutil.copy(runs / f"seed{seeds[0]}" / "loss.png", out / f"{tag}_loss.png")
        if (runs / f"seed{seeds[0]}" / "max_activation.png").exists():
            shutil.copy(runs / f"seed{seeds[0]}" / "max_activation.png", out / f"{tag}_max_activation.png")
    if "sweep" in report:
        plot_sweep(report["sweep"], out / f"{tag}_sweep.png")
    if report.get("runs"):  # the seed where plain FP8's training loss strays furthest from bf16's
        spikes = report["spikes"].get("fp8", [])
        worst = max(zip(spikes, sorted(seeds)))[1] if len(spikes) == len(seeds) else seeds[0]
        plot_excess(report["runs"], worst, args, out / f"{tag}_excess.png")
    print(f"wall {report['wall_s'] / 60:.1f} min")
    return 0


def plot_excess(runs, seed, args, path, window=5):
    """Seed ``seed``: each FP8 recipe's training loss over bf16's at the same step (``window``-step
    means), with the steps whose batch contains the trigger byte marked."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("excess plot skipped: matplotlib is not installed")
        return
    by = {r["name"]: r["train_loss"] for r in runs if r["seed"] == seed and r.get("train_loss")}
    if "bf16" not in by:
        return
    data = load_text_data()
    cfg = TrainConfig()
    base = by["bf16"]
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for name, curve in by.items():
        if name == "bf16":
            continue
        steps = sorted(k for k in curve if k in base)
        xs, ys = [], []
        for i in range(len(steps) - window + 1):
            w = steps[i:i + window]
            xs.append(w[-1])
            ys.append(100 * (sum(curve[k] for k in w) / sum(base[k] for k in w) - 1))
        ax.plot(xs, ys, label=name)
    hits = [k for k in sorted(base) if k > args.plant_at and bool(
        (data.batch("train", cfg.batch_size, cfg.seq_len, seed, k - 1)[0] == ord(args.trigger)).any())]
    sparse_hits = len(hits) <= 0.5 * sum(1 for k in base if k > args.plant_at)
    for k in hits if sparse_hits else []:  # a trigger in most batches would grey out the plot
        ax.axvline(k, color="grey", lw=0.6, alpha=0.5)
    ax.axvline(args.plant_at, color="k", ls="--", lw=0.8)
    ax.set_xlabel(f"step (dashed: plant; grey: batches containing {args.trigger!r})" if sparse_hits else
                  f"step (dashed: plant; {len(hits)} of the batches after it contain {args.trigger!r})")
    ax.set_ylabel(f"train loss over bf16 (%, {window}-step mean)")
    ax.set_title(f"seed {seed} (plain FP8's largest excess): {args.plant} plant, α = {args.alpha:g}, "
                 f"trigger {args.trigger!r}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


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
