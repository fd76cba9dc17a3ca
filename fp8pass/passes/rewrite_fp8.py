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
are passed by name (the op's schema is declared once, in ``fp8pass.op_schema``); ``out_dtype``
is the dtype the replaced node produced (under autocast the autocast dtype, so the rewritten graph
computes in the same dtypes as the original). AOT
autograd functionalizes the records into copies onto those inputs, so the state survives recompiles
and ``torch._dynamo.reset()`` (it belongs to the weight, not to the graph). The backward of
``fp8_linear`` records the grad_output amax itself.

A GLU site ``down(act(gate(x)) * up(x))`` becomes FP8 linears for gate and up (one for a fused
projection) and one ``fp8pass::swiglu_down`` with the matched activation (silu, gelu, gelu_tanh or
relu: activation, product, Smooth-SwiGLU scaling and the FP8 down GEMM). Under MX granularity a GLU's
three projections become plain MX linears instead (:meth:`FP8Rewriter.replace_glu_mx`).

An RMSNorm site (``Config.save_norm_input_fp8``: a norm only FP8 linears read) becomes
``y = fp8pass::rmsnorm(x, w, eps=, hat_dtype=, out_dtype=, fwd_format=)[0]``: the same values, its
normalized input kept as E4M3 codes for backward (:meth:`FP8Rewriter.replace_norm`).
"""

from __future__ import annotations

import operator

import torch

from ..numerics import ROLES
from ..op_schema import GLUKnobs, NormKnobs
from .annotate import facts, value_dtype
from .plan import GLUSite, LinearSite, NormSite, Plan, is_nvfp4
from .rewrite_base import GraphRewriter, keep_meta

__all__ = ["FP8Rewriter"]


class FP8Rewriter(GraphRewriter):
    """Dense linears and GLU MLPs in FP8 (sites whose recipe is DelayedScaling or CurrentScaling)."""

    share_input_casts = True  # q/k/v, gate/up: one cast of their input, its codes saved once

    def replace_linear(self, site: LinearSite) -> None:
        p = site.proj
        self.replace(p.call, self.fp8_linear(p.x, p.w, p.b, p.call, p.w_t), site.nodes)

    def replace_glu(self, site: GLUSite) -> list[str]:
        """Rewrite a GLU; returns the FQNs of the weights made FP8.

        gate and up become FP8 linears (one for a fused projection; its original slicing then
        yields the pieces). The activation, product and down projection of every GLU
        (SwiGLU, GeGLU, ReGLU) become one ``swiglu_down`` with the matched activation
        (Smooth-SwiGLU per ``Config.smooth_swiglu``; its argument holds for any GLU).
        """
        if self.knobs.granularity == "mx":
            return self.replace_glu_mx(site)
        for p in site.projections()[:-1]:  # gate_up, or gate and up
            self.replace(p.call, self.fp8_linear(p.x, p.w, p.b, p.call, p.w_t))
        down = site.down_proj
        w = down.w
        a_s, b_s, g_s = (self.state(w, r) for r in ROLES)
        sr = self.sr_stream(w)
        glu = GLUKnobs.from_linear(self.knobs, site.act, self.cfg.smooth_swiglu, not facts(w).regathered,
                                   self.cfg.recompute_glu_output)
        with self.graph.inserting_before(down.call):
            w_down = self.graph.call_function(torch.t, (w,)) if down.w_t else w
            out = self.graph.call_function(
                self.ops.swiglu_down.default, (self.r(site.gate_out), self.r(site.up_out), w_down, a_s, b_s, g_s, sr),
                self.kwargs(value_dtype(down.call), activation=glu.activation, smooth=glu.smooth,
                            recast_weight=glu.recast_weight, recompute_output=glu.recompute_output))
            y = self.graph.call_function(operator.getitem, (out, 0))
            if self.delayed:
                self.record(a_s, self.graph.call_function(operator.getitem, (out, 1)), glu.fwd_format)
                if glu.smooth != "channel":  # channel mode casts W_down / c with current scaling
                    self.record(b_s, self.graph.call_function(operator.getitem, (out, 2)), glu.fwd_format)
            if down.b is not None:
                y = self.graph.call_function(operator.add, (y, down.b))
        keep_meta(y, down.call)
        self.replace(down.call, y, site.nodes)
        return ([site.gate] if site.fused else [site.gate, site.up]) + [site.down]

    def replace_glu_mx(self, site: GLUSite) -> list[str]:
        """MX: gate, up (or the fused projection) and down become MX ``fp8_linear`` calls; the
        activation and product stay as they are. No Smooth-SwiGLU: MX scales are current, per 32
        channels of each token, so a hot GLU channel coarsens only its own block (docs/numerics.md, MX).
        """
        for p in site.projections():
            self.replace(p.call, self.fp8_linear(p.x, p.w, p.b, p.call, p.w_t), site.nodes)
        return ([site.gate] if site.fused else [site.gate, site.up]) + [site.down]

    def replace_norm(self, site: NormSite) -> None:
        """An RMSNorm into ``fp8pass::rmsnorm`` (its matched nodes erased once dead; the input's own
        cast stays where something else reads it)."""
        fmt = "identity" if self.cfg.fwd_format == "identity" else "e4m3"
        k = NormKnobs(site.eps, site.hat_dtype, site.out_dtype, fmt)
        with self.graph.inserting_before(site.call):
            out = self.graph.call_function(self.ops.rmsnorm.default, (self.r(site.x), site.w), k.kwargs())
            y = self.graph.call_function(operator.getitem, (out, 0))
        keep_meta(out, site.call)
        keep_meta(y, site.call)
        self.replace(site.call, y, site.nodes)

    def apply(self, plan: Plan) -> tuple[list[str], list[tuple[str, str]]]:
        """Rewrite the plan's FP8 GLUs and linears (NVFP4 ones are NVFP4Rewriter's); returns (weights made
        FP8, (where, reason) kept)."""
        done = self.replace_sites([s for s in plan.glus if not is_nvfp4(s)],
                                  [s for s in plan.linears if not is_nvfp4(s)])
        for site in plan.norms:
            self.replace_norm(site)
        return done, []

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
