"""A small declarative pattern language for Dynamo's torch-level FX graphs.

Patterns are trees of :class:`Op` (a call: function, method name or operator), :class:`Bind`
(name the node a sub-pattern matched; a second ``Bind`` of the same name must meet the same node,
which is how ``g * sigmoid(g)`` says "the same g") and :class:`OneOf` (alternatives). Matching is
a generator of :class:`Match` objects, so alternatives and commutative operands backtrack.

Why not ``torch.fx.subgraph_rewriter``: it matches one traced form at a time, cannot say "either
operand order", "this call or that method" or "the same node twice", and the real model code we
meet writes the same SwiGLU in a dozen textual forms. Here a new form is one more alternative.
"""

from __future__ import annotations

import abc
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import fx

from .annotate import facts

__all__ = [
    "Match", "Pattern", "Op", "Bind", "Tag", "OneOf", "Where", "Const", "ANY",
    "param_fqn", "weight_fqn", "caller_fqn", "is_param_placeholder", "example_value", "CASTS", "is_cast",
    "DTensorCall", "FROM_LOCAL", "REDISTRIBUTE", "TO_LOCAL",
]


@dataclass
class Match:
    """Bindings of one successful match, and the call nodes it covers (root first)."""

    bindings: dict[str, Any] = field(default_factory=dict)
    nodes: list[fx.Node] = field(default_factory=list)

    def extend(self, name: str | None = None, value: Any = None, node: fx.Node | None = None) -> "Match":
        b = dict(self.bindings)
        if name is not None:
            b[name] = value
        return Match(b, self.nodes + ([node] if node is not None else []))

    def __getitem__(self, name: str) -> Any:
        return self.bindings[name]

    def get(self, name: str, default=None) -> Any:
        return self.bindings.get(name, default)


class Pattern(abc.ABC):
    """A pattern: ``match(value, m)`` yields every extension of ``m`` under which ``value`` matches."""

    @abc.abstractmethod
    def match(self, value: Any, m: Match) -> Iterator[Match]: ...

    def __call__(self, node: Any) -> Iterator[Match]:
        return self.match(node, Match())


class _Any(Pattern):
    """Matches any argument (node or literal) and binds nothing."""

    def match(self, value, m):
        yield m


ANY = _Any()


@dataclass
class Const(Pattern):
    """A literal argument equal to one of ``values``."""

    values: tuple

    def match(self, value, m):
        if not isinstance(value, fx.Node) and value in self.values:
            yield m


@dataclass
class Where(Pattern):
    """Any node for which ``pred(node)`` holds."""

    pred: Callable[[fx.Node], bool]

    def match(self, value, m):
        if isinstance(value, fx.Node) and self.pred(value):
            yield m


@dataclass
class Bind(Pattern):
    """Match ``pattern`` and bind the node (or literal) to ``name``; a bound name must recur equal:
    the same node, or the same cast of the same node (Dynamo does not merge ``x.bfloat16()`` written
    twice, as torchtitan's experts do for gate and up); such a twin joins the match's nodes."""

    name: str
    pattern: Pattern = ANY

    def match(self, value, m):
        if self.name in m.bindings:
            bound = m.bindings[self.name]
            if bound is value:
                yield m
            elif _same_cast(bound, value):
                yield m.extend(node=value)
            return
        for m2 in self.pattern.match(value, m):
            yield m2.extend(self.name, value)


@dataclass
class Tag(Pattern):
    """Match ``pattern`` and bind the constant ``value`` to ``name`` (which alternative matched)."""

    name: str
    value: Any
    pattern: Pattern

    def match(self, value, m):
        for m2 in self.pattern.match(value, m):
            yield m2.extend(self.name, self.value)


class OneOf(Pattern):
    """The first, then the second, ... alternative (all are tried, in order)."""

    def __init__(self, *alternatives: Pattern):
        self.alternatives = alternatives

    def match(self, value, m):
        for alt in self.alternatives:
            yield from alt.match(value, m)


# dtype casts and contiguity calls: what real code puts around a weight or an input of a matmul
CASTS = ("to", "type", "type_as", "float", "bfloat16", "half", "double", "contiguous")


def is_cast(node: Any) -> bool:
    """A dtype cast or contiguity call (:data:`CASTS`, no side effects) of a tensor node that keeps its
    shape and device: the same values, possibly in another floating dtype (a device move, a reshape by
    ``type``/``to`` or a cast to a non-float dtype is not one)."""
    if not (is_call(node, CASTS) and node.op == "call_method" and node.args and isinstance(node.args[0], fx.Node)):
        return False
    out, inp = example_value(node), example_value(node.args[0])
    return (isinstance(out, torch.Tensor) and isinstance(inp, torch.Tensor) and out.shape == inp.shape
            and out.device == inp.device and out.dtype.is_floating_point and inp.dtype.is_floating_point)


def _same_cast(a: Any, b: Any) -> bool:
    """``a`` and ``b`` are the same value: the same node, or the same cast call of the same value
    (or the same ``DTensor.from_local`` call: a TP plan's hook on each projection makes its own)."""
    if a is b:
        return True
    if _same_from_local(a, b):
        return True
    return (is_cast(a) and is_cast(b) and a.target == b.target and len(a.args) == len(b.args)
            and _same_cast(a.args[0], b.args[0]) and a.args[1:] == b.args[1:] and a.kwargs == b.kwargs
            and example_value(a).dtype == example_value(b).dtype)


def _same_from_local(a: Any, b: Any) -> bool:
    """Two ``from_local`` calls of one local tensor that declare the same DTensor. Compared by their
    example values (mesh, placements, shape, stride), not their arguments: a Dynamo wrapper of the call
    (:func:`~.annotate.dtensor_call`) is a new function per call site with the arguments in its closure."""
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
        return False
    if facts(a).dtensor_call != "from_local" or facts(b).dtensor_call != "from_local" or a.args[:1] != b.args[:1]:
        return False
    declared = _declared(a)
    return declared is not None and declared == _declared(b)


def _declared(node: fx.Node) -> tuple | None:
    value = example_value(node)
    if not hasattr(value, "placements") or not hasattr(value, "device_mesh"):
        return None
    return value.device_mesh, tuple(value.placements), tuple(value.shape), tuple(value.stride())


@dataclass(frozen=True)
class DTensorCall:
    """An :class:`Op` target: a DTensor conversion ("from_local", "redistribute" or "to_local") in
    whichever form Dynamo recorded it, the call itself or its wrapper (:func:`~.annotate.dtensor_call`)."""

    name: str


# tensor parallel's module hooks: a local tensor declared a DTensor (RowwiseParallel's input), a DTensor
# redistributed and made a local tensor (ColwiseParallel's output)
FROM_LOCAL, REDISTRIBUTE, TO_LOCAL = DTensorCall("from_local"), DTensorCall("redistribute"), DTensorCall("to_local")


def _target_ok(node: fx.Node, targets: tuple) -> bool:
    got = facts(node)
    if got.side_effects:  # an in-place / random / stateful call is never part of a match
        return False
    if got.dtensor_call is not None and DTensorCall(got.dtensor_call) in targets:
        return True
    if node.op in ("call_function", "call_method"):
        return node.target in targets  # method names are strings in ``targets``
    return False


class Op(Pattern):
    """A call node whose target is one of ``targets`` (callables, or method names as strings).

    Args:
        targets: a callable / method name or a tuple of them.
        *args: patterns for the positional arguments (literals are wrapped in :class:`Const`);
            extra positional arguments of the node fail the match unless ``varargs``.
        kwargs: ``name=(position, default, pattern)`` checks an argument that may come
            positionally at ``position`` or by keyword, with ``default`` when absent.
        commutative: also try the two positional arguments swapped (``a * b``).
        varargs: accept nodes with more positional arguments than patterns.
    """

    def __init__(self, targets, *args, commutative=False, varargs=False, **kwargs):
        self.targets = targets if isinstance(targets, tuple) else (targets,)
        self.args = tuple(a if isinstance(a, Pattern) else Const((a,)) for a in args)
        self.kwargs = kwargs
        self.commutative = commutative
        self.varargs = varargs

    def _arg(self, node, name, spec):
        pos, default, _ = spec
        if pos is not None and len(node.args) > pos:
            return node.args[pos]
        return node.kwargs.get(name, default)

    def match(self, value, m):
        if not isinstance(value, fx.Node) or not _target_ok(value, self.targets):
            return
        n_pos = len(self.args)
        extra_pos = [p for p, _, _ in self.kwargs.values() if p is not None]
        limit = max([n_pos] + [p + 1 for p in extra_pos])
        if len(value.args) > limit and not self.varargs:
            return
        if len(value.args) < n_pos:
            return
        orders = [tuple(value.args[:n_pos])]
        if self.commutative and n_pos == 2:
            orders.append((value.args[1], value.args[0]))
        for args in orders:
            yield from self._match_args(value, list(zip(self.args, args)), m.extend(node=value))

    def _match_args(self, node, pairs, m):
        if not pairs:
            yield from self._match_kwargs(node, list(self.kwargs.items()), m)
            return
        (pat, arg), rest = pairs[0], pairs[1:]
        for m2 in pat.match(arg, m):
            yield from self._match_args(node, rest, m2)

    def _match_kwargs(self, node, items, m):
        if not items:
            yield m
            return
        (name, spec), rest = items[0], items[1:]
        pat = spec[2] if isinstance(spec[2], Pattern) else Const((spec[2],))
        for m2 in pat.match(self._arg(node, name, spec), m):
            yield from self._match_kwargs(node, rest, m2)


# ---- facts about Dynamo's graph that patterns and the policy need (passes/annotate.py) -------

def example_value(node: Any):
    """The fake tensor Dynamo recorded for ``node`` (None for literals / missing)."""
    return facts(node).value if isinstance(node, fx.Node) else None


def param_fqn(node: fx.Node) -> str | None:
    """Absolute parameter FQN (``model.layers.0.mlp.gate_proj.weight``) of a placeholder, else None."""
    return facts(node).weight_fqn if node.op == "placeholder" else None


def weight_fqn(node: fx.Node) -> str | None:
    """FQN of the parameter a weight operand is: the placeholder's own, or for one expert's matrix of
    a 3-D expert weight (``W[e]``, ``W.select(0, e)``, e a constant) the expert weight's; else None."""
    if node.op == "placeholder":
        return param_fqn(node)
    if node.op in ("call_function", "call_method") and node.args and isinstance(node.args[0], fx.Node):
        base = node.args[0]
        ev = example_value(base)
        one_expert = (node.target is operator.getitem and isinstance(node.args[1], int)) or (
            node.target in ("select", torch.select) and node.args[1:] and node.args[1] == 0)
        if one_expert and base.op == "placeholder" and isinstance(ev, torch.Tensor) and ev.dim() == 3:
            return param_fqn(base)
    return None


def is_param_placeholder(node: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "placeholder" and param_fqn(node) is not None


def caller_fqn(node: fx.Node) -> str:
    """Absolute FQN of the innermost module whose forward made this call ('' at the root)."""
    return facts(node).owner


def is_call(node: Any, targets) -> bool:
    return isinstance(node, fx.Node) and _target_ok(node, targets if isinstance(targets, tuple) else (targets,))


MUL = (operator.mul, torch.mul, "mul")
