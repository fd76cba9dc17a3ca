"""FP8 cast telemetry: skipped non-finite amaxes and casts that outgrew their delayed scale.

The runtime ops count both on the device, inside the delayed-scaling record, with no host sync
(``skipped`` and ``overflows`` of every :class:`fp8pass.numerics.DelayedScalingState`). Reading
them is the sync, so it happens when asked: :func:`scaling_telemetry` stacks every counter of a
model into one tensor and reads it once.

* ``skipped``: amaxes that were NaN, Inf or >= 2**64 and were left out of the history (the tensor
  held such values; the scale kept its last usable value).
* ``overflows``: casts whose tensor exceeded the range of the delayed scale it was given by more
  than 16x (``amax * scale > 16 * fmt.max``): the values past it saturated to +-max, or, with
  ``DelayedScaling(on_overflow="current")``, that cast used the tensor's current scale instead.
  A few after a jump in magnitude is delayed scaling's lag; a steady stream means the history or
  the margin is too short for this model.

The trainer logs the totals in metrics.jsonl (``fp8_skipped``, ``fp8_overflows``) and warns the
first time either is non-zero. A plain loop calls :func:`check_scaling` where it can afford one
host read (at logging time): it warns once per process and kind. The runtime never warns by itself:
that would read the counters back on every record (a device sync per linear on GPU).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from ..distributed.amax_sync import scaling_states

__all__ = ["ScalingTelemetry", "scaling_telemetry", "warn_once", "check_scaling"]


@dataclass
class ScalingTelemetry:
    """Counters of one model, read at one moment (cumulative since the states were created).

    Attributes:
        skipped, overflows: ``{"<param FQN>.<role>": count}`` for every delayed-scaling state
            (per-expert states are summed over their experts).
    """

    skipped: dict[str, int] = field(default_factory=dict)
    overflows: dict[str, int] = field(default_factory=dict)

    @property
    def total_skipped(self) -> int:
        return sum(self.skipped.values())

    @property
    def total_overflows(self) -> int:
        return sum(self.overflows.values())

    def nonzero(self) -> dict[str, dict[str, int]]:
        """Only the tensors with a non-zero count: ``{"skipped": {...}, "overflows": {...}}``."""
        return {"skipped": {k: v for k, v in self.skipped.items() if v},
                "overflows": {k: v for k, v in self.overflows.items() if v}}

    def warning(self) -> str | None:
        """A one-paragraph warning naming the worst tensors, or None when every count is zero."""
        if not (self.total_skipped or self.total_overflows):
            return None
        parts = []
        for kind, counts, what in (
            ("skipped", self.skipped, "non-finite (NaN/Inf, or >= 2**64) amaxes skipped"),
            ("overflows", self.overflows, "casts past their delayed scale's range (saturated, or recast "
                                          "with on_overflow='current')"),
        ):
            worst = sorted(((v, k) for k, v in counts.items() if v), reverse=True)[:3]
            if worst:
                parts.append(f"{sum(counts.values())} {what}, most in " + ", ".join(f"{k} ({v})" for v, k in worst))
        text = "fp8pass: " + "; ".join(parts) + "."
        if self.total_overflows:  # the demo's first steps show a few: say what they mean (issue 34)
            text += (" A few, early in training or after a jump in magnitude, are delayed scaling's lag (the "
                     "scale follows the last steps' amaxes) and harmless; a steady stream means the amax history "
                     "or margin is too short for this model (docs/numerics.md, Delayed scaling).")
        return text


def scaling_telemetry(model: torch.nn.Module) -> ScalingTelemetry:
    """Read the telemetry counters of every delayed-scaling state of ``model`` (one host read).

    Args:
        model: the model (compiled, DDP- or FSDP-wrapped) whose weights own delayed-scaling state.
    """
    states = scaling_states(model)
    if not states:
        return ScalingTelemetry()
    dev = states[0][1].skipped.device
    counts = torch.stack([torch.stack([s.skipped.sum(), s.overflows.sum()]).to(dev) for _, s in states]).tolist()
    return ScalingTelemetry(skipped={name: int(c[0]) for (name, _), c in zip(states, counts)},
                            overflows={name: int(c[1]) for (name, _), c in zip(states, counts)})


def warn_once(telemetry: ScalingTelemetry, seen: set[str]) -> None:
    """Warn for each kind (skipped, overflows) the first time it is non-zero (``seen`` keeps track)."""
    new = [k for k, n in (("skipped", telemetry.total_skipped), ("overflows", telemetry.total_overflows))
           if n and k not in seen]
    if new:
        seen.update(new)
        warnings.warn(telemetry.warning(), RuntimeWarning, stacklevel=2)


_SEEN: set[str] = set()  # kinds already warned about by check_scaling in this process


def check_scaling(model: torch.nn.Module) -> ScalingTelemetry:
    """Read ``model``'s counters (one host read) and warn the first time per process that any
    non-finite amax was skipped or any cast outgrew its delayed scale; returns the telemetry.

    Call it off the hot path (when logging); the trainer does the same with its own record.
    """
    t = scaling_telemetry(model)
    warn_once(t, _SEEN)
    return t
