"""Experiment 3 (paper Fig. 5): FP8 Adam moment formats, m ∈ {E4M3, E5M2} × v ∈ {E4M3, E5M2} vs fp32.

The paper's form: v stored directly (not sqrt(v)) and one fp32 scale per tensor, the four format
combinations against fp32 moments. Beside them, the storage variants fp8pass offers: sqrt(v) instead
of v, and one scale per block of 128 instead of per tensor (the optimizer's defaults).

The tiny Llama trains in bf16 (recipe ``bf16-fp8adam``, so only the optimizer differs between runs)
with fp8pass.optim.AdamW, against torch.optim.AdamW (fp32 moments, recipe ``bf16``). Every variant
trains on several seeds and is compared with the fp32-moment run of the same seed (same
initialisation, data order and validation batches): one run per variant carries ~1-2% of chaotic
run-to-run noise here (docs/results/parity.md). The paper (Llama2-100M) found only m = E4M3,
v = E5M2 on par with the baseline.

Run: ``python -m experiments.moments`` (defaults: the 5 paper-form runs on seeds 0,1,2 and the 3
storage variants on the same seeds, 300 steps at lr 3e-3, 2 worker processes; docs/results/moments.md
says how the setting was chosen and how long it took). ``--variants`` picks runs by name,
``--side-seeds`` gives the storage variants fewer seeds; finished runs with the same configuration
are reused.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from experiments.common import paired_gaps, plot_seeds, run_dir, run_parallel, train_job

BASELINE = "fp32"
# name -> TrainConfig overrides. Paper form: v itself, one scale per tensor (moment_block_size=None).
PAPER = {
    BASELINE: {"recipe": "bf16"},
    "m-e4m3_v-e5m2": {"m_format": "e4m3", "v_format": "e5m2"},
    "m-e4m3_v-e4m3": {"m_format": "e4m3", "v_format": "e4m3"},
    "m-e5m2_v-e5m2": {"m_format": "e5m2", "v_format": "e5m2"},
    "m-e5m2_v-e4m3": {"m_format": "e5m2", "v_format": "e4m3"},
}
# fp8pass's storage variants of the paper's choice (m E4M3, v E5M2).
SIDE = {
    "m-e4m3_sqrtv-e5m2": {"m_format": "e4m3", "v_format": "e5m2", "v_sqrt": True},
    "m-e4m3_v-e5m2_b128": {"m_format": "e4m3", "v_format": "e5m2", "moment_block_size": 128},
    "m-e4m3_sqrtv-e5m2_b128": {"m_format": "e4m3", "v_format": "e5m2", "v_sqrt": True, "moment_block_size": 128},
}
VARIANTS = {**PAPER, **SIDE}


def variant_config(name: str, *, steps: int, lr: float, seed: int, out: str) -> dict:
    """TrainConfig keyword arguments of run ``name``: the paper's form unless the variant says otherwise."""
    over = VARIANTS[name]
    cfg = {"recipe": "bf16-fp8adam", "v_sqrt": False, "moment_block_size": None}
    cfg.update(over)
    cfg.update(steps=steps, lr=lr, seed=seed, out=out, eval_every=50, ckpt_every=steps, monitor_every=0,
               progress=False)
    return cfg


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/results")
    ap.add_argument("--runs", default="runs/moments", help="run directories: RUNS/seedS/NAME")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {', '.join(VARIANTS)} "
                    f"(the baseline {BASELINE} always runs)")
    ap.add_argument("--seeds", default="0,1,2", help="seeds of the paper-form runs and the baseline")
    ap.add_argument("--side-seeds", default=None, help="seeds of the storage variants (default: --seeds)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--tag", default="moments", help="prefix of the result files")
    args = ap.parse_args(argv)
    names = [BASELINE] + [n.strip() for n in args.variants.split(",") if n.strip() and n.strip() != BASELINE]
    bad = [n for n in names if n not in VARIANTS]
    if bad:
        ap.error(f"unknown variant {', '.join(bad)}; valid: {', '.join(VARIANTS)}")
    seeds = [int(x) for x in args.seeds.split(",")]
    side_seeds = [int(x) for x in args.side_seeds.split(",")] if args.side_seeds else seeds
    out, runs = Path(args.out), Path(args.runs)
    out.mkdir(parents=True, exist_ok=True)
    jobs = [{"name": name, "config": variant_config(name, steps=args.steps, lr=args.lr, seed=seed,
                                                    out=str(run_dir(runs, seed, name)))}
            for name in names for seed in (side_seeds if name in SIDE else seeds)]
    if any(s not in seeds for s in side_seeds):  # every compared run needs its seed's baseline
        jobs += [{"name": BASELINE, "config": variant_config(BASELINE, steps=args.steps, lr=args.lr, seed=s,
                                                             out=str(run_dir(runs, s, BASELINE)))}
                 for s in side_seeds if s not in seeds]
    t0 = time.perf_counter()
    results = run_parallel(train_job, jobs, args.workers, lambda r: print(
        f"{r['name']:24s} seed {r['seed']}  {r['status']:8s} val {r['final_val_loss']:.4f}  {r['wall_s']:.0f}s",
        flush=True))
    summary = paired_gaps(results, BASELINE)
    import torch

    machine = {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
               "loadavg_end": list(__import__("os").getloadavg())}
    report = {"args": vars(args), "machine": machine, "results": results, "summary": summary,
              "wall_s": time.perf_counter() - t0}
    (out / f"{args.tag}.json").write_text(json.dumps(report, indent=1))
    print("final validation loss gap to fp32 moments (same seed), %:")
    for name, s in summary.items():
        print(f"  {name:24s} mean {s['mean_gap_pct']:+.2f}  std {s['std_pct']:.2f}  "
              f"per seed {', '.join(f'{g:+.2f}' for g in s['gaps_pct'])}  diverged/NaN seeds: {s['not_finite']}")
    plot_seeds(runs, names, sorted(set(seeds) | set(side_seeds)), summary, None, out / f"{args.tag}.png",
               title=f"FP8 moments, lr {args.lr:g}, {args.steps} steps; band: min-max over seeds")
    print(f"wall {report['wall_s'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
