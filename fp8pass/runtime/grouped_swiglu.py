"""``fp8pass::fp8_grouped_swiglu_down``: the expert GLU tail ``y_g = (act(gate_g) * up_g) W_down_e^T`` in FP8.

``swiglu_down`` (:mod:`.swiglu`) for rows grouped by expert, as :mod:`.grouped_linear` takes them:
``gate``/``up`` [S, F] (from an ``fp8_grouped_linear``; or ``up`` None and ``gate`` the fused
projection's output [S, 2F], gate its first half and up its second, as ``chunk(2, -1)`` splits it: the
backward then returns d(gate_up) from the GLU backward's own loop, with no ``cat`` of dgate and dup
after it), ``offs`` int32 [E], ``w_down`` [E, D, F]
(or [E, F, D] with ``w_transposed``), ``y`` [S, D]. The down GEMM's operands are cast per expert
(:mod:`.grouped_casting`). Smooth-SwiGLU per expert: ``channel`` scales ``c`` [E, F] come from each
expert's own rows and are folded into that expert's ``W_down`` columns (``B = W_down / c``, cast with
current scaling since it changes every call); ``token`` gives ``r`` [S, 1], ``none`` []. Saved for
backward: A's and B's codes and [E] scales, the smoothing scales, and ``gate``/``up`` for the
activation derivative. The static knobs are :class:`~fp8pass.op_schema.GroupedGLUKnobs`; ``out_dtype`` as in
:mod:`.grouped_linear`.

CPU, ``channel``/``none``: A's codes, B's codes and the GLU backward run in compiled passes that never
materialise fp32 [S, F] temporaries (:mod:`.grouped_glu_cpu`; same bits as the generic path, tested).
Devices that offer ``grouped_glu`` (CUDA), FP8 formats, ``channel``/``none`` with a kernel activation
(silu, relu): ``A`` and the channel scales in four launches (two for ``none``) and the GLU backward in
one (``kernels.triton_grouped_glu``: relu bit for bit; silu's ``exp`` is the GPU's, as in the dense
SwiGLU kernels); the other cases (and the identity format) run the torch ops. There, with fp32 or bf16
weights, ``B = W_down / c`` is divided inside the weight's cast kernels (``cast_experts``' divisor: no ``B``
written and read back) and ``dW = dB / c`` inside the wgrad GEMM's decode scales of A's columns (no pass
over ``dW``): the torch ops' bits, tested (``dW`` rounded once, where the torch ops round ``dB`` and then
divide exactly: equal unless ``dB / c`` is subnormal).
"""

from __future__ import annotations

import torch

from .. import kernels
from ..kernels import cpu
from ..op_schema import SR_SEED, SR_STREAM, GroupedGLUKnobs, knob_op
from .casting import as_bytes, from_bytes, resolve_format, unaliased
from .grouped_casting import cast_experts, cast_grouped_rows, casts_both_layouts, grad_format, group_ids, with_ones
from .grouped_glu_cpu import (
    cpu_fast,
    fused_glu_operand,
    fused_smoothed_weight_operand,
    glu_backward_rows,
    glu_backward_rows_joined,
    scaled_values,
    times,
)
from .grouped_linear import (
    check_grouped_knobs,
    check_grouped_tensors,
    check_states,
    dgrad_b,
    out_features,
    record_grouped_grad_amax,
    saved_weight_like,
    weight_operands,
    wgrad,
)
from .linear import compute_dtype
from .sr import draw_seed
from .swiglu import (
    _C_MAX,
    _C_MIN,
    _DIVIDED_IN_KERNEL,
    ACTIVATIONS,
    SMOOTH_MODES,
    _glu_backward_math,
    _swiglu_backward_math,
    channel_scales,
    swiglu_operand,
)

__all__ = ["fp8_grouped_swiglu_down_op", "check_grouped_glu_knobs", "check_grouped_swiglu_args"]


def check_grouped_glu_knobs(k: GroupedGLUKnobs) -> None:
    """Clear errors for bad knob values of ``fp8_grouped_swiglu_down``."""
    if k.activation not in ACTIVATIONS:
        raise ValueError(f"unknown GLU activation {k.activation!r}; valid: {', '.join(map(repr, ACTIVATIONS))}")
    if k.smooth not in SMOOTH_MODES:
        raise ValueError(f"unknown smooth mode {k.smooth!r}; valid: {', '.join(map(repr, SMOOTH_MODES))}")
    check_grouped_knobs(k)


def check_grouped_swiglu_args(gate, up, w_down, offs, w_transposed, states) -> None:
    """Clear errors for bad tensor arguments of ``fp8_grouped_swiglu_down`` (knobs: :func:`check_grouped_glu_knobs`)."""
    op = "fp8_grouped_swiglu_down"
    if up is None and (gate.dim() != 2 or gate.shape[1] % 2):
        raise ValueError(f"{op}: with up=None, gate is the fused gate_up output [S, 2F] (an even width), got "
                         f"{tuple(gate.shape)}")
    gate, up = halves(gate, up)
    if gate.shape != up.shape:
        raise ValueError(f"{op}: gate and up must have the same shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    check_grouped_tensors(op, gate, w_down, offs)
    f, _ = out_features(w_down, w_transposed)
    if gate.shape[1] != f:
        layout = "[E, F, D]" if w_transposed else "[E, D, F]"
        raise ValueError(f"{op}: gate/up have {gate.shape[1]} channels, w_down {tuple(w_down.shape)} ({layout}, "
                         f"w_transposed={w_transposed}) expects F = {f}")
    check_states(op, ("a_state", "b_state", "g_state"), states, w_down.shape[0])


def halves(gate, up):
    """``(gate, up)``; with ``up`` None, the two halves of the fused ``gate`` [S, 2F] (views)."""
    if up is not None:
        return gate, up
    f = gate.shape[1] // 2
    return gate[:, :f], gate[:, f:]


def _knobs(args) -> GroupedGLUKnobs:
    return GroupedGLUKnobs.of(args, check_grouped_glu_knobs)


def _grouped_operand(gate, up, ids, experts, smooth, activation):
    """The down GEMM's left operand ``A`` (fp32 [S, F]) and the smoothing scales (the generic path).

    ``channel``: per-expert per-channel ``c`` [E, F] from each expert's own rows (:func:`channel_scales`
    of the per-expert channel amax; 1 for an expert without rows); ``token``: ``r`` [S, 1]; ``none``: [].
    """
    if smooth != "channel":
        return swiglu_operand(gate, up, smooth, activation)
    h, _ = swiglu_operand(gate, up, "none", activation)
    amax = torch.zeros(experts + 1, h.shape[1], dtype=torch.float32, device=h.device)
    amax = amax.scatter_reduce(0, ids[:, None].expand(h.shape), h.abs(), "amax", include_self=True)[:experts]
    c = channel_scales(amax)
    return h * _row_scales(c, ids), c


def _row_scales(c, ids):
    """Each row's expert channel scales ``c[e]`` ([S, F]; 1 for padding rows)."""
    return with_ones(c)[ids]


def _glu_kernels(kern, gate, k: GroupedGLUKnobs, fmt) -> bool:
    """Whether the device's grouped GLU kernels (``OFFERS.grouped_glu``) compute the activation: FP8
    formats only (the identity format keeps the torch ops, which give the plain GLU's bits)."""
    return (kern.OFFERS.grouped_glu and fmt is not None and k.smooth != "token"
            and k.activation in kern.GLU_ACTIVATIONS and not cpu_fast(gate))


def _divides_in_kernels(w_down, w_dtype, fmt) -> bool:
    """Whether the CUDA kernels divide by the channel scales themselves: ``W_down / c`` in the weight's
    cast (``cast_experts``' divisor), ``dW = dB / c`` in the wgrad's decode scales (``wgrad``'s ``x_div``);
    ``w_down`` (or its saved codes) of dtype ``w_dtype``: fp32 and bf16, whose division by a power of two
    the kernels do as torch does (fp16's ``c`` can overflow: the torch ops)."""
    return w_dtype in _DIVIDED_IN_KERNEL and casts_both_layouts(w_down, fmt)


def _per_channel(c, w_transposed):
    """``c`` [E, F] shaped to broadcast over the F dim of ``w_down`` ([E, D, F] or [E, F, D])."""
    return c[:, :, None] if w_transposed else c[:, None, :]


@knob_op("fp8pass::fp8_grouped_swiglu_down",
         "Tensor gate, Tensor? up, Tensor w_down, Tensor offs, bool w_transposed, Tensor[] a_state, Tensor[] b_state, "
         f"Tensor[] g_state, {SR_STREAM}", GroupedGLUKnobs,
         "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
def fp8_grouped_swiglu_down_op(gate, up, w_down, offs, w_transposed, a_state, b_state, g_state, sr_stream, *knobs):
    """Returns ``(y, a_amax, b_amax, a_data, a_scale, b_data, b_scale, smooth_scales)``; see the module doc."""
    k = _knobs(knobs)
    check_grouped_swiglu_args(gate, up, w_down, offs, w_transposed, (a_state, b_state, g_state))
    gate, up = halves(gate, up)
    fmt = resolve_format(k.fwd_format)
    dt = compute_dtype(k, gate.dtype)
    experts = w_down.shape[0]
    kern = kernels.for_device(gate.device)
    if fmt is None:  # identity: the weight's values in the dtype the replaced node computed in
        w_down = w_down.to(dt)
    fast = fmt is not None and cpu_fast(gate)
    ids = None if _glu_kernels(kern, gate, k, fmt) else group_ids(offs, gate.shape[0])
    if fast and k.smooth != "token":
        ao, s = fused_glu_operand(gate, up, offs, ids, experts, k.smooth, k.activation, fmt, a_state, k.margin,
                                  k.power_of_two, dt)
    else:
        if ids is None:
            a, s = kern.grouped_glu_operand(gate, up, offs, k.activation, k.smooth, (_C_MIN, _C_MAX))
        else:
            a, s = _grouped_operand(gate, up, ids, experts, k.smooth, k.activation)
        ao = cast_grouped_rows(a, offs, fmt, a_state, k.margin, k.power_of_two, gemm_out=dt, ids=ids)
    if fast and k.smooth == "channel":  # B = W_down / c without materialising it
        bo = fused_smoothed_weight_operand(w_down, _per_channel(1 / s, w_transposed), fmt, k.margin,
                                           k.power_of_two, dt)
    elif k.smooth == "channel" and _divides_in_kernels(w_down, w_down.dtype, fmt):  # B = W_down / c read from W_down, in the cast
        divisor = {"row_divisor" if w_transposed else "col_divisor": s}
        bo = cast_experts(w_down, fmt, [], k.margin, k.power_of_two, gemm_out=dt, **divisor)
    elif k.smooth == "channel":  # B = W_down / c per expert: changes every call, so current-scaled
        # times 1/c: the same bits as dividing (c is a power of two), and a multiply is cheaper
        b = w_down * _per_channel(1 / s, w_transposed).to(w_down.dtype)
        bo = cast_experts(b, fmt, [], k.margin, k.power_of_two, gemm_out=dt)
    else:
        bo = cast_experts(w_down, fmt, b_state, k.margin, k.power_of_two, gemm_out=dt)
    b_fwd, b_saved = weight_operands(bo, kern, dt, w_transposed)
    y = kern.grouped_gemm(ao.gemm_input(kern, dt), ao.scale, b_fwd, bo.scale, offs, dt, fast_accum=k.fast_accum,
                          a_row_inv=ao.row_inv, a_row_pad=ao.row_pad, b_row_inv=None if w_transposed else bo.row_inv)
    if k.smooth == "token":
        y = (y.float() * s).to(dt)
    states = (a_state, b_state)  # a scale is a fresh tensor unless taken from a state: copied only then
    return (y, ao.amax, bo.amax, as_bytes(ao.data), unaliased(ao.scale, states), as_bytes(b_saved),
            unaliased(bo.scale, states), unaliased(s, states))


@fp8_grouped_swiglu_down_op.register_fake
def _(gate, up, w_down, offs, w_transposed, a_state, b_state, g_state, sr_stream, *knobs):
    k = _knobs(knobs)
    check_grouped_swiglu_args(gate, up, w_down, offs, w_transposed, (a_state, b_state, g_state))
    gate, up = halves(gate, up)
    fmt = resolve_format(k.fwd_format)
    dt = compute_dtype(k, gate.dtype)
    experts, rows, f = w_down.shape[0], gate.shape[0], gate.shape[1]
    _, n = out_features(w_down, w_transposed)
    f32 = dict(dtype=torch.float32, device=gate.device)
    s_shape = {"channel": (experts, f), "token": (rows, 1), "none": ()}[k.smooth]
    return (gate.new_empty(rows, n, dtype=dt), torch.empty(experts, **f32), torch.empty(experts, **f32),
            gate.new_empty(rows, f, dtype=torch.float32 if fmt is None else torch.uint8), torch.empty(experts, **f32),
            saved_weight_like(w_down, fmt, w_transposed, dt if fmt is None else torch.uint8),
            torch.empty(experts, **f32), torch.empty(s_shape, **f32))


@knob_op("fp8pass::fp8_grouped_swiglu_down_backward",
         "Tensor dy, Tensor gate, Tensor? up, Tensor a_data, Tensor a_scale, Tensor b_data, Tensor b_scale, "
         f"Tensor smooth_scales, Tensor offs, Tensor[] g_state, {SR_SEED}, bool w_transposed, ScalarType w_dtype",
         GroupedGLUKnobs, "(Tensor, Tensor, Tensor, Tensor)")
def fp8_grouped_swiglu_down_backward_op(dy, gate, up, a_data, a_scale, b_data, b_scale, smooth_scales, offs, g_state,
                                        sr_seed, w_transposed, w_dtype, *knobs):
    """``(dgate, dup, dW_down, dy_amax [E])`` (no state mutation); GEMMs in the forward's compute dtype,
    each gradient in its input's dtype. With ``up`` None (``gate`` the fused gate_up): ``dgate`` is
    d(gate_up) [S, 2F], both halves written by one pass, and ``dup`` is empty."""
    k = _knobs(knobs)
    fused = up is None
    gate, up = halves(gate, up)
    dt = compute_dtype(k, gate.dtype)
    fmt = resolve_format(grad_format(k.bwd_format, dy.device))
    fwd_fmt = resolve_format(k.fwd_format)
    a_data = from_bytes(a_data, fwd_fmt)
    b_data = from_bytes(b_data, fwd_fmt)
    kern = kernels.for_device(dy.device)
    experts = b_data.shape[0]
    glu_kernels = _glu_kernels(kern, gate, k, fwd_fmt)
    ids = None if glu_kernels else group_ids(offs, dy.shape[0])
    s = smooth_scales
    g = dy.float() * s if k.smooth == "token" else dy
    go = cast_grouped_rows(g, offs, fmt, g_state, k.margin, k.power_of_two, k.grad_rounding, gemm_out=dt,
                           keep_codes=False, ids=ids, seed=sr_seed)
    g_in = go.gemm_input(kern, dt)
    da = kern.grouped_gemm(g_in, go.scale, dgrad_b(b_data, w_transposed), b_scale, offs, dt,
                           a_row_inv=go.row_inv, a_row_pad=go.row_pad)  # dA [S, F]
    # B = W / c => dW = dB / c (exact: powers of two); on CPU the 1/c scales A's columns as its codes
    # are upcast for the GEMM (the same bits: every step scales exactly by a power of two), not dB after it
    fast = cpu_fast(gate)
    fold = k.smooth == "channel" and fwd_fmt is not None and fast and kern.OFFERS.upcast_gemm_operands
    a_in = (cpu.run_fused(scaled_values, (a_data, with_ones(1 / s), ids), (kern.gemm_dtype(dt, g_in),)) if fold
            else a_data)
    # CUDA: dW = dB / c by the wgrad GEMM's decode scales of A's columns (exact: c are powers of two; the
    # output rounded once, to dB / c, where the torch ops round dB and then divide: equal unless dB / c is
    # subnormal)
    in_scales = k.smooth == "channel" and not fold and _divides_in_kernels(b_data, w_dtype, fwd_fmt)
    db = wgrad(kern, a_in, a_scale, g_in, go.scale, offs, w_transposed, dt,
               x_div=s if in_scales else None).to(w_dtype)  # dB (dW), w_down's layout
    if k.smooth == "channel" and not fold and not in_scales:
        db = cpu.run_fused(times, (db, _per_channel(1 / s, w_transposed).to(db.dtype)), ())
    if glu_kernels:
        dgate, dup = kern.grouped_glu_backward(da, gate, up, offs, k.activation, s if k.smooth == "channel" else None,
                                               fused)
        return dgate, dup, db, go.amax
    if k.smooth != "token" and fast:
        col = with_ones(s) if k.smooth == "channel" else gate.new_ones(experts + 1, gate.shape[1], dtype=torch.float32)
        fn = glu_backward_rows_joined if fused else glu_backward_rows
        grads = cpu.run_fused(fn, (da, gate, up, col, ids), (k.activation, gate.dtype, up.dtype))
        return (grads, grads.new_empty(0), db, go.amax) if fused else (*grads, db, go.amax)
    if k.smooth == "channel":
        s = _row_scales(s, ids)
    if k.activation == "silu":
        dgate, dup = kernels.run_fused(_swiglu_backward_math, (da, gate, up, s), (k.smooth,))
    else:  # eager torch math, as swiglu_down
        dgate, dup = _glu_backward_math(da, gate, up, s, k.smooth, k.activation)
    dgate, dup = dgate.to(gate.dtype), dup.to(up.dtype)
    if fused:
        return torch.cat((dgate, dup), dim=1), dgate.new_empty(0), db, go.amax
    return dgate, dup, db, go.amax


@fp8_grouped_swiglu_down_backward_op.register_fake
def _(dy, gate, up, a_data, a_scale, b_data, b_scale, smooth_scales, offs, g_state, sr_seed, w_transposed, w_dtype,
      *knobs):
    return (gate.new_empty(gate.shape), gate.new_empty(0) if up is None else up.new_empty(up.shape),
            dy.new_empty(b_data.shape, dtype=w_dtype),
            dy.new_empty(b_data.shape[0], dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    gate, up, w_down, offs, w_transposed, a_state, b_state, g_state = inputs[:8]
    _, _, _, a_data, a_scale, b_data, b_scale, s = output
    ctx.save_for_backward(gate, up, a_data, a_scale, b_data, b_scale, s, offs)
    ctx.set_materialize_grads(False)  # as grouped_linear's
    ctx.g_state = list(g_state)
    ctx.sr_stream = inputs[8]
    ctx.n_states = (len(a_state), len(b_state), len(g_state))
    ctx.w_transposed, ctx.w_dtype = w_transposed, w_down.dtype
    ctx.knobs = GroupedGLUKnobs.take(inputs)  # validated by the forward


def _backward(ctx, dy, *unused):
    k = ctx.knobs
    gate, up, a_data, a_scale, b_data, b_scale, s, offs = ctx.saved_tensors
    if dy is None:  # only the amaxes or codes were used: y's gradient is zero
        dy = gate.new_zeros(gate.shape[0], out_features(b_data, ctx.w_transposed)[1],
                            dtype=compute_dtype(k, gate.dtype))
    dgate, dup, dw, g_amax = torch.ops.fp8pass.fp8_grouped_swiglu_down_backward(
        dy, *ctx.saved_tensors, ctx.g_state, draw_seed(ctx.sr_stream, k.grad_rounding, k.bwd_format), ctx.w_transposed,
        ctx.w_dtype, *k.args())
    record_grouped_grad_amax(ctx.g_state, g_amax, k)
    na, nb, ng = ctx.n_states
    return (dgate, None if up is None else dup, dw, None, None, [None] * na, [None] * nb, [None] * ng, None) + \
        GroupedGLUKnobs.no_grads()


fp8_grouped_swiglu_down_op.register_autograd(_backward, setup_context=_setup_context)
