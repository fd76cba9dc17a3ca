"""What every rewriter shares: the graph copy, state placeholders, replacement, and the cleanup.

A rewriter (FP8 linears and GLUs: :mod:`.rewrite_fp8`; MoE experts: :mod:`.rewrite_grouped`; NVFP4:
:mod:`.rewrite_nvfp4`) emits ``torch.ops.fp8pass`` calls before a matched node and redirects the
node's users to them. The cleanup then removes exactly the nodes the matches covered that no longer
have users (the replaced calls and their now-dead transposes, slices and activations), never a general
dead-code sweep: Dynamo's graphs hold in-place ops, RNG draws and vmap/autograd state changes whose
results are unused, and ``Node.is_impure`` does not know most of them. A covered node with side
effects cannot exist (patterns never match one, see :mod:`.annotate`), and is kept regardless.

State placeholders: a weight's scaling state enters the graph as extra placeholders appended after
Dynamo's; :class:`StateInput` says which tensor of which weight's state each one is, and the backend
passes the live tensors on every call.
"""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass

import torch
from torch import fx

from ..config import Config, DelayedScaling
from ..numerics import ROLES, DelayedScalingState
from ..op_schema import LinearKnobs
from .annotate import facts, value_dtype

__all__ = ["StateInput", "GraphRewriter", "copy_graph_module", "record_params",
           "keep_meta", "finish", "STATE_FIELDS"]

STATE_FIELDS = len(DelayedScalingState.OP_FIELDS)  # the op list of one delayed-scaling state


@dataclass(frozen=True)
class StateInput:
    """An extra graph input: field ``field`` of role ``role`` of the state of placeholder ``weight_pos``.

    ``kind`` says whose state: "linear" (``runtime.state_for``), "experts" (per-expert state of a
    3-D expert weight, ``runtime.grouped_state_for``), "hcp" (NVFP4 hot-channel patching) or "sr" (the
    weight's stochastic-rounding stream, ``runtime.sr.stream_for``).
    ``config``: the site's Config (its recipe and formats make the state; ``Config.rules``).
    """

    weight_pos: int
    role: str
    field: int
    kind: str = "linear"
    config: Config | None = None


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of Dynamo's GraphModule whose graph, and its subgraphs' graphs, may be edited (Dynamo
    re-reads the original)."""
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
    for node in graph.nodes:  # higher-order ops' bodies (.hops) are rewritten too: copies of them
        sub = getattr(new_gm, node.target, None) if node.op == "get_attr" else None
        if isinstance(sub, fx.GraphModule):
            setattr(new_gm, node.target, copy_graph_module(sub))
    if hasattr(gm, "_param_name_to_source"):  # AOT autograd reads the static inputs (CUDA graphs) from it
        new_gm._param_name_to_source = gm._param_name_to_source
    return new_gm


def record_params(knobs: LinearKnobs) -> tuple:
    """The recipe fields a delayed-scaling record takes (states recorded together must share them)."""
    return knobs.margin, knobs.interval, knobs.algo, knobs.power_of_two


class GraphRewriter:
    """Base of the rewriters: state placeholders, replacement bookkeeping, the covered-node cleanup.

    Args:
        gm: the copy of Dynamo's GraphModule to edit in place (annotated by :func:`.annotate.annotate`).
        cfg: the backend's Config; each site is emitted with its own (:meth:`at`).

    Attributes:
        share_input_casts: linears go through one shared input cast per input node
            (``fp8_cast_input`` + ``fp8_linear_precast``: codes saved once, weights recast in backward)
            instead of one ``fp8_linear`` each; MX granularity always takes ``fp8_linear``.
    """

    share_input_casts = False

    def __init__(self, gm: fx.GraphModule, cfg: Config):
        self.gm, self.graph, self.cfg = gm, gm.graph, cfg
        self.delayed = isinstance(cfg.recipe, DelayedScaling)
        self.knobs = LinearKnobs.from_config(cfg)   # the site being emitted's (:meth:`at`)
        self.placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        self.pos = {n: i for i, n in enumerate(self.placeholders)}
        self.last_ph = self.placeholders[-1] if self.placeholders else None
        self.extra: list[StateInput] = []
        self._state_nodes: dict[tuple[int, str, str], list[fx.Node]] = {}
        # the runtime's ops by name: passes import only the ops' knob declarations (fp8pass.op_schema),
        # never their implementations; the backend imports those, which registers the ops
        self.ops = torch.ops.fp8pass
        self.replaced: dict[fx.Node, fx.Node] = {}  # planned nodes replaced earlier in this rewrite
        # forward records of this graph, per state: (state placeholders, fmt, [amax nodes], record_params);
        # emitted as one batched op per record_params at the end of the forward (see :func:`emit_records`)
        self.records: dict[tuple[int, ...], tuple[list[fx.Node], str, list[fx.Node], tuple]] = {}
        self.covered: set[fx.Node] = set()          # nodes of the matches rewritten: the only erasable ones
        self._input_casts: dict[tuple, list[tuple]] = {}  # (x, dtype) -> nodes of its casts (detach, cast, outputs)

    @contextlib.contextmanager
    def at(self, recipe):
        """Emit the ops of one site with its ``policy.SiteRecipe`` (the plan site's ``recipe``): the
        Config and backward of the rule that decided it (``Config.rules``), or the backend's Config."""
        saved = self.cfg, self.knobs, self.delayed
        self.cfg = recipe.cfg
        self.knobs = LinearKnobs.from_config(self.cfg, recipe.backward)
        self.delayed = isinstance(self.cfg.recipe, DelayedScaling)
        try:
            yield
        finally:
            self.cfg, self.knobs, self.delayed = saved

    def kwargs(self, out_dtype, **more) -> dict:
        """The emitted op's knobs by name: the site's recipe (:attr:`knobs`), then ``out_dtype`` (the
        replaced node's dtype) and ``more`` (a GLU op's own knobs), in the order the graph prints them."""
        kw = self.knobs.kwargs()
        del kw["out_dtype"]
        return dict(kw, out_dtype=out_dtype, **more)

    def r(self, value):
        """``value`` as it is now: the plan's nodes may have been replaced by an earlier site."""
        while isinstance(value, fx.Node) and value in self.replaced:
            value = self.replaced[value]
        return value

    def replace(self, old: fx.Node, new: fx.Node, covered=()) -> None:
        """Redirect ``old``'s users to ``new``; ``covered``: the match's nodes (erased when dead)."""
        if self.cfg.compiler == "eager" and _mutated_later(old):
            # eager autograd refuses in-place ops on a custom op's tuple outputs (AOT autograd
            # functionalizes them): hand the mutating users a copy (only for the eager compiler)
            with self.graph.inserting_after(new):
                copy = self.graph.call_method("clone", (new,))
            keep_meta(copy, old)
            new = copy
        old.replace_all_uses_with(new)
        self.replaced[old] = new
        self.covered.add(old)
        self.covered.update(covered)

    def state_placeholders(self, w: fx.Node, role: str, kind: str, fields: int) -> list[fx.Node]:
        """``fields`` placeholders for the state of (weight ``w``, ``role``), made once per weight."""
        key = (self.pos[w], role, kind)
        if key not in self._state_nodes:
            nodes = []
            for f in range(fields):
                anchor = self.last_ph
                ctx = (self.graph.inserting_before(next(iter(self.graph.nodes))) if anchor is None
                       else self.graph.inserting_after(anchor))
                with ctx:
                    ph = self.graph.placeholder(f"{kind}_state_{w.name}_{role}_{f}")
                # a static input: the state tensors live as long as the weight and are updated in
                # place, so CUDA graphs (mode="reduce-overhead") use them where they are, like parameters
                ph._dynamo_source = None
                ph.meta["tensor_dict"] = {"_dynamo_static_input_type": "unguarded"}
                self.last_ph = ph
                nodes.append(ph)
                self.extra.append(StateInput(self.pos[w], role, f, kind, self.cfg))
            self._state_nodes[key] = nodes
        return self._state_nodes[key]

    def state(self, w: fx.Node, role: str, kind: str = "linear") -> list[fx.Node]:
        """Delayed-scaling state placeholders of (weight, role); [] under current scaling."""
        if not self.delayed:
            return []
        return self.state_placeholders(w, role, kind, STATE_FIELDS)

    def sr_stream(self, w: fx.Node) -> fx.Node | None:
        """The placeholder of ``w``'s stochastic-rounding stream (``runtime.sr``), or None where the
        gradient cast rounds to nearest or is the identity."""
        if self.knobs.grad_rounding != "stochastic" or self.cfg.bwd_format == "identity" or w not in self.pos:
            return None
        return self.state_placeholders(w, "grad_output", "sr", 1)[0]

    def record(self, state: list[fx.Node], amax: fx.Node, fmt: str, params: tuple | None = None) -> None:
        """Note a forward record of ``amax`` into ``state`` (nothing under current scaling).

        The records of a graph are emitted together by :func:`emit_records`; a state used more than
        once in the graph (a weight applied twice) records the max of its amaxes, once. ``params``:
        :func:`record_params` of the state's recipe (default: the site being emitted).
        """
        if not state or fmt == "identity":
            return
        key = tuple(id(n) for n in state)
        self.records.setdefault(key, (state, fmt, [], params or record_params(self.knobs)))[2].append(amax)

    def fp8_linear(self, x, w: fx.Node, b, before: fx.Node, w_t: bool = False) -> fx.Node:
        """Emit an FP8 linear ``x @ w.T + b`` (with its records) before ``before``; returns ``y``.

        ``w_t``: ``w`` is stored [in, out] (GPT-2's Conv1D); the op gets its transpose (a view).
        With :attr:`share_input_casts` (and not MX granularity), ``x`` is cast once by a shared
        ``fp8_cast_input`` (:meth:`input_cast`) and the linear is an ``fp8_linear_precast``.
        """
        if self.share_input_casts and self.knobs.granularity != "mx" and not facts(w).regathered:
            return self._fp8_linear_precast(x, w, b, before, w_t)
        xs, ws, gs = (self.state(w, r) for r in ROLES)
        with self.graph.inserting_before(before):
            weight = self.graph.call_function(torch.t, (w,)) if w_t else w
            out = self.graph.call_function(self.ops.fp8_linear.default,
                                           (self.r(x), weight, b, xs, ws, gs, self.sr_stream(w)),
                                           self.kwargs(value_dtype(before)))
            y = self.graph.call_function(operator.getitem, (out, 0))
            if self.delayed:
                self.record(xs, self.graph.call_function(operator.getitem, (out, 1)), self.knobs.fwd_format)
                self.record(ws, self.graph.call_function(operator.getitem, (out, 2)), self.knobs.fwd_format)
        keep_meta(y, before)
        return y

    def input_cast(self, x: fx.Node, xs: list[fx.Node], out_dtype, before: fx.Node) -> tuple:
        """``(x_data, x_scale, x_amax, x_alt)`` nodes of ``fp8_cast_input(x.detach(), xs)`` (``x_amax``
        None under current scaling) for a linear at ``before``: one cast per (input node, compute
        dtype), sitting right before the earliest linear that uses it; a later request shares it
        (and its ``xs`` is not read: the first consumer's state scales the shared cast) unless a
        node with side effects (an in-place write, possibly into ``x``) lies between the two, in
        which case this linear gets its own cast."""
        casts = self._input_casts.setdefault((x, out_dtype, self.knobs), [])
        for nodes in casts:
            head = nodes[0]
            after = _clear_between(head, before)  # before comes later: nothing may write in between
            if after is None:  # before comes first: move the cast up to it, if nothing writes in between
                if not _clear_between(before, head):
                    continue
                for n in nodes:
                    if n is not None:
                        before.prepend(n)
                return nodes[2:]
            if after:
                return nodes[2:]
        with self.graph.inserting_before(before):
            # detached: the cast is forward-only; dx reaches x through the linears' own x input
            xd = self.graph.call_method("detach", (x,))
            cast = self.graph.call_function(self.ops.fp8_cast_input.default, (xd, xs),
                                            self.kwargs(out_dtype))
            # x_amax only where delayed scaling records it
            outs = tuple(self.graph.call_function(operator.getitem, (cast, i)) if i != 2 or self.delayed else None
                         for i in range(4))
        nodes = (xd, cast, *outs)
        for n in nodes:
            if n is not None:
                keep_meta(n, before)
        casts.append(nodes)
        return outs

    def _fp8_linear_precast(self, x, w: fx.Node, b, before: fx.Node, w_t: bool) -> fx.Node:
        xs, ws, gs = (self.state(w, r) for r in ROLES)
        sr = self.sr_stream(w)
        x = self.r(x)
        dt = value_dtype(before)
        data, scale, amax, up = self.input_cast(x, xs, dt, before)
        with self.graph.inserting_before(before):
            weight = self.graph.call_function(torch.t, (w,)) if w_t else w
            out = self.graph.call_function(self.ops.fp8_linear_precast.default,
                                           (x, data, scale, up, weight, b, ws, gs, sr),
                                           self.kwargs(dt))
            y = self.graph.call_function(operator.getitem, (out, 0))
            if self.delayed:  # every consumer's input state records the shared cast's amax
                self.record(xs, amax, self.knobs.fwd_format)
                self.record(ws, self.graph.call_function(operator.getitem, (out, 1)), self.knobs.fwd_format)
        keep_meta(y, before)
        return y


def _clear_between(a: fx.Node, b: fx.Node) -> bool | None:
    """Whether no node strictly between ``a`` and a later ``b`` has side effects; None if ``b`` does
    not come after ``a``."""
    clear = True
    n = a.next
    while n.op != "root":
        if n is b:
            return clear
        if clear and facts(n).side_effects:
            clear = False
        n = n.next
    return None


_VIEWS = {"view", "reshape", "transpose", "t", "permute", "narrow", "select", "unsqueeze", "squeeze", "expand",
          "chunk", "split", "unbind", "flatten", "unflatten", "view_as", "reshape_as", "getitem", "__getitem__",
          "contiguous", "T", "mT"}


def _mutated_later(node: fx.Node) -> bool:
    """Whether a later node mutates ``node``'s result or a view of it in place."""
    todo, seen = [node], set()
    while todo:
        cur = todo.pop()
        if cur in seen:
            continue
        seen.add(cur)
        for user in cur.users:
            name = getattr(user.target, "__name__", str(user.target))
            if facts(user).side_effects and user.args and user.args[0] is cur:
                return True
            if name in _VIEWS:
                todo.append(user)
    return False


def keep_meta(new: fx.Node, old: fx.Node) -> None:
    """Carry the module stack and source line of a replaced node (explain and error messages)."""
    new.meta.update({k: v for k, v in old.meta.items() if k in ("nn_module_stack", "stack_trace")})


def emit_records(graph: fx.Graph, rewriters: list[GraphRewriter]) -> None:
    """One ``fp8pass::delayed_record_many_`` before the output for every forward record of the graph.

    One op per recipe (:func:`record_params`: rules may give linears different delayed recipes); each
    state appears once, with the ``maximum`` of its amaxes when the graph used it more than once
    (NaN-propagating, like the record itself).
    """
    groups: dict[tuple, dict] = {}
    for key, (state, fmt, amaxes, params) in _merged_records(rewriters).items():
        groups.setdefault(params, {})[key] = (state, fmt, amaxes)
    for params, group in groups.items():
        _emit_record_group(graph, group, params)


def _merged_records(rewriters: list[GraphRewriter]) -> dict:
    """The forward records of all ``rewriters`` of one graph, one per state:
    key -> (state, fmt, [amax nodes], record_params)."""
    records: dict = {}
    for rw in rewriters:
        for key, (state, fmt, amaxes, params) in rw.records.items():
            if key in records:
                records[key][2].extend(amaxes)
            else:
                records[key] = (state, fmt, list(amaxes), params)
    return records


def _max_of(graph: fx.Graph, amaxes: list[fx.Node]) -> fx.Node:
    amax = amaxes[0]
    for other in amaxes[1:]:
        amax = graph.call_function(torch.maximum, (amax, other))
    return amax


def _emit_record_group(graph: fx.Graph, records: dict, params: tuple) -> None:
    margin, interval, algo, power_of_two = params
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    col = {f: i for i, f in enumerate(DelayedScalingState.OP_FIELDS)}
    with graph.inserting_before(output):
        amaxes = [_max_of(graph, nodes) for _, _, nodes in records.values()]
        lists = [[state[col[f]] for state, _, _ in records.values()]
                 for f in ("amax_history", "scale", "steps", "skipped", "overflows", "pending", "accumulate")]
        fmts = [fmt for _, fmt, _ in records.values()]
        graph.call_function(torch.ops.fp8pass.delayed_record_many_.default,
                            (*lists, amaxes, fmts, margin, interval, algo, power_of_two))


def return_records(graph: fx.Graph, rewriters: list[GraphRewriter]) -> list[tuple[list[fx.Node], str, tuple]]:
    """A higher-order op body's forward records as extra outputs, appended to the tuple it returns;
    returns (state placeholders of the body, format, record_params) per appended output, in order.

    The enclosing graph records them once (:class:`.rewrite_hop.BodyRewriter`): a body recorded
    into its state itself would record again when activation checkpointing recomputes it.
    """
    records = _merged_records(rewriters)
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    with graph.inserting_before(output):
        amaxes = [_max_of(graph, nodes) for _, _, nodes, _ in records.values()]
    output.args = ((*output.args[0], *amaxes),)
    return [(state, fmt, params) for state, fmt, _, params in records.values()]


def finish(gm: fx.GraphModule, rewriters: list[GraphRewriter], emit: bool = True) -> None:
    """Emit the forward records (``emit``; a body returns them instead, :func:`return_records`), erase
    the covered nodes left without users (never anything else), check and regenerate code."""
    if emit:
        emit_records(gm.graph, rewriters)
    covered: set[fx.Node] = set()
    for rw in rewriters:
        covered |= rw.covered
    graph = gm.graph
    changed = True
    while changed:
        changed = False
        for node in reversed(list(graph.nodes)):
            if node in covered and not node.users and node.op in ("call_function", "call_method") \
                    and not facts(node).side_effects:
                graph.erase_node(node)
                covered.discard(node)
                changed = True
    graph.lint()
    gm.recompile()
