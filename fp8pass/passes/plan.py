"""Analysis of one Dynamo graph: which GLU MLPs, MoE experts and linears become FP8, what stays, breaks.

The plan is typed: ``Plan.sites`` holds one site per rewrite (:class:`GLUSite`, :class:`LinearSite`
and their expert / per-expert-loop kinds), each with one :class:`Projection` per role (call node,
``x``, ``w``, ``b``, layout, fused rows, expert index). This module is the only reader of the
patterns' matches; the rewriters read the sites' fields.

``plan_graph`` only reads the graph (and its annotations, :mod:`.annotate`); ``rewrite.apply_plan``
changes a copy of it. Explain uses the plan alone, so ``fp8pass.explain`` works on any model without
running FP8 ops. A GLU or linear whose weights are single experts of a 3-D expert weight (``W[e]``
with a constant ``e``: a per-expert Python loop) is a ``LoopGLUSite`` / ``LoopLinearSite``: FP8 per
expert, with one scale per (expert weight, expert), one expert stack in the report. Every
matmul-like call the plan leaves in high precision is listed in ``skipped`` with its reason (the
NVFP4 recipe's protected linears too, :func:`_protect_nvfp4`: their :class:`Projection` carries the
:class:`Protection` the NVFP4 rewriter follows);
attention's score and value products (SDPA, FlexAttention, explicit matmuls in an attention module)
are one "attention, kept" line per module.

Higher-order ops' bodies (:mod:`.hops`) are planned like any graph: an activation-checkpointed or
``wrap`` body's plan goes to ``Plan.bodies`` (rewritten with the enclosing graph), a ``cond`` /
``while_loop`` body's planned matmuls are listed as kept. Every body's kept list joins ``skipped``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import fx

from ..config import Config, CurrentScaling, NVFP4Scaling
from . import hops
from .annotate import META_KEY, annotate
from .matcher import MUL, Match, caller_fqn, example_value, is_call, is_cast, param_fqn, weight_fqn
from .nvfp4_policy import protected_linears
from .patterns import (
    GLU_PRODUCT_LOOSE,
    GROUPED_LINEAR,
    LINEAR,
    MATMUL_LIKE,
    activation,
    expert_slices,
    find_expert_glus,
    find_glu_mlps,
    find_rms_norms,
    grouped_mm_targets,
    linear,
    variant_name,
)
from .policy import Decision, SiteRecipe, decide_linear

__all__ = ["Projection", "Protection", "GLUSite", "ExpertGLUSite", "LoopGLUSite", "LinearSite", "LoopLinearSite",
           "ExpertLinearSite", "NormSite", "Site", "BodyPlan", "Plan", "plan_graph", "is_nvfp4", "nvfp4_projections"]


@dataclass(frozen=True, slots=True)
class Protection:
    """A projection of an NVFP4 site that the recipe keeps out of 4 bits (:mod:`.nvfp4_policy`).

    ``recipe``: the FP8 recipe (current scaling, no state) it runs in instead
    (``NVFP4Scaling.protected_precision="fp8"``), or None: it stays in high precision.
    """

    reason: str
    recipe: SiteRecipe | None = None


@dataclass(slots=True)
class Projection:
    """One projection ``x @ w.T (+ b)`` of a site: what the rewrite reads and replaces."""

    call: fx.Node            # the matched call the rewrite replaces
    x: fx.Node               # its input (a GLU's down projection: the GLU product)
    w: fx.Node               # its weight: a parameter, or the slice ``W[e]`` in a per-expert loop
    b: fx.Node | None
    fqn: str                 # the weight's name in reports
    layout: str = "out_in"   # "out_in": ``w`` is [out, in] (nn.Linear); "in_out": stored transposed (Conv1D)
    rows: slice | None = None   # a fused gate_up projection: the rows of its weight that are this role's
    expert: tuple[fx.Node, int] | None = None   # ``(W, e)`` where ``w`` is ``W[e]`` (a per-expert loop)
    protection: Protection | None = None        # NVFP4 sites: kept out of 4 bits, decided by the plan

    @property
    def w_t(self) -> bool:
        """The weight is stored [in, out]: the op gets its transpose."""
        return self.layout == "in_out"


@dataclass(slots=True)
class GLUSite:
    """One matched GLU MLP ``down(act(gate(x)) * up(x))``.

    A fused gate/up projection is one call: ``gate_proj`` and ``up_proj`` then share it (and its
    weight) and differ in ``rows``.
    """

    kind: ClassVar[str] = "glu"

    variant: str
    act: str
    gate_proj: Projection
    up_proj: Projection
    down_proj: Projection      # its ``x`` is the GLU product
    gate_out: fx.Node          # the values the product multiplies: gate's output (a fused one's slice)
    up_out: fx.Node
    nodes: list[fx.Node] = field(default_factory=list)   # the match's nodes (erasable once dead)
    recipe: SiteRecipe | None = None  # the recipe every projection of it runs in (policy.SiteRecipe)

    @property
    def fused(self) -> bool:
        return self.gate_proj.rows is not None

    @property
    def gate(self) -> str:
        """Weight FQNs (for a fused projection, gate and up are the same FQN)."""
        return self.gate_proj.fqn

    @property
    def up(self) -> str:
        return self.up_proj.fqn

    @property
    def down(self) -> str:
        return self.down_proj.fqn

    @property
    def gate_rows(self) -> slice | None:
        """Rows of the fused weight that are the gate / the up projection (None: separate projections)."""
        return self.gate_proj.rows

    @property
    def up_rows(self) -> slice | None:
        return self.up_proj.rows

    def projections(self) -> list[Projection]:
        """Its distinct calls, in order: gate_up and down (fused), or gate, up and down."""
        return [self.gate_proj, self.down_proj] if self.fused else [self.gate_proj, self.up_proj, self.down_proj]


@dataclass(slots=True)
class ExpertGLUSite(GLUSite):
    """One MoE expert stack whose experts are GLUs: grouped gate/up and down projections."""

    kind: ClassVar[str] = "expert_glu"

    offs: fx.Node | None = None   # the group offsets; None: batched form, x [E, C, in]


@dataclass(slots=True)
class LoopGLUSite(GLUSite):
    """A GLU over single experts ``W[e]`` of 3-D expert weights (a per-expert loop): each projection's
    ``expert`` names its ``(W, e)``."""

    kind: ClassVar[str] = "loop_glu"


@dataclass(slots=True)
class LinearSite:
    """One linear op ``x @ w.T (+ b)`` that becomes an FP8 (or NVFP4) linear."""

    kind: ClassVar[str] = "linear"

    proj: Projection
    nodes: list[fx.Node] = field(default_factory=list)   # the match's nodes (erasable once dead)
    recipe: SiteRecipe | None = None

    @property
    def fqn(self) -> str:
        return self.proj.fqn


@dataclass(slots=True)
class LoopLinearSite(LinearSite):
    """A linear over a single expert ``W[e]`` of a 3-D expert weight (``proj.expert`` is ``(W, e)``)."""

    kind: ClassVar[str] = "loop_linear"


@dataclass(slots=True)
class ExpertLinearSite(LinearSite):
    """One grouped expert projection that becomes an FP8 grouped linear."""

    kind: ClassVar[str] = "expert_linear"

    offs: fx.Node | None = None   # None: batched form, x [E, C, in]


@dataclass(slots=True)
class NormSite:
    """An RMSNorm whose output only FP8 linears read (``Config.save_norm_input_fp8``): rewritten into
    ``fp8pass::rmsnorm``, which keeps FP8 codes of its normalized input for backward, not the input."""

    kind: ClassVar[str] = "rmsnorm"

    call: fx.Node                  # the matched node whose value the op's ``y`` replaces
    x: fx.Node                     # the norm's input (before its fp32 cast)
    w: fx.Node                     # its 1-D weight parameter
    fqn: str
    eps: float
    hat_dtype: torch.dtype | None  # x_hat's cast before the weight multiplies it (Hugging Face), else None
    out_dtype: torch.dtype | None  # the output's final cast, else None
    nodes: list[fx.Node] = field(default_factory=list)   # the match's nodes (erasable once dead)
    recipe: SiteRecipe | None = None  # unused: the norm runs no GEMM (kept for the sites' common shape)


Site = GLUSite | LinearSite | NormSite


@dataclass
class Plan:
    """What becomes FP8 in one graph: ``sites`` in plan order, what stays and why (``skipped``)."""

    sites: list[Site] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)   # (where, reason)
    graph_breaks: list[str] = field(default_factory=list)
    # MLP module FQN cut by a break -> where: "act" (after the activation) or "glu" (after the product)
    split_modules: dict[str, str] = field(default_factory=dict)
    # rewritten higher-order op bodies (activation checkpointing, wrap), each with its own plan
    bodies: list["BodyPlan"] = field(default_factory=list)

    def of_kind(self, cls: type) -> list:
        """The sites of exactly this kind (``cls.kind``), in plan order."""
        return [s for s in self.sites if s.kind == cls.kind]

    @property
    def glus(self) -> list[GLUSite]:
        return self.of_kind(GLUSite)

    @property
    def linears(self) -> list[LinearSite]:
        return self.of_kind(LinearSite)

    @property
    def expert_glus(self) -> list[ExpertGLUSite]:
        return self.of_kind(ExpertGLUSite)

    @property
    def expert_linears(self) -> list[ExpertLinearSite]:
        return self.of_kind(ExpertLinearSite)

    @property
    def loop_glus(self) -> list[LoopGLUSite]:
        """Per-expert loops: GLUs over single experts ``W[e]`` of 3-D expert weights."""
        return self.of_kind(LoopGLUSite)

    @property
    def loop_linears(self) -> list[LoopLinearSite]:
        return self.of_kind(LoopLinearSite)

    @property
    def norms(self) -> list[NormSite]:
        """RMSNorms that keep FP8 codes of their normalized input (``Config.save_norm_input_fp8``)."""
        return self.of_kind(NormSite)

    def empty(self) -> bool:
        """Nothing to rewrite (in this graph or any body)."""
        return not (self.sites or self.bodies)

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


def _projection(m: Match, role: str, x: fx.Node, fqn: str | None = None,
                call: fx.Node | None = None) -> Projection:
    """The projection a match binds under ``role`` (``gate_up``, ``gate``, ``up``, ``down``, ``lin``;
    ``call``: the matched node, where the match was made at it)."""
    w = m[f"{role}_w"]
    return Projection(call=m[role] if call is None else call, x=x, w=w, b=m.get(f"{role}_b"),
                      fqn=fqn or weight_fqn(w) or w.name, layout=m.get(f"{role}_layout") or "out_in",
                      expert=expert_slices(m).get(w))


def _glu_site(m: Match, cls=GLUSite) -> GLUSite:
    """The typed site of a GLU match (the only place a GLU's match is read by key)."""
    if m.get("proj") == "fused":
        fused = _projection(m, "gate_up", m["x"])
        gate, up = replace(fused, rows=m["gate_rows"]), replace(fused, rows=m["up_rows"])
    else:
        gate, up = _projection(m, "gate", m["x"]), _projection(m, "up", m["x"])
    extra = {"offs": m.get("offs")} if cls is ExpertGLUSite else {}
    return cls(variant=variant_name(m), act=m["act"], gate_proj=gate, up_proj=up,
               down_proj=_projection(m, "down", m["h"]), gate_out=m["gate"], up_out=m["up"], nodes=m.nodes,
               **extra)


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
    """Whether ``node`` is, or is a few calls downstream of, a DTensor made a local tensor. Told by the
    values (a local tensor computed from a DTensor), so a traced form of ``to_local`` the patterns do not
    know is listed too."""
    for _ in range(depth):
        if not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method"):
            return False
        arg = node.args[0] if node.args else None
        if _layout(example_value(node)) is None and isinstance(arg, fx.Node) and _layout(example_value(arg)) is not None:
            return True
        node = arg
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
    for experts, found in ((True, find_expert_glus(graph)), (False, find_glu_mlps(graph))):
        what = "experts" if experts else "GLU"
        matches, rejected = found
        for m in matches:
            d = _glu_kind_decision(cfg, m, experts)
            loop = not experts and bool(expert_slices(m))
            site = _glu_site(m, ExpertGLUSite if experts else LoopGLUSite if loop else GLUSite)
            site.recipe = d.site
            if d.fp8 and loop and isinstance(d.site.cfg.recipe, NVFP4Scaling):
                d = Decision(False, _NO_LOOP_NVFP4)
            if d.fp8:
                plan.sites.append(site)
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
                cls = LinearSite if expert is None else LoopLinearSite
                plan.sites.append(cls(_projection(m, "lin", m["lin_x"], weight_fqn(w) or where, node),
                                      list(dict.fromkeys(m.nodes)), d.site))
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
                    plan.sites.append(ExpertLinearSite(_projection(m, "lin", m["lin_x"], where, node),
                                                       list(dict.fromkeys(m.nodes)), d.site, offs=m.get("offs")))
                else:
                    plan.skipped.append((where, d.reason))
                break
    plan.skipped += _unplanned_matmuls(graph, decided)
    if cfg.save_norm_input_fp8:
        _plan_norms(graph, plan)
    for b in hops.bodies(graph):
        sub = plan_graph(b.gm.graph, cfg, body=True)
        why = _why_body_kept(b, sub)
        if why is None:
            plan.bodies.append(BodyPlan(b, sub))
        else:
            plan.skipped += [(w, why) for w in sub.planned_weights()]
        plan.skipped += sub.skipped
    if not body:  # a body with NVFP4 sites is kept whole (_why_body_kept)
        plan.skipped += _protect_nvfp4(plan)
    return plan


def _fp8_inputs(plan: Plan) -> dict[fx.Node, set[fx.Node]]:
    """The input node of every FP8 (not NVFP4) projection of ``plan`` -> the calls that read it."""
    out: dict[fx.Node, set[fx.Node]] = {}
    for site in plan.glus + plan.linears:
        if is_nvfp4(site):
            continue
        projections = site.projections()[:-1] if isinstance(site, GLUSite) else [site.proj]
        for p in projections:
            out.setdefault(p.x, set()).add(p.call)
    return out


def _foreign_reader(node: fx.Node, fp8_inputs: dict[fx.Node, set[fx.Node]]) -> fx.Node | None:
    """A reader of ``node`` that is not an FP8 linear taking it as its input (directly or through
    dtype casts), or None when every reader is one."""
    for user in node.users:
        if user in fp8_inputs.get(node, ()):
            continue
        if is_cast(user):
            other = _foreign_reader(user, fp8_inputs)
            if other is None:
                continue
            return other
        return user
    return None


def _plan_norms(graph: fx.Graph, plan: Plan) -> None:
    """RMSNorm sites (``Config.save_norm_input_fp8``): a norm whose every reader is a converted FP8
    linear, else ``Plan.skipped`` with the reason."""
    found, rejected = find_rms_norms(graph)
    fp8_inputs = _fp8_inputs(plan)
    for m, reason in rejected:
        plan.skipped.append((f"RMSNorm {_weight_name(m['norm_w'])}", f"input kept in high precision: {reason}"))
    for m in found:
        w = m["norm_w"]
        fqn = _weight_name(w)
        where = f"RMSNorm {fqn}"
        xf = example_value(m["norm_xf"])
        torch_form = m.get("norm_form") == "torch"
        # torch.rms_norm upcasts bf16/fp16 inputs to fp32 itself (fp64 stays fp64)
        stats = getattr(xf, "dtype", None)
        if torch_form and stats in (torch.bfloat16, torch.float16):
            stats = torch.float32
        if not isinstance(xf, torch.Tensor) or stats != torch.float32:
            plan.skipped.append((where, f"input kept in high precision: its statistics are computed in "
                                        f"{getattr(xf, 'dtype', '?')}, not fp32"))
            continue
        reader = _foreign_reader(m["norm"], fp8_inputs)
        if reader is not None:
            plan.skipped.append((where, f"input kept in high precision: its output is read by "
                                        f"{_reader_name(reader)}, which is not an FP8 linear"))
            continue
        hat_cast, out_cast = m.get("norm_hat_cast"), m.get("norm_out_cast")
        hat_dtype = None if hat_cast is None else example_value(hat_cast).dtype
        out_dtype = None if out_cast is None else example_value(out_cast).dtype
        eps = m["norm_eps"]
        if torch_form:  # ((xf * rstd) * w).type_as(x); eps None: fp32's epsilon (the dtype it computes in)
            out_dtype = example_value(m["norm"]).dtype
            eps = torch.finfo(torch.float32).eps if eps is None else eps
        plan.sites.append(NormSite(call=m["norm"], x=m["norm_x"], w=w, fqn=fqn, eps=eps, hat_dtype=hat_dtype,
                                   out_dtype=out_dtype, nodes=list(m.nodes)))


def _reader_name(node: fx.Node, depth: int = 3) -> str:
    """A reader of a norm's output for explain: the linear it reaches through a few views or casts
    (Hugging Face slices the last hidden state before the LM head) when there is one, else the call."""
    cur = node
    for _ in range(depth + 1):
        for m in LINEAR(cur):
            return f"{_weight_name(m['lin_w'])} (a linear kept in high precision)"
        if len(cur.users) != 1 or not (is_cast(cur) or is_call(cur, _NORM_READER_VIEWS)):
            break
        cur = next(iter(cur.users))
    name = getattr(node.target, "__name__", str(node.target))
    return f"{name} at {caller_fqn(node) or node.name}"


_NORM_READER_VIEWS = (operator.getitem, "view", "reshape", "contiguous", "flatten")


def is_nvfp4(site: Site) -> bool:
    """Whether a site's recipe is NVFP4 (the NVFP4 rewriter's) rather than FP8."""
    return isinstance(site.recipe.cfg.recipe, NVFP4Scaling)


def nvfp4_projections(plan: Plan) -> dict[SiteRecipe, list[tuple[Projection, list[fx.Node]]]]:
    """The projections of the plan's NVFP4 sites with their match's nodes, by recipe (GLUs' first, in plan order).

    Each NVFP4 recipe protects among its own projections, and the NVFP4 rewriter emits them in this order.
    """
    out: dict[SiteRecipe, list[tuple[Projection, list[fx.Node]]]] = {}
    for glu in plan.glus:
        if is_nvfp4(glu):
            # the activation and product stay (the NVFP4 down linear reads them): covering the whole
            # match erases only what died, the replaced projections and their weight transposes
            out.setdefault(glu.recipe, []).extend((p, glu.nodes) for p in glu.projections())
    for lin in plan.linears:
        if is_nvfp4(lin):
            out.setdefault(lin.recipe, []).append((lin.proj, lin.nodes))
    return out


def _protect_nvfp4(plan: Plan) -> list[tuple[str, str]]:
    """Mark the NVFP4 projections each NVFP4 recipe keeps out of 4 bits (:mod:`.nvfp4_policy`) with their
    :class:`Protection`: FP8 with current scaling (``protected_precision="fp8"``, no state) or high
    precision. Returns their (where, reason) entries for ``Plan.skipped``."""
    kept: list[tuple[str, str]] = []
    for site, parts in nvfp4_projections(plan).items():
        recipe = site.cfg.recipe
        protected = protected_linears([p.fqn for p, _ in parts], recipe)
        as_fp8 = SiteRecipe(replace(site.cfg, recipe=CurrentScaling()), site.backward, site.rule)
        by = f" ({site.rule})" if site.rule else ""
        for p, _ in parts:
            if p.fqn not in protected:
                continue
            if recipe.protected_precision == "fp8":
                p.protection = Protection(protected[p.fqn], as_fp8)
                kept.append((p.fqn, protected[p.fqn] + ": FP8 linear (current scaling)" + by))
            else:
                p.protection = Protection(protected[p.fqn])
                kept.append((p.fqn, protected[p.fqn] + ": kept in high precision" + by))
    return list(dict.fromkeys(kept))


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
               for p in plan.walk() for site in p.sites)


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
