"""Scales from amaxes, and the delayed-scaling amax history.

Convention (docs/numerics.md, Scales): ``data = saturating_cast(x * scale)``, ``x ~= data / scale``, and current
scaling uses ``scale = fmt.max / amax`` per group. Edge cases, each a documented safe behaviour:

* amax == 0 (an all-zero group): scale 1, so the data are zeros and the scale stays finite.
* amax == +Inf, or a finite amax >= ``HUGE_AMAX`` (2**64; its square overflows fp32, so no norm, softmax
  or loss computes with it): scale 1, as for Inf; such values saturate to +-max in the data. Keeping
  scales above ``fmt.max / 2**64`` also keeps a GEMM's ``1 / (scale_a * scale_b)`` finite in fp32.
* amax is NaN: scale 1 for FP8 formats (NaN has a code there and propagates in the data); NaN for
  E2M1, which has no NaN code, so the group dequantizes to NaN instead of silently to numbers.
* tiny amax: the scale is capped at 2**126 so ``x * scale`` never overflows to Inf.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch

from .formats import Format, get_format

if TYPE_CHECKING:  # annotations only: the recipe's fields are read; numerics imports nothing of fp8pass's at run time
    from ..scaling_recipes import DelayedScaling

__all__ = ["ROLES", "MAX_SCALE", "HUGE_AMAX", "NO_PENDING", "scale_from_amax", "power_of_two_floor",
           "DelayedScalingState", "delayed_scaling_update", "record_update", "commit_update", "amax_is_usable",
           "outgrew", "scale_to_cast"]

# The tensors of a linear that each have a scaling state (LinearScalingState, the ops' x/w/g state
# arguments and the rewriters' state placeholders, in this order; checkpoints key them by these names)
ROLES = ("input", "weight", "grad_output")

MAX_SCALE = 2.0**126
HUGE_AMAX = 2.0**64
# A recorded cast counts as an overflow when its amax was more than this factor (4 binades) past the
# range of the scale it was given: the lag after a jump. Not the usual overshoot of delayed scaling:
# measured on the tiny Llama (60 steps, history 16, margin 0), forward casts stayed within 1.19x of
# their range and gradient casts went past it by up to 8.6x (20 of 1652 casts beyond 2x).
OVERFLOW_FACTOR = 16.0
# ``pending`` of a state that holds no accumulated amax (amaxes are >= 0 or NaN, so max() with it is the amax)
NO_PENDING = -1.0


def amax_is_usable(amax: torch.Tensor) -> torch.Tensor:
    """Bool: finite and below ``HUGE_AMAX`` (NaN, Inf and huge finite amaxes are treated alike)."""
    return amax.to(torch.float32) < HUGE_AMAX  # False for NaN and +Inf too (amaxes are >= 0)


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
    ok = (amax > 0) & amax_is_usable(amax)
    fallback = torch.ones_like(scale)
    if fmt.nan_code is None:
        fallback = torch.where(torch.isnan(amax), torch.nan, fallback)
    return torch.where(ok, scale, fallback)


def outgrew(amax: torch.Tensor, scale: torch.Tensor, fmt: Format | str, factor: float = 1.0) -> torch.Tensor:
    """Bool: a usable ``amax`` past ``factor`` times the range of ``scale`` (``amax * scale > factor * fmt.max``;
    with factor 1: the cast saturates some values)."""
    amax = amax.to(torch.float32)
    return amax_is_usable(amax) & (amax * scale.to(torch.float32) > factor * get_format(fmt).max)


def scale_to_cast(state: list[torch.Tensor], amax_now: torch.Tensor, fmt: Format | str, margin: float = 0.0,
                  power_of_two: bool = False) -> torch.Tensor:
    """The scale a delayed-scaled cast uses, on device (no host read; broadcasts over expert stacks).

    ``state`` is the op list ``[amax_history, scale, steps, skipped, overflows, guard]``. The held
    scale, except: with an empty history, the current scale of ``amax_now`` (bootstrap); with the
    overflow guard on and ``amax_now`` past the held scale's range, the current scale too.
    """
    scale, steps, skipped, guard = state[1].to(torch.float32), state[2], state[3], state[5]
    current = scale_from_amax(amax_now, fmt, margin, power_of_two)
    held = (steps > skipped) & ~(guard & outgrew(amax_now, scale, fmt))
    return torch.where(held, scale, current)


def power_of_two_floor(scale: torch.Tensor) -> torch.Tensor:
    """``2**floor(log2(scale))`` for positive normal fp32 scales, exactly: keep only the exponent bits."""
    return (scale.to(torch.float32).view(torch.int32) & 0x7F800000).view(torch.float32)


def delayed_scaling_update(
    amax: torch.Tensor,
    history: torch.Tensor,
    scale: torch.Tensor,
    steps: torch.Tensor,
    skipped: torch.Tensor,
    overflows: torch.Tensor,
    recipe: DelayedScaling,
    fmt: Format | str,
):
    """One delayed-scaling step, functionally: record ``amax``, maybe recompute the scale.

    A non-finite or huge amax (see :func:`amax_is_usable`) is not written into the history (it is
    counted in ``skipped``), so a NaN, Inf or 1e30 in one step never poisons the scales of the
    following steps. ``overflows`` counts the steps whose usable amax exceeded ``OVERFLOW_FACTOR``
    (16) times the range of the scale the cast was given (``amax * scale > 16 * fmt.max``, with a
    non-empty history): the tensor outgrew its delayed scale by more than 4 binades, so its cast
    saturated its top values (or, with ``on_overflow="current"``, was recast).

    Broadcasts over leading dims, so one call updates a stack of independent states (per-expert
    scaling): ``history`` [..., H], ``amax``/``scale``/``skipped`` [...] (``amax`` may be any shape
    with that many elements; a scalar state has ``[]``), ``steps`` [...] or ``[]`` (a step count
    shared by the stack).

    Returns:
        (history, scale, steps, skipped, overflows), new tensors.
    """
    fmt = get_format(fmt)
    lead = history.shape[:-1]
    amax = amax.to(torch.float32).reshape(lead)
    finite = amax_is_usable(amax)
    rolled = torch.cat([amax.unsqueeze(-1), history[..., :-1]], dim=-1)
    new_history = torch.where(finite.unsqueeze(-1), rolled, history)
    had_valid = steps > skipped
    new_steps = steps + 1
    new_skipped = skipped + (~finite).to(skipped.dtype)
    new_overflows = overflows + (had_valid & outgrew(amax, scale, fmt, OVERFLOW_FACTOR)).to(overflows.dtype)
    reduced = new_history.amax(dim=-1) if recipe.algo == "max" else new_history[..., 0]
    recomputed = scale_from_amax(reduced, fmt, recipe.margin, recipe.power_of_two)
    first_valid = finite & ~had_valid
    update = ((new_steps % recipe.interval) == 0) | first_valid
    update = update & (new_steps > new_skipped)
    new_scale = torch.where(update, recomputed, scale)
    return new_history, new_scale, new_steps, new_skipped, new_overflows


def record_update(amax, history, scale, steps, skipped, overflows, pending, accumulate, recipe: DelayedScaling,
                  fmt: Format | str):
    """One record into a state with gradient accumulation, functionally (the runtime ops' math).

    ``pending`` holds the max of the amaxes recorded while ``accumulate`` was set (``NO_PENDING``:
    none). The recorded value is ``max(pending, amax)`` (NaN-sticky: a non-finite micro-batch makes
    the accumulated amax non-finite, so the step is skipped). With ``accumulate`` False it enters the
    history at once (:func:`delayed_scaling_update`) and ``pending`` is emptied; with ``accumulate``
    True only ``pending`` changes (:func:`commit_update` enters it later). Broadcasts like
    :func:`delayed_scaling_update`; ``accumulate`` is a bool tensor (no host read).

    Returns:
        (history, scale, steps, skipped, overflows, pending), new tensors.
    """
    amax = torch.maximum(pending, amax.to(torch.float32).reshape(pending.shape))
    h, s, n, k, o = delayed_scaling_update(amax, history, scale, steps, skipped, overflows, recipe, fmt)
    keep = accumulate
    return (torch.where(keep.unsqueeze(-1), history, h), torch.where(keep, scale, s), torch.where(keep, steps, n),
            torch.where(keep, skipped, k), torch.where(keep, overflows, o),
            torch.where(keep, amax, torch.full_like(amax, NO_PENDING)))


def commit_update(history, scale, steps, skipped, overflows, pending, recipe: DelayedScaling, fmt: Format | str):
    """Enter an accumulated ``pending`` amax into the history (a no-op where nothing is pending).

    Returns:
        (history, scale, steps, skipped, overflows, pending), new tensors (``pending`` emptied).
    """
    has = ~(pending < 0)  # True for amaxes >= 0 and for NaN
    h, s, n, k, o = delayed_scaling_update(pending, history, scale, steps, skipped, overflows, recipe, fmt)
    return (torch.where(has.unsqueeze(-1), h, history), torch.where(has, s, scale), torch.where(has, n, steps),
            torch.where(has, k, skipped), torch.where(has, o, overflows), torch.full_like(pending, NO_PENDING))


class DelayedScalingState:
    """The plain-tensor state of one delayed-scaled tensor (for example a weight's input).

    Attributes:
        amax_history: fp32 [history_len], newest entry first.
        scale: fp32 scalar, the scale the next cast uses.
        steps: int64 scalar, how many amaxes were offered to :meth:`record`.
        skipped: int64 scalar, how many of them were NaN/Inf (or huge) and left out of the history.
        overflows: int64 scalar, telemetry: how many recorded casts outgrew the scale they were
            given by more than 4 binades (``amax * scale > 16 * fmt.max``: saturated, or recast by
            the overflow guard). Counted on
            the state's device without a host sync; not part of :meth:`state_dict` (a resumed run
            counts from 0).
        guard: bool scalar, the recipe's ``on_overflow == "current"`` as the ops read it.
        pending: fp32 scalar, the max of the amaxes recorded while accumulating (``NO_PENDING``: none).
        accumulate: bool scalar; while set, records only raise ``pending`` and :meth:`commit` enters
            it into the history (gradient accumulation: one history entry per optimizer step, the
            amax over all micro-batches; see ``fp8pass.accumulate_scaling``).

    The runtime ops take the state as the list ``[getattr(state, f) for f in OP_FIELDS]``.

    With ``experts=E`` the object is a stack of E independent states (one per MoE expert): history
    [E, history_len], scale/steps/skipped [E], and :meth:`record` takes an [E] amax.

    Args:
        recipe: the DelayedScaling recipe.
        fmt: the format this tensor is cast to.
        device: where the state tensors live.
        experts: None for one state, or the number of stacked per-expert states.
    """

    OP_FIELDS = ("amax_history", "scale", "steps", "skipped", "overflows", "guard", "pending", "accumulate")
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
        self.overflows = torch.zeros(lead, dtype=torch.int64, device=device)
        self.guard = torch.tensor(recipe.on_overflow == "current", device=device)
        self.pending = torch.full(lead, NO_PENDING, dtype=torch.float32, device=device)
        self.accumulate = torch.tensor(False, device=device)

    def op_tensors(self) -> list[torch.Tensor]:
        """The live tensors in the order the runtime ops take them (``OP_FIELDS``)."""
        return [getattr(self, f) for f in self.OP_FIELDS]

    def to_device(self, device: torch.device | str) -> None:
        """Move the state to ``device`` keeping every tensor object (graphs and registries hold them)."""
        for f in self.OP_FIELDS:
            t = getattr(self, f)
            if t.device != torch.device(device):
                t.data = t.data.to(device)

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

    _UPDATED = ("amax_history", "scale", "steps", "skipped", "overflows", "pending")

    def record(self, amax: torch.Tensor) -> None:
        """Record one step's amax (in place, so compiled graphs holding these tensors see it).

        While :attr:`accumulate` is set the amax only raises :attr:`pending` (see :meth:`commit`).
        On CPU a newly skipped amax is warned about once (a host read is free there; on GPU the
        count is read when asked, ``fp8pass.monitor.scaling_telemetry``).
        """
        before = self.skipped.clone() if self.skipped.device.type == "cpu" else None
        new = record_update(amax, self.amax_history, self.scale, self.steps, self.skipped, self.overflows,
                            self.pending, self.accumulate, self.recipe, self.fmt)
        for f, v in zip(self._UPDATED, new):
            getattr(self, f).copy_(v)
        if before is not None and bool((self.skipped > before).any()):
            self.warn_skipped()

    def commit(self) -> None:
        """Enter the accumulated :attr:`pending` amax into the history (no-op when nothing is pending)."""
        new = commit_update(self.amax_history, self.scale, self.steps, self.skipped, self.overflows,
                            self.pending, self.recipe, self.fmt)
        for f, v in zip(self._UPDATED, new):
            getattr(self, f).copy_(v)

    def warn_skipped(self) -> None:
        """Warn (once per state) that NaN/Inf amaxes were left out of the history."""
        if id(self) in DelayedScalingState._warned or int(self.skipped.sum()) == 0:
            return
        DelayedScalingState._warned.add(id(self))
        warnings.warn(
            f"fp8pass: a non-finite amax (NaN/Inf, or a value >= 2**64, in the tensor) was skipped in a delayed-scaling "
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
        self.pending.fill_(NO_PENDING)  # an accumulation in progress is not part of a checkpoint

    def __repr__(self) -> str:
        if self.experts is not None:
            return (f"DelayedScalingState({self.fmt.name}, experts={self.experts}, "
                    f"scale={[round(v, 6) for v in self.scale.tolist()]}, steps={self.steps.tolist()}, "
                    f"skipped={self.skipped.tolist()})")
        return (f"DelayedScalingState({self.fmt.name}, scale={float(self.scale):.6g}, "
                f"steps={int(self.steps)}, skipped={int(self.skipped)})")
