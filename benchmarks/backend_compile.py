"""Compile-time and step-time cost of the fp8 backend (ratios measured in one run).

1. compile time of ``backend="fp8"`` / ``backend="inductor"`` for a 4-layer tiny Llama in bf16
   (forward + backward compile: the first training step minus a steady step, on a second fresh
   instance so the runtime's process-wide cast kernels are already compiled), Inductor's caches off;
2. fp8pass pass time (copy + plan + rewrite, no compile) for 1, 2, 4, ..., 64 layers;
3. steady step time (fwd + bwd, median of 3) of the compiled tiny Llama, fp8 / bf16, on this CPU.

Usage: python benchmarks/backend_compile.py [--max-layers 64] [--json out.json]
The tiny Llama is the torchtitan-style model of tests/_models.py (dim 256, ffn 512, 4 heads).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "tests")]

import fp8pass  # noqa: E402
from _models import TitanLlama  # noqa: E402
from fp8pass.backend import Backend  # noqa: E402
from fp8pass.config import Config  # noqa: E402

DIM, HIDDEN, VOCAB, HEADS = 256, 512, 512, 4


def model(n_layers, dtype=torch.float32):
    torch.manual_seed(0)
    return TitanLlama(vocab=VOCAB, dim=DIM, n_layers=n_layers, n_heads=HEADS, hidden=HIDDEN).to(dtype)


def step(cm, ids):
    out = cm(ids)
    torch.nn.functional.cross_entropy(out.flatten(0, 1).float(), ids.flatten()).backward()


def compile_seconds(backend_factory, n_layers, ids, dtype):
    """First-step time minus steady-step time, for a fresh model instance and a fresh backend.

    The first call (a throw-away instance) also compiles the runtime's own cached CPU cast kernels,
    which belong to the runtime, not to a model's compile; the measured call is the second.
    """
    results = []
    for _ in range(2):
        m = model(n_layers, dtype)
        cm = torch.compile(m, backend=backend_factory(), fullgraph=True)
        t0 = time.perf_counter()
        step(cm, ids)
        first = time.perf_counter() - t0
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            step(cm, ids)
            times.append(time.perf_counter() - t0)
        steady = statistics.median(times)
        results.append((first - steady, steady))
    return results[-1]


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
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    torch._inductor.config.fx_graph_cache = False
    torch._inductor.config.autotune_local_cache = False
    os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")
    torch._functorch.config.enable_autograd_cache = False
    ids = torch.randint(0, VOCAB, (4, 128))
    res = {"torch": torch.__version__, "threads": torch.get_num_threads(), "dim": DIM, "hidden": HIDDEN,
           "tokens_per_step": ids.numel()}

    n = args.steps_layers
    dt = torch.bfloat16
    inductor = lambda: "inductor"  # noqa: E731
    fp8 = lambda: fp8pass.backend(Config())  # noqa: E731
    c_ind, s_ind = compile_seconds(inductor, n, ids, dt)
    c_fp8, s_fp8 = compile_seconds(fp8, n, ids, dt)
    res["compile_s"] = {"inductor": c_ind, "fp8": c_fp8, "ratio_fp8_over_inductor": c_fp8 / c_ind}
    res["step_s"] = {"bf16_inductor": s_ind, "fp8": s_fp8, "ratio_fp8_over_bf16": s_fp8 / s_ind}
    print(f"compile time ({n} layers, bf16 model): inductor {c_ind:.1f} s, fp8 {c_fp8:.1f} s, "
          f"ratio {c_fp8 / c_ind:.2f} (goal <= 1.3)")
    print(f"step time ({n} layers, {ids.numel()} tokens, fwd+bwd): bf16 {s_ind * 1e3:.1f} ms, "
          f"fp8 {s_fp8 * 1e3:.1f} ms, ratio {s_fp8 / s_ind:.2f}")

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
