"""Experiment 1 (paper Thm. 1): ℓ2 regularisation + saturated gates align w1ᵢ and w2ᵢ (w1ᵢ = ±w2ᵢ).

Setting (pure torch, fp32, seconds per run):
- inputs x ∈ R^8, N = 4096 samples, x = μ·e + ξ with ξ ~ N(0, I) and |μ| = 6 along a random unit e:
  a gate whose w2ᵢ has a large component along e sees |w2ᵢᵀx| far from 0 on (almost) every sample,
  so σ'(w2ᵢᵀx) -> 0 there; gates nearly orthogonal to e keep w2ᵢᵀx near 0 (unsaturated). One run
  thus holds saturated and unsaturated channels side by side.
- targets: a wider random SwiGLU teacher (64 channels, 4 outputs), standardised; the student has
  k = 32 channels, so the data exceed its capacity (the theorem's typical regime).
- student: y = W3 [(W1 x) ⊙ Swish(W2 x)], loss = MSE + λ/2 (‖W1‖² + ‖W2‖² + ‖W3‖²), full batch,
  Adam (cosine lr) then L-BFGS to a stationary point (gradient norm printed).
- per channel: corr(w1ᵢ, w2ᵢ) and cosine (fp8pass.monitor.weight_alignment) and the mean of
  σ'(w2ᵢᵀxₙ) over samples (0.25 = unsaturated at 0; -> 0 saturated); channels that weight decay
  drove to zero (‖w1ᵢ‖‖w2ᵢ‖ < 1e-4) are dead, have no direction, and are left out.
- λ = 1e-3 with 8 seeds, and the control λ = 0 (no weight decay) with the same seeds.

Run: ``python -m experiments.theorem1 [--out docs/results]`` (about 2-4 minutes on one shared core).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from fp8pass.monitor import weight_alignment

D, K, N, OUT, TEACHER = 8, 32, 4096, 4, 64
BINS = ((0.0, 0.05), (0.05, 0.1), (0.1, 0.15), (0.15, 0.2), (0.2, 0.26))
SAT, UNSAT = 0.05, 0.15          # mean σ' below SAT: saturated; above UNSAT: unsaturated


def make_data(seed: int, mu: float):
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(D, generator=g)
    e /= e.norm()
    x = torch.randn(N, D, generator=g) + mu * e
    t1, t2 = torch.randn(TEACHER, D, generator=g) / math.sqrt(D), torch.randn(TEACHER, D, generator=g) / math.sqrt(D)
    y = ((x @ t1.t()) * F.silu(x @ t2.t())) @ (torch.randn(TEACHER, OUT, generator=g) / 8)
    return x, (y - y.mean(0)) / y.std(0)


def fit(x, y, lam: float, seed: int, steps: int = 2000, lr: float = 1e-2, trace_every: int = 50):
    g = torch.Generator().manual_seed(seed + 1000)
    w1 = (torch.randn(K, D, generator=g) / math.sqrt(D)).requires_grad_()
    w2 = (torch.randn(K, D, generator=g) / math.sqrt(D)).requires_grad_()
    w3 = (torch.randn(OUT, K, generator=g) / math.sqrt(K)).requires_grad_()
    params = [w1, w2, w3]

    def objective():
        h = (x @ w1.t()) * F.silu(x @ w2.t())
        return ((h @ w3.t() - y) ** 2).mean() + lam / 2 * sum(p.pow(2).sum() for p in params)

    opt = torch.optim.Adam(params, lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps, eta_min=lr * 1e-3)
    trace = []
    for s in range(steps):
        loss = objective()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if s % trace_every == 0:
            trace.append((s, *channel_stats(x, w1.detach(), w2.detach())))
    lbfgs = torch.optim.LBFGS(params, lr=1, max_iter=500, tolerance_grad=1e-10, tolerance_change=1e-14,
                              history_size=50, line_search_fn="strong_wolfe")

    def closure():
        lbfgs.zero_grad()
        l = objective()
        l.backward()
        return l
    lbfgs.step(closure)
    loss = objective()
    grads = torch.autograd.grad(loss, params)
    gnorm = math.sqrt(sum(gr.pow(2).sum().item() for gr in grads))
    trace.append((steps, *channel_stats(x, w1.detach(), w2.detach())))
    return w1.detach(), w2.detach(), loss.item(), gnorm, trace


def channel_stats(x, w1, w2):
    """(corr, cos, mean σ'(w2ᵢᵀx), ‖w1ᵢ‖·‖w2ᵢ‖) per channel."""
    a = weight_alignment(w1, w2)
    s = torch.sigmoid(x @ w2.t())
    return a["corr"], a["cos"], (s * (1 - s)).mean(0), a["norm_w1"] * a["norm_w2"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/results")
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--mu", type=float, default=6.0)
    ap.add_argument("--lam", type=float, default=1e-3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    runs = {}
    for lam in (args.lam, 0.0):
        rows, traces = [], []
        for seed in range(args.seeds):
            x, y = make_data(seed, args.mu)
            w1, w2, loss, gnorm, trace = fit(x, y, lam, seed)
            corr, cos, sp, normprod = channel_stats(x, w1, w2)
            print(f"λ={lam:g} seed {seed}: loss {loss:.4f}, gradient norm at the end {gnorm:.1e}")
            for i in range(K):
                rows.append({"seed": seed, "channel": i, "corr": corr[i].item(), "cos": cos[i].item(),
                             "mean_sigma_prime": sp[i].item(), "norm_product": normprod[i].item(),
                             "loss": loss, "grad_norm": gnorm})
            traces.append(trace)
        runs[lam] = (rows, traces)

    summary = {}
    for lam, (rows, _) in runs.items():
        live = [r for r in rows if r["norm_product"] >= 1e-4]
        sat = [r for r in live if r["mean_sigma_prime"] < SAT]
        uns = [r for r in live if r["mean_sigma_prime"] > UNSAT]
        med = lambda v: sorted(v)[len(v) // 2] if v else float("nan")
        summary[str(lam)] = {
            "channels": len(rows), "dead": len(rows) - len(live),
            "saturated": len(sat), "unsaturated": len(uns),
            "saturated_median_abs_corr": med([abs(r["corr"]) for r in sat]),
            "saturated_min_abs_corr": min((abs(r["corr"]) for r in sat), default=float("nan")),
            "saturated_frac_abs_corr_gt_0.9": sum(abs(r["corr"]) > 0.9 for r in sat) / max(len(sat), 1),
            "saturated_positive": sum(r["corr"] > 0 for r in sat), "saturated_negative": sum(r["corr"] < 0 for r in sat),
            "unsaturated_median_abs_corr": med([abs(r["corr"]) for r in uns]),
            "unsaturated_frac_abs_corr_gt_0.9": sum(abs(r["corr"]) > 0.9 for r in uns) / max(len(uns), 1),
            "max_grad_norm": max(r["grad_norm"] for r in rows),
            "bins": [{"mean_sigma_prime": f"[{lo}, {hi})", "channels": len(b),
                      "median_abs_corr": med([abs(r["corr"]) for r in b]),
                      "frac_abs_corr_gt_0.9": sum(abs(r["corr"]) > 0.9 for r in b) / max(len(b), 1)}
                     for lo, hi in BINS for b in [[r for r in live if lo <= r["mean_sigma_prime"] < hi]]],
        }
    wall = time.perf_counter() - t0
    (out / "theorem1.json").write_text(json.dumps({"summary": summary, "args": vars(args), "wall_s": wall,
                                                   "channels": {str(k): v[0] for k, v in runs.items()}}, indent=1))
    print(json.dumps(summary, indent=1))
    print(f"wall {wall:.0f} s")
    plot(runs, args, out / "theorem1.png")
    return 0


def plot(runs, args, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install matplotlib)")
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (lam, (rows, _)) in zip(axes[:2], runs.items()):
        live = [r for r in rows if r["norm_product"] >= 1e-4]
        sc = ax.scatter([r["mean_sigma_prime"] for r in live], [r["corr"] for r in live],
                        c=[math.log10(r["norm_product"]) for r in live], s=12, cmap="viridis")
        ax.axvline(SAT, ls=":", c="gray")
        ax.axvline(UNSAT, ls=":", c="gray")
        ax.set_xlabel("mean σ'(w2ᵢᵀx) over samples  (0.25 unsaturated, → 0 saturated)")
        ax.set_ylabel("corr(w1ᵢ, w2ᵢ)")
        ax.set_title(f"λ = {lam:g}: {len(live)} live channels, {args.seeds} seeds")
        ax.set_ylim(-1.05, 1.05)
        fig.colorbar(sc, ax=ax, label="log10 ‖w1ᵢ‖‖w2ᵢ‖")
    # Trajectories (first seed, λ > 0): the most and least saturated live channels at the end.
    rows, traces = runs[args.lam]
    trace = traces[0]
    last_sp, last_np = trace[-1][3], trace[-1][4]
    live = [i for i in range(K) if last_np[i] >= 1e-4]
    order = sorted(live, key=lambda i: last_sp[i].item())
    ax = axes[2]
    for i in order[:3] + order[-2:]:
        ax.plot([t[0] for t in trace], [t[1][i].item() for t in trace],
                label=f"ch {i}: final mean σ' {last_sp[i].item():.3f}")
    ax.set_xlabel("Adam step (last point: after L-BFGS)")
    ax.set_ylabel("corr(w1ᵢ, w2ᵢ)")
    ax.set_title(f"seed 0, λ = {args.lam:g}: alignment over training")
    ax.set_ylim(-1.05, 1.05)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    sys.exit(main())
