"""Draw a rewritten graph (networkx + matplotlib): FP8 ops and Smooth-SwiGLU ops highlighted."""

from __future__ import annotations

import re

__all__ = ["draw_graph"]

_COLORS = {"swiglu_down": "#d62728", "fp8_linear": "#ff7f0e", "delayed_record_": "#bbbbbb",
           "placeholder": "#9ecae1", "other": "#e0e0e0"}


def _kind(line: str) -> str:
    for k in ("swiglu_down", "fp8_linear", "delayed_record_"):
        if f"fp8pass.{k}" in line:
            return k
    return "other"


def draw_graph(report, path: str) -> None:
    """Draw ``report.graph_after`` (the rewritten code) as a dataflow graph into ``path``.

    The code text is parsed (``name = op(args)`` lines) so the drawing needs no live graph.
    """
    if not str(path).endswith((".png", ".svg")):
        raise ValueError(f"--draw writes .png or .svg files, got {path!r}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import networkx as nx

    g = nx.DiGraph()
    assign = re.compile(r"^\s*(\w+) = (.*)$")
    for line in report.graph_after.splitlines():
        m = assign.match(line)
        if not m:
            continue
        name, rhs = m.groups()
        g.add_node(name, kind=_kind(rhs))
        for ref in re.findall(r"\b(\w+)\b", rhs):
            if ref in g and ref != name:
                g.add_edge(ref, name)
    if g.number_of_nodes() == 0:
        raise ValueError("nothing to draw: the report has no rewritten graph")
    for n in g.nodes:  # placeholders have no defining line; mark sources
        if g.in_degree(n) == 0 and g.nodes[n].get("kind") == "other":
            g.nodes[n]["kind"] = "placeholder"
    try:
        gen = {n: i for i, layer in enumerate(nx.topological_generations(g)) for n in layer}
        nx.set_node_attributes(g, gen, "layer")
        pos = nx.multipartite_layout(g, subset_key="layer", align="horizontal")
        pos = {n: (x, -y) for n, (x, y) in pos.items()}
    except nx.NetworkXUnfeasible:
        pos = nx.spring_layout(g, seed=0)
    size = max(8, min(60, g.number_of_nodes() ** 0.5 * 2))
    fig, ax = plt.subplots(figsize=(size, size))
    colors = [_COLORS[g.nodes[n].get("kind", "other")] for n in g.nodes]
    nx.draw_networkx(g, pos, ax=ax, node_color=colors, node_size=120, font_size=5, arrowsize=6, width=0.5)
    ax.set_title(f"fp8pass: {len(report.swiglus)} GLU(s), {len(report.linears)} FP8 linear weight(s) "
                 f"(red: swiglu_down, orange: fp8_linear)")
    ax.axis("off")
    fig.savefig(path, dpi=150 if str(path).endswith(".png") else None)
    plt.close(fig)
