"""Triton kernels of the grouped (MoE) GLU tail's activation: ``A = act(gate) * up``, smoothed per expert.

Rows grouped by expert as ``torch._grouped_mm`` takes them (``offs``: int32 [E] cumulative group ends;
rows past ``offs[-1]`` are padding, smoothing scale 1); a row's expert is found in the kernel
(``triton_grouped_casts._expert_of``: no ``searchsorted``/index launches, no host read).

==================================  =================================================================
``_grouped_glu_kernel``             one read of gate and up, ``h = act(g) * u``; ``AMAX``: each tile's
                                    per-expert column maxima of ``|h|`` folded into ``amax`` [E, F]
                                    (an atomic max on the int32 bits of non-negative values: exact and
                                    independent of the programs' order; NaN above Inf above every
                                    finite value, and any non-finite maximum gives the channel scale
                                    1, as the torch reference's NaN-propagating max does); otherwise
                                    ``A = h * c[expert(r), col]`` (``SMOOTH``; else ``h``), fp32
``_grouped_glu_backward_kernel``    one read of dA, gate and up: ``dh = dA * c[expert(r), col]``
                                    (``SMOOTH``), ``dgate = act_backward(dh * u, g)``,
                                    ``dup = dh * act(g)``, rounded to the output dtype; for the fused
                                    gate_up input both halves of one [S, 2F] output (no ``cat``)
==================================  =================================================================

The torch reference is ``fp8pass.runtime.swiglu``'s ``_glu_operand`` / ``_glu_backward_math`` with the
per-expert channel scales of ``runtime.grouped_swiglu`` (the same ops in the same order, FMA
contraction off). Activations: ``relu`` (bit-identical: every op is exact or correctly rounded) and
``silu`` (``g / (1 + exp(-g))``: ``tl.exp`` is the GPU's approximate ``ex2``, numpy's ``exp`` under the
interpreter, where torch has its own ``exp``, so ``h`` may differ in its last bits, exactly as in the
dense SwiGLU kernels of :mod:`.triton_operand_casts`; tests/kernels/test_triton_grouped_glu.py bounds it and
checks the exact cases). Other activations keep the torch ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import triton_scaling
from .triton_glu import _round_for
from .triton_grouped_casts import _expert_of
from .triton_helpers import check_interpretable
from .triton_operand_casts import _silu

__all__ = ["ACTIVATIONS", "grouped_glu_amax", "grouped_glu_operand", "grouped_glu_backward"]

_SMOOTH = ("none", "channel")

ACTIVATIONS = {"silu": 0, "relu": 1}
_TILE = (32, 64)  # rows x channels of a program


@triton.jit
def _act(g, ACT: tl.constexpr):
    """``act(g)`` in fp32: silu (``_silu``) or relu (``torch.relu``'s bits: -0 and NaN kept)."""
    if ACT == 0:
        return _silu(g)
    return tl.where(g < 0, 0.0, g)


@triton.jit
def _glu_tile(g_ptr, u_ptr, ld, R, F, offs_ptr, E, rows, cols, ACT: tl.constexpr, EP: tl.constexpr):
    """(h = act(g) * u [BR, BC] fp32, the rows' experts, the tile's mask) of one tile of rows/channels."""
    mask = (rows[:, None] < R) & (cols[None, :] < F)
    idx = rows[:, None] * ld + cols[None, :]
    g = tl.load(g_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    expert = _expert_of(rows, offs_ptr, E, 1, False, EP)
    return _act(g, ACT) * u, expert, mask


@triton.jit
def _row_channel_scales(c_ptr, expert, cols, E, F):
    """``c[expert(r), col]`` [BR, BC]; padding rows (expert E) and channels past F: 1."""
    ok = (expert[:, None] < E) & (cols[None, :] < F)
    return tl.load(c_ptr + expert[:, None].to(tl.int64) * F + cols[None, :], mask=ok, other=1.0)


@triton.jit
def _grouped_glu_kernel(g_ptr, u_ptr, ld, c_ptr, amax_ptr, a_ptr, R, F, offs_ptr, E, AMAX: tl.constexpr,
                        SMOOTH: tl.constexpr, ACT: tl.constexpr, EP: tl.constexpr, BR: tl.constexpr,
                        BC: tl.constexpr):
    """AMAX: fold the tile's per-expert column maxima of ``|act(g) * u|`` into ``amax`` [E, F] (int32
    bits, zeroed by the caller); else write ``A`` [R, F] fp32 (see the module doc)."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.program_id(1).to(tl.int64) * BC + tl.arange(0, BC)
    h, expert, mask = _glu_tile(g_ptr, u_ptr, ld, R, F, offs_ptr, E, rows, cols, ACT, EP)
    if AMAX:
        bits = tl.where(mask, tl.abs(h), 0.0).to(tl.int32, bitcast=True)  # >= 0: ordered like the values
        first = tl.min(tl.where(rows < R, expert, E))
        last = tl.minimum(tl.max(tl.where(rows < R, expert, 0)), E - 1)  # padding rows have no expert
        e = first
        # the experts whose rows the tile holds, usually one or two (a while loop: triton 3.6's
        # interpreter with numpy 2.4 fails on a reduced tensor as a range() bound)
        while e <= last:
            col_max = tl.max(tl.where(expert[:, None] == e, bits, 0), axis=0)
            tl.atomic_max(amax_ptr + e * F + cols, col_max, mask=cols < F)
            e += 1
    else:
        if SMOOTH:
            h = h * _row_channel_scales(c_ptr, expert, cols, E, F)
        tl.store(a_ptr + rows[:, None] * F + cols[None, :], h, mask=mask)


@triton.jit
def _grouped_glu_backward_kernel(da_ptr, g_ptr, u_ptr, ld, c_ptr, dg_ptr, du_ptr, out_ld, R, F, offs_ptr, E,
                                 SMOOTH: tl.constexpr, ACT: tl.constexpr, EP: tl.constexpr, BR: tl.constexpr,
                                 BC: tl.constexpr):
    """A tile of ``dgate`` and ``dup`` (module doc), as ``swiglu._glu_backward_math`` computes them."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.program_id(1).to(tl.int64) * BC + tl.arange(0, BC)
    mask = (rows[:, None] < R) & (cols[None, :] < F)
    idx = rows[:, None] * ld + cols[None, :]
    g = tl.load(g_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    dh = tl.load(da_ptr + rows[:, None] * F + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if SMOOTH:
        dh = dh * _row_channel_scales(c_ptr, _expert_of(rows, offs_ptr, E, 1, False, EP), cols, E, F)
    grad = dh * u
    if ACT == 0:  # aten.silu_backward: grad * sig * (1 + g * (1 - sig)), sig = 1 / (1 + exp(-g))
        denom = 1.0 + tl.exp(-g)
        sig = tl.math.div_rn(tl.full(g.shape, 1.0, tl.float32), denom)
        dgate = (grad * sig) * (1.0 + g * (1.0 - sig))
        dup = dh * tl.math.div_rn(g, denom)
    else:  # aten.threshold_backward(grad, relu(g), 0)
        act = _act(g, ACT)
        dgate = tl.where(act <= 0, 0.0, grad)
        dup = dh * act
    out = rows[:, None] * out_ld + cols[None, :]
    tl.store(dg_ptr + out, _round_for(dgate, dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + out, _round_for(dup, du_ptr.dtype.element_ty), mask=mask)


def _rows_of(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(gate, up, their common row stride): the halves of a fused gate_up as they are, else contiguous."""
    if gate.stride(1) == 1 and up.stride(1) == 1 and gate.stride(0) == up.stride(0):
        return gate, up, gate.stride(0)
    return gate.contiguous(), up.contiguous(), gate.shape[1]


def _check(gate, up, offs, activation):
    if activation not in ACTIVATIONS:
        raise ValueError(f"grouped GLU kernels: activation {activation!r} is not one of {sorted(ACTIVATIONS)}")
    if gate.dim() != 2 or gate.shape != up.shape or offs.dim() != 1 or offs.dtype != torch.int32:
        raise ValueError(f"grouped GLU kernels: gate/up [S, F] of one shape and int32 offs [E], got "
                         f"{tuple(gate.shape)}, {tuple(up.shape)}, offs {offs.dtype} {tuple(offs.shape)}")
    check_interpretable(gate.device)


def _launch_args(gate, up, offs):
    r, f = gate.shape
    br, bc = _TILE
    return (triton.cdiv(r, br), triton.cdiv(f, bc)), dict(EP=triton.next_power_of_2(max(offs.numel(), 1)), BR=br,
                                                          BC=bc)


def grouped_glu_amax(gate: torch.Tensor, up: torch.Tensor, offs: torch.Tensor, activation: str) -> torch.Tensor:
    """fp32 [E, F]: per expert, the channel maxima of ``|act(gate) * up|`` over its rows (0 for an expert
    without rows; padding rows left out), one launch after a zero fill."""
    _check(gate, up, offs, activation)
    g, u, ld = _rows_of(gate, up)
    r, f = g.shape
    amax = torch.zeros(offs.numel(), f, dtype=torch.float32, device=g.device)
    if r and f and offs.numel():
        grid, kw = _launch_args(g, u, offs)
        _grouped_glu_kernel[grid](g, u, ld, amax, amax.view(torch.int32), amax, r, f, offs, offs.numel(), AMAX=True,
                                  SMOOTH=False, ACT=ACTIVATIONS[activation], **kw, enable_fp_fusion=False)
    return amax


def grouped_glu_operand(gate: torch.Tensor, up: torch.Tensor, offs: torch.Tensor, activation: str, smooth: str,
                        c_range: tuple[float, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """The down GEMM's operand ``A`` (fp32 [S, F]) and the smoothing scales, as
    ``runtime.grouped_swiglu``'s torch path makes them: ``channel``: ``c`` [E, F] the power-of-two
    channel scales of each expert's maxima (``grouped_glu_amax``, then one
    ``triton_scaling.channel_scales`` launch over the [E, F] maxima, clamped to ``c_range``) and
    ``A = act(gate) * up * c[expert(r)]`` (padding rows: 1); ``none``: ``A = act(gate) * up`` and a
    scalar 1. Four launches (channel) or two, whatever the number of experts."""
    if smooth not in _SMOOTH:
        raise ValueError(f"grouped_glu_operand: smooth must be one of {_SMOOTH}, got {smooth!r}")
    _check(gate, up, offs, activation)
    g, u, ld = _rows_of(gate, up)
    r, f = g.shape
    c = None
    if smooth == "channel":
        amax = grouped_glu_amax(g, u, offs, activation)
        c = triton_scaling.channel_scales(amax.view(1, -1), *c_range).view(amax.shape)
    a = torch.empty(r, f, dtype=torch.float32, device=g.device)
    if r and f:
        grid, kw = _launch_args(g, u, offs)
        _grouped_glu_kernel[grid](g, u, ld, a if c is None else c, a, a, r, f, offs, offs.numel(), AMAX=False,
                                  SMOOTH=c is not None, ACT=ACTIVATIONS[activation], **kw, enable_fp_fusion=False)
    return a, (torch.ones((), dtype=torch.float32, device=g.device) if c is None else c)


def grouped_glu_backward(da: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, offs: torch.Tensor, activation: str,
                         c: torch.Tensor | None, joined: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dgate, dup)`` in gate's and up's dtypes from ``dA`` [S, F] (``c``: the channel scales [E, F]
    of :func:`grouped_glu_operand`, or None), one launch; ``joined`` (gate and up the halves of one fused
    gate_up): ``(d(gate_up) [S, 2F], empty)``, dgate in the first half and dup in the second."""
    _check(gate, up, offs, activation)
    g, u, ld = _rows_of(gate, up)
    r, f = g.shape
    if da.shape != (r, f) or (c is not None and c.shape != (offs.numel(), f)):
        raise ValueError(f"grouped_glu_backward: dA must be [S, F] = [{r}, {f}] and c [E, F] or None, got dA "
                         f"{tuple(da.shape)}, c {None if c is None else tuple(c.shape)}")
    if joined:
        out = torch.empty(r, 2 * f, dtype=gate.dtype, device=g.device)
        dg, du, out_ld = out[:, :f], out[:, f:], 2 * f
    else:
        dg = torch.empty(r, f, dtype=gate.dtype, device=g.device)
        du = torch.empty(r, f, dtype=up.dtype, device=g.device)
        out_ld = f
    if r and f:
        grid, kw = _launch_args(g, u, offs)
        c_arg = dg if c is None else c.float().contiguous()
        _grouped_glu_backward_kernel[grid](da.contiguous(), g, u, ld, c_arg, dg, du, out_ld, r, f, offs, offs.numel(),
                                           SMOOTH=c is not None, ACT=ACTIVATIONS[activation], **kw,
                                           enable_fp_fusion=False)
    return (out, out.new_empty(0)) if joined else (dg, du)
