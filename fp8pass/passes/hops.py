"""Higher-order ops whose bodies hold user code: where their bodies are and what binds to them.

Dynamo traces ``torch.utils.checkpoint.checkpoint`` (``use_reentrant`` True or False alike, with or
without a selective-checkpointing ``context_fn``; HF ``gradient_checkpointing_enable()`` calls it)
into ``torch.ops.higher_order.tag_activation_checkpoint(body, *operands, **kwargs)`` and
``torch._higher_order_ops.wrap.wrap(fn, ...)`` into ``wrap(body, *operands)``: the body is a
GraphModule attribute read by a ``get_attr`` node, its placeholders bound to the operands in order
(the parameters it uses among them), and it returns a tuple the outer graph indexes. These bodies are
planned and rewritten like a top-level graph (:func:`.rewrite.apply_plan`).

``cond(pred, true_fn, false_fn, operands)`` and ``while_loop(cond_fn, body_fn, carried, additional)``
bodies are planned but only listed: the delayed-scaling records would have to leave every branch
(or every iteration) with the same outputs, so their matmuls are kept in high precision, each with
the reason. ``flex_attention``'s score and mask functions are per-score scalar code, never walked;
the op itself is attention (listed by the plan like SDPA).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

__all__ = ["Body", "bodies", "operands", "append_operands", "returns_tuple", "is_flex_attention", "REWRITTEN", "LISTED"]

_HO = torch.ops.higher_order
# kind of a higher-order op whose body is rewritten, by op
REWRITTEN = {_HO.tag_activation_checkpoint: "activation checkpointing", _HO.wrap: "wrap"}
# kind of a higher-order op whose bodies are only listed, by op
LISTED = {_HO.cond: "torch.cond", _HO.while_loop: "torch.while_loop"}


@dataclass(frozen=True)
class Body:
    """One body of a higher-order op call.

    Attributes:
        node: the higher-order op call in the enclosing graph.
        attr: the body's attribute name on the enclosing GraphModule.
        gm: the body (the enclosing GraphModule's attribute).
        kind: "activation checkpointing", "wrap", "torch.cond", "torch.while_loop".
        rewritten: whether the body is rewritten (else its matmuls are listed as kept).
    """

    node: fx.Node
    attr: str
    gm: fx.GraphModule
    kind: str

    @property
    def rewritten(self) -> bool:
        return self.kind in REWRITTEN.values()


def _attr(node) -> str | None:
    return node.target if isinstance(node, fx.Node) and node.op == "get_attr" else None


def _body_attrs(node: fx.Node) -> list[str]:
    """The attribute names of ``node``'s bodies (empty for any other node)."""
    if node.op != "call_function":
        return []
    if node.target in REWRITTEN:
        return [a for a in (_attr(node.args[0]),) if a]
    if node.target is _HO.cond:
        return [a for a in (_attr(node.args[1]), _attr(node.args[2])) if a]
    if node.target is _HO.while_loop:
        return [a for a in (_attr(node.args[0]), _attr(node.args[1])) if a]
    return []


def bodies(graph: fx.Graph) -> list[Body]:
    """The bodies of the higher-order op calls in ``graph`` that carry user code, in graph order."""
    owner = graph.owning_module
    out = []
    for node in graph.nodes:
        for attr in _body_attrs(node):
            gm = getattr(owner, attr, None) if owner is not None else None
            if isinstance(gm, fx.GraphModule):
                out.append(Body(node, attr, gm, REWRITTEN.get(node.target) or LISTED[node.target]))
    return out


def operands(node: fx.Node) -> list:
    """The enclosing graph's values bound to a body's placeholders, in order."""
    if node.target in REWRITTEN:
        return list(node.args[1:])
    if node.target is _HO.cond:
        return list(node.args[3])
    if node.target is _HO.while_loop:
        return list(node.args[2]) + list(node.args[3] if len(node.args) > 3 else ())
    raise ValueError(f"{node.target} is not a higher-order op with a body fp8pass walks")


def append_operands(node: fx.Node, values: list) -> None:
    """Bind ``values`` to a rewritten body's placeholders added after its own."""
    if node.target not in REWRITTEN:
        raise ValueError(f"only {', '.join(REWRITTEN.values())} bodies are rewritten, not {node.target}")
    node.args = (*node.args, *values)


def returns_tuple(gm: fx.GraphModule) -> bool:
    """Whether the body returns a tuple (or list) the enclosing graph indexes: outputs can be appended."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return isinstance(out.args[0], (tuple, list))


def is_flex_attention(node: fx.Node) -> bool:
    flex = getattr(_HO, "flex_attention", None)
    return flex is not None and node.op == "call_function" and node.target is flex
