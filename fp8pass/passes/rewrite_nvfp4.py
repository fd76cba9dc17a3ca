"""Rewrite for the NVFP4 recipe: linears into ``fp8pass::nvfp4_linear`` (+ HCP state and update).

Every planned linear (GLU projections included: NVFP4 has no Smooth-SwiGLU form, the down
projection is a plain NVFP4 linear of the GLU product) becomes::

    out = fp8pass::nvfp4_linear(x, W, b, hcp_state, weight_2d, rht, rht_seed, grad_sr, second_order, mode,
                                hcp_backward, sr_stream)
    y   = out[0]
    fp8pass::hcp_update_(*hcp_state, out[1], decay, interval)      # with HCP only

``hcp_state`` = ``[err, hot, step]`` of the weight's HCPState, appended as extra graph inputs like the
delayed-scaling state; ``sr_stream`` the weight's stochastic-rounding stream (``runtime.sr``) with
``grad_stochastic_rounding``, else None. Linears that ``nvfp4_policy`` protects stay as they are
(``protected_precision="high"``) or become FP8 linears with current scaling ("fp8"). The sites are
those whose recipe (``Config.recipe`` or a rule's) is NVFP4; each NVFP4 recipe protects among its own.
"""

from __future__ import annotations

import operator
from dataclasses import replace

import torch
from torch import fx

from ..config import CurrentScaling
from .nvfp4_policy import protected_linears
from .plan import Plan
from .policy import SiteRecipe
from .rewrite_base import GraphRewriter, is_nvfp4, keep_meta

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
        r, hcp = self.cfg.recipe, self.cfg.recipe.hcp
        hs = self.hcp_state(w)
        sr = self.nvfp4_sr_stream(w)
        with self.graph.inserting_before(before):
            weight = self.graph.call_function(torch.t, (w,)) if w_t else w
            out = self.graph.call_function(
                self.ops.nvfp4_linear.default,
                (self.r(x), weight, b, hs, r.weight_2d, r.rht, r.rht_seed, r.grad_stochastic_rounding,
                 True if hcp is None else hcp.second_order, "split" if hcp is None else hcp.mode,
                 False if hcp is None else hcp.backward, sr))
            y = self.graph.call_function(operator.getitem, (out, 0))
            if hs:
                err = self.graph.call_function(operator.getitem, (out, 1))
                self.graph.call_function(self.ops.hcp_update_.default,
                                         (*hs, err, float(hcp.decay), int(hcp.update_interval)))
        keep_meta(y, before)
        return y

    def apply(self, plan: Plan) -> tuple[list[str], list[tuple[str, str]]]:
        """Rewrite every planned NVFP4 linear; returns (NVFP4 weights, (where, reason) of protected ones)."""
        by_recipe: dict[SiteRecipe, list] = {}
        for glu in plan.glus:
            if is_nvfp4(glu):
                by_recipe.setdefault(glu.recipe, []).extend(self._glu_parts(glu))
        for s in plan.linears:
            if is_nvfp4(s):
                by_recipe.setdefault(s.recipe, []).append((s.fqn, s.x, s.w, s.b, s.node, s.nodes, s.w_t))
        nvfp4: list[str] = []
        kept: list[tuple[str, str]] = []
        for recipe, sites in by_recipe.items():
            self._apply_recipe(recipe, sites, nvfp4, kept)
        return list(dict.fromkeys(nvfp4)), list(dict.fromkeys(kept))

    @staticmethod
    def _glu_parts(glu) -> list[tuple]:
        """A GLU's projections as linear sites: (fqn, x, w, b, call node, its match's nodes, weight stored
        [in, out])."""
        m = glu.match
        # the activation and product stay (the NVFP4 down linear reads them): covering the whole
        # match erases only what died, the replaced projections and their weight transposes
        parts = ([(glu.gate, m["x"], "gate_up")] if glu.fused else
                 [(glu.gate, m["x"], "gate"), (glu.up, m["x"], "up")])
        parts.append((glu.down, m["h"], "down"))
        return [(fqn, x, m[f"{p}_w"], m.get(f"{p}_b"), m[p], m.nodes, m.get(f"{p}_layout") == "in_out")
                for fqn, x, p in parts]

    def _apply_recipe(self, site: SiteRecipe, sites: list[tuple], nvfp4: list[str], kept: list) -> None:
        """The linears of one NVFP4 recipe: its protected ones kept or FP8 (per-tensor current
        scaling, no state), the others NVFP4."""
        recipe = site.cfg.recipe
        protected = protected_linears([s[0] for s in sites], recipe)
        as_fp8 = SiteRecipe(replace(site.cfg, recipe=CurrentScaling()), site.backward, site.rule)
        by = f" ({site.rule})" if site.rule else ""
        for fqn, x, w, b, node, nodes, w_t in sites:
            if fqn in protected:
                if recipe.protected_precision == "fp8":
                    with self.at(as_fp8):
                        self.replace(node, self.fp8_linear(x, w, b, node, w_t), nodes)
                    kept.append((fqn, protected[fqn] + ": FP8 linear (current scaling)" + by))
                else:
                    kept.append((fqn, protected[fqn] + ": kept in high precision" + by))
                continue
            with self.at(site):
                self.replace(node, self.nvfp4_linear(x, w, b, node, w_t), nodes)
            nvfp4.append(fqn)
