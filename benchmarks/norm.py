"""``fp8pass::rmsnorm`` (``Config.save_norm_input_fp8``) against the norm it replaces, forward + backward.

The op keeps E4M3 codes of ``x_hat`` for backward instead of the norm's input (docs/runtime.md); it pays
one cast forward and one decode backward for it. This times, interleaved round by round in one process:

* ``inductor norm``: the model's RMSNorm compiled by Inductor (what the fp8 backend runs without the knob);
* ``eager norm``: the same norm as eager torch;
* ``fp8pass::rmsnorm``: the op, forward and backward (on CPU: its compiled loops, ``kernels.cpu.run_fused``).

Shapes are the rows x d_model of ``benchmarks/train_step.py``'s ``tiny`` (2048 x 256) and ``block``
(2048 x 2048) norms; the ratio to ``inductor norm`` is the op's cost per norm. What that is of a step:
``benchmarks/memory.py``'s ``fp8 + save_norm_input_fp8`` row.

    python -m benchmarks.norm [--shapes tiny,block] [--rounds 11] [--threads 1] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from benchmarks.common import listed, machine, time_rounds
from fp8pass.op_schema import NormKnobs
from fp8pass.runtime.rmsnorm import rmsnorm_reference

SHAPES = {"tiny": (2048, 256), "block": (2048, 2048)}
KNOBS = NormKnobs(eps=1e-5, hat_dtype=None, out_dtype=None, fwd_format="e4m3")  # fp8pass's TinyLlama form


def cases(rows: int, d: int) -> dict:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, d, generator=g).requires_grad_()
    w = (torch.randn(d, generator=g) * 0.5 + 1.0).requires_grad_()
    dy = torch.randn(rows, d, generator=g)
    compiled = torch.compile(lambda x, w: rmsnorm_reference(x, w, KNOBS), dynamic=True)

    def run(norm):
        def step():
            x.grad = w.grad = None
            norm(x, w).backward(dy)
        step.inputs = (x, w)
        return step

    return {"inductor norm": run(compiled), "eager norm": run(lambda x, w: rmsnorm_reference(x, w, KNOBS)),
            "fp8pass::rmsnorm": run(lambda x, w: torch.ops.fp8pass.rmsnorm(x, w, *KNOBS.args())[0])}


def run(shape: str, rounds: int) -> dict:
    rows, d = SHAPES[shape]
    times = time_rounds(cases(rows, d), "cpu", repeat=rounds, warmup=2)
    base = times["inductor norm"]
    out = {}
    for name, t in times.items():
        ratios = [a / b for a, b in zip(t, base)]
        out[name] = {"ms": statistics.median(t) * 1e3, "all_ms": [s * 1e3 for s in t],
                     "ratio": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)]}
    return {"shape": shape, "rows": rows, "d": d, "cases": out}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="tiny,block")
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    p.add_argument("--json")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    shapes = listed(p, a.shapes, SHAPES, "shape")
    res = {"machine": machine(), "load_before": os.getloadavg(), "results": [run(s, a.rounds) for s in shapes]}
    res["load_after"] = os.getloadavg()
    print("| shape (rows x d) | case | fwd+bwd ms, median | / inductor norm (median of per-round ratios; range) |")
    print("|---|---|---|---|")
    for r in res["results"]:
        for name, c in r["cases"].items():
            lo, hi = c["ratio_range"]
            print(f"| {r['shape']} ({r['rows']} x {r['d']}) | {name} | {c['ms']:.2f} | {c['ratio']:.2f} ({lo:.2f}-{hi:.2f}) |")
    print(f"load (1-min) before {res['load_before'][0]:.2f}, after {res['load_after'][0]:.2f}; "
          f"{res['machine']['cpu']}, {res['machine']['cpu_capability']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
