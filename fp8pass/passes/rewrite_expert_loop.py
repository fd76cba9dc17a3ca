"""The per-expert loop: GLUs and linears over single experts ``W[e]`` of 3-D expert weights, in FP8.

A Python loop over ``range(E)`` (dense or masked routing, fixed-capacity slots) leaves one call per
expert in the graph, its weight ``W[e]`` / ``W.select(0, e)`` a view of the stacked parameter with a
constant ``e``. Each becomes the dense op (``fp8_linear``; an expert GLU ``fp8_linear`` +
``swiglu_down`` with Smooth-SwiGLU, as :class:`~.rewrite_fp8.FP8Rewriter` rewrites any GLU) on that
view, so autograd takes the gradient to the stacked parameter through the select.

Scaling state: expert ``e`` of ``W`` casts with row ``e`` of the per-expert state of ``W``
(``runtime.grouped_state_for``: history [E, H], scale [E], ...; ``StateInput.kind == "experts"``,
the same state the grouped ops use, so checkpoints, ``scaling_state_dict`` and the amax reduction
see it as any expert stack's). The ops get the rows as views of the state placeholders; their
backward records ``grad_output`` into the row in place. The forward amaxes of every expert of ``W``
go into the graph's batched record as one [E] vector (``0`` for an expert the graph does not call,
as the grouped ops record an expert that got no rows; the max when it is called more than once).
"""

from __future__ import annotations

import torch
from torch import fx

from ..numerics import DelayedScalingState
from .matcher import example_value
from .plan import Plan
from .rewrite_base import STATE_FIELDS, record_params
from .rewrite_fp8 import FP8Rewriter
from .rewrite_grouped import EXPERTS_KIND

__all__ = ["ExpertLoopRewriter"]

# per-state flags read whole by every expert (0-d in a stacked state too)
_SHARED_FIELDS = {"guard", "accumulate"}


class ExpertLoopRewriter(FP8Rewriter):
    """``Plan.loop_glus`` / ``Plan.loop_linears`` in FP8, one scaling state per (expert weight, expert)."""

    # each expert casts its own input with its own state (the shared input cast keys on one state)
    share_input_casts = False

    def __init__(self, gm: fx.GraphModule, cfg):
        super().__init__(gm, cfg)
        self.slices: dict[fx.Node, tuple[fx.Node, int]] = {}   # W[e] node -> (W placeholder, e)
        self._rows: dict[tuple, list[fx.Node]] = {}           # (W, role, e) -> row views of the state
        self._row_of: dict[tuple[int, ...], tuple[list[fx.Node], fx.Node, int]] = {}  # row key -> (stack state, W, e)
        # stack state key -> (stack state, W, fmt, {e: [amax nodes]}, record_params of its site's recipe)
        self._loop_records: dict[tuple[int, ...], tuple[list[fx.Node], fx.Node, str, dict[int, list[fx.Node]],
                                                        tuple]] = {}

    def state(self, w: fx.Node, role: str, kind: str = "linear") -> list[fx.Node]:
        """Row ``e`` of ``W``'s per-expert state for ``w = W[e]``; a plain weight's own state otherwise."""
        if w not in self.slices or not self.delayed:
            return super().state(w, role, kind)
        stack, e = self.slices[w]
        key = (stack, role, e)
        if key not in self._rows:
            full = self.state_placeholders(stack, role, EXPERTS_KIND, STATE_FIELDS)
            # after every placeholder (later state placeholders go after the last placeholder)
            first = next(n for n in self.graph.nodes if n.op != "placeholder")
            rows = []
            with self.graph.inserting_before(first):
                for name, t in zip(DelayedScalingState.OP_FIELDS, full):
                    rows.append(t if name in _SHARED_FIELDS else self.graph.call_method("select", (t, 0, e)))
            self._rows[key] = rows
            self._row_of[tuple(id(n) for n in rows)] = (full, stack, e)
        return self._rows[key]

    def sr_stream(self, w: fx.Node) -> fx.Node | None:
        """The expert stack's one stream for ``w = W[e]`` (each expert's backward draws from it in turn)."""
        return super().sr_stream(self.slices[w][0] if w in self.slices else w)

    def record(self, state: list[fx.Node], amax: fx.Node, fmt: str, params: tuple | None = None) -> None:
        """A row's forward amax waits for its expert stack's [E] record (:meth:`_record_stacks`)."""
        row = self._row_of.get(tuple(id(n) for n in state)) if state else None
        if row is None:
            return super().record(state, amax, fmt, params)
        if fmt == "identity":
            return
        full, stack, e = row
        entry = self._loop_records.setdefault(tuple(id(n) for n in full),
                                              (full, stack, fmt, {}, params or record_params(self.knobs)))
        entry[3].setdefault(e, []).append(amax)

    def _record_stacks(self) -> None:
        """One [E] amax vector per expert stack state, into the graph's batched record."""
        if not self._loop_records:
            return
        output = next(n for n in reversed(self.graph.nodes) if n.op == "output")
        with self.graph.inserting_before(output):
            for full, stack, fmt, per_expert, params in self._loop_records.values():
                experts = int(example_value(stack).shape[0])
                any_amax = next(iter(per_expert.values()))[0]
                zero = None
                column = []
                for e in range(experts):
                    got = per_expert.get(e)
                    if got is None:
                        if zero is None:
                            zero = self.graph.call_function(torch.zeros_like, (any_amax,))
                        column.append(zero)
                        continue
                    amax = got[0]
                    for other in got[1:]:
                        amax = self.graph.call_function(torch.maximum, (amax, other))
                    column.append(amax)
                # detached: an op's amax outputs carry autograd history under the eager compiler, and
                # the record's in-place copies must not put the state tensors on the autograd graph
                vector = self.graph.call_method("detach", (self.graph.call_function(torch.stack, (column,)),))
                super().record(full, vector, fmt, params)

    def apply(self, plan: Plan) -> tuple[list[str], list[tuple[str, str]]]:
        """Rewrite the plan's per-expert loop GLUs and linears; returns (expert weights made FP8, [])."""
        for site in plan.loop_glus:
            self.slices.update((p.w, p.expert) for p in site.projections() if p.expert is not None)
        for site in plan.loop_linears:
            self.slices[site.proj.w] = site.proj.expert
        done = self.replace_sites(plan.loop_glus, plan.loop_linears)
        self._record_stacks()
        return list(dict.fromkeys(done)), []
