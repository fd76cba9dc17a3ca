"""``fp8pass::fp8_linear``: ``y = x W^T (+ b)`` with FP8 GEMMs in forward and backward.

Forward: ``x`` and ``W`` cast to ``fwd_format`` (E4M3), one GEMM, bias added in high precision, output
in ``out_dtype`` (the replaced node's dtype: under autocast the autocast dtype, whatever ``x``'s is;
None means ``x``'s). The GEMMs of every pass round to that dtype (CPU: bf16 GEMMs of the upcast codes
where this machine's bf16 matmul is fast, else fp32 GEMMs and a cast), and each gradient comes back in
its input's own dtype, as autocast's backward does. Backward (the "hybrid" recipe): ``dy`` cast to ``bwd_format`` (E5M2, round to nearest
or stochastic), ``dx = dy W`` (E5M2 x E4M3) and ``dW = dy^T x`` (E5M2 x E4M3) from the FP8 codes
saved in forward (1 byte/element; no high-precision copy of ``x`` or ``W`` is kept), ``db = sum(dy)``.

MX granularity (OCP MXFP8) blocks every GEMM operand along that GEMM's reduction dim, as MX GEMMs
require: forward ``x`` and ``W`` along in-features, dgrad ``dy`` along out-features and ``W`` down its
rows, wgrad ``dy`` and ``x`` along tokens. So the forward saves ``x`` and ``W`` cast down their rows
(32 x 1 blocks, a second cast of each) and the backward casts ``dy`` both ways. The GEMMs run on the
exact dequantized values (no MX tensor cores on CPUs or Hopper GPUs).

The op returns, besides ``y``, the amaxes of ``x`` and ``W`` (to record into delayed-scaling state)
and the saved operands (codes and scales) that its backward needs: custom ops can only hand tensors to
their backward through their outputs. Callers use ``[0]``, ``[1]``, ``[2]`` and ignore the rest.
"""

from __future__ import annotations

import torch

from ..config import ALGOS, BACKWARDS, GRANULARITIES
from ..kernels import cpu as cpu_kernels
from ..kernels import uses_triton
from ..numerics import ROUNDINGS
from ..op_schema import SR_SEED, SR_STREAM, LinearKnobs, knob_op
from .casting import (
    MX_COLS,
    Operand,
    as_bytes,
    cast_operand,
    column_major,
    column_major_like,
    dequantized,
    from_bytes,
    gemm,
    resolve_format,
    saved_transposed,
    tile_for,
    unaliased,
)
from .sr import draw_seed, draws_per_backward, seed_of

__all__ = ["fp8_linear_op", "check_linear_args", "check_linear_tensors", "check_knobs", "knobs_of", "compute_dtype",
           "record_grad_amax", "linear_backward"]


def check_linear_args(x, weight, bias, k: LinearKnobs):
    """Clear errors for bad arguments (what was wrong and what is valid)."""
    check_linear_tensors(x, weight, bias)
    check_knobs(k)


def check_linear_tensors(x, weight, bias):
    """The tensor half of :func:`check_linear_args` (the ops validate their knobs in :func:`knobs_of`)."""
    if x.dim() < 1 or weight.dim() != 2:
        raise ValueError(f"fp8_linear needs x [..., in] and weight [out, in]; got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"fp8_linear: x has {x.shape[-1]} input features, weight expects {weight.shape[1]}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"fp8_linear: bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    for name, t in (("x", x), ("weight", weight)):
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"fp8_linear: {name} must be float16/bfloat16/float32/float64, got {t.dtype}")


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_knobs(k: LinearKnobs) -> None:
    """Clear errors for bad knob values (shared by the linear and GLU ops)."""
    check_recipe_knobs(k)
    if k.granularity not in GRANULARITIES:
        raise ValueError(f"unknown granularity {k.granularity!r}; valid: {', '.join(GRANULARITIES)}")
    if k.block < 1:
        raise ValueError(f"block must be >= 1, got {k.block}")


def check_recipe_knobs(k) -> None:
    """Clear errors for the knobs every FP8 op has (formats, grad_rounding, algo, out_dtype, fast_accum): dense
    :class:`LinearKnobs` and the grouped ops' knobs alike."""
    resolve_format(k.fwd_format)
    resolve_format(k.bwd_format)
    if k.grad_rounding not in ROUNDINGS:
        raise ValueError(f"unknown grad_rounding {k.grad_rounding!r}; valid: {', '.join(ROUNDINGS)}")
    if k.algo not in ALGOS:
        raise ValueError(f"unknown algo {k.algo!r}; valid: {', '.join(ALGOS)}")
    if k.out_dtype is not None and k.out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be None or float16/bfloat16/float32/float64, got {k.out_dtype}")
    if not isinstance(k.fast_accum, bool):
        raise TypeError(f"fast_accum must be True or False, got {k.fast_accum!r}")
    if getattr(k, "backward", "fp8") not in BACKWARDS:  # the grouped ops' knobs have no backward override
        raise ValueError(f"unknown backward {k.backward!r}; valid: {', '.join(BACKWARDS)}")


def knobs_of(args: tuple) -> LinearKnobs:
    """An op's ``*knobs`` as validated :class:`LinearKnobs` (:func:`check_knobs`), built once per
    distinct tuple (:meth:`Knobs.of <fp8pass.op_schema.Knobs.of>`)."""
    return LinearKnobs.of(args, check_knobs)


def compute_dtype(k: LinearKnobs, x_dtype: torch.dtype) -> torch.dtype:
    """The dtype the op computes and outputs in: ``k.out_dtype`` (the replaced node's), else ``x``'s."""
    return x_dtype if k.out_dtype is None else k.out_dtype


def _up(device, out_dtype) -> torch.dtype | None:
    """Dtype the torch-family GEMM upcasts codes to (None: the Triton/CUDA path takes the codes).

    On CPU, :func:`fp8pass.kernels.cpu.gemm_dtype` decides (bf16 only where this CPU has
    native bf16 matmuls), so the casts upcast once, to what the GEMM will use.
    """
    if uses_triton(device):
        return None
    if torch.device(device).type == "cpu":
        return cpu_kernels.gemm_dtype(out_dtype)
    return torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32


def _mx_mm_dtype(device, out_dtype) -> torch.dtype:
    """GEMM dtype of MX operands: bf16 (exact for them, fp32 accumulation) where this device's GEMM
    prefers it and the output is bf16 anyway, else fp32."""
    if out_dtype != torch.bfloat16:
        return torch.float32
    return torch.bfloat16 if _up(device, out_dtype) in (None, torch.bfloat16) else torch.float32


def _scale_shape(granularity, block, rows, cols, weight):
    if granularity == "tensor":
        return ()
    tile = tile_for(granularity, block, (rows, cols), weight)
    return (-(-rows // tile[0]), -(-cols // tile[1]))


@knob_op("fp8pass::fp8_linear",
         f"Tensor x, Tensor weight, Tensor? bias, Tensor[] x_state, Tensor[] w_state, Tensor[] g_state, {SR_STREAM}",
         LinearKnobs, "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
def fp8_linear_op(x, weight, bias, x_state, w_state, g_state, sr_stream, *knobs):
    """Returns ``(y, x_amax, w_amax, x_data, x_scale, w_data, w_scale)``; see the module doc."""
    k = knobs_of(knobs)
    check_linear_tensors(x, weight, bias)
    fmt = resolve_format(k.fwd_format)
    dt = compute_dtype(k, x.dtype)
    x2d = x.reshape(-1, x.shape[-1])
    if fmt is None:  # identity: the values themselves, in the dtype the replaced node computed in
        x2d, weight = x2d.to(dt), weight.to(dt)
    up = _up(x.device, dt)
    xt = tile_for(k.granularity, k.block, x2d.shape, weight=False)
    wt = tile_for(k.granularity, k.block, weight.shape, weight=True)
    transposed = saved_transposed(x.device, fmt, k.granularity)  # GPU: keep the layouts backward reads
    xo = cast_operand(x2d, fmt, k.granularity, xt, x_state, k.margin, k.power_of_two, up=up, transpose=transposed)
    wo = cast_operand(weight, fmt, k.granularity, wt, w_state, k.margin, k.power_of_two, up=up, transpose=transposed)
    mx = k.granularity == "mx" and fmt is not None
    y = gemm(xo, xt, wo, wt, dt, bias, mm_dtype=_mx_mm_dtype(x.device, dt) if mx else torch.float32,
             fast_accum=k.fast_accum)
    if mx:  # the backward GEMMs reduce over tokens (x) and out-features (W): save both cast down the rows
        xo = cast_operand(x2d, fmt, k.granularity, MX_COLS)
        wo = cast_operand(weight, fmt, k.granularity, MX_COLS)
    x_saved, w_saved = (column_major(xo), column_major(wo)) if transposed else (xo.data, wo.data)
    return (y.reshape(*x.shape[:-1], weight.shape[0]), xo.amax, wo.amax,
            as_bytes(x_saved), unaliased(xo.scale, (x_state, w_state)), as_bytes(w_saved),
            unaliased(wo.scale, (x_state, w_state)))


@fp8_linear_op.register_fake
def _(x, weight, bias, x_state, w_state, g_state, sr_stream, *knobs):
    k = knobs_of(knobs)
    check_linear_tensors(x, weight, bias)
    fmt = resolve_format(k.fwd_format)
    dt = compute_dtype(k, x.dtype)
    rows = 1
    for d in x.shape[:-1]:
        rows = rows * d
    kk, n = weight.shape[1], weight.shape[0]
    code = dt if fmt is None else torch.uint8
    f32 = dict(dtype=torch.float32, device=x.device)
    granularity = k.granularity if fmt else "tensor"
    if granularity == "mx":  # saved cast down the rows (MX_COLS)
        x_scale, w_scale = (-(-rows // MX_COLS[0]), kk), (-(-n // MX_COLS[0]), kk)
    else:
        x_scale = _scale_shape(granularity, k.block, rows, kk, False)
        w_scale = _scale_shape(granularity, k.block, n, kk, True)
    if saved_transposed(x.device, fmt, granularity):
        x_saved, w_saved = column_major_like(rows, kk, code, x.device), column_major_like(n, kk, code, x.device)
    else:
        x_saved, w_saved = x.new_empty(rows, kk, dtype=code), x.new_empty(n, kk, dtype=code)
    return (
        x.new_empty(*x.shape[:-1], n, dtype=dt),
        x.new_empty((), dtype=torch.float32),
        x.new_empty((), dtype=torch.float32),
        x_saved,
        torch.empty(x_scale, **f32),
        w_saved,
        torch.empty(w_scale, **f32),
    )


@knob_op("fp8pass::fp8_linear_backward",
         f"Tensor dy, Tensor x_data, Tensor x_scale, Tensor w_data, Tensor w_scale, Tensor[] g_state, {SR_SEED}, "
         "ScalarType x_dtype, ScalarType w_dtype, bool want_bias_grad", LinearKnobs,
         "(Tensor, Tensor, Tensor, Tensor)")
def fp8_linear_backward_op(dy, x_data, x_scale, w_data, w_scale, g_state, sr_seed, x_dtype, w_dtype, want_bias_grad,
                           *knobs):
    """``(dx2d, dW, db_fp32, dy_amax)`` from ``dy`` and the saved FP8 operands (no state mutation); ``db_fp32``
    is empty without ``want_bias_grad``.

    The GEMMs round to the forward's compute dtype (what autocast's backward does), then each
    gradient takes its input's dtype.
    """
    k = knobs_of(knobs)
    fwd_fmt = resolve_format(k.fwd_format)
    return linear_backward(dy, from_bytes(x_data, fwd_fmt), x_scale, from_bytes(w_data, fwd_fmt), w_scale, g_state,
                           x_dtype, w_dtype, want_bias_grad, k, sr_seed=sr_seed)


def linear_backward(dy, x_data, x_scale, w_data, w_scale, g_state, x_dtype, w_dtype, want_bias_grad,
                    k: LinearKnobs, w_up: torch.Tensor | None = None, sr_seed: torch.Tensor | None = None):
    """The backward GEMMs of :func:`fp8_linear_backward_op` from the saved operands as codes (FP8
    dtypes, not bytes); ``w_up``: ``w_data`` already in the GEMM dtype (same values), if at hand;
    ``sr_seed``: the stochastic gradient casts' seeds (``runtime.sr``: int64 [1], MX [2], one per cast of
    ``dy``: ``draws_per_backward``), or None (torch's generator).

    ``k.backward == "high"``: the saved operands are dequantized and the GEMMs take them and ``dy``
    as the identity format's do (Transformer Engine's ``backward_override="dequantized"``): the
    gradients of the forward that ran, without the E5M2 cast of ``dy`` or FP8 GEMMs."""
    dt = compute_dtype(k, x_dtype)
    if k.backward == "high":
        saved = MX_COLS if k.granularity == "mx" and resolve_format(k.fwd_format) is not None else None
        xt = saved or tile_for(k.granularity, k.block, x_data.shape, weight=False)
        wt = saved or tile_for(k.granularity, k.block, w_data.shape, weight=True)
        xo, wo = dequantized(x_data, x_scale, xt, dt), dequantized(w_data, w_scale, wt, dt)
        k = k.replace(fwd_format="identity", bwd_format="identity", granularity="tensor", backward="fp8")
        return linear_backward(dy, xo.data, xo.scale, wo.data, wo.scale, g_state, x_dtype, w_dtype,
                               want_bias_grad, k)
    fmt = resolve_format(k.bwd_format)
    fwd_fmt = resolve_format(k.fwd_format)
    dy2d = dy.reshape(-1, dy.shape[-1])
    up = _up(dy.device, dt)
    gt = tile_for(k.granularity, k.block, dy2d.shape, weight=False)
    # dy's codes are never kept: where GEMMs read values (CPU) none are written (keep_codes=False)
    saved_scales = (x_scale, w_scale) if x_scale.dim() == 0 and w_scale.dim() == 0 else ()
    go = cast_operand(dy2d, fmt, k.granularity, gt, g_state, k.margin, k.power_of_two, k.grad_rounding, up=up,
                      transpose=up is None, keep_codes=False, invert=saved_scales, seed=seed_of(sr_seed, 0))
    xt = tile_for(k.granularity, k.block, x_data.shape, weight=False)
    wt = tile_for(k.granularity, k.block, w_data.shape, weight=True)
    x_inv, w_inv = go.inverted if go.inverted else (None, None)  # the decode scales, from dy's scale launch
    xo = Operand(x_data, x_scale, x_scale, inv_scale=x_inv)
    wo = Operand(w_data, w_scale, w_scale, w_up, inv_scale=w_inv)
    go_w, g_wt, mm = go, gt, torch.float32
    if k.granularity == "mx":  # every operand blocked along its GEMM's reduction dim (the module doc)
        saved_mx = fwd_fmt is not None
        if saved_mx:
            xt = wt = MX_COLS
        if fmt is not None:
            g_wt = MX_COLS
            go_w = cast_operand(dy2d, fmt, k.granularity, MX_COLS, g_state, k.margin, k.power_of_two,
                                k.grad_rounding, seed=seed_of(sr_seed, 1))
        if saved_mx and fmt is not None:
            mm = _mx_mm_dtype(dy.device, dt)
    # dx = dy @ W: W^T [in, out] is the "B" operand ([N, K] with K = out).
    dx = gemm(go, gt, wo, wt, x_dtype, b_t=True, mm_dtype=mm, compute_dtype=dt)
    # dW = dy^T @ x: dy^T [out, tokens] and x^T [in, tokens].
    dw = gemm(go_w, g_wt, xo, xt, w_dtype, a_t=True, b_t=True, mm_dtype=mm, compute_dtype=dt)
    if want_bias_grad:
        db = dy2d.sum(0, dtype=torch.float32)
    else:  # no bias: no sum over all tokens, and no zero-filled placeholder either (a launch)
        db = dy2d.new_empty(0, dtype=torch.float32)
    return dx, dw, db, go.amax


@fp8_linear_backward_op.register_fake
def _(dy, x_data, x_scale, w_data, w_scale, g_state, sr_seed, x_dtype, w_dtype, want_bias_grad, *knobs):
    rows, kk = x_data.shape
    n = w_data.shape[0]
    return (dy.new_empty(rows, kk, dtype=x_dtype), dy.new_empty(n, kk, dtype=w_dtype),
            dy.new_empty(n if want_bias_grad else 0, dtype=torch.float32), dy.new_empty((), dtype=torch.float32))


def keep_output_grad_only(ctx, y: torch.Tensor) -> None:
    """Backward gets ``None`` (not zero-filled tensors) for outputs nobody differentiated: the saved
    codes, scales and amaxes never are, and ``y``'s own is rebuilt by :func:`output_grad` only when
    just those were used."""
    ctx.set_materialize_grads(False)
    ctx.y_meta = (y.shape, y.dtype, y.device)


def output_grad(ctx, dy: torch.Tensor | None) -> torch.Tensor:
    """``dy``, or zeros shaped like the output when only the op's other outputs were used."""
    if dy is None:
        shape, dtype, device = ctx.y_meta
        return torch.zeros(shape, dtype=dtype, device=device)
    return dy


def _setup_context(ctx, inputs, output):
    x, weight, bias, x_state, w_state, g_state = inputs[:6]
    _, _, _, x_data, x_scale, w_data, w_scale = output
    ctx.save_for_backward(x_data, x_scale, w_data, w_scale)
    keep_output_grad_only(ctx, output[0])
    ctx.g_state = list(g_state)
    ctx.sr_stream = inputs[6]
    ctx.n_states = (len(x_state), len(w_state), len(g_state))
    ctx.x_shape = x.shape
    ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
    ctx.b_dtype = None if bias is None else bias.dtype
    ctx.knobs = LinearKnobs.take(inputs)  # validated by the forward


def record_grad_amax(g_state, g_amax, k: LinearKnobs) -> None:
    """The backward's record of grad_output's amax into its delayed-scaling state (if any)."""
    if g_state and resolve_format(k.bwd_format) is not None:
        torch.ops.fp8pass.delayed_record_(*g_state, g_amax, k.bwd_format, k.margin, k.interval, k.algo,
                                          k.power_of_two)


def _backward(ctx, dy, *unused):
    k = ctx.knobs
    dx, dw, db, g_amax = torch.ops.fp8pass.fp8_linear_backward(
        output_grad(ctx, dy), *ctx.saved_tensors, ctx.g_state,
        draw_seed(ctx.sr_stream, k.grad_rounding, k.bwd_format, draws_per_backward(k.granularity)),
        ctx.x_dtype, ctx.w_dtype, ctx.b_dtype is not None, *k.args())
    record_grad_amax(ctx.g_state, g_amax, k)
    dbias = None if ctx.b_dtype is None else db.to(ctx.b_dtype)
    nx, nw, ng = ctx.n_states
    return ((dx.reshape(ctx.x_shape), dw, dbias, [None] * nx, [None] * nw, [None] * ng, None)
            + LinearKnobs.no_grads())


fp8_linear_op.register_autograd(_backward, setup_context=_setup_context)
