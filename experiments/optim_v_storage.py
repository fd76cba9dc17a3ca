"""How to store Adam's second moment in FP8: v itself, or sqrt(v)? Measure the update error.

A tensor of 32768 elements (256 blocks of 128) gets a stream of gradients whose per-element scale is
log-uniform over ``spread`` decades inside every block (embedding rows, rare features, and layer
outliers all produce such spreads). Adam runs with fp32 moments and with each FP8 storage variant on
the same stream (lr = 0, so only the moments evolve); after ``steps`` steps we compare the update
u = m_hat / (sqrt(v_hat) + eps) element by element with the fp32 one.

The update is computed with the optimizer's own stored m and v (``opt.moments``), i.e. m in E4M3 as
the optimizer really keeps it: what the parameter would receive. The ``v alone`` columns repeat the
measurement with fp32 Adam's m in place of the stored one, so that only the storage of v differs
(the first version of this experiment reported only those). The row "m E4M3, v fp32" is m's own
share of the error.

Reported per variant, over the elements whose fp32 update matters (|u| > 1e-3): median and 99th
percentile of |u - u_fp32| / |u_fp32|, the largest ratio |u| / |u_fp32| (a blow-up: v flushed to 0
while m survives gives m / eps), and the shares of updates more than 2x too large and more than 2x
too small. Run: ``python -m experiments.optim_v_storage`` (about a minute).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

import fp8pass.optim as fo

# name -> fp8pass.optim.AdamW storage options (m is E4M3 in all of them, the optimizer's default)
VARIANTS = {
    "m E4M3, v fp32 (m alone)": dict(v_format="fp32"),
    "v in E5M2 (paper form)": dict(v_sqrt=False),
    "sqrt(v) in E5M2": dict(v_sqrt=True),
    "v in E5M2, stochastic": dict(v_sqrt=False, rounding="stochastic"),
    "sqrt(v) in E5M2, stochastic": dict(v_sqrt=True, rounding="stochastic"),
    "v in E5M2, per tensor": dict(v_sqrt=False, block_size=None),
    "sqrt(v) in E5M2, per tensor": dict(v_sqrt=True, block_size=None),
    "v in E4M3": dict(v_sqrt=False, v_format="e4m3"),
}
CASES = ((0.95, "steady", None), (0.999, "steady", None), (0.95, "every other element stops at step 30", 30))


def _errors(u: torch.Tensor, u0: torch.Tensor) -> dict:
    keep = u0.abs() > 1e-3  # updates that matter
    rel = ((u - u0).abs() / u0.abs())[keep]
    ratio = (u.abs() / u0.abs().clamp_min(1e-12))[keep]
    return dict(median=rel.median().item(), p99=rel.quantile(0.99).item(), max_ratio=ratio.max().item(),
                too_large=(ratio > 2).float().mean().item(), too_small=(ratio < 0.5).float().mean().item())


def run(spread: float, beta2: float, steps: int, decay_after: int | None, variant: dict, seed: int = 0) -> dict:
    """Errors of the update of ``variant`` against fp32 Adam on one gradient stream (see the module doc)."""
    n = 256 * 128
    g = torch.Generator().manual_seed(seed)
    scales = 10 ** (-spread * torch.rand(n, generator=g))
    ref_p = torch.nn.Parameter(torch.zeros(n))
    p = torch.nn.Parameter(torch.zeros(n))
    kw = dict(lr=0.0, betas=(0.9, beta2), eps=1e-8, weight_decay=0.0, kernels="torch")
    ref = fo.AdamW([ref_p], m_format="fp32", v_format="fp32", **kw)
    opt = fo.AdamW([p], generator=torch.Generator().manual_seed(seed + 1), **kw, **variant)
    for t in range(steps):
        grad = torch.randn(n, generator=g) * scales * 1e-2
        if decay_after is not None and t >= decay_after:
            grad[1::2] = 0.0  # every other element stops receiving gradient: its v must decay while
            # its block's amax (set by the active neighbours) does not, so the scale cannot do it
        ref_p.grad = grad
        p.grad = grad.clone()
        ref.step()
        opt.step()
    bc1, bc2 = 1 - 0.9**steps, 1 - beta2**steps
    m0, v0 = ref.moments(ref_p)
    m1, v1 = opt.moments(p)
    u0 = (m0 / bc1) / ((v0 / bc2).sqrt() + 1e-8)
    real = _errors((m1 / bc1) / ((v1 / bc2).sqrt() + 1e-8), u0)           # what the optimizer applies
    v_alone = _errors((m0 / bc1) / ((v1 / bc2).sqrt() + 1e-8), u0)        # fp32 m: v's storage only
    return {**real, "v_alone": v_alone}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--spreads", default="2,6", help="decades of |g| inside a block, comma-separated")
    ap.add_argument("--json", default=None, help="write the rows here too")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    print(f"# m in E4M3 (block 128 unless 'per tensor'), {args.steps} steps; CPU "
          f"{torch.backends.cpu.get_cpu_capability()}, load {os.getloadavg()[0]:.1f}")
    print("| spread | beta2 | case | storage | median rel. err | p99 | max \\|u\\|/\\|u32\\| | > 2x too large "
          "| < 0.5x | v alone: > 2x too large | v alone: max |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for spread in (float(s) for s in args.spreads.split(",")):
        for beta2, case, decay in CASES:
            for name, variant in VARIANTS.items():
                r = run(spread, beta2, args.steps, decay, variant)
                rows.append({"spread_decades": spread, "beta2": beta2, "case": case, "storage": name, **r})
                va = r["v_alone"]
                print(f"| 1e{spread:g} | {beta2} | {case} | {name} | {r['median']:.4f} | {r['p99']:.3g} | "
                      f"{r['max_ratio']:.3g} | {100 * r['too_large']:.2f}% | {100 * r['too_small']:.2f}% | "
                      f"{100 * va['too_large']:.2f}% | {va['max_ratio']:.3g} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows,
                                               "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                                               "torch": torch.__version__}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
