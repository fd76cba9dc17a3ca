"""Rewrite for the NVFP4 recipe: linears into ``fp8pass::nvfp4_linear`` (+ HCP state and update).

Every planned linear (GLU projections included: NVFP4 has no Smooth-SwiGLU form, the down
projection is a plain NVFP4 linear of the GLU product) becomes::

    out = fp8pass::nvfp4_linear(x, W, b, hcp_state, weight_2d, rht, rht_seed, grad_sr, second_order, mode,
                                hcp_backward)
    y   = out[0]
    fp8pass::hcp_update_(*hcp_state, out[1], decay, interval)      # with HCP only

``hcp_state`` = ``[err, hot, step]`` of the weight's HCPState, appended as extra graph inputs like the
delayed-scaling state. Linears that ``nvfp4_policy`` protects stay as they are
(``protected_precision="high"``) or become FP8 linears with current scaling ("fp8").
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from ..config import Config
from .nvfp4_policy import protected_linears
from .plan import Plan
from .rewrite_base import GraphRewriter, keep_meta

__all__ = ["NVFP4Rewriter", "HCP_KIND"]

HCP_KIND = "hcp"


class NVFP4Rewriter(GraphRewriter):
    """Linears (GLU projections included) into ``nvfp4_linear``; protected ones as FP8 or kept."""

    def __init__(self, gm: fx.GraphModule, cfg: Config):
        super().__init__(gm, cfg)
        self.recipe = cfg.recipe
        self.delayed = False
        # protected linears in FP8: per-tensor current scaling, no state
        self.kw = dict(fwd_format=cfg.fwd_format, bwd_format=cfg.bwd_format, granularity="tensor", block=128,
                       power_of_two=False,
                       grad_rounding="stochastic" if cfg.grad_stochastic_rounding else "nearest",
                       margin=0.0, interval=1, algo="max", fast_accum=cfg.fast_accum)

    def hcp_state(self, w: fx.Node) -> list[fx.Node]:
        """``[err, hot, step]`` placeholders of the weight's HCPState; [] without HCP."""
        if self.recipe.hcp is None:
            return []
        return self.state_placeholders(w, HCP_KIND, HCP_KIND, 3)

    def nvfp4_linear(self, x, w: fx.Node, b, before: fx.Node, w_t: bool = False) -> fx.Node:
        r, hcp = self.recipe, self.recipe.hcp
        hs = self.hcp_state(w)
        with self.graph.inserting_before(before):
            weight = self.graph.call_function(torch.t, (w,)) if w_t else w
            out = self.graph.call_function(
                self.ops.nvfp4_linear.default,
                (self.r(x), weight, b, hs, r.weight_2d, r.rht, r.rht_seed, r.grad_stochastic_rounding,
                 True if hcp is None else hcp.second_order, "split" if hcp is None else hcp.mode,
                 False if hcp is None else hcp.backward))
            y = self.graph.call_function(operator.getitem, (out, 0))
            if hs:
                err = self.graph.call_function(operator.getitem, (out, 1))
                self.graph.call_function(self.ops.hcp_update_.default,
                                         (*hs, err, float(hcp.decay), int(hcp.update_interval)))
        keep_meta(y, before)
        return y

    def apply(self, plan: Plan) -> tuple[list[str], list[tuple[str, str]]]:
        """Rewrite every planned linear; returns (NVFP4 weights, (where, reason) of protected ones)."""
        sites = []  # (fqn, x, w, b, call node, its match's nodes, weight stored [in, out])
        for glu in plan.glus:
            m = glu.match
            # the activation and product stay (the NVFP4 down linear reads them): covering the whole
            # match erases only what died, the replaced projections and their weight transposes
            parts = ([("gate", glu.gate, m["x"], "gate_up")] if glu.fused else
                     [("gate", glu.gate, m["x"], "gate"), ("up", glu.up, m["x"], "up")])
            parts.append(("down", glu.down, m["h"], "down"))
            for _, fqn, x, p in parts:
                sites.append((fqn, x, m[f"{p}_w"], m.get(f"{p}_b"), m[p], m.nodes, m.get(f"{p}_layout") == "in_out"))
        sites += [(s.fqn, s.x, s.w, s.b, s.node, s.nodes, s.w_t) for s in plan.linears]
        protected = protected_linears([s[0] for s in sites], self.recipe)
        as_fp8 = self.recipe.protected_precision == "fp8"
        nvfp4: list[str] = []
        kept: list[tuple[str, str]] = []
        for fqn, x, w, b, node, nodes, w_t in sites:
            if fqn in protected:
                if as_fp8:
                    self.replace(node, self.fp8_linear(x, w, b, node, w_t), nodes)
                    kept.append((fqn, protected[fqn] + ": FP8 linear (current scaling)"))
                else:
                    kept.append((fqn, protected[fqn] + ": kept in high precision"))
                continue
            self.replace(node, self.nvfp4_linear(x, w, b, node, w_t), nodes)
            nvfp4.append(fqn)
        return list(dict.fromkeys(nvfp4)), list(dict.fromkeys(kept))
