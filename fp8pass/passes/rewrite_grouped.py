"""The MoE expert rewriter: grouped expert projections into per-expert-scaled FP8 grouped ops.

An expert GLU ``down(act(gate) * up)`` over grouped projections (one offsets tensor; or batched
``bmm`` over ``x`` [E, C, in], which becomes the same ops with every expert given C rows) becomes::

    out = fp8pass::fp8_grouped_linear(x, W_gate_up, offs, w_transposed, x_state, w_state, g_state, sr_stream, ...,
                                      out_dtype=<the replaced projection's dtype>)
    gate, up = <the original slicing of out[0]>
    out = fp8pass::fp8_grouped_swiglu_down(gate, up, W_down, offs, w_transposed, a_state, b_state, g_state,
                                           sr_stream, ..., out_dtype=<down's dtype>, activation=act, smooth=smooth)
    fp8pass::delayed_record_(*state, out[1] / out[2], ...)           # per-expert amaxes [E]

and an expert projection on its own becomes one ``fp8_grouped_linear``. ``out_dtype`` is the dtype the
replaced node produced (under autocast the autocast dtype), so the rewritten graph keeps every dtype.
The state of a 3-D expert weight holds one scale per expert (``StateInput.kind == "experts"``; the
backend resolves it with ``runtime.grouped_state_for``); the records take the ops' per-expert amax vectors.
With stochastic gradient rounding each expert stack has one stochastic-rounding stream (``sr_stream``,
``runtime.sr``) whatever the recipe's granularity: the grouped ops cast the gradient per expert.

When gate and up are the first and second half of the fused output (``chunk(2, -1)``, as transformers'
experts split it), the GLU op takes ``out[0]`` itself with ``up=None``: its backward returns d(gate_up)
in one pass instead of dgate and dup that the ``chunk`` backward would ``cat``.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from ..numerics import ROLES
from ..op_schema import GroupedGLUKnobs, GroupedLinearKnobs
from .annotate import value_dtype
from .matcher import example_value
from .plan import ExpertGLUSite, Plan
from .rewrite_base import GraphRewriter, keep_meta

__all__ = ["GroupedRewriter", "EXPERTS_KIND"]

EXPERTS_KIND = "experts"


def _split_in_halves(site: ExpertGLUSite) -> bool:
    """Whether a fused expert GLU's gate and up are the first and second half of the gate_up output
    (``chunk(2, -1)``, ``split(F, -1)``, ``[..., :F]`` / ``[..., F:]``): the form the grouped GLU op
    takes whole (``up=None``)."""
    if not site.fused:
        return False
    width = example_value(site.gate_proj.call).shape[-1]
    if not isinstance(width, int) or width % 2:
        return False
    half = width // 2
    return site.gate_rows == slice(0, half, 1) and site.up_rows == slice(half, width, 1)


class GroupedRewriter(GraphRewriter):
    """MoE expert stacks in FP8 with per-expert scales (FP8 recipes only)."""

    def rows_and_offsets(self, x: fx.Node, w: fx.Node, offs):
        """``(x2d, offs, shape_back)``: the grouped op's operands for either expert form.

        grouped: ``x`` is already [S, in] sorted by expert with ``offs``. batched (``offs`` None):
        ``x`` is [E, C, in]; its rows are flattened and every expert gets C of them,
        ``offs = [C, 2C, ..., E C]``; ``shape_back(y2d)`` restores [E, C, out].
        """
        if offs is not None:
            return x, offs, lambda y: y
        experts = int(example_value(w).shape[0])
        g = self.graph
        cap = g.call_method("size", (x, 1))
        x2d = g.call_method("reshape", (x, (-1, g.call_method("size", (x, -1)))))
        device = g.call_function(getattr, (x, "device"))
        ends = g.call_function(torch.arange, (1, experts + 1), {"dtype": torch.int32, "device": device})
        offs = g.call_function(operator.mul, (ends, cap))
        return x2d, offs, lambda y: g.call_method("reshape", (y, (experts, cap, -1)))

    def grouped_linear(self, x, w: fx.Node, offs, layout: str, before: fx.Node) -> fx.Node:
        """Emit an FP8 grouped linear (and its per-expert records) before ``before``; returns ``y``."""
        xs, ws, gs = (self.state(w, r, EXPERTS_KIND) for r in ROLES)
        with self.graph.inserting_before(before):
            x2d, offs, back = self.rows_and_offsets(self.r(x), w, offs)
            out = self.graph.call_function(self.ops.fp8_grouped_linear.default,
                                           (x2d, w, offs, layout == "in_out", xs, ws, gs, self.sr_stream(w)),
                                           GroupedLinearKnobs.from_config(self.cfg, value_dtype(before)).kwargs())
            y = back(self.graph.call_function(operator.getitem, (out, 0)))
            if self.delayed:
                self.record(xs, self.graph.call_function(operator.getitem, (out, 1)), self.knobs.fwd_format)
                self.record(ws, self.graph.call_function(operator.getitem, (out, 2)), self.knobs.fwd_format)
        keep_meta(y, before)
        return y

    def replace_expert_glu(self, site: ExpertGLUSite) -> list[str]:
        for p in site.projections()[:-1]:  # gate_up, or gate and up
            self.replace(p.call, self.grouped_linear(p.x, p.w, site.offs, p.layout, p.call))
        down = site.down_proj
        w = down.w
        a_s, b_s, g_s = (self.state(w, r, EXPERTS_KIND) for r in ROLES)
        knobs = GroupedGLUKnobs.from_config(self.cfg, value_dtype(down.call), site.act)
        with self.graph.inserting_before(down.call):
            if _split_in_halves(site):  # the op takes gate_up itself: its backward writes d(gate_up), no cat
                gate, offs, back = self.rows_and_offsets(self.r(site.gate_proj.call), w, site.offs)
                up = None
            else:
                gate, offs, back = self.rows_and_offsets(self.r(site.gate_out), w, site.offs)
                up = self.r(site.up_out) if site.offs is not None else self.graph.call_method(
                    "reshape", (self.r(site.up_out), (-1, self.graph.call_method("size", (self.r(site.up_out), -1)))))
            out = self.graph.call_function(
                self.ops.fp8_grouped_swiglu_down.default,
                (gate, up, w, offs, down.w_t, a_s, b_s, g_s, self.sr_stream(w)), knobs.kwargs())
            y = back(self.graph.call_function(operator.getitem, (out, 0)))
            if self.delayed:
                self.record(a_s, self.graph.call_function(operator.getitem, (out, 1)), knobs.fwd_format)
                if knobs.smooth != "channel":  # channel mode casts W_down / c with current scaling
                    self.record(b_s, self.graph.call_function(operator.getitem, (out, 2)), knobs.fwd_format)
        keep_meta(y, down.call)
        self.replace(down.call, y, site.nodes)
        return ([site.gate] if site.fused else [site.gate, site.up]) + [site.down]

    def apply(self, plan: Plan) -> tuple[list[str], list[tuple[str, str]]]:
        """Rewrite the plan's expert GLUs and expert linears; returns (weights made FP8, [])."""
        done: list[str] = []
        for site in plan.expert_glus:
            with self.at(site.recipe):
                done += self.replace_expert_glu(site)
        for lin in plan.expert_linears:
            p = lin.proj
            with self.at(lin.recipe):
                self.replace(p.call, self.grouped_linear(p.x, p.w, lin.offs, p.layout, p.call), lin.nodes)
            done.append(lin.fqn)
        return done, []
