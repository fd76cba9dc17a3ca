"""CUDA kernels of the runtime ops: Triton casts and ``torch._scaled_mm`` FP8 GEMMs.

``_scaled_mm`` wants ``a`` row-major and ``b`` column-major, dims that are multiples of 16, and not
both operands E5M2; it takes decode scales (``1 / encode scale``) and accumulates in fp32. Operands
it cannot take (other shapes, the identity testing format) go through the fallback: dequantize to
fp32 and multiply there, which is correct for every shape, only slower. Never used on CPU.
"""

from __future__ import annotations

import torch

from ...numerics import Format
from . import triton_kernels

__all__ = ["cast", "upcast", "gemm_tensor_scaled", "transpose_cast"]

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def cast(x: torch.Tensor, scale: torch.Tensor, fmt: Format, up: torch.dtype | None = None):
    """Codes ``saturating_cast(x * scale)`` and ``max |x|`` in one read (Triton)."""
    x2d = x.reshape(-1, x.shape[-1]) if x.dim() > 1 else x.reshape(1, -1)
    codes, _, amax = triton_kernels.transpose_cast(x2d, scale, fmt, transpose=False)
    codes = codes.view(x.shape)
    return codes, amax, (None if up is None else codes.to(up))


transpose_cast = triton_kernels.transpose_cast


def upcast(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return codes.to(dtype)


def _scaled_mm_ok(a: torch.Tensor, b: torch.Tensor, out_dtype) -> bool:
    return (a.is_cuda and a.dtype in _FP8 and b.dtype in _FP8 and not (a.dtype == b.dtype == torch.float8_e5m2)
            and all(d % 16 == 0 for d in (*a.shape, b.shape[0]))
            and out_dtype in (torch.bfloat16, torch.float16, torch.float32))


def gemm_tensor_scaled(a, a_scale, b, b_scale, out_dtype, bias=None):
    """``(a / a_scale) @ (b / b_scale).T (+ bias)``; ``a`` [M, K], ``b`` [N, K], scalar scales."""
    if _scaled_mm_ok(a, b, out_dtype):
        inv_a = torch.reciprocal(a_scale.to(torch.float32)).reshape(())
        inv_b = torch.reciprocal(b_scale.to(torch.float32)).reshape(())
        bias_arg = bias.to(out_dtype) if bias is not None and out_dtype == torch.bfloat16 else None
        out = torch._scaled_mm(a.contiguous(), b.contiguous().t(), scale_a=inv_a, scale_b=inv_b,
                               bias=bias_arg, out_dtype=out_dtype)
        if bias is not None and bias_arg is None:
            out = (out.float() + bias.float()).to(out_dtype)
        return out
    av = a.to(torch.float32) / a_scale.to(torch.float32)
    bv = b.to(torch.float32) / b_scale.to(torch.float32)
    out = av @ bv.t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)
