"""An RMSNorm that keeps its normalized input as FP8 for backward: ``fp8pass::rmsnorm``.

What a compiled RMSNorm keeps for backward is its fp32 input ``x`` (the residual stream: 4 bytes per
element per norm) while the FP8 linears that read its output keep their own E4M3 codes of it. This op
computes the norm's forward exactly as the model wrote it and keeps instead::

    rstd  = rsqrt(mean(x^2, -1) + eps)       fp32, one per row
    x_hat = x * rstd                         E4M3 codes (1 byte per element) and one per-tensor scale

Backward (``g = dy * w``, all in fp32, ``x_hat`` the codes' values)::

    dw = sum_rows(dy * x_hat)
    dx = rstd * (g - x_hat * mean(g * x_hat, -1))

(from ``y = w * x * rstd`` with ``d rstd / dx_i = -rstd^3 x_i / d``: ``dx = rstd * g - x * rstd^3 *
mean(g * x) = rstd * (g - x_hat * mean(g * x_hat))``.)

Why ``x_hat`` and not ``x``: ``x_hat`` has unit RMS per row and ``|x_hat| <= sqrt(d)``, so one
per-tensor scale serves every row, whatever the residual stream's growth across layers; and the
backward needs ``x`` only through ``x_hat`` and ``rstd``. Why not the consumers' codes of ``y``
(``x_hat = y / w``, no extra bytes at all): the division by ``w`` turns the codes' relative error of
``y`` into an absolute error ``|y| 2^-4 / |w|`` of ``x_hat``, unbounded where a weight is near zero
(norm weights drift towards 0 for channels a layer ignores), and those codes are the linears' input
cast, which a Config may make per-row, per-block, MX or delayed (a stale scale can saturate). The
norm's own cast costs one 1-byte copy per element and its error is 2^-4 relative, always.

Numerics: ``y`` is the original norm's value bit for bit (the same torch ops, in the same order, in
the same dtypes: :class:`~fp8pass.op_schema.NormKnobs` says which form). ``dx`` and ``dw`` differ
from the exact gradients only by ``x_hat``'s E4M3 rounding: per element ``|x_hat' - x_hat| <=
2^-4 |x_hat| + 2^-10 / scale`` (half an ulp of a 3-bit mantissa; the second term for values that land
in E4M3's subnormals), which bounds ``dw`` and ``dx`` elementwise (tests/runtime/test_rmsnorm.py).

The cast is the kernels' per-tensor current cast (:func:`~.casting.cast_operand`, the same as an FP8
linear's input cast on that device). The rest is the torch math above, in two functions
(:func:`norm_forward_math`, :func:`norm_backward_math`; the backward takes ``x_hat`` as the codes' values
times ``1 / scale``). On CUDA (and on the CUDA code path run on CPU, ``FP8PASS_KERNELS=triton``) the
device module's norm kernels take it (``kernels/triton_norm.py``: forward and backward two launches each,
where these torch ops are 18); their row sums are reduced in the kernels' order, so ``y`` there is the
norm to fp32 rounding of ``rstd``, not bit for bit. On CPU, inputs of at least
``kernels.cpu.MIN_COMPILED`` elements run each as one Inductor-compiled loop nest (``cpu.run_fused``): the
forward reads ``x`` once and writes ``y``, ``x_hat`` and ``rstd``; the backward upcasts the codes in one
compiled loop (the kernels' ``upcast``), then reads them and ``dy`` once per reduction. There ``y`` is the value Inductor computes for the same norm (its reduction order
for ``mean(x^2)``, the order of the norm the fp8 backend compiled before this op replaced it; tested
against ``torch.compile`` of :func:`rmsnorm_reference`); smaller inputs, and norms the kernels do not take
(fp64 tensors) on the CUDA code path, run the eager ops, equal to the eager norm bit for bit.
"""

from __future__ import annotations

import torch

from .. import kernels
from ..op_schema import NormKnobs, knob_op
from .casting import IDENTITY, as_bytes, cast_operand, from_bytes, resolve_format

__all__ = ["rmsnorm_op", "rmsnorm_reference", "check_norm_knobs", "norm_forward_math", "norm_backward_math"]


def check_norm_knobs(k: NormKnobs) -> None:
    if not isinstance(k.eps, float) or not k.eps >= 0.0:
        raise ValueError(f"rmsnorm: eps must be a float >= 0, got {k.eps!r}")
    if k.fwd_format != IDENTITY:
        resolve_format(k.fwd_format)  # raises for a non-FP8 format


def _knobs(args: tuple) -> NormKnobs:
    return NormKnobs.of(args, check_norm_knobs)


def _check(x, weight):
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"rmsnorm: x [..., d] and weight [d] expected, got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    if not x.dtype.is_floating_point or not weight.dtype.is_floating_point:
        raise TypeError(f"rmsnorm: x and weight must be floating point, got {x.dtype} and {weight.dtype}")


def _y_dtype(x_dtype, weight_dtype, k: NormKnobs) -> torch.dtype:
    if k.out_dtype is not None:
        return k.out_dtype
    return torch.promote_types(torch.float32 if k.hat_dtype is None else k.hat_dtype, weight_dtype)


def norm_forward_math(x: torch.Tensor, weight: torch.Tensor, eps: float, hat_dtype, out_dtype):
    """``(y, x_hat [rows, d] fp32, rstd [rows, 1] fp32)``: the norm's forward (module doc) and what its
    backward keeps, before the cast of ``x_hat``."""
    xf = x.float()  # as the models write it
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    x_hat = xf * rstd
    h = x_hat if hat_dtype is None else x_hat.to(hat_dtype)
    y = h * weight
    d = x.shape[-1]
    return y if out_dtype is None else y.to(out_dtype), x_hat.reshape(-1, d), rstd.reshape(-1, 1)


def norm_backward_math(dy: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, rstd: torch.Tensor,
                       weight: torch.Tensor, x_dtype: torch.dtype):
    """``(dx [rows, d] in x_dtype, dw in weight's dtype)`` from ``dy [rows, d]`` and the values of the
    saved codes of ``x_hat`` (``x_hat = values * (1 / scale)``), all in fp32 (module doc)."""
    x_hat = values * scale.reciprocal()  # one division per tensor, as the kernels take it
    dyf = dy.float()
    g = dyf * weight.float()
    dw = (dyf * x_hat).sum(0)
    dx = rstd * (g - x_hat * (g * x_hat).mean(-1, keepdim=True))
    return dx.to(x_dtype), dw.to(weight.dtype)


def _norm_kernels(device: torch.device, d: int, x_dtype: torch.dtype, weight_dtype: torch.dtype, k: NormKnobs):
    """The device module whose norm kernels take this norm (CUDA's Triton kernels: 4 launches forward
    and backward instead of 18 torch ops), or None: the torch ops above."""
    if k.fwd_format == IDENTITY:
        return None
    kern = kernels.for_device(device)
    if kern.OFFERS.fused_norm and kern.norm_supported(d, resolve_format(k.fwd_format), x_dtype, weight_dtype,
                                                      k.hat_dtype, _y_dtype(x_dtype, weight_dtype, k)):
        return kern
    return None


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, k: NormKnobs) -> torch.Tensor:
    """The norm this op computes, as plain differentiable torch (what the rewrite replaced)."""
    return norm_forward_math(x, weight, k.eps, k.hat_dtype, k.out_dtype)[0]


@knob_op("fp8pass::rmsnorm", "Tensor x, Tensor weight", NormKnobs, "(Tensor, Tensor, Tensor, Tensor)")
def rmsnorm_op(x, weight, *knobs):
    """``(y, x_hat_data [rows, d], x_hat_scale, rstd [rows, 1])``; see the module doc. The last three
    are for backward (uint8 E4M3 codes and their fp32 encode scale; fp32 values and 1 for "identity")."""
    k = _knobs(knobs)
    _check(x, weight)
    d = x.shape[-1]
    kern = _norm_kernels(x.device, d, x.dtype, weight.dtype, k)
    if kern is not None:
        y, codes, scale, rstd = kern.rmsnorm_forward(x.reshape(-1, d), weight, k.eps, k.hat_dtype,
                                                     _y_dtype(x.dtype, weight.dtype, k), resolve_format(k.fwd_format))
        return y.view(x.shape), codes, scale, rstd
    y, x_hat, rstd = kernels.run_fused(norm_forward_math, (x, weight), (k.eps, k.hat_dtype, k.out_dtype))
    operand = cast_operand(x_hat, resolve_format(k.fwd_format))
    return y, as_bytes(operand.data), operand.scale, rstd


@rmsnorm_op.register_fake
def _(x, weight, *knobs):
    k = _knobs(knobs)
    _check(x, weight)
    d = x.shape[-1]
    rows = x.numel() // d if d else 0
    f32 = dict(dtype=torch.float32, device=x.device)
    code = torch.float32 if k.fwd_format == IDENTITY else torch.uint8
    return (x.new_empty(x.shape, dtype=_y_dtype(x.dtype, weight.dtype, k)),
            x.new_empty(rows, d, dtype=code), torch.empty((), **f32), torch.empty(rows, 1, **f32))


@knob_op("fp8pass::rmsnorm_backward",
         "Tensor dy, Tensor x_hat_data, Tensor x_hat_scale, Tensor rstd, Tensor weight, ScalarType x_dtype",
         NormKnobs, "(Tensor, Tensor)")
def rmsnorm_backward_op(dy, x_hat_data, x_hat_scale, rstd, weight, x_dtype, *knobs):
    """``(dx [rows, d] in x_dtype, dw in weight's dtype)`` from the saved codes (module doc)."""
    k = _knobs(knobs)
    fmt = resolve_format(k.fwd_format)
    kern = _norm_kernels(x_hat_data.device, x_hat_data.shape[-1], x_dtype, weight.dtype, k)
    if kern is not None:
        return kern.rmsnorm_backward(dy.reshape(x_hat_data.shape), x_hat_data, x_hat_scale, rstd, weight, x_dtype, fmt)
    codes = from_bytes(x_hat_data, fmt)
    # the codes' values first, by the device's own upcast (CPU: one compiled loop), then the fp32 math as
    # one loop nest: decoding FP8 inside it would run once per reduction, and the decode is the dear part
    values = kernels.for_device(codes.device).upcast(codes, torch.float32)
    return kernels.run_fused(norm_backward_math, (dy.reshape(codes.shape), values, x_hat_scale, rstd, weight),
                             (x_dtype,))


@rmsnorm_backward_op.register_fake
def _(dy, x_hat_data, x_hat_scale, rstd, weight, x_dtype, *knobs):
    return dy.new_empty(x_hat_data.shape, dtype=x_dtype), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output):
    x, weight = inputs[:2]
    _, x_hat_data, x_hat_scale, rstd = output
    ctx.save_for_backward(x_hat_data, x_hat_scale, rstd, weight)
    ctx.set_materialize_grads(False)
    ctx.x_meta = (x.shape, x.dtype)
    ctx.y_meta = (output[0].shape, output[0].dtype, output[0].device)
    ctx.knobs = NormKnobs.take(inputs)


def _backward(ctx, dy, *unused):
    shape, x_dtype = ctx.x_meta
    if dy is None:  # only the saved outputs were used
        y_shape, y_dtype, device = ctx.y_meta
        dy = torch.zeros(y_shape, dtype=y_dtype, device=device)
    dx, dw = torch.ops.fp8pass.rmsnorm_backward(dy, *ctx.saved_tensors, x_dtype, *ctx.knobs.args())
    return (dx.reshape(shape), dw) + NormKnobs.no_grads()


rmsnorm_op.register_autograd(_backward, setup_context=_setup_context)
