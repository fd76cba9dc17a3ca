"""``fp8pass::nvfp4_linear``: ``y = x W^T (+ b)`` with NVFP4 operands in forward and backward.

Operands are quantized with ``fp8pass.quantize(.., E2M1, granularity="block")`` (E2M1 codes, E4M3
block scales, one fp32 tensor scale). No CPU or Hopper GPU has FP4 tensor cores, so every GEMM runs
on the exact operand values: ``codes * block_scale`` is exact in fp32 (and bf16), the GEMM
accumulates in fp32 and the two tensor scales are divided out of the result. The numerics are
NVFP4's; only the speed is not.

* forward: ``Q(x)`` 1x16 blocks along in-features, RNE; ``Q(W)`` 16x16 blocks (``weight_2d``) or 1x16.
  With HCP state, the hot input channels' residual is added back (see :func:`hcp_patch`).
* dgrad ``dx = dy W``: ``Q_sr(dy)`` 1x16 along out-features; ``Q(W)``: the forward's 16x16 blocks
  (W^T quantizes identically), or W^T quantized 1x16 along out-features when ``weight_2d`` is off.
* wgrad ``dW = dy^T x``: both operands transposed so tokens are last, zero-padded to a multiple
  of 16, RHT'd (``rht``), quantized 1x16 along tokens; ``dy`` with stochastic rounding.
* ``db = sum(dy)`` in fp32.
* HCP in backward (``hcp_backward``): the forward's hot input channels ``h`` are patched in both
  gradient GEMMs too, as columns of their outputs: ``dx[:, h]`` and ``dW[:, h]`` get
  ``A B_h^T - Q(A) Q(B_h)^T`` (second order) added, with ``(A, B) = (dy, W^T)`` for dgrad and the RHT'd
  ``(dy^T, x^T)`` for wgrad, so with every channel hot both gradients are the high-precision ones.

Stochastic rounding of the gradients rounds the E4M3 block scales up (``fp8pass.quantize``), so no
block max is clipped and the rounding is unbiased everywhere. Its bits come from the weight's
stochastic-rounding stream where the op gets one (``sr_stream``, :mod:`fp8pass.runtime.sr`: two seeds
per backward, one for dgrad's ``Q_sr(dy)`` and one for wgrad's), else from torch's generator. Backward saves ``x`` and ``W`` in high
precision (the weight is a parameter anyway) and recomputes the quantizations: RNE is deterministic,
so W's blocks are bit-identical to the forward's.
"""

from __future__ import annotations

import torch

from ..config import HCP_MODES
from ..kernels import torch_family
from ..numerics import E2M1, decode
from ..op_schema import SR_SEED, SR_STREAM, NVFP4GradKnobs, NVFP4Knobs, knob_op
from ..quantized import quantize
from .hcp import channel_error, select_hot
from .rht import pad_last_dim, rht_last_dim
from .sr import seed_of

__all__ = ["nvfp4_values", "nvfp4_linear_op", "hcp_patch", "residual_operands", "ACT_BLOCK", "WEIGHT_BLOCK"]

ACT_BLOCK = (1, 16)
WEIGHT_BLOCK = (16, 16)


def nvfp4_values(x2d: torch.Tensor, tile=ACT_BLOCK, rounding: str = "nearest",
                 seed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4-quantize a 2-D tensor; returns ``(v, g)``, values ``v / g``.

    ``v = E2M1 code * E4M3 block scale`` (exact in fp32), ``g`` the fp32 tensor encode scale.
    ``seed``: stochastic rounding's seed (int64 [1]), or None (torch's generator).
    """
    q = quantize(x2d, E2M1, granularity="block", block=tile, rounding=rounding, seed=seed)
    codes = decode(q.data, E2M1, torch.float32).reshape(x2d.shape)
    return codes * torch_family.expand_groups(q.block_scale.to(torch.float32), tile, x2d.shape), q.scale


def _mm_scaled(av, ag, bv, bg) -> torch.Tensor:
    """``(av @ bv^T) / (ag * bg)`` in fp32."""
    return torch.mm(av, bv.t()) / (ag * bg)


def residual_operands(a, aq, b, bq, second_order: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(L, R)`` with ``L @ R^T = a b^T - aq bq^T`` (second order) or that less ``(a - aq)(b - bq)^T``.

    ``L = [a - aq | aq]``, ``R = [b or bq | b - bq]``: ``(a - aq) b^T + aq (b - bq)^T`` is exactly
    ``a b^T - aq bq^T``; with ``bq`` in place of ``b`` the second-order term ``(a - aq)(b - bq)^T`` is
    left out. One GEMM whatever the order. All fp32.
    """
    a, b = a.to(torch.float32), b.to(torch.float32)
    return torch.cat([a - aq, aq], 1), torch.cat([b if second_order else bq, b - bq], 1)


def hcp_patch(x2d, xd, w, wd, hot, second_order: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Operands ``(A_h, B_h)`` with ``A_h @ B_h^T`` = the hot input channels' residual of ``X W^T``.

    First order: ``dX_h Q(W)_h^T + Q(X)_h dW_h^T``; with ``second_order`` ``+ dX_h dW_h^T`` (then it is
    ``X_h W_h^T - Q(X)_h Q(W)_h^T``), with ``dX = X - Q(X)``, ``dW = W - Q(W)`` (:func:`residual_operands`).
    """
    return residual_operands(x2d[:, hot], xd[:, hot], w[:, hot], wd[:, hot], second_order)


def _check(x, weight, bias, hcp_state, hcp_mode):
    if x.dim() < 1 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"nvfp4_linear needs x [..., in] and weight [out, in] with matching in; got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    if weight.shape[1] % 2:
        raise ValueError(f"nvfp4_linear: in_features must be even (E2M1 packs two codes per byte), got "
                         f"{weight.shape[1]}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"nvfp4_linear: bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    for name, t in (("x", x), ("weight", weight)):
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(f"nvfp4_linear: {name} must be float16/bfloat16/float32, got {t.dtype}")
    if hcp_state and len(hcp_state) != 3:
        raise ValueError("hcp_state must be [] or [err, hot, step] (fp8pass.runtime.HCPState.op_args())")
    if hcp_state and hcp_state[0].numel() != weight.shape[1]:
        raise ValueError(f"HCP state tracks {hcp_state[0].numel()} channels, the weight has {weight.shape[1]}")
    if hcp_mode not in HCP_MODES:
        raise ValueError(f"unknown hcp_mode {hcp_mode!r}; valid: {', '.join(HCP_MODES)}")


# Runs under the caller's autocast, as it always has: its GEMMs then run in the autocast dtype.
@knob_op("fp8pass::nvfp4_linear", f"Tensor x, Tensor weight, Tensor? bias, Tensor[] hcp_state, {SR_STREAM}",
         NVFP4Knobs, "(Tensor, Tensor, Tensor)", ambient_autocast=True)
def nvfp4_linear_op(x, weight, bias, hcp_state, sr_stream, *knobs):
    """Returns ``(y, chan_err, hot)``: with ``hcp_state``, ``chan_err`` is the forward GEMM's error
    per input channel from both operands (``[in]`` fp32, :func:`fp8pass.runtime.hcp.channel_error`)
    and ``hot`` the channels patched in this call (int64; what the backward patches); else empty.
    ``sr_stream``: the weight's stochastic-rounding stream (``runtime.sr``), which the backward's
    stochastic gradient casts draw their two seeds from (``sr_draw_``); None: torch's generator."""
    k = NVFP4Knobs.of(knobs)
    _check(x, weight, bias, hcp_state, k.hcp_mode)
    x2d = x.reshape(-1, x.shape[-1])
    xv, xg = nvfp4_values(x2d, ACT_BLOCK)
    wv, wg = nvfp4_values(weight, WEIGHT_BLOCK if k.weight_2d else ACT_BLOCK)
    chan_err = x.new_empty(0, dtype=torch.float32)
    hot = None
    if hcp_state:
        err, hot, step = hcp_state
        xd, wd = xv / xg, wv / wg
        chan_err = channel_error(x2d, xd, weight, wd)
        if int(step) == 0:  # no hot set chosen yet: pick it from this call's error
            hot = select_hot(chan_err, hot.numel())
    if hot is None or hot.numel() == 0:
        y = _mm_scaled(xv, xg, wv, wg)
    else:
        a, b = hcp_patch(x2d, xd, weight, wd, hot, k.hcp_second_order)
        if k.hcp_mode == "concat":
            y = torch.mm(torch.cat([xd, a], 1), torch.cat([wd, b], 1).t())
        else:
            y = _mm_scaled(xv, xg, wv, wg) + torch.mm(a, b.t())
    if bias is not None:
        y = y + bias.to(torch.float32)
    hot_out = x.new_empty(0, dtype=torch.int64) if hot is None else hot.clone()
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0]), chan_err, hot_out


@nvfp4_linear_op.register_fake
def _(x, weight, bias, hcp_state, sr_stream, *knobs):
    _check(x, weight, bias, hcp_state, NVFP4Knobs.of(knobs).hcp_mode)
    n = weight.shape[1] if hcp_state else 0
    n_hot = hcp_state[1].numel() if hcp_state else 0
    return (x.new_empty(*x.shape[:-1], weight.shape[0]), x.new_empty(n, dtype=torch.float32),
            x.new_empty(n_hot, dtype=torch.int64))


def _patch_columns(out, hot, a, aq, b, bq, second_order):
    """``out[:, hot] += a b_hot^T - aq bq_hot^T`` (less the second-order term without it), in fp32."""
    left, right = residual_operands(a, aq, b[hot], bq[hot], second_order)
    return out.index_add(1, hot, torch.mm(left, right.t()))


# Under the caller's autocast, as its forward.
@knob_op("fp8pass::nvfp4_linear_backward", f"Tensor dy, Tensor x, Tensor weight, Tensor hot, {SR_SEED}",
         NVFP4GradKnobs, "(Tensor, Tensor, Tensor)", ambient_autocast=True)
def nvfp4_linear_backward_op(dy, x, weight, hot, sr_seed, *knobs):
    """``(dx, dW, db_fp32)`` of ``y = x W^T + b`` (see the module doc); ``hot``: input channels whose
    gradient columns are patched (empty: plain NVFP4 gradients); ``sr_seed``: the two stochastic
    gradient casts' seeds (int64 [2]: dgrad's, wgrad's), or None (torch's generator)."""
    k = NVFP4GradKnobs.of(knobs)
    rounding = "stochastic" if k.grad_sr else "nearest"
    dy2d = dy.reshape(-1, dy.shape[-1])
    x2d = x.reshape(-1, x.shape[-1])
    # dgrad: reduction over out-features
    gv, gg = nvfp4_values(dy2d, ACT_BLOCK, rounding, seed_of(sr_seed, 0) if k.grad_sr else None)
    if k.weight_2d:
        wv, wg = nvfp4_values(weight, WEIGHT_BLOCK)
    else:
        wtv, wg = nvfp4_values(weight.t(), ACT_BLOCK)
        wv = wtv.t()
    dx = torch.mm(gv, wv) / (gg * wg)
    if hot.numel():  # (A, B) = (dy, W^T): columns h of dx
        dx = _patch_columns(dx, hot, dy2d, gv / gg, weight.t(), (wv / wg).t(), k.hcp_second_order)
    # wgrad: reduction over tokens (last dim after transposing)
    a, b = dy2d.t(), x2d.t()
    if k.rht:
        a, b = rht_last_dim(a, k.rht_seed), rht_last_dim(b, k.rht_seed)
    else:
        a, b = pad_last_dim(a), pad_last_dim(b)
    av, ag = nvfp4_values(a, ACT_BLOCK, rounding, seed_of(sr_seed, 1) if k.grad_sr else None)
    bv, bg = nvfp4_values(b, ACT_BLOCK)
    dw = _mm_scaled(av, ag, bv, bg)
    if hot.numel():  # (A, B) = (dy^T, x^T) after the RHT: columns h of dW
        dw = _patch_columns(dw, hot, a, av / ag, b, bv / bg, k.hcp_second_order)
    db = dy2d.sum(0, dtype=torch.float32)
    return dx.to(x.dtype).reshape(x.shape), dw.to(weight.dtype), db


@nvfp4_linear_backward_op.register_fake
def _(dy, x, weight, hot, sr_seed, *knobs):
    return (torch.empty_like(x), torch.empty_like(weight),
            dy.new_empty(weight.shape[0], dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    x, weight, bias, hcp_state, sr_stream = inputs[:5]
    k = NVFP4Knobs.take(inputs)  # validated by the forward
    hot = output[2] if k.hcp_backward else output[2][:0]
    ctx.save_for_backward(x, weight, hot)
    ctx.n_hcp = len(hcp_state)
    ctx.b_dtype = None if bias is None else bias.dtype
    ctx.knobs = k.grad()
    ctx.sr_stream = sr_stream


def _backward(ctx, dy, _chan_err_grad, _hot_grad):
    x, weight, hot = ctx.saved_tensors
    k = ctx.knobs
    seeds = torch.ops.fp8pass.sr_draw_(ctx.sr_stream, 2) if k.grad_sr and ctx.sr_stream is not None else None
    dx, dw, db = torch.ops.fp8pass.nvfp4_linear_backward(dy, x, weight, hot, seeds, *k.args())
    dbias = None if ctx.b_dtype is None else db.to(ctx.b_dtype)
    return (dx, dw, dbias, [None] * ctx.n_hcp, None) + NVFP4Knobs.no_grads()


nvfp4_linear_op.register_autograd(_backward, setup_context=_setup_context)
