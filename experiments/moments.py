"""Experiment 3 (paper Fig. 5): FP8 Adam moment formats, m ∈ {E4M3, E5M2} × v ∈ {E4M3, E5M2} vs fp32.

The tiny Llama trains in bf16 (recipe ``bf16-fp8adam``, so only the optimizer differs between runs)
with fp8pass.optim.AdamW holding m and v in the given formats (block size 128, round to nearest),
against torch.optim.AdamW (fp32 moments). Every combination trains on several seeds and is compared
with the fp32-moment run of the same seed (same initialisation, data order and validation batches):
one run per combination carries ~1-2% of chaotic run-to-run noise here (docs/results/parity.md).
The paper (Llama2-100M) found only m = E4M3, v = E5M2 on par with the baseline.

Run: ``python experiments/moments.py`` (defaults: 3 seeds x 5 runs x 600 steps at lr 1.5e-3, the parity
experiment's setting, 2 worker processes; ~20 min on an idle 2-core machine). ``--block-size`` sets the moments' scaling block (default 128;
a block larger than any tensor gives one scale per tensor, like the paper's reference code).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import paired_gaps, plot_seeds, run_dir, run_parallel, train_job  # noqa: E402


COMBOS = (("fp32", None, None), ("m-e4m3_v-e5m2", "e4m3", "e5m2"), ("m-e4m3_v-e4m3", "e4m3", "e4m3"),
          ("m-e5m2_v-e5m2", "e5m2", "e5m2"), ("m-e5m2_v-e4m3", "e5m2", "e4m3"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/results")
    ap.add_argument("--runs", default="runs/moments", help="run directories: RUNS/seedS/NAME")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--tag", default="moments", help="prefix of the result files")
    args = ap.parse_args(argv)
    seeds = [int(x) for x in args.seeds.split(",")]
    out, runs = Path(args.out), Path(args.runs)
    out.mkdir(parents=True, exist_ok=True)
    jobs = [{"name": name, "config": dict(recipe="bf16" if m is None else "bf16-fp8adam", m_format=m or "e4m3",
                                          v_format=v or "e5m2", block_size=args.block_size, steps=args.steps,
                                          lr=args.lr, seed=seed, out=str(run_dir(runs, seed, name)), eval_every=50,
                                          ckpt_every=args.steps, monitor_every=0, progress=False)}
            for seed in seeds for name, m, v in COMBOS]
    t0 = time.perf_counter()
    results = run_parallel(train_job, jobs, args.workers, lambda r: print(
        f"{r['name']:16s} seed {r['seed']}  {r['status']:8s} val {r['final_val_loss']:.4f}  {r['wall_s']:.0f}s",
        flush=True))
    summary = paired_gaps(results, "fp32")
    report = {"args": vars(args), "results": results, "summary": summary, "wall_s": time.perf_counter() - t0}
    (out / f"{args.tag}.json").write_text(json.dumps(report, indent=1))
    print(f"final validation loss gap to fp32 moments (same seed), % over seeds {seeds}:")
    for name, s in summary.items():
        print(f"  {name:16s} mean {s['mean_gap_pct']:+.2f}  s.e. {s['stderr_pct']:.2f}  "
              f"per seed {', '.join(f'{g:+.2f}' for g in s['gaps_pct'])}  diverged/NaN: {s['not_finite']}")
    plot_seeds(runs, [c[0] for c in COMBOS], seeds, summary, None, out / f"{args.tag}.png",
               title=f"FP8 moments (block {args.block_size}); band: min-max over seeds")
    print(f"wall {report['wall_s'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
