"""Which NVFP4-eligible linears the NVFP4 recipe keeps out of 4 bits, and why.

Applied after the general policy (``policy.decide_linear``: LM head and embeddings by
``Config.keep_high_precision``, dtypes, shapes) to the linears that would become NVFP4:

1. post-QK protection (``NVFP4Scaling.protect_post_qk``): value and output projections of
   attention (``post_qk_patterns`` against the module FQN), the ops the seed document found most
   sensitive to quantization error;
2. the last N transformer blocks: ``NVFP4Scaling.keep_last_blocks`` (default 4, the seed document's
   "last 4 layers in BF16"), or, when None, the N whose share of the graph's block linears is closest
   to ``keep_last_fraction`` (0.15: NVIDIA kept ~15% of the linears, its last blocks, in BF16). A block
   is the FQN prefix up to its first numeric component (``layers.7``); the count is over the linears of
   one graph (a model compiled whole sees them all). When the rule keeps every block of a graph, a
   warning says so (on a model of 4 blocks or fewer the default leaves no block linear in NVFP4).
"""

from __future__ import annotations

import fnmatch
import warnings

from ..config import NVFP4Scaling
from .policy import block_of, module_fqn

__all__ = ["block_of", "protected_linears"]

def _last_blocks(n_per_block: list[int], recipe: NVFP4Scaling) -> int:
    if recipe.keep_last_blocks is not None:
        return min(int(recipe.keep_last_blocks), len(n_per_block))
    total = sum(n_per_block)
    if not total:
        return 0
    best, best_gap, covered = 0, recipe.keep_last_fraction, 0
    for n, cnt in enumerate(reversed(n_per_block), start=1):
        covered += cnt
        gap = abs(covered / total - recipe.keep_last_fraction)
        if gap < best_gap - 1e-12:
            best, best_gap = n, gap
    return best


def protected_linears(fqns: list[str], recipe: NVFP4Scaling) -> dict[str, str]:
    """``{weight FQN: reason}`` for the linears (weight FQNs, NVFP4-eligible) kept out of NVFP4."""
    out: dict[str, str] = {}
    if recipe.protect_post_qk:
        for f in fqns:
            mod = module_fqn(f)
            for pat in recipe.post_qk_patterns:
                if fnmatch.fnmatchcase(mod, pat):
                    out[f] = f"post-QK protection (pattern {pat!r}, NVFP4Scaling.protect_post_qk)"
                    break
    blocks: dict[str, int] = {}
    for f in dict.fromkeys(fqns):
        b = block_of(f)
        if b is not None:
            blocks[b[0]] = b[1]
    order = sorted(blocks, key=lambda k: blocks[k])
    counts = [sum(1 for f in dict.fromkeys(fqns) if (block_of(f) or ("",))[0] == b) for b in order]
    n = _last_blocks(counts, recipe)
    if order and n == len(order):
        warnings.warn(
            f"fp8pass NVFP4: the last-blocks rule (keep_last_blocks={recipe.keep_last_blocks}, keep_last_fraction="
            f"{recipe.keep_last_fraction}) keeps all {len(order)} blocks of this graph in high precision, so none "
            f"of its block linears is NVFP4; set NVFP4Scaling(keep_last_blocks=<fewer>) or keep_last_blocks=None "
            f"(the share keep_last_fraction of the block linears)",
            UserWarning, stacklevel=2)
    kept = set(order[len(order) - n:]) if n else set()
    for f in fqns:
        b = block_of(f)
        if b is not None and b[0] in kept and f not in out:
            out[f] = f"last {n} of {len(order)} blocks kept (NVFP4Scaling.keep_last_blocks/keep_last_fraction)"
    return out
