"""Rewrite for the NVFP4 recipe: linears into ``fp8pass::nvfp4_linear`` (+ HCP state and update).

Every planned linear (GLU projections included: NVFP4 has no Smooth-SwiGLU form, the down
projection is a plain NVFP4 linear of the GLU product) becomes::

    out = fp8pass::nvfp4_linear(x, W, b, hcp_state, sr_stream, weight_2d, rht, rht_seed, grad_sr,
                                second_order, mode, hcp_backward)
    y   = out[0]
    fp8pass::hcp_update_(*hcp_state, out[1], decay, interval)      # with HCP only

``hcp_state`` = ``[err, hot, step]`` of the weight's HCPState, appended as extra graph inputs like the
delayed-scaling state; ``sr_stream`` the weight's stochastic-rounding stream (``runtime.sr``) with
``grad_stochastic_rounding``, else None. Linears that ``nvfp4_policy`` protects (decided by the plan:
``Projection.protection``, listed in ``Plan.skipped``) stay as they are (``protected_precision="high"``)
or become FP8 linears with current scaling ("fp8"). The sites are those whose recipe (``Config.recipe``
or a rule's) is NVFP4; each NVFP4 recipe protects among its own.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from ..op_schema import NVFP4Knobs
from .plan import Plan, nvfp4_projections
from .rewrite_base import GraphRewriter, keep_meta

__all__ = ["NVFP4Rewriter", "HCP_KIND"]

HCP_KIND = "hcp"


class NVFP4Rewriter(GraphRewriter):
    """Linears (GLU projections included) into ``nvfp4_linear``; protected ones as FP8 or kept."""

    def hcp_state(self, w: fx.Node) -> list[fx.Node]:
        """``[err, hot, step]`` placeholders of the weight's HCPState; [] without HCP."""
        if self.cfg.recipe.hcp is None:
            return []
        return self.state_placeholders(w, HCP_KIND, HCP_KIND, 3)

    def nvfp4_sr_stream(self, w: fx.Node) -> fx.Node | None:
        """The placeholder of ``w``'s stochastic-rounding stream, which the NVFP4 backward's two
        stochastic gradient casts draw from; None with round-to-nearest gradients."""
        if not self.cfg.recipe.grad_stochastic_rounding or w not in self.pos:
            return None
        return self.state_placeholders(w, "grad_output", "sr", 1)[0]

    def nvfp4_linear(self, x, w: fx.Node, b, before: fx.Node, w_t: bool = False) -> fx.Node:
        hcp = self.cfg.recipe.hcp
        hs = self.hcp_state(w)
        sr = self.nvfp4_sr_stream(w)
        with self.graph.inserting_before(before):
            weight = self.graph.call_function(torch.t, (w,)) if w_t else w
            out = self.graph.call_function(
                self.ops.nvfp4_linear.default,
                (self.r(x), weight, b, hs, sr, *NVFP4Knobs.from_recipe(self.cfg.recipe).args()))
            y = self.graph.call_function(operator.getitem, (out, 0))
            if hs:
                err = self.graph.call_function(operator.getitem, (out, 1))
                self.graph.call_function(self.ops.hcp_update_.default,
                                         (*hs, err, float(hcp.decay), int(hcp.update_interval)))
        keep_meta(y, before)
        return y

    def apply(self, plan: Plan) -> tuple[list[str], list[tuple[str, str]]]:
        """Rewrite every planned NVFP4 projection as the plan decided: NVFP4, or (protected) FP8 with
        current scaling, or left as it is; returns (NVFP4 weights, []: the plan lists the protected ones)."""
        nvfp4: list[str] = []
        for recipe, parts in nvfp4_projections(plan).items():
            for p, nodes in parts:
                if p.protection is None:
                    with self.at(recipe):
                        self.replace(p.call, self.nvfp4_linear(p.x, p.w, p.b, p.call, p.w_t), nodes)
                    nvfp4.append(p.fqn)
                elif p.protection.recipe is not None:
                    with self.at(p.protection.recipe):
                        self.replace(p.call, self.fp8_linear(p.x, p.w, p.b, p.call, p.w_t), nodes)
        return list(dict.fromkeys(nvfp4)), []
