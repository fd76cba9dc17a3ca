"""The explain report: what the fp8 backend matched, rewrote, kept, and where graphs broke."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..runtime.grouped_casting import scaled_grouped_mm_grad_format

__all__ = ["SwiGLUEntry", "ExpertsEntry", "Report", "expert_weights_outside_graphs", "expert_grads_line", "graph_tensors",
           "OUTSIDE_GRAPHS"]

OUTSIDE_GRAPHS = ("3-D expert weight that no graph takes: the code using it ran between graphs, in high precision "
                  "(a per-expert loop over data-dependent expert ids breaks the graph, e.g. transformers' eager "
                  "experts); use model.set_experts_implementation('grouped_mm'), or loop over range(E) with int "
                  "indices")


def graph_tensors(gm, inputs) -> set[int]:
    """``id`` of every tensor a graph takes: its inputs and the attributes it reads (``get_attr``)."""
    out = {id(t) for t in inputs if isinstance(t, torch.Tensor)}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            obj = gm
            for part in str(node.target).split("."):
                obj = getattr(obj, part, None)
            out.add(id(obj))
    return out


def expert_weights_outside_graphs(model, graph_inputs: set[int]) -> list[tuple[str, str]]:
    """``(FQN, reason)`` for each 3-D parameter of ``model`` (convolutions' aside) whose identity is not
    among ``graph_inputs`` (the ``id`` of every tensor the graphs were called with).

    Such an expert stack is in no graph, so nothing can make it FP8; without this line the report
    would not mention it at all.
    """
    if not isinstance(model, torch.nn.Module):
        return []
    model = getattr(model, "_orig_mod", model)
    out = []
    for mod_name, mod in model.named_modules():
        if isinstance(mod, torch.nn.modules.conv._ConvNd):
            continue
        for name, p in mod.named_parameters(recurse=False):
            if p.dim() == 3 and id(p) not in graph_inputs:
                out.append((f"{mod_name}.{name}" if mod_name else name, OUTSIDE_GRAPHS))
    return out


@dataclass(frozen=True)
class SwiGLUEntry:
    """One matched GLU MLP: weight FQNs of its projections and the variant ("swiglu", "geglu-tanh", ...)."""

    gate: str
    up: str
    down: str
    variant: str
    graph: int = 0


@dataclass(frozen=True)
class ExpertsEntry:
    """One MoE expert stack made FP8: its module, its 3-D expert weights and the form ("swiglu
    experts (fused gate_up)", "grouped linears")."""

    module: str
    weights: tuple[str, ...]
    variant: str
    graph: int = 0


@dataclass
class Report:
    """What ``fp8pass.explain`` (or a compile with the fp8 backend) found, graph by graph.

    Attributes:
        swiglus: one :class:`SwiGLUEntry` per matched dense GLU MLP (SwiGLU, GeGLU, ReGLU).
        experts: one :class:`ExpertsEntry` per MoE expert stack made FP8 (grouped, per-expert scales).
        linears: FQNs of the weights whose linear became FP8 (GLU projections included).
        decided_by: weight FQN -> the recipe it runs in and what decided it (a ``Config.rules`` rule, or
            ``Config.recipe``), for every weight in ``linears`` and the expert stacks; printed as a
            column when the Config has rules.
        skipped: ``(where, reason)`` for linear ops left in high precision.
        graph_breaks: Dynamo's graph-break reasons and GLUs split by a break.
        graph_before / graph_after: the torch-level graphs' code before and after the rewrite.
        num_graphs: how many graphs Dynamo produced.
        notes: one-line remarks on the report itself (no graph captured, a non-fp8 compile backend).
    """

    swiglus: list[SwiGLUEntry] = field(default_factory=list)
    experts: list[ExpertsEntry] = field(default_factory=list)
    linears: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    graph_breaks: list[str] = field(default_factory=list)
    graph_before: str = ""
    graph_after: str = ""
    num_graphs: int = 0
    config: object = None
    notes: list[str] = field(default_factory=list)
    decided_by: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        kind = "NVFP4" if type(getattr(self.config, "recipe", None)).__name__ == "NVFP4Scaling" else "FP8"
        lines = [f"fp8pass report: {self.num_graphs} graph(s), {len(self.swiglus)} GLU MLP(s) fused, "
                 f"{len(self.experts)} MoE expert stack(s), "
                 f"{len(self.linears)} {kind} linear weight(s), {len(self.skipped)} op(s) kept in high "
                 f"precision, {len(self.graph_breaks)} graph-break note(s)"]
        lines += [f"note: {n}" for n in self.notes]
        if self.config is not None:
            lines.append(f"config: {self.config}")
        if self.swiglus:
            smooth = getattr(self.config, "smooth_swiglu", "channel")
            treatment = ("recipe per rule, below" if getattr(self.config, "rules", ()) else
                         "NVFP4 linears" if kind == "NVFP4" else
                         f"Smooth-SwiGLU, per {smooth}" if smooth else "FP8, no smoothing")
            lines += ["", f"GLU MLPs ({treatment}):"]
            lines += _table(["variant", "gate", "up", "down"],
                            [[s.variant, s.gate, s.up, s.down] for s in self.swiglus])
        if self.experts:
            lines += ["", f"MoE expert stacks ({kind}, one scale per expert):"]
            lines += _table(["variant", "module", "weights"],
                            [[e.variant, e.module, ", ".join(w.rsplit(".", 1)[-1] for w in e.weights)]
                             for e in self.experts])
            lines.append(expert_grads_line(getattr(self.config, "bwd_format", "e5m2")))
        if self.linears and getattr(self.config, "rules", ()):
            lines += ["", "FP8 / NVFP4 linears, by rule (Config.rules, first match wins):"]
            lines += _table(["weight", "recipe (decided by)"],
                            [[f, self.decided_by.get(f, "")] for f in self.linears])
        elif self.linears:
            lines += ["", f"{kind} linears (weight FQN):"]
            lines += ["  " + f for f in self.linears]
        if self.skipped:
            lines += ["", "kept in high precision:"]
            lines += _table(["where", "reason"], [list(s) for s in self.skipped])
        if self.graph_breaks:
            lines += ["", "graph breaks:"]
            lines += ["  " + b for b in self.graph_breaks]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"Report(swiglus={len(self.swiglus)}, experts={len(self.experts)}, linears={len(self.linears)}, "
                f"skipped={len(self.skipped)}, graph_breaks={len(self.graph_breaks)})")


def expert_grads_line(bwd_format: str) -> str:
    """Which gradient format the expert stacks' grouped GEMMs take, per device."""
    cuda = scaled_grouped_mm_grad_format(bwd_format)
    if cuda == bwd_format:
        return f"  grads: {bwd_format.upper()} per expert (CPU and CUDA)"
    return (f"  grads: {bwd_format.upper()} per expert on CPU; on CUDA {cuda.upper()} per expert, scales passed "
            f"row-wise (torch._scaled_grouped_mm takes E4M3 only)")


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    fmt = "  " + "  ".join(f"{{:{w}}}" for w in widths)
    out = [fmt.format(*header), "  " + "  ".join("-" * w for w in widths)]
    out += [fmt.format(*map(str, r)).rstrip() for r in rows]
    return out
