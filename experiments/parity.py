"""Experiment 4: bf16 vs fp8-smooth-fp8adam parity, over several seeds, against a measured noise floor.

One run per recipe cannot resolve a 0.5% gap here: two runs of the *same* math that differ only in
rounding (bf16 eager vs the fp8 backend with quantization switched off) ended up to 2% apart after
300 steps (docs/results/parity.md). Small numerical differences grow chaotically through training,
so the final loss of one run carries noise of that size whatever the precision. This experiment
therefore measures:

- per seed, the final validation loss of ``bf16`` (the baseline), of ``fp8-smooth-fp8adam`` and of a
  **noise-floor** run, ``bf16-inductor``: the same bf16 recipe compiled by Inductor, i.e. the same
  math with a different rounding order and no FP8 at all;
- per seed, each run's gap to the same seed's bf16 run (same data order and validation batches);
- the mean gap over seeds and its standard error. The parity goal is a mean fp8 gap < 0.5%; the
  noise floor's spread says how finely the seeds can resolve it.

Runs are independent single-threaded processes, ``--workers`` at a time (2 fit the 2-core machine);
runs already finished with the same configuration are reused, so adding seeds or runs later only
trains what is new.
Run: ``python -m experiments.parity`` (defaults: 4 seeds x 3 runs x 600 steps at lr 1.5e-3, 22 min on
the idle 2-core machine; ``--seeds 0,1,2,3,4,5,6,7`` shrinks the standard error by sqrt(2) in twice the
time).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from experiments.common import paired_gaps, plot_seeds, run_dir, run_parallel, train_job
from fp8pass.train import TrainConfig

# name -> TrainConfig overrides. The first entry is the baseline every gap is measured against.
RUNS = {
    "bf16": {"recipe": "bf16"},
    "bf16-inductor": {"recipe": "bf16", "compile_bf16": True},
    "fp8-smooth-fp8adam": {"recipe": "fp8-smooth-fp8adam"},
    "fp8-smooth": {"recipe": "fp8-smooth"},
    "bf16-fp8adam": {"recipe": "bf16-fp8adam"},
    "fp8": {"recipe": "fp8"},
    "bf16-fp8adam-sr": {"recipe": "bf16-fp8adam", "moment_rounding": "stochastic"},
    "fp8-smooth-fp8adam-sr": {"recipe": "fp8-smooth-fp8adam", "moment_rounding": "stochastic"},
    "fp8-smooth-fp8adam-recompute-glu": {"recipe": "fp8-smooth-fp8adam", "recompute_glu_output": True},
    "fp8-smooth-fp8adam-norm-fp8": {"recipe": "fp8-smooth-fp8adam", "save_norm_input_fp8": True},
    "bf16-fp8adam-bf16sr": {"recipe": "bf16-fp8adam", "bf16_stochastic_round": True},
    "fp8-smooth-fp8adam-bf16sr": {"recipe": "fp8-smooth-fp8adam", "bf16_stochastic_round": True},
}
GOAL_PCT = 0.5


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/results", help="where parity.json and parity.png go")
    ap.add_argument("--runs-dir", default="runs/parity", help="run directories: RUNS_DIR/seedS/NAME")
    ap.add_argument("--runs", default="bf16,bf16-inductor,fp8-smooth-fp8adam",
                    help=f"comma-separated, baseline first; from {', '.join(RUNS)}")
    ap.add_argument("--seeds", default="0,1,2,3")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    bad = [n for n in names if n not in RUNS]
    if bad or len(names) < 2:
        ap.error(f"--runs needs a baseline and at least one more run from {', '.join(RUNS)}; got {args.runs!r}")
    seeds = [int(s) for s in args.seeds.split(",")]
    out, runs_dir = Path(args.out), Path(args.runs_dir)
    out.mkdir(parents=True, exist_ok=True)

    jobs = []
    for seed in seeds:
        for name in names:
            cfg = dict(RUNS[name], steps=args.steps, lr=args.lr, seed=seed, out=str(run_dir(runs_dir, seed, name)),
                       eval_every=50, eval_batches=args.eval_batches, ckpt_every=args.steps, monitor_every=0,
                       progress=False)
            jobs.append({"name": name, "config": cfg})
    # the slowest (fp8) jobs first, so the two workers finish together
    jobs.sort(key=lambda j: not TrainConfig(**j["config"]).recipe.startswith("fp8"))
    t0 = time.perf_counter()
    results = run_parallel(train_job, jobs, args.workers, lambda r: print(
        f"{r['name']:20s} seed {r['seed']}  {r['status']:8s} val {r['final_val_loss']:.4f}  {r['wall_s']:.0f}s",
        flush=True))
    summary = paired_gaps(results, names[0])
    report = {"args": vars(args), "goal_pct": GOAL_PCT, "results": results, "summary": summary,
              "wall_s": time.perf_counter() - t0}
    (out / "parity.json").write_text(json.dumps(report, indent=1))
    print(f"\nfinal validation loss gap to {names[0]} (same seed), % over seeds {seeds}:")
    for name, s in summary.items():
        print(f"  {name:20s} mean {s['mean_gap_pct']:+.2f}  s.e. {s['stderr_pct']:.2f}  std {s['std_pct']:.2f}  "
              f"per seed {', '.join(f'{g:+.2f}' for g in s['gaps_pct'])}")
    png = plot_seeds(runs_dir, names, seeds, summary, GOAL_PCT, out / "parity.png")
    print(f"wrote {out / 'parity.json'}" + (f" and {png}" if png else "") + f" in {report['wall_s'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
