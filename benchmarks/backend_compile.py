"""Compile-time and step-time cost of the fp8 backend (ratios measured in one run).

1. compile time of ``backend="fp8"`` / ``backend="inductor"`` for a 4-layer tiny Llama in bf16
   (fp32 on CPUs without native bf16 matmuls: ``benchmarks.common.baseline_dtype``; forward + backward compile: the first training step minus a steady step), each in a fresh
   process with Inductor's caches off; fp8 also with ``FP8PASS_CPU_FUSED=0``, which leaves out the
   runtime's own compiled cast kernels (compiled on first use) and so isolates the graph compile;
2. fp8pass pass time (copy + plan + rewrite, no compile) for 1, 2, 4, ..., 64 layers;
3. steady step time (fwd + bwd, median of 3) of the compiled tiny Llama, fp8 / bf16, on this CPU.

Usage: python -m benchmarks.backend_compile [--max-layers 64] [--steps-layers 4] [--no-eager-casts] [--json out.json]
The tiny Llama is the torchtitan-style model of fp8pass/testing/models.py (dim 256, ffn 512, 4 heads).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import fp8pass
from benchmarks.common import baseline_dtype, dtype_name
from fp8pass.compile_backend import Backend
from fp8pass.config import Config
from fp8pass.testing.models import TitanLlama

ROOT = Path(__file__).resolve().parents[1]

DIM, HIDDEN, VOCAB, HEADS = 256, 512, 512, 4


def model(n_layers, dtype=torch.float32):
    torch.manual_seed(0)
    return TitanLlama(vocab=VOCAB, dim=DIM, n_layers=n_layers, n_heads=HEADS, hidden=HIDDEN).to(dtype)


def step(cm, ids):
    out = cm(ids)
    torch.nn.functional.cross_entropy(out.flatten(0, 1).float(), ids.flatten()).backward()


def compile_seconds(which, n_layers, ids, dtype):
    """(first-step time - steady-step time, steady-step time) of one fresh compile in this process."""
    m = model(n_layers, dtype)
    be = "inductor" if which == "inductor" else fp8pass.backend(Config())
    cm = torch.compile(m, backend=be, fullgraph=True)
    t0 = time.perf_counter()
    step(cm, ids)
    first = time.perf_counter() - t0
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        step(cm, ids)
        times.append(time.perf_counter() - t0)
    steady = statistics.median(times)
    return first - steady, steady


def in_subprocess(which, n_layers, extra_env=None):
    """Run one compile measurement in a fresh process (no in-memory caches), Inductor caches off."""
    env = dict(os.environ, TORCHINDUCTOR_FORCE_DISABLE_CACHES="1", **(extra_env or {}))
    r = subprocess.run([sys.executable, "-m", "benchmarks.backend_compile", "--one", which, "--steps-layers", str(n_layers)],
                       cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def pass_seconds(n_layers, ids):
    graphs = []

    def cap(gm, ex):
        graphs.append((gm, ex))
        return gm.forward

    torch._dynamo.reset()
    m = model(n_layers)
    torch.compile(m, backend=cap, fullgraph=True)(ids)
    gm, ex = graphs[0]
    be = Backend(Config())
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        _, rec = be.transform(gm, ex)
        best = min(best, time.perf_counter() - t0)
    assert len(rec.report.swiglus) == n_layers
    return best


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-layers", type=int, default=64)
    ap.add_argument("--steps-layers", type=int, default=4)
    ap.add_argument("--no-eager-casts", action="store_true",
                    help="leave out the third compile (fp8 with the runtime's eager casts, a diagnosis, no goal): "
                         "bench --quick, to fit its time budget")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    ids = torch.randint(0, VOCAB, (4, 128))
    n = args.steps_layers
    if args.one:
        c, s_ = compile_seconds(args.one, n, ids, baseline_dtype("cpu"))
        print(json.dumps({"compile_s": c, "step_s": s_}))
        return None
    res = {"torch": torch.__version__, "threads": torch.get_num_threads(), "dim": DIM, "hidden": HIDDEN,
           "layers": n, "tokens_per_step": ids.numel(), "dtype": dtype_name(baseline_dtype("cpu"))}
    ind = in_subprocess("inductor", n)
    fp8 = in_subprocess("fp8", n)
    res["inductor"], res["fp8"] = ind, fp8
    r_all = fp8["compile_s"] / ind["compile_s"]
    res["compile_ratio"] = {"fp8_over_inductor": r_all}
    r_step = fp8["step_s"] / ind["step_s"]
    res["step_ratio_fp8_over_bf16"] = r_step
    eager = ""
    if not args.no_eager_casts:
        fp8_eager_casts = in_subprocess("fp8", n, {"FP8PASS_CPU_FUSED": "0"})
        res["fp8_eager_casts"] = fp8_eager_casts
        r_graph = fp8_eager_casts["compile_s"] / ind["compile_s"]
        res["compile_ratio"]["fp8_eager_casts_over_inductor"] = r_graph
        eager = f" | fp8 with the runtime's eager casts {fp8_eager_casts['compile_s']:.1f} s (ratio {r_graph:.2f})"
    print(f"compile time ({n} layers, {res['dtype']}, first step - steady step, fresh process each):")
    print(f"  inductor {ind['compile_s']:.1f} s | fp8 {fp8['compile_s']:.1f} s (ratio {r_all:.2f}){eager}; goal <= 1.3")
    print(f"step time ({ids.numel()} tokens, fwd+bwd): {res['dtype']} inductor {ind['step_s'] * 1e3:.0f} ms, "
          f"fp8 {fp8['step_s'] * 1e3:.0f} ms (ratio {r_step:.2f})"
          + (f", fp8 eager casts {res['fp8_eager_casts']['step_s'] * 1e3:.0f} ms" if "fp8_eager_casts" in res else ""))

    layers, passes = [], []
    k = 1
    while k <= args.max_layers:
        t = pass_seconds(k, ids[:1, :16])
        layers.append(k)
        passes.append(t)
        print(f"pass time {k:3d} layers: {t * 1e3:8.1f} ms  ({t / k * 1e3:.2f} ms/layer)")
        k *= 2
    res["pass_s"] = dict(zip(map(str, layers), passes))
    per_layer = [t / k for k, t in zip(layers, passes)]
    res["pass_ms_per_layer_first_last"] = [per_layer[0] * 1e3, per_layer[-1] * 1e3]
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
