"""The first pass over a Dynamo graph: the facts patterns, policy and rewriters read, once per node.

Every node gets a :class:`NodeFacts` in ``node.meta["fp8pass"]``: its example (fake) value, the
absolute FQN of the parameter a placeholder carries (and whether FSDP2 may rebuild that parameter
between forward and backward), the absolute FQN of the module whose forward made a call, and whether
the node has side effects. Later passes only read these facts.

Side effects decide what a rewrite may touch: a node that mutates a tensor (in-place methods and
functions, ``out=``, ``setitem``), draws random numbers, or changes autograd / vmap / functorch /
profiler state is never part of a match and is never removed, whether or not its result is used.
The classification is deliberately conservative: an unknown kind of node counts as having effects.
"""

from __future__ import annotations

import dataclasses
import operator
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from . import hops
from .names import FrameNames

__all__ = ["NodeFacts", "annotate", "facts", "has_side_effects", "dtensor_call", "relative_param_names", "value_dtype",
           "weight_may_be_regathered", "fsdp_param_groups", "META_KEY"]

META_KEY = "fp8pass"


@dataclass(frozen=True)
class NodeFacts:
    """What the passes know about one node.

    Attributes:
        value: the example (fake) tensor Dynamo recorded, or None.
        weight_fqn: for a placeholder that is a parameter, its absolute FQN; else None.
        owner: absolute FQN of the innermost module whose forward made this call ('' at the root).
        side_effects: the node mutates state or draws random numbers: keep it, never match it.
        regathered: for a placeholder, :func:`weight_may_be_regathered` of its real tensor.
        dtensor_call: the DTensor conversion the node is, in either traced form (:func:`dtensor_call`).
    """

    value: Any
    weight_fqn: str | None
    owner: str
    side_effects: bool
    regathered: bool = False
    dtensor_call: str | None = None


def fsdp_param_groups(state) -> list:
    """The FSDP2 parameter groups of one module's FSDP state."""
    groups = getattr(state, "_fsdp_param_groups", None)  # torch >= 2.12: a list
    if groups is None:  # torch 2.11: one group or None
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return groups


def weight_may_be_regathered(weight) -> bool:
    """Whether ``weight``'s storage may be rewritten between forward and backward: it is a parameter
    managed by FSDP2 (``fully_shard``), which frees the unsharded parameter after forward and gathers
    it again into the same storage for backward, on any number of ranks (one included). With an
    all-gather extension (the FP8 all-gather) the gathered values come from a fresh cast, possibly with
    a newer scale, written in place (the version counter moves). An op that recasts the weight in
    backward (``fp8_linear_precast``, ``swiglu_down`` with ``recast_weight``) needs the forward's
    values; for such weights the per-linear ``fp8_linear`` (weight codes saved from forward) is used
    and ``swiglu_down`` keeps ``W_down``'s codes."""
    if not isinstance(weight, torch.Tensor) or "torch.distributed.fsdp" not in sys.modules:
        return False
    from torch.distributed._composable_state import _module_state_mapping
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    for ref in list(_module_state_mapping.values()):
        state = ref()
        if not isinstance(state, FSDPState):
            continue
        for group in fsdp_param_groups(state):
            for fp in group.fsdp_params:
                if weight is fp.sharded_param or weight is getattr(fp, "_unsharded_param", None):
                    return True
    return False


_INPLACE_OPERATORS = {
    operator.setitem, operator.delitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
    operator.ifloordiv, operator.imod, operator.ipow, operator.imatmul, operator.iand, operator.ior,
    operator.ixor, operator.ilshift, operator.irshift,
}

# random numbers: removing an unused draw would shift every later draw
_RANDOM_NAMES = {
    "rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "bernoulli",
    "multinomial", "normal", "poisson", "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
    "feature_alpha_dropout", "rrelu", "native_dropout", "uniform", "exponential", "geometric", "cauchy",
    "log_normal", "manual_seed", "seed", "set_rng_state", "get_rng_state",
}

# global state: autograd, vmap/functorch levels, profiler ranges, assertions
_STATEFUL_MODULES = ("torch._C._functorch", "torch._functorch", "torch.autograd", "torch._C._autograd",
                     "torch.profiler", "torch.autograd.profiler", "torch._C._profiler", "torch.cuda",
                     "torch.distributed", "torch._dynamo")
_STATEFUL_NAMES = {"_assert", "_assert_async", "_check", "_check_is_size", "_assert_scalar", "_set_grad_enabled",
                   "set_grad_enabled", "_enter_autocast", "_exit_autocast", "print", "_record_function_enter",
                   "_record_function_exit", "_record_function_enter_new"}


def _from_local_targets() -> tuple:
    if not torch.distributed.is_available():
        return ()
    from torch.distributed.tensor import DTensor

    return (DTensor.from_local,)


# ``DTensor.from_local``: tensor parallel's module hooks declare a local tensor a DTensor with it
_FROM_LOCAL = _from_local_targets()
# the DTensor conversions of tensor parallel's module hooks, as methods (``from_local`` is a function)
_DTENSOR_METHODS = ("redistribute", "to_local")
# Dynamo's wrappers of those calls, by name: ``"prim " + from_local.__name__``, ``prim_redistribute``,
# ``prim_to_local`` (torch/_dynamo/variables/torch.py and tensor.py)
_DTENSOR_WRAPPERS = {"prim from_local": "from_local", "prim_redistribute": "redistribute", "prim_to_local": "to_local"}


def dtensor_call(node: fx.Node) -> str | None:
    """Which DTensor conversion ``node`` is, "from_local", "redistribute" or "to_local"; None if none.

    Dynamo records each in one of two forms: the call itself (``DTensor.from_local(x, mesh, placements,
    run_check=False)``, the methods ``x.redistribute(placements=...)`` and ``x.to_local()``; torch 2.13),
    or a call of a wrapper function it makes for that one call site, whose closure holds the non-tensor
    arguments, so the node's only argument is the tensor (``prim from_local(x)``,
    ``prim_redistribute(x)``, ``prim_to_local(x)``; torch 2.11). The layouts are in both forms the
    example values' (a DTensor's ``device_mesh`` and ``placements``).
    """
    if node.op == "call_method":
        return node.target if node.target in _DTENSOR_METHODS else None
    if node.op != "call_function":
        return None
    if node.target in _FROM_LOCAL:
        return "from_local"
    name = getattr(node.target, "__name__", None)
    if name in _DTENSOR_WRAPPERS and (getattr(node.target, "__module__", None) or "").startswith("torch._dynamo"):
        return _DTENSOR_WRAPPERS[name]
    return None


def _runs_check(node: fx.Node) -> bool:
    """Whether a ``from_local`` node runs its cross-rank check (``run_check=True``: a collective).
    A Dynamo wrapper keeps the keyword arguments in its closure (``kwargs_as_value``); where they cannot
    be read there, the call counts as running it."""
    if node.target in _FROM_LOCAL:
        return bool(node.kwargs.get("run_check"))
    code, cells = getattr(node.target, "__code__", None), getattr(node.target, "__closure__", None) or ()
    free = dict(zip(code.co_freevars, cells)) if code is not None else {}
    try:
        baked = free["kwargs_as_value"].cell_contents
    except (KeyError, ValueError):  # no such variable, or an empty cell
        return True
    return not isinstance(baked, dict) or bool(baked.get("run_check"))


def _name_of(target) -> str:
    return getattr(target, "__name__", None) or str(target)


def has_side_effects(node: fx.Node) -> bool:
    """Whether ``node`` must stay in the graph whatever the rewrite does (see the module doc)."""
    if node.op in ("placeholder", "get_attr"):
        return False
    if node.op in ("output", "call_module"):
        return True
    if "out" in node.kwargs:
        return True
    target = node.target
    if node.op == "call_method":
        name = str(target)
        if name.endswith("_") and not name.startswith("__"):
            return True  # tensor.add_(), .copy_(), .scatter_(), .masked_fill_(), .uniform_() ...
        return name in _RANDOM_NAMES or name in ("record_stream", "set_", "resize_", "share_memory_")
    if node.op != "call_function":
        return True
    if target in _INPLACE_OPERATORS:
        return True
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        overload = target if isinstance(target, torch._ops.OpOverload) else None
        schema = overload._schema if overload is not None else None
        if schema is not None and (schema.is_mutable or torch.Tag.nondeterministic_seeded in overload.tags):
            return True
        if overload is None:
            packet = target
            if any(getattr(packet, o)._schema.is_mutable for o in packet.overloads()):
                return True
    name = _name_of(target)
    if name.endswith("_") and not name.startswith("__"):
        return True  # torch.relu_, torch.nn.init.*_
    if name in _RANDOM_NAMES or name in _STATEFUL_NAMES:
        return True
    module = getattr(target, "__module__", None) or ""
    conversion = dtensor_call(node)
    if conversion == "from_local":  # without run_check it wraps a tensor (no collective): a TP hook's form
        return _runs_check(node)
    if conversion is not None:  # Dynamo's redistribute / to_local wrapper: as the methods, no effects
        return False
    if any(module == m or module.startswith(m + ".") for m in _STATEFUL_MODULES):
        return True
    try:
        return bool(node.is_impure())
    except Exception:  # noqa: BLE001 - an unknown target: be conservative
        return True


def _relative_owner(node: fx.Node) -> str:
    """The innermost ``nn_module_stack`` path, relative to the frame's root."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    # "L['self'].model.layers.0.mlp" / "L['args'][0].lm_head": drop the root local
    if "]." in path:
        return path.split("].", 1)[1] if path.startswith("L[") else path
    return "" if path.startswith("L[") else path


def _source(node: fx.Node):
    src = getattr(node, "_dynamo_source", None)
    if src is None:
        src = getattr(node.meta.get("grapharg"), "source", None)
    return src


def _source_fqn(node: fx.Node, value, real) -> str | None:
    """Parameter FQN from Dynamo's source chain (relative to the frame root), None if no parameter.

    The chain reads ``L['self']._modules['layers']._modules['0']..._parameters['weight']``; the FQN is
    the ``_modules`` / ``_parameters`` keys and attribute names along it.
    """
    src = _source(node)
    parts: list[str] = []
    is_param = isinstance(value, torch.nn.Parameter) or isinstance(real, torch.nn.Parameter)
    first = True
    while src is not None:
        member = getattr(src, "member", None)
        index = getattr(src, "index", None)
        base = getattr(src, "base", None)
        if index is not None and base is not None and getattr(base, "member", None) in ("_modules", "_parameters"):
            if first and base.member == "_parameters":
                is_param = True
            parts.append(str(index))
            src = base.base
        elif member is not None and member not in ("_modules", "_parameters") and base is not None:
            parts.append(str(member))  # attribute access (``self.layers``) on a module
            src = base
        else:
            src = base
        first = False
    if not is_param:
        return None
    return ".".join(reversed(parts)) if parts else node.name


def _compute(node: fx.Node, names: FrameNames | None, real: Any) -> NodeFacts:
    value = node.meta.get("example_value", node.meta.get("val"))
    weight = None
    if node.op == "placeholder":
        if names is not None and isinstance(real, torch.nn.Parameter) and id(real) in names.params:
            weight = names.params[id(real)]
        else:
            relative = _source_fqn(node, value, real)
            if relative is not None and names is not None and names.prefix and relative != node.name:
                relative = f"{names.prefix}.{relative}"
            weight = relative
    owner = _relative_owner(node)
    if names is not None:
        owner = names.module(owner)
    return NodeFacts(value, weight, owner, has_side_effects(node), weight_may_be_regathered(real), dtensor_call(node))


def annotate(graph: fx.Graph, names: FrameNames | None = None, example_inputs: list | None = None) -> None:
    """Record :class:`NodeFacts` on every node of ``graph`` (the first pass; later ones read them).

    Args:
        graph: Dynamo's torch-level graph.
        names: absolute names of the frame (``names.frame_names``); None keeps Dynamo's paths.
        example_inputs: the real inputs of the graph's placeholders, in order (parameters among them
            are named by identity); None when only fake values are known (explain on captured graphs).
    """
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    reals = dict(zip(placeholders, example_inputs or []))
    for node in graph.nodes:
        node.meta[META_KEY] = _compute(node, names, reals.get(node))
    _annotate_bodies(graph, names)


def _annotate_bodies(graph: fx.Graph, names: FrameNames | None) -> None:
    """Higher-order ops' bodies (:mod:`.hops`): their nodes as any graph's; a placeholder bound to a
    parameter of the enclosing graph is that parameter (Dynamo gives body placeholders no source)."""
    for body in hops.bodies(graph):
        for node in body.gm.graph.nodes:
            node.meta[META_KEY] = _compute(node, names, None)
        placeholders = [n for n in body.gm.graph.nodes if n.op == "placeholder"]
        for ph, outer in zip(placeholders, hops.operands(body.node)):
            if isinstance(outer, fx.Node) and outer.op == "placeholder" and facts(outer).weight_fqn is not None:
                ph.meta[META_KEY] = dataclasses.replace(facts(ph), weight_fqn=facts(outer).weight_fqn,
                                                        regathered=facts(outer).regathered)
        _annotate_bodies(body.gm.graph, names)


def facts(node: fx.Node) -> NodeFacts:
    """The node's facts; computed on the spot for a node the first pass did not see."""
    got = node.meta.get(META_KEY)
    if got is None:
        got = _compute(node, None, None)
        node.meta[META_KEY] = got
    return got


def value_dtype(node: fx.Node) -> torch.dtype | None:
    """The dtype of the tensor ``node`` produced when Dynamo traced it (None if unknown).

    A rewritten op must produce what the replaced node did: under autocast a linear's output has the
    autocast dtype, not its input's (Dynamo guards on the autocast state, so it is fixed per graph).
    """
    value = facts(node).value
    return value.dtype if isinstance(value, torch.Tensor) else None


def relative_param_names(graph: fx.Graph, example_inputs: list) -> dict[int, str]:
    """Input position -> parameter path from the frame root (Dynamo's source), for the parameters."""
    out = {}
    for pos, (node, real) in enumerate(zip([n for n in graph.nodes if n.op == "placeholder"], example_inputs)):
        if isinstance(real, torch.nn.Parameter):
            rel = _source_fqn(node, node.meta.get("example_value"), real)
            if rel is not None and rel != node.name:
                out[pos] = rel
    return out
