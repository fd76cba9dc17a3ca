"""What the runtime precision audit costs: at compile time (per graph) and per training step.

    python -m tools.precision_audit [--layers 8] [--d-model 256] [--steps 5]

Compiles a TinyLlama (``--layers`` blocks) with the ``fp8`` backend (aot_eager), timing the audit
(``precision_audit.graph_gemms`` over each rewritten graph) against the backend's whole pass over the
graph (plan + rewrite + audit: ``GraphRecord.pass_seconds``) and the first call (compile + step). Then
per step: the only work the audit adds to a step is the trainer's check of ``audit_version(model)``
(``train.loop.log_precision_audit``); timed over 10,000 calls against the median step. The ops pay
nothing at run time (the records are made at compile time), so no step-time A/B is measured: there is
no per-step code to switch off. Ratios of one run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import fp8pass
import fp8pass.compile_backend as cb
from fp8pass.monitor import audit_version, precision_audit
from fp8pass.train import ModelConfig, TinyLlama


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    d = args.d_model
    model = TinyLlama(ModelConfig(d_model=d, n_layers=args.layers, n_heads=4, ffn=4 * d, max_seq_len=128))
    backend = fp8pass.backend(fp8pass.Config(compiler="aot_eager"))
    spent: list[float] = []
    real = cb.graph_gemms

    def timed(*a, **k):
        t = time.perf_counter()
        out = real(*a, **k)
        spent.append(time.perf_counter() - t)
        return out

    cb.graph_gemms = timed
    x = torch.randint(0, 256, (4, 128))
    cm = torch.compile(model, backend=backend)
    t0 = time.perf_counter()
    cm(x, x).backward()
    first = time.perf_counter() - t0
    cb.graph_gemms = real
    steps = []
    for _ in range(args.steps):
        t = time.perf_counter()
        cm(x, x).backward()
        steps.append(time.perf_counter() - t)
    n = 10_000
    t = time.perf_counter()
    for _ in range(n):
        audit_version(model)
    check = (time.perf_counter() - t) / n
    audit, passes = sum(spent), sum(r.pass_seconds for r in backend.records)
    step = statistics.median(steps)
    print(f"TinyLlama {args.layers} x d{d}: {len(backend.records)} graph(s), {len(precision_audit(model))} GEMM records")
    print(f"audit at compile: {audit * 1e3:.2f} ms = {audit / passes:.1%} of the backend's pass ({passes * 1e3:.0f} ms), "
          f"{audit / first:.3%} of the first call ({first:.1f} s)")
    print(f"per step: audit_version {check * 1e6:.2f} us = {check / step:.5%} of the median step ({step * 1e3:.0f} ms)")


if __name__ == "__main__":
    main()
