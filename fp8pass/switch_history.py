"""A model's precision switches (issue 30 item 4): the history and the Config it makes.

``fp8pass.switch_precision(model, rules)`` appends a :class:`PrecisionSwitch` to the model's history
(kept on the user's module itself, so it lives and dies with the model and a deep copy carries it).
The backend reads it on every call of a compiled graph: the history's length is the model's
*precision epoch*; when it changed since the graph was last planned, the graph is planned again
under :func:`switched_config` and recompiled only if the rewrite differs (compile_backend.py).

This module is the low end of that feature (the backend reads it, ``fp8pass.precision_switch``
writes it): it imports nothing above ``config`` and ``precision_file``.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass, replace

import torch

from .config import Config, Rule
from .precision_file import rules_from_data, rules_to_data

__all__ = ["PrecisionSwitch", "history", "epoch", "switched_config", "eval_config", "record", "set_history",
           "HISTORY_KEY", "history_to_tensor", "history_from_tensor", "mark_compiled", "was_compiled"]

_ATTR = "_fp8pass_precision_switches"  # module attribute: the history (a list, oldest first)
HISTORY_KEY = "fp8_precision_switches"  # the history's entry in the model's state_dict (a uint8 JSON tensor)


@dataclass(frozen=True)
class PrecisionSwitch:
    """One precision switch of a model (``fp8pass.switch_precision``).

    Attributes:
        step: the training step the switch was made at (None: not given).
        rules: the rules that took precedence from then on (first match wins; before every earlier
            switch's rules and ``Config.rules``).
        reason: why (free text: "last 10% in bf16", "drift in layers.3.mlp", "Config.schedule[0]").
    """

    step: int | None
    rules: tuple[Rule, ...]
    reason: str = ""

    def to_data(self) -> dict:
        """Plain data (JSON-able): ``{"step", "rules", "reason"}`` with the rules as a precision file holds them."""
        return {"step": self.step, "rules": rules_to_data(self.rules), "reason": self.reason}

    @classmethod
    def from_data(cls, data, source: str = "precision switch") -> "PrecisionSwitch":
        if not isinstance(data, dict) or set(data) != {"step", "rules", "reason"}:
            raise ValueError(f"{source}: expected {{'step', 'rules', 'reason'}}, got {data!r}")
        step = data["step"]
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ValueError(f"{source}: step must be an int >= 0 or None, got {step!r}")
        if not isinstance(data["reason"], str):
            raise ValueError(f"{source}: reason must be a string, got {data['reason']!r}")
        return cls(step, tuple(rules_from_data(data["rules"], f"{source}")), data["reason"])


def history(model: torch.nn.Module) -> list[PrecisionSwitch]:
    """``model``'s switches, oldest first (the live list; empty when none). ``model``: the user's module."""
    return model.__dict__.get(_ATTR, [])


def record(model: torch.nn.Module, switch: PrecisionSwitch) -> None:
    """Append ``switch`` to ``model``'s history (the backend sees it at the model's next call)."""
    model.__dict__.setdefault(_ATTR, []).append(switch)


def set_history(model: torch.nn.Module, switches: list[PrecisionSwitch]) -> None:
    """Replace ``model``'s history (a checkpoint's)."""
    model.__dict__[_ATTR] = list(switches)


def epoch(model: torch.nn.Module | None) -> int:
    """The model's precision epoch: the number of switches made (0 for None: a compiled function)."""
    return 0 if model is None else len(model.__dict__.get(_ATTR, ()))


def switched_config(cfg: Config, model: torch.nn.Module | None) -> Config:
    """``cfg`` with the model's switches' rules before its own: newest switch first, first match wins."""
    switches = history(model) if model is not None else []
    if not switches:
        return cfg
    rules = tuple(r for s in reversed(switches) for r in s.rules)
    return replace(cfg, rules=rules + tuple(cfg.rules))


def eval_config(cfg: Config) -> Config:
    """The Config of a model's evaluation graphs (``model.eval()``) under ``cfg.eval_recipe``: every linear
    that ``keep_high_precision`` / ``keep_first_layers`` / ``keep_last_layers`` leave eligible runs in the
    eval recipe (the training rules and switches do not apply)."""
    if cfg.eval_recipe is None:
        return cfg
    return replace(cfg, rules=(Rule("*", cfg.eval_recipe),), eval_recipe=None)


def history_to_tensor(switches: list[PrecisionSwitch]) -> torch.Tensor:
    """The history as a uint8 tensor of its JSON (a state-dict value DCP and ``weights_only`` loads take)."""
    text = json.dumps([s.to_data() for s in switches], sort_keys=True)
    return torch.tensor(list(text.encode()), dtype=torch.uint8)


def history_from_tensor(t, key: str = HISTORY_KEY) -> list[PrecisionSwitch]:
    """Inverse of :func:`history_to_tensor`; ValueError naming ``key`` for anything else."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1:
        raise ValueError(f"{key}: expected a 1-D uint8 tensor (the precision-switch history as JSON), got "
                         f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    try:
        data = json.loads(bytes(t.tolist()).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{key}: not the JSON of a precision-switch history ({e})") from None
    if not isinstance(data, list):
        raise ValueError(f"{key}: expected a list of switches, got {type(data).__name__}")
    return [PrecisionSwitch.from_data(d, f"{key}[{i}]") for i, d in enumerate(data)]


_COMPILED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()  # models an fp8 backend compiled a graph of


def mark_compiled(model: torch.nn.Module) -> None:
    """The backend compiled a graph of ``model`` (so a switch of it has graphs to act on)."""
    _COMPILED.add(model)


def was_compiled(model: torch.nn.Module) -> bool:
    return model in _COMPILED
