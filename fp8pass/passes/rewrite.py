"""Rewrite a copy of Dynamo's graph: planned linears into ``torch.ops.fp8pass`` ops, state as inputs.

Replacement of a linear site ``y = x @ W.T (+ b)`` (any form the patterns match)::

    out = fp8pass::fp8_linear(x, W, b, x_state, w_state, g_state, <recipe scalars>)
    y   = out[0]
    fp8pass::delayed_record_(*x_state, out[1], ...)    # delayed scaling only: record the amaxes
    fp8pass::delayed_record_(*w_state, out[2], ...)

The ``*_state`` lists are ``[amax_history, scale, steps, skipped]`` of the weight's
``LinearScalingState`` (fp8pass.runtime.state); they enter the graph as extra placeholders appended
after Dynamo's, and the backend passes the live tensors on every call. AOT autograd functionalizes
the records into copies onto those inputs, so the state survives recompiles and
``torch._dynamo.reset()`` (it belongs to the weight, not to the graph). The backward of
``fp8_linear`` records the grad_output amax itself.

A GLU site ``down(act(gate(x)) * up(x))`` becomes FP8 linears for gate and up (one for a fused
projection) and one ``fp8pass::swiglu_down`` with the matched activation (silu, gelu, gelu_tanh or
relu: activation, product, Smooth-SwiGLU scaling and the FP8 down GEMM; see ``_Rewriter.replace_glu``).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from ..config import Config, DelayedScaling, NVFP4Scaling
from .plan import GLUSite, LinearSite, Plan

__all__ = ["StateInput", "copy_graph_module", "apply_plan"]

ROLES = ("input", "weight", "grad_output")


@dataclass(frozen=True)
class StateInput:
    """An extra graph input: field ``field`` of role ``role`` of the state of placeholder ``weight_pos``."""

    weight_pos: int
    role: str
    field: int


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of Dynamo's GraphModule whose graph may be edited (Dynamo re-reads the original)."""
    graph = fx.Graph()
    val_map: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(gm.graph, val_map)
    graph.output(out)
    for old, new in val_map.items():
        src = getattr(old, "_dynamo_source", None)
        if src is not None:
            new._dynamo_source = src
    new_gm = fx.GraphModule(gm, graph)
    new_gm.meta.update(getattr(gm, "meta", {}))
    return new_gm


def _recipe_kwargs(cfg: Config) -> dict:
    r = cfg.recipe
    delayed = isinstance(r, DelayedScaling)
    return dict(
        fwd_format=cfg.fwd_format, bwd_format=cfg.bwd_format,
        granularity=r.granularity, block=getattr(r, "block", 128),
        power_of_two=bool(r.power_of_two),
        grad_rounding="stochastic" if cfg.grad_stochastic_rounding else "nearest",
        margin=float(getattr(r, "margin", 0.0)) if delayed else 0.0,
        interval=int(getattr(r, "interval", 1)) if delayed else 1,
        algo=getattr(r, "algo", "max") if delayed else "max",
    )


class _Rewriter:
    def __init__(self, gm: fx.GraphModule, cfg: Config):
        self.gm, self.graph, self.cfg = gm, gm.graph, cfg
        self.delayed = isinstance(cfg.recipe, DelayedScaling)
        self.kw = _recipe_kwargs(cfg)
        self.placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        self.pos = {n: i for i, n in enumerate(self.placeholders)}
        self.last_ph = self.placeholders[-1] if self.placeholders else None
        self.extra: list[StateInput] = []
        self._state_nodes: dict[tuple[int, str], list[fx.Node]] = {}
        # the runtime's ops by name: passes never import the runtime (numerics -> passes ->
        # runtime -> backend); the backend imports it, which registers them
        self.ops = torch.ops.fp8pass
        self.replaced: dict[fx.Node, fx.Node] = {}  # planned nodes replaced earlier in this rewrite

    def r(self, value):
        """``value`` as it is now: the plan's nodes may have been replaced by an earlier site."""
        while isinstance(value, fx.Node) and value in self.replaced:
            value = self.replaced[value]
        return value

    def replace(self, old: fx.Node, new: fx.Node) -> None:
        old.replace_all_uses_with(new)
        self.replaced[old] = new

    def state(self, w: fx.Node, role: str) -> list[fx.Node]:
        """Placeholders for the four state tensors of (weight, role); [] under current scaling."""
        if not self.delayed:
            return []
        key = (self.pos[w], role)
        if key not in self._state_nodes:
            nodes = []
            for f in range(4):
                anchor = self.last_ph
                if anchor is None:
                    ctx = self.graph.inserting_before(next(iter(self.graph.nodes)))
                else:
                    ctx = self.graph.inserting_after(anchor)
                with ctx:
                    ph = self.graph.placeholder(f"fp8_state_{w.name}_{role}_{f}")
                self.last_ph = ph
                nodes.append(ph)
                self.extra.append(StateInput(self.pos[w], role, f))
            self._state_nodes[key] = nodes
        return self._state_nodes[key]

    def _record(self, state: list[fx.Node], amax: fx.Node, fmt: str) -> None:
        if not state or fmt == "identity":
            return
        k = self.kw
        self.graph.call_function(self.ops.delayed_record_.default,
                                 (*state, amax, fmt, k["margin"], k["interval"], k["algo"], k["power_of_two"]))

    def linear(self, x, w: fx.Node, b, before: fx.Node, weight_value=None) -> fx.Node:
        """Emit an FP8 linear before ``before``; ``weight_value`` overrides W (a slice of a fused W)."""
        xs, ws, gs = (self.state(w, r) for r in ROLES)
        with self.graph.inserting_before(before):
            out = self.graph.call_function(
                self.ops.fp8_linear.default,
                (self.r(x), weight_value if weight_value is not None else w, b, xs, ws, gs), dict(self.kw))
            y = self.graph.call_function(operator.getitem, (out, 0))
            if self.delayed:
                self._record(xs, self.graph.call_function(operator.getitem, (out, 1)), self.kw["fwd_format"])
                self._record(ws, self.graph.call_function(operator.getitem, (out, 2)), self.kw["fwd_format"])
        y.meta.update({k: v for k, v in before.meta.items() if k in ("nn_module_stack", "stack_trace")})
        return y

    def replace_linear(self, site: LinearSite) -> None:
        y = self.linear(site.x, site.w, site.b, site.node)
        self.replace(site.node, y)

    def replace_glu(self, site: GLUSite) -> tuple[list[str], str | None]:
        """Rewrite a GLU; returns (FQNs of weights made FP8, None: no part of a GLU stays high precision).

        gate and up become FP8 linears (one for a fused projection; its original slicing then
        yields the pieces). The activation, product and down projection of every GLU
        (SwiGLU, GeGLU, ReGLU) become one ``swiglu_down`` with the matched activation
        (Smooth-SwiGLU per ``Config.smooth_swiglu``; its argument holds for any GLU).
        """
        m = site.match
        if site.fused:
            fused_call = m["gate_up"]
            y = self.linear(m["x"], m["gate_up_w"], m.get("gate_up_b"), fused_call)
            self.replace(fused_call, y)
            done = [site.gate]
        else:
            for p in ("gate", "up"):
                y = self.linear(m["x"], m[f"{p}_w"], m.get(f"{p}_b"), m[p])
                self.replace(m[p], y)
            done = [site.gate, site.up]
        down, w = m["down"], m["down_w"]
        a_s, b_s, g_s = (self.state(w, r) for r in ROLES)
        k = self.kw
        smooth = self.cfg.smooth_swiglu or "none"
        with self.graph.inserting_before(down):
            out = self.graph.call_function(
                self.ops.swiglu_down.default,
                (self.r(m["gate"]), self.r(m["up"]), w, a_s, b_s, g_s, site.act, smooth, k["fwd_format"],
                 k["bwd_format"], k["granularity"], k["block"], k["power_of_two"], k["grad_rounding"], k["margin"],
                 k["interval"], k["algo"]))
            y = self.graph.call_function(operator.getitem, (out, 0))
            if self.delayed:
                self._record(a_s, self.graph.call_function(operator.getitem, (out, 1)), k["fwd_format"])
                if smooth != "channel":  # channel mode casts W_down / c with current scaling
                    self._record(b_s, self.graph.call_function(operator.getitem, (out, 2)), k["fwd_format"])
            if m.get("down_b") is not None:
                y = self.graph.call_function(operator.add, (y, m["down_b"]))
        y.meta.update({kk: v for kk, v in down.meta.items() if kk in ("nn_module_stack", "stack_trace")})
        self.replace(down, y)
        return done + [site.down], None


def apply_plan(gm: fx.GraphModule, plan: Plan, cfg: Config) -> tuple[fx.GraphModule, list[StateInput], list[str], list[tuple[str, str]]]:
    """Rewrite ``gm`` (already a copy) in place per ``plan``.

    Returns:
        (gm, extra inputs the backend appends on every call, FQNs of weights made FP8,
        extra (where, reason) entries for ops the rewrite kept in high precision).
    """
    if isinstance(cfg.recipe, NVFP4Scaling):
        from .rewrite_nvfp4 import apply_nvfp4_plan  # it subclasses _Rewriter

        return apply_nvfp4_plan(gm, plan, cfg)
    rw = _Rewriter(gm, cfg)
    fp8: list[str] = []
    kept: list[tuple[str, str]] = []
    for site in plan.glus:
        done, why_not = rw.replace_glu(site)
        fp8 += done
        if why_not:
            kept.append((site.down, why_not))
    for site in plan.linears:
        rw.replace_linear(site)
        fp8.append(site.fqn)
    _erase_dead(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return gm, rw.extra, list(dict.fromkeys(fp8)), kept


def _erase_dead(graph: fx.Graph) -> None:
    """Remove the replaced calls (and their now-unused inputs' transposes); keep side effects."""
    for node in reversed(list(graph.nodes)):
        if node.op in ("call_function", "call_method") and not node.users and not node.is_impure():
            graph.erase_node(node)
