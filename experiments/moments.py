"""Experiment 3 (paper Fig. 5): FP8 Adam moment formats, m ∈ {E4M3, E5M2} × v ∈ {E4M3, E5M2} vs fp32.

The tiny Llama trains in bf16 (recipe ``bf16-fp8adam``, so only the optimizer differs between runs)
with fp8pass.optim.AdamW holding m and v in the given formats (block size 128, round to nearest),
against torch.optim.AdamW (fp32 moments). Same seed, data order, lr schedule and weight decay.
The paper (Llama2-100M) found only m = E4M3, v = E5M2 on par with the baseline.

Run: ``python experiments/moments.py`` (defaults: 300 steps per run, 5 runs; ~15-25 min on the
shared 2-core machine).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fp8pass.train import TrainConfig, load_text_data, train  # noqa: E402
from fp8pass.train.plots import plot_runs  # noqa: E402

COMBOS = (("fp32", None, None), ("m-e4m3_v-e5m2", "e4m3", "e5m2"), ("m-e4m3_v-e4m3", "e4m3", "e4m3"),
          ("m-e5m2_v-e5m2", "e5m2", "e5m2"), ("m-e5m2_v-e4m3", "e5m2", "e4m3"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/results")
    ap.add_argument("--runs", default="runs/moments")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    out, runs = Path(args.out), Path(args.runs)
    out.mkdir(parents=True, exist_ok=True)
    data = load_text_data()
    t0 = time.perf_counter()
    results = {"args": vars(args), "runs": {}}
    for name, m, v in COMBOS:
        cfg = TrainConfig(recipe="bf16" if m is None else "bf16-fp8adam", m_format=m or "e4m3",
                          v_format=v or "e5m2", steps=args.steps, lr=args.lr, out=str(runs / name),
                          eval_every=50, ckpt_every=args.steps, monitor_every=0, progress=False)
        t = time.perf_counter()
        r = train(cfg, data=data)
        results["runs"][name] = {"status": r.status, "final_train_loss": r.final_loss,
                                 "final_val_loss": r.final_val_loss, "wall_s": time.perf_counter() - t}
        print(name, r.status, round(r.final_val_loss, 4), f"{time.perf_counter() - t:.0f}s", flush=True)
    base = results["runs"]["fp32"]["final_val_loss"]
    for name, rec in results["runs"].items():
        rec["gap_vs_fp32_pct"] = 100 * (rec["final_val_loss"] - base) / base
    results["wall_s"] = time.perf_counter() - t0
    (out / "moments.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results["runs"], indent=1))
    if plot_runs(runs, out_dir=runs):
        import shutil
        shutil.copy(runs / "loss.png", out / "moments_loss.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
