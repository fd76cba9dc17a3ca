"""PNG plots of training runs: loss per recipe, per-layer max |h|, SwiGLU alignment.

matplotlib is optional: without it :func:`plot_runs` prints how to install it and returns no files.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .logging import read_metrics

__all__ = ["plot_runs", "find_runs", "have_matplotlib"]


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def find_runs(root: str | Path) -> dict[str, Path]:
    """``{run name: metrics.jsonl}`` for ``root`` itself and its direct sub-folders."""
    root = Path(root)
    runs = {}
    if (root / "metrics.jsonl").exists():
        runs[root.name] = root / "metrics.jsonl"
    for d in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
        if (d / "metrics.jsonl").exists():
            runs[d.name] = d / "metrics.jsonl"
    return runs


def _ema(xs, beta=0.9):
    out, m = [], None
    for x in xs:
        m = x if m is None else beta * m + (1 - beta) * x
        out.append(m)
    return out


def plot_runs(root: str | Path, out_dir: str | Path | None = None, stream=None) -> list[Path]:
    """Write loss.png, max_activation.png and alignment.png for the runs under ``root``.

    Returns the written paths (empty, with a message on ``stream``, when matplotlib is missing).
    """
    stream = stream or sys.stderr
    if not have_matplotlib():
        stream.write("plots skipped: matplotlib is not installed (pip install matplotlib); "
                     "metrics.jsonl holds every number\n")
        return []
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = find_runs(root)
    out_dir = Path(out_dir or root)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, path in runs.items():
        tr = read_metrics(path, "train")
        ev = read_metrics(path, "eval")
        if tr:
            line, = ax.plot([r["step"] for r in tr], _ema([r["loss"] for r in tr]), label=f"{name} train (EMA)", lw=1)
            if ev:
                ax.plot([r["step"] for r in ev], [r["val_loss"] for r in ev], "o--", color=line.get_color(),
                        label=f"{name} val", ms=4)
    ax.set_xlabel("step"); ax.set_ylabel("cross-entropy (nats/byte)"); ax.set_title("loss per recipe")
    ax.grid(alpha=0.3); ax.legend(fontsize=8)
    written.append(_save(fig, out_dir / "loss.png", plt))

    for metric, fname, title in (("max_abs_h", "max_activation.png", "per-layer max |h| (SwiGLU output)"),
                                 ("max_abs_corr", "alignment.png", "SwiGLU max |corr(w1ᵢ, w2ᵢ)| per layer")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        any_data = False
        styles = ["-", "--", ":", "-."]
        for k, (name, path) in enumerate(runs.items()):
            recs = read_metrics(path, "monitor")
            for layer in sorted({r["layer"] for r in recs}):
                pts = [(r["step"], r[metric]) for r in recs if r["layer"] == layer and metric in r]
                if pts:
                    any_data = True
                    ax.plot(*zip(*pts), styles[k % 4], marker=".", label=f"{name} {layer}", lw=1)
        if not any_data:
            plt.close(fig)
            continue
        ax.set_xlabel("step"); ax.set_title(title); ax.grid(alpha=0.3); ax.legend(fontsize=6, ncol=2)
        if metric == "max_abs_h":
            ax.set_yscale("log")
        written.append(_save(fig, out_dir / fname, plt))
    return written


def _save(fig, path, plt):
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
