"""Gradient fidelity at a checkpoint: how far each precision's loss and gradients are from fp32.

Loads a trainer checkpoint (``RUN_DIR/checkpoint.pt``), computes the fp32 loss and gradients on
``--batches`` training batches, then the same under each variant, and reports per parameter group the
mean relative error ``||g - g_fp32|| / ||g_fp32||`` and the mean loss difference. Variants:

- ``bf16``: the trainer's bf16 autocast;
- ``fp8:KEY=VALUE,...``: the fp8 backend with ``fp8pass.Config`` overrides, e.g. ``fp8:`` (defaults:
  delayed scaling, Smooth-SwiGLU per channel, stochastically rounded E5M2 gradients),
  ``fp8:grad_stochastic_rounding=0``, ``fp8:scaling=current``, ``fp8:scaling=current,granularity=row``,
  ``fp8:fwd_format=identity,bwd_format=identity`` (quantization off: the pipeline's own error).

Delayed-scaling variants first run ``--warmup`` batches to fill their amax histories. This separates
what FP8 does to one step (the numbers here) from what it does to a whole run (experiments/parity.py).

Run: ``python -m experiments.grad_fidelity runs/parity/seed0/bf16 bf16 fp8: fp8:scaling=current``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import warnings
from pathlib import Path

import torch

import fp8pass
from fp8pass.config import CurrentScaling, DelayedScaling
from fp8pass.train import ModelConfig, TinyLlama, load_text_data
from fp8pass.train.checkpoint import load_checkpoint


def fp8_config(spec: str) -> fp8pass.Config:
    """``KEY=VALUE,...`` -> Config; ``scaling`` and ``granularity`` choose the recipe."""
    kv = dict(item.split("=", 1) for item in spec.split(",") if item)
    scaling, gran = kv.pop("scaling", "delayed"), kv.pop("granularity", "tensor")
    if scaling not in ("delayed", "current"):
        raise ValueError(f"scaling must be delayed or current, got {scaling!r}")
    recipe = CurrentScaling(granularity=gran) if scaling == "current" else DelayedScaling()
    fields = {f.name: f for f in dataclasses.fields(fp8pass.Config)}
    over = {}
    for k, v in kv.items():
        if k not in fields:
            raise ValueError(f"unknown Config field {k!r}; valid: {', '.join(fields)}")
        over[k] = {"grad_stochastic_rounding": lambda s: s in ("1", "true"), "min_dim": int,
                   "dim_multiple": int, "smooth_swiglu": lambda s: None if s == "none" else s}.get(k, str)(v)
    return fp8pass.Config(recipe=recipe, **over)


def group_of(name: str) -> str:
    parts = name.split(".")
    return parts[-2] if parts[0] == "layers" else name


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", help="a trainer run directory (with checkpoint.pt)")
    ap.add_argument("variants", nargs="+", help="bf16 | fp8:KEY=VALUE,...")
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--json", default=None, help="also write the numbers here")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    ck = load_checkpoint(args.run_dir)
    tc = ck["config"]
    data = load_text_data(tc.get("data"))

    def batch(i):
        return data.batch("train", tc["batch_size"], tc["seq_len"], tc["seed"], 10_000 + i)

    def model():
        m = TinyLlama(ModelConfig(**tc["model"]))
        m.load_state_dict(ck["model"])
        return m

    def loss_and_grads(fwd, m, i, autocast=True):
        m.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = fwd(*batch(i))
        loss.backward()
        return loss.item(), {n: p.grad.detach().float().clone() for n, p in m.named_parameters()}

    ref_model = model()
    ref = [loss_and_grads(ref_model, ref_model, i, autocast=False) for i in range(args.batches)]
    report = {}
    for variant in args.variants:
        m = model()
        if variant == "bf16":
            fwd = m
        elif variant.startswith("fp8:"):
            fwd = torch.compile(m, backend=fp8pass.backend(fp8_config(variant[4:])))
            for i in range(args.warmup):
                loss_and_grads(fwd, m, 1000 + i)
        else:
            ap.error(f"unknown variant {variant!r}: bf16 or fp8:KEY=VALUE,...")
        errs, dloss = {}, []
        for i in range(args.batches):
            loss, grads = loss_and_grads(fwd, m, i)
            dloss.append(loss - ref[i][0])
            for n, g in grads.items():
                r = ref[i][1][n]
                errs.setdefault(n, []).append(((g - r).norm() / r.norm()).item())
        per_param = {n: sum(v) / len(v) for n, v in errs.items()}
        groups = {}
        for n, e in per_param.items():
            groups.setdefault(group_of(n), []).append(e)
        groups = {k: sum(v) / len(v) for k, v in groups.items()}
        report[variant] = {"loss_diff": sum(dloss) / len(dloss),
                           "rel_grad_err_mean": sum(per_param.values()) / len(per_param),
                           "rel_grad_err_by_group": groups}
        print(f"{variant:45s} loss diff {report[variant]['loss_diff']:+.5f}  "
              f"mean rel grad err {report[variant]['rel_grad_err_mean']:.4f}", flush=True)
        print("    " + "  ".join(f"{k}={v:.3f}" for k, v in groups.items()), flush=True)
        torch._dynamo.reset()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
