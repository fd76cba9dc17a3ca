"""Triton kernels of ``fp8pass::rmsnorm`` (``Config.save_norm_input_fp8``): four launches per norm, forward
and backward, where its torch ops take 18 on a GPU.

The math is :mod:`fp8pass.runtime.rmsnorm`'s (``norm_forward_math``, ``norm_backward_math``: the references)::

    rstd = 1 / sqrt(sum(x^2) / d + eps)          x_hat = x * rstd          y = (x_hat -> hat) * w (-> out)
    dw = sum_rows(dy * x_hat)                    dx = rstd * (g - x_hat * (sum(g * x_hat) / d)),  g = dy * w

=============================  ====================================================================================
``_rmsnorm_forward_kernel``    ``y`` and ``rstd`` of blocks of rows in one read of ``x``, and the partial max
                               ``|x_hat|`` of each program; the last program to arrive reduces them and runs
                               current scaling's epilogue (``triton_scaling.scale_epilogue``): the scale of
                               ``x_hat``'s codes, picked on the device
``_rmsnorm_cast_kernel``       the codes of ``x_hat = x * rstd`` with that scale (``cast_codes``, the one exact
                               cast): a second read of ``x``, one byte written per element
``_rmsnorm_backward_kernel``   ``dx`` of blocks of rows from ``dy``, the codes (``decode_codes``: the hardware
                               conversion on sm_89+), their scale, ``rstd`` and ``w``; each program's column
                               sums of ``dy * x_hat``
``_column_sum_kernel``         ``dw``: the programs' column sums added, in ``w``'s dtype
=============================  ====================================================================================

Numerics: every elementwise step is the reference's, in its order and dtypes (products and divisions
correctly rounded, ``y``'s roundings to the hat, product and output dtypes as torch's type promotion
makes them; on a GPU the compiler may contract the backward's ``g - x_hat * mean`` into one FMA). The row sums and ``dw``'s column sums are reductions in the kernel's order, and ``rstd``
is ``1 / sqrt`` correctly rounded twice (torch's CPU ``rsqrt``; on a GPU torch and Inductor take the
approximate ``rsqrt``): ``rstd`` and the sums agree with the reference's to a few fp32 ulps, not bit for bit.
Given the kernel's ``rstd``, ``y``, ``x_hat``'s amax, scale and codes are exact: the reference's ops
applied to ``x`` and that ``rstd`` (tests/kernels/test_triton_norm.py). ``x_hat``'s values in the
backward are the codes' values times ``1 / scale`` (the reference takes them so too).

Registers: a loop step holds a block of ``ROWS`` rows x ``CHUNK`` columns (about 4096 elements, 8-16
per thread). Rows wider than ``CHUNK`` (``WIDE``: Llama-70B's 8192 features and up) are read twice per
block, the second read from the cache, and the backward adds each block's column sums of ``dy * x_hat``
into its program's row of the partial sums in memory instead of registers: no kernel spills
(``python -m benchmarks.gpu_static --only norm``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..numerics.formats import Format
from .triton_helpers import (
    INTERPRETING,
    abs_max_2d,
    cast_codes,
    check_interpretable,
    decode_codes,
    hardware_cast,
    max_propagating_nan,
)
from .triton_scaling import counter, epilogue_args, rounded_to, scale_by_last_program

__all__ = ["norm_supported", "rmsnorm_forward", "rmsnorm_backward"]

_FLOATS = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
# Elements per loop step (a block of rows): the interpreter runs each step as numpy calls, large blocks.
_STEP = 1 << 16 if INTERPRETING else 4096
# Columns of a row in one step: wider rows are taken in steps (registers: 16 fp32 per thread and tensor).
_MAX_CHUNK = 1 << 16 if INTERPRETING else 4096
# Programs of the forward (their partial maxima are reduced by the last in one vector step) and of the
# backward (each writes a row of dw's column sums: few enough that summing them is cheap, enough to
# fill an H200's 132 SMs twice).
_FORWARD_PROGRAMS = 1024
_BACKWARD_PROGRAMS = 4 if INTERPRETING else 264


@triton.jit
def _rstd(sum_sq, d, eps):
    """``1 / sqrt(sum_sq / d + eps)``, each step correctly rounded (torch's CPU ``rsqrt`` is ``1 / sqrt``)."""
    return tl.math.div_rn(tl.full(sum_sq.shape, 1.0, tl.float32), tl.sqrt_rn(tl.math.div_rn(sum_sq, d) + eps))


@triton.jit
def _normed(x, rstd, w, y_ptr, idx, mask, HAT: tl.constexpr, PROD: tl.constexpr, OUT: tl.constexpr):
    """Stores ``y`` of a tile of ``x`` (the reference's roundings); returns the tile's max ``|x_hat|``."""
    x_hat = x * rstd[:, None]
    y = rounded_to(x_hat, HAT) * w[None, :]
    if OUT != PROD:  # torch rounds the product to its dtype, then converts
        y = rounded_to(y, PROD)
    tl.store(y_ptr + idx, rounded_to(y, OUT).to(OUT), mask=mask)
    return abs_max_2d(x_hat)


@triton.jit
def _rmsnorm_forward_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, partial_ptr, counter_ptr, held_ptr, steps_ptr, skipped_ptr,
                            guard_ptr, inv0_in, inv1_in, amax_out, scale_out, inv_out, recast_out, inv0_out, inv1_out,
                            rows, D, eps, HAT: tl.constexpr, PROD: tl.constexpr, OUT: tl.constexpr,
                            N_INVERT: tl.constexpr, DELAYED: tl.constexpr, TARGET: tl.constexpr,
                            FMT_MAX: tl.constexpr, MAX_SCALE_C: tl.constexpr, HUGE: tl.constexpr, POW2: tl.constexpr,
                            NAN_SCALE: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr, WIDE: tl.constexpr,
                            RBLOCK: tl.constexpr):
    """Each program takes every ``num_programs``-th block of ``ROWS`` rows: ``y``, ``rstd``, and its max
    ``|x_hat|`` (NaN-propagating); the last to arrive (acquire-release counter, reset by it) reduces the
    programs' maxima and stores the scale of ``x_hat`` (``scale_by_last_program``, current scaling). A row of
    ``D <= CHUNK`` features is read once; ``WIDE`` rows in ``CHUNK``-column steps twice (the sum of squares,
    then ``y``: the second read of the row block hits the cache)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cols = tl.arange(0, CHUNK)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)  # all of it unless WIDE
    d = tl.full([ROWS], D, tl.int32).to(tl.float32)
    pmax = tl.zeros([], tl.float32)
    for rb in range(pid.to(tl.int64), tl.cdiv(rows, ROWS), nprog):
        r = rb * ROWS + tl.arange(0, ROWS)
        if WIDE:
            sum_sq = tl.zeros([ROWS], tl.float32)
            for c0 in range(0, D, CHUNK):
                mask = (r[:, None] < rows) & (c0 + cols[None, :] < D)
                x = tl.load(x_ptr + r[:, None] * D + c0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                sum_sq += tl.sum(x * x, 1)
            rstd = _rstd(sum_sq, d, eps)
            for c0 in range(0, D, CHUNK):
                mask = (r[:, None] < rows) & (c0 + cols[None, :] < D)
                idx = r[:, None] * D + c0 + cols[None, :]
                x = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
                w_c = tl.load(w_ptr + c0 + cols, mask=c0 + cols < D, other=0.0).to(tl.float32)
                pmax = max_propagating_nan(pmax, _normed(x, rstd, w_c, y_ptr, idx, mask, HAT, PROD, OUT))
        else:
            mask = (r[:, None] < rows) & (cols[None, :] < D)
            idx = r[:, None] * D + cols[None, :]
            x = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
            rstd = _rstd(tl.sum(x * x, 1), d, eps)
            pmax = max_propagating_nan(pmax, _normed(x, rstd, w, y_ptr, idx, mask, HAT, PROD, OUT))
        tl.store(rstd_ptr + r, rstd, mask=r < rows)
    tl.store(partial_ptr + pid, pmax)
    scale_by_last_program(partial_ptr, nprog, counter_ptr, held_ptr, steps_ptr, skipped_ptr, guard_ptr, inv0_in,
                          inv1_in, amax_out, scale_out, inv_out, recast_out, inv0_out, inv1_out, N_INVERT, DELAYED,
                          TARGET, FMT_MAX, MAX_SCALE_C, HUGE, POW2, NAN_SCALE, RBLOCK)


@triton.jit
def _rmsnorm_cast_kernel(x_ptr, rstd_ptr, scale_ptr, out_ptr, rows, D, MBITS: tl.constexpr, BIAS: tl.constexpr,
                         MAX_CODE: tl.constexpr, NAN_CODE: tl.constexpr, HW: tl.constexpr, ROWS: tl.constexpr,
                         CHUNK: tl.constexpr):
    """Program ``i``: rows ``[i * ROWS, (i + 1) * ROWS)``, codes of ``(x * rstd) * scale`` (RNE, saturating)."""
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, CHUNK)
    rstd = tl.load(rstd_ptr + r, mask=r < rows, other=0.0)
    scale = tl.load(scale_ptr)
    for c0 in range(0, D, CHUNK):
        mask = (r[:, None] < rows) & (c0 + cols[None, :] < D)
        idx = r[:, None] * D + c0 + cols[None, :]
        x_hat = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32) * rstd[:, None]
        code = cast_codes(x_hat * scale, 0, MBITS, BIAS, MAX_CODE, NAN_CODE, 7, False, HW)
        tl.store(out_ptr + idx, code.to(tl.uint8), mask=mask)


@triton.jit
def _grad_inputs(dy_ptr, codes_ptr, idx, mask, inv_scale, MBITS: tl.constexpr, BIAS: tl.constexpr,
                 IEEE_SPECIALS: tl.constexpr, HW: tl.constexpr):
    """``(dy, x_hat)`` of a tile, fp32: ``x_hat`` = the codes' values times ``1 / scale``."""
    dy = tl.load(dy_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    code = tl.load(codes_ptr + idx, mask=mask, other=0).to(tl.int32)
    return dy, decode_codes(code, MBITS, BIAS, IEEE_SPECIALS, HW) * inv_scale


@triton.jit
def _store_dx(dx_ptr, idx, mask, g, x_hat, mean, rstd):
    dx = rstd[:, None] * (g - x_hat * mean[:, None])
    out = dx_ptr.dtype.element_ty
    tl.store(dx_ptr + idx, rounded_to(dx, out).to(out), mask=mask)


@triton.jit
def _rmsnorm_backward_kernel(dy_ptr, codes_ptr, scale_ptr, rstd_ptr, w_ptr, dx_ptr, part_ptr, rows, D,
                             MBITS: tl.constexpr, BIAS: tl.constexpr, IEEE_SPECIALS: tl.constexpr, HW: tl.constexpr,
                             ROWS: tl.constexpr, CHUNK: tl.constexpr, WIDE: tl.constexpr):
    """Each program takes every ``num_programs``-th block of ``ROWS`` rows: ``dx``; and its column sums of
    ``dy * x_hat`` are row ``program_id`` of ``part`` [programs, D]: held in registers for rows of
    ``D <= CHUNK``; ``WIDE`` rows are read in ``CHUNK``-column steps twice (the row sums, then ``dx``) and
    the sums added into ``part``'s row, which only this program touches, after each block."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cols = tl.arange(0, CHUNK)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    inv_scale = tl.math.div_rn(tl.full([], 1.0, tl.float32), tl.load(scale_ptr))
    d = tl.full([ROWS], D, tl.int32).to(tl.float32)
    part_row = part_ptr + pid.to(tl.int64) * D
    dw = tl.zeros([CHUNK], tl.float32)
    if WIDE:
        for c0 in range(0, D, CHUNK):
            tl.store(part_row + c0 + cols, dw, mask=c0 + cols < D)
    for rb in range(pid.to(tl.int64), tl.cdiv(rows, ROWS), nprog):
        r = rb * ROWS + tl.arange(0, ROWS)
        rstd = tl.load(rstd_ptr + r, mask=r < rows, other=0.0)
        if WIDE:
            gx = tl.zeros([ROWS], tl.float32)
            for c0 in range(0, D, CHUNK):
                mask = (r[:, None] < rows) & (c0 + cols[None, :] < D)
                dy, x_hat = _grad_inputs(dy_ptr, codes_ptr, r[:, None] * D + c0 + cols[None, :], mask, inv_scale, MBITS,
                                         BIAS, IEEE_SPECIALS, HW)
                w_c = tl.load(w_ptr + c0 + cols, mask=c0 + cols < D, other=0.0).to(tl.float32)
                gx += tl.sum((dy * w_c[None, :]) * x_hat, 1)
            mean = tl.math.div_rn(gx, d)
            for c0 in range(0, D, CHUNK):
                mask = (r[:, None] < rows) & (c0 + cols[None, :] < D)
                idx = r[:, None] * D + c0 + cols[None, :]
                dy, x_hat = _grad_inputs(dy_ptr, codes_ptr, idx, mask, inv_scale, MBITS, BIAS, IEEE_SPECIALS, HW)
                w_c = tl.load(w_ptr + c0 + cols, mask=c0 + cols < D, other=0.0).to(tl.float32)
                _store_dx(dx_ptr, idx, mask, dy * w_c[None, :], x_hat, mean, rstd)
                pmask = c0 + cols < D  # the same pointers load and store: each thread its own elements
                acc = tl.load(part_row + c0 + cols, mask=pmask, other=0.0)
                tl.store(part_row + c0 + cols, acc + tl.sum(dy * x_hat, 0), mask=pmask)
        else:
            mask = (r[:, None] < rows) & (cols[None, :] < D)
            idx = r[:, None] * D + cols[None, :]
            dy, x_hat = _grad_inputs(dy_ptr, codes_ptr, idx, mask, inv_scale, MBITS, BIAS, IEEE_SPECIALS, HW)
            g = dy * w[None, :]
            dw += tl.sum(dy * x_hat, 0)
            _store_dx(dx_ptr, idx, mask, g, x_hat, tl.math.div_rn(tl.sum(g * x_hat, 1), d), rstd)
    if not WIDE:
        tl.store(part_row + cols, dw, mask=cols < D)


@triton.jit
def _column_sum_kernel(part_ptr, n_part, D, out_ptr, BP: tl.constexpr, BC: tl.constexpr):
    """Program ``j``: columns ``[j * BC, (j + 1) * BC)`` of ``part`` [n_part, D] summed, in ``out``'s dtype."""
    cols = tl.program_id(0).to(tl.int64) * BC + tl.arange(0, BC)
    acc = tl.zeros([BP, BC], tl.float32)
    for p0 in range(0, n_part, BP):
        p = p0 + tl.arange(0, BP)
        acc += tl.load(part_ptr + p[:, None] * D + cols[None, :], mask=(p[:, None] < n_part) & (cols[None, :] < D),
                       other=0.0)
    out = out_ptr.dtype.element_ty
    tl.store(out_ptr + cols, rounded_to(tl.sum(acc, 0), out).to(out), mask=cols < D)


def norm_supported(d: int, fmt: Format, x_dtype: torch.dtype, weight_dtype: torch.dtype,
                   hat_dtype: torch.dtype | None, out_dtype: torch.dtype) -> bool:
    """Whether these kernels take a norm: ``d >= 1``, an 8-bit format with a torch dtype, fp32 / bf16 / fp16
    tensors (else the op keeps its torch ops)."""
    floats = (x_dtype, weight_dtype, out_dtype) + (() if hat_dtype is None else (hat_dtype,))
    return d >= 1 and fmt.torch_dtype is not None and fmt.signed and all(t in _FLOATS for t in floats)


def _block(rows: int, d: int, backward: bool = False) -> tuple[int, int, bool, int]:
    """(ROWS, CHUNK, WIDE, num_warps): a loop step of ``ROWS`` rows x ``CHUNK`` columns, about ``_STEP``
    elements, 8-16 per thread; rows wider than ``_MAX_CHUNK`` in several steps (``WIDE``). The backward
    takes one row per step on a GPU, wide rows in half steps (with triton 3.6 both spill otherwise)."""
    chunk = min(triton.next_power_of_2(d), _MAX_CHUNK)
    if backward and d > chunk and not INTERPRETING:
        chunk //= 2  # the wide backward at 4096 columns a step spills with triton 3.6 (8 warps, 64 registers)
    step = chunk if backward and not INTERPRETING else _STEP
    rows_per_step = max(1, min(triton.next_power_of_2(max(rows, 1)), step // chunk))
    warps = max(4, min(16, rows_per_step * chunk // 512))
    return rows_per_step, chunk, d > chunk, warps


def rmsnorm_forward(x2d: torch.Tensor, weight: torch.Tensor, eps: float, hat_dtype: torch.dtype | None,
                    out_dtype: torch.dtype, fmt: Format):
    """``(y [rows, d] in out_dtype, codes [rows, d] uint8, scale, rstd [rows, 1] fp32)`` in two launches:
    the norm with ``x_hat``'s amax and scale, then its codes (module doc). ``norm_supported`` must hold."""
    check_interpretable(x2d.device)
    x2d = x2d.contiguous()
    rows, d = x2d.shape
    device = x2d.device
    prod = torch.promote_types(torch.float32 if hat_dtype is None else hat_dtype, weight.dtype)
    y = torch.empty(rows, d, dtype=out_dtype, device=device)
    rstd = torch.empty(rows, 1, dtype=torch.float32, device=device)
    codes = torch.empty(rows, d, dtype=torch.uint8, device=device)
    sc, args, consts = epilogue_args(fmt, 0.0, False, None, (), device)
    step_rows, chunk, wide, warps = _block(rows, d)
    programs = max(1, min(triton.cdiv(rows, step_rows), _FORWARD_PROGRAMS))
    partials = torch.empty(programs, dtype=torch.float32, device=device)
    _rmsnorm_forward_kernel[(programs,)](
        x2d, weight.contiguous(), y, rstd, partials, counter(device), *args, rows, d, eps,
        HAT=_FLOATS[hat_dtype or torch.float32], PROD=_FLOATS[prod], OUT=_FLOATS[out_dtype], **consts, ROWS=step_rows,
        CHUNK=chunk, WIDE=wide, RBLOCK=triton.next_power_of_2(_FORWARD_PROGRAMS), num_warps=warps)
    if rows:
        _rmsnorm_cast_kernel[(triton.cdiv(rows, step_rows),)](
            x2d, rstd, sc.scale, codes, rows, d, MBITS=fmt.mbits, BIAS=fmt.bias, MAX_CODE=fmt.max_code,
            NAN_CODE=fmt.nan_code, HW=hardware_cast(device, fmt), ROWS=step_rows, CHUNK=chunk, num_warps=warps)
    return y, codes, sc.scale, rstd


def rmsnorm_backward(dy2d: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, rstd: torch.Tensor,
                     weight: torch.Tensor, x_dtype: torch.dtype, fmt: Format):
    """``(dx [rows, d] in x_dtype, dw in weight's dtype)`` in two launches (module doc); ``codes``: the
    forward's uint8 codes of ``fmt``."""
    check_interpretable(dy2d.device)
    rows, d = codes.shape
    device = codes.device
    dx = torch.empty(rows, d, dtype=x_dtype, device=device)
    dw = torch.empty(d, dtype=weight.dtype, device=device)
    step_rows, chunk, wide, warps = _block(rows, d, backward=True)
    programs = max(1, min(triton.cdiv(rows, step_rows), _BACKWARD_PROGRAMS))
    part = torch.empty(programs, d, dtype=torch.float32, device=device)
    _rmsnorm_backward_kernel[(programs,)](
        dy2d.contiguous(), codes.contiguous(), scale, rstd, weight.contiguous(), dx, part, rows, d, MBITS=fmt.mbits,
        BIAS=fmt.bias, IEEE_SPECIALS=fmt.name == "e5m2", HW=hardware_cast(device, fmt), ROWS=step_rows, CHUNK=chunk,
        WIDE=wide, num_warps=warps)
    bc = min(256, triton.next_power_of_2(d))
    _column_sum_kernel[(triton.cdiv(d, bc),)](part, programs, d, dw, BP=8, BC=bc)
    return dx, dw
