"""NVFP4 recipe experiment: tiny Llama, byte-level, fp32 high precision vs NVFP4 vs NVFP4+HCP, ablations.

    python -m experiments.nvfp4 --steps 150 --seeds 0,1,2,3 --out docs/results/nvfp4

Every NVFP4 run keeps the last block of the four in fp32 (``keep_last_blocks=None``: the count closest
to 15% of the block linears; the default, the seed document's last 4 blocks, would keep all four).
HCP runs: the seed's S-O2-B (concat, second order, gradients patched too) and forward-only.

Every run: same seed, same data order, AdamW; the model compiled with ``fp8pass.backend`` and
``Config(recipe=NVFP4Scaling(...), compiler="eager")`` (the rewritten graph runs as is: compiling with
Inductor changes nothing numerically and costs minutes on a shared CPU). The baseline is the same
model in fp32 without the backend. Validation: mean loss over fixed held-out windows, computed with
the run's own numerics. Writes ``<out>.json`` and ``<out>.png``.

Model and corpus are the trainer's (``fp8pass.train``): ``TinyLlama`` with
``ModelConfig(d_model=64, n_layers=4, n_heads=4, ffn=176)`` and the embedded standard-library text
(``load_text_data``), batches from its ``batch(split, ...)``. The loop is written out here rather than
run through ``fp8pass.train.train`` because the trainer's recipes are bf16-autocast ones and this
experiment compares NVFP4 against fp32.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

import fp8pass
from experiments.common import paired_gaps
from fp8pass import Config, HotChannelPatching, NVFP4Scaling
from fp8pass.train import ModelConfig, TinyLlama, load_text_data

BASE = dict(keep_last_blocks=None)  # 1 of the 4 blocks kept (15%); the default 4 would keep them all
RUNS = {
    "high precision": None,
    "nvfp4": NVFP4Scaling(**BASE),
    "nvfp4+hcp": "hcp",
    "nvfp4+hcp fwd only": "hcp-fwd",
    "nvfp4 no RHT": NVFP4Scaling(rht=False, **BASE),
    "nvfp4 no SR": NVFP4Scaling(grad_stochastic_rounding=False, **BASE),
    "nvfp4 no 2D weight blocks": NVFP4Scaling(weight_2d=False, **BASE),
    "nvfp4 no post-QK protection": NVFP4Scaling(protect_post_qk=False, **BASE),
}


def run(name, recipe, args, data, seed):
    torch.manual_seed(seed)
    model = TinyLlama(ModelConfig(d_model=64, n_layers=args.layers, n_heads=4, ffn=176, max_seq_len=args.seq))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 10) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    torch._dynamo.reset()
    fwd = model if recipe is None else torch.compile(model, backend=fp8pass.backend(Config(recipe=recipe,
                                                                                          compiler="eager")))
    losses, t0 = [], time.perf_counter()
    for step in range(args.steps):
        x, y = data.batch("train", args.batch, args.seq, seed, step)
        loss = fwd(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
    secs = time.perf_counter() - t0
    with torch.no_grad():
        vl = [fwd(*data.batch("val", args.batch, args.seq, 12345, i)).item() for i in range(args.val_batches)]
    out = {"name": name, "seed": seed, "recipe": repr(recipe), "train_loss": losses, "val_loss": sum(vl) / len(vl),
           "seconds": secs}
    print(f"{name:30s} seed {seed}  val {out['val_loss']:.4f}  final train {sum(losses[-10:]) / 10:.4f}  {secs:.0f}s",
          flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seeds", default="0", help="comma-separated; every run on every seed, gaps paired by seed")
    ap.add_argument("--val-batches", type=int, default=8)
    ap.add_argument("--hcp-interval", type=int, default=10, help="HCP refresh interval (short runs)")
    ap.add_argument("--runs", default=",".join(RUNS))
    ap.add_argument("--out", default="docs/results/nvfp4")
    args = ap.parse_args()
    torch.set_num_threads(1)
    data = load_text_data()
    names = args.runs.split(",")
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        ap.error(f"unknown runs {unknown}; valid: {', '.join(RUNS)}")
    results = []
    for seed in (int(x) for x in args.seeds.split(",")):
        for name in names:
            recipe = RUNS[name]
            if recipe in ("hcp", "hcp-fwd"):  # the seed's S-O2-B, or patching the forward GEMM only
                recipe = NVFP4Scaling(hcp=HotChannelPatching(update_interval=args.hcp_interval, mode="concat",
                                                             backward=recipe == "hcp"), **BASE)
            results.append(run(name, recipe, args, data, seed))
    summary = paired_gaps(results, "high precision", key="val_loss") if "high precision" in names else {}
    for name, s in summary.items():
        print(f"{name:30s} gap to high precision: mean {s['mean_gap_pct']:+.2f}%  s.e. {s['stderr_pct']:.2f}  "
              f"per seed {', '.join(f'{g:+.2f}' for g in s['gaps_pct'])}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps({"args": vars(args), "summary": summary, "results": results},
                                                   indent=1))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
        k = 10
        for r in results:
            if r["seed"] != results[0]["seed"]:
                continue
            tl = r["train_loss"]
            sm = [sum(tl[max(0, i - k + 1):i + 1]) / len(tl[max(0, i - k + 1):i + 1]) for i in range(len(tl))]
            ax[0].plot(sm, label=r["name"])
        ax[0].set_xlabel("step"); ax[0].set_ylabel(f"train loss ({k}-step mean), seed {results[0]['seed']}")
        ax[0].legend(fontsize=7)
        shown = list(summary)
        ax[1].barh(shown, [summary[n]["mean_gap_pct"] for n in shown],
                   xerr=[0.0 if math.isnan(summary[n]["stderr_pct"]) else summary[n]["stderr_pct"] for n in shown])
        ax[1].axvline(0, color="k", lw=0.8)
        ax[1].set_xlabel("validation loss gap to high precision (%), mean over seeds ± s.e.")
        fig.tight_layout()
        fig.savefig(args.out + ".png", dpi=110)
    except ImportError:
        print("matplotlib missing: no plot")


if __name__ == "__main__":
    main()
