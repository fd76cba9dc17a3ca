"""Which matched ops become FP8 and which stay in high precision (with the reason, for explain).

The rules, in order (the first that applies decides):

1. ``Config.keep_high_precision`` globs (fnmatch) against the weight's module FQN
   (``model.layers.0.mlp.down_proj``), its parameter FQN (``...down_proj.weight``) and the FQN of
   the module that made the call (so a tied LM head, whose weight is the embedding's, is still
   recognised as ``lm_head``).
2. dtype: only fp32 / bf16 / fp16 activations and weights; float64 models are numerics experiments
   and run unchanged.
3. shapes: weights must be 2-D (3-D for MoE expert stacks, whose per-expert matrices count) with both
   dims >= ``min_dim`` and divisible by ``dim_multiple``.
4. a linear whose input is a GLU output that a graph break cut off (see ``rewrite``) stays high
   precision: an unsmoothed FP8 cast of a GLU output is exactly the outlier case Smooth-SwiGLU exists for.

Between 1 and 2: ``Config.keep_first_layers`` / ``keep_last_layers`` keep the linears of the first /
last N numbered blocks (:func:`block_of`) of the graph, by count. Then ``Config.rules``: the first rule
whose glob matches one of the same three FQNs decides the linear's recipe (``"high"``: kept); the
decision carries it as a :class:`SiteRecipe`, the one Config the rewriter emits the linear's ops with.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, replace

import torch
from torch import fx

from ..config import HIGH, Config, DelayedScaling, NVFP4Scaling
from .matcher import caller_fqn, example_value, param_fqn, weight_fqn

__all__ = ["Decision", "SiteRecipe", "site_recipe", "unmatched_rules", "decide_linear", "module_fqn", "FP8_DTYPES", "block_of", "graph_blocks"]

FP8_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class SiteRecipe:
    """How one FP8 site is rewritten: its Config (the rule's recipe fields over ``Config``'s), the
    backward override and the rule that decided it (``""``: no rule matched, ``Config.recipe``)."""

    cfg: Config
    backward: str = "fp8"
    rule: str = ""

    def describe(self, glu: bool = False) -> str:
        """``FP8 delayed e4m3/e5m2, backward high (rules[1] '*.o_proj' -> delayed, backward high)``: the
        recipe that ran and what decided it (explain's per-linear attribution); ``glu``: a projection
        of a fused GLU (its Smooth-SwiGLU mode is named too)."""
        r = self.cfg.recipe
        if isinstance(r, NVFP4Scaling):
            what = "NVFP4" + (" + HCP" if r.hcp is not None else "")
        else:
            kind = "delayed" if isinstance(r, DelayedScaling) else f"current per {r.granularity}"
            what = f"FP8 {kind} {self.cfg.fwd_format}/{self.cfg.bwd_format}"
            if glu and r.granularity != "mx":  # MX GLUs are three plain linears
                what += f", Smooth-SwiGLU {self.cfg.smooth_swiglu or 'off'}"
        if self.backward == "high":
            what += ", backward high"
        return f"{what} ({self.rule or 'Config.recipe'})"


@dataclass(frozen=True)
class Decision:
    fp8: bool
    reason: str = ""
    site: SiteRecipe | None = None   # for fp8 decisions


def unmatched_rules(cfg: Config, model: torch.nn.Module) -> list[str]:
    """The patterns of ``cfg.rules`` that match no module or parameter FQN of ``model`` (a typo, or
    a rule written for another model): such a rule decides nothing."""
    if not cfg.rules:
        return []
    names = [n for n, _ in model.named_modules()] + [n for n, _ in model.named_parameters()]
    return [r.pattern for r in cfg.rules if not any(fnmatch.fnmatchcase(n, r.pattern) for n in names if n)]


def site_recipe(cfg: Config, names: list[str]) -> SiteRecipe | str:
    """The site recipe for a linear known by ``names`` (FQNs), or the reason a ``"high"`` rule keeps it."""
    found = cfg.rule_for(names)
    if found is None:
        return SiteRecipe(replace(cfg, rules=()) if cfg.rules else cfg)
    i, rule = found
    label = f"rules[{i}] {rule.describe()}"
    if rule.recipe == HIGH:
        return f"kept in high precision by {label}"
    return SiteRecipe(rule.site_config(cfg), rule.backward, label)


def module_fqn(weight_fqn: str) -> str:
    return weight_fqn.rsplit(".", 1)[0] if "." in weight_fqn else weight_fqn


_BLOCK = re.compile(r"^(.*?(?:^|\.)(\d+))(?:\.|$)")


def block_of(fqn: str) -> tuple[str, int] | None:
    """``("layers.7", 7)`` for ``layers.7.attention.wq.weight``; None outside numbered blocks."""
    m = _BLOCK.match(fqn)
    return None if m is None else (m.group(1), int(m.group(2)))


def graph_blocks(graph: fx.Graph) -> list[str]:
    """The numbered blocks whose parameters ``graph`` holds, in index order."""
    blocks: dict[str, int] = {}
    for node in graph.nodes:
        f = param_fqn(node) if node.op == "placeholder" else None
        b = block_of(f) if f else None
        if b is not None:
            blocks[b[0]] = b[1]
    return sorted(blocks, key=lambda k: blocks[k])


def _kept_by_layer_count(cfg: Config, call: fx.Node, weight_fqn: str) -> str | None:
    if not (cfg.keep_first_layers or cfg.keep_last_layers):
        return None
    b = block_of(weight_fqn)
    if b is None:
        return None
    order = graph_blocks(call.graph)
    if b[0] not in order:
        return None
    i, n = order.index(b[0]), len(order)
    if i < cfg.keep_first_layers:
        return f"kept in high precision: block {i + 1} of {n}, keep_first_layers={cfg.keep_first_layers}"
    if i >= n - cfg.keep_last_layers:
        return f"kept in high precision: block {i + 1} of {n}, keep_last_layers={cfg.keep_last_layers}"
    return None


def _kept_by_glob(cfg: Config, names: list[str]) -> str | None:
    for pat in cfg.keep_high_precision:
        for name in names:
            if name and fnmatch.fnmatchcase(name, pat):
                return pat
    return None


def decide_linear(cfg: Config, call: fx.Node, x, w: fx.Node, b=None, experts: bool = False,
                  w_operand: fx.Node | None = None) -> Decision:
    """Decide for one linear call ``call`` computing ``x @ w.T (+ b)``.

    ``experts``: ``w`` is a 3-D expert stack [E, out, in] or [E, in, out]; the shape rules apply to
    each expert's matrix. One expert's matrix of a stack (``W[e]``, a per-expert loop) is a 2-D
    weight named by the stack's FQN, so the globs treat every form of an expert weight alike.
    ``w_operand``: what the matmul read, when the code cast ``w`` on the way (``w.bfloat16().t()``):
    its dtype is the compute dtype the code asked for, judged by the dtype rule.
    """
    wf = weight_fqn(w) or w.name
    names = [module_fqn(wf), wf, caller_fqn(call)]
    pat = _kept_by_glob(cfg, names)
    if pat is not None:
        return Decision(False, f"kept in high precision by keep_high_precision pattern {pat!r}")
    why = _kept_by_layer_count(cfg, call, wf)
    if why is not None:
        return Decision(False, why)
    site = site_recipe(cfg, names)
    if isinstance(site, str):
        return Decision(False, site)
    wv, xv = example_value(w), example_value(x)
    cast = example_value(w_operand) if w_operand is not None and w_operand is not w else None
    if isinstance(cast, torch.Tensor) and cast.dtype not in FP8_DTYPES:
        return Decision(False, f"weight cast to {cast.dtype} before the matmul (FP8 computes in fp32/bf16/fp16): "
                               "kept in high precision")
    for what, v in (("weight", wv), ("input", xv)):
        if isinstance(v, torch.Tensor) and v.dtype not in FP8_DTYPES:
            return Decision(False, f"{what} dtype {v.dtype} (FP8 applies to fp32/bf16/fp16 models)")
    if b is not None:
        bv = example_value(b)
        if isinstance(bv, torch.Tensor) and bv.dtype not in FP8_DTYPES:
            return Decision(False, f"bias dtype {bv.dtype} (FP8 applies to fp32/bf16/fp16 models)")
        out = example_value(call)
        if isinstance(bv, torch.Tensor) and isinstance(out, torch.Tensor) and tuple(bv.shape) != tuple(out.shape[-1:]):
            return Decision(False, f"bias of shape {tuple(bv.shape)} broadcast to {out.shape[-1]} output features "
                                   "(the FP8 ops add a bias of one value per output feature)")
    if isinstance(wv, torch.Tensor):
        want = 3 if experts else 2
        if wv.dim() != want:
            return Decision(False, f"weight is {wv.dim()}-D, not {want}-D")
        dims = [int(d) for d in wv.shape[-2:]]
        if min(dims) < cfg.min_dim:
            return Decision(False, f"weight {tuple(dims)} has a dim below min_dim={cfg.min_dim}")
        if any(d % cfg.dim_multiple for d in dims):
            return Decision(False, f"weight {tuple(dims)} has a dim not divisible by dim_multiple={cfg.dim_multiple}")
    if isinstance(xv, torch.Tensor) and xv.dim() < 1:
        return Decision(False, "scalar input")
    return Decision(True, site=site)
