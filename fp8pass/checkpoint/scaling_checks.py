"""Validation of FP8 scaling state before it is loaded: every rule in one place, every failure named.

The loaders (``model.load_state_dict`` through :mod:`fp8pass.checkpoint.scaling_state`'s hooks,
:func:`fp8pass.load_scaling_state_dict`, :func:`fp8pass.load_checkpoint_state`, the trainer's resume,
:func:`fp8pass.distributed.load_checkpoint`) call these before they copy a value into a live state,
and raise :class:`~fp8pass.checkpoint.CheckpointError` naming the key (the key names are
:mod:`fp8pass.checkpoint.keys`):

* delayed scaling (per role ``input`` / ``weight`` / ``grad_output``): ``scale`` finite and > 0,
  ``amax_history`` finite and >= 0 with the recipe's length, ``steps`` / ``skipped`` integers with
  ``0 <= skipped <= steps <= MAX_COUNTER``, shapes the weight's (``[]`` / ``[H]``, or ``[E]`` /
  ``[E, H]`` for a stack of E experts);
* hot-channel patching: ``err`` >= 0, ``hot`` indices inside the input features, ``step`` in range;
* stochastic-rounding streams (``runtime.sr``): int64 ``[key, draws]`` with ``0 <= key < 2**31`` and
  ``0 <= draws < 2**62``.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from ..runtime.hcp import HCP_FIELDS
from ..runtime.sr import KEY_LIMIT
from ..runtime.state import ROLES
from ..switch_history import HISTORY_KEY, history_from_tensor
from .errors import CheckpointError
from .keys import DELAYED_FIELDS, DELAYED_KEYS, HCP_KEY, SCALING_KEY, SR_KEY, group_delayed_keys, missing_delayed_keys

__all__ = ["check_delayed_state", "check_hcp_state", "check_sr_stream", "check_model_state_dict",
           "check_scaling_state_dict", "MAX_COUNTER"]

MAX_DRAWS = 2**62  # a stream's draw count: below it the seed hash's int64 products cannot overflow
# Largest step / skipped count a checkpoint may hold: 2**31 - 1 casts of one tensor (a 1 ms step for 24
# days); larger values are corruption or a foreign producer, and reject sign flips of the int64 counters.
MAX_COUNTER = 2**31 - 1


def _first_bad(t: torch.Tensor, ok: torch.Tensor) -> str:
    """``value (at index ...)`` of the first entry where ``ok`` is False."""
    idx = tuple(int(i) for i in (~ok).nonzero()[0]) if ok.dim() else ()
    value = t[idx].item() if idx else t.item()
    return f"{value!r}" + (f" at index {list(idx)}" if idx else "")


def _require(key: str, t: torch.Tensor, ok: torch.Tensor, rule: str) -> None:
    if not bool(ok.all()):
        raise CheckpointError(f"{key}: {rule}, got {_first_bad(t, ok)}")


def _check_tensor(key: str, t, shape: tuple, kind: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise CheckpointError(f"{key}: expected a tensor, got {type(t).__name__}")
    if kind == "float" and not t.is_floating_point():
        raise CheckpointError(f"{key}: expected a floating-point tensor, got {t.dtype}")
    if kind == "int" and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        raise CheckpointError(f"{key}: expected an integer tensor, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise CheckpointError(f"{key}: shape {tuple(t.shape)}, this model's state has {tuple(shape)}")


def _check_counters(name: str, steps: torch.Tensor, skipped: torch.Tensor | None = None) -> None:
    _require(name + ("steps" if skipped is not None else "step"), steps, (steps >= 0) & (steps <= MAX_COUNTER),
             f"a count in [0, {MAX_COUNTER}]")
    if skipped is not None:
        _require(name + "skipped", skipped, (skipped >= 0) & (skipped <= steps), "a count in [0, steps]")


def check_delayed_state(sd: Mapping[str, torch.Tensor], name: str, weight_shape: Sequence[int] | None = None,
                        history_len: int | None = None) -> None:
    """Check one weight's delayed-scaling state before it is loaded; raise naming the offending key.

    Rules: ``amax_history`` finite and >= 0, ``scale`` finite and > 0 (fp32), ``steps`` and
    ``skipped`` integers with ``0 <= skipped <= steps <= MAX_COUNTER``; shapes ``[H]`` and ``[]`` for
    a matrix, ``[E, H]`` and ``[E]`` for a stack of E experts (a 3-D weight).

    Args:
        sd: ``{"<role>.<field>": tensor}`` for the roles input / weight / grad_output.
        name: prefix of the keys in messages (e.g. ``"layers.0.mlp.up_proj.weight.fp8_scaling"``).
        weight_shape: the weight's shape in this model (default: any matrix or expert stack).
        history_len: the history length the state must have (default: the same for all roles).

    Raises:
        CheckpointError: naming ``name.<role>.<field>`` and the offending value.
    """
    lead = None if weight_shape is None else ((int(weight_shape[0]),) if len(weight_shape) == 3 else ())
    for role in ROLES:
        key = f"{name}.{role}."
        hist, scale, steps, skipped = (sd[f"{role}.{f}"] for f in DELAYED_FIELDS)
        if not isinstance(hist, torch.Tensor) or hist.dim() < 1:
            raise CheckpointError(f"{key}amax_history: expected a tensor [history_len] (or [experts, history_len])")
        if lead is None:
            lead = tuple(hist.shape[:-1])
            if len(lead) > 1:
                raise CheckpointError(f"{key}amax_history: shape {tuple(hist.shape)}, expected [history_len] "
                                      "or [experts, history_len]")
        if history_len is None:
            history_len = int(hist.shape[-1])
        _check_tensor(key + "amax_history", hist, lead + (history_len,), "float")
        for field, t, kind in (("scale", scale, "float"), ("steps", steps, "int"), ("skipped", skipped, "int")):
            _check_tensor(key + field, t, lead, kind)
        h, s = hist.to(torch.float32), scale.to(torch.float32)
        _require(key + "amax_history", h, torch.isfinite(h) & (h >= 0), "amaxes must be finite and >= 0")
        _require(key + "scale", s, torch.isfinite(s) & (s > 0), "a scale must be finite and > 0")
        _check_counters(key, steps, skipped)


def check_hcp_state(sd: Mapping[str, torch.Tensor], name: str, in_features: int | None = None) -> None:
    """Check one weight's hot-channel-patching state: ``err`` >= 0 (NaN allowed: the EMA of a NaN
    input, which ``select_hot`` ranks first), ``hot`` channel indices in ``[0, in_features)``,
    ``step`` in ``[0, MAX_COUNTER]``. Raises CheckpointError naming ``name.<field>``."""
    err, hot, step = sd["hcp.err"], sd["hcp.hot"], sd["hcp.step"]
    if not isinstance(err, torch.Tensor) or err.dim() != 1:
        raise CheckpointError(f"{name}.err: expected a tensor [in_features]")
    n = int(err.shape[0]) if in_features is None else int(in_features)
    _check_tensor(f"{name}.err", err, (n,), "float")
    if not isinstance(hot, torch.Tensor) or hot.dim() != 1:
        raise CheckpointError(f"{name}.hot: expected a tensor [n_hot]")
    _check_tensor(f"{name}.hot", hot, tuple(hot.shape), "int")
    _check_tensor(f"{name}.step", step, (), "int")
    _require(f"{name}.err", err, ~(err < 0), "errors must be >= 0")
    _require(f"{name}.hot", hot, (hot >= 0) & (hot < n), f"channel indices in [0, {n})")
    _check_counters(f"{name}.", step)


def check_model_state_dict(state_dict: Mapping[str, torch.Tensor], shapes: Mapping[str, Sequence[int]] | None = None,
                           history_len: int | None = None) -> None:
    """Validate the scaling-state entries of a model state dict before ``load_state_dict``.

    The state-dict hooks validate each weight's state as they load it, but report through
    ``load_state_dict``'s RuntimeError after earlier modules were loaded; checkpoint loaders call
    this first, so a bad checkpoint raises before anything changes.

    Args:
        state_dict: a ``model.state_dict()`` with ``"<param>.fp8_scaling.<role>.<field>"`` /
            ``"<param>.fp8_hcp.<field>"`` entries and the precision-switch history ``"fp8_precision_switches"``
            (other keys are ignored).
        shapes: the model's parameter shapes by FQN (default: not compared).
        history_len: the recipe's history length (default: consistent within each weight).

    Raises:
        CheckpointError: an incomplete state, or a value or shape :func:`check_delayed_state` /
            :func:`check_hcp_state` rejects, naming the key.
    """
    groups: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for key, v in state_dict.items():
        if key.rsplit(".", 1)[-1] == HISTORY_KEY:
            try:
                history_from_tensor(v, key)
            except ValueError as e:
                raise CheckpointError(str(e)) from None
            continue
        if f".{SR_KEY}." in key:
            if not key.endswith(f".{SR_KEY}.stream"):
                raise CheckpointError(f"{key}: a stochastic-rounding entry must be '<param>.{SR_KEY}.stream'")
            check_sr_stream(v, key)
            continue
        for marker, kind in ((f".{SCALING_KEY}.", SCALING_KEY), (f".{HCP_KEY}.", HCP_KEY)):
            if marker in key:
                param, rest = key.split(marker, 1)
                groups.setdefault((param, kind), {})[rest if kind == SCALING_KEY else f"hcp.{rest}"] = v
    for (param, kind), sd in groups.items():
        shape = shapes.get(param) if shapes is not None else None
        need = (DELAYED_KEYS if kind == SCALING_KEY
                else [f"hcp.{f}" for f in HCP_FIELDS])
        miss = [k for k in need if k not in sd]
        if miss:
            raise CheckpointError(f"{param}.{kind}: incomplete state, missing {miss}")
        if kind == SCALING_KEY:
            check_delayed_state(sd, f"{param}.{kind}", shape, history_len)
        else:
            check_hcp_state(sd, f"{param}.{kind}", int(shape[1]) if shape is not None and len(shape) == 2 else None)


def check_sr_stream(t, key: str) -> None:
    """Check a stochastic-rounding stream ``[key, draws]`` (int64) before it is loaded; raises
    CheckpointError naming ``key``."""
    _check_tensor(key, t, (2,), "int")
    if t.dtype != torch.int64:
        raise CheckpointError(f"{key}: expected an int64 tensor [key, draws], got {t.dtype}")
    _require(key, t[:1], (t[:1] >= 0) & (t[:1] < KEY_LIMIT), f"a stream key in [0, {KEY_LIMIT})")
    _require(key, t[1:], (t[1:] >= 0) & (t[1:] < MAX_DRAWS), f"a draw count in [0, {MAX_DRAWS})")


def check_scaling_state_dict(state_dict: Mapping[str, torch.Tensor], shapes: Mapping[str, Sequence[int]],
                             history_len: int | None = None, kinds: tuple[str, ...] = ("delayed", "hcp")) -> None:
    """Validate a :func:`fp8pass.scaling_state_dict` for a model with parameter ``shapes``.

    Args:
        state_dict: ``"<param>.<role>.<field>"`` (delayed scaling), ``"<param>.hcp.<field>"``
            (NVFP4 hot-channel patching) and ``"<param>.sr.stream"`` (stochastic-rounding streams,
            any recipe: :func:`check_sr_stream`) entries.
        shapes: the model's parameter shapes by FQN.
        history_len: the recipe's history length (default: consistent within each weight).
        kinds: the kinds of state the recipe keeps; entries of another kind are rejected.

    Raises:
        CheckpointError: a key naming no parameter state of an allowed kind, an incomplete state, or
            a value / shape :func:`check_delayed_state` / :func:`check_hcp_state` rejects.
    """
    hcp: dict[str, dict[str, torch.Tensor]] = {}
    rest = {}
    for key, v in state_dict.items():
        parts = key.rsplit(".", 2)
        if "hcp" in kinds and len(parts) == 3 and parts[1] == "hcp" and parts[2] in HCP_FIELDS and parts[0] in shapes:
            hcp.setdefault(parts[0], {})[f"hcp.{parts[2]}"] = v
        elif len(parts) == 3 and parts[1:] == ["sr", "stream"] and parts[0] in shapes:
            check_sr_stream(v, key)
        else:
            rest[key] = v
    grouped, unknown = group_delayed_keys(rest, shapes) if "delayed" in kinds else ({}, sorted(rest))
    if unknown:
        raise CheckpointError(f"keys that name no {' or '.join(kinds) or 'scaling'} state of a parameter of this model: "
                              f"{unknown[:5]}")
    for name, sd in grouped.items():
        miss = missing_delayed_keys(sd)
        if miss:
            raise CheckpointError(f"{name}: incomplete delayed-scaling state, missing {miss}")
        check_delayed_state(sd, name, shapes[name], history_len)
    for name, sd in hcp.items():
        miss = [f"hcp.{f}" for f in HCP_FIELDS if f"hcp.{f}" not in sd]
        if miss:
            raise CheckpointError(f"{name}.hcp: incomplete hot-channel-patching state, missing {miss}")
        shape = shapes[name]
        check_hcp_state(sd, f"{name}.hcp", int(shape[1]) if len(shape) == 2 else None)
