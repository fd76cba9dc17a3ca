"""Linears that share one input cast: ``fp8pass::fp8_cast_input`` + ``fp8pass::fp8_linear_precast``.

Several linears often read one tensor (q/k/v projections of the normed hidden state; gate and up
projections of a GLU). :func:`fp8_linear_op <fp8pass.runtime.linear.fp8_linear_op>` casts its ``x``
itself and saves its own copy of the codes for backward, so three projections of one ``x`` cast it
three times and save three identical copies. Here the cast is its own forward-only op, emitted once
per input, and every linear takes its outputs::

    x_data, x_scale, x_amax, x_alt = fp8pass::fp8_cast_input(x.detach(), x_state, <knobs>)
    y_q, w_amax_q, w_scale_q = fp8pass::fp8_linear_precast(x, x_data, x_scale, x_alt, W_q, b_q, w_state_q,
                                                           g_state_q, <knobs>)
    y_k, ...                  = fp8pass::fp8_linear_precast(x, x_data, x_scale, x_alt, W_k, ...)

``x`` is still an input of each linear, so autograd routes its ``dx`` to it, but its values are not
read. The linear saves for backward its *inputs* ``x_data`` and ``x_scale`` (one graph node, so AOT
autograd's partitioner keeps the codes once however many linears use them), the weight itself (a
parameter, held anyway) and the weight's scale: the backward recasts ``W`` with that scale (the same
codes as the forward's, bit for bit: the same cast of the same values) instead of keeping 1 byte per
weight element alive from forward to backward. With per-row/per-tile current scaling the recast
recomputes the scales too (deterministic, identical).

Numerics: under current scaling outputs and gradients are bit-identical to one ``fp8_linear`` per
linear (the same casts and GEMMs). Under delayed scaling the shared cast uses the first consumer's
``x_state`` and its amax is recorded into every consumer's ``x_state`` (they see the same tensor, so
their histories stay identical). MX granularity (a second, column-blocked cast of ``x`` per linear)
and NVFP4 keep the per-linear ops.

``x_alt``: the second form of x's codes that GEMMs read, made by the same cast. On CPU, the codes
already converted to the GEMM dtype (what :func:`~.casting.cast_operand` makes beside the codes), shared
by the consumers' forward GEMMs and never saved. On the Triton/CUDA path (per-tensor FP8) the codes
laid out column-major (:func:`~.casting.saved_transposed`): the forward GEMMs read ``x_data`` and the
backward keeps ``x_alt`` instead, whose transpose is the row-major ``x^T`` the wgrad ``_scaled_mm`` takes
(no copy). An empty 1-D tensor otherwise (identity format, per-row/tile scales).
"""

from __future__ import annotations

import torch

from ..op_schema import SR_SEED, SR_STREAM, LinearKnobs, knob_op
from .casting import (
    Operand,
    as_bytes,
    cast_operand,
    cast_with_scale,
    column_major,
    column_major_like,
    from_bytes,
    gemm,
    resolve_format,
    saved_transposed,
    tile_for,
    unaliased,
)
from .linear import (
    _scale_shape,
    _up,
    check_linear_tensors,
    compute_dtype,
    keep_output_grad_only,
    knobs_of,
    linear_backward,
    output_grad,
    record_grad_amax,
)
from .sr import draw_seed

__all__ = ["fp8_cast_input_op", "fp8_linear_precast_op", "shares_input_cast"]


def shares_input_cast(k: LinearKnobs) -> bool:
    """Whether linears with these knobs go through the shared cast (everything but MX granularity)."""
    return k.granularity != "mx"


def _check_cast(x, k: LinearKnobs):
    """``k`` comes validated from :func:`~.linear.knobs_of`."""
    if x.dim() < 1:
        raise ValueError(f"fp8_cast_input needs x [..., in]; got a {x.dim()}-D tensor")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise TypeError(f"fp8_cast_input: x must be float16/bfloat16/float32/float64, got {x.dtype}")
    if not shares_input_cast(k):
        raise ValueError("fp8_cast_input: MX granularity casts x per linear (use fp8_linear)")


@knob_op("fp8pass::fp8_cast_input", "Tensor x, Tensor[] x_state", LinearKnobs, "(Tensor, Tensor, Tensor, Tensor)")
def fp8_cast_input_op(x, x_state, *knobs):
    """``(x_data [rows, in], x_scale, x_amax, x_alt)`` of the module doc; ``x`` [..., in] is cast as
    ``fp8_linear`` casts it (``x_state``: delayed scaling, [] current)."""
    k = knobs_of(knobs)
    _check_cast(x, k)
    fmt = resolve_format(k.fwd_format)
    dt = compute_dtype(k, x.dtype)
    x2d = x.reshape(-1, x.shape[-1])
    if fmt is None:  # identity: the values themselves, in the dtype the replaced node computed in
        x2d = x2d.to(dt)
    up = _up_dtype(k, x.device, dt)
    xt = tile_for(k.granularity, k.block, x2d.shape, weight=False)
    transposed = saved_transposed(x.device, fmt, k.granularity)
    xo = cast_operand(x2d, fmt, k.granularity, xt, x_state, k.margin, k.power_of_two, up=up, transpose=transposed)
    if transposed:
        x_alt = as_bytes(column_major(xo))
    else:
        x_alt = xo.up if up is not None and xo.up is not None else x.new_empty(0, dtype=dt)
        if x_alt is xo.data:  # outputs may not alias (codes already in the GEMM dtype)
            x_alt = x_alt.clone()
    return as_bytes(xo.data), unaliased(xo.scale, x_state), xo.amax, x_alt


@fp8_cast_input_op.register_fake
def _(x, x_state, *knobs):
    k = knobs_of(knobs)
    _check_cast(x, k)
    fmt = resolve_format(k.fwd_format)
    dt = compute_dtype(k, x.dtype)
    rows = 1
    for d in x.shape[:-1]:
        rows = rows * d
    kk = x.shape[-1]
    up = _up_dtype(k, x.device, dt)
    f32 = dict(dtype=torch.float32, device=x.device)
    if saved_transposed(x.device, fmt, k.granularity):
        x_alt = column_major_like(rows, kk, torch.uint8, x.device)
    else:
        x_alt = x.new_empty(rows, kk, dtype=up) if up is not None else x.new_empty(0, dtype=dt)
    return (x.new_empty(rows, kk, dtype=torch.uint8 if fmt is not None else dt),
            torch.empty(_scale_shape(k.granularity if fmt else "tensor", k.block, rows, kk, False), **f32),
            torch.empty((), **f32),
            x_alt)


def _operand_x(x_data, x_scale, x_alt, fmt, k: LinearKnobs) -> Operand:
    """x's forward GEMM operand: the codes, with their GEMM-dtype values where the CPU made them (``x_alt``
    holds those, or on the Triton path the column-major codes that only the backward reads)."""
    data = from_bytes(x_data, fmt)
    values = x_alt.dim() == 2 and not saved_transposed(x_data.device, fmt, k.granularity)
    return Operand(data, x_scale, x_scale, x_alt if values else None)


def _cast_weight(w, k: LinearKnobs, w_state, up, scale=None, invert=(), transpose=False) -> Operand:
    """``W``'s operand as ``fp8_linear`` casts it (``w`` already in the compute dtype for the identity
    format). With ``scale`` (backward): the cast of ``W`` with that per-tensor scale, the forward's
    codes again, or, per row/tile (current scaling), the same current cast again. ``invert``: the
    other GEMM operand's scale, whose decode scale the GPU kernels make with W's (``cast_operand``)."""
    fmt = resolve_format(k.fwd_format)
    wt = tile_for(k.granularity, k.block, w.shape, weight=True)
    # keep_codes=False: only GEMMs read W's operand (backward recasts it), so on CPU one loop writes
    # the GEMM values and no codes (casting.cast_with_scale).
    if scale is None or fmt is None or k.granularity != "tensor":
        return cast_operand(w, fmt, k.granularity, wt, w_state if scale is None else None, k.margin,
                            k.power_of_two, up=up, keep_codes=False, invert=invert)
    return cast_with_scale(w, scale, fmt, up, keep_codes=False, transpose=transpose, transposed_only=transpose)


def _up_dtype(k: LinearKnobs, device, dt) -> torch.dtype | None:
    """The GEMM dtype a per-tensor cast also produces its codes in (CPU), else None."""
    if resolve_format(k.fwd_format) is None or k.granularity != "tensor":
        return None
    return _up(device, dt)


def _check_precast(x, x_data, x_scale, x_alt, weight, bias):
    check_linear_tensors(x, weight, bias)
    rows = 1
    for d in x.shape[:-1]:
        rows = rows * d
    if x_data.dim() != 2 or x_data.shape[0] != rows or x_data.shape[1] != x.shape[-1]:
        raise ValueError(f"fp8_linear_precast: x_data {tuple(x_data.shape)} is not the cast of x {tuple(x.shape)} "
                         f"(expected [{rows}, {x.shape[-1]}]: pass fp8_cast_input(x)'s outputs)")


@knob_op("fp8pass::fp8_linear_precast",
         "Tensor x, Tensor x_data, Tensor x_scale, Tensor x_alt, Tensor weight, Tensor? bias, Tensor[] w_state, "
         f"Tensor[] g_state, {SR_STREAM}", LinearKnobs, "(Tensor, Tensor, Tensor)")
def fp8_linear_precast_op(x, x_data, x_scale, x_alt, weight, bias, w_state, g_state, sr_stream, *knobs):
    """``(y, w_amax, w_scale)``: ``y = x W^T (+ b)`` from ``fp8_cast_input(x)``'s outputs (``x``'s
    values are not read); see the module doc."""
    k = knobs_of(knobs)
    _check_precast(x, x_data, x_scale, x_alt, weight, bias)
    fmt = resolve_format(k.fwd_format)
    dt = compute_dtype(k, x.dtype)
    w = weight.to(dt) if fmt is None else weight
    xo = _operand_x(x_data, x_scale, x_alt, fmt, k)
    wo = _cast_weight(w, k, w_state, _up_dtype(k, x.device, dt), invert=(x_scale,) if x_scale.dim() == 0 else ())
    if wo.inverted:  # x's decode scale, made by W's scale launch (GPU)
        xo.inv_scale = wo.inverted[0]
    xt = tile_for(k.granularity, k.block, xo.data.shape, weight=False)
    wt = tile_for(k.granularity, k.block, weight.shape, weight=True)
    y = gemm(xo, xt, wo, wt, dt, bias, fast_accum=k.fast_accum)
    return y.reshape(*x.shape[:-1], weight.shape[0]), wo.amax, unaliased(wo.scale, (x_scale, w_state))


@fp8_linear_precast_op.register_fake
def _(x, x_data, x_scale, x_alt, weight, bias, w_state, g_state, sr_stream, *knobs):
    k = knobs_of(knobs)
    _check_precast(x, x_data, x_scale, x_alt, weight, bias)
    fmt = resolve_format(k.fwd_format)
    dt = compute_dtype(k, x.dtype)
    n, kk = weight.shape
    f32 = dict(dtype=torch.float32, device=x.device)
    return (x.new_empty(*x.shape[:-1], n, dtype=dt), torch.empty((), **f32),
            torch.empty(_scale_shape(k.granularity if fmt else "tensor", k.block, n, kk, True), **f32))


@knob_op("fp8pass::fp8_linear_precast_backward",
         f"Tensor dy, Tensor x_data, Tensor x_scale, Tensor weight, Tensor w_scale, Tensor[] g_state, {SR_SEED}, "
         "ScalarType x_dtype, bool want_bias_grad", LinearKnobs, "(Tensor, Tensor, Tensor, Tensor)")
def fp8_linear_precast_backward_op(dy, x_data, x_scale, weight, w_scale, g_state, sr_seed, x_dtype, want_bias_grad,
                                   *knobs):
    """``(dx2d, dW, db_fp32, dy_amax)``: ``W`` recast with the forward's scale, then the GEMMs of
    ``fp8_linear_backward`` (no state mutation)."""
    k = knobs_of(knobs)
    fmt = resolve_format(k.fwd_format)
    dt = compute_dtype(k, x_dtype)
    w = weight.to(dt) if fmt is None else weight
    # on the GPU the recast writes W^T alone (one read, no row-major codes): the dgrad's _scaled_mm takes it
    wo = _cast_weight(w, k, [], _up_dtype(k, dy.device, dt), scale=w_scale,
                      transpose=saved_transposed(dy.device, fmt, k.granularity))
    w_data = column_major(wo) if wo.data_t is not None else wo.data
    return linear_backward(dy, from_bytes(x_data, fmt), x_scale, w_data, wo.scale, g_state, x_dtype, weight.dtype,
                           want_bias_grad, k, w_up=wo.up, sr_seed=sr_seed)


@fp8_linear_precast_backward_op.register_fake
def _(dy, x_data, x_scale, weight, w_scale, g_state, sr_seed, x_dtype, want_bias_grad, *knobs):
    rows, kk = x_data.shape
    n = weight.shape[0]
    return (dy.new_empty(rows, kk, dtype=x_dtype), dy.new_empty(n, kk, dtype=weight.dtype),
            dy.new_empty(n if want_bias_grad else 0, dtype=torch.float32), dy.new_empty((), dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    x, x_data, x_scale, x_alt, weight, bias, w_state, g_state = inputs[:8]
    k = LinearKnobs.take(inputs)
    # the codes once (a shared input; on the GPU the column-major copy the wgrad reads), W itself
    saved_x = x_alt if saved_transposed(x.device, resolve_format(k.fwd_format), k.granularity) else x_data
    ctx.save_for_backward(saved_x, x_scale, weight, output[2])
    keep_output_grad_only(ctx, output[0])
    ctx.g_state = list(g_state)
    ctx.sr_stream = inputs[8]
    ctx.n_states = (len(w_state), len(g_state))
    ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
    ctx.b_dtype = None if bias is None else bias.dtype
    ctx.knobs = k  # validated by the forward


def _backward(ctx, dy, *unused):
    k = ctx.knobs
    dx, dw, db, g_amax = torch.ops.fp8pass.fp8_linear_precast_backward(
        output_grad(ctx, dy), *ctx.saved_tensors, ctx.g_state, draw_seed(ctx.sr_stream, k.grad_rounding, k.bwd_format),
        ctx.x_dtype, ctx.b_dtype is not None, *k.args())
    record_grad_amax(ctx.g_state, g_amax, k)
    dbias = None if ctx.b_dtype is None else db.to(ctx.b_dtype)
    nw, ng = ctx.n_states
    return ((dx.reshape(ctx.x_shape), None, None, None, dw, dbias, [None] * nw, [None] * ng, None)
            + LinearKnobs.no_grads())


fp8_linear_precast_op.register_autograd(_backward, setup_context=_setup_context)
