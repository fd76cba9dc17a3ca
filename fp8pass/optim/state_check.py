"""Validation of an optimizer state dict before it is loaded: counters in range, FP8 block scales usable.

One checker for every load path (``fp8pass.optim.Adam.load_state_dict``, the trainer's resume,
:func:`fp8pass.checkpoint.load`, :func:`fp8pass.distributed.load_checkpoint`); it names the entry
that is wrong. What it checks:

* ``step`` (any optimizer that keeps one): a finite integer in ``[0, max_step]``; an fp32 step
  (torch's and fp8pass's Adam) counts exactly only up to ``2**24``, so a larger one cannot come
  from training, and neither can a negative one.
* ``<moment>_scale`` of fp8pass's FP8 moments: finite and > 0 (a moment is ``codes / scale``, so a
  zero, negative, NaN or Inf scale turns the update into garbage or NaN).
* with ``params``: the shapes of Adam's moments (dense, or FP8 codes and per-block scales) against
  the parameters they belong to.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch

from ..integrity import CheckpointError
from .moments import num_blocks

__all__ = ["check_optimizer_state", "MAX_FP32_STEP"]

MAX_FP32_STEP = 2**24  # fp32 integers are exact up to here: past it, step + 1 == step
_MAX_INT_STEP = 2**31 - 1
_SAME_SHAPE = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer")


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (each rank checks its own), else ``t``."""
    return t._local_tensor if hasattr(t, "_local_tensor") and hasattr(t, "device_mesh") else t


def _check_step(key: str, step, max_step: int | None) -> None:
    if isinstance(step, torch.Tensor):
        if step.numel() != 1:
            raise CheckpointError(f"{key}: expected one number, got a tensor of shape {tuple(step.shape)}")
        limit = MAX_FP32_STEP if step.is_floating_point() else _MAX_INT_STEP
        value = _local(step).item()
    elif isinstance(step, (int, float)) and not isinstance(step, bool):
        limit, value = _MAX_INT_STEP, step
    else:
        raise CheckpointError(f"{key}: expected a number, got {type(step).__name__}")
    if max_step is not None:
        limit = min(limit, max_step)
    if not (math.isfinite(value) and value == int(value) and 0 <= value <= limit):
        raise CheckpointError(f"{key}: an optimizer step count must be an integer in [0, {limit}], got {value!r}")


def check_optimizer_state(state_dict: Mapping, *, params: Mapping | None = None, max_step: int | None = None,
                          name: str = "optimizer") -> None:
    """Raise CheckpointError naming the entry if ``state_dict`` (torch layout: ``state`` and
    ``param_groups``) holds a value no training run produces.

    Args:
        state_dict: an optimizer's ``state_dict()`` (its ``state`` keyed by index, or by FQN as in DCP).
        params: optional ``{state key: (parameter name, shape)}``; then moment shapes are checked and
            messages name the parameter.
        max_step: an upper bound for ``step`` tighter than the representable one (the trainer's own
            step count).
        name: prefix of the keys in messages.
    """
    if not isinstance(state_dict, Mapping) or not isinstance(state_dict.get("state", {}), Mapping) \
            or not isinstance(state_dict.get("param_groups", []), Sequence):
        raise CheckpointError(f"{name}: not an optimizer state dict (expected 'state' and 'param_groups')")
    groups = {}
    for g in state_dict.get("param_groups", []):
        if not isinstance(g, Mapping) or not isinstance(g.get("params", []), Sequence):
            raise CheckpointError(f"{name}.param_groups: expected dicts with a 'params' list")
        for i in g.get("params", []):
            groups[i] = g
    for key, st in state_dict.get("state", {}).items():
        pname, shape = params[key] if params is not None and key in params else (key, None)
        where = f"{name}.state[{pname!r}]"
        if not isinstance(st, Mapping):
            raise CheckpointError(f"{where}: expected a dict, got {type(st).__name__}")
        if "step" in st:
            _check_step(f"{where}.step", st["step"], max_step)
        group = groups.get(key, {})
        fp8 = "m_format" in group  # an fp8pass.optim group: "<moment>_scale" are FP8 block scales
        for k, t in st.items():
            if not isinstance(t, torch.Tensor) or k == "step":
                continue
            if fp8 and k.endswith("_scale"):
                s = _local(t).to(torch.float32)
                ok = torch.isfinite(s) & (s > 0)
                if not bool(ok.all()):
                    i = int((~ok).nonzero()[0][0]) if s.dim() else 0
                    raise CheckpointError(f"{where}.{k}: FP8 moment block scales must be finite and > 0, got "
                                          f"{s.reshape(-1)[i].item()!r} (block {i})")
            if shape is None:
                continue
            if k in _SAME_SHAPE or (fp8 and k.endswith("_codes")):
                if tuple(t.shape) != tuple(shape):
                    raise CheckpointError(f"{where}.{k}: shape {tuple(t.shape)}, the parameter has {tuple(shape)}")
            elif fp8 and k.endswith("_scale"):
                numel = math.prod(shape)
                block = group.get("block_size") or max(1, numel)
                want = (num_blocks(numel, block),)
                if tuple(t.shape) != want:
                    raise CheckpointError(f"{where}.{k}: shape {tuple(t.shape)}, expected {want} (one scale per "
                                          f"{block} elements of a parameter of shape {tuple(shape)})")
