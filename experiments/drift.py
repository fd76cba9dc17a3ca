"""Issue 30 item 8: the online drift check on the planted aligned-outlier failure (experiments/outlier_plant.py).

Per seed, the same planted outlier (saturated plant, alpha 300, trigger '#', planted at step 50 and frozen, as
experiments/instability.py's default setting, where plain FP8 ends +22.6% above bf16) is trained three ways:

- ``bf16``: the reference;
- ``fp8``: plain FP8 SwiGLU without the check (the control);
- ``fp8-fallback-nN``: plain FP8 with ``--drift-check N --on-drift fallback`` (``fp8pass.DriftCheck``): every N
  steps the step's micro-batch is replayed in high precision; a confirmed drift switches the blamed layers
  (a GLU without Smooth-SwiGLU: to the per-channel form) for the rest of the run.

``--ramp R`` grows alpha linearly from 0 at the plant to its value R steps later (an outlier that grows, as
the paper's do, instead of appearing at once); the plant direction is fitted at the plant step either way.

Reported per seed: the first check that saw the drift, the first that flagged an outlier (GLU MLP) layer and the
one that acted, every switch, the step at which the control's training loss first exceeds bf16's by more than 2% (the
departure), and the final validation-loss gaps to bf16 of the control and of the fallback run. The drift
run's records before its first switch are those of a plain FP8 run with the check on ("warn"): the check
changes no state (tests/monitor/test_drift.py), so until it acts that run is the control, step for step.

Run: ``python -m experiments.drift`` (4 seeds, 150 steps, N = 5, 2 worker processes; ``--ramp 50`` for the
growing outlier); results in docs/results/TAG.json and the table printed (docs/results/drift.md). The fallback
runs live in ``fp8-fallback-nN[-VARIANT]`` next to the bf16 and control runs, which every N and variant reuse;
``--only`` trains a subset (e.g. the bf16 and control runs first), ``--skip-train`` only summarizes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch

from experiments.common import gap_pct, run_dir, run_parallel
from experiments.outlier_plant import Planter
from fp8pass import DriftCheck
from fp8pass.train import TrainConfig, load_text_data, train
from fp8pass.train.logging import read_metrics

DEPART_PCT = 2.0   # "the loss departs from bf16": the control's training loss more than 2% above bf16's
GOAL_PCT = 1.0     # the fallback run's final validation gap to bf16
LOCAL_ERROR = DriftCheck.max_local_error  # the trainer's default threshold, what the fallback runs use
RUNS = (("bf16", "bf16", {}), ("fp8", "fp8", {}), ("fp8-fallback", "fp8", {"on_drift": "fallback"}))


class RampPlanter(Planter):
    """:class:`Planter` whose alpha grows linearly from 0 at the plant to ``alpha`` ``ramp`` steps later."""

    def __init__(self, *args, ramp: int = 0, **kw):
        super().__init__(*args, **kw)
        self.ramp, self.full = ramp, self.alpha

    def __call__(self, step, model, log, final=False):
        if self.ramp and step >= self.at:
            self.alpha = self.full * min(1.0, (step - self.at + 1) / self.ramp)
        super().__call__(step, model, log, final)


def train_one(job: dict) -> dict:
    """One (run, seed) in a worker process; a run already finished in its directory is kept."""
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    out = Path(job["config"]["out"])
    ends = read_metrics(out / "metrics.jsonl", "end") if (out / "metrics.jsonl").exists() else []
    if ends and ends[-1]["status"] == "finished" and (out / "job.json").exists() \
            and json.loads((out / "job.json").read_text()) == job:
        return {"name": job["name"], "seed": job["seed"], "reused": True}
    data = load_text_data()
    info = {}
    planter = RampPlanter(data, job["plant_at"], job["alpha"], job["seed"], info, ramp=job["ramp"])
    t = time.perf_counter()
    r = train(TrainConfig(**job["config"]), data=data, callbacks=[planter], grad_callbacks=[planter.zero_grads])
    (out / "job.json").write_text(json.dumps(job))
    return {"name": job["name"], "seed": job["seed"], "status": r.status, "wall_s": time.perf_counter() - t}


def fallback_name(every: int, variant: str = "") -> str:
    """The fallback run's folder, ``fp8-fallback-nN[-VARIANT]``, next to the bf16 and control runs it shares."""
    return f"fp8-fallback-n{every}" + (f"-{variant}" if variant else "")


def is_outlier_layer(weight: str) -> bool:
    """The planted outlier lives in every block's GLU MLP (outlier_plant.plant)."""
    return ".mlp." in weight


def summarize(runs: Path, seeds: list[int], plant_at: int, every: int = 5, variant: str = "") -> list[dict]:
    rows = []
    for seed in seeds:
        paths = {name: run_dir(runs, seed, fallback_name(every, variant) if name == "fp8-fallback" else name)
                 / "metrics.jsonl" for name, _, _ in RUNS}
        if not all(p.exists() and read_metrics(p, "end") for p in paths.values()):
            continue
        train_loss = {n: {r["step"]: r["loss"] for r in read_metrics(p, "train")} for n, p in paths.items()}
        val = {n: read_metrics(p, "eval")[-1]["val_loss"] for n, p in paths.items()}
        base, ctl = train_loss["bf16"], train_loss["fp8"]
        depart = next((s for s in sorted(ctl) if s > plant_at and 100 * (ctl[s] / base[s] - 1) > DEPART_PCT), None)
        drift = read_metrics(paths["fp8-fallback"], "drift")
        seen = next((d for d in drift if d["action"] != "none"), None)
        acted = next((d for d in drift if d["action"] in ("warn", "fallback")), None)
        # a check that blames a GLU layer for its own local error (a spurious drift can name GLUs by cosine)
        outlier = next((d for d in drift if any(is_outlier_layer(w) and d["local_error"].get(w, 0.0) > LOCAL_ERROR
                                                for w in d["flagged"])), None)
        clean_before = all(d["action"] == "none" for d in drift if d["step"] <= plant_at)
        excess = (lambda s: None if s is None else 100 * (ctl[s] / base[s] - 1))
        rows.append({
            "seed": seed, "departure_step": depart,
            "first_detection_step": seen and seen["step"], "action_step": acted and acted["step"],
            "control_excess_at_detection_pct": excess(seen and seen["step"]),
            "control_excess_at_action_pct": excess(acted and acted["step"]),
            "outlier_flag_step": outlier and outlier["step"],
            "control_excess_at_outlier_flag_pct": excess(outlier and outlier["step"]),
            "outlier_flag_local_error": outlier and max(
                (outlier["local_error"].get(w, 0.0) for w in outlier["flagged"]), default=None),
            "switches": [{"step": d["step"], "reasons": d["reasons"], "switched": d["switched"]}
                         for d in drift if d["switched"]],
            "blamed": acted and acted["flagged"], "switched": acted and acted["switched"],
            "reasons": acted and acted["reasons"], "local_error_at_action": acted and {
                w: acted["local_error"][w] for w in acted["flagged"] if w in acted["local_error"]},
            "loss_rel_diff_at_action": acted and acted["loss_rel_diff"],
            "no_flag_before_plant": clean_before, "checks": len(drift),
            "final_val": val, "gap_control_pct": gap_pct(val["fp8"], val["bf16"]),
            "gap_fallback_pct": gap_pct(val["fp8-fallback"], val["bf16"]),
            "drift_seconds_median": sorted(d["seconds"] for d in drift)[len(drift) // 2] if drift else None,
        })
    return rows


def table(rows: list[dict]) -> str:
    lines = [("| seed | control departs (>2%) at step | check first flags the outlier layers at step (control "
              "excess; worst local error) | check acts at step (control excess) | switched (step: what) | "
              "final val gap: control | final val gap: fallback |"),
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        switched = "; ".join(f"{s['step']}: " + ", ".join(k.replace("layers.", "L") for k in s["switched"])
                             for s in r["switches"]) or "none"
        fmt = (lambda v: "n/a" if v is None else f"{v:+.1f}%")
        err = "n/a" if r["outlier_flag_local_error"] is None else f"{r['outlier_flag_local_error']:.0%}"
        lines.append(f"| {r['seed']} | {r['departure_step']} | {r['outlier_flag_step']} "
                     f"({fmt(r['control_excess_at_outlier_flag_pct'])}; {err}) | {r['action_step']} "
                     f"({fmt(r['control_excess_at_action_pct'])}) | {switched} | {r['gap_control_pct']:+.2f}% | "
                     f"{r['gap_fallback_pct']:+.2f}% |")
    if rows:
        mean = lambda k: sum(r[k] for r in rows) / len(rows)  # noqa: E731
        lines.append(f"| mean | | | | | {mean('gap_control_pct'):+.2f}% | {mean('gap_fallback_pct'):+.2f}% |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/results")
    ap.add_argument("--tag", default="drift")
    ap.add_argument("--runs", default=None, help="run directories RUNS/seedS/NAME (default runs/TAG)")
    ap.add_argument("--seeds", default="0,1,2,3")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--plant-at", type=int, default=50)
    ap.add_argument("--alpha", type=float, default=300.0)
    ap.add_argument("--ramp", type=int, default=0, help="steps over which alpha grows from 0 (0: planted at once)")
    ap.add_argument("--drift-check", type=int, default=5, help="steps between drift checks (N)")
    ap.add_argument("--compiler", default="inductor", choices=("inductor", "aot_eager"))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--act-at-once", type=float, default=None,
                    help="fallback runs: DriftCheck.act_at_once (default: DriftCheck's)")
    ap.add_argument("--reset-moments", action="store_true", help="fallback runs: DriftCheck.reset_moments")
    ap.add_argument("--variant", default="", help="suffix of the fallback runs' folder (fp8-fallback-nN-VARIANT)")
    ap.add_argument("--only", default=None,
                    help="train only these runs, comma-separated from bf16,fp8,fp8-fallback (default: all three)")
    ap.add_argument("--skip-train", action="store_true", help="only summarize the runs in --runs")
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    runs = Path(args.runs or f"runs/{args.tag}")
    t0 = time.perf_counter()
    fallback = fallback_name(args.drift_check, args.variant)
    options = {"drift_check": args.drift_check, **({"drift_act_at_once": args.act_at_once}
                                                   if args.act_at_once is not None else {}),
               **({"drift_reset_moments": True} if args.reset_moments else {})}
    jobs = [{"name": fallback if extra else name, "seed": seed, "plant_at": args.plant_at, "alpha": args.alpha,
             "ramp": args.ramp,
             "config": {"recipe": recipe, "steps": args.steps, "lr": args.lr, "seed": seed, "compiler": args.compiler,
                        "out": str(run_dir(runs, seed, fallback if extra else name)), "eval_every": 25,
                        "ckpt_every": args.steps, "monitor_every": 0, "progress": False,
                        **({**options, **extra} if extra else {})}}
            for seed in seeds for name, recipe, extra in RUNS if args.only is None or name in args.only.split(",")]
    if not args.skip_train:
        run_parallel(train_one, jobs, args.workers, lambda r: print(r, flush=True))
    rows = summarize(runs, seeds, args.plant_at, args.drift_check, args.variant)
    report = {"args": vars(args), "depart_pct": DEPART_PCT, "goal_pct": GOAL_PCT, "rows": rows,
              "wall_s": time.perf_counter() - t0}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.tag}.json").write_text(json.dumps(report, indent=1, default=float))
    print(table(rows))
    print(f"wall {report['wall_s'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
