"""The FP8 rewriter: planned linears into ``fp8_linear``, GLU MLPs into FP8 linears + ``swiglu_down``.

Replacement of a linear site ``y = x @ W.T (+ b)`` (any form the patterns match)::

    c   = fp8pass::fp8_cast_input(x.detach(), x_state, <recipe knobs>, out_dtype=<y's dtype>)  # once per x
    out = fp8pass::fp8_linear_precast(x, c[0], c[1], c[3], W, b, w_state, g_state, <recipe knobs>, out_dtype=...)
    y   = out[0]
    # delayed scaling only: c[2] and out[1] (the x and W amaxes) join the graph's one
    # fp8pass::delayed_record_many_(...) before the output (rewrite_base), with every other record

Every linear reading the same ``x`` (q/k/v, gate/up) takes the same cast, so its codes are saved for
backward once (``fp8pass.runtime.precast``). Under MX granularity each linear is one
``fp8pass::fp8_linear(x, W, b, x_state, w_state, g_state, ...)`` instead (``y = out[0]``, amaxes
``out[1]``, ``out[2]``), as in the NVFP4 rewriter's FP8 linears.

The ``*_state`` lists are the op lists (``DelayedScalingState.OP_FIELDS``) of the weight's
``LinearScalingState`` (fp8pass.runtime.state), extra placeholders (:mod:`.rewrite_base`). The knobs
are passed by name (the op's schema is declared once, in ``fp8pass.runtime.op_schema``); ``out_dtype``
is the dtype the replaced node produced (under autocast the autocast dtype, so the rewritten graph
computes in the same dtypes as the original). AOT
autograd functionalizes the records into copies onto those inputs, so the state survives recompiles
and ``torch._dynamo.reset()`` (it belongs to the weight, not to the graph). The backward of
``fp8_linear`` records the grad_output amax itself.

A GLU site ``down(act(gate(x)) * up(x))`` becomes FP8 linears for gate and up (one for a fused
projection) and one ``fp8pass::swiglu_down`` with the matched activation (silu, gelu, gelu_tanh or
relu: activation, product, Smooth-SwiGLU scaling and the FP8 down GEMM). Under MX granularity a GLU's
three projections become plain MX linears instead (:meth:`FP8Rewriter.replace_glu_mx`).
"""

from __future__ import annotations

import operator

import torch

from .annotate import facts, value_dtype
from .plan import GLUSite, LinearSite, Plan
from .rewrite_base import ROLES, GraphRewriter, is_nvfp4, keep_meta

__all__ = ["FP8Rewriter"]


class FP8Rewriter(GraphRewriter):
    """Dense linears and GLU MLPs in FP8 (sites whose recipe is DelayedScaling or CurrentScaling)."""

    share_input_casts = True  # q/k/v, gate/up: one cast of their input, its codes saved once

    def replace_linear(self, site: LinearSite) -> None:
        self.replace(site.node, self.fp8_linear(site.x, site.w, site.b, site.node, site.w_t), site.nodes)

    def replace_glu(self, site: GLUSite) -> list[str]:
        """Rewrite a GLU; returns the FQNs of the weights made FP8.

        gate and up become FP8 linears (one for a fused projection; its original slicing then
        yields the pieces). The activation, product and down projection of every GLU
        (SwiGLU, GeGLU, ReGLU) become one ``swiglu_down`` with the matched activation
        (Smooth-SwiGLU per ``Config.smooth_swiglu``; its argument holds for any GLU).
        """
        if self.kw["granularity"] == "mx":
            return self.replace_glu_mx(site)
        m = site.match
        if site.fused:
            fused_call = m["gate_up"]
            self.replace(fused_call, self.fp8_linear(m["x"], m["gate_up_w"], m.get("gate_up_b"), fused_call,
                                                     m.get("gate_up_layout") == "in_out"))
            done = [site.gate]
        else:
            for p in ("gate", "up"):
                self.replace(m[p], self.fp8_linear(m["x"], m[f"{p}_w"], m.get(f"{p}_b"), m[p],
                                                   m.get(f"{p}_layout") == "in_out"))
            done = [site.gate, site.up]
        down, w = m["down"], m["down_w"]
        a_s, b_s, g_s = (self.state(w, r) for r in ROLES)
        sr = self.sr_stream(w)
        k = self.kw
        smooth = self.cfg.smooth_swiglu or "none"
        with self.graph.inserting_before(down):
            w_down = self.graph.call_function(torch.t, (w,)) if m.get("down_layout") == "in_out" else w
            out = self.graph.call_function(
                self.ops.swiglu_down.default, (self.r(m["gate"]), self.r(m["up"]), w_down, a_s, b_s, g_s, sr),
                dict(k, out_dtype=value_dtype(down), activation=site.act, smooth=smooth,
                     recast_weight=not facts(w).regathered, recompute_output=self.cfg.recompute_glu_output))
            y = self.graph.call_function(operator.getitem, (out, 0))
            if self.delayed:
                self.record(a_s, self.graph.call_function(operator.getitem, (out, 1)), k["fwd_format"])
                if smooth != "channel":  # channel mode casts W_down / c with current scaling
                    self.record(b_s, self.graph.call_function(operator.getitem, (out, 2)), k["fwd_format"])
            if m.get("down_b") is not None:
                y = self.graph.call_function(operator.add, (y, m["down_b"]))
        keep_meta(y, down)
        self.replace(down, y, m.nodes)
        return done + [site.down]

    def replace_glu_mx(self, site: GLUSite) -> list[str]:
        """MX: gate, up (or the fused projection) and down become MX ``fp8_linear`` calls; the
        activation and product stay as they are. No Smooth-SwiGLU: MX scales are current, per 32
        channels of each token, so a hot GLU channel coarsens only its own block (docs/numerics.md, MX).
        """
        m = site.match
        parts = [("gate_up", m["x"])] if site.fused else [("gate", m["x"]), ("up", m["x"])]
        parts.append(("down", m["h"]))
        for p, x in parts:
            call = m[p]
            self.replace(call, self.fp8_linear(x, m[f"{p}_w"], m.get(f"{p}_b"), call,
                                               m.get(f"{p}_layout") == "in_out"), m.nodes)
        return ([site.gate] if site.fused else [site.gate, site.up]) + [site.down]

    def apply(self, plan: Plan) -> tuple[list[str], list[tuple[str, str]]]:
        """Rewrite the plan's FP8 GLUs and linears (NVFP4 ones are NVFP4Rewriter's); returns (weights made
        FP8, (where, reason) kept)."""
        return self.replace_sites([s for s in plan.glus if not is_nvfp4(s)],
                                  [s for s in plan.linears if not is_nvfp4(s)]), []

    def replace_sites(self, glus, linears) -> list[str]:
        """Rewrite these GLU and linear sites, each with its recipe; returns the FQNs of the weights made FP8."""
        fp8: list[str] = []
        for site in glus:
            with self.at(site.recipe):
                fp8 += self.replace_glu(site)
        for site in linears:
            with self.at(site.recipe):
                self.replace_linear(site)
            fp8.append(site.fqn)
        return fp8
