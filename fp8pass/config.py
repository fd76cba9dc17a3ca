"""Scaling recipes (plain dataclasses; the bottom of the import graph).

``Config`` (what the compile backend does) sits beside the recipes; the recipes are what the
numerics core, the runtime ops and the optimizer share.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CurrentScaling", "DelayedScaling", "Config", "GRANULARITIES", "ALGOS"]

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


SMOOTH_SWIGLU = ("channel", "token", None)
COMPILERS = ("inductor", "aot_eager", "eager")
ON_GRAPH_BREAK = ("warn", "error", "ignore")
DEFAULT_KEEP_HIGH_PRECISION = ("lm_head", "output", "*embed*", "*wte*", "*wpe*")


@dataclass(frozen=True)
class Config:
    """What the ``fp8`` torch.compile backend does to a model (``fp8pass.backend(cfg)``).

    Args:
        recipe: scaling of the FP8 linears: ``DelayedScaling()`` (default, amax histories kept per
            weight and role across steps) or ``CurrentScaling()``.
        smooth_swiglu: Smooth-SwiGLU form for every matched GLU: "channel" (the paper: one scale per
            channel of the GLU output, folded into the down-projection weight), "token" (the
            authors' reference code: one scale per token) or None (plain FP8 down projection).
        keep_high_precision: fnmatch globs; a linear whose weight FQN, or the FQN of the module that
            calls it, matches any of them stays in the model's dtype. The default keeps the LM head
            (HF ``lm_head``, torchtitan ``output``) and embeddings, as the paper does.
        min_dim: linears with in- or out-features below this stay high precision (the FP8 casts cost
            more than they save on tiny GEMMs).
        dim_multiple: FP8 GEMMs need both feature dims divisible by this (16 for ``_scaled_mm``);
            other linears stay high precision. 1 disables the check.
        grad_stochastic_rounding: round gradients (E5M2) stochastically instead of to nearest even.
        fwd_format, bwd_format: formats of the forward operands (input, weight) and of the gradient
            (``"e4m3"`` / ``"e5m2"``; ``"e4m3_gaudi"`` for Gaudi2's range). ``"identity"`` turns
            quantization off inside the same ops (a testing hook: the rewritten model then computes
            the original math).
        compiler: what compiles the rewritten graph: "inductor" (default), "aot_eager" (AOT autograd
            without code generation, quick; useful for debugging) or "eager" (run the rewritten FX
            graph as is).
        on_graph_break: what to do when a graph break splits a GLU across graphs: "warn" (default:
            warn, report it in ``explain``, keep the split GLU's linears in high precision),
            "error" (raise) or "ignore" (same handling, no warning).
    """

    recipe: CurrentScaling | DelayedScaling = DelayedScaling()
    smooth_swiglu: str | None = "channel"
    keep_high_precision: tuple[str, ...] = DEFAULT_KEEP_HIGH_PRECISION
    min_dim: int = 16
    dim_multiple: int = 16
    grad_stochastic_rounding: bool = True
    fwd_format: str = "e4m3"
    bwd_format: str = "e5m2"
    compiler: str = "inductor"
    on_graph_break: str = "warn"

    def __post_init__(self):
        if not isinstance(self.recipe, (CurrentScaling, DelayedScaling)):
            raise TypeError(
                f"recipe must be fp8pass.DelayedScaling(...) or fp8pass.CurrentScaling(...), "
                f"got {type(self.recipe).__name__}"
            )
        _check_choice("smooth_swiglu", self.smooth_swiglu, SMOOTH_SWIGLU)
        _check_choice("compiler", self.compiler, COMPILERS)
        _check_choice("on_graph_break", self.on_graph_break, ON_GRAPH_BREAK)
        keep = self.keep_high_precision
        if isinstance(keep, str):  # a lone glob would otherwise be iterated character by character
            keep = (keep,)
        keep = tuple(keep)
        if not all(isinstance(k, str) for k in keep):
            raise TypeError(f"keep_high_precision must be FQN glob strings, got {keep!r}")
        object.__setattr__(self, "keep_high_precision", keep)
        for name in ("fwd_format", "bwd_format"):
            v = getattr(self, name)
            if not isinstance(v, str):
                v = getattr(v, "name", v)  # a numerics Format object
                object.__setattr__(self, name, v)
            if v != "identity":
                from .numerics.formats import get_format  # formats import nothing from config

                if get_format(v).torch_dtype is None:
                    raise ValueError(f"{name} must be an FP8 format (e4m3, e4m3_gaudi, e5m2) or "
                                     f"'identity', got {v!r}")
        for name in ("min_dim", "dim_multiple"):
            v = getattr(self, name)
            if int(v) != v or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
