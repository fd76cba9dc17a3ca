"""Scales from amaxes, and the delayed-scaling amax history.

Convention (docs/numerics.md, Scales): ``data = saturating_cast(x * scale)``, ``x ~= data / scale``, and current
scaling uses ``scale = fmt.max / amax`` per group. Edge cases, each a documented safe behaviour:

* amax == 0 (an all-zero group): scale 1, so the data are zeros and the scale stays finite.
* amax == +Inf: scale 1; Inf saturates to +-max in the data.
* amax is NaN: scale 1 for FP8 formats (NaN has a code there and propagates in the data); NaN for
  E2M1, which has no NaN code, so the group dequantizes to NaN instead of silently to numbers.
* tiny amax: the scale is capped at 2**126 so ``x * scale`` never overflows to Inf.
"""

from __future__ import annotations

import warnings

import torch

from ..config import DelayedScaling
from .formats import Format, get_format

__all__ = ["MAX_SCALE", "scale_from_amax", "power_of_two_floor", "DelayedScalingState", "delayed_scaling_update"]

MAX_SCALE = 2.0**126


def scale_from_amax(
    amax: torch.Tensor, fmt: Format | str, margin: float = 0.0, power_of_two: bool = False
) -> torch.Tensor:
    """Encode scale ``fmt.max / amax / 2**margin`` (fp32), with the edge cases of the module doc.

    Args:
        amax: fp32 tensor of per-group absolute maxima (any shape).
        fmt: the format the group is cast to.
        margin: lower the scale by 2**margin.
        power_of_two: round the scale down to ``2**floor(log2(scale))``.
    """
    fmt = get_format(fmt)
    amax = amax.to(torch.float32)
    target = fmt.max / (2.0**margin) if margin else fmt.max
    # Tensor / tensor: torch computes `python_float / tensor` as a reciprocal times the float, which
    # is not correctly rounded; the Triton kernels use the correctly rounded division too.
    scale = torch.clamp(torch.full_like(amax, target) / amax, max=MAX_SCALE)
    if power_of_two:
        scale = power_of_two_floor(scale)
    ok = (amax > 0) & torch.isfinite(amax)
    fallback = torch.ones_like(scale)
    if fmt.nan_code is None:
        fallback = torch.where(torch.isnan(amax), torch.nan, fallback)
    return torch.where(ok, scale, fallback)


def power_of_two_floor(scale: torch.Tensor) -> torch.Tensor:
    """``2**floor(log2(scale))`` for positive normal fp32 scales, exactly: keep only the exponent bits."""
    return (scale.to(torch.float32).view(torch.int32) & 0x7F800000).view(torch.float32)


def delayed_scaling_update(
    amax: torch.Tensor,
    history: torch.Tensor,
    scale: torch.Tensor,
    steps: torch.Tensor,
    skipped: torch.Tensor,
    recipe: DelayedScaling,
    fmt: Format | str,
):
    """One delayed-scaling step, functionally: record ``amax``, maybe recompute the scale.

    A non-finite amax is not written into the history (it is counted in ``skipped``), so a NaN or
    Inf in one step never poisons the scales of the following steps.

    Broadcasts over leading dims, so one call updates a stack of independent states (per-expert
    scaling): ``history`` [..., H], ``amax``/``scale``/``skipped`` [...] (``amax`` may be any shape
    with that many elements; a scalar state has ``[]``), ``steps`` [...] or ``[]`` (a step count
    shared by the stack).

    Returns:
        (history, scale, steps, skipped), new tensors.
    """
    lead = history.shape[:-1]
    amax = amax.to(torch.float32).reshape(lead)
    finite = torch.isfinite(amax)
    rolled = torch.cat([amax.unsqueeze(-1), history[..., :-1]], dim=-1)
    new_history = torch.where(finite.unsqueeze(-1), rolled, history)
    had_valid = steps > skipped
    new_steps = steps + 1
    new_skipped = skipped + (~finite).to(skipped.dtype)
    reduced = new_history.amax(dim=-1) if recipe.algo == "max" else new_history[..., 0]
    recomputed = scale_from_amax(reduced, fmt, recipe.margin, recipe.power_of_two)
    first_valid = finite & ~had_valid
    update = ((new_steps % recipe.interval) == 0) | first_valid
    update = update & (new_steps > new_skipped)
    new_scale = torch.where(update, recomputed, scale)
    return new_history, new_scale, new_steps, new_skipped


class DelayedScalingState:
    """The plain-tensor state of one delayed-scaled tensor (for example a weight's input).

    Attributes:
        amax_history: fp32 [history_len], newest entry first.
        scale: fp32 scalar, the scale the next cast uses.
        steps: int64 scalar, how many amaxes were offered to :meth:`record`.
        skipped: int64 scalar, how many of them were NaN/Inf and left out of the history.

    With ``experts=E`` the object is a stack of E independent states (one per MoE expert): history
    [E, history_len], scale/steps/skipped [E], and :meth:`record` takes an [E] amax.

    Args:
        recipe: the DelayedScaling recipe.
        fmt: the format this tensor is cast to.
        device: where the state tensors live.
        experts: None for one state, or the number of stacked per-expert states.
    """

    _warned: set[int] = set()

    def __init__(self, recipe: DelayedScaling, fmt: Format | str, device: torch.device | str = "cpu",
                 experts: int | None = None):
        if experts is not None and (int(experts) != experts or experts < 1):
            raise ValueError(f"experts must be None or an int >= 1, got {experts!r}")
        self.recipe = recipe
        self.fmt = get_format(fmt)
        self.experts = experts
        lead = () if experts is None else (int(experts),)
        self.amax_history = torch.zeros(*lead, recipe.history_len, dtype=torch.float32, device=device)
        self.scale = torch.ones(lead, dtype=torch.float32, device=device)
        self.steps = torch.zeros(lead, dtype=torch.int64, device=device)
        self.skipped = torch.zeros(lead, dtype=torch.int64, device=device)

    @property
    def has_history(self) -> torch.Tensor:
        """Bool tensor: at least one finite amax has been recorded."""
        return self.steps > self.skipped

    def scale_for(self, amax_now: torch.Tensor | None = None) -> torch.Tensor:
        """The scale to cast with now; with an empty history, the current amax's scale (bootstrap)."""
        if amax_now is None:
            return self.scale
        current = scale_from_amax(amax_now, self.fmt, self.recipe.margin, self.recipe.power_of_two)
        return torch.where(self.has_history, self.scale, current)

    def record(self, amax: torch.Tensor) -> None:
        """Record one step's amax (in place, so compiled graphs holding these tensors see it)."""
        h, s, n, k = delayed_scaling_update(
            amax, self.amax_history, self.scale, self.steps, self.skipped, self.recipe, self.fmt
        )
        self.amax_history.copy_(h)
        self.scale.copy_(s)
        self.steps.copy_(n)
        if self.skipped.device.type == "cpu":  # a GPU check would sync every step; see warn_skipped
            skipped_now = bool((k > self.skipped).any())
            self.skipped.copy_(k)
            if skipped_now:
                self.warn_skipped()
        else:
            self.skipped.copy_(k)

    def warn_skipped(self) -> None:
        """Warn (once per state) that NaN/Inf amaxes were left out of the history."""
        if id(self) in DelayedScalingState._warned or int(self.skipped.sum()) == 0:
            return
        DelayedScalingState._warned.add(id(self))
        warnings.warn(
            f"fp8pass: a non-finite amax (NaN/Inf in the tensor) was skipped in a delayed-scaling "
            f"history ({int(self.skipped.sum())} so far); the scale kept its last finite value. "
            f"Check the model for NaN/Inf; the count is in the state's 'skipped' entry.",
            RuntimeWarning,
            stacklevel=3,
        )

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {
            "amax_history": self.amax_history.clone(),
            "scale": self.scale.clone(),
            "steps": self.steps.clone(),
            "skipped": self.skipped.clone(),
        }

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        missing = {"amax_history", "scale", "steps", "skipped"} - set(sd)
        if missing:
            raise KeyError(f"delayed-scaling state is missing {sorted(missing)}")
        if sd["amax_history"].shape != self.amax_history.shape:
            raise ValueError(
                f"amax_history has shape {tuple(sd['amax_history'].shape)}, this recipe expects "
                f"{tuple(self.amax_history.shape)} (history_len={self.recipe.history_len})"
            )
        for k in ("amax_history", "scale", "steps", "skipped"):
            getattr(self, k).copy_(sd[k])

    def __repr__(self) -> str:
        if self.experts is not None:
            return (f"DelayedScalingState({self.fmt.name}, experts={self.experts}, "
                    f"scale={[round(v, 6) for v in self.scale.tolist()]}, steps={self.steps.tolist()}, "
                    f"skipped={self.skipped.tolist()})")
        return (f"DelayedScalingState({self.fmt.name}, scale={float(self.scale):.6g}, "
                f"steps={int(self.steps)}, skipped={int(self.skipped)})")
