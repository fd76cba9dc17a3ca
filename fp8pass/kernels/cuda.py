"""CUDA kernels of the runtime ops: Triton casts and ``torch._scaled_mm`` FP8 GEMMs.

``_scaled_mm`` wants ``a`` [M, K] row-major and ``b`` column-major, K and N multiples of 16 (M is
free), and not both operands E5M2; it takes decode scales (``1 / encode scale``) and accumulates in
fp32. :func:`scaled_mm_plan` decides: FP8 operands on CUDA always take it, K and N that are not
multiples of 16 padded with zero codes (a zero adds exactly nothing to an fp32 sum), so a token
count of 4095 in a wgrad GEMM costs one small copy, not a dequantize + fp32 matmul. What it cannot
take (two E5M2 operands, the identity testing format, empty dims, CPU tensors, GPUs below compute
capability 8.9; :func:`scaled_mm_refusal` says which) goes through the fallback: dequantize to fp32 and
multiply there, correct for every shape, only slower. Never used on CPU. The precision audit
(fp8pass/precision_audit.py) names the same choices per weight, from the same functions.

Grouped (MoE) GEMMs: all three (forward, dgrad, wgrad) are one ``torch._scaled_grouped_mm`` each
where the GPU takes it (sm90+, E4M3 operands, dims multiples of 16; the gradient is cast to E4M3 for
them, :func:`fp8pass.runtime.grouped_casting.grad_format`), else one :func:`grouped_mm_emulated` with
the same arguments; neither reads the group offsets on the host. Their operands are cast by
:func:`cast_grouped` (Triton, two launches for any number of experts; round to nearest), a
stochastically rounded gradient by the eager torch ``cast_rows``.
"""

from __future__ import annotations

import functools

import torch

from ..numerics.formats import Format
from . import (
    cpu,
    triton_family,
    triton_grouped_casts,
    triton_grouped_glu,
    triton_norm,
    triton_operand_casts,
    triton_scaling,
)
from .interface import Offers

__all__ = ["OFFERS", "cast", "cast_delayed", "cast_current", "cast_stochastic", "upcast", "gemm_tensor_scaled", "scaled_mm_plan",
           "scaled_mm_refusal", "device_capability", "grouped_mm_refusal", "grouped_mm_operands_refusal",
           "transpose_cast", "row_amax", "cast_rows", "cast_grouped", "grouped_gemm",
           "grouped_gemm_wgrad", "grouped_mm_emulated", "GROUP_ALIGN", "grouped_glu_operand", "grouped_glu_backward",
           "GLU_ACTIVATIONS", "norm_supported", "rmsnorm_forward", "rmsnorm_backward"]

# Scales picked on the device inside the casts' launches, both layouts from one read; the GEMMs
# (``_scaled_mm``) take the FP8 codes themselves.
OFFERS = Offers(scale_on_device=True, transpose_cast=True, values_without_codes=False, upcast_gemm_operands=False,
                grouped_casts=True, grouped_glu=True, fused_norm=True)

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
cast_grouped = triton_grouped_casts.cast_grouped
grouped_glu_operand = triton_grouped_glu.grouped_glu_operand
grouped_glu_backward = triton_grouped_glu.grouped_glu_backward
GLU_ACTIVATIONS = tuple(triton_grouped_glu.ACTIVATIONS)
norm_supported = triton_norm.norm_supported
rmsnorm_forward = triton_norm.rmsnorm_forward
rmsnorm_backward = triton_norm.rmsnorm_backward


def cast_delayed(x2d: torch.Tensor, state: list[torch.Tensor], fmt: Format, margin: float, power_of_two: bool,
                 rounding: str = "nearest", transpose: bool = False, invert: tuple[torch.Tensor, ...] = (),
                 seed: torch.Tensor | None = None):
    """A delayed-scaled cast in one read of ``x2d`` and two launches (no host read).

    Casts with the held scale, taking the per-tile maxima of ``|x|`` from the same read; the kernel's
    last program reduces them and picks the scale the cast should have used
    (:func:`~fp8pass.numerics.scaling.scale_to_cast`: the held one, or the current one with an empty
    history or when the overflow guard fires) with its decode scale; a second launch recasts only if
    it differs (otherwise it reads and writes nothing). So the codes, scale and amax are those of
    the two-read reference; a second read happens only on the first step and when the guard fires.
    ``invert``: scales whose decode scales the scale launch computes too (:func:`cast_current`).
    ``seed``: stochastic rounding's seed (int64 [1], a stream's draw; both launches use it), or None
    (one drawn from the device's generator).

    Returns:
        (codes [R, C], codes [C, R] or None, :class:`~.triton_scaling.OperandScale`).
    """
    data, data_t, sc = triton_operand_casts.transpose_cast(x2d, state[1], fmt, transpose, rounding,
                                                     delayed=(state, margin, power_of_two, invert), seed=seed)
    triton_operand_casts.transpose_cast(x2d, sc.scale, fmt, transpose, rounding, only_if=sc.recast, out=(data, data_t),
                                        seed=seed)
    return data, data_t, sc


def cast_current(x2d: torch.Tensor, fmt: Format, margin: float, power_of_two: bool, rounding: str = "nearest",
                 transpose: bool = False, invert: tuple[torch.Tensor, ...] = (), seed: torch.Tensor | None = None):
    """A current-scaled per-tensor cast in two reads of ``x2d`` and two launches (no host read): the amax
    and, from the kernel's last program, the scale (:func:`~fp8pass.numerics.scale_from_amax`), its
    decode scale and ``1 / s`` of each ``invert`` scale (:func:`.triton_scaling.amax_and_scale`); the
    cast (both layouts with ``transpose``); ``seed`` as in :func:`cast_delayed`.

    Returns:
        (codes [R, C], codes [C, R] or None, :class:`~.triton_scaling.OperandScale`).
    """
    sc = triton_scaling.amax_and_scale(x2d, fmt, margin, power_of_two, invert=invert)
    data, data_t, _ = triton_operand_casts.transpose_cast(x2d, sc.scale, fmt, transpose, rounding, partials=True,
                                                          seed=seed)
    return data, data_t, sc


def cast_stochastic(x2d: torch.Tensor, scale: torch.Tensor, fmt: Format, seed: torch.Tensor | None = None):
    """Stochastically rounded codes of ``x2d * scale`` and ``max |x2d|`` in one read: the Triton
    cast kernel (random bits from a seed drawn on the device; no host sync), instead of the torch
    integer emulation (~30 elementwise kernels and a full-size ``randint``). ``seed``: int64 [1] (a
    stream's draw), or None (drawn)."""
    return triton_family.cast_scaled(x2d, scale, fmt, "stochastic", None, want_amax=True, seed=seed)


def upcast(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return codes.to(dtype)


def scaled_mm_plan(m: int, k: int, n: int, a_dtype: torch.dtype, b_dtype: torch.dtype, out_dtype: torch.dtype,
                   device: torch.device | str) -> tuple[int, int] | None:
    """``(pad_k, pad_n)``: the zero columns that make K and N multiples of 16 for ``torch._scaled_mm``,
    or None where it cannot take the GEMM (the fallback then runs; :func:`scaled_mm_refusal` says why).

    torch checks ``mat1.size(1) % 16`` and both dims of ``mat2`` (K and N); M may be anything.
    """
    if scaled_mm_refusal(m, k, n, a_dtype, b_dtype, out_dtype, device) is not None:
        return None
    return (-k) % 16, (-n) % 16


FP8_GEMM_CAPABILITY = (8, 9)  # cuBLASLt's FP8 GEMMs (torch._scaled_mm): Ada and Hopper onwards
GROUPED_FP8_GEMM_CAPABILITY = (9, 0)  # torch._scaled_grouped_mm: Hopper onwards


def device_capability(device: torch.device | str) -> tuple[int, int] | None:
    """The compute capability of a CUDA ``device`` (cached per device), or None where the device names no
    index (``"cuda"`` given by its type alone: the plan's own tests, the CPU code-path counters)."""
    device = torch.device(device)
    return None if device.index is None else _capability(device.index)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))


def scaled_mm_refusal(m: int, k: int, n: int, a_dtype: torch.dtype, b_dtype: torch.dtype, out_dtype: torch.dtype,
                      device: torch.device | str) -> str | None:
    """Why ``torch._scaled_mm`` cannot take this GEMM (the dequantize + fp32 matmul fallback runs), or None
    where it can: the one statement of what the FP8 GEMM takes (:func:`scaled_mm_plan`, the precision audit)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"{device.type} tensors: torch._scaled_mm runs on CUDA devices only"
    if a_dtype not in _FP8 or b_dtype not in _FP8:
        return f"operands {a_dtype} x {b_dtype} are not FP8 codes"
    if a_dtype == b_dtype == torch.float8_e5m2:
        return "both operands E5M2: cuBLASLt has no E5M2 x E5M2 FP8 GEMM"
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"output dtype {out_dtype}: torch._scaled_mm writes bf16, fp16 or fp32"
    if 0 in (m, k, n):
        return "an empty dimension: nothing to multiply"
    cap = device_capability(device)
    if cap is not None and cap < FP8_GEMM_CAPABILITY:
        return (f"{device} has compute capability {cap[0]}.{cap[1]}: no FP8 GEMMs (torch._scaled_mm needs "
                f"{FP8_GEMM_CAPABILITY[0]}.{FP8_GEMM_CAPABILITY[1]} or later)")
    return None


def gemm_tensor_scaled(a, a_scale, b, b_scale, out_dtype, bias=None, a_inv=None, b_inv=None, fast_accum=False):
    """``(a / a_scale) @ (b / b_scale).T (+ bias)``; ``a`` [M, K], ``b`` [N, K], scalar scales.

    ``fast_accum``: ``_scaled_mm``'s ``use_fast_accum`` (the forward GEMMs; gradients accumulate precisely).

    ``a_inv``/``b_inv``: the decode scales ``1 / a_scale`` / ``1 / b_scale`` where the caller has them
    (computed beside the scale, :mod:`.triton_scaling`): ``_scaled_mm`` takes those, and a
    ``reciprocal`` launch each is saved.
    """
    plan = scaled_mm_plan(a.shape[0], a.shape[1], b.shape[0], a.dtype, b.dtype, out_dtype, a.device)
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


def cast_rows(x2d, row_scale, fmt: Format, rounding="nearest", generator=None, seed=None):
    """Codes of ``x[i] * row_scale[i]`` (same math as the CPU module's ``cast_rows``, eager; ``seed``:
    a stream's draw, int64 [1], instead of one from ``generator``)."""
    if x2d.numel() == 0:
        return torch.empty(x2d.shape, dtype=fmt.torch_dtype, device=x2d.device)
    row_scale = row_scale.to(torch.float32)
    if rounding == "nearest":
        return cpu._cast_rows_math(x2d, row_scale, fmt.max, fmt.torch_dtype)
    seed = cpu.stochastic_seed(seed, generator, x2d.device)
    return cpu._cast_rows_sr_math(x2d.contiguous(), row_scale, seed, fmt.max, fmt.mbits, fmt.emin, fmt.torch_dtype)


# --- grouped (MoE) GEMMs ----------------------------------------------------------------------------
# torch._scaled_grouped_mm (sm90+; the checks of _scaled_grouped_mm_cuda in Blas.cpp and of its meta
# function) takes two E4M3 operands, bf16 out and fp32 DECODE scales given per row and per column:
#   2d x 3d (forward, dgrad): a [S, K] row-major, b [E, K, N] column-major, offs the group ends along S,
#       scale_a [S], scale_b [E, N]; out [S, N], rows past offs[-1] left unwritten;
#   2d x 2d (wgrad): a [M, T] row-major, b [T, N] column-major, offs the group ends along T (the
#       contraction), scale_a [E*M], scale_b [E*N]; out [E, M, N];
#   a's last dim and both dims of b multiples of 16.
# The scales here are per expert: the row and column vectors repeat each expert's decode scale.

GROUP_ALIGN = 16  # wgrad groups start at multiples of 16 tokens: 16-byte aligned FP8 addresses for TMA


def _grouped_mm_operands_ok(a, b, out_dtype) -> bool:
    """Whether ``torch._scaled_grouped_mm`` takes these operands, as they are passed to it (dtypes, dims)."""
    return grouped_mm_operands_refusal(a.shape, b.shape, a.dtype, b.dtype, out_dtype) is None


def grouped_mm_operands_refusal(a_shape, b_shape, a_dtype, b_dtype, out_dtype) -> str | None:
    """Why ``torch._scaled_grouped_mm`` cannot take operands of these shapes and dtypes (as passed to it: ``b``
    column-major [E, K, N] or [T, N]), or None where it can."""
    if not a_dtype == b_dtype == torch.float8_e4m3fn:
        return f"operands {a_dtype} x {b_dtype}: torch._scaled_grouped_mm takes E4M3 x E4M3 only"
    if out_dtype != torch.bfloat16:
        return f"output dtype {out_dtype}: torch._scaled_grouped_mm writes bf16 only"
    if 0 in tuple(a_shape) or 0 in tuple(b_shape):
        return "an empty dimension: nothing to multiply"
    if a_shape[-1] % 16 or b_shape[-2] % 16 or b_shape[-1] % 16:
        return (f"dims {tuple(a_shape)} x {tuple(b_shape)}: torch._scaled_grouped_mm needs the contraction and "
                f"output dims multiples of 16")
    return None


def grouped_mm_refusal(a_shape, b_shape, a_dtype, b_dtype, out_dtype, device: torch.device | str) -> str | None:
    """Why ``torch._scaled_grouped_mm`` cannot take this grouped GEMM on ``device`` (:func:`grouped_mm_emulated`
    runs instead), or None where it can."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"{device.type} tensors: torch._scaled_grouped_mm runs on CUDA devices only"
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"torch {torch.__version__} has no torch._scaled_grouped_mm"
    cap = device_capability(device)
    if cap is not None and cap < GROUPED_FP8_GEMM_CAPABILITY:
        return (f"{device} has compute capability {cap[0]}.{cap[1]}: torch._scaled_grouped_mm needs "
                f"{GROUPED_FP8_GEMM_CAPABILITY[0]}.{GROUPED_FP8_GEMM_CAPABILITY[1]} or later")
    return grouped_mm_operands_refusal(a_shape, b_shape, a_dtype, b_dtype, out_dtype)


def _scaled_grouped_mm_ok(a, b, out_dtype) -> bool:
    return grouped_mm_refusal(a.shape, b.shape, a.dtype, b.dtype, out_dtype, a.device) is None


def grouped_mm_emulated(a, b, scale_a, scale_b, offs, out_dtype):
    """What ``torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs)`` computes (both layouts of the
    table above), in torch ops on any device and with no host sync: per element the fp32 sum of the
    operands' products, times its row's decode scale, times its column's, rounded once to ``out_dtype``.

    Groups of data-dependent size are masks, not slices: every expert's GEMM runs over all rows (2d x 3d)
    or all contraction columns (2d x 2d) with the others' entries zero, E times the kernel's work. It is
    the fallback (CPU tensors, GPUs or shapes without the kernel) and the CPU tests' stand-in for the
    kernel. Rows past ``offs[-1]`` come out 0 (2d x 3d).
    """
    experts = offs.numel()
    expert = torch.arange(experts, device=a.device, dtype=offs.dtype)
    along = a.shape[0] if b.dim() == 3 else a.shape[1]  # the grouped dim: rows of a, or the contraction
    ids = torch.searchsorted(offs, torch.arange(along, device=a.device, dtype=offs.dtype), right=True)
    mine = ids[None, :] == expert[:, None]  # [E, along]
    av = a.float()
    if b.dim() == 3:  # where(), not a product with the mask: a NaN of one group stays out of the others
        acc = torch.bmm(torch.where(mine[:, :, None], av[None], 0.0), b.float()).sum(0)  # one non-zero term each
        out = acc * scale_a[:, None] * scale_b[ids.clamp(max=experts - 1)]
    else:
        acc = torch.matmul(torch.where(mine[:, None, :], av[None], 0.0), b.float())  # [E, M, N]
        out = acc * scale_a.view(experts, -1, 1) * scale_b.view(experts, 1, -1)
    return out.to(out_dtype)


def _grouped_mm(a, b, scale_a, scale_b, offs, out_dtype, fast_accum=False):
    if _scaled_grouped_mm_ok(a, b, out_dtype):
        return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs, out_dtype=out_dtype,
                                        use_fast_accum=fast_accum)
    return grouped_mm_emulated(a, b, scale_a, scale_b, offs, out_dtype)


def _expert_of_rows(offs, rows):
    """Expert of every row (E for rows past ``offs[-1]``)."""
    return torch.searchsorted(offs, torch.arange(rows, device=offs.device, dtype=offs.dtype), right=True)


def _repeated_inverse(scale, times, divisor=None):
    """fp32 [E, times] contiguous: each expert's decode scale ``1 / scale[e]`` repeated (one launch), or
    divided by ``divisor`` [E, times] (powers of two: exact)."""
    inverse = torch.reciprocal(scale.float()[:, None].expand(scale.shape[0], times))
    return inverse if divisor is None else inverse * torch.reciprocal(divisor)


def grouped_gemm(a, a_scale, b, b_scale, offs, out_dtype, fast_accum=False, a_row_inv=None, b_row_inv=None,
                 a_row_pad=None):
    """Per group ``(a[g] / a_scale[e]) @ (b[e] / b_scale[e]).T``: a [S, K], b [E, N, K] (any strides);
    rows past offs[-1] = 0. One grouped GEMM (2d x 3d), no host sync; ``fast_accum``: the forward's
    ``use_fast_accum`` (``Config.fast_accum``). ``a_row_inv`` [S] / ``b_row_inv`` [E * N]: the decode
    scales of a's and b's rows as :func:`cast_grouped` wrote them (the GEMM's scale vectors, so no
    launches make them here), ``a_row_pad`` [S] a's padding rows (the rows the output zeroes); None:
    made here from the [E] scales and ``offs``."""
    experts = b.shape[0]
    ids = _expert_of_rows(offs, a.shape[0]) if a_row_inv is None or a_row_pad is None else None
    if a_row_inv is not None:
        scale_a = a_row_inv
    else:
        scale_a = torch.reciprocal(a_scale.float())[ids.clamp(max=experts - 1)]
    scale_b = b_row_inv.view(experts, -1) if b_row_inv is not None else _repeated_inverse(b_scale, b.shape[1])
    # [E, K, N] column-major: b [E, N, K] row-major (a copy only for a transposed view: dgrad, w_transposed)
    b = b if b.is_contiguous() else b.clone(memory_format=torch.contiguous_format)
    out = _grouped_mm(a.contiguous(), b.transpose(1, 2), scale_a, scale_b, offs, out_dtype, fast_accum)
    return out.masked_fill((ids == experts if a_row_pad is None else a_row_pad)[:, None], 0)


def _aligned_groups(offs, rows):
    """The 2d x 2d GEMM's token layout: each group starting at a multiple of ``GROUP_ALIGN`` (zeros
    between groups). Returns (int32 [E] group ends in it, int64 [rows] position of every row in it,
    its width: a static bound, so the layout needs no host read of the group sizes; the group sizes)."""
    sizes = torch.diff(offs, prepend=offs.new_zeros(1))
    gaps = torch.cumsum((-sizes) & (GROUP_ALIGN - 1), 0, dtype=offs.dtype)  # zeros added up to each group's end
    shift = torch.cat([gaps.new_zeros(1), gaps])  # of each group's rows (rows past offs[-1]: the total)
    where = torch.arange(rows, device=offs.device) + shift[_expert_of_rows(offs, rows)]
    return offs + gaps, where, _aligned_width(rows, offs.numel()), sizes


def _aligned_width(rows, experts):
    """Columns of the aligned token layout: room for every row and each group's padding (a static bound)."""
    return -(-(rows + (GROUP_ALIGN - 1) * experts) // GROUP_ALIGN) * GROUP_ALIGN


def _scattered_transpose(x, where, width):
    """``x.T`` [C, width] with row r of ``x`` [R, C] in column ``where[r]``, zeros elsewhere (zero codes
    are 0.0 in both FP8 formats)."""
    raw = x.view(torch.uint8) if x.element_size() == 1 else x  # index_copy_ of FP8 dtypes: as bytes
    out = raw.new_zeros(x.shape[1], width).index_copy_(1, where, raw.t())
    return out.view(x.dtype)


def grouped_gemm_wgrad(a, a_scale, b, b_scale, offs, out_dtype, a_div=None, b_div=None):
    """Per expert ``(a[g] / a_scale[e]).T @ (b[g] / b_scale[e])``: [E, M, N] from a [S, M], b [S, N] (rows
    past offs[-1] left out). One grouped GEMM (2d x 2d, groups along the contraction), no host sync.
    ``a_div`` [E, M] / ``b_div`` [E, N]: fp32 powers of two the output's rows / columns are divided by,
    folded into the decode scales (exact; no pass over the output)."""
    width = _aligned_width(a.shape[0], offs.numel())
    if a.numel() and b.numel() and a.element_size() == b.element_size() == 1:
        # both operands in the aligned layout, the padded group ends and decode scales: two launches
        mat_a, ends, empty, scale_a = triton_grouped_casts.aligned_transpose(a, a_scale, offs, width, a_div)
        mat_b, _, _, scale_b = triton_grouped_casts.aligned_transpose(b, b_scale, offs, width, b_div)
    else:  # the torch layout (the reference of the kernel above; other dtypes, empty operands)
        ends, where, width, sizes = _aligned_groups(offs, a.shape[0])
        mat_a, mat_b = _scattered_transpose(a, where, width), _scattered_transpose(b, where, width)
        scale_a = _repeated_inverse(a_scale, a.shape[1], a_div).view(-1)
        scale_b = _repeated_inverse(b_scale, b.shape[1], b_div).view(-1)
        empty = sizes == 0
    # mat_a [M, T] row-major, mat_b^T [T, N] column-major
    out = _grouped_mm(mat_a, mat_b.t(), scale_a, scale_b, ends, out_dtype)
    # an expert without tokens gets 0, not whatever the kernel leaves for an empty contraction
    return out.masked_fill(empty[:, None, None], 0)
