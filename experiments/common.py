"""What the multi-seed experiments share: a pool of single-threaded training processes and paired gaps.

Small numerical differences grow chaotically through training, so one run per recipe carries noise of
the size of the effects measured here (docs/results/parity.md measured it). The experiments therefore
train every recipe on several seeds and compare each run with the baseline run *of the same seed*
(same initialisation, data order and validation batches).
"""

from __future__ import annotations

import math
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Callable, Iterable

__all__ = ["run_parallel", "train_job", "gap_pct", "paired_gaps", "run_dir", "finished_run", "plot_seeds"]


def run_parallel(fn: Callable[[dict], dict], jobs: Iterable[dict], workers: int,
                 on_result: Callable[[dict], None] | None = None) -> list[dict]:
    """``fn(job)`` for every job, each in a fresh spawned process, ``workers`` at a time.

    A fresh process per job matters: Dynamo keeps compiled entries per code object, so models compiled
    one after another in one process share ``TinyLlama.forward``'s recompile limit (8); past it Dynamo
    silently runs the frame eagerly, and an "fp8" run would train in bf16. ``fn`` must be a
    module-level function of an importable module. Results come back in job order.
    """
    results = []
    with ProcessPoolExecutor(max_workers=max(1, workers), mp_context=get_context("spawn"),
                             max_tasks_per_child=1) as pool:
        for r in pool.map(fn, jobs):
            results.append(r)
            if on_result:
                on_result(r)
    return results


def train_job(job: dict) -> dict:
    """Train ``TrainConfig(**job["config"])`` in this (worker) process, single-threaded, and return
    ``{"name": job["name"], "seed", "status", "final_val_loss", ...}``. A run already finished in its
    directory with the same configuration is reused (:func:`finished_run`)."""
    import time
    import warnings

    import torch

    from fp8pass.train import TrainConfig, load_text_data, train
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    cfg = TrainConfig(**job["config"])
    done = finished_run(cfg)
    if done is not None:
        return {"name": job["name"], **done}
    t = time.perf_counter()
    r = train(cfg, data=load_text_data(cfg.data))
    return {"name": job["name"], "seed": cfg.seed, "status": r.status, "final_val_loss": r.final_val_loss,
            "final_train_loss": r.final_loss, "wall_s": time.perf_counter() - t}


def gap_pct(x: float, base: float) -> float:
    """Relative gap of ``x`` to ``base`` in percent."""
    return 100.0 * (x - base) / base


def paired_gaps(results: list[dict], baseline: str, key: str = "final_val_loss") -> dict:
    """Per run name: the gaps (%) of ``key`` to the same seed's ``baseline`` run, their mean, std and
    standard error. ``results`` are dicts with "name", "seed" and ``key``; runs whose value or whose
    baseline is not finite (a diverged run) are listed under "not_finite" instead of entering the mean.
    """
    base = {r["seed"]: r[key] for r in results if r["name"] == baseline}
    out = {}
    for name in dict.fromkeys(r["name"] for r in results if r["name"] != baseline):
        gaps, bad = [], []
        for r in results:
            if r["name"] != name:
                continue
            b = base.get(r["seed"], float("nan"))
            if math.isfinite(r[key]) and math.isfinite(b):
                gaps.append(gap_pct(r[key], b))
            else:
                bad.append(r["seed"])
        sd = statistics.stdev(gaps) if len(gaps) > 1 else float("nan")
        out[name] = {"gaps_pct": gaps, "not_finite": bad,
                     "mean_gap_pct": statistics.fmean(gaps) if gaps else float("nan"), "std_pct": sd,
                     "stderr_pct": sd / math.sqrt(len(gaps)) if len(gaps) > 1 else float("nan")}
    return out


def finished_run(cfg) -> dict | None:
    """The result of a run already finished in ``cfg.out`` with exactly this configuration, else None.

    Lets an experiment be re-run with more runs or seeds without retraining what it has (delete the
    run directory to force a rerun).
    """
    import json

    from fp8pass.train.logging import read_metrics

    out = Path(cfg.out)
    try:
        # runs save their configuration with precision="auto" resolved for the machine
        same = json.loads((out / "config.json").read_text()) == json.loads(json.dumps(cfg.resolved().to_dict()))
    except (OSError, ValueError):
        return None
    recs = read_metrics(out / "metrics.jsonl")
    end = [r for r in recs if r.get("kind") == "end"]
    evals = [r for r in recs if r.get("kind") == "eval"]
    train = [r for r in recs if r.get("kind") == "train"]
    if not (same and end and end[-1]["step"] == cfg.steps and evals and evals[-1]["step"] == cfg.steps):
        return None
    return {"seed": cfg.seed, "status": end[-1]["status"], "final_val_loss": evals[-1]["val_loss"],
            "final_train_loss": train[-1]["loss"] if train else float("nan"), "wall_s": end[-1]["wall_s"],
            "reused": True}


def run_dir(root: str | Path, seed: int, name: str) -> Path:
    """Where run ``name`` of ``seed`` trains: ROOT/seedS/NAME (so ``plot_runs(ROOT/seedS)`` plots a seed)."""
    return Path(root) / f"seed{seed}" / name


def plot_seeds(root: str | Path, names: list[str], seeds: list[int], summary: dict, goal_pct: float | None,
               path: str | Path, title: str = "") -> Path | None:
    """Two panels: validation loss per run (mean over seeds, band min-max) and the per-seed final gaps
    to the baseline ``names[0]`` with their mean +- 2 standard errors (against the goal band |gap| <
    ``goal_pct``, when there is a goal)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        return None
    from fp8pass.train.logging import read_metrics

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
    for k, name in enumerate(names):
        curves = [c for c in (read_metrics(run_dir(root, s, name) / "metrics.jsonl", "eval") for s in seeds) if c]
        if not curves:
            continue
        n = min(len(c) for c in curves)
        steps = [e["step"] for e in curves[0][:n]]
        vals = [[c[i]["val_loss"] for c in curves] for i in range(n)]
        line, = ax.plot(steps, [statistics.fmean(v) for v in vals], "o-", ms=3,
                        label=f"{name} (mean of {len(curves)} seeds)")
        ax.fill_between(steps, [min(v) for v in vals], [max(v) for v in vals], color=line.get_color(), alpha=0.15)
        if name in summary and summary[name]["gaps_pct"]:
            s = summary[name]
            bx.plot([k] * len(s["gaps_pct"]), s["gaps_pct"], "o", color=line.get_color(), alpha=0.6)
            err = 2 * s["stderr_pct"] if math.isfinite(s["stderr_pct"]) else 0.0
            bx.errorbar([k + 0.15], [s["mean_gap_pct"]], yerr=[err], fmt="s", color=line.get_color(), capsize=4)
    ax.set_xlabel("step"); ax.set_ylabel("validation loss (nats/byte)"); ax.set_yscale("log")
    ax.set_title(title or "validation loss (band: min-max over seeds)"); ax.grid(alpha=0.3); ax.legend(fontsize=7)
    if goal_pct:
        bx.axhspan(-goal_pct, goal_pct, color="green", alpha=0.1, label=f"goal: |gap| < {goal_pct}%")
    bx.axhline(0, color="k", lw=0.8)
    bx.set_xticks(range(len(names)), names, rotation=15, fontsize=7)
    bx.set_ylabel(f"final val-loss gap to {names[0]}, same seed (%)")
    bx.set_title("per seed (dots); mean ± 2 s.e. (squares)"); bx.grid(alpha=0.3)
    if goal_pct:
        bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
