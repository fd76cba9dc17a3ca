"""``to_fp8(optimizer)``: an existing ``torch.optim.Adam`` / ``AdamW`` made ``fp8pass.optim.Adam`` / ``AdamW``.

It turns the optimizer (fresh, or with state) into fp8pass's in place: same object, same param
groups, hooks and LR schedulers; existing moments are quantized at once. The state-dict conversions
(``to_torch_state_dict``, ``from_torch_state_dict``) are in ``torch_state_dict.py``, below the
optimizer, which reads a torch state dict in ``load_state_dict``.
"""

from __future__ import annotations

import functools
import weakref

import torch

from .adam import Adam, AdamW
from .options import check_bf16_sr, check_options, check_param

__all__ = ["to_fp8"]


def to_fp8(optimizer: torch.optim.Optimizer, *, m_format: str = "e4m3", v_format: str = "e5m2",
           block_size: int | None = 128, v_sqrt: bool = False, rounding: str = "nearest",
           stochastic_flush: bool = False, kernels: str = "auto", bf16_stochastic_round: bool = False,
           generator: torch.Generator | None = None) -> torch.optim.Optimizer:
    """Convert a ``torch.optim.Adam`` / ``AdamW`` to FP8 moment storage, in place; returns it.

    Args:
        optimizer: a torch Adam or AdamW (exact class, not another subclass), fresh or mid-training.
        m_format, v_format, block_size, v_sqrt, rounding, stochastic_flush, kernels,
            bf16_stochastic_round, generator: as for :class:`fp8pass.optim.Adam`; applied to every
            param group.

    Raises:
        TypeError: for any other optimizer class.
        ValueError: amsgrad=True, differentiable=True, complex parameters, bad options.
    """
    if isinstance(optimizer, Adam):
        return optimizer
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        raise TypeError(f"to_fp8 converts torch.optim.Adam or torch.optim.AdamW, got {type(optimizer).__name__}")
    extra = dict(m_format=m_format, v_format=v_format, block_size=block_size, v_sqrt=v_sqrt, rounding=rounding,
                 stochastic_flush=stochastic_flush, kernels=kernels, bf16_stochastic_round=bf16_stochastic_round)
    for g in optimizer.param_groups:
        check_options(g["lr"], g["betas"], g["eps"], g["weight_decay"], g.get("amsgrad", False),
                       g.get("differentiable", False), m_format, v_format, block_size, rounding, kernels)
        for p in g["params"]:
            check_param(p)
        check_bf16_sr(dict(g, bf16_stochastic_round=bf16_stochastic_round))
    decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(
        optimizer.defaults.get("decoupled_weight_decay", False))
    for g in optimizer.param_groups:
        g["decoupled_weight_decay"] = decoupled or bool(g.get("decoupled_weight_decay", False))
        g.update(extra)
    optimizer.defaults.update(extra, decoupled_weight_decay=decoupled)
    optimizer.__class__ = AdamW if decoupled else Adam
    optimizer.generator = generator
    optimizer._workspaces = {}
    # A fused torch AdamW tells GradScaler it unscales gradients itself; this step does not.
    optimizer._step_supports_amp_scaling = False
    if hasattr(optimizer, "_patch_step_function"):
        optimizer._patch_step_function()  # step hooks/profiling on the new class, as torch does in __init__
    _rewrap_lr_scheduler_step(optimizer)
    for g in optimizer.param_groups:
        for p in g["params"]:
            st = optimizer.state.get(p)
            if st:
                optimizer._init_state(p, g, st)
    return optimizer


def _rewrap_lr_scheduler_step(optimizer) -> None:
    """An LR scheduler created before ``to_fp8`` wrapped the instance's bound torch ``step``; wrap the
    new class's ``step`` the same way (it records that step ran, for the scheduler's order check)."""
    old = optimizer.__dict__.get("step")
    if old is None:
        return
    if not getattr(old, "_wrapped_by_lr_sched", False):
        raise ValueError("optimizer.step was replaced on the instance by something other than an LR "
                         "scheduler; call fp8pass.optim.to_fp8 before wrapping step")
    del optimizer.__dict__["step"]
    opt_ref = weakref.ref(optimizer)
    cls_step = type(optimizer).step

    @functools.wraps(cls_step)
    def step(*args, **kwargs):
        opt = opt_ref()
        opt._opt_called = True
        return cls_step(opt, *args, **kwargs)

    step._wrapped_by_lr_sched = True
    optimizer.step = step
