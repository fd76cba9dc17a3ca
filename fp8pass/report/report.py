"""The explain report: what the fp8 backend matched, rewrote, kept, and where graphs broke.

It also accounts for every **matmul weight** of the model: a parameter with two or more dims that
enters, as itself or through views, slices, gathers, casts and contiguous copies (the forms the plan
follows, ``fp8pass.passes.WEIGHT_VIEWS``), the weight operand of ``F.linear`` / ``nn.Linear``, or an operand of
``matmul`` / ``@`` / ``mm`` / ``addmm`` / ``bmm`` / ``baddbmm`` / ``einsum`` / a grouped mm, in the
forward explain ran. Embeddings are not (a lookup is no matmul) unless the same Parameter is also
an LM head's weight (tied), norm weights and biases are not (1-D), convolutions are not. Each one
is in the report's ``linears`` (FP8 somewhere), in ``skipped`` with the reason a graph's plan kept
it, or in ``skipped`` as outside every graph (:data:`RAN_EAGERLY`, :data:`OUTSIDE_GRAPHS`), or as
taken by a graph whose top level has no matmul over it (:data:`IN_NO_GRAPH_MATMUL`).
"""

from __future__ import annotations

import contextlib
import re
import weakref
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode

from ..passes import WEIGHT_VIEWS, inplace_compile_suspended
from ..runtime.grouped_casting import scaled_grouped_mm_grad_format

__all__ = ["SwiGLUEntry", "ExpertsEntry", "Report", "weights_outside_graphs", "expert_grads_line", "graph_tensors",
           "matmul_weights", "planned_weights", "OUTSIDE_GRAPHS", "RAN_EAGERLY", "IN_NO_GRAPH_MATMUL"]

OUTSIDE_GRAPHS = ("3-D expert weight that no graph takes: the code using it ran between graphs, in high precision "
                  "(a per-expert loop over data-dependent expert ids breaks the graph, e.g. transformers' eager "
                  "experts); use model.set_experts_implementation('grouped_mm'), or loop over range(E) with int "
                  "indices")
RAN_EAGERLY = ("matmul weight that no graph takes: its matmul ran eagerly between graphs (outside any graph), in "
               "high precision; the graph breaks listed say where Dynamo fell back to eager (a data-dependent "
               "shape such as torch.where(mask) or nonzero, a torch.compiler.disable'd function, a side effect in "
               "an activation-checkpointed layer)")
IN_NO_GRAPH_MATMUL = ("matmul weight that a graph takes, but no graph's top level has a matmul over it: its matmul "
                      "ran inside a higher-order op's body (activation checkpointing, torch.cond, ...) or eagerly "
                      "between graphs, in high precision")


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


# matmul-like torch functions (by name, as plan.py names graph targets) -> which arguments are matmul operands
_WEIGHT_ARG = {"linear": ((1, "weight"),)}   # F.linear: the weight only (the input is an activation, the bias 1-D)
_ADD_FIRST = {"addmm": ((1, "mat1"), (2, "mat2")), "baddbmm": ((1, "batch1"), (2, "batch2"))}
_TWO_OPERANDS = {"matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "_grouped_mm", "grouped_mm",
                 "grouped_mm_fallback"}
_OPERAND_KWARGS = ("input", "other", "mat1", "mat2", "mat_a", "mat_b")


def _matmul_operands(name: str, args: tuple, kwargs: dict) -> list:
    """The operands of a matmul-like call that may be weights (empty for any other call)."""
    if name == "einsum":   # einsum(equation, *operands) or einsum(equation, [operands])
        operands = args[1:]
        return list(operands[0] if len(operands) == 1 and isinstance(operands[0], (list, tuple)) else operands)
    if name in _TWO_OPERANDS:
        return list(args[:2]) + [kwargs.get(k) for k in _OPERAND_KWARGS]
    spec = _WEIGHT_ARG.get(name) or _ADD_FIRST.get(name) or ()
    return [args[i] if len(args) > i else kwargs.get(key) for i, key in spec]


class _MatmulWeightRecorder(TorchFunctionMode):
    """Records which parameters enter a matmul while the model runs eagerly under this mode."""

    def __init__(self, params: dict[int, str]):
        super().__init__()
        self.params = params                  # id(parameter) -> FQN
        self.derived: dict[int, tuple[weakref.ref, str]] = {}   # id(copy of a weight) -> (the copy, its FQN)
        self.found: dict[str, None] = {}      # FQNs in the order their first matmul ran

    def _fqn(self, t) -> str | None:
        for _ in range(8):   # a view's _base is the tensor it views; copies are in ``derived``
            if not isinstance(t, torch.Tensor):
                return None
            if id(t) in self.params:
                return self.params[id(t)]
            hit = self.derived.get(id(t))
            if hit is not None and hit[0]() is t:
                return hit[1]
            t = t._base
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "").split(".")[0]
        if name == "__get__":   # a property (``W.T``, ``W.mT``): a view, found through ``_base``
            return out
        for operand in _matmul_operands(name, args, kwargs):
            fqn = self._fqn(operand)
            if fqn is not None:
                self.found.setdefault(fqn)
        if name in WEIGHT_VIEWS and args:
            fqn = self._fqn(args[0])
            if fqn is not None:
                for t in (out if isinstance(out, (tuple, list)) else (out,)):
                    if isinstance(t, torch.Tensor) and t._base is None and id(t) not in self.params:
                        self.derived[id(t)] = (weakref.ref(t), fqn)
        return out


@contextlib.contextmanager
def _state_kept(model: torch.nn.Module):
    """The RNG state and every buffer of ``model`` as they were before (an extra forward leaves no trace):
    each buffer object back in its module (a forward may assign a new tensor) with its values."""
    buffers = [(mod, name, b, b.detach().clone()) for mod in model.modules()
               for name, b in mod.named_buffers(recurse=False)]
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            with torch.no_grad():
                for mod, name, b, saved in buffers:
                    setattr(mod, name, b)
                    b.copy_(saved)


def matmul_weights(model, args: tuple = (), kwargs: dict | None = None) -> dict[str, torch.nn.Parameter]:
    """FQN -> parameter for each matmul weight of ``model`` (module docstring) in ``model(*args, **kwargs)``.

    Runs the forward once eagerly (``torch.compiler.set_stance("force_eager")``, an in-place compile set
    aside) under ``no_grad`` with a ``TorchFunctionMode`` that records the matmul operands; the RNG and
    the model's buffers are restored afterwards. Not under Dynamo: a mode on the stack changes the
    graphs Dynamo captures (operators become method calls). Empty for a function (no parameters).
    """
    if not isinstance(model, torch.nn.Module):
        return {}
    named = dict(model.named_parameters())
    recorder = _MatmulWeightRecorder({id(p): n for n, p in named.items() if p.dim() >= 2})
    with _state_kept(model), inplace_compile_suspended(model), torch.compiler.set_stance("force_eager"), \
            torch.no_grad(), recorder:
        model(*args, **(kwargs or {}))
    return {n: named[n] for n in recorder.found}


_INDEX = re.compile(r"\[-?\d+\]$")


def weights_outside_graphs(weights: dict[str, torch.nn.Parameter], planned: set[str],
                           graph_inputs: set[int]) -> list[tuple[str, str]]:
    """``(FQN, reason)`` for each matmul weight (``weights``, from :func:`matmul_weights`) that no
    graph's plan names (``planned``: the FQNs in ``linears`` and ``skipped``, ``W[e]`` as ``W``).

    Such a weight ran in high precision with nothing to say so: taken by no graph (``graph_inputs``,
    the ``id`` of every tensor a graph took) it ran eagerly between graphs (:data:`RAN_EAGERLY`; a 3-D
    expert weight :data:`OUTSIDE_GRAPHS`, with what to do), else it ran where no pass looks
    (:data:`IN_NO_GRAPH_MATMUL`).
    """
    out = []
    for fqn, p in weights.items():
        if fqn in planned:
            continue
        if id(p) in graph_inputs:
            out.append((fqn, IN_NO_GRAPH_MATMUL))
        else:
            out.append((fqn, OUTSIDE_GRAPHS if p.dim() == 3 else RAN_EAGERLY))
    return out


def planned_weights(report: "Report") -> set[str]:
    """The weight FQNs a report's graphs name: its FP8 linears and its kept entries (``W[e]`` as ``W``)."""
    return set(report.linears) | {_INDEX.sub("", where) for where, _ in report.skipped}


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
        matmul_weights: FQNs of the model's matmul weights (module docstring) in the forward explain ran;
            each is in ``linears`` or ``skipped`` (``fp8pass.explain`` only; empty for a compile's report).
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
    matmul_weights: list[str] = field(default_factory=list)
    decided_by: dict[str, str] = field(default_factory=dict)

    @property
    def outside_graphs(self) -> list[str]:
        """FQNs of the matmul weights whose matmul ran in no graph (eagerly between graphs)."""
        return [w for w, r in self.skipped if r in (RAN_EAGERLY, OUTSIDE_GRAPHS)]

    def accounting(self) -> tuple[int, int, int, int] | None:
        """(matmul weights, FP8, kept in high precision, ran eagerly between graphs), each weight counted
        once (FP8 before kept before outside); None when the matmul weights are unknown (a compile's report)."""
        if not self.matmul_weights:
            return None
        fp8 = set(self.linears)
        outside = set(self.outside_graphs) - fp8
        kept = planned_weights(self) - fp8 - outside
        total = set(self.matmul_weights)
        return len(total), len(fp8 & total), len(kept & total), len(outside & total)

    def __str__(self) -> str:
        kind = "NVFP4" if type(getattr(self.config, "recipe", None)).__name__ == "NVFP4Scaling" else "FP8"
        lines = [f"fp8pass report: {self.num_graphs} graph(s), {len(self.swiglus)} GLU MLP(s) fused, "
                 f"{len(self.experts)} MoE expert stack(s), "
                 f"{len(self.linears)} {kind} linear weight(s), {len(self.skipped)} op(s) kept in high "
                 f"precision, {len(self.graph_breaks)} graph-break note(s)"]
        lines += [f"note: {n}" for n in self.notes]
        counts = self.accounting()
        if counts is not None:
            lines.append(f"matmul weights: {counts[0]} = {counts[1]} {kind} + {counts[2]} kept in high precision + "
                         f"{counts[3]} ran eagerly between graphs")
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
