"""Triton kernel of the SwiGLU backward from the FP8 copies of ``gate`` and ``up`` that forward saved.

``_swiglu_backward_kernel``, one read of ``dA``, the gate and up codes, one write of ``dgate`` and ``dup``::

    g = value(gate_codes) / gate_scale,  u = value(up_codes) / up_scale      (fp32, the saved values)
    dh = dA * c[col]  (channel)  |  dA / r[row]  (token)  |  dA      (undo the smoothing of A)
    sig = 1 / (1 + exp(-g))
    dgate = ((dh * u) * sig) * (1 + g * (1 - sig))                   (aten.silu_backward's formula)
    dup = dh * (g / (1 + exp(-g)))                                   (silu(g), as torch computes it)

Reference: ``fp8pass.runtime.swiglu._glu_backward_from_saved`` (torch ops, the CPU path); in place of
its ~8 elementwise kernels on a GPU, one. ``exp`` is the GPU's approximate ``ex2``-based one (numpy's
under the interpreter) where torch uses its own, so ``sig`` may differ in the last fp32 bits: the
gradients agree to within one step of their output dtype, nearly all bit for bit
(tests/test_triton_glu.py bounds it); divisions are correctly rounded, as torch's are. A code's value
comes from a 256-entry fp32 table of its format (made once per device with torch's own float8
conversion; a cached gather), so the kernel reads the codes as bytes. The forward's SwiGLU kernels
are in :mod:`.triton_operand_casts`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_helpers import check_interpretable

__all__ = ["swiglu_backward"]

_SMOOTH = {"none": 0, "channel": 1, "token": 2}


@triton.jit
def _swiglu_backward_kernel(da_ptr, g_ptr, u_ptr, lut_ptr, g_scale_ptr, u_scale_ptr, s_ptr, dg_ptr, du_ptr, T, F,
                            SMOOTH: tl.constexpr, BT: tl.constexpr, BF: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    cols = tl.program_id(1).to(tl.int64) * BF + tl.arange(0, BF)
    mask = (rows[:, None] < T) & (cols[None, :] < F)
    idx = rows[:, None] * F + cols[None, :]
    da = tl.load(da_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    g_code = tl.load(g_ptr + idx, mask=mask, other=0).to(tl.int32)
    u_code = tl.load(u_ptr + idx, mask=mask, other=0).to(tl.int32)
    g = tl.math.div_rn(tl.load(lut_ptr + g_code), tl.load(g_scale_ptr))
    u = tl.math.div_rn(tl.load(lut_ptr + u_code), tl.load(u_scale_ptr))
    if SMOOTH == 1:
        dh = da * tl.load(s_ptr + cols, mask=cols < F, other=1.0)[None, :]
    elif SMOOTH == 2:
        dh = tl.math.div_rn(da, tl.load(s_ptr + rows, mask=rows < T, other=1.0)[:, None])
    else:
        dh = da
    denom = 1.0 + tl.exp(-g)
    sig = tl.math.div_rn(tl.full([BT, BF], 1.0, tl.float32), denom)
    dgate = ((dh * u) * sig) * (1.0 + g * (1.0 - sig))
    dup = dh * tl.math.div_rn(g, denom)
    tl.store(dg_ptr + idx, _round_for(dgate, dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + idx, _round_for(dup, du_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _round_for(x, dtype: tl.constexpr):
    """fp32 ``x`` in ``dtype``, rounded to nearest even. For bf16 the rounding is done on the bits first
    (then the conversion is exact): Triton's interpreter truncates fp32 -> bf16, the GPU rounds."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        x = tl.where(x != x, x, rounded)
    return x.to(dtype)


def swiglu_backward(da: torch.Tensor, g_codes: torch.Tensor, g_scale: torch.Tensor, u_codes: torch.Tensor,
                    u_scale: torch.Tensor, smooth_scales: torch.Tensor, smooth: str, out_dtype: torch.dtype,
                    bt: int = 32, bf: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dgate, dup)`` [T, F] in ``out_dtype`` (see the module doc), one launch.

    Args:
        da: [T, F] gradient of the down GEMM's operand ``A``.
        g_codes, u_codes: [T, F] FP8 codes of gate and up (one FP8 dtype); g_scale, u_scale: their fp32
            scalar scales.
        smooth_scales: ``c`` [F] (channel), ``r`` [T, 1] (token), anything (none).
        smooth: "channel", "token" or "none".
    """
    if smooth not in _SMOOTH:
        raise ValueError(f"unknown smooth mode {smooth!r}; valid: {', '.join(_SMOOTH)}")
    if g_codes.dtype != u_codes.dtype or g_codes.element_size() != 1 or not g_codes.dtype.is_floating_point:
        raise TypeError(f"swiglu_backward: gate and up codes must share one FP8 dtype, got {g_codes.dtype} "
                        f"and {u_codes.dtype}")
    t, f = da.shape
    check_interpretable(da.device)
    dg = torch.empty(t, f, dtype=out_dtype, device=da.device)
    du = torch.empty(t, f, dtype=out_dtype, device=da.device)
    if t and f:
        s = smooth_scales.reshape(-1) if smooth != "none" else g_scale
        _swiglu_backward_kernel[(triton.cdiv(t, bt), triton.cdiv(f, bf))](
            da.contiguous(), g_codes.contiguous().view(torch.uint8), u_codes.contiguous().view(torch.uint8),
            _decode_table(g_codes.dtype, da.device), g_scale, u_scale, s.contiguous(), dg, du, t, f,
            SMOOTH=_SMOOTH[smooth], BT=bt, BF=bf)
    return dg, du


_TABLES: dict[tuple, torch.Tensor] = {}


def _decode_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """fp32 [256]: the value of every code of the FP8 ``dtype`` (torch's conversion), made once per device."""
    key = (dtype, device)
    if key not in _TABLES:
        _TABLES[key] = torch.arange(256, dtype=torch.uint8, device=device).view(dtype).to(torch.float32)
    return _TABLES[key]
