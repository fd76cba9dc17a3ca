"""PNG plots of training runs: loss per recipe, per-layer max |h|, SwiGLU alignment.

matplotlib is optional: without it :func:`plot_runs` prints how to install it and returns no files.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..checkpoint import atomic_write
from .logging import read_metrics

__all__ = ["plot_runs", "find_runs", "have_matplotlib", "run_label"]


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


def run_label(name: str, path: Path) -> str:
    """The legend's name of a run: its folder name, plus the dtype it really computed in where the
    name would mislead (the "bf16" recipe runs in fp32 on CPUs without native bf16 matmuls)."""
    meta = read_metrics(path, "meta")
    precision = meta[0].get("precision") if meta else None
    recipe = meta[0].get("recipe", name) if meta else name
    if precision is None or precision == "bf16":
        return name
    return f"{name} (ran in {precision})" if recipe.startswith("bf16") else f"{name} (rest in {precision})"


def _layer_order(layer: str) -> tuple:
    """Sort key: layers.2 before layers.10."""
    return tuple(int(p) if p.isdigit() else p for p in layer.split("."))


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

    labels = {name: run_label(name, path) for name, path in runs.items()}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, path in runs.items():
        tr = read_metrics(path, "train")
        ev = read_metrics(path, "eval")
        if tr:
            line, = ax.plot([r["step"] for r in tr], _ema([r["loss"] for r in tr]), label=f"{labels[name]} train (EMA)",
                            lw=1)
            if ev:
                ax.plot([r["step"] for r in ev], [r["val_loss"] for r in ev], "o--", color=line.get_color(),
                        label=f"{labels[name]} val", ms=4)
    ax.set_xlabel("step"); ax.set_ylabel("cross-entropy (nats/byte)"); ax.set_title("loss per recipe")
    ax.grid(alpha=0.3); ax.legend(fontsize=9)
    written.append(_save(fig, out_dir / "loss.png", plt))

    monitor = {name: read_metrics(path, "monitor") for name, path in runs.items()}
    # one colour per layer in every recipe, one line style per recipe: a layer is compared across recipes
    layers = sorted({r["layer"] for recs in monitor.values() for r in recs}, key=_layer_order)
    colours = plt.get_cmap("tab10" if len(layers) <= 10 else "tab20")
    styles = ["-", "--", ":", "-."]
    for metric, fname, title, ylabel in (
            ("max_abs_h", "max_activation.png", "per-layer max |h| (SwiGLU output)", "max |h| over channels (log)"),
            ("max_abs_corr", "alignment.png", "SwiGLU weight alignment per layer", "max over channels of |corr(w1ᵢ, w2ᵢ)|")):
        fig, ax = plt.subplots(figsize=(8, 5))
        any_data = False
        for k, (name, recs) in enumerate(monitor.items()):
            for j, layer in enumerate(layers):
                pts = [(r["step"], r[metric]) for r in recs if r["layer"] == layer and metric in r]
                if pts:
                    any_data = True
                    ax.plot(*zip(*pts), styles[k % 4], color=colours(j), marker=".", label=f"{labels[name]}: {layer}",
                            lw=1.2)
        if not any_data:
            plt.close(fig)
            continue
        ax.set_xlabel("step"); ax.set_ylabel(ylabel); ax.set_title(title); ax.grid(alpha=0.3)
        if metric == "max_abs_h":
            ax.set_yscale("log")
        # beside the axes: with recipes x layers entries, a legend inside hid the lines
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
        written.append(_save(fig, out_dir / fname, plt))
    return written


def _save(fig, path, plt):
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, dpi=110, format="png"))  # never through a link at ``path``
    plt.close(fig)
    return path
