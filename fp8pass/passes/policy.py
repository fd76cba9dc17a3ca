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
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch
from torch import fx

from ..config import Config
from .matcher import caller_fqn, example_value, param_fqn

__all__ = ["Decision", "decide_linear", "module_fqn", "FP8_DTYPES"]

FP8_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Decision:
    fp8: bool
    reason: str = ""


def module_fqn(weight_fqn: str) -> str:
    return weight_fqn.rsplit(".", 1)[0] if "." in weight_fqn else weight_fqn


def _kept_by_glob(cfg: Config, names: list[str]) -> str | None:
    for pat in cfg.keep_high_precision:
        for name in names:
            if name and fnmatch.fnmatchcase(name, pat):
                return pat
    return None


def decide_linear(cfg: Config, call: fx.Node, x, w: fx.Node, b=None, experts: bool = False) -> Decision:
    """Decide for one linear call ``call`` computing ``x @ w.T (+ b)``.

    ``experts``: ``w`` is a 3-D expert stack [E, out, in] or [E, in, out]; the shape rules apply to
    each expert's matrix.
    """
    wf = param_fqn(w) or w.name
    names = [module_fqn(wf), wf, caller_fqn(call)]
    pat = _kept_by_glob(cfg, names)
    if pat is not None:
        return Decision(False, f"kept in high precision by keep_high_precision pattern {pat!r}")
    wv, xv = example_value(w), example_value(x)
    for what, v in (("weight", wv), ("input", xv)):
        if isinstance(v, torch.Tensor) and v.dtype not in FP8_DTYPES:
            return Decision(False, f"{what} dtype {v.dtype} (FP8 applies to fp32/bf16/fp16 models)")
    if b is not None:
        bv = example_value(b)
        if isinstance(bv, torch.Tensor) and bv.dtype not in FP8_DTYPES:
            return Decision(False, f"bias dtype {bv.dtype} (FP8 applies to fp32/bf16/fp16 models)")
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
    return Decision(True)
