"""CUDA kernels of the runtime ops: Triton casts and ``torch._scaled_mm`` FP8 GEMMs.

``_scaled_mm`` wants ``a`` [M, K] row-major and ``b`` column-major, K and N multiples of 16 (M is
free), and not both operands E5M2; it takes decode scales (``1 / encode scale``) and accumulates in
fp32. :func:`scaled_mm_plan` decides: FP8 operands on CUDA always take it, K and N that are not
multiples of 16 padded with zero codes (a zero adds exactly nothing to an fp32 sum), so a token
count of 4095 in a wgrad GEMM costs one small copy, not a dequantize + fp32 matmul. What it cannot
take (two E5M2 operands, the identity testing format, empty dims, CPU tensors) goes through the
fallback: dequantize to fp32 and multiply there, correct for every shape, only slower. Never used
on CPU.

Grouped (MoE) GEMMs: the forward (E4M3 x E4M3) uses ``torch._scaled_grouped_mm`` where torch has it
and the GPU takes it (sm90+, dims multiples of 16), with no host sync; otherwise, and for the
backward GEMMs (E5M2 operands, which ``_scaled_grouped_mm`` does not take), a loop of
:func:`gemm_tensor_scaled` per group, which reads the group offsets on the host (one sync per call).
The per-row casts are eager torch math here (no Triton kernel yet).
"""

from __future__ import annotations

import torch

from ..numerics import Format
from . import triton_family, triton_operand_casts, triton_scaling
from .interface import Offers

__all__ = ["OFFERS", "cast", "cast_delayed", "cast_current", "cast_stochastic", "upcast", "gemm_tensor_scaled", "scaled_mm_plan",
           "transpose_cast", "row_amax", "cast_rows", "grouped_gemm",
           "grouped_gemm_wgrad"]

# Scales picked on the device inside the casts' launches, both layouts from one read; the GEMMs
# (``_scaled_mm``) take the FP8 codes themselves.
OFFERS = Offers(scale_on_device=True, transpose_cast=True, values_without_codes=False, upcast_gemm_operands=False)

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def cast(x: torch.Tensor, scale: torch.Tensor, fmt: Format, up: torch.dtype | None = None, want_amax: bool = True):
    """Codes ``saturating_cast(x * scale)`` and ``max |x|`` in one read (Triton); amax None without
    ``want_amax`` (no reduction launched: a recast with a known scale)."""
    x2d = x.reshape(-1, x.shape[-1]) if x.dim() > 1 else x.reshape(1, -1)
    codes, _, amax = triton_operand_casts.transpose_cast(x2d, scale, fmt, transpose=False, partials=not want_amax)
    amax = amax if want_amax else None
    codes = codes.view(x.shape)
    return codes, amax, (None if up is None else codes.to(up))


transpose_cast = triton_operand_casts.transpose_cast


def cast_delayed(x2d: torch.Tensor, state: list[torch.Tensor], fmt: Format, margin: float, power_of_two: bool,
                 rounding: str = "nearest", transpose: bool = False, invert: tuple[torch.Tensor, ...] = ()):
    """A delayed-scaled cast in one read of ``x2d`` and two launches (no host read).

    Casts with the held scale, taking the per-tile maxima of ``|x|`` from the same read; the kernel's
    last program reduces them and picks the scale the cast should have used
    (:func:`~fp8pass.numerics.scaling.scale_to_cast`: the held one, or the current one with an empty
    history or when the overflow guard fires) with its decode scale; a second launch recasts only if
    it differs (otherwise it reads and writes nothing). So the codes, scale and amax are those of
    the two-read reference; a second read happens only on the first step and when the guard fires.
    ``invert``: scales whose decode scales the scale launch computes too (:func:`cast_current`).

    Returns:
        (codes [R, C], codes [C, R] or None, :class:`~.triton_scaling.OperandScale`).
    """
    data, data_t, sc = triton_operand_casts.transpose_cast(x2d, state[1], fmt, transpose, rounding,
                                                     delayed=(state, margin, power_of_two, invert))
    triton_operand_casts.transpose_cast(x2d, sc.scale, fmt, transpose, rounding, only_if=sc.recast, out=(data, data_t))
    return data, data_t, sc


def cast_current(x2d: torch.Tensor, fmt: Format, margin: float, power_of_two: bool, rounding: str = "nearest",
                 transpose: bool = False, invert: tuple[torch.Tensor, ...] = ()):
    """A current-scaled per-tensor cast in two reads of ``x2d`` and two launches (no host read): the amax
    and, from the kernel's last program, the scale (:func:`~fp8pass.numerics.scale_from_amax`), its
    decode scale and ``1 / s`` of each ``invert`` scale (:func:`.triton_scaling.amax_and_scale`); the
    cast (both layouts with ``transpose``).

    Returns:
        (codes [R, C], codes [C, R] or None, :class:`~.triton_scaling.OperandScale`).
    """
    sc = triton_scaling.amax_and_scale(x2d, fmt, margin, power_of_two, invert=invert)
    data, data_t, _ = triton_operand_casts.transpose_cast(x2d, sc.scale, fmt, transpose, rounding, partials=True)
    return data, data_t, sc


def cast_stochastic(x2d: torch.Tensor, scale: torch.Tensor, fmt: Format):
    """Stochastically rounded codes of ``x2d * scale`` and ``max |x2d|`` in one read: the Triton
    cast kernel (random bits from a seed drawn on the device; no host sync), instead of the torch
    integer emulation (~30 elementwise kernels and a full-size ``randint``)."""
    return triton_family.cast_scaled(x2d, scale, fmt, "stochastic", None, want_amax=True)


def upcast(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return codes.to(dtype)


def scaled_mm_plan(m: int, k: int, n: int, a_dtype: torch.dtype, b_dtype: torch.dtype, out_dtype: torch.dtype,
                   device_type: str) -> tuple[int, int] | None:
    """``(pad_k, pad_n)``: the zero columns that make K and N multiples of 16 for ``torch._scaled_mm``,
    or None where it cannot take the GEMM (the fallback then runs).

    torch checks ``mat1.size(1) % 16`` and both dims of ``mat2`` (K and N); M may be anything.
    """
    if device_type != "cuda" or a_dtype not in _FP8 or b_dtype not in _FP8:
        return None
    if a_dtype == b_dtype == torch.float8_e5m2:  # cuBLASLt has no E5M2 x E5M2 kernel
        return None
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32) or 0 in (m, k, n):
        return None
    return (-k) % 16, (-n) % 16


def gemm_tensor_scaled(a, a_scale, b, b_scale, out_dtype, bias=None, a_inv=None, b_inv=None, fast_accum=False):
    """``(a / a_scale) @ (b / b_scale).T (+ bias)``; ``a`` [M, K], ``b`` [N, K], scalar scales.

    ``fast_accum``: ``_scaled_mm``'s ``use_fast_accum`` (the forward GEMMs; gradients accumulate precisely).

    ``a_inv``/``b_inv``: the decode scales ``1 / a_scale`` / ``1 / b_scale`` where the caller has them
    (computed beside the scale, :mod:`.triton_scaling`): ``_scaled_mm`` takes those, and a
    ``reciprocal`` launch each is saved.
    """
    plan = scaled_mm_plan(a.shape[0], a.shape[1], b.shape[0], a.dtype, b.dtype, out_dtype, a.device.type)
    if plan is not None:
        pad_k, pad_n = plan
        a, b = a.contiguous(), b.contiguous()
        if pad_k or pad_n:  # zero codes are 0.0 in both FP8 formats
            a = torch.nn.functional.pad(a.view(torch.uint8), (0, pad_k)).view(a.dtype)
            b = torch.nn.functional.pad(b.view(torch.uint8), (0, pad_k, 0, pad_n)).view(b.dtype)
        inv_a = (a_inv if a_inv is not None else torch.reciprocal(a_scale.to(torch.float32))).reshape(())
        inv_b = (b_inv if b_inv is not None else torch.reciprocal(b_scale.to(torch.float32))).reshape(())
        fuse_bias = bias is not None and out_dtype == torch.bfloat16 and not pad_n
        out = torch._scaled_mm(a, b.t(), scale_a=inv_a, scale_b=inv_b,
                               bias=bias.to(out_dtype) if fuse_bias else None, out_dtype=out_dtype,
                               use_fast_accum=fast_accum)
        if pad_n:
            out = out[:, : out.shape[1] - pad_n].contiguous()
        if bias is not None and not fuse_bias:
            out = (out.float() + bias.float()).to(out_dtype)
        return out
    av = a.to(torch.float32) / a_scale.to(torch.float32)
    bv = b.to(torch.float32) / b_scale.to(torch.float32)
    out = av @ bv.t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def row_amax(x2d: torch.Tensor) -> torch.Tensor:
    """``max_j |x_ij|`` per row, fp32 [rows]."""
    if x2d.shape[1] == 0:
        return torch.zeros(x2d.shape[0], dtype=torch.float32, device=x2d.device)
    return x2d.float().abs().amax(dim=1)


def cast_rows(x2d, row_scale, fmt: Format, rounding="nearest", generator=None):
    """Codes of ``x[i] * row_scale[i]`` (same math as the CPU module's ``cast_rows``, eager)."""
    from . import cpu

    if x2d.numel() == 0:
        return torch.empty(x2d.shape, dtype=fmt.torch_dtype, device=x2d.device)
    row_scale = row_scale.to(torch.float32)
    if rounding == "nearest":
        return cpu._cast_rows_math(x2d, row_scale, fmt.max, fmt.torch_dtype)
    seed = torch.randint(0, 2 ** 31 - 1, (), generator=generator, dtype=torch.int32, device=x2d.device)
    return cpu._cast_rows_sr_math(x2d.contiguous(), row_scale, seed, fmt.max, fmt.mbits, fmt.emin, fmt.torch_dtype)


def _scaled_grouped_mm_ok(a, b, out_dtype) -> bool:
    return (hasattr(torch, "_scaled_grouped_mm") and a.is_cuda
            and torch.cuda.get_device_capability(a.device) >= (9, 0)
            and a.dtype == b.dtype == torch.float8_e4m3fn and out_dtype == torch.bfloat16
            and a.shape[1] % 16 == 0 and b.shape[1] % 16 == 0)


def grouped_gemm(a, a_scale, b, b_scale, offs, out_dtype):
    """Per group ``(a[g] / a_scale[e]) @ (b[e] / b_scale[e]).T``: a [S, K], b [E, N, K]; rows past offs[-1] = 0."""
    rows = torch.arange(a.shape[0], device=a.device)
    if _scaled_grouped_mm_ok(a, b, out_dtype):
        # Decode scales: one per row of a (its expert's), one per (expert, output column) of b.
        ids = torch.searchsorted(offs, rows.to(offs.dtype), right=True).clamp(max=offs.numel() - 1)
        inv_a = torch.reciprocal(a_scale.float())[ids].contiguous()
        inv_b = torch.reciprocal(b_scale.float())[:, None].expand(b.shape[0], b.shape[1]).contiguous()
        bt = b.contiguous().transpose(1, 2)  # [E, K, N], column-major as the kernel wants
        out = torch._scaled_grouped_mm(a.contiguous(), bt, inv_a, inv_b, offs=offs, out_dtype=out_dtype)
        return out.masked_fill((rows >= offs[-1])[:, None], 0)  # the kernel leaves those rows unwritten
    out = torch.zeros(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)
    start = 0
    # Fallback (no _scaled_grouped_mm: pre-sm_90, other dtypes or shapes): slicing groups of
    # data-dependent size needs their offsets on the host, one sync per grouped GEMM.
    for e, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = gemm_tensor_scaled(a[start:end], a_scale[e], b[e], b_scale[e], out_dtype)
        start = end
    return out


def grouped_gemm_wgrad(a, a_scale, b, b_scale, offs, out_dtype):
    """Per expert ``(a[g] / a_scale[e]).T @ (b[g] / b_scale[e])``: [E, M, N] from a [S, M], b [S, N]."""
    out = torch.zeros(offs.numel(), a.shape[1], b.shape[1], dtype=out_dtype, device=a.device)
    start = 0
    # One host read of the offsets per call (groups of data-dependent size are sliced on the host);
    # the grouped-K form of _scaled_grouped_mm would avoid it and is not wired here yet.
    for e, end in enumerate(offs.tolist()):
        if end > start:
            out[e] = gemm_tensor_scaled(a[start:end].t(), a_scale[e], b[start:end].t(), b_scale[e], out_dtype)
        start = end
    return out
