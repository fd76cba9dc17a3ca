"""Draw what the backend did to a model, one box per layer pattern, repeated blocks folded ("x 32").

The drawing is built from an explain :class:`~fp8pass.report.Report` (weight FQNs and what
happened to each), not from the dataflow graph: a 32-layer model's graph has thousands of nodes and
no drawing of it is readable. Weights whose FQN has a numeric component (``layers.7.mlp.up_proj``)
belong to block 7 of ``layers``; consecutive blocks with the same treatment of the same weights are
one box. Colors: red GLU MLPs (fused, Smooth-SwiGLU), orange FP8 linears, grey kept in high precision.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass, field

from ..checkpoint import atomic_write

__all__ = ["draw_graph", "layer_patterns", "MAX_PIXELS"]

MAX_PIXELS = 2000  # long side of a PNG
_DPI = 150
_COLORS = {"glu": "#f4a6a6", "fp8": "#fdd0a2", "kept": "#e0e0e0"}
_MAX_ROWS = 24  # rows of a box before the rest is summarized


@dataclass
class Box:
    """One box of the drawing: a top-level weight, or a run of identical blocks."""

    title: str
    rows: list[tuple[str, str]] = field(default_factory=list)  # (label, kind)
    repeat: int = 1


def _entries(report) -> list[tuple[str, str, str]]:
    """(weight FQN or op, label of what happened, kind) in graph order, a GLU as one entry (at its gate)."""
    glu_of = {}
    for s in report.swiglus:
        for w in (s.gate, s.up, s.down):
            glu_of[w] = s
    out, seen = [], set()
    for w in report.linears:
        s = glu_of.get(w)
        if s is not None:
            if id(s) not in seen:
                seen.add(id(s))
                names = "/".join(_leaf(x) for x in (s.gate, s.up)) + " -> " + _leaf(s.down)
                out.append((s.gate, f"{s.variant}: {names}", "glu"))
        else:
            out.append((w, f"{_leaf(w)}: FP8 linear", "fp8"))
    for where, reason in report.skipped:
        leaf = where.rsplit(".", 1)[-1]
        reason = reason.removeprefix("kept in high precision by ").removeprefix(f"{leaf}, kept (").rstrip(")")
        out.append((where, f"{_leaf(where)}: kept ({_short(reason)})", "kept"))
    out.sort(key=lambda e: _first_use(report.graph_before, e[0]))
    # an op kept inside a module (attention's score products) sits before the module's last linear,
    # its output projection
    for entry in [e for e in out if e[2] == "kept"]:
        rest = [e for e in out if e is not entry]
        inside = [i for i, e in enumerate(rest) if e[0].startswith(entry[0] + ".")]
        if inside:
            out = rest[:inside[-1]] + [entry] + rest[inside[-1]:]
    return out


def _first_use(code: str, name: str) -> int:
    """Where the graph first reads weight or module ``name``.

    Dynamo names a parameter ``..._modules_<a>_modules_<b>_parameters_<p>_``; a module is first used
    where one of its parameters or submodules is.
    """
    parts = name.split(".")
    as_param = "_modules_" + "_modules_".join(parts[:-1]) + "_parameters_" + parts[-1] + "_"
    as_module = "_modules_" + "_modules_".join(parts)
    found = [p for p in (code.find(as_param), code.find(as_module + "_modules_"), code.find(as_module + "_parameters_"))
             if p >= 0]
    return min(found) if found else len(code)


def _leaf(fqn: str) -> str:
    return fqn[:-len(".weight")] if fqn.endswith(".weight") else fqn


def _short(reason: str, width: int = 48) -> str:
    return reason if len(reason) <= width else reason[:width - 3] + "..."


_BLOCK = re.compile(r"^(.*?)\.(\d+)\.(.*)$")


def layer_patterns(report) -> list[Box]:
    """The boxes of the drawing, in graph order (also the text form of it)."""
    units: list[tuple[str, int | None, list[tuple[str, str]]]] = []  # (stack name, index, rows)
    for where, label, kind in _entries(report):
        m = _BLOCK.match(where)
        if m:
            stack, index = m.group(1), int(m.group(2))
            label = label.replace(f"{stack}.{index}.", "")
            if units and units[-1][0] == stack and units[-1][1] == index:
                units[-1][2].append((label, kind))
            else:
                units.append((stack, index, [(label, kind)]))
        else:
            units.append((_leaf(where), None, [(label, kind)]))
    boxes: list[Box] = []
    prev = None
    for stack, index, rows in units:
        if index is not None and prev is not None and prev[0] == stack and prev[2] == rows and prev[1] is not None:
            boxes[-1].repeat += 1
            first = boxes[-1].title.split(".")[-1].split("-")[0]
            boxes[-1].title = f"{stack}.{first}-{index}"
        else:
            title = f"{stack}.{index}" if index is not None else stack
            boxes.append(Box(title, list(rows)))
        prev = (stack, index, rows)
    return boxes


def draw_graph(report, path: str) -> None:
    """Draw the layer patterns of ``report`` into ``path`` (.png at most MAX_PIXELS on the long side, or .svg)."""
    if not str(path).endswith((".png", ".svg")):
        raise ValueError(f"--draw writes .png or .svg files, got {path!r}")
    boxes = layer_patterns(report)
    if not boxes:
        raise ValueError("nothing to draw: the report found no linear layer")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    for b in boxes:
        if len(b.rows) > _MAX_ROWS:
            b.rows = b.rows[:_MAX_ROWS - 1] + [(f"... {len(b.rows) - _MAX_ROWS + 1} more", "kept")]
    row_h, gap, head = 0.28, 0.35, 0.36  # inches
    heights = [head + row_h * len(b.rows) + 0.1 for b in boxes]
    total = sum(heights) + gap * (len(boxes) - 1) + 1.0  # title above, margin below
    width = 7.0
    scale = min(1.0, MAX_PIXELS / _DPI / max(total, width))  # shrink everything to fit the pixel budget
    fig = plt.figure(figsize=(width * scale, total * scale))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(total, 0)
    ax.axis("off")
    font = 9 * scale
    ax.text(width / 2, 0.35, f"fp8pass: {len(report.swiglus)} GLU MLP(s), {len(report.linears)} low-precision "
            f"linear weight(s), {len(report.skipped)} kept", ha="center", va="center", fontsize=font * 1.1,
            weight="bold")
    y = 0.8
    for i, (b, h) in enumerate(zip(boxes, heights)):
        ax.add_patch(FancyBboxPatch((0.4, y), width - 0.8, h, boxstyle="round,pad=0.02", fc="white", ec="#444444",
                                    lw=0.8))
        title = b.title + (f"   \N{MULTIPLICATION SIGN} {b.repeat}" if b.repeat > 1 else "")
        ax.text(0.55, y + head / 2 + 0.02, title, va="center", fontsize=font, weight="bold")
        for j, (label, kind) in enumerate(b.rows):
            ry = y + head + j * row_h
            ax.add_patch(FancyBboxPatch((0.7, ry + 0.03), width - 1.4, row_h - 0.06, boxstyle="round,pad=0.01",
                                        fc=_COLORS[kind], ec="none"))
            ax.text(0.8, ry + row_h / 2, label, va="center", fontsize=font * 0.9, family="monospace")
        if i + 1 < len(boxes):
            ax.annotate("", xy=(width / 2, y + h + gap - 0.02), xytext=(width / 2, y + h + 0.02),
                        arrowprops={"arrowstyle": "->", "lw": 0.8})
        y += h + gap
    png = str(path).endswith(".png")
    image = io.BytesIO()  # rendered first: matplotlib's SVG writer wants a seekable file
    fig.savefig(image, dpi=_DPI if png else None, format="png" if png else "svg")
    atomic_write(path, lambda f: f.write(image.getvalue()))
    plt.close(fig)
