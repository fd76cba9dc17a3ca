"""Apply a plan: the recipe's rewriters over one graph copy, then the covered-node cleanup.

The rewriters are siblings over :mod:`.rewrite_base`: :class:`~.rewrite_fp8.FP8Rewriter` (dense
linears, GLU MLPs), :class:`~.rewrite_grouped.GroupedRewriter` (MoE expert stacks),
:class:`~.rewrite_expert_loop.ExpertLoopRewriter` (per-expert loops over ``W[e]``) and
:class:`~.rewrite_nvfp4.NVFP4Rewriter`. Each appends its state placeholders after the previous
one's, so the extra inputs keep their order.
"""

from __future__ import annotations

from torch import fx

from ..config import Config
from .plan import Plan
from .rewrite_base import StateInput, copy_graph_module, finish
from .rewrite_expert_loop import ExpertLoopRewriter
from .rewrite_fp8 import FP8Rewriter
from .rewrite_grouped import GroupedRewriter
from .rewrite_nvfp4 import NVFP4Rewriter

__all__ = ["StateInput", "copy_graph_module", "apply_plan"]


def apply_plan(gm: fx.GraphModule, plan: Plan, cfg: Config) -> tuple[fx.GraphModule, list[StateInput], list[str], list[tuple[str, str]]]:
    """Rewrite ``gm`` (already a copy, annotated) in place per ``plan``.

    Returns:
        (gm, extra inputs the backend appends on every call, FQNs of weights made FP8 / NVFP4,
        extra (where, reason) entries for ops the rewrite kept in high precision).
    """
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
    finish(gm, rewriters)
    return gm, extra, list(dict.fromkeys(done)), kept
