"""Apply a plan: the recipe's rewriters over one graph copy, then the covered-node cleanup.

The rewriters are siblings over :mod:`.rewrite_base`: :class:`~.rewrite_fp8.FP8Rewriter` (dense
linears, GLU MLPs), :class:`~.rewrite_grouped.GroupedRewriter` (MoE expert stacks),
:class:`~.rewrite_expert_loop.ExpertLoopRewriter` (per-expert loops over ``W[e]``) and
:class:`~.rewrite_nvfp4.NVFP4Rewriter`. Each appends its state placeholders after the previous
one's, so the extra inputs keep their order. Higher-order op bodies (activation checkpointing,
``wrap``) are rewritten the same way, depth first, and threaded into the enclosing graph by
:class:`~.rewrite_hop.BodyRewriter` (state operands in, amaxes out, recorded once outside).
"""

from __future__ import annotations

from torch import fx

from ..config import Config
from .plan import Plan
from .rewrite_base import StateInput, copy_graph_module, finish, return_records
from .rewrite_expert_loop import ExpertLoopRewriter
from .rewrite_fp8 import FP8Rewriter
from .rewrite_grouped import GroupedRewriter
from .rewrite_hop import BodyRewriter
from .rewrite_nvfp4 import NVFP4Rewriter

__all__ = ["StateInput", "copy_graph_module", "apply_plan"]


def apply_plan(gm: fx.GraphModule, plan: Plan, cfg: Config) -> tuple[fx.GraphModule, list[StateInput], list[str], list[tuple[str, str]]]:
    """Rewrite ``gm`` (already a copy, annotated) in place per ``plan``, its higher-order op bodies too.

    Returns:
        (gm, extra inputs the backend appends on every call, FQNs of weights made FP8 / NVFP4,
        extra (where, reason) entries for ops the rewrite kept in high precision).
    """
    done, kept, extra, _ = _rewrite(gm, plan, cfg, body=False)
    return gm, extra, done, kept


def _rewrite(gm: fx.GraphModule, plan: Plan, cfg: Config, body: bool):
    """(weights made FP8, kept, state inputs, returned records) of one graph or body (``body``: its
    records are returned as outputs, :func:`.rewrite_base.return_records`, not recorded in it)."""
    # each rewriter takes the sites of its kind (a site's recipe: Config.recipe or a rule's)
    kinds = [FP8Rewriter, GroupedRewriter, ExpertLoopRewriter, NVFP4Rewriter]
    done: list[str] = []
    kept: list[tuple[str, str]] = []
    extra: list[StateInput] = []
    rewriters = []
    for kind in kinds:
        rw = kind(gm, cfg)
        d, k = rw.apply(plan)
        done += d
        kept += k
        extra += rw.extra
        rewriters.append(rw)
    if plan.bodies:
        threader = BodyRewriter(gm, cfg, siblings=rewriters)
        for site in plan.bodies:
            d, k, body_extra, returned = _rewrite(site.body.gm, site.plan, cfg, body=True)
            threader.thread(site, body_extra, returned)
            done += d
            kept += k
        extra += threader.extra
        rewriters.append(threader)
    returned = return_records(gm.graph, rewriters) if body else []
    finish(gm, rewriters, emit=not body)
    return list(dict.fromkeys(done)), kept, extra, returned
