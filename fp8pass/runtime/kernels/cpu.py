"""CPU kernels of the runtime ops (torch family): fused casts and the bf16 GEMM of FP8 operands.

CPU FP8 GEMMs are bf16 matmuls of the upcast FP8 codes: every E4M3/E5M2 value is exact in bf16, the
products of two of them are exact in fp32, and oneDNN's bf16 matmul accumulates in fp32. The scales
enter as the GEMM's ``alpha`` (applied to the fp32 accumulator, one rounding to the output dtype).
``torch._scaled_mm`` is never used on CPU (REFERENCES.md §5: ~10,000x slower).

Eager elementwise casts cost several passes over memory (widen, multiply, clamp, convert) and the
fp8 -> bf16 conversion is scalar code in eager torch; they would decide the CPU speed ratio. Each
cast below is therefore one Inductor-compiled loop (``dynamic=True``, so shapes never recompile):

=====================  ==================================================================
``cast``               one read of ``x``: codes ``sat(x * s)``, ``max |x|`` and optionally the
                       codes upcast to the GEMM dtype, written in the same loop
``upcast``             codes -> bf16 / fp32
=====================  ==================================================================

Inductor converts fp32 -> fp8 with c10's round-to-nearest-even, bit-identical to
``fp8pass.numerics.saturating_cast`` (tested). ``FP8PASS_CPU_FUSED=0`` (or a machine where Inductor
cannot compile) selects the eager twins, which compute the same bits more slowly.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

from ...numerics import Format
from ...numerics.kernels import torch_family

__all__ = ["fused_enabled", "cast", "upcast", "gemm_tensor_scaled"]

_BROKEN: list[str] = []  # set once when Inductor fails, so we warn once and stay eager


def fused_enabled() -> bool:
    """Whether the compiled CPU kernels are used (FP8PASS_CPU_FUSED=0 turns them off)."""
    return os.environ.get("FP8PASS_CPU_FUSED", "1") != "0" and not _BROKEN


def _eager_cast(x: torch.Tensor, scale: torch.Tensor, fmax: float, dtype, up):
    xf = x.float()
    amax = xf.abs().amax()
    codes = (xf * scale).clamp_(-fmax, fmax).to(dtype)
    return codes, amax, (codes.to(up) if up is not None else None)


@functools.cache
def _compiled_cast(fmax: float, dtype: torch.dtype, up: torch.dtype | None):
    def cast_kernel(x, scale):
        xf = x.float()
        amax = xf.abs().amax()
        codes = (xf * scale).clamp(-fmax, fmax).to(dtype)
        if up is None:
            return codes, amax
        return codes, amax, codes.to(up)

    return torch.compile(cast_kernel, dynamic=True, fullgraph=True)


@functools.cache
def _compiled_upcast(dtype: torch.dtype):
    return torch.compile(lambda c: c.to(dtype), dynamic=True, fullgraph=True)


def _run_compiled(fn, eager, *args):
    if fused_enabled():
        try:
            return fn(*args)
        except Exception as err:  # no C++ compiler, unsupported torch: stay correct, get slower
            _BROKEN.append(repr(err))
            warnings.warn(f"fp8pass: compiled CPU casts unavailable ({err!r:.200}); using eager casts",
                          RuntimeWarning, stacklevel=3)
    return eager(*args)


def cast(x: torch.Tensor, scale: torch.Tensor, fmt: Format, up: torch.dtype | None = None):
    """Codes ``saturating_cast(x * scale, fmt)`` (RNE) for a scalar fp32 ``scale``, with ``max |x|``.

    Args:
        x: bf16/fp16/fp32 tensor, any shape (made contiguous).
        scale: fp32 scalar tensor.
        fmt: an FP8 format with a torch dtype.
        up: also return the codes converted to this dtype (the GEMM operand), or None.

    Returns:
        (codes, amax fp32 scalar, upcast or None).
    """
    x = x.contiguous()
    scale = scale.to(torch.float32).reshape(())
    if x.numel() == 0:
        codes = torch.empty(x.shape, dtype=fmt.torch_dtype, device=x.device)
        zero = torch.zeros((), dtype=torch.float32, device=x.device)
        return codes, zero, (codes.to(up) if up is not None else None)
    if x.dtype == torch.float64:
        codes, amax = torch_family.cast_scaled(x, scale, fmt, want_amax=True)
        return codes, amax.float(), (codes.to(up) if up is not None else None)
    out = _run_compiled(
        _compiled_cast(fmt.max, fmt.torch_dtype, up),
        lambda a, s: _eager_cast(a, s, fmt.max, fmt.torch_dtype, up),
        x, scale,
    )
    codes, amax = out[0], out[1]
    return codes, amax.float(), (out[2] if up is not None else None)


def upcast(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 codes -> ``dtype`` (exact); a transposed view is upcast through its contiguous base."""
    if codes.dtype == dtype:
        return codes
    if not codes.dtype.is_floating_point or codes.element_size() != 1:
        return codes.to(dtype)
    if codes.dim() == 2 and not codes.is_contiguous() and codes.t().is_contiguous():
        return upcast(codes.t(), dtype).t()
    codes = codes.contiguous()
    if codes.numel() == 0:
        return codes.to(dtype)
    return _run_compiled(_compiled_upcast(dtype), lambda c: c.to(dtype), codes)


def gemm_tensor_scaled(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(a / a_scale) @ (b / b_scale).T (+ bias)`` for 2-D operands with scalar scales.

    ``a`` [M, K] and ``b`` [N, K] are FP8 codes (any strides) or, with the identity testing format,
    high-precision values with scale 1. The GEMM runs in bf16 when the output is bf16 (fp32
    accumulation, one rounding), otherwise in fp32; ``alpha = 1 / (a_scale * b_scale)``.
    """
    gemm_dtype = torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32
    if a.dtype == torch.float64 or b.dtype == torch.float64:
        gemm_dtype = torch.float64
    a_up = upcast(a, gemm_dtype)
    b_up = upcast(b, gemm_dtype)
    alpha = 1.0 / (float(a_scale) * float(b_scale))
    m, n = a_up.shape[0], b_up.shape[0]
    if bias is None:
        if alpha == 1.0:
            out = torch.mm(a_up, b_up.t())
        else:
            out = torch.addmm(a_up.new_zeros(()).expand(m, n), a_up, b_up.t(), beta=0, alpha=alpha)
    else:
        out = torch.addmm(bias.to(gemm_dtype), a_up, b_up.t(), alpha=alpha)
    return out.to(out_dtype)
