"""Loss scaling for fp16 compute: static or dynamic, with the optimizer step skipped on overflow.

fp16 has 5 exponent bits: small gradients flush to zero, large ones overflow to inf. The loss is
multiplied by ``scale`` before backward (so the gradients that flow through fp16 ops are ``scale``
times larger) and the parameter gradients are divided by it before clipping and the step. When a
gradient is inf/NaN after backward the step is skipped (weights and optimizer state untouched) and
counted. The dynamic scaler halves the scale on every overflow (it may go below 1, which also cures
overflow of large gradients) and doubles it after ``growth_interval`` clean steps.
"""

from __future__ import annotations

import math

import torch

__all__ = ["LossScaler", "parse_loss_scale"]


def parse_loss_scale(value) -> str | float | None:
    """``None`` (off), ``"dynamic"`` / ``"dynamic:<initial scale>"`` or a static scale (a finite float > 0,
    also given as text); ValueError otherwise."""
    if value is None or value == "dynamic":
        return value
    if isinstance(value, str) and value.startswith("dynamic:"):
        _positive(value[len("dynamic:"):], value)
        return value
    return _positive(value, value)


def _positive(text, value) -> float:
    try:
        scale = float(text)
    except (TypeError, ValueError):
        scale = float("nan")
    if isinstance(text, bool) or not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"loss_scale must be 'dynamic', 'dynamic:<initial scale>' or a finite number > 0 "
                         f"(a static scale), got {value!r}")
    return scale


class LossScaler:
    """Scale the loss, unscale the gradients, skip and count overflowing steps.

    Args:
        mode: "dynamic", "dynamic:<initial scale>" or a static scale (float > 0).
        init_scale: the dynamic scaler's first scale (2**16 as in torch.amp.GradScaler), unless the
            mode names one.
        growth_factor, backoff_factor: multiply the scale by these after ``growth_interval`` clean
            steps / after an overflow (dynamic only).
        growth_interval: clean steps between growths.

    Usage per optimizer step: ``scaler.scale(loss).backward()`` (for each micro-batch), then
    ``ok = scaler.unscale_(params)``, clip, ``if ok: opt.step()``, ``scaler.update(ok)``.
    """

    def __init__(self, mode, *, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        mode = parse_loss_scale(mode)
        if mode is None:
            raise ValueError("LossScaler needs 'dynamic' or a static scale; use no scaler to turn it off")
        if not (growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1 and init_scale > 0):
            raise ValueError("need growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1, init_scale > 0")
        self.dynamic = isinstance(mode, str)
        if self.dynamic and mode != "dynamic":
            init_scale = float(mode[len("dynamic:"):])
        self.scale_value = float(init_scale if self.dynamic else mode)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.clean_steps = 0
        self.skipped = 0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_value

    @torch.no_grad()
    def unscale_(self, params) -> bool:
        """Divide the gradients by the scale in place; True when all are finite (one host sync)."""
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return True
        inv = 1.0 / self.scale_value
        torch._foreach_mul_(grads, inv)
        finite = torch.stack([torch.isfinite(g).all() for g in grads]).all()
        return bool(finite)

    def state_dict(self) -> dict:
        """What a resumed run needs to continue exactly: the scale, the clean-step count, the skips."""
        return {"scale": self.scale_value, "clean_steps": self.clean_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s values; ValueError naming the entry when one is invalid."""
        if not isinstance(state, dict) or set(state) != {"scale", "clean_steps", "skipped"}:
            raise ValueError(f"loss scaler state: expected the keys clean_steps, scale, skipped, got "
                             f"{sorted(state) if isinstance(state, dict) else type(state).__name__}")
        scale = state["scale"]
        if type(scale) is not float or not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"loss scaler state: scale must be a finite float > 0, got {scale!r}")
        for key in ("clean_steps", "skipped"):
            if type(state[key]) is not int or state[key] < 0:
                raise ValueError(f"loss scaler state: {key} must be an integer >= 0, got {state[key]!r}")
        if self.dynamic and state["clean_steps"] >= self.growth_interval:
            raise ValueError(f"loss scaler state: clean_steps {state['clean_steps']} >= growth_interval "
                             f"{self.growth_interval} (the scale would already have grown)")
        if not self.dynamic and scale != self.scale_value:
            raise ValueError(f"loss scaler state: saved static scale {scale!r} differs from this run's "
                             f"{self.scale_value!r}")
        self.scale_value, self.clean_steps, self.skipped = scale, state["clean_steps"], state["skipped"]

    def update(self, finite: bool) -> None:
        """After the step: count a skip; the dynamic scale backs off on overflow, grows when clean."""
        if not finite:
            self.skipped += 1
            self.clean_steps = 0
            if self.dynamic:
                self.scale_value *= self.backoff_factor
            return
        self.clean_steps += 1
        if self.dynamic and self.clean_steps >= self.growth_interval:
            self.scale_value *= self.growth_factor
            self.clean_steps = 0
