"""Precision switches inside a run, without a restart (issue 30 item 4; docs/precision.md).

``fp8pass.switch_precision(model, rules)`` puts ``rules`` before the model's earlier switches and its
``Config.rules`` from the model's next call on; the backend plans each compiled graph again under
them and recompiles only the graphs whose rewrite changed (once each), while the weights that stay in
FP8 keep their scaling state (it belongs to the weight). ``fp8pass.apply_schedule`` makes the switches
of a ``Config.schedule`` that are due at a step. The history (:class:`PrecisionSwitch` records) is
saved in ``model.state_dict()`` and so in every checkpoint, and a resume continues in the switched
precision.
"""

from __future__ import annotations

import warnings

import torch

from .checkpoint import hook_precision_history
from .compile_backend import Backend, fp8_backend
from .config import Config, DelayedScaling, Rule, Switch
from .passes.names import _unwrapped
from .passes.policy import module_fqn, unmatched_rules
from .passes.uncompiled import compile_backend_of
from .runtime.state import _REGISTRY as _DELAYED_STATES
from .switch_history import PrecisionSwitch, history, record, was_compiled

__all__ = ["switch_precision", "precision_switches", "apply_schedule", "schedule_tag", "PrecisionSwitch"]


def _fp8_backend_of(model) -> Backend | None | bool:
    """The fp8 Backend ``model`` (a wrapper or an in-place compile) is compiled with; True for the
    ``"fp8"`` entry point's default one; None when it is not compiled with fp8pass."""
    be = compile_backend_of(model)
    if isinstance(be, Backend):
        return be
    return True if be is fp8_backend else None


def _compiled_model(model: torch.nn.Module, what: str) -> torch.nn.Module:
    """The user's module of ``model``; ValueError when the fp8 backend never compiled it (nothing to switch)."""
    target = _unwrapped(model)
    if not (was_compiled(target) or _fp8_backend_of(model) or _fp8_backend_of(target)):
        raise ValueError(f"{what}: {type(target).__name__} is not compiled with the fp8 backend, so no graph of it "
                         f"can switch precision; compile it first: torch.compile(model, backend=\"fp8\") or "
                         f"backend=fp8pass.backend(cfg) (or model.compile(backend=...))")
    return target


def _check_delayed_states(model, target: torch.nn.Module, rules: tuple[Rule, ...]) -> None:
    """A weight with delayed-scaling state keeps its delayed recipe for life (its state, made for that
    recipe, is what it casts with): refuse a switch giving it another one, naming the weight."""
    be = _fp8_backend_of(model) or _fp8_backend_of(target)
    base = be.config if isinstance(be, Backend) else Config()
    switched = Config(rules=rules)
    for name, p in target.named_parameters():
        st = _DELAYED_STATES.get(p)
        found = switched.rule_for([module_fqn(name), name]) if st is not None else None
        if found is None or not isinstance(found[1].scaling, DelayedScaling):
            continue
        site = found[1].site_config(base)
        fwd, bwd = (f if f != "identity" else d for f, d in ((site.fwd_format, "e4m3"), (site.bwd_format, "e5m2")))
        if site.recipe != st.recipe or (st.input.fmt.name, st.grad_output.fmt.name) != (fwd, bwd):
            raise ValueError(
                f"switch_precision: rules[{found[0]}] {found[1].describe()} gives {name} the delayed recipe "
                f"{site.recipe} ({fwd}/{bwd}), but its delayed-scaling state was made for {st.recipe} "
                f"({st.input.fmt.name}/{st.grad_output.fmt.name}) and a weight keeps one delayed recipe; give it "
                f"that recipe, a current-scaling one ('blockwise', 'mxfp8', CurrentScaling(...)) or 'high'")


def _check_rules(rules, what: str = "switch_precision(model, rules)") -> tuple[Rule, ...]:
    if isinstance(rules, Rule) or not isinstance(rules, (list, tuple)) or not rules:
        raise TypeError(f"{what} takes a non-empty list of fp8pass.Rule (first match wins), got {rules!r}")
    for i, r in enumerate(rules):
        if not isinstance(r, Rule):
            raise TypeError(f"{what}: rules[{i}] must be an fp8pass.Rule(pattern, recipe, backward=...), got {r!r}")
    return tuple(rules)


def switch_precision(model: torch.nn.Module, rules, *, reason: str = "", step: int | None = None
                     ) -> PrecisionSwitch:
    """From ``model``'s next call on, ``rules`` take precedence over its earlier switches and its Config's rules.

    The fp8 backend plans each of the model's compiled graphs again at its next call (first match wins:
    these rules, then the earlier switches' newest first, then ``Config.rules``) and recompiles a graph
    only if its rewrite changed: at most one compile per graph. Weights that stay in FP8 keep their
    scaling state (delayed-scaling histories, stochastic-rounding streams); a weight that becomes FP8
    starts from its first cast's amax, or from the state it had when it last ran in FP8.
    ``keep_high_precision`` and ``keep_first_layers``/``keep_last_layers`` still keep their linears.

    Args:
        model: a model compiled with the fp8 backend: ``torch.compile(model, backend="fp8")`` or
            ``fp8pass.backend(cfg)`` (the wrapper or the module), or ``model.compile(backend=...)``.
        rules: a non-empty list of :class:`fp8pass.Rule`, e.g. ``[Rule("*", "high")]`` (everything back
            to high precision) or ``[Rule("layers.[0-3].*", "paper")]``.
        reason: why, kept in the record (logs, checkpoints).
        step: the training step of the switch, kept in the record.

    Returns:
        the :class:`PrecisionSwitch` recorded (also in :func:`precision_switches`).

    Raises:
        TypeError: ``rules`` is not a non-empty list of Rule, ``model`` not an ``nn.Module``.
        ValueError: ``model`` was never compiled with the fp8 backend (nothing to switch), or a bad ``step``.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"switch_precision(model, rules) takes the model (an nn.Module), got {type(model).__name__}")
    rules = _check_rules(rules)
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(f"switch_precision: step must be an int >= 0 or None, got {step!r}")
    if not isinstance(reason, str):
        raise TypeError(f"switch_precision: reason must be a string, got {reason!r}")
    target = _compiled_model(model, "switch_precision")
    _check_delayed_states(model, target, rules)
    for pattern in unmatched_rules(Config(rules=rules), target):
        warnings.warn(f"fp8pass.switch_precision: rule pattern {pattern!r} matches no module or parameter of "
                      f"{type(target).__name__}; the rule decides nothing", UserWarning, stacklevel=2)
    switch = PrecisionSwitch(step, rules, reason)
    hook_precision_history(target)  # the history travels in model.state_dict() from now on
    record(target, switch)
    return switch


def precision_switches(model: torch.nn.Module) -> list[PrecisionSwitch]:
    """``model``'s precision switches, oldest first (a copy; empty when none)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"precision_switches(model) takes the model (an nn.Module), got {type(model).__name__}")
    return list(history(_unwrapped(model)))


def schedule_tag(i: int, switch: Switch) -> str:
    """The reason a scheduled switch is recorded with: ``"schedule[i]"``, then ``": <its reason>"``."""
    return f"schedule[{i}]" + (f": {switch.reason}" if switch.reason else "")


def apply_schedule(model: torch.nn.Module, step: int, total_steps: int | None = None, schedule=None
                   ) -> list[PrecisionSwitch]:
    """Make the switches of ``schedule`` that are due at ``step`` and not made yet; returns them (oldest first).

    Call it before each training step (the trainer does). A switch is due when ``step`` reached its step
    (``Switch.step(total_steps)``); it is made once: the model's history (restored from a checkpoint on
    resume) records it with reason :func:`schedule_tag`, so a resumed run does not make it again.

    Args:
        model: the compiled model (as :func:`switch_precision` takes it).
        step: the 0-based step about to run.
        total_steps: the run's steps (needed by ``Switch(at_fraction=...)``).
        schedule: a sequence of :class:`fp8pass.Switch`; default: ``Config.schedule`` of the fp8 backend
            ``model`` is compiled with (a ``torch.compile`` wrapper or an in-place compile).

    Raises:
        ValueError: no ``schedule`` given and none found on the model's backend, or an ``at_fraction`` switch
            without ``total_steps``; and as :func:`switch_precision`.
    """
    target = _compiled_model(model, "apply_schedule")
    if schedule is None:
        be = _fp8_backend_of(model)
        if not isinstance(be, Backend):
            raise ValueError("apply_schedule: pass schedule=[fp8pass.Switch(...), ...]; the model's Config.schedule "
                             "is found only on a model compiled with fp8pass.backend(cfg) (the torch.compile wrapper "
                             "or model.compile(...))")
        schedule = be.config.schedule
    schedule = Config(schedule=schedule).schedule  # validated (TypeError naming a bad entry)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"apply_schedule: step must be an int >= 0, got {step!r}")
    made = {s.reason for s in history(target)}
    out = []
    for i, sw in enumerate(schedule):
        tag = schedule_tag(i, sw)
        if sw.step(total_steps) <= step and tag not in made:
            out.append(switch_precision(model, list(sw.rules), reason=tag, step=step))
    return out
