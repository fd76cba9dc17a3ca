"""The explain report: what the fp8 backend matched, rewrote, kept, and where graphs broke."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["SwiGLUEntry", "Report"]


@dataclass(frozen=True)
class SwiGLUEntry:
    """One matched GLU MLP: weight FQNs of its projections and the variant ("swiglu", "geglu-tanh", ...)."""

    gate: str
    up: str
    down: str
    variant: str
    graph: int = 0


@dataclass
class Report:
    """What ``fp8pass.explain`` (or a compile with the fp8 backend) found, graph by graph.

    Attributes:
        swiglus: one :class:`SwiGLUEntry` per matched GLU MLP (SwiGLU, GeGLU, ReGLU).
        linears: FQNs of the weights whose linear became FP8 (GLU projections included).
        skipped: ``(where, reason)`` for linear ops left in high precision.
        graph_breaks: Dynamo's graph-break reasons and GLUs split by a break.
        graph_before / graph_after: the torch-level graphs' code before and after the rewrite.
        num_graphs: how many graphs Dynamo produced.
    """

    swiglus: list[SwiGLUEntry] = field(default_factory=list)
    linears: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    graph_breaks: list[str] = field(default_factory=list)
    graph_before: str = ""
    graph_after: str = ""
    num_graphs: int = 0
    config: object = None

    def __str__(self) -> str:
        lines = [f"fp8pass report: {self.num_graphs} graph(s), {len(self.swiglus)} GLU MLP(s) fused, "
                 f"{len(self.linears)} FP8 linear weight(s), {len(self.skipped)} op(s) kept in high "
                 f"precision, {len(self.graph_breaks)} graph-break note(s)"]
        if self.config is not None:
            lines.append(f"config: {self.config}")
        if self.swiglus:
            lines += ["", "GLU MLPs (Smooth-SwiGLU treatment):"]
            lines += _table(["variant", "gate", "up", "down"],
                            [[s.variant, s.gate, s.up, s.down] for s in self.swiglus])
        if self.linears:
            lines += ["", "FP8 linears (weight FQN):"]
            lines += ["  " + f for f in self.linears]
        if self.skipped:
            lines += ["", "kept in high precision:"]
            lines += _table(["where", "reason"], [list(s) for s in self.skipped])
        if self.graph_breaks:
            lines += ["", "graph breaks:"]
            lines += ["  " + b for b in self.graph_breaks]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"Report(swiglus={len(self.swiglus)}, linears={len(self.linears)}, "
                f"skipped={len(self.skipped)}, graph_breaks={len(self.graph_breaks)})")


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    fmt = "  " + "  ".join(f"{{:{w}}}" for w in widths)
    out = [fmt.format(*header), "  " + "  ".join("-" * w for w in widths)]
    out += [fmt.format(*map(str, r)).rstrip() for r in rows]
    return out
