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
(tests/kernels/test_triton_glu.py bounds it); divisions are correctly rounded, as torch's are. A code's value
comes from a 256-entry fp32 table of its format (made once per device with torch's own float8
conversion; a cached gather), so the kernel reads the codes as bytes. In channel mode the same launch
can also make ``dW_down = dB / c`` (``UNSMOOTH_W``: extra programs, bit for bit as torch divides). The
forward's SwiGLU kernels are in :mod:`.triton_operand_casts`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_helpers import check_interpretable, decode_table
from .triton_scaling import divided_in, reciprocal_rn, rounded_to

__all__ = ["swiglu_backward"]

_SMOOTH = {"none": 0, "channel": 1, "token": 2}


@triton.jit
def _swiglu_backward_kernel(da_ptr, g_ptr, u_ptr, lut_ptr, g_scale_ptr, u_scale_ptr, s_ptr, dg_ptr, du_ptr, db_ptr,
                            dw_ptr, T, F, N, SMOOTH: tl.constexpr, BT: tl.constexpr, BF: tl.constexpr,
                            UNSMOOTH_W: tl.constexpr = False):
    """Programs ``(i, j)`` with ``i < cdiv(T, BT)``: the tile of dgate and dup (module doc). UNSMOOTH_W
    (channel): the programs past them, ``(cdiv(T, BT) + i, j)``, each a tile of ``dW = dB / c`` [N, F]
    in dW's dtype (fp32 or bf16) from the down GEMM's ``dB`` as torch computes it: ``dB`` rounded to
    dW's dtype, then divided (``triton_scaling.divided_in``); no launch of its own."""
    pid_t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BF + tl.arange(0, BF)
    n_t = tl.cdiv(T, BT)
    if UNSMOOTH_W:
        if pid_t >= n_t:
            _unsmooth_tile(db_ptr, dw_ptr, s_ptr, N, F, (pid_t - n_t) * BT + tl.arange(0, BT), cols)
        else:
            _swiglu_backward_tile(da_ptr, g_ptr, u_ptr, lut_ptr, g_scale_ptr, u_scale_ptr, s_ptr, dg_ptr, du_ptr, T,
                                  F, pid_t * BT + tl.arange(0, BT), cols, SMOOTH, BT, BF)
    else:
        _swiglu_backward_tile(da_ptr, g_ptr, u_ptr, lut_ptr, g_scale_ptr, u_scale_ptr, s_ptr, dg_ptr, du_ptr, T, F,
                              pid_t * BT + tl.arange(0, BT), cols, SMOOTH, BT, BF)


@triton.jit
def _unsmooth_tile(db_ptr, dw_ptr, c_ptr, N, F, rows, cols):
    """A tile of ``dW = dB.to(w_dtype) / c`` (``swiglu._unsmooth_weight_grad``'s two roundings)."""
    mask = (rows[:, None] < N) & (cols[None, :] < F)
    idx = rows[:, None] * F + cols[None, :]
    dtype = dw_ptr.dtype.element_ty
    db = rounded_to(tl.load(db_ptr + idx, mask=mask, other=0.0).to(tl.float32), dtype)
    dw = divided_in(db, reciprocal_rn(tl.load(c_ptr + cols, mask=cols < F, other=1.0))[None, :], dtype)
    tl.store(dw_ptr + idx, dw.to(dtype), mask=mask)


@triton.jit
def _swiglu_backward_tile(da_ptr, g_ptr, u_ptr, lut_ptr, g_scale_ptr, u_scale_ptr, s_ptr, dg_ptr, du_ptr, T, F, rows,
                          cols, SMOOTH: tl.constexpr, BT: tl.constexpr, BF: tl.constexpr):
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
    """fp32 ``x`` in ``dtype``, rounded to nearest even (``triton_scaling.rounded_to``, then an exact
    conversion: Triton's interpreter truncates fp32 -> bf16, the GPU rounds)."""
    return rounded_to(x, dtype).to(dtype)


def swiglu_backward(da: torch.Tensor, g_codes: torch.Tensor, g_scale: torch.Tensor, u_codes: torch.Tensor,
                    u_scale: torch.Tensor, smooth_scales: torch.Tensor, smooth: str, out_dtype: torch.dtype,
                    bt: int = 32, bf: int = 64, weight_grad: tuple[torch.Tensor, torch.dtype] | None = None):
    """``(dgate, dup)`` [T, F] in ``out_dtype`` (see the module doc), one launch; with ``weight_grad``
    ``(dgate, dup, dW)``.

    Args:
        da: [T, F] gradient of the down GEMM's operand ``A``.
        g_codes, u_codes: [T, F] FP8 codes of gate and up (one FP8 dtype); g_scale, u_scale: their fp32
            scalar scales.
        smooth_scales: ``c`` [F] (channel), ``r`` [T, 1] (token), anything (none).
        smooth: "channel", "token" or "none".
        weight_grad: channel mode: ``(dB, w_dtype)``, the down GEMM's ``dB`` [N, F] and W_down's dtype
            (fp32 or bf16): ``dW = dB / c`` in ``w_dtype`` is made by the same launch, as
            ``swiglu._unsmooth_weight_grad`` makes it (bit for bit).
    """
    if smooth not in _SMOOTH:
        raise ValueError(f"unknown smooth mode {smooth!r}; valid: {', '.join(_SMOOTH)}")
    if g_codes.dtype != u_codes.dtype or g_codes.element_size() != 1 or not g_codes.dtype.is_floating_point:
        raise TypeError(f"swiglu_backward: gate and up codes must share one FP8 dtype, got {g_codes.dtype} "
                        f"and {u_codes.dtype}")
    t, f = da.shape
    if weight_grad is not None and (smooth != "channel" or weight_grad[1] not in (torch.float32, torch.bfloat16)
                                    or weight_grad[0].dim() != 2 or weight_grad[0].shape[1] != f):
        raise ValueError(f"swiglu_backward: weight_grad is channel mode's (dB [N, {f}], fp32 or bf16 dtype)")
    check_interpretable(da.device)
    dg = torch.empty(t, f, dtype=out_dtype, device=da.device)
    du = torch.empty(t, f, dtype=out_dtype, device=da.device)
    db, dw, n = dg, dg, 0
    if weight_grad is not None:
        db = weight_grad[0].contiguous()
        n = db.shape[0]
        dw = torch.empty(db.shape, dtype=weight_grad[1], device=da.device)
    if f and (t or n):
        s = smooth_scales.reshape(-1) if smooth != "none" else g_scale
        _swiglu_backward_kernel[(triton.cdiv(t, bt) + triton.cdiv(n, bt), triton.cdiv(f, bf))](
            da.contiguous(), g_codes.contiguous().view(torch.uint8), u_codes.contiguous().view(torch.uint8),
            decode_table(g_codes.dtype, da.device), g_scale, u_scale, s.contiguous(), dg, du, db, dw, t, f, n,
            SMOOTH=_SMOOTH[smooth], BT=bt, BF=bf, UNSMOOTH_W=weight_grad is not None)
    return (dg, du) if weight_grad is None else (dg, du, dw)
