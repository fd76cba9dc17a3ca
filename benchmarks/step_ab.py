"""A/B of one implementation choice inside whole training steps, in one process.

A kernel timed alone can mislead: the E5M2 upcast through fp32 measured 2x slower alone in one
process (its fp32 -> bf16 conversion into a fresh 1 MiB tensor took 0.40 ms, into a reused buffer
0.05 ms) and 4x faster in another, and made whole steps 3% faster. So a choice is kept when whole steps say so: one model, one optimizer, the
step run with choice A and with choice B alternately, round by round (load from other processes
hits both alike), medians and each round printed.

Each experiment names a module attribute and its two values; both must compute the same bits (the
tests hold that), only the time may differ.

    python -m benchmarks.step_ab e5m2-upcast [--shape tiny|block] [--variant fp8-smooth-fp8adam]
                                 [--rounds 11] [--warmup 2] [--threads 1]
    python -m benchmarks.step_ab e5m2-upcast --moe fp8_current|fp8_delayed [--moe-grad-rounding stochastic]
                                 # the MoE layer step of benchmarks/moe.py at its default size
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks import moe
from benchmarks.common import baseline_dtype, machine
from benchmarks.train_step import SHAPES, VARIANTS, build
from fp8pass.kernels import cpu

EXPERIMENTS = {  # name -> (module, attribute, {label: value}); the first label is today's choice
    "e5m2-upcast": (cpu, "_UPCAST_OUTSIDE_THE_LOOP",
                    {"via fp32": (torch.float8_e5m2,), "one loop": ()}),
}


MOE_CASES = ("fp8_current", "fp8_delayed")


def make_step(shape: str, variant: str, device: str = "cpu", grad_rounding: str = "nearest"):
    """One training step of ``train_step``'s ``shape`` and ``variant``; ``shape="moe"``: forward +
    backward of ``moe.py``'s expert layer (its default size, gradients rounded by ``grad_rounding``)
    for the case named by ``variant``."""
    if shape == "moe":
        fns, _ = moe.cases(4096, 8, 2, 1024, 2816, device, grad_rounding=grad_rounding)
        return fns[variant]
    return build(shape, variant, device, baseline_dtype(device))[-1]


def run(name: str, shape: str = "tiny", variant: str = "fp8-smooth-fp8adam", rounds: int = 11,
        warmup: int = 2, device: str = "cpu", grad_rounding: str = "nearest") -> dict:
    module, attr, choices = EXPERIMENTS[name]
    keep = getattr(module, attr)
    step = make_step(shape, variant, device, grad_rounding)
    times: dict[str, list[float]] = {label: [] for label in choices}
    try:
        for _ in range(warmup):
            for value in choices.values():
                setattr(module, attr, value)
                step()
        for _ in range(rounds):
            for label, value in choices.items():
                setattr(module, attr, value)
                start = time.perf_counter()
                step()
                times[label].append((time.perf_counter() - start) * 1e3)
    finally:
        setattr(module, attr, keep)
    medians = {label: statistics.median(t) for label, t in times.items()}
    first = next(iter(medians))
    return {"experiment": name, "shape": shape, "variant": variant, "medians_ms": medians,
            "ratios": {label: m / medians[first] for label, m in medians.items()}, "rounds_ms": times}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("experiment", choices=sorted(EXPERIMENTS))
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--variant", choices=sorted(VARIANTS), default="fp8-smooth-fp8adam")
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    ap.add_argument("--moe", choices=MOE_CASES, default=None,
                    help="time moe.py's expert layer (this case) instead of a training step")
    ap.add_argument("--moe-grad-rounding", choices=("nearest", "stochastic"), default="nearest",
                    help="the MoE layer's gradient rounding (moe.py --grad-rounding)")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.warmup < 1:
        ap.error("--rounds and --warmup must be at least 1 (the first steps compile)")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(machine())
    shape, variant = ("moe", args.moe) if args.moe else (args.shape, args.variant)
    res = run(args.experiment, shape, variant, args.rounds, args.warmup, grad_rounding=args.moe_grad_rounding)
    print(f"\n## {res['experiment']}: {res['variant']} step, {res['shape']}, {args.rounds} alternated rounds")
    print("| choice | median ms | / first | rounds ms |\n|---|---|---|---|")
    for label, m in res["medians_ms"].items():
        rounds = " ".join(f"{t:.0f}" for t in res["rounds_ms"][label])
        print(f"| {label} | {m:.1f} | {res['ratios'][label]:.3f} | {rounds} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
