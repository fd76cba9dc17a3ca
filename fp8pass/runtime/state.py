"""Delayed-scaling state of the runtime ops, and the op that records an amax into it.

The state of one delayed-scaled tensor is a :class:`fp8pass.numerics.DelayedScalingState`: plain
tensors ``[amax_history, scale, steps, skipped, overflows, guard]`` (``DelayedScalingState.OP_FIELDS``).
The ops take it as a ``list[Tensor]`` (empty list: current scaling) and never mutate it themselves
(``register_autograd`` refuses ops that declare ``mutates_args``). Recording is a separate op,
``fp8pass::delayed_record_``, that mutates the first five tensors in place (so the tensors keep their
identity: graphs, CUDA graphs and optimizers holding them see the update) and has no autograd:

* forward: the op returns the amaxes of its FP8 operands; the caller records them
  (:meth:`LinearScalingState.record_forward`, or the compile backend inserting
  ``delayed_record_`` after the op, which AOT autograd functionalizes into copies onto the graph inputs);
* backward: the op's backward formula calls ``delayed_record_`` on the ``grad_output`` state it
  received as an input (AOT autograd supports input mutations in the backward graph).

Under ``torch.no_grad`` / ``inference_mode`` no backward runs, so no grad_output amax is recorded.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from ..config import DelayedScaling
from ..numerics import E4M3, E5M2, DelayedScalingState, Format, delayed_scaling_update, get_format

__all__ = ["delayed_record_", "record", "LinearScalingState", "state_for", "grouped_state_for", "ROLES"]

ROLES = ("input", "weight", "grad_output")


@torch.library.custom_op("fp8pass::delayed_record_",
                         mutates_args=("history", "scale", "steps", "skipped", "overflows"))
def delayed_record_(
    history: torch.Tensor,
    scale: torch.Tensor,
    steps: torch.Tensor,
    skipped: torch.Tensor,
    overflows: torch.Tensor,
    guard: torch.Tensor,
    amax: torch.Tensor,
    fmt: str,
    margin: float,
    interval: int,
    algo: str,
    power_of_two: bool,
) -> None:
    """Record ``amax`` into one delayed-scaling state, in place (the recipe is passed as scalars).

    Also records a stack of per-expert states in one call: ``history`` [E, H], ``scale``/``steps``/
    ``skipped``/``overflows``/``amax`` [E] (see :func:`fp8pass.numerics.delayed_scaling_update`).
    ``guard`` is read by the casts, not here.

    CPU state: the first skipped amax and the first overflow of the process are warned about once
    each (a host read is free there). CUDA state: nothing is read back (no sync); the counters are
    reported by ``fp8pass.monitor.scaling_telemetry`` and the trainer.
    """
    if amax.numel() != scale.numel() or history.shape[:-1] != scale.shape:
        raise ValueError(f"delayed_record_: history {tuple(history.shape)} must be [..., H] with scale "
                         f"{tuple(scale.shape)} = [...] and as many amaxes, got amax {tuple(amax.shape)}")
    recipe = DelayedScaling(history_len=history.shape[-1], margin=margin, interval=interval, algo=algo,
                            power_of_two=power_of_two)
    h, s, n, k, o = delayed_scaling_update(amax, history, scale, steps, skipped, overflows, recipe, fmt)
    if steps.device.type == "cpu":
        _warn_first(skipped, k, o.sum() > overflows.sum(), fmt)
    history.copy_(h)
    scale.copy_(s)
    steps.copy_(n)
    skipped.copy_(k)
    overflows.copy_(o)


@delayed_record_.register_fake
def _(history, scale, steps, skipped, overflows, guard, amax, fmt, margin, interval, algo, power_of_two):
    return None


_WARNED: set[str] = set()  # one warning per process and kind, on the op path


def _warn_first(skipped_before, skipped_after, overflowed, fmt: str) -> None:
    if "skipped" not in _WARNED and bool((skipped_after > skipped_before).any()):
        _WARNED.add("skipped")
        warnings.warn(
            "fp8pass: a non-finite amax (NaN/Inf, or a value >= 2**64, in a tensor cast to FP8) was skipped "
            "in a delayed-scaling history; the scale kept its last finite value (warned once per process; "
            "counts per tensor: fp8pass.monitor.scaling_telemetry(model)). Check the model for NaN/Inf.",
            RuntimeWarning, stacklevel=2)
    if "overflow" not in _WARNED and bool(overflowed):
        _WARNED.add("overflow")
        warnings.warn(
            f"fp8pass: a tensor outgrew its delayed scale by more than 16x ({fmt} values past the format's max "
            f"were saturated, or recast with DelayedScaling(on_overflow='current')): delayed scaling lags a "
            f"sudden jump in magnitude (warned once per process; counts per tensor: "
            f"fp8pass.monitor.scaling_telemetry(model)).",
            RuntimeWarning, stacklevel=2)


def record(state: list[torch.Tensor], amax: torch.Tensor, fmt: Format | str, recipe: DelayedScaling) -> None:
    """Record ``amax`` into ``state`` (the op list ``DelayedScalingState.op_tensors()``) through the op."""
    torch.ops.fp8pass.delayed_record_(*state, amax.detach(), get_format(fmt).name, float(recipe.margin),
                                      int(recipe.interval), recipe.algo, bool(recipe.power_of_two))


def _tensors(s: DelayedScalingState) -> list[torch.Tensor]:
    return s.op_tensors()


@dataclass
class LinearScalingState:
    """Delayed-scaling state of one FP8 linear: its input, weight and grad_output.

    Args:
        recipe: the DelayedScaling recipe (shared by the three roles).
        device: where the state tensors live.
        fwd_format, bwd_format: formats of input/weight and of grad_output.
        experts: None for a linear; E for the grouped (MoE) ops, whose every role is a stack of E
            per-expert states (history [E, H], scale/steps/skipped [E]; each expert's step count
            advances on every call, also when the expert got no rows).

    Attributes:
        input, weight, grad_output: :class:`DelayedScalingState` each.

    ``op_args()`` gives the three ``list[Tensor]`` arguments of ``fp8pass::fp8_linear``;
    ``record_forward`` records the amaxes that op returned. The backward records grad_output itself.
    """

    recipe: DelayedScaling
    device: torch.device | str = "cpu"
    fwd_format: Format | str = E4M3
    bwd_format: Format | str = E5M2
    experts: int | None = None

    def __post_init__(self):
        fwd, bwd = get_format(self.fwd_format), get_format(self.bwd_format)
        self.input = DelayedScalingState(self.recipe, fwd, self.device, self.experts)
        self.weight = DelayedScalingState(self.recipe, fwd, self.device, self.experts)
        self.grad_output = DelayedScalingState(self.recipe, bwd, self.device, self.experts)

    def roles(self) -> dict[str, DelayedScalingState]:
        return {"input": self.input, "weight": self.weight, "grad_output": self.grad_output}

    def op_args(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """``(x_state, w_state, g_state)`` for the op: the live tensors (mutated by recording)."""
        return _tensors(self.input), _tensors(self.weight), _tensors(self.grad_output)

    def recipe_args(self) -> dict:
        """The recipe as the ops' plain scalar arguments."""
        r = self.recipe
        return {"margin": float(r.margin), "interval": int(r.interval), "algo": r.algo,
                "power_of_two": bool(r.power_of_two)}

    def record_forward(self, x_amax: torch.Tensor, w_amax: torch.Tensor) -> None:
        record(_tensors(self.input), x_amax, self.input.fmt, self.recipe)
        record(_tensors(self.weight), w_amax, self.weight.fmt, self.recipe)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Flat ``{role.field: tensor}`` (plain tensors, cloned)."""
        return {f"{role}.{k}": v for role, s in self.roles().items() for k, v in s.state_dict().items()}

    def to_device(self, device: torch.device | str) -> None:
        """Move every role's state to ``device``, keeping the tensor objects (see DelayedScalingState)."""
        for s in self.roles().values():
            s.to_device(device)

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        for role, s in self.roles().items():
            s.load_state_dict({k.split(".", 1)[1]: v for k, v in sd.items() if k.startswith(role + ".")})


_REGISTRY = WeakTensorKeyDictionary()  # weight -> LinearScalingState; keyed by identity, not value


def state_for(weight: torch.Tensor, recipe: DelayedScaling, fwd_format=E4M3, bwd_format=E5M2) -> LinearScalingState:
    """The LinearScalingState kept for ``weight`` (created on first use; freed with the weight).

    A state created under a different recipe or formats is an error rather than silently reused.
    """
    st = _REGISTRY.get(weight)
    if st is None:
        st = LinearScalingState(recipe, weight.device, fwd_format, bwd_format)
        _REGISTRY[weight] = st
        return st
    _check_same(st, recipe, fwd_format, bwd_format, weight)
    return st


def _check_same(st: LinearScalingState, recipe, fwd_format, bwd_format, weight: torch.Tensor) -> None:
    """A state made under another recipe is an error; one left on another device moves to the weight's.

    ``model.to(device)`` moves parameters in place (same objects), so the state keyed by a weight
    follows it here, when the backend compiles the moved model, instead of handing CPU scales to
    CUDA kernels.
    """
    experts = int(weight.shape[0]) if st.experts is not None else None
    if (st.recipe != recipe or st.input.fmt != get_format(fwd_format)
            or st.grad_output.fmt != get_format(bwd_format) or st.experts != experts):
        what = "this weight" if st.experts is None else f"this expert weight ({st.experts} experts)"
        raise ValueError(
            f"{what} already has delayed-scaling state for {st.recipe} "
            f"({st.input.fmt.name}/{st.grad_output.fmt.name}); pass state= explicitly to use another recipe"
        )
    if st.input.scale.device != weight.device:
        st.to_device(weight.device)


_GROUPED_REGISTRY = WeakTensorKeyDictionary()  # expert weight [E, ...] -> LinearScalingState(experts=E)


def grouped_state_for(weight: torch.Tensor, recipe: DelayedScaling, fwd_format=E4M3, bwd_format=E5M2
                      ) -> LinearScalingState:
    """Per-expert delayed-scaling state kept for a stacked expert weight ``[E, ...]`` (like :func:`state_for`).

    The state has ``experts = weight.shape[0]``; its ``op_args()`` are the ``x_state``/``w_state``/
    ``g_state`` (or ``a_state``/``b_state``/``g_state``) lists of the grouped ops.
    """
    if weight.dim() != 3:
        raise ValueError(f"grouped_state_for needs a stacked expert weight [E, rows, cols], got {tuple(weight.shape)}")
    st = _GROUPED_REGISTRY.get(weight)
    if st is None:
        st = LinearScalingState(recipe, weight.device, fwd_format, bwd_format, experts=int(weight.shape[0]))
        _GROUPED_REGISTRY[weight] = st
        return st
    _check_same(st, recipe, fwd_format, bwd_format, weight)
    return st
