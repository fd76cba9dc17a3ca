"""Quantize throughput relative to ``tensor.clone()`` of the same input, measured in one run.

Current scaling = amax pass + cast (``fp8pass.quantize``); delayed scaling = one cast with the held
scale that records the amax in the same read (``fp8pass.quantize_delayed``). The ratio is
``clone time / quantize time``: 1.0 means quantizing moves data as fast as copying it. Goal on CPU: >= 0.5.

    python -m benchmarks.quantize [--numel 67108864] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

import fp8pass
from benchmarks.common import machine, time_fn


def run(numel: int = 64 * 1024 * 1024, device: str = "cpu", repeat: int = 7) -> list[dict]:
    """Rounds of [clone, each quantize case], interleaved so that load changes on a shared machine
    hit every case alike; a case's ratio is the median over rounds of clone time / its time in that round."""
    torch.manual_seed(0)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(numel, device=device).to(dtype)
        cases = {}
        for fmt in (fp8pass.E4M3, fp8pass.E5M2):
            state = fp8pass.DelayedScalingState(fp8pass.DelayedScaling(), fmt, device=device)
            cases[(fmt.name, "current (amax+cast)")] = lambda fmt=fmt: fp8pass.quantize(x, fmt)
            cases[(fmt.name, "delayed (cast+amax record)")] = lambda s=state: fp8pass.quantize_delayed(x, s)
        times = {k: [] for k in cases}
        clones = []
        for _ in range(repeat):
            clones.append(time_fn(lambda: x.clone(), warmup=1, repeat=1)["median"])
            for k, fn in cases.items():
                times[k].append(time_fn(fn, warmup=1, repeat=1)["median"])
        for (fmt_name, op), ts in times.items():
            ratios = sorted(c / t for c, t in zip(clones, ts))
            rows.append({
                "dtype": str(dtype).replace("torch.", ""), "format": fmt_name, "op": op, "numel": numel,
                "clone_ms": statistics.median(clones) * 1e3, "ms": statistics.median(ts) * 1e3,
                "spread_ms": (max(ts) - min(ts)) * 1e3, "ratio_vs_clone": statistics.median(ratios),
            })
    return rows


def to_markdown(rows: list[dict]) -> str:
    lines = ["| input | format | op | clone ms | quantize ms (spread) | clone / quantize |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['dtype']} | {r['format']} | {r['op']} | {r['clone_ms']:.1f} | "
                     f"{r['ms']:.1f} ({r['spread_ms']:.1f}) | **{r['ratio_vs_clone']:.2f}** |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=64 * 1024 * 1024)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = run(args.numel, args.device, args.repeat)
    print(machine())
    print(to_markdown(rows))
    worst = min(r["ratio_vs_clone"] for r in rows)
    print(f"worst ratio {worst:.2f} (goal on CPU: >= 0.5)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
