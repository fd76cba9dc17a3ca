"""Where a training step's time goes, per op: ``benchmarks/memory.py``'s variants side by side.

For each variant (its model, optimizer and step, built as ``benchmarks.memory`` builds them, at its
default high precision), two warm-up steps, then one step under ``torch.profiler``; prints the whole
step, the self CPU time of the ops named in ``--ops`` (the profiler's names) and the optimizer step, one
column per variant. Made to see why a variant's step is slower (e.g. bf16 weights on an AVX2-only CPU:
torch's own bf16 attention and matmuls).

    python -m tools.step_ops [--shape tiny] [--variants "fp8-smooth-fp8adam,fp8 + bf16 SR weights"]
                             [--ops "..."] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import baseline_dtype, listed, machine
from benchmarks.memory import VARIANTS
from benchmarks.train_step import SHAPES, build

DEFAULT_OPS = ("aten::_scaled_dot_product_flash_attention_for_cpu_backward",
               "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::mm", "aten::addmm")


def profile_variant(shape: str, name: str, ops) -> dict:
    _, _, _, _, step = build(shape, name, "cpu", baseline_dtype("cpu"), VARIANTS[name])
    step()
    step()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = prof.key_averages()
    out = {"step_ms": (time.perf_counter() - t0) * 1e3,
           "optimizer": sum(e.cpu_time_total for e in events if e.key.startswith("Optimizer.step")) / 1e3}
    for op in ops:  # exact names (a forward's name is a prefix of its backward's)
        out[op] = sum(e.self_cpu_time_total for e in events if e.key == op) / 1e3
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="tiny", choices=list(SHAPES))
    p.add_argument("--variants", default="fp8-smooth-fp8adam,fp8 + bf16 SR weights")
    p.add_argument("--ops", default=",".join(DEFAULT_OPS))
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    names = listed(p, a.variants, VARIANTS, "variant")
    ops = [o.strip() for o in a.ops.split(",") if o.strip()]
    load = os.getloadavg()[0]
    res = {v: profile_variant(a.shape, v, ops) for v in names}
    m = machine()
    print(f"{a.shape}, one profiled step each, ms; {m['cpu']}, {m['cpu_capability']}, high precision "
          f"{baseline_dtype('cpu')}, load {load:.2f} -> {os.getloadavg()[0]:.2f}")
    print("| op (self CPU ms) | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    labels = {"step_ms": "whole step (wall)", "optimizer": "optimizer step (total CPU)"}
    for key in ["step_ms", *ops, "optimizer"]:
        print(f"| {labels.get(key, key)} | " + " | ".join(f"{res[v][key]:.0f}" for v in names) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
