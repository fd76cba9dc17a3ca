"""``fp8pass::fp8_linear``: ``y = x W^T (+ b)`` with FP8 GEMMs in forward and backward.

Forward: ``x`` and ``W`` cast to ``fwd_format`` (E4M3), one GEMM, bias added in high precision, output
in ``x``'s dtype. Backward (the "hybrid" recipe): ``dy`` cast to ``bwd_format`` (E5M2, round to nearest
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

from ..numerics import ROUNDINGS
from ..config import GRANULARITIES, ALGOS
from .casting import MX_COLS, Operand, as_bytes, cast_operand, from_bytes, gemm, resolve_format, tile_for
from .kernels import cpu as cpu_kernels
from .kernels import uses_triton

__all__ = ["fp8_linear_op", "check_linear_args"]


def check_linear_args(x, weight, bias, fwd_format, bwd_format, granularity, block, grad_rounding, algo):
    """Clear errors for bad arguments (what was wrong and what is valid)."""
    if x.dim() < 1 or weight.dim() != 2:
        raise ValueError(f"fp8_linear needs x [..., in] and weight [out, in]; got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"fp8_linear: x has {x.shape[-1]} input features, weight expects {weight.shape[1]}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"fp8_linear: bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    for name, t in (("x", x), ("weight", weight)):
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            raise TypeError(f"fp8_linear: {name} must be float16/bfloat16/float32/float64, got {t.dtype}")
    resolve_format(fwd_format)
    resolve_format(bwd_format)
    if granularity not in GRANULARITIES:
        raise ValueError(f"unknown granularity {granularity!r}; valid: {', '.join(GRANULARITIES)}")
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    if grad_rounding not in ROUNDINGS:
        raise ValueError(f"unknown grad_rounding {grad_rounding!r}; valid: {', '.join(ROUNDINGS)}")
    if algo not in ALGOS:
        raise ValueError(f"unknown algo {algo!r}; valid: {', '.join(ALGOS)}")


def _up(device, out_dtype) -> torch.dtype | None:
    """Dtype the torch-family GEMM upcasts codes to (None: the Triton/CUDA path takes the codes).

    On CPU, :func:`fp8pass.runtime.kernels.cpu.gemm_dtype` decides (bf16 only where this CPU has
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


@torch.library.custom_op("fp8pass::fp8_linear", mutates_args=())
def fp8_linear_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    x_state: list[torch.Tensor],
    w_state: list[torch.Tensor],
    g_state: list[torch.Tensor],
    fwd_format: str,
    bwd_format: str,
    granularity: str,
    block: int,
    power_of_two: bool,
    grad_rounding: str,
    margin: float,
    interval: int,
    algo: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(y, x_amax, w_amax, x_data, x_scale, w_data, w_scale)``; see the module doc."""
    check_linear_args(x, weight, bias, fwd_format, bwd_format, granularity, block, grad_rounding, algo)
    fmt = resolve_format(fwd_format)
    x2d = x.reshape(-1, x.shape[-1])
    up = _up(x.device, x.dtype)
    xt = tile_for(granularity, block, x2d.shape, weight=False)
    wt = tile_for(granularity, block, weight.shape, weight=True)
    xo = cast_operand(x2d, fmt, granularity, xt, x_state, margin, power_of_two, up=up)
    wo = cast_operand(weight, fmt, granularity, wt, w_state, margin, power_of_two, up=up)
    mx = granularity == "mx" and fmt is not None
    y = gemm(xo, xt, wo, wt, x.dtype, bias, mm_dtype=_mx_mm_dtype(x.device, x.dtype) if mx else torch.float32)
    if mx:  # the backward GEMMs reduce over tokens (x) and out-features (W): save both cast down the rows
        xo = cast_operand(x2d, fmt, granularity, MX_COLS)
        wo = cast_operand(weight, fmt, granularity, MX_COLS)
    return (y.reshape(*x.shape[:-1], weight.shape[0]), xo.amax, wo.amax,
            as_bytes(xo.data), xo.scale.clone(), as_bytes(wo.data), wo.scale.clone())


@fp8_linear_op.register_fake
def _(x, weight, bias, x_state, w_state, g_state, fwd_format, bwd_format, granularity, block, power_of_two,
      grad_rounding, margin, interval, algo):
    check_linear_args(x, weight, bias, fwd_format, bwd_format, granularity, block, grad_rounding, algo)
    fmt = resolve_format(fwd_format)
    rows = 1
    for d in x.shape[:-1]:
        rows = rows * d
    k, n = weight.shape[1], weight.shape[0]
    code = x.dtype if fmt is None else torch.uint8
    wcode = weight.dtype if fmt is None else torch.uint8
    f32 = dict(dtype=torch.float32, device=x.device)
    if granularity == "mx" and fmt is not None:  # saved cast down the rows (MX_COLS)
        x_scale, w_scale = (-(-rows // MX_COLS[0]), k), (-(-n // MX_COLS[0]), k)
    else:
        x_scale = _scale_shape(granularity if fmt else "tensor", block, rows, k, False)
        w_scale = _scale_shape(granularity if fmt else "tensor", block, n, k, True)
    return (
        x.new_empty(*x.shape[:-1], n),
        x.new_empty((), dtype=torch.float32),
        x.new_empty((), dtype=torch.float32),
        x.new_empty(rows, k, dtype=code),
        torch.empty(x_scale, **f32),
        x.new_empty(n, k, dtype=wcode),
        torch.empty(w_scale, **f32),
    )


@torch.library.custom_op("fp8pass::fp8_linear_backward", mutates_args=())
def fp8_linear_backward_op(
    dy: torch.Tensor,
    x_data: torch.Tensor,
    x_scale: torch.Tensor,
    w_data: torch.Tensor,
    w_scale: torch.Tensor,
    g_state: list[torch.Tensor],
    x_dtype: torch.dtype,
    w_dtype: torch.dtype,
    want_bias_grad: bool,
    fwd_format: str,
    bwd_format: str,
    granularity: str,
    block: int,
    power_of_two: bool,
    grad_rounding: str,
    margin: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx2d, dW, db_fp32, dy_amax)`` from ``dy`` and the saved FP8 operands (no state mutation)."""
    fmt = resolve_format(bwd_format)
    x_data = from_bytes(x_data, resolve_format(fwd_format))
    w_data = from_bytes(w_data, resolve_format(fwd_format))
    dy2d = dy.reshape(-1, dy.shape[-1])
    up = _up(dy.device, x_dtype)
    gt = tile_for(granularity, block, dy2d.shape, weight=False)
    go = cast_operand(dy2d, fmt, granularity, gt, g_state, margin, power_of_two, grad_rounding, up=up,
                      transpose=up is None)
    xt = tile_for(granularity, block, x_data.shape, weight=False)
    wt = tile_for(granularity, block, w_data.shape, weight=True)
    xo = Operand(x_data, x_scale, x_scale)
    wo = Operand(w_data, w_scale, w_scale)
    go_w, g_wt, mm = go, gt, torch.float32
    if granularity == "mx":  # every operand blocked along its GEMM's reduction dim (the module doc)
        saved_mx = resolve_format(fwd_format) is not None
        if saved_mx:
            xt = wt = MX_COLS
        if fmt is not None:
            g_wt = MX_COLS
            go_w = cast_operand(dy2d, fmt, granularity, MX_COLS, g_state, margin, power_of_two, grad_rounding)
        if saved_mx and fmt is not None:
            mm = _mx_mm_dtype(dy.device, x_dtype)
    # dx = dy @ W: W^T [in, out] is the "B" operand ([N, K] with K = out).
    dx = gemm(go, gt, wo, wt, x_dtype, b_t=True, mm_dtype=mm)
    # dW = dy^T @ x: dy^T [out, tokens] and x^T [in, tokens].
    dw = gemm(go_w, g_wt, xo, xt, w_dtype, a_t=True, b_t=True, mm_dtype=mm)
    if want_bias_grad:
        db = dy2d.sum(0, dtype=torch.float32)
    else:  # a sum over all tokens is not free; skip it when there is no bias
        db = dy2d.new_zeros(w_data.shape[0], dtype=torch.float32)
    return dx, dw, db, go.amax


@fp8_linear_backward_op.register_fake
def _(dy, x_data, x_scale, w_data, w_scale, g_state, x_dtype, w_dtype, want_bias_grad, fwd_format, bwd_format, granularity, block,
      power_of_two, grad_rounding, margin):
    rows, k = x_data.shape
    n = w_data.shape[0]
    return (dy.new_empty(rows, k, dtype=x_dtype), dy.new_empty(n, k, dtype=w_dtype),
            dy.new_empty(n, dtype=torch.float32), dy.new_empty((), dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    (x, weight, bias, x_state, w_state, g_state, fwd_format, bwd_format, granularity, block, power_of_two,
     grad_rounding, margin, interval, algo) = inputs
    _, _, _, x_data, x_scale, w_data, w_scale = output
    ctx.save_for_backward(x_data, x_scale, w_data, w_scale)
    ctx.g_state = list(g_state)
    ctx.n_states = (len(x_state), len(w_state), len(g_state))
    ctx.x_shape = x.shape
    ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
    ctx.b_dtype = None if bias is None else bias.dtype
    ctx.args = (fwd_format, bwd_format, granularity, block, power_of_two, grad_rounding, margin)
    ctx.recipe = (margin, interval, algo, power_of_two)


def _backward(ctx, dy, *unused):
    x_data, x_scale, w_data, w_scale = ctx.saved_tensors
    fwd_format, bwd_format, granularity, block, power_of_two, grad_rounding, margin = ctx.args
    dx, dw, db, g_amax = torch.ops.fp8pass.fp8_linear_backward(
        dy, x_data, x_scale, w_data, w_scale, ctx.g_state, ctx.x_dtype, ctx.w_dtype, ctx.b_dtype is not None, fwd_format, bwd_format, granularity,
        block, power_of_two, grad_rounding, margin)
    if ctx.g_state and resolve_format(bwd_format) is not None:
        m, interval, algo, p2 = ctx.recipe
        torch.ops.fp8pass.delayed_record_(*ctx.g_state, g_amax, bwd_format, m, interval, algo, p2)
    dbias = None if ctx.b_dtype is None else db.to(ctx.b_dtype)
    nx, nw, ng = ctx.n_states
    return (dx.reshape(ctx.x_shape), dw, dbias, [None] * nx, [None] * nw, [None] * ng) + (None,) * 9


fp8_linear_op.register_autograd(_backward, setup_context=_setup_context)
