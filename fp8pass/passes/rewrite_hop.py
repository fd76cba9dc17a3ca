"""Threading a rewritten higher-order op body (:mod:`.hops`) into its enclosing graph.

A body (activation checkpointing, ``wrap``) is rewritten by the same rewriters as a top-level graph
(:func:`.rewrite.apply_plan`), with two differences the recomputation of activation checkpointing
needs:

* state inputs: the body's state placeholders become extra operands of the op call, bound to the
  enclosing graph's state placeholders of the same weights (made here, so a graph's state inputs
  stay one list). The input and weight states enter as copies taken before the call
  (``fp8pass::state_snapshot``, tagged ``CheckpointPolicy.MUST_SAVE``): the enclosing graph records
  into the live states at its end, and a recomputation in backward then still casts with the
  forward's scales (eager ``checkpoint`` re-runs the body on its saved operands; under AOT autograd,
  aot_eager and Inductor, a recomputed cast reads the saved copy, never the updated input: a plain
  ``clone`` was recomputed from the input by the partitioner, and Inductor removes it outright).
  The grad_output state enters live: the backward records ``dy``'s amax into it, once (a
  recomputation runs the forward only).
* records: the body returns its forward amaxes as extra outputs (:func:`.rewrite_base.return_records`)
  and the enclosing graph records them with its own, once per step, however often the body runs.
"""

from __future__ import annotations

import operator

from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from . import hops
from .plan import BodyPlan
from .rewrite_base import GraphRewriter, StateInput

__all__ = ["BodyRewriter"]

_LIVE_ROLES = ("grad_output",)  # states the body's backward records into: passed live, not cloned


class BodyRewriter(GraphRewriter):
    """The enclosing graph's side of rewritten bodies: state operands in, amax outputs recorded.

    Args:
        gm, cfg: as :class:`.rewrite_base.GraphRewriter`.
        siblings: the graph's rewriters that ran before: a weight used both in the graph and in a
            body (or in two bodies) gets one set of state inputs, and its amaxes one record.
    """

    def __init__(self, gm: fx.GraphModule, cfg, siblings=()):
        super().__init__(gm, cfg)
        for rw in siblings:
            self._state_nodes.update(rw._state_nodes)

    def _outer_state(self, weight: fx.Node, s: StateInput, body_extra: list[StateInput]) -> fx.Node:
        """The enclosing graph's placeholder for the body's state input ``s`` (of weight ``weight``),
        made with the body site's Config (a rule's recipe makes its own state) and as many fields as
        the body has of that state (a stochastic-rounding stream has one, a scaling state all)."""
        fields = 1 + max(o.field for o in body_extra
                         if (o.weight_pos, o.role, o.kind) == (s.weight_pos, s.role, s.kind))
        saved = self.cfg
        self.cfg = s.config if s.config is not None else self.cfg
        try:
            return self.state_placeholders(weight, s.role, s.kind, fields)[s.field]
        finally:
            self.cfg = saved

    def thread(self, site: BodyPlan, body_extra: list[StateInput],
               returned: list[tuple[list[fx.Node], str, tuple]]) -> None:
        """Bind a rewritten body's state placeholders and record its returned amaxes.

        Args:
            site: the body and its plan.
            body_extra: the body's state placeholders (its last ``len(body_extra)``), as StateInputs
                whose ``weight_pos`` is the weight's placeholder position in the body.
            returned: per amax output appended to the body's tuple (in order): the body's state
                placeholders it records into, the format and the record's recipe parameters.
        """
        call = site.body.node
        body_phs = [n for n in site.body.gm.graph.nodes if n.op == "placeholder"]
        state_phs = body_phs[len(body_phs) - len(body_extra):]
        bound = hops.operands(call)
        live: dict[fx.Node, fx.Node] = {}
        for ph, s in zip(state_phs, body_extra):
            weight = bound[s.weight_pos]
            if not (isinstance(weight, fx.Node) and weight.op == "placeholder" and weight in self.pos):
                raise RuntimeError(f"fp8pass: a rewritten {site.body.kind} body's weight {weight} is not an input "
                                   f"of the enclosing graph (please report this graph)")
            live[ph] = self._outer_state(weight, s, body_extra)
        copied = [i for i, s in enumerate(body_extra) if s.role not in _LIVE_ROLES]
        values = [live[ph] for ph in state_phs]
        if copied:
            with self.graph.inserting_before(call):
                snapshot = self.graph.call_function(self.ops.state_snapshot.default,
                                                    ([values[i] for i in copied],))
                # saved for backward, never recomputed there (a recomputation would read the inputs
                # after this graph's records); the tag reaches AOT autograd through the node meta
                snapshot.meta["recompute"] = CheckpointPolicy.MUST_SAVE
                for k, i in enumerate(copied):
                    values[i] = self.graph.call_function(operator.getitem, (snapshot, k))
                    values[i].meta["recompute"] = CheckpointPolicy.MUST_SAVE
        hops.append_operands(call, values)
        out = next(n for n in reversed(site.body.gm.graph.nodes) if n.op == "output")
        first = len(out.args[0]) - len(returned)
        with self.graph.inserting_after(call):
            for i, (state, fmt, params) in reversed(list(enumerate(returned))):
                amax = self.graph.call_function(operator.getitem, (call, first + i))
                self.record([live[n] for n in state], amax, fmt, params)
