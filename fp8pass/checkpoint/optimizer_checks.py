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
  the parameters they belong to, and any other state tensor at most the parameter's size. Every
  shape is checked before any value is computed on: a crafted file can hold a view that claims
  2**34 elements over a few bytes of storage, and computing on it would allocate for all of them.
* moment values (dense moments and the values FP8 codes stand for) finite: a NaN or Inf moment
  makes every later update of its parameter NaN (it can only come from a non-finite gradient).
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch

from ..kernels.adam_layout import num_blocks
from ..numerics import decode, get_format
from .errors import CheckpointError

__all__ = ["check_optimizer_state", "saved_param_shapes", "MAX_FP32_STEP"]

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


def saved_param_shapes(optimizer: torch.optim.Optimizer, state_dict: Mapping,
                       names: Mapping[int, str] | None = None) -> dict:
    """``{state key: (parameter name, shape)}`` for ``optimizer``'s saved ``state_dict`` (its ``state``
    keyed by index in ``param_groups`` order), the ``params`` of :func:`check_optimizer_state`.

    ``names`` maps ``id(parameter)`` to its FQN (default: the state key). Returns {} when the
    counts differ or the groups are malformed (``load_state_dict`` / the checker report those).
    """
    try:
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    except (KeyError, TypeError):
        return {}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if len(ids) != len(params):
        return {}
    names = names or {}
    return {i: (names.get(id(p), i), tuple(p.shape)) for i, p in zip(ids, params)}


def _fp8_format(key: str, group: Mapping):
    """The FP8 format of moment codes ``key`` (``exp_avg[_sqrt]_codes`` / ``exp_avg_sq[_sqrt]_codes``)."""
    fmt = group.get("v_format") if key.startswith("exp_avg_sq") else group.get("m_format")
    try:
        return get_format(fmt)
    except (ValueError, TypeError, KeyError):
        return None


def _check_shape(where: str, k: str, t: torch.Tensor, shape: tuple, group: Mapping, fp8: bool) -> None:
    """The shape rules (module docstring) of state tensor ``k`` of a parameter of ``shape``."""
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
    elif t.numel() > max(1, math.prod(shape)):
        raise CheckpointError(f"{where}.{k}: {t.numel()} elements, more than its parameter's {math.prod(shape)} "
                              f"(shape {tuple(shape)}); no optimizer keeps such state")


def _check_values(where: str, k: str, t: torch.Tensor, group: Mapping, fp8: bool) -> None:
    """The value rules (module docstring) of state tensor ``k`` (its shape already checked)."""
    if fp8 and k.endswith("_scale"):
        s = _local(t).to(torch.float32)
        ok = torch.isfinite(s) & (s > 0)
        if not bool(ok.all()):
            i = int((~ok).nonzero()[0][0]) if s.dim() else 0
            raise CheckpointError(f"{where}.{k}: FP8 moment block scales must be finite and > 0, got "
                                  f"{s.reshape(-1)[i].item()!r} (block {i})")
        return
    if fp8 and k.endswith("_codes"):
        fmt = _fp8_format(k, group)
        if fmt is None:
            return  # an unknown format: the optimizer's own load reports it
        if t.element_size() != 1:
            raise CheckpointError(f"{where}.{k}: FP8 codes are 1-byte values, got {t.dtype}")
        vals = decode(_local(t).reshape(-1), fmt, torch.float32)
    elif k in _SAME_SHAPE and t.is_floating_point():
        vals = _local(t).reshape(-1)
    else:
        return
    bad = ~torch.isfinite(vals)
    if bool(bad.any()):
        i = int(bad.nonzero()[0][0])
        raise CheckpointError(f"{where}.{k}: a moment must be finite, got {vals[i].item()!r} (element {i}); "
                              "the state was saved after a non-finite gradient reached the optimizer")


def check_optimizer_state(state_dict: Mapping, *, params: Mapping | None = None, max_step: int | None = None,
                          name: str = "optimizer") -> None:
    """Raise CheckpointError naming the entry if ``state_dict`` (torch layout: ``state`` and
    ``param_groups``) holds a value no training run produces.

    Args:
        state_dict: an optimizer's ``state_dict()`` (its ``state`` keyed by index, or by FQN as in DCP).
        params: optional ``{state key: (parameter name, shape)}`` (:func:`saved_param_shapes`); then
            every state tensor's shape is checked first and messages name the parameter. Without it,
            the tensors must already be bounded (DCP loads into the model's own tensors).
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
    entries = []
    for key, st in state_dict.get("state", {}).items():  # structure and shapes of everything first
        pname, shape = params[key] if params is not None and key in params else (key, None)
        where = f"{name}.state[{pname!r}]"
        if not isinstance(st, Mapping):
            raise CheckpointError(f"{where}: expected a dict, got {type(st).__name__}")
        group = groups.get(key, {})
        fp8 = "m_format" in group  # an fp8pass.optim group: "<moment>_scale" are FP8 block scales
        tensors = [(k, t) for k, t in st.items() if isinstance(t, torch.Tensor) and k != "step"]
        if shape is not None:
            for k, t in tensors:
                _check_shape(where, k, t, shape, group, fp8)
        entries.append((where, st, group, fp8, tensors))
    for where, st, group, fp8, tensors in entries:  # then the values
        if "step" in st:
            _check_step(f"{where}.step", st["step"], max_step)
        for k, t in tensors:
            _check_values(where, k, t, group, fp8)
