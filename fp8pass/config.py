"""Scaling recipes (plain dataclasses; the bottom of the import graph).

The backend's ``Config`` joins these once the compile backend exists; the recipes are what the
numerics core, the runtime ops and the optimizer share.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CurrentScaling", "DelayedScaling", "GRANULARITIES", "ALGOS"]

GRANULARITIES = ("tensor", "row", "block")
ALGOS = ("max", "most_recent")


def _check_choice(what: str, value, valid) -> None:
    if value not in valid:
        raise ValueError(f"unknown {what} {value!r}; valid: {', '.join(map(str, valid))}")


@dataclass(frozen=True)
class CurrentScaling:
    """Scale every tensor from its own amax, at the moment it is cast.

    Args:
        granularity: "tensor", "row" (per row of the last dim: per token / per output channel) or
            "block" (1 x block tiles for activations, block x block for weights).
        block: tile edge for "block" granularity (128 for FP8, as in DeepSeek-V3).
        power_of_two: round scales down to a power of two, ``2**floor(log2(max / amax))``.
    """

    granularity: str = "tensor"
    block: int = 128
    power_of_two: bool = False

    def __post_init__(self):
        _check_choice("granularity", self.granularity, GRANULARITIES)
        if self.block < 1:
            raise ValueError(f"block must be a positive int, got {self.block}")


@dataclass(frozen=True)
class DelayedScaling:
    """Scale from the amaxes that earlier steps recorded (per-tensor), as Transformer Engine does.

    A tensor is cast with the scale held in its state; the cast records the tensor's amax into a
    history of ``history_len`` entries; every ``interval`` recorded steps the scale is recomputed as
    ``fmt.max / reduce(history) / 2**margin`` with reduce = max over the history ("max") or its newest
    entry ("most_recent"). The very first cast, with an empty history, scales from its own amax.

    Args:
        history_len: entries in the amax history (>= 1).
        margin: lower the scale by 2**margin, headroom against growth between updates.
        interval: recompute the scale every ``interval`` steps (>= 1).
        algo: "max" or "most_recent".
        power_of_two: round scales down to a power of two (the paper's reference implementation).
    """

    history_len: int = 16
    margin: float = 0.0
    interval: int = 1
    algo: str = "max"
    power_of_two: bool = False

    def __post_init__(self):
        _check_choice("algo", self.algo, ALGOS)
        if int(self.history_len) != self.history_len or self.history_len < 1:
            raise ValueError(f"history_len must be an int >= 1, got {self.history_len}")
        if int(self.interval) != self.interval or self.interval < 1:
            raise ValueError(f"interval must be an int >= 1, got {self.interval}")

    @property
    def granularity(self) -> str:
        return "tensor"
