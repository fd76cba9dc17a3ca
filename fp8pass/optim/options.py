"""The options of an FP8 Adam(W) param group: their keys, their checks, and the moment storage they ask for.

Below both the optimizer (``adam.py``) and the torch state-dict conversions (``torch_state_dict.py``),
which read the same group keys.
"""

from __future__ import annotations

import torch

from ..numerics import ROUNDINGS
from .moments import MOMENT_FORMATS, MomentSpec

__all__ = ["KERNELS", "FP8_GROUP_KEYS", "moment_specs", "check_options", "check_bf16_sr", "check_param",
           "check_offload_state"]

KERNELS = ("auto", "torch", "compiled", "triton")
# Keys fp8pass adds to a torch Adam(W) param group.
FP8_GROUP_KEYS = ("m_format", "v_format", "block_size", "v_sqrt", "rounding", "stochastic_flush", "kernels",
                  "bf16_stochastic_round")


def moment_specs(group: dict, numel: int | None = None) -> tuple[MomentSpec, MomentSpec]:
    """The (first, second) moment storage a param group asks for, for a parameter of ``numel``
    elements (needed when ``block_size`` is None: one scale per tensor is one block of ``numel``)."""
    b = group["block_size"]
    if b is None:
        if numel is None:
            raise ValueError("moment_specs: block_size=None (one scale per tensor) needs the parameter's numel")
        b = max(1, numel)
    return (MomentSpec("exp_avg", group["m_format"], b),
            MomentSpec("exp_avg_sq", group["v_format"], b, sqrt=group["v_sqrt"]))


def check_options(lr, betas, eps, weight_decay, amsgrad, differentiable, m_format, v_format, block_size,
                   rounding, kernels) -> None:
    if amsgrad:
        raise ValueError("fp8pass.optim does not support amsgrad=True (it would need a third, max-of-v "
                         "moment store); use torch.optim.AdamW(amsgrad=True) for that")
    if differentiable:
        raise ValueError("fp8pass.optim does not support differentiable=True: quantized moments have no "
                         "useful gradient; use torch.optim.AdamW(differentiable=True)")
    if not isinstance(lr, torch.Tensor) and not 0.0 <= lr:
        raise ValueError(f"invalid learning rate {lr}: must be >= 0")
    if not 0.0 <= eps:
        raise ValueError(f"invalid eps {eps}: must be >= 0")
    if len(betas) != 2 or not all(0.0 <= float(b) < 1.0 for b in betas):
        raise ValueError(f"invalid betas {betas}: two numbers in [0, 1) expected")
    if not 0.0 <= weight_decay:
        raise ValueError(f"invalid weight_decay {weight_decay}: must be >= 0")
    for what, fmt in (("m_format", m_format), ("v_format", v_format)):
        if fmt not in MOMENT_FORMATS:
            raise ValueError(f"unknown {what} {fmt!r}; valid: {', '.join(MOMENT_FORMATS)}")
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1):
        raise ValueError(f"block_size must be a positive int (elements per fp32 scale) or None (one scale "
                         f"per tensor), got {block_size!r}")
    if rounding not in ROUNDINGS:
        raise ValueError(f"unknown rounding {rounding!r}; valid: {', '.join(ROUNDINGS)}")
    if kernels not in KERNELS:
        raise ValueError(f"unknown kernels {kernels!r}; valid: {', '.join(KERNELS)}")


def check_bf16_sr(group: dict) -> None:
    """``bf16_stochastic_round`` is a bool, and with it every parameter of the group is bf16."""
    sr = group.get("bf16_stochastic_round", False)
    if not isinstance(sr, bool):
        raise ValueError(f"bf16_stochastic_round must be True or False, got {sr!r}")
    if not sr:
        return
    for p in group["params"]:
        if p.dtype != torch.bfloat16:
            raise ValueError(
                f"bf16_stochastic_round=True updates bf16 weights (no fp32 master copy), but a parameter of "
                f"shape {tuple(p.shape)} is {p.dtype}: cast the model to bf16 first (model.to(torch.bfloat16)), "
                f"put that parameter in a param group with bf16_stochastic_round=False, or leave the option off")


def check_param(p: torch.Tensor) -> None:
    if torch.is_complex(p):
        raise ValueError(f"fp8pass.optim does not support complex parameters (got {p.dtype}); "
                         f"optimize torch.view_as_real(p) as a real parameter or use torch.optim.AdamW")
    if not p.is_floating_point():
        raise ValueError(f"fp8pass.optim optimizes floating-point parameters, got {p.dtype}")


def check_offload_state(offload_state) -> None:
    """``offload_state`` (keep the optimizer state in host memory between steps) is a bool."""
    if not isinstance(offload_state, bool):
        raise ValueError(f"offload_state must be True or False (keep the optimizer state in host memory "
                         f"between steps), got {offload_state!r}")
