"""Experiment 4: bf16 vs fp8-smooth-fp8adam over a run long enough for the loss to flatten.

Same seed, data order and schedule; the final validation loss gap (goal < 0.5%) is the result.
Run: ``python experiments/parity.py`` (defaults: 300 steps; ~20-30 min on the shared 2-core machine,
mostly the fp8 run: FP8 on CPU is simulated by bf16 GEMMs of FP8 codes plus casts, slower than bf16).
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
from fp8pass.train import TrainConfig, load_text_data, train  # noqa: E402
from fp8pass.train.plots import plot_runs  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/results")
    ap.add_argument("--runs", default="runs/parity")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--recipes", default="bf16,fp8-smooth-fp8adam")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    out, runs = Path(args.out), Path(args.runs)
    out.mkdir(parents=True, exist_ok=True)
    data = load_text_data()
    t0 = time.perf_counter()
    results = {"args": vars(args), "runs": {}}
    for recipe in args.recipes.split(","):
        cfg = TrainConfig(recipe=recipe, steps=args.steps, out=str(runs / recipe), eval_every=50,
                          ckpt_every=args.steps, monitor_every=100, progress=False)
        t = time.perf_counter()
        r = train(cfg, data=data)
        torch._dynamo.reset()
        results["runs"][recipe] = {"status": r.status, "final_train_loss": r.final_loss,
                                   "final_val_loss": r.final_val_loss, "wall_s": time.perf_counter() - t}
        print(recipe, r.status, round(r.final_val_loss, 5), f"{time.perf_counter() - t:.0f}s", flush=True)
    names = list(results["runs"])
    base = results["runs"][names[0]]["final_val_loss"]
    for name in names[1:]:
        results["runs"][name]["gap_vs_%s_pct" % names[0]] = 100 * (results["runs"][name]["final_val_loss"] - base) / base
    results["wall_s"] = time.perf_counter() - t0
    (out / "parity.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results["runs"], indent=1))
    if plot_runs(runs, out_dir=runs):
        import shutil
        for f in ("loss.png", "max_activation.png", "alignment.png"):
            if (runs / f).exists():
                shutil.copy(runs / f, out / f"parity_{f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
