"""How to store Adam's second moment in E5M2: v itself, or sqrt(v)? Measure the update error.

A tensor of 32768 elements (256 blocks of 128) gets a stream of gradients whose per-element scale is
log-uniform over ``spread`` decades inside every block (embedding rows, rare features, and layer
outliers all produce such spreads). Adam runs with fp32 moments and with each storage variant on the
same stream (lr = 0, so only the moments evolve); after ``steps`` steps we compare the update
u = m_hat / (sqrt(v_hat) + eps) element by element with the fp32 one, using fp32 Adam's m in both so
that only the storage of v differs (m's own E4M3 error is the same for every variant).

Reported per variant: median and 99th percentile of |u - u_fp32| / |u_fp32|, the largest ratio
|u| / |u_fp32| (a blow-up: v flushed to 0 while m survives gives m / eps), and the share of elements
whose update is more than 2x too large. Run: ``python experiments/optim_v_storage.py``.
"""

from __future__ import annotations

import argparse

import torch

import fp8pass.optim as fo

VARIANTS = {
    "v in E5M2 (RNE)": dict(v_sqrt=False),
    "sqrt(v) in E5M2 (RNE)": dict(v_sqrt=True),
    "v in E5M2 (stochastic)": dict(v_sqrt=False, rounding="stochastic"),
    "sqrt(v) in E5M2 (stochastic)": dict(v_sqrt=True, rounding="stochastic"),
    "v in E4M3 (RNE)": dict(v_sqrt=False, v_format="e4m3"),
}


def run(spread: float, beta2: float, steps: int, decay_after: int | None, variant: dict, seed: int = 0):
    n = 256 * 128
    g = torch.Generator().manual_seed(seed)
    scales = 10 ** (-spread * torch.rand(n, generator=g))
    ref_p = torch.nn.Parameter(torch.zeros(n))
    p = torch.nn.Parameter(torch.zeros(n))
    kw = dict(lr=0.0, betas=(0.9, beta2), eps=1e-8, weight_decay=0.0)
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
    u1 = (m0 / bc1) / ((v1 / bc2).sqrt() + 1e-8)
    keep = u0.abs() > 1e-3  # updates that matter
    rel = ((u1 - u0).abs() / u0.abs())[keep]
    ratio = (u1.abs() / u0.abs().clamp_min(1e-12))[keep]
    return dict(median=rel.median().item(), p99=rel.quantile(0.99).item(), max_ratio=ratio.max().item(),
                blowups=(ratio > 2).float().mean().item())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    print("| gradient spread in a block | beta2 | case | storage | median rel. err | p99 rel. err | max |u|/|u32| | share > 2x |")
    print("|---|---|---|---|---|---|---|---|")
    for spread in (2, 6):
        for beta2, case, decay in ((0.95, "steady", None), (0.999, "steady", None),
                                   (0.95, "every other element stops at step 30", 30)):
            for name, variant in VARIANTS.items():
                r = run(spread, beta2, args.steps, decay, variant)
                print(f"| 1e{spread} | {beta2} | {case} | {name} | {r['median']:.4f} | {r['p99']:.3f} | "
                      f"{r['max_ratio']:.3g} | {r['blowups']:.4f} |", flush=True)


if __name__ == "__main__":
    main()
