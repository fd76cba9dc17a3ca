"""Step time of fp8pass AdamW alone: fp32 weights (the master copy) against bf16 weights updated by
stochastic rounding (``bf16_stochastic_round=True``), and bf16 weights rounded to nearest, on CPU.

The three optimizers update their own copies of ``benchmarks.optim.make_params``' parameters (default
100M: 2048 x 2048 matrices and a few vectors) with fixed gradients, with the group's kernels
(``--kernels``, default "auto": the compiled chunk update on CPU at this size); the rounds interleave the
three so that load from other processes hits all of them alike; the median of ``--rounds`` steps is
kept, after one untimed step each (state creation and compilation). Prints per optimizer its median step
and the ratio to the fp32-weight step in the same run. Run with another tree on PYTHONPATH to time its
fp8pass with the same script::

    python -m tools.bf16_sr_step_time [--params 100e6] [--rounds 5] [--threads 1] [--kernels auto]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import fp8pass
import fp8pass.optim as fo
from benchmarks.optim import make_params


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=100e6)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kernels", default="auto")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    fp32 = make_params(int(a.params))
    kw = dict(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, kernels=a.kernels)

    def bf16_copy():
        out = [torch.nn.Parameter(p.detach().bfloat16()) for p in fp32]
        for q, p in zip(out, fp32):
            q.grad = p.grad.bfloat16()
        return out

    opts = {"fp32 weights": fo.AdamW(fp32, **kw),
            "bf16 weights, stochastic rounding": fo.AdamW(bf16_copy(), bf16_stochastic_round=True,
                                                          generator=torch.Generator().manual_seed(0), **kw),
            "bf16 weights, nearest": fo.AdamW(bf16_copy(), **kw)}
    times: dict = {name: [] for name in opts}
    for name, opt in opts.items():
        opt.step()  # state, compilation
    for _ in range(a.rounds):
        for name, opt in opts.items():
            t0 = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - t0)
    n = sum(p.numel() for p in fp32)
    print(f"fp8pass {fp8pass.__file__}, {n / 1e6:.1f}M parameters, {a.threads} thread(s), kernels={a.kernels}, "
          f"{a.rounds} interleaved rounds")
    base = statistics.median(times["fp32 weights"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:36s} {med * 1e3:9.1f} ms  ({', '.join(f'{t * 1e3:.0f}' for t in ts)})  x{med / base:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
