"""Analysis of one Dynamo graph: which GLU MLPs, MoE experts and linears become FP8, what stays, breaks.

``plan_graph`` only reads the graph (and its annotations, :mod:`.annotate`); ``rewrite.apply_plan``
changes a copy of it. Explain uses the plan alone, so ``fp8pass.explain`` works on any model without
running FP8 ops. A GLU or linear whose weights are single experts of a 3-D expert weight (``W[e]``
with a constant ``e``: a per-expert Python loop) goes to ``loop_glus`` / ``loop_linears``: FP8 per
expert, with one scale per (expert weight, expert), one expert stack in the report. Every
matmul-like call the plan leaves in high precision is listed in ``skipped`` with its reason;
attention's score and value products (SDPA, FlexAttention, explicit matmuls in an attention module)
are one "attention, kept" line per module.

Higher-order ops' bodies (:mod:`.hops`) are planned like any graph: an activation-checkpointed or
``wrap`` body's plan goes to ``Plan.bodies`` (rewritten with the enclosing graph), a ``cond`` /
``while_loop`` body's planned matmuls are listed as kept. Every body's kept list joins ``skipped``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import fx

from ..config import Config, NVFP4Scaling
from . import hops
from .annotate import META_KEY, annotate
from .matcher import MUL, Match, caller_fqn, example_value, is_call, param_fqn, weight_fqn
from .patterns import (
    GLU_PRODUCT_LOOSE, GROUPED_LINEAR, LINEAR, MATMUL_LIKE, activation, expert_slices, find_expert_glus,
    find_glu_mlps, grouped_mm_targets, linear, variant_name,
)
from .policy import Decision, SiteRecipe, decide_linear

__all__ = ["GLUSite", "LinearSite", "ExpertGLUSite", "ExpertLinearSite", "BodyPlan", "Plan", "plan_graph"]


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
    recipe: SiteRecipe | None = None  # the recipe every projection of it runs in (policy.SiteRecipe)

    @property
    def fused(self) -> bool:
        return self.gate_rows is not None


@dataclass
class LinearSite:
    """One linear op ``x @ w.T (+ b)`` that becomes an FP8 linear (``w`` stored [in, out]: ``w_t``).

    In a per-expert loop ``w`` is the slice ``W[e]`` and ``expert`` is ``(W, e)``.
    """

    node: fx.Node
    x: fx.Node
    w: fx.Node
    b: fx.Node | None
    fqn: str
    nodes: list[fx.Node] = field(default_factory=list)   # the match's nodes (erasable once dead)
    w_t: bool = False
    expert: tuple[fx.Node, int] | None = None
    recipe: SiteRecipe | None = None


@dataclass
class ExpertGLUSite(GLUSite):
    """One MoE expert stack whose experts are GLUs: grouped gate/up and down projections."""


@dataclass
class ExpertLinearSite:
    """One grouped expert projection that becomes an FP8 grouped linear."""

    node: fx.Node
    x: fx.Node
    w: fx.Node
    offs: fx.Node | None   # None: batched form, x [E, C, in]
    layout: str
    fqn: str
    nodes: list[fx.Node] = field(default_factory=list)
    recipe: SiteRecipe | None = None


@dataclass
class Plan:
    glus: list[GLUSite] = field(default_factory=list)
    linears: list[LinearSite] = field(default_factory=list)
    expert_glus: list[ExpertGLUSite] = field(default_factory=list)
    expert_linears: list[ExpertLinearSite] = field(default_factory=list)
    # per-expert loops: GLUs / linears over single experts ``W[e]`` of 3-D expert weights
    loop_glus: list[GLUSite] = field(default_factory=list)
    loop_linears: list[LinearSite] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)   # (where, reason)
    graph_breaks: list[str] = field(default_factory=list)
    # MLP module FQN cut by a break -> where: "act" (after the activation) or "glu" (after the product)
    split_modules: dict[str, str] = field(default_factory=dict)
    # rewritten higher-order op bodies (activation checkpointing, wrap), each with its own plan
    bodies: list["BodyPlan"] = field(default_factory=list)

    def empty(self) -> bool:
        """Nothing to rewrite (in this graph or any body)."""
        return not (self.glus or self.linears or self.expert_glus or self.expert_linears or self.loop_glus
                    or self.loop_linears or self.bodies)

    def walk(self):
        """This plan and its bodies' plans, depth first."""
        yield self
        for b in self.bodies:
            yield from b.plan.walk()

    def planned_weights(self) -> list[str]:
        """The FQNs of the weights this plan (bodies included) would make FP8, in plan order."""
        out: list[str] = []
        for p in self.walk():
            for g in p.glus + p.expert_glus + p.loop_glus:
                out += [g.gate, g.up, g.down]
            out += [lin.fqn for lin in p.linears + p.expert_linears + p.loop_linears]
        return list(dict.fromkeys(out))


@dataclass
class BodyPlan:
    """A higher-order op body to rewrite with the enclosing graph (:mod:`.hops`)."""

    body: hops.Body
    plan: Plan


_ACT_OF_LINEAR = activation(linear("g"))


def _where(call: fx.Node, w: fx.Node | None = None) -> str:
    if w is not None:
        fqn = _weight_name(w)
        if fqn:
            return fqn
    return caller_fqn(call) or call.name


def _glu_decision(cfg: Config, m: Match, experts: bool = False) -> Decision:
    """A GLU becomes FP8 only when each of its projections may (else its linears are decided alone)."""
    if m["gate"] is m.get("up"):  # pragma: no cover - patterns cannot produce this
        return Decision(False, "gate and up are the same value")
    why = _tp_layout_problem(m)
    if why:
        return Decision(False, f"tensor parallel: {why}")
    parts = [("down", m["down"], m.get("h_dt", m["h"]), m["down_w"], m.get("down_b"))]
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
    sites = []
    for role, call, x, w, b in parts:
        d = decide_linear(cfg, call, x, w, b, experts=experts, w_operand=m.get(f"{role}_w_operand"))
        if not d.fp8:
            return Decision(False, f"{role} projection {_weight_name(w)}: {d.reason}")
        sites.append((role, d.site))
    if any(site != sites[0][1] for _, site in sites):  # one fused op runs one recipe
        return Decision(False, "its projections fall under different recipes (" + "; ".join(
            f"{role}: {site.rule or 'Config.recipe'}" for role, site in sites) + "); each linear is decided alone")
    return Decision(True, site=sites[0][1])


def _layout(value) -> tuple | None:
    """A DTensor value's (mesh, placements) with shard dims made non-negative; None for a plain tensor."""
    if not hasattr(value, "placements") or not hasattr(value, "device_mesh"):
        return None
    nd = value.dim()
    places = tuple(type(p)(p.dim % nd) if p.is_shard() and p.dim < 0 else p for p in value.placements)
    return value.device_mesh, places


def _tp_layout_problem(m: Match) -> str | None:
    """Why a GLU seen through tensor parallel's hooks is not one ``swiglu_down`` on the projections'
    DTensor outputs (None when it is, or when there is no TP form).

    The hooks compute ``act(gate) * up`` on local tensors and declare the product a DTensor; the fused
    op computes it on the DTensors themselves. The two agree when the outputs are made local unchanged
    (a redistribute to the layout they already have), gate's and up's layouts are one, and the product
    is declared with that layout on that mesh, without partial sums (``act`` of a partial sum is not
    the sum of ``act``s).
    """
    hooks = {"gate": m.get("gate_local"), "up": m.get("up_local"), "down input": m.get("h_dt")}
    if all(v is None for v in hooks.values()):
        return None
    absent = [k for k, v in hooks.items() if v is None]
    if absent:
        return f"the {' and '.join(absent)} of this GLU bypass the TP plan's DTensor hooks the others pass"
    layouts = {}
    for p in ("gate", "up"):
        out, local = _layout(example_value(m[p])), _layout(example_value(m[f"{p}_local"].args[0]))
        if out is None or local is None:
            return f"the {p} projection's output is not a DTensor"
        if out != local:
            return (f"the {p} projection's output is redistributed ({out[1]} -> {local[1]}) before its local use; "
                    "only a no-op redistribute (ColwiseParallel's Shard(-1) output) is fused")
        layouts[p] = local
    h = _layout(example_value(m["h_dt"]))
    if h is None or layouts["gate"] != layouts["up"] or layouts["gate"] != h:
        return (f"the GLU product is declared {h[1] if h else '?'} but computed from gate {layouts['gate'][1]} and up "
                f"{layouts['up'][1]} shards (or on another mesh)")
    if any(p.is_partial() for p in h[1]):
        return "the GLU product is declared a partial sum"
    if tuple(example_value(m["h_dt"]).shape) != tuple(example_value(m["gate_local"].args[0]).shape):
        return "the GLU product's declared shape differs from the projections' (uneven shards)"
    return None


def _glu_site(m: Match, cls=GLUSite) -> GLUSite:
    fused = m.get("proj") == "fused"
    gw = m["gate_up_w"] if fused else m["gate_w"]
    uw = m["gate_up_w"] if fused else m["up_w"]
    return cls(
        match=m, variant=variant_name(m), act=m["act"],
        gate=weight_fqn(gw) or gw.name, up=weight_fqn(uw) or uw.name,
        down=weight_fqn(m["down_w"]) or m["down_w"].name,
        gate_rows=m.get("gate_rows") if fused else None, up_rows=m.get("up_rows") if fused else None,
    )


def _weight_name(w: fx.Node) -> str:
    """``W`` for a parameter, ``W[e]`` for expert ``e``'s matrix of a 3-D expert weight, else the node."""
    fqn = weight_fqn(w)
    if fqn is None:
        return w.name
    return fqn if w.op == "placeholder" else f"{fqn}[{w.args[-1]}]"


_NO_LOOP_NVFP4 = "the NVFP4 recipe has no per-expert state: a per-expert loop's experts stay in high precision"


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


def _list_unmatched_tp_glus(graph: fx.Graph, matched_h: list, plan: Plan) -> None:
    """A GLU product of DTensors made local (``to_local``) that no GLU match covers: a tensor parallel
    form the patterns do not follow (a fused gate_up, a reshape between the hooks and the product). Its
    down projection would run as a plain FP8 linear, without Smooth-SwiGLU: listed, never silent."""
    seen = set(matched_h)
    for node in graph.nodes:
        if node in seen or node.op not in ("call_function", "call_method"):
            continue
        for m in GLU_PRODUCT_LOOSE(node):
            if m["h"] in seen:
                break
            seen.add(m["h"])
            if any(_made_local_upstream(m[p]) for p in ("gate", "up")):
                mod = _mlp_module(m["h"])
                plan.skipped.append((f"GLU {mod or m['h'].name}", "not fused: tensor parallel form not recognised "
                                     "(the patterns follow separate gate/up projections with ColwiseParallel outputs "
                                     "and a RowwiseParallel down projection)"))
            break


def _made_local_upstream(node, depth: int = 4) -> bool:
    """Whether ``node`` is, or is a few calls downstream of, a DTensor's ``to_local()``."""
    for _ in range(depth):
        if not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method"):
            return False
        if node.op == "call_method" and node.target == "to_local":
            return True
        node = node.args[0] if node.args else None
    return False


def _ensure_annotated(graph: fx.Graph) -> None:
    """Annotate a graph nobody annotated yet (tests and tools that plan captured graphs directly)."""
    first = next(iter(graph.nodes), None)
    if first is not None and META_KEY not in first.meta:
        annotate(graph)


def _stacked_form_ok(m: Match, projections) -> str | None:
    """Why a match's expert projections cannot share one grouping (None when they can)."""
    forms = {m.get(f"form_{p}") for p in projections}
    if len(forms) != 1:
        return f"expert projections mix grouped and batched forms ({', '.join(sorted(map(str, forms)))})"
    if forms == {"bmm"}:
        for p in projections:
            x = example_value(m["h"] if p == "down" else m.get(f"{p}_x", m.get("x")))
            w = example_value(m[f"{p}_w"])
            if not (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and x.dim() == 3
                    and x.shape[0] == w.shape[0]):
                return "batched expert GEMM whose input is not [experts, capacity, features]"
    return None


_NO_GROUPED_NVFP4 = "the NVFP4 recipe has no grouped expert op: experts stay in high precision"
_NO_GROUPED_HIGH_BACKWARD = ("backward='high' ({rule}) has no grouped expert op: the expert GEMMs stay in high "
                             "precision")


def _grouped_ok(d: Decision) -> Decision:
    """An FP8 decision for grouped expert GEMMs, unless its recipe has no grouped op."""
    if d.fp8 and isinstance(d.site.cfg.recipe, NVFP4Scaling):
        return Decision(False, _NO_GROUPED_NVFP4)
    if d.fp8 and d.site.backward == "high":
        return Decision(False, _NO_GROUPED_HIGH_BACKWARD.format(rule=d.site.rule))
    return d


def _glu_kind_decision(cfg: Config, m: Match, experts: bool) -> Decision:
    if experts:
        why = _stacked_form_ok(m, ["gate_up", "down"] if m.get("proj") == "fused" else ["gate", "up", "down"])
        if why:
            return Decision(False, why)
        return _grouped_ok(_glu_decision(cfg, m, experts))
    return _glu_decision(cfg, m, experts)


def plan_graph(graph: fx.Graph, cfg: Config, split_before: dict[str, str] | None = None, body: bool = False) -> Plan:
    """Decide what becomes FP8 in ``graph`` and its higher-order ops' bodies (not modified).

    Args:
        graph: Dynamo's torch-level graph (placeholders carry ``_dynamo_source``), annotated by
            :func:`.annotate.annotate` (done here with Dynamo's own names if it is not).
        cfg: the backend's Config.
        split_before: ``Plan.split_modules`` of the earlier graphs of the same model: MLPs that a
            graph break split; their down projection, fed by a graph input, stays high precision.
        body: ``graph`` is a higher-order op's body: its inputs and outputs are values of the
            enclosing graph, not graph breaks.
    """
    _ensure_annotated(graph)
    plan = Plan()
    covered: set[fx.Node] = set()
    # MoE expert GLUs first: their projections are grouped GEMMs no dense pattern matches
    for experts, found, cls, sites in ((True, find_expert_glus(graph), ExpertGLUSite, plan.expert_glus),
                                       (False, find_glu_mlps(graph), GLUSite, plan.glus)):
        what = "experts" if experts else "GLU"
        matches, rejected = found
        for m in matches:
            d = _glu_kind_decision(cfg, m, experts)
            site = _glu_site(m, cls)
            site.recipe = d.site
            loop = not experts and bool(expert_slices(m))
            if d.fp8 and loop and isinstance(d.site.cfg.recipe, NVFP4Scaling):
                d = Decision(False, _NO_LOOP_NVFP4)
            if d.fp8:
                (plan.loop_glus if loop else sites).append(site)
                covered |= set(m.nodes)
            else:
                plan.skipped.append((f"{what} {_module_of(site.down)}", f"not fused: {d.reason}"))
        for m, reason in rejected:
            plan.skipped.append((f"{what} at {_where(m['down'], m['down_w'])}", f"not fused: {reason}"))
        if not experts:
            _list_unmatched_tp_glus(graph, [m["h"] for m in matches] + [m["h"] for m, _ in rejected], plan)
    unsafe = set() if body else _find_breaks(graph, covered, plan, dict(split_before or {}))
    decided: set[fx.Node] = set(covered)
    for node in graph.nodes:
        if node in covered or node.op not in ("call_function", "call_method"):
            continue
        for m in LINEAR(node):
            decided.add(node)
            w = m["lin_w"]
            where = _weight_name(w)
            if node in unsafe:
                plan.skipped.append((where, "input is a GLU output cut off by a graph break; an "
                                            "unsmoothed FP8 cast of it is the outlier case"))
                break
            if _is_router(node):
                d = Decision(False, "MoE router (its output picks the experts: topk): kept in high precision by policy")
            else:
                d = decide_linear(cfg, node, m["lin_x"], w, m.get("lin_b"), w_operand=m.get("lin_w_operand"))
            expert = expert_slices(m).get(w)
            if d.fp8 and expert is not None and isinstance(d.site.cfg.recipe, NVFP4Scaling):
                d = Decision(False, _NO_LOOP_NVFP4)
            if d.fp8:
                site = LinearSite(node, m["lin_x"], w, m.get("lin_b"), weight_fqn(w) or where,
                                  list(dict.fromkeys(m.nodes)), m.get("lin_layout") == "in_out", expert, d.site)
                (plan.loop_linears if expert is not None else plan.linears).append(site)
            else:
                plan.skipped.append((where, d.reason))
            break
        else:
            for m in GROUPED_LINEAR(node):
                decided.add(node)
                w = m["lin_w"]
                where = param_fqn(w) or w.name
                d = decide_linear(cfg, node, m["lin_x"], w, None, experts=True, w_operand=m.get("lin_w_operand"))
                why = _stacked_form_ok(m, ["lin"])
                if d.fp8 and why:
                    d = Decision(False, why)
                d = _grouped_ok(d)
                if d.fp8:
                    plan.expert_linears.append(ExpertLinearSite(node, m["lin_x"], w, m.get("offs"), m["lin_layout"],
                                                                where, list(dict.fromkeys(m.nodes)), d.site))
                else:
                    plan.skipped.append((where, d.reason))
                break
    plan.skipped += _unplanned_matmuls(graph, decided)
    for b in hops.bodies(graph):
        sub = plan_graph(b.gm.graph, cfg, body=True)
        why = _why_body_kept(b, sub)
        if why is None:
            plan.bodies.append(BodyPlan(b, sub))
        else:
            plan.skipped += [(w, why) for w in sub.planned_weights()]
        plan.skipped += sub.skipped
    return plan


def _why_body_kept(b: hops.Body, sub: Plan) -> str | None:
    """Why a higher-order op body's planned matmuls stay high precision (None: it is rewritten)."""
    if not b.rewritten:
        return (f"inside {b.kind} (a higher-order op body): kept in high precision (the delayed-scaling records would have to "
                "leave every branch / iteration alike; fp8pass rewrites activation-checkpointed and wrap bodies only)")
    if _has_nvfp4_site(sub):
        return (f"inside {b.kind} (a higher-order op body): the NVFP4 recipe is not applied there (its hot-channel update runs in "
                "forward and would run again in the recomputation); kept in high precision")
    if not hops.returns_tuple(b.gm):
        return f"inside {b.kind} (a higher-order op body returning no tuple ; no room for its amax outputs): kept in high precision"
    return None


def _has_nvfp4_site(plan: Plan) -> bool:
    """Whether any site of ``plan`` (bodies included) has the NVFP4 recipe (Config.recipe or a rule's)."""
    return any(site.recipe is not None and isinstance(site.recipe.cfg.recipe, NVFP4Scaling)
               for p in plan.walk()
               for site in p.glus + p.linears + p.expert_glus + p.expert_linears + p.loop_glus + p.loop_linears)


_TOPK = (torch.topk, "topk")
# what may sit between a router's logits and its top-k: casts, normalisations, a bias, views
_ROUTER_PATH = {"softmax", "sigmoid", "log_softmax", "float", "to", "type", "view", "reshape", "add", "sub", "mul",
                "truediv", "div", "relu", "getitem", "squeeze", "unsqueeze", "flatten", "_softmax", "contiguous"}


def _is_router(linear_call: fx.Node, depth: int = 5) -> bool:
    """Whether a linear's output reaches a ``topk`` through a few elementwise / view steps (MoE routing)."""
    frontier = [linear_call]
    for _ in range(depth):
        nxt = []
        for n in frontier:
            for u in n.users:
                if is_call(u, _TOPK):
                    return True
                name = getattr(u.target, "__name__", str(u.target)).lstrip("_")
                if name in _ROUTER_PATH or str(u.target) in _ROUTER_PATH:
                    nxt.append(u)
        frontier = nxt
    return False


def _module_of(weight_fqn: str) -> str:
    """``layers.0.mlp`` for ``layers.0.mlp.down_proj.weight`` (the GLU's module)."""
    return weight_fqn.rsplit(".", 2)[0] if weight_fqn.count(".") >= 2 else weight_fqn


_ATTENTION_WORDS = ("attn", "attention", "mixer", "self_attn")


def _operands(node: fx.Node) -> list:
    if node.target in (torch.einsum,):
        return [a for a in node.args[1:] if isinstance(a, fx.Node)]
    if node.target in (torch.addmm, "addmm", torch.baddbmm, "baddbmm"):
        return list(node.args[1:3])
    return list(node.args[:2])


# what a weight may go through on its way into a matmul and still be "the weight"
_WEIGHT_VIEWS = {"view", "reshape", "transpose", "t", "permute", "T", "mT", "contiguous", "expand", "getitem",
                 "__getitem__", "select", "narrow", "index_select", "type", "to", "float", "bfloat16", "half",
                 "squeeze", "unsqueeze", "flatten", "unflatten", "chunk", "split"}


def _param_under(value, depth: int = 4) -> fx.Node | None:
    """The parameter placeholder a matmul operand is a view / slice / gather / cast of, if any."""
    for _ in range(depth):
        if not isinstance(value, fx.Node):
            return None
        if value.op == "placeholder":
            return value if param_fqn(value) is not None else None
        name = getattr(value.target, "__name__", str(value.target))
        if value.op not in ("call_function", "call_method") or name not in _WEIGHT_VIEWS:
            return None
        value = value.args[0] if value.args else None
    return None


def _tensor_indexed_expert(node: fx.Node) -> bool:
    """An operand is ``W[idx]`` / ``W.select(0, idx)`` of a 3-D parameter with a tensor (or symbolic) index."""
    for a in _operands(node):
        for _ in range(3):  # through a transpose or cast
            if not isinstance(a, fx.Node) or a.op not in ("call_function", "call_method") or not a.args:
                break
            name = getattr(a.target, "__name__", str(a.target))
            base = a.args[0]
            if name in ("getitem", "select") and isinstance(base, fx.Node) and base.op == "placeholder":
                ev = example_value(base)
                index = a.args[1] if name == "getitem" else (a.args[2] if len(a.args) > 2 else None)
                if isinstance(ev, torch.Tensor) and ev.dim() == 3 and isinstance(index, fx.Node):
                    return True
                break
            a = base
    return False


def _unplanned_matmuls(graph: fx.Graph, decided: set[fx.Node]) -> list[tuple[str, str]]:
    """(where, reason) for every matmul-like call the plan neither rewrote nor already explained."""
    out: list[tuple[str, str]] = []
    attention: dict[str, int] = {}
    targets = MATMUL_LIKE + grouped_mm_targets()
    for node in graph.nodes:
        if hops.is_flex_attention(node):  # a higher-order op: its score / mask functions hold no weights
            owner = caller_fqn(node) or node.name
            attention[owner] = attention.get(owner, 0) + 1
            continue
        if node in decided or node.op not in ("call_function", "call_method") or not is_call(node, targets):
            continue
        owner = caller_fqn(node) or node.name
        name = getattr(node.target, "__name__", str(node.target))
        weights = [w for w in (_param_under(a) for a in _operands(node)) if w is not None]
        if node.target is F.scaled_dot_product_attention:
            attention[owner] = attention.get(owner, 0) + 1
            continue
        if not weights:
            last = owner.rsplit(".", 1)[-1].lower()
            if any(k in last for k in _ATTENTION_WORDS) or "attn" in owner.lower():
                attention[owner] = attention.get(owner, 0) + 1
            else:
                out.append((owner, f"{name} of two activations (no parameter operand): kept"))
            continue
        w = weights[0]
        ev = example_value(w)
        dims = f"{ev.dim()}-D " if isinstance(ev, torch.Tensor) else ""
        if _is_router(node):
            why = "MoE router (its output picks the experts: topk): kept in high precision by policy"
        elif _tensor_indexed_expert(node):
            why = ("one expert's matrix picked by a tensor index (a per-expert loop over data-dependent expert "
                   "ids): not a constant expert, no per-expert state to key; loop over range(E) with int "
                   "indices, or use transformers' experts_implementation='grouped_mm'")
        elif is_call(node, grouped_mm_targets()):
            why = "grouped expert GEMM in a form the patterns do not know (bias, out_dtype or a reshaped weight)"
        elif isinstance(ev, torch.Tensor) and ev.dim() == 3:
            why = (f"{name} over a gathered or stacked 3-D expert weight (per-token weight gather or fixed "
                   "capacity): unsupported form; use transformers' experts_implementation='grouped_mm'")
        else:
            why = f"{name} with a {dims}weight in an unsupported form (a slice, view or non-default arguments)"
        out.append((param_fqn(w) or owner, why))
    for owner, n in attention.items():
        out.append((owner, f"attention, kept ({n} op{'s' if n > 1 else ''}: scores and weighted values "
                           "are products of activations)"))
    return out
