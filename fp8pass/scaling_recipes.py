"""The scaling recipes: how a tensor's FP8/NVFP4 scale is chosen (plain dataclasses; the bottom of the import graph).

``DelayedScaling`` (from an amax history), ``CurrentScaling`` (from the tensor itself, per tensor,
row, block or MX block), ``NVFP4Scaling`` (with ``HotChannelPatching``). They are what the numerics
core, the runtime ops and the optimizer share; ``fp8pass.config.Config`` holds one, and the named
recipes (``recipes.py``) are built from them.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

__all__ = ["CurrentScaling", "DelayedScaling", "NVFP4Scaling", "HotChannelPatching", "GRANULARITIES", "ALGOS",
           "ON_OVERFLOW", "HCP_MODES", "PROTECTED_PRECISIONS", "POST_QK_PATTERNS"]

GRANULARITIES = ("tensor", "row", "block", "mx")
ALGOS = ("max", "most_recent")
ON_OVERFLOW = ("saturate", "current")


# One validation style for every public argument: the error names the argument, the value and what
# is allowed. Types are checked exactly: True passes `int(v) == v`, and "no" is truthy.

def _check_choice(what: str, value, valid) -> None:
    if value not in valid:
        raise ValueError(f"unknown {what} {value!r}; valid: {', '.join(map(str, valid))}")


def _symbolic(value) -> bool:
    """A torch.SymInt / SymFloat: Dynamo rebuilds recipes with them while tracing; the concrete recipe
    they stand for was checked when it was made, and comparing them would add guards."""
    return type(value).__name__ in ("SymInt", "SymFloat")


def _check_int(what: str, value, lo: int, meaning: str = "") -> None:
    """``value`` is an integer (not a bool, not a float) >= ``lo``."""
    if _symbolic(value):
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < lo:
        raise ValueError(f"{what} must be an int >= {lo}{meaning}, got {value!r}")


def _check_bool(what: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{what} must be True or False, got {value!r}")


def _check_number(what: str, value, lo: float, hi: float, hi_open: bool = False, meaning: str = "") -> None:
    """``value`` is a finite real number in ``[lo, hi]`` (``[lo, hi)`` with ``hi_open``)."""
    if _symbolic(value):
        return
    ok = (not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)
          and lo <= value and (value < hi if hi_open else value <= hi))
    if not ok:
        raise ValueError(f"{what} must be a number in [{lo}, {hi}{')' if hi_open else ']'}{meaning}, got {value!r}")


@dataclass(frozen=True)
class CurrentScaling:
    """Scale every tensor from its own amax, at the moment it is cast.

    Args:
        granularity: "tensor", "row" (per row of the last dim: per token / per output channel),
            "block" (1 x block tiles for activations, block x block for weights) or "mx" (OCP MXFP8:
            32 elements along each GEMM's reduction dim share a power-of-two E8M0 scale;
            docs/numerics.md, MX).
        block: tile edge for "block" granularity (128 for FP8, as in DeepSeek-V3); "mx" blocks are
            always 32 (leave ``block`` at its default or set 32).
        power_of_two: round scales down to a power of two, ``2**floor(log2(max / amax))``.
    """

    granularity: str = "tensor"
    block: int = 128
    power_of_two: bool = False

    def __post_init__(self):
        _check_choice("granularity", self.granularity, GRANULARITIES)
        _check_int("CurrentScaling.block", self.block, 1, " (the tile edge)")
        _check_bool("CurrentScaling.power_of_two", self.power_of_two)
        if self.granularity == "mx" and self.block not in (32, 128):
            raise ValueError(f"MX blocks are 32 elements (OCP MX v1.0); leave block at its default, got {self.block}")


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
        on_overflow: what a cast does when the tensor outgrew its delayed scale (``amax * scale`` past
            the format's max, the lag of delayed scaling after a jump): "saturate" (default, as
            Transformer Engine: values past the range clip to +-max, the next steps' scales catch up)
            or "current" (the overflow guard: that cast uses the tensor's own current scale instead;
            it costs one amax pass before each delayed-scaled cast on CPU, none extra on GPU).
            Either way the event is counted in the state's ``overflows`` (see ``fp8pass.monitor``).
    """

    history_len: int = 16
    margin: float = 0.0
    interval: int = 1
    algo: str = "max"
    power_of_two: bool = False
    on_overflow: str = "saturate"

    def __post_init__(self):
        _check_choice("algo", self.algo, ALGOS)
        _check_choice("on_overflow", self.on_overflow, ON_OVERFLOW)
        _check_int("DelayedScaling.history_len", self.history_len, 1)
        _check_int("DelayedScaling.interval", self.interval, 1)
        # 2**margin divides the scale: past 64 the headroom is absurd and fp32 scales underflow to 0
        _check_number("DelayedScaling.margin", self.margin, 0, 64, meaning=" (the scale is divided by 2**margin)")
        _check_bool("DelayedScaling.power_of_two", self.power_of_two)

    @property
    def granularity(self) -> str:
        return "tensor"


HCP_MODES = ("split", "concat")
PROTECTED_PRECISIONS = ("high", "fp8")
POST_QK_PATTERNS = ("*v_proj", "*o_proj", "*wv", "*wo", "*out_proj", "*c_proj")


@dataclass(frozen=True)
class HotChannelPatching:
    """Hot-channel patching (HCP) of an NVFP4 linear's GEMMs.

    Per linear and input channel ``c``, the error that quantizing both operands puts into the forward
    GEMM through that channel, ``||X_c W_c^T - Q(X)_c Q(W)_c^T||_F**2`` (columns ``c`` of X and W), is
    kept as an exponential moving average; every ``update_interval`` steps the ``fraction`` of
    channels with the largest error become "hot" and their residual is added back in high precision:
    ``dX_h Q(W)_h^T + Q(X)_h dW_h^T`` (first order) ``+ dX_h dW_h^T`` (second order). With
    ``backward`` the two gradient GEMMs are patched at the same channels (columns ``h`` of dX and dW).
    The seed document's S-O2-B mode is ``mode="concat", second_order=True, backward=True``.

    Args:
        fraction: share of input channels patched (0 <= fraction <= 1; 0.09 as in the seed document).
        update_interval: steps between refreshes of the hot set (the first step always chooses one).
        decay: EMA decay of the per-channel error (0 <= decay < 1).
        second_order: also add the ``dX_h dW_h^T`` term (then fraction=1 gives the exact GEMM).
        mode: "split" (a second small GEMM added to the output) or "concat" (one GEMM over
            ``[Q(X) | dX_h | Q(X)_h]`` and ``[Q(W) | W_h | dW_h]``); same result to fp32 rounding.
        backward: also patch the hot channels' columns of the dgrad and wgrad GEMMs (docs/nvfp4.md).
    """

    fraction: float = 0.09
    update_interval: int = 1000
    decay: float = 0.9
    second_order: bool = True
    mode: str = "split"
    backward: bool = True

    def __post_init__(self):
        _check_number("HotChannelPatching.fraction", self.fraction, 0, 1)
        _check_int("HotChannelPatching.update_interval", self.update_interval, 1)
        _check_number("HotChannelPatching.decay", self.decay, 0, 1, hi_open=True)
        _check_bool("HotChannelPatching.second_order", self.second_order)
        _check_bool("HotChannelPatching.backward", self.backward)
        _check_choice("HCP mode", self.mode, HCP_MODES)

    def num_hot(self, channels: int) -> int:
        """Hot channels of a linear with ``channels`` input features (rounded to nearest)."""
        return min(channels, int(round(self.fraction * channels)))


@dataclass(frozen=True)
class NVFP4Scaling:
    """NVFP4 training recipe: E2M1 elements, E4M3 scales per 16 elements, one fp32 scale per tensor.

    Activations and gradients use 1x16 blocks along the GEMM's reduction dim; weights 16x16 blocks
    (``weight_2d``) so W and W^T quantize identically in forward and backward. Forward rounds to
    nearest even; gradients round stochastically (``grad_stochastic_rounding``). The weight-gradient
    GEMM's operands get a 16x16 random Hadamard transform along the token dim (``rht``).

    Keep-high-precision policy (compile backend): the LM head (``Config.keep_high_precision``), the
    last blocks (``keep_last_blocks``: 4, the seed document's rule; or, with ``keep_last_blocks=None``,
    the count closest to ``keep_last_fraction`` of the block linears, NVIDIA's ~15%) and, with
    ``protect_post_qk``, the attention value/output projections (``post_qk_patterns``) stay in the
    model dtype (``protected_precision="high"``) or become FP8 linears with current scaling ("fp8").

    Args:
        rht: random Hadamard transform on the wgrad GEMM operands.
        rht_seed: seed of the transform's random signs (the same for every layer).
        grad_stochastic_rounding: stochastic rounding of the gradients (dgrad and wgrad operands).
        weight_2d: 16x16 weight blocks; False quantizes W (1x16 along in-features) and W^T (1x16 along
            out-features) separately, an ablation.
        keep_last_blocks: number of final transformer blocks kept out of NVFP4 (4: "the last 4
            layers in BF16" of the seed document); None: derive it from ``keep_last_fraction``.
        keep_last_fraction: with ``keep_last_blocks=None``, the share of the block linears kept
            (0.15: ~15% of the linears, NVIDIA's recipe).
        protect_post_qk: keep the projections matching ``post_qk_patterns`` out of NVFP4.
        post_qk_patterns: fnmatch globs on the module FQN of value/output projections.
        protected_precision: "high" (the model dtype) or "fp8" (E4M3/E5M2 current scaling).
        hcp: a :class:`HotChannelPatching`, or None (off).
    """

    rht: bool = True
    rht_seed: int = 0
    grad_stochastic_rounding: bool = True
    weight_2d: bool = True
    keep_last_blocks: int | None = 4
    keep_last_fraction: float = 0.15
    protect_post_qk: bool = True
    post_qk_patterns: tuple[str, ...] = POST_QK_PATTERNS
    protected_precision: str = "high"
    hcp: HotChannelPatching | None = None

    def __post_init__(self):
        if self.keep_last_blocks is not None:
            _check_int("NVFP4Scaling.keep_last_blocks", self.keep_last_blocks, 0, " or None")
        _check_number("NVFP4Scaling.keep_last_fraction", self.keep_last_fraction, 0, 1)
        _check_int("NVFP4Scaling.rht_seed", self.rht_seed, 0)
        for name in ("rht", "grad_stochastic_rounding", "weight_2d", "protect_post_qk"):
            _check_bool(f"NVFP4Scaling.{name}", getattr(self, name))
        _check_choice("protected_precision", self.protected_precision, PROTECTED_PRECISIONS)
        if self.hcp is not None and not isinstance(self.hcp, HotChannelPatching):
            raise TypeError(f"hcp must be a HotChannelPatching or None, got {type(self.hcp).__name__}")
        pats = (self.post_qk_patterns,) if isinstance(self.post_qk_patterns, str) else tuple(self.post_qk_patterns)
        object.__setattr__(self, "post_qk_patterns", pats)

    @property
    def granularity(self) -> str:
        return "block"

    @property
    def power_of_two(self) -> bool:
        return False
