"""Analysis of one Dynamo graph: which GLU MLPs and linears become FP8, what stays, graph breaks.

``plan_graph`` only reads the graph; ``rewrite.apply_plan`` changes a copy of it. Explain uses the
plan alone, so ``fp8pass.explain`` works on any model without running FP8 ops.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import fx

from ..config import Config
from .matcher import MUL, Match, caller_fqn, param_fqn
from .patterns import GLU_PRODUCT_LOOSE, LINEAR, activation, find_glu_mlps, linear, variant_name
from .policy import Decision, decide_linear

__all__ = ["GLUSite", "LinearSite", "Plan", "plan_graph"]


@dataclass
class GLUSite:
    """One matched GLU MLP ``down(act(gate(x)) * up(x))``."""

    match: Match
    variant: str
    act: str
    gate: str                 # weight FQNs (for a fused projection, gate and up are the same FQN)
    up: str
    down: str
    gate_rows: slice | None = None   # rows of the fused weight that are the gate / the up projection
    up_rows: slice | None = None

    @property
    def fused(self) -> bool:
        return self.gate_rows is not None


@dataclass
class LinearSite:
    """One linear op ``x @ w.T (+ b)`` that becomes an FP8 linear."""

    node: fx.Node
    x: fx.Node
    w: fx.Node
    b: fx.Node | None
    fqn: str


@dataclass
class Plan:
    glus: list[GLUSite] = field(default_factory=list)
    linears: list[LinearSite] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)   # (where, reason)
    graph_breaks: list[str] = field(default_factory=list)
    # MLP module FQN cut by a break -> where: "act" (after the activation) or "glu" (after the product)
    split_modules: dict[str, str] = field(default_factory=dict)


_ACT_OF_LINEAR = activation(linear("g"))


def _where(call: fx.Node, w: fx.Node | None = None) -> str:
    if w is not None:
        fqn = param_fqn(w)
        if fqn:
            return fqn
    return caller_fqn(call) or call.name


def _glu_decision(cfg: Config, m: Match) -> Decision:
    """A GLU becomes FP8 only when each of its projections may (else its linears are decided alone)."""
    if m["gate"] is m.get("up"):  # pragma: no cover - patterns cannot produce this
        return Decision(False, "gate and up are the same value")
    parts = [("down", m["down"], m["h"], m["down_w"], m.get("down_b"))]
    if m.get("proj") == "fused":
        parts.append(("gate_up", m["gate_up"], m["x"], m["gate_up_w"], m.get("gate_up_b")))
        for p in ("gate", "up"):
            rows = m[f"{p}_rows"]
            n = len(range(rows.start, rows.stop, rows.step))
            if n % cfg.dim_multiple or n < cfg.min_dim:
                return Decision(False, f"{p} part of the fused projection has {n} rows "
                                       f"(min_dim={cfg.min_dim}, dim_multiple={cfg.dim_multiple})")
    else:
        parts += [(p, m[p], m["x"], m[f"{p}_w"], m.get(f"{p}_b")) for p in ("gate", "up")]
    for role, call, x, w, b in parts:
        d = decide_linear(cfg, call, x, w, b)
        if not d.fp8:
            return Decision(False, f"{role} projection {param_fqn(w) or w.name}: {d.reason}")
    return Decision(True)


def _glu_site(m: Match) -> GLUSite:
    fused = m.get("proj") == "fused"
    gw = m["gate_up_w"] if fused else m["gate_w"]
    uw = m["gate_up_w"] if fused else m["up_w"]
    return GLUSite(
        match=m, variant=variant_name(m), act=m["act"],
        gate=param_fqn(gw) or gw.name, up=param_fqn(uw) or uw.name,
        down=param_fqn(m["down_w"]) or m["down_w"].name,
        gate_rows=m.get("gate_rows") if fused else None, up_rows=m.get("up_rows") if fused else None,
    )


def _is_input(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "placeholder" and param_fqn(node) is None


def _leaves_graph(node: fx.Node) -> bool:
    return any(u.op == "output" for u in node.users)


def _mlp_module(node: fx.Node) -> str:
    """FQN of the module that owns an MLP's intermediate (the parent of its act/mul calls)."""
    fqn = caller_fqn(node)
    # the activation is often a child module (``mlp.act_fn``): report its parent
    if node.target is not None and fqn and any(k in fqn.rsplit(".", 1)[-1] for k in ("act", "activation")):
        return fqn.rsplit(".", 1)[0] if "." in fqn else ""
    return fqn


def _find_breaks(graph: fx.Graph, covered: set[fx.Node], plan: Plan, split_before: dict[str, str]) -> set[fx.Node]:
    """GLU pieces cut by a graph break; returns linear calls whose input is a cut GLU output."""
    unsafe_linears: set[fx.Node] = set()
    seen_h: set[fx.Node] = set()
    for node in graph.nodes:
        if node in covered or node.op not in ("call_function", "call_method"):
            continue
        for m in GLU_PRODUCT_LOOSE(node):
            h = m["h"]
            if h in seen_h:
                break
            seen_h.add(h)
            mod = _mlp_module(h)
            missing = [p for p in ("gate", "up") if _is_input(m[p])]
            if missing:
                plan.graph_breaks.append(
                    f"{mod or h.name}: the GLU's {' and '.join(missing)} projection(s) ran in an earlier "
                    f"graph (a graph break splits this {m['act']} GLU)")
                for u in h.users:
                    unsafe_linears.add(u)
            if _leaves_graph(h):
                plan.graph_breaks.append(
                    f"{mod or h.name}: the {m['act']} GLU output leaves the graph before its down "
                    f"projection (a graph break splits this GLU)")
                plan.split_modules[mod] = "glu"
            break
    # an activation of a projection whose result leaves the graph: the break is between act and mul
    for node in graph.nodes:
        if node in covered or node.op not in ("call_function", "call_method") or not _leaves_graph(node):
            continue
        for m in _ACT_OF_LINEAR(node):
            if m["act"] in ("silu",):
                mod = _mlp_module(node)
                plan.graph_breaks.append(
                    f"{mod or node.name}: a {m['act']} activation output leaves the graph before its "
                    f"GLU product (a graph break may split this GLU)")
                plan.split_modules[mod] = "act"
            break
    # a linear in a module whose GLU an earlier graph saw split, fed by a graph input
    for node in graph.nodes:
        if node.op in ("call_function", "call_method") and node not in covered:
            for m in LINEAR(node):
                mod = caller_fqn(node)
                x = m["lin_x"]
                kind = "glu" if _is_input(x) else "act" if (
                    isinstance(x, fx.Node) and x.target in MUL and any(_is_input(a) for a in x.args)) else None
                if kind and any(k == kind and (mod == s or mod.startswith(s + ".") or s == "")
                                for s, k in split_before.items()):
                    unsafe_linears.add(node)
                break
    return unsafe_linears


def plan_graph(graph: fx.Graph, cfg: Config, split_before: dict[str, str] | None = None) -> Plan:
    """Decide what becomes FP8 in ``graph`` (not modified).

    Args:
        graph: Dynamo's torch-level graph (placeholders carry ``_dynamo_source``).
        cfg: the backend's Config.
        split_before: ``Plan.split_modules`` of the earlier graphs of the same model: MLPs that a
            graph break split; their down projection, fed by a graph input, stays high precision.
    """
    plan = Plan()
    glus, rejected = find_glu_mlps(graph)
    covered: set[fx.Node] = set()
    for m in glus:
        d = _glu_decision(cfg, m)
        site = _glu_site(m)
        if d.fp8:
            plan.glus.append(site)
            covered |= set(m.nodes)
        else:
            plan.skipped.append((f"GLU {site.down.rsplit('.', 2)[0] if '.' in site.down else site.down}",
                                 f"not fused: {d.reason}"))
    for m, reason in rejected:
        plan.skipped.append((f"GLU at {_where(m['down'], m['down_w'])}", f"not fused: {reason}"))
    unsafe = _find_breaks(graph, covered, plan, dict(split_before or {}))
    for node in graph.nodes:
        if node in covered or node.op not in ("call_function", "call_method"):
            continue
        for m in LINEAR(node):
            w = m["lin_w"]
            where = param_fqn(w) or w.name
            if node in unsafe:
                plan.skipped.append((where, "input is a GLU output cut off by a graph break; an "
                                            "unsmoothed FP8 cast of it is the outlier case"))
                break
            d = decide_linear(cfg, node, m["lin_x"], w, m.get("lin_b"))
            if d.fp8:
                plan.linears.append(LinearSite(node, m["lin_x"], w, m.get("lin_b"), where))
            else:
                plan.skipped.append((where, d.reason))
            break
    # matmuls of activations (attention scores) and other ops are simply not matched; list only
    # matmuls that look like linears but whose weight is no parameter, so explain shows them
    for node in graph.nodes:
        if node.op == "call_function" and node.target is torch._C._nn.linear and node not in covered:
            w = node.args[1]
            if isinstance(w, fx.Node) and param_fqn(w) is None:
                plan.skipped.append((caller_fqn(node) or node.name,
                                     "F.linear with a weight that is not a parameter"))
    return plan
