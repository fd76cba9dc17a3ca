"""Public runtime ops: ``fp8pass.ops.fp8_linear``, ``fp8_linears`` (one cast of a shared input) and
``swiglu_mlp`` (autograd included).

Usable without the compile backend. ``recipe=None`` means current per-tensor scaling;
``CurrentScaling(granularity=...)`` selects per-row or block scales; ``DelayedScaling(...)`` scales
from amax histories kept per weight (see :func:`fp8pass.runtime.state_for`) or in the ``state`` you
pass. The ops they call are documented in :mod:`fp8pass.runtime`.

Stochastic gradient rounding (``grad_rounding="stochastic"``, NVFP4's ``grad_stochastic_rounding``)
here draws its seeds from torch's global generator (``torch.manual_seed`` reproduces them); a compiled
model draws from per-weight streams instead (docs/backend.md, Stochastic rounding streams), as does a
``torch.ops.fp8pass.*`` op given ``sr_stream``.
"""

from __future__ import annotations

import torch

from .config import CurrentScaling, DelayedScaling, NVFP4Scaling
from .numerics import E4M3, E5M2, Format, get_format
from .op_schema import GLUKnobs, LinearKnobs, NVFP4Knobs, smooth_knob
from .passes.annotate import weight_may_be_regathered
from .runtime import (
    ACTIVATIONS,
    IDENTITY,
    HCPState,
    LinearScalingState,
    channel_scales,
    fold_channel_scales,
    hcp_state_for,
    state_for,
)
from .runtime.precast import shares_input_cast

__all__ = ["fp8_linear", "fp8_linears", "swiglu_mlp", "nvfp4_linear", "LinearScalingState", "channel_scales",
           "fold_channel_scales", "IDENTITY"]


def _fmt_name(fmt) -> str:
    return IDENTITY if fmt == IDENTITY else get_format(fmt).name


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype ``F.linear`` would compute ``x``'s product in under autocast (None: no autocast)."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


def _recipe_args(recipe, weight, state, fwd, bwd, grad_rounding, out_dtype, fast_accum=True):
    """``(x_state, w_state, g_state, LinearKnobs, state)`` for one op call."""
    if recipe is None:
        recipe = CurrentScaling()
    if isinstance(recipe, DelayedScaling):
        if state is None:
            if fwd == IDENTITY or bwd == IDENTITY:
                raise ValueError("delayed scaling needs real formats; use recipe=None with the identity format")
            state = state_for(weight, recipe, fwd, bwd)
        xs, ws, gs = state.op_args()
        if not torch.is_grad_enabled():
            gs = []  # no backward will run: do not hand grad_output state to the op
        knobs = LinearKnobs.from_recipe(recipe, fwd, bwd, grad_rounding, fast_accum, out_dtype=out_dtype)
        return xs, ws, gs, knobs, state
    if isinstance(recipe, CurrentScaling):
        if state is not None:
            raise ValueError("state= is for DelayedScaling recipes; CurrentScaling keeps no state")
        knobs = LinearKnobs.from_recipe(recipe, fwd, bwd, grad_rounding, fast_accum, out_dtype=out_dtype)
        return [], [], [], knobs, None
    raise TypeError(f"recipe must be None, fp8pass.CurrentScaling or fp8pass.DelayedScaling; got {recipe!r}")


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    recipe: CurrentScaling | DelayedScaling | None = None,
    *,
    state: LinearScalingState | None = None,
    fwd_format: Format | str = E4M3,
    bwd_format: Format | str = E5M2,
    grad_rounding: str = "nearest",
    backward: str = "fp8",
) -> torch.Tensor:
    """FP8 ``F.linear``: forward E4M3 x E4M3, backward E5M2 grads (dgrad E5M2 x E4M3, wgrad E4M3 x E5M2).

    Args:
        x: [..., in] input (bf16/fp16/fp32; any strides; empty batch allowed).
        weight: [out, in].
        bias: [out] or None; added in high precision.
        recipe: None (current per-tensor scaling), CurrentScaling or DelayedScaling.
        state: explicit LinearScalingState for DelayedScaling (default: the one kept for ``weight``).
        fwd_format, bwd_format: formats of x/W and of grad_output ("identity" turns quantization off:
            a testing hook).
        grad_rounding: "nearest" or "stochastic" for grad_output.
        backward: "fp8" or "high" (dgrad and wgrad GEMMs in high precision on the dequantized saved
            operands, ``dy`` not cast; ``fp8pass.Rule(backward=)``, docs/precision.md).

    Returns:
        ``y`` [..., out] in ``x``'s dtype (under autocast: the autocast dtype, as ``F.linear``). Under
        delayed scaling the amaxes of x and W are recorded into the state now and the amax of
        grad_output when backward runs.
    """
    fwd, bwd = _fmt_name(fwd_format), _fmt_name(bwd_format)
    xs, ws, gs, knobs, st = _recipe_args(recipe, weight, state, fwd, bwd, grad_rounding, _autocast_dtype(x))
    out = torch.ops.fp8pass.fp8_linear(x, weight, bias, xs, ws, gs, None, *knobs.replace(backward=backward).args())
    if st is not None:
        st.record_forward(out[1], out[2])
    return out[0]


def _shared_input_linears(x, weights, biases, recipe, states, fwd, bwd, grad_rounding):
    """Linears of one input from one cast of ``x`` (``fp8_cast_input`` + one ``fp8_linear_precast``
    per weight, as the compile backend emits them): ``x``'s codes are made and kept once, the weights
    recast in backward. Bit-identical to one :func:`fp8_linear` per weight under current scaling;
    under delayed scaling the cast takes the first linear's input state and its amax is recorded into
    every linear's (they all see the same tensor). Returns None where the per-linear ops are used
    instead (MX granularity; a weight FSDP2 rebuilds between forward and backward, see
    :func:`~fp8pass.passes.annotate.weight_may_be_regathered`)."""
    dtype = _autocast_dtype(x)
    args = [_recipe_args(recipe, w, st, fwd, bwd, grad_rounding, dtype) for w, st in zip(weights, states)]
    xs, knobs = args[0][0], args[0][3]
    if not shares_input_cast(knobs) or any(weight_may_be_regathered(w) for w in weights):
        return None
    x_data, x_scale, x_amax, x_alt = torch.ops.fp8pass.fp8_cast_input(x.detach(), xs, *knobs.args())
    outs = []
    for w, b, (_, ws, gs, _, st) in zip(weights, biases, args):
        y, w_amax, _ = torch.ops.fp8pass.fp8_linear_precast(x, x_data, x_scale, x_alt, w, b, ws, gs, None, *knobs.args())
        if st is not None:
            st.record_forward(x_amax, w_amax)
        outs.append(y)
    return outs


def fp8_linears(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    biases: list[torch.Tensor | None] | None = None,
    recipe: CurrentScaling | DelayedScaling | None = None,
    *,
    states: list[LinearScalingState | None] | None = None,
    fwd_format: Format | str = E4M3,
    bwd_format: Format | str = E5M2,
    grad_rounding: str = "nearest",
) -> list[torch.Tensor]:
    """Several FP8 linears of the same input (q/k/v, gate/up) with one cast of ``x``.

    ``[fp8_linear(x, w, b, ...) for w, b in zip(weights, biases)]``, bit for bit under current
    scaling, but ``x`` is cast once and its codes are saved for backward once, not once per linear
    (what the compile backend does for linears that share an input node). Under delayed scaling the
    cast uses the first linear's input scale and records ``x``'s amax into every linear's state. With
    MX granularity, or with FSDP2-managed weights (FSDP2 may rebuild them between forward and
    backward), it is the per-linear calls.

    Args:
        x: [..., in] input.
        weights: [out_i, in] each (at least one).
        biases: one [out_i] or None per weight, or None for no biases.
        recipe, fwd_format, bwd_format, grad_rounding: as for :func:`fp8_linear`, for every linear.
        states: DelayedScaling only: one LinearScalingState or None (the one kept for the weight) per weight.

    Returns:
        The outputs, one per weight, as :func:`fp8_linear` returns them.
    """
    weights = list(weights)
    if not weights:
        raise ValueError("fp8_linears needs at least one weight")
    biases = [None] * len(weights) if biases is None else list(biases)
    states = [None] * len(weights) if states is None else list(states)
    if len(biases) != len(weights) or len(states) != len(weights):
        raise ValueError(f"fp8_linears: {len(weights)} weights but {len(biases)} biases and {len(states)} states; "
                         "give one (or None) per weight")
    fwd, bwd = _fmt_name(fwd_format), _fmt_name(bwd_format)
    shared = _shared_input_linears(x, weights, biases, recipe, states, fwd, bwd, grad_rounding)
    if shared is not None:
        return shared
    return [fp8_linear(x, w, b, recipe, state=st, fwd_format=fwd_format, bwd_format=bwd_format,
                       grad_rounding=grad_rounding) for w, b, st in zip(weights, biases, states)]


def _swiglu_down(gate, up, w_down, activation, smooth, recipe, state, fwd, bwd, grad_rounding):
    xs, ws, gs, knobs, st = _recipe_args(recipe, w_down, state, fwd, bwd, grad_rounding, _autocast_dtype(gate))
    # W_down recast in backward (not its codes kept) unless FSDP2 may rebuild it in between
    knobs = GLUKnobs.from_linear(knobs, activation, smooth, not weight_may_be_regathered(w_down))
    out = torch.ops.fp8pass.swiglu_down(gate, up, w_down, xs, ws, gs, None, *knobs.args())
    if st is not None:
        st.record_forward(out[1], out[2])
    return out[0]


def swiglu_mlp(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor | None,
    w_down: torch.Tensor,
    smooth: str | None = "channel",
    recipe: CurrentScaling | DelayedScaling | None = None,
    *,
    states: dict | None = None,
    fwd_format: Format | str = E4M3,
    bwd_format: Format | str = E5M2,
    grad_rounding: str = "nearest",
    activation: str = "silu",
) -> torch.Tensor:
    """FP8 GLU MLP ``(act(x W_gate^T) * (x W_up^T)) W_down^T`` with Smooth-SwiGLU (SwiGLU by default).

    Args:
        x: [..., hidden].
        w_gate, w_up: [ffn, hidden] each; or ``w_up=None`` and ``w_gate`` the fused [2*ffn, hidden]
            gate/up weight (gate rows first, as ``chunk(2)`` splits it).
        w_down: [hidden_out, ffn].
        smooth: "channel" (paper), "token" (reference code) or None (plain FP8 SwiGLU).
        recipe: as for :func:`fp8_linear`; applies to all three GEMMs.
        states: DelayedScaling only: ``{"gate": , "up": , "down": }`` LinearScalingStates (default: the
            ones kept per weight).
        fwd_format, bwd_format, grad_rounding: as for :func:`fp8_linear`.
        activation: the gate's activation: "silu" (SwiGLU), "gelu" (GeGLU, erf), "gelu_tanh" (GeGLU,
            tanh approximation, Gemma) or "relu" (ReGLU). Non-silu activations run as eager torch
            math (no fused kernel); the smoothing and FP8 GEMMs are the same.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown GLU activation {activation!r}; valid: {', '.join(map(repr, ACTIVATIONS))}")
    smooth_knob(smooth)  # a bad mode fails here, before any GEMM
    states = states or {}
    kw = dict(fwd_format=fwd_format, bwd_format=bwd_format, grad_rounding=grad_rounding)
    if w_up is None:
        gu = fp8_linear(x, w_gate, None, recipe, state=states.get("gate"), **kw)
        gate, up = gu.chunk(2, dim=-1)
    else:
        gate, up = fp8_linears(x, [w_gate, w_up], None, recipe, states=[states.get("gate"), states.get("up")], **kw)
    return _swiglu_down(gate, up, w_down, activation, smooth, recipe, states.get("down"), _fmt_name(fwd_format),
                        _fmt_name(bwd_format), grad_rounding)


def nvfp4_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 recipe: NVFP4Scaling | None = None, hcp_state: HCPState | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` with the NVFP4 recipe (``fp8pass::nvfp4_linear``, autograd included).

    Args:
        x: ``[..., in]`` fp32/bf16/fp16; ``in`` even.
        weight: ``[out, in]``.
        bias: ``[out]`` or None.
        recipe: an :class:`fp8pass.NVFP4Scaling` (default ``NVFP4Scaling()``: RHT, SR, 2-D weight blocks).
        hcp_state: with ``recipe.hcp`` set, the HCP state to read and update (default: the state kept
            for ``weight``, :func:`fp8pass.runtime.hcp_state_for`). Every call records the input's
            per-channel error into it.
    """
    recipe = NVFP4Scaling() if recipe is None else recipe
    if not isinstance(recipe, NVFP4Scaling):
        raise TypeError(f"nvfp4_linear takes an fp8pass.NVFP4Scaling recipe, got {type(recipe).__name__}")
    hcp = recipe.hcp
    if hcp_state is not None and hcp is None:
        raise ValueError("hcp_state was given but recipe.hcp is None; set NVFP4Scaling(hcp=HotChannelPatching())")
    if hcp is not None and hcp_state is None:
        hcp_state = hcp_state_for(weight, hcp)
    args = [] if hcp is None else hcp_state.op_args()
    y, chan_err, _ = torch.ops.fp8pass.nvfp4_linear(
        x, weight, bias, args, None,  # no stream: torch's generator (docs/backend.md)
        *NVFP4Knobs.from_recipe(recipe).args())
    if hcp is not None:
        hcp_state.update(chan_err)
    return y
