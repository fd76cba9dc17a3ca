"""Rewrite for the NVFP4 recipe: linears into ``fp8pass::nvfp4_linear`` (+ HCP state and update).

Every planned linear (GLU projections included: NVFP4 has no Smooth-SwiGLU form, the down
projection is a plain NVFP4 linear of the GLU product) becomes::

    out = fp8pass::nvfp4_linear(x, W, b, hcp_state, weight_2d, rht, rht_seed, grad_sr, second_order, mode)
    y   = out[0]
    fp8pass::hcp_update_(*hcp_state, out[1], decay, interval)      # with HCP only

``hcp_state`` = ``[err, hot, step]`` of the weight's HCPState, appended as extra graph inputs like the
delayed-scaling state. Linears that ``nvfp4_policy`` protects stay as they are
(``protected_precision="high"``) or become FP8 linears with current scaling ("fp8").
"""

from __future__ import annotations

import operator

from torch import fx

from ..config import Config
from .nvfp4_policy import protected_linears
from .plan import Plan
from .rewrite import StateInput, _erase_dead, _Rewriter

__all__ = ["apply_nvfp4_plan", "HCP_ROLE"]

HCP_ROLE = "hcp"


class _NVFP4Rewriter(_Rewriter):
    def __init__(self, gm: fx.GraphModule, cfg: Config):
        super().__init__(gm, cfg)
        self.recipe = cfg.recipe
        self.delayed = False
        # protected linears in FP8: per-tensor current scaling, no state
        self.kw = dict(fwd_format=cfg.fwd_format, bwd_format=cfg.bwd_format, granularity="tensor", block=128,
                       power_of_two=False,
                       grad_rounding="stochastic" if cfg.grad_stochastic_rounding else "nearest",
                       margin=0.0, interval=1, algo="max")

    def hcp_state(self, w: fx.Node) -> list[fx.Node]:
        if self.recipe.hcp is None:
            return []
        key = (self.pos[w], HCP_ROLE)
        if key not in self._state_nodes:
            nodes = []
            for f in range(3):
                anchor = self.last_ph
                ctx = (self.graph.inserting_before(next(iter(self.graph.nodes))) if anchor is None
                       else self.graph.inserting_after(anchor))
                with ctx:
                    ph = self.graph.placeholder(f"hcp_state_{w.name}_{f}")
                self.last_ph = ph
                nodes.append(ph)
                self.extra.append(StateInput(self.pos[w], HCP_ROLE, f))
            self._state_nodes[key] = nodes
        return self._state_nodes[key]

    def nvfp4_linear(self, x, w: fx.Node, b, before: fx.Node) -> fx.Node:
        r, hcp = self.recipe, self.recipe.hcp
        hs = self.hcp_state(w)
        with self.graph.inserting_before(before):
            out = self.graph.call_function(
                self.ops.nvfp4_linear.default,
                (self.r(x), w, b, hs, r.weight_2d, r.rht, r.rht_seed, r.grad_stochastic_rounding,
                 True if hcp is None else hcp.second_order, "split" if hcp is None else hcp.mode))
            y = self.graph.call_function(operator.getitem, (out, 0))
            if hs:
                err = self.graph.call_function(operator.getitem, (out, 1))
                self.graph.call_function(self.ops.hcp_update_.default,
                                         (*hs, err, float(hcp.decay), int(hcp.update_interval)))
        y.meta.update({k: v for k, v in before.meta.items() if k in ("nn_module_stack", "stack_trace")})
        return y


def apply_nvfp4_plan(gm: fx.GraphModule, plan: Plan, cfg: Config):
    """Like ``rewrite.apply_plan`` for ``Config(recipe=NVFP4Scaling(...))``; same return value
    (the weight FQN list holds the NVFP4 linears; protected ones are in the kept list with the reason)."""
    rw = _NVFP4Rewriter(gm, cfg)
    sites = []  # (fqn, x, w, b, call node)
    for glu in plan.glus:
        m = glu.match
        if glu.fused:
            sites.append((glu.gate, m["x"], m["gate_up_w"], m.get("gate_up_b"), m["gate_up"]))
        else:
            sites += [(glu.gate, m["x"], m["gate_w"], m.get("gate_b"), m["gate"]),
                      (glu.up, m["x"], m["up_w"], m.get("up_b"), m["up"])]
        sites.append((glu.down, m["h"], m["down_w"], m.get("down_b"), m["down"]))
    sites += [(s.fqn, s.x, s.w, s.b, s.node) for s in plan.linears]
    protected = protected_linears([s[0] for s in sites], cfg.recipe)
    as_fp8 = cfg.recipe.protected_precision == "fp8"
    nvfp4: list[str] = []
    kept: list[tuple[str, str]] = []
    for fqn, x, w, b, node in sites:
        if fqn in protected:
            if as_fp8:
                rw.replace(node, rw.linear(x, w, b, node))
                kept.append((fqn, protected[fqn] + ": FP8 linear (current scaling)"))
            else:
                kept.append((fqn, protected[fqn] + ": kept in high precision"))
            continue
        rw.replace(node, rw.nvfp4_linear(x, w, b, node))
        nvfp4.append(fqn)
    _erase_dead(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return gm, rw.extra, list(dict.fromkeys(nvfp4)), list(dict.fromkeys(kept))
