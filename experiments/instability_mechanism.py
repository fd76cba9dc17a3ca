"""Why the per-token Smooth-SwiGLU form protects less than the per-channel one: forward measurements.

Takes the seed's bf16 run of an instability experiment (its final weights and its plant, from
``RUNS/seedS/bf16``), re-plants it with ``--alpha`` and measures, on validation batches:

1. per layer, on tokens without the trigger byte: how much the planted channel inflates the token
   scale r_t = max_i |up_ti| (ratio to the same max without channel 0), the per-tensor amax of the
   token form's GEMM operand A = silu(gate)·up/r and of the plain h, and the median |A| of the
   ordinary channels with and without the plant;
2. where each recipe's validation-loss excess over bf16 sits: at trigger tokens, at positions after a
   trigger in the same window, or elsewhere;
3. whether the planted ``w_down`` column (divided by α², so it flushes under per-tensor FP8 weight
   scaling) matters: bf16 validation loss with that column zeroed.

Run: ``python -m experiments.instability_mechanism --runs runs/instability_sparse_alpha200 --alpha 200``
(seconds; needs the runs of ``experiments/instability.py``). Writes ``--json`` if given.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from experiments.instability import RUNS, forward_for, val_loss
from experiments.outlier_plant import plant
from fp8pass.train import ModelConfig, TinyLlama, load_text_data


def planted_model(weights, plant_info, alpha):
    model = TinyLlama(ModelConfig())
    model.load_state_dict(weights)
    plant(model, plant_info["dirs"], alpha, plant_info["cols"])
    return model


@torch.no_grad()
def token_scale_stats(model, x, trigger):
    """Per layer: r inflation, amax of A and h, median ordinary |A| (section 1 of the module doc)."""
    seen = {}
    hooks = []
    for i, layer in enumerate(model.layers):
        for name in ("gate_proj", "up_proj"):
            hooks.append(getattr(layer.mlp, name).register_forward_hook(
                lambda mod, a, out, key=(name, i): seen.__setitem__(key, out.float().reshape(-1, out.shape[-1]))))
    try:
        model(x)
    finally:
        for h in hooks:
            h.remove()
    other = x.reshape(-1) != trigger
    rows = []
    for i in range(len(model.layers)):
        up, gate = seen[("up_proj", i)], seen[("gate_proj", i)]
        h = F.silu(gate) * up
        r = up.abs().amax(1)
        r_without = up[:, 1:].abs().amax(1).clamp_min(1e-30)
        a = h / r[:, None]
        rows.append({
            "layer": i,
            "r_inflation_median": (r / r_without)[other].median().item(),
            "r_inflation_q90": (r / r_without)[other].quantile(0.9).item(),
            "amax_h": h.abs().max().item(),
            "amax_A": a.abs().max().item(),
            "median_ordinary_A": a[other][:, 1:].abs().median().item(),
            "median_ordinary_A_without_plant": (h / r_without[:, None])[other][:, 1:].abs().median().item(),
        })
    return rows


@torch.no_grad()
def loss_by_position(weights, plant_info, alpha, data, seed, trigger, batches):
    """Per recipe: total excess over bf16 (%) and its split by position kind (section 2)."""
    per = {}
    for name, recipe, smooth in RUNS:
        fwd = forward_for(planted_model(weights, plant_info, alpha), recipe, smooth, data, seed)
        ce, kinds = [], []
        for i in range(batches):
            x, y = data.batch("val", 16, 128, seed, i)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = fwd(x).float()
            ce.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none"))
            hit = x == trigger
            after = torch.zeros_like(hit)
            after[:, 1:] = hit.cumsum(1)[:, :-1] > 0
            kinds.append(torch.where(hit, 0, torch.where(after, 1, 2)).reshape(-1))
        per[name] = (torch.cat(ce), torch.cat(kinds))
        torch._dynamo.reset()
    base, kind = per["bf16"]
    out = {"fractions": {k: (kind == j).float().mean().item() for j, k in enumerate(("trigger", "after", "other"))}}
    for name, (ce, _) in per.items():
        if name == "bf16":
            continue
        out[name] = {"total_pct": 100 * ((ce.mean() - base.mean()) / base.mean()).item(),
                     **{f"{k}_pct": 100 * ((ce - base)[kind == j].sum() / base.sum()).item()
                        for j, k in enumerate(("trigger", "after", "other"))}}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", required=True, help="an instability experiment's run directory (runs/TAG)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--alpha", type=float, required=True)
    ap.add_argument("--trigger", default="#")
    ap.add_argument("--batches", type=int, default=10, help="validation batches for the loss split")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    src = Path(args.runs) / f"seed{args.seed}" / "bf16"
    if not (src / "plant.pt").exists():
        ap.error(f"{src} has no plant.pt: run experiments/instability.py with --runs {args.runs} first")
    weights = torch.load(src / "checkpoint.pt", weights_only=True)["model"]
    plant_info = torch.load(src / "plant.pt", weights_only=True)
    data = load_text_data()
    trigger = ord(args.trigger)
    report = {"args": vars(args)}
    model = planted_model(weights, plant_info, args.alpha)
    report["token_scale"] = token_scale_stats(model, data.batch("val", 16, 128, args.seed, 0)[0], trigger)
    for row in report["token_scale"]:
        print({k: round(v, 6) if isinstance(v, float) else v for k, v in row.items()})
    report["loss_by_position"] = loss_by_position(weights, plant_info, args.alpha, data, args.seed, trigger,
                                                  args.batches)
    print(json.dumps(report["loss_by_position"], indent=1))
    planted = val_loss(model, data, args.seed)
    with torch.no_grad():
        for layer in model.layers:
            layer.mlp.down_proj.weight[:, 0] = 0
    zeroed = val_loss(model, data, args.seed)
    report["w_down_column_zeroed_pct"] = 100 * (zeroed - planted) / planted
    print(f"bf16 val loss {planted:.4f}; with the planted w_down column zeroed {zeroed:.4f} "
          f"({report['w_down_column_zeroed_pct']:+.3f}%)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
