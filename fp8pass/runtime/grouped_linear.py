"""``fp8pass::fp8_grouped_linear``: MoE expert projections ``y_g = x_g W_e^T`` with per-expert FP8 scales.

The tokens routed to E experts arrive as one 2-D tensor ``x`` [S, K] whose rows are sorted by expert;
``offs`` (int32 [E]) holds the cumulative END row of each expert's group, exactly as
``torch._grouped_mm(x, w, offs=offs)`` takes it: group e is rows ``offs[e-1]:offs[e]`` (``offs[-1]``
for e = 0 is 0), groups may be empty, and rows past ``offs[-1]`` (padding) give zeros in ``y`` and
get zero gradient. Expert weights are stacked: ``[E, N, K]`` (each expert an ``nn.Linear`` weight,
``y_g = x_g W_e^T``) or, with ``w_transposed``, ``[E, K, N]`` (``y_g = x_g W_e``).

Scaling is per expert (:mod:`.grouped_casting`): ``x_amax``/``w_amax`` [E], ``dy`` in backward
likewise. Delayed scaling keeps a stack of E states per role (history [E, H], scale/steps/skipped
[E]; :func:`fp8pass.runtime.grouped_state_for`), read by the ops and recorded by the same
``fp8pass::delayed_record_`` op as the dense ops (it broadcasts over the expert dim). Saved for
backward: the FP8 codes (1 byte/element) and the [E] scales.

The static knobs are :class:`~fp8pass.op_schema.GroupedLinearKnobs` (the schema's last arguments, declared
once). ``out_dtype`` (the replaced node's dtype, passed by the rewrite; None: the input's) is the dtype
the op computes and outputs in, as for ``fp8_linear``: under autocast(bf16) the outputs are bf16
whatever the inputs' dtype, the GEMMs of both passes round to it (CPU: bf16 GEMMs of the codes where
this CPU's bf16 matmul is native, :func:`fp8pass.kernels.cpu.gemm_dtype`), each gradient takes
its input's dtype, and autocast is off inside the op (:func:`~fp8pass.op_schema.knob_op`).

Kernels (:mod:`fp8pass.kernels`): CPU = compiled per-row casts + one GEMM per group on the
upcast codes; CUDA = one ``torch._scaled_grouped_mm`` per GEMM (forward, dgrad, wgrad; E4M3 gradients,
:func:`.grouped_casting.grad_format`) where available, else its sync-free emulation; no host sync.
The GLU tail of an expert MLP is :mod:`.grouped_swiglu`.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import kernels
from ..numerics import DelayedScalingState
from ..op_schema import SR_SEED, SR_STREAM, GroupedLinearKnobs, knob_op
from .casting import as_bytes, from_bytes, resolve_format, unaliased
from .grouped_casting import GroupedOperand, cast_experts, cast_grouped_rows, casts_both_layouts, grad_format
from .linear import FLOAT_DTYPES, check_recipe_knobs, compute_dtype, record_grad_amax
from .sr import draw_seed

__all__ = ["fp8_grouped_linear_op", "check_grouped_knobs", "record_grouped_grad_amax", "check_grouped_tensors",
           "check_grouped_linear_args", "out_features", "weight_operands", "saved_weight_like", "dgrad_b",
           "wgrad"]


def check_grouped_knobs(k: GroupedLinearKnobs) -> None:
    """Clear errors for bad knob values of the grouped ops (shared by the linear and GLU ops): the
    dense ops' checks of the knobs they have in common (the grouped ops have no granularity/block)."""
    check_recipe_knobs(k)


def check_grouped_tensors(op, x, weight, offs) -> None:
    """Clear errors for grouped rows ``x`` [S, K], stacked weights [E, rows, cols] and ``offs``."""
    if x.dim() != 2:
        raise ValueError(f"{op}: needs 2-D rows grouped by expert [S, K], got {tuple(x.shape)}")
    if weight.dim() != 3:
        raise ValueError(f"{op}: needs stacked expert weights [E, rows, cols], got {tuple(weight.shape)}")
    if offs.dim() != 1 or offs.dtype != torch.int32 or offs.numel() != weight.shape[0]:
        raise ValueError(f"{op}: offs must be int32 [E] = [{weight.shape[0]}] cumulative group ends, got "
                         f"{offs.dtype} {tuple(offs.shape)}")
    for name, t in (("x", x), ("weight", weight)):
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{op}: {name} must be float16/bfloat16/float32/float64, got {t.dtype}")


def check_states(op, names, states, experts) -> None:
    """Each delayed state is [] or the per-expert op list (``DelayedScalingState.OP_FIELDS``, [E] scales)."""
    for name, state in zip(names, states):
        if state and (len(state) != len(DelayedScalingState.OP_FIELDS) or tuple(state[1].shape) != (experts,)):
            raise ValueError(f"{op}: {name} must be [] or [history [E, H], scale [E], steps, skipped, overflows, "
                             f"guard] with E = {experts}; got {[tuple(t.shape) for t in state]}")


def out_features(weight, w_transposed):
    """(contraction, output) sizes of one expert of a stacked weight (or its saved codes)."""
    return (weight.shape[1], weight.shape[2]) if w_transposed else (weight.shape[2], weight.shape[1])


def check_grouped_linear_args(x, weight, offs, w_transposed, states) -> None:
    """Clear errors for bad tensor arguments of ``fp8_grouped_linear`` (the knobs: :func:`check_grouped_knobs`)."""
    op = "fp8_grouped_linear"
    check_grouped_tensors(op, x, weight, offs)
    k, _ = out_features(weight, w_transposed)
    if x.shape[1] != k:
        layout = "[E, K, N]" if w_transposed else "[E, N, K]"
        raise ValueError(f"{op}: x has {x.shape[1]} features, weight {tuple(weight.shape)} ({layout}, "
                         f"w_transposed={w_transposed}) expects K = {k}")
    check_states(op, ("x_state", "w_state", "g_state"), states, weight.shape[0])


def weight_operands(wo: GroupedOperand, kern, dt, w_transposed):
    """The expert weight's cast as the forward GEMM takes it (the ``[E, N, K]`` right operand of
    ``a @ b^T``) and the codes the op saves for the backward (the weight's shape).

    The grouped FP8 GEMM reads each expert's ``b`` row-major: the forward wants ``[E, N, K]`` rows, the
    dgrad ``[E, K, N]`` ones. Where the cast wrote both layouts (``wo.data_t``) each GEMM reads one as
    written: for an ``[E, N, K]`` weight the saved codes are ``data_t``'s ``[E, K, N]`` rows seen as the
    weight's shape (a transposed view, which :func:`dgrad_b` turns back into contiguous rows); for an
    ``[E, K, N]`` weight the forward reads ``data_t``. Elsewhere one of the two GEMMs copies the codes.
    :func:`saved_weight_like` is the fake of the saved codes."""
    if wo.data_t is None:
        data = wo.gemm_input(kern, dt)
        return (data.transpose(1, 2) if w_transposed else data), wo.data
    if w_transposed:
        return wo.data_t, wo.data
    return wo.data, wo.data_t.transpose(1, 2)


def saved_weight_like(weight, fmt, w_transposed, dtype):
    """An empty tensor with the shape and strides of the codes :func:`weight_operands` saves."""
    if not w_transposed and casts_both_layouts(weight, fmt):
        e, n, k = weight.shape
        return weight.new_empty(e, k, n, dtype=dtype).transpose(1, 2)
    return weight.new_empty(weight.shape, dtype=dtype)


def dgrad_b(w, w_transposed):
    """The expert weight as the ``[E, K, N]`` right operand of ``dy @ b^T`` (input gradient)."""
    return w if w_transposed else w.transpose(1, 2)


def wgrad(kern, xo_data, xo_scale, go_data, go_scale, offs, w_transposed, out_dtype, x_div=None):
    """Per-expert weight gradient in the weight's layout: ``dy_g^T x_g`` [N, K] or ``x_g^T dy_g`` [K, N];
    ``x_div`` [E, K] (fp32 powers of two): its K dim divided by them, in the GEMM's decode scales."""
    if w_transposed:
        return kern.grouped_gemm_wgrad(xo_data, xo_scale, go_data, go_scale, offs, out_dtype, a_div=x_div)
    return kern.grouped_gemm_wgrad(go_data, go_scale, xo_data, xo_scale, offs, out_dtype, b_div=x_div)


def record_grouped_grad_amax(g_state, g_amax, k) -> None:
    """The backward's record of the gradient's [E] amax, in the format the gradient was cast to."""
    record_grad_amax(g_state, g_amax, dataclasses.replace(k, bwd_format=grad_format(k.bwd_format, g_amax.device)))


def _knobs(args) -> GroupedLinearKnobs:
    return GroupedLinearKnobs.of(args, check_grouped_knobs)


@knob_op("fp8pass::fp8_grouped_linear",
         "Tensor x, Tensor weight, Tensor offs, bool w_transposed, Tensor[] x_state, Tensor[] w_state, "
         f"Tensor[] g_state, {SR_STREAM}", GroupedLinearKnobs, "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
def fp8_grouped_linear_op(x, weight, offs, w_transposed, x_state, w_state, g_state, sr_stream, *knobs):
    """Returns ``(y, x_amax, w_amax, x_data, x_scale, w_data, w_scale)``; see the module doc."""
    k = _knobs(knobs)
    check_grouped_linear_args(x, weight, offs, w_transposed, (x_state, w_state, g_state))
    fmt = resolve_format(k.fwd_format)
    dt = compute_dtype(k, x.dtype)
    if fmt is None:  # identity: the values themselves, in the dtype the replaced node computed in
        x, weight = x.to(dt), weight.to(dt)
    kern = kernels.for_device(x.device)
    xo = cast_grouped_rows(x, offs, fmt, x_state, k.margin, k.power_of_two, gemm_out=dt)
    wo = cast_experts(weight, fmt, w_state, k.margin, k.power_of_two, gemm_out=dt)
    # the weight's row decode scales are the GEMM's column scales where its rows are the GEMM's N
    w_fwd, w_saved = weight_operands(wo, kern, dt, w_transposed)
    y = kern.grouped_gemm(xo.gemm_input(kern, dt), xo.scale, w_fwd, wo.scale, offs, dt, fast_accum=k.fast_accum,
                          a_row_inv=xo.row_inv, a_row_pad=xo.row_pad, b_row_inv=None if w_transposed else wo.row_inv)
    states = (x_state, w_state)  # a scale is a fresh tensor unless taken from a state: copied only then
    return (y, xo.amax, wo.amax, as_bytes(xo.data), unaliased(xo.scale, states), as_bytes(w_saved),
            unaliased(wo.scale, states))


@fp8_grouped_linear_op.register_fake
def _(x, weight, offs, w_transposed, x_state, w_state, g_state, sr_stream, *knobs):
    k = _knobs(knobs)
    check_grouped_linear_args(x, weight, offs, w_transposed, (x_state, w_state, g_state))
    fmt = resolve_format(k.fwd_format)
    dt = compute_dtype(k, x.dtype)
    experts = weight.shape[0]
    _, n = out_features(weight, w_transposed)
    f32 = dict(dtype=torch.float32, device=x.device)
    return (x.new_empty(x.shape[0], n, dtype=dt), torch.empty(experts, **f32), torch.empty(experts, **f32),
            x.new_empty(x.shape, dtype=dt if fmt is None else torch.uint8), torch.empty(experts, **f32),
            saved_weight_like(weight, fmt, w_transposed, dt if fmt is None else torch.uint8),
            torch.empty(experts, **f32))


@knob_op("fp8pass::fp8_grouped_linear_backward",
         "Tensor dy, Tensor x_data, Tensor x_scale, Tensor w_data, Tensor w_scale, Tensor offs, Tensor[] g_state, "
         f"{SR_SEED}, bool w_transposed, ScalarType x_dtype, ScalarType w_dtype", GroupedLinearKnobs,
         "(Tensor, Tensor, Tensor)")
def fp8_grouped_linear_backward_op(dy, x_data, x_scale, w_data, w_scale, offs, g_state, sr_seed, w_transposed,
                                   x_dtype, w_dtype, *knobs):
    """``(dx, dW, dy_amax [E])`` from ``dy`` and the saved FP8 operands (no state mutation). The GEMMs
    round to the forward's compute dtype, then each gradient takes its input's dtype (as autocast's
    backward does)."""
    k = _knobs(knobs)
    fmt = resolve_format(grad_format(k.bwd_format, dy.device))
    x_data = from_bytes(x_data, resolve_format(k.fwd_format))
    w_data = from_bytes(w_data, resolve_format(k.fwd_format))
    dt = compute_dtype(k, x_dtype)
    kern = kernels.for_device(dy.device)
    go = cast_grouped_rows(dy, offs, fmt, g_state, k.margin, k.power_of_two, k.grad_rounding, gemm_out=dt,
                           keep_codes=False, seed=sr_seed)
    g_in = go.gemm_input(kern, dt)
    dx = kern.grouped_gemm(g_in, go.scale, dgrad_b(w_data, w_transposed), w_scale, offs, dt,
                           a_row_inv=go.row_inv, a_row_pad=go.row_pad).to(x_dtype)
    dw = wgrad(kern, x_data, x_scale, g_in, go.scale, offs, w_transposed, dt).to(w_dtype)
    return dx, dw, go.amax


@fp8_grouped_linear_backward_op.register_fake
def _(dy, x_data, x_scale, w_data, w_scale, offs, g_state, sr_seed, w_transposed, x_dtype, w_dtype, *knobs):
    return (dy.new_empty(x_data.shape, dtype=x_dtype), dy.new_empty(w_data.shape, dtype=w_dtype),
            dy.new_empty(w_data.shape[0], dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    x, weight, offs, w_transposed, x_state, w_state, g_state = inputs[:7]
    _, _, _, x_data, x_scale, w_data, w_scale = output
    ctx.save_for_backward(x_data, x_scale, w_data, w_scale, offs)
    ctx.set_materialize_grads(False)  # no zero-filled gradients for the saved codes (never differentiated)
    ctx.g_state = list(g_state)
    ctx.sr_stream = inputs[7]
    ctx.n_states = (len(x_state), len(w_state), len(g_state))
    ctx.w_transposed = w_transposed
    ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
    ctx.knobs = GroupedLinearKnobs.take(inputs)  # validated by the forward


def _backward(ctx, dy, *unused):
    k = ctx.knobs
    x_data, x_scale, w_data, w_scale, offs = ctx.saved_tensors
    if dy is None:  # only the amaxes or codes were used: y's gradient is zero
        dy = x_data.new_zeros(x_data.shape[0], out_features(w_data, ctx.w_transposed)[1],
                              dtype=compute_dtype(k, ctx.x_dtype))
    dx, dw, g_amax = torch.ops.fp8pass.fp8_grouped_linear_backward(
        dy, *ctx.saved_tensors, ctx.g_state, draw_seed(ctx.sr_stream, k.grad_rounding, k.bwd_format),
        ctx.w_transposed, ctx.x_dtype, ctx.w_dtype, *k.args())
    record_grouped_grad_amax(ctx.g_state, g_amax, k)
    nx, nw, ng = ctx.n_states
    return (dx, dw, None, None, [None] * nx, [None] * nw, [None] * ng, None) + GroupedLinearKnobs.no_grads()


fp8_grouped_linear_op.register_autograd(_backward, setup_context=_setup_context)
