"""Casting one GEMM operand: current or delayed scaling, any granularity, or the identity hook.

An operand is what a GEMM needs and what backward saves: ``data`` (FP8 codes, 1 byte/element),
``scale`` (fp32 encode scale: ``[]`` per tensor, ``[rows, 1]`` per row, ``[nr, nc]`` per tile) and the
tensor's ``amax`` (fp32 scalar, what delayed scaling records). Values are ``data / scale``
(the convention of docs/numerics.md, Scales), so a GEMM of two operands is ``(a.data @ b.data.T) / (a.scale * b.scale)``.

Identity format (testing hook): the format name ``"identity"`` turns quantization off. ``data`` is
then the tensor itself in its own dtype and ``scale`` is 1, so every op computes the unquantized math;
the function-preservation tests of Smooth-SwiGLU rely on it. It is a runtime-op argument only, never
a numerics Format.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kernels
from ..kernels import torch_family
from ..numerics import Format, get_format, scale_from_amax
from ..numerics.scaling import outgrew, scale_to_cast
from ..quantized import quantize

__all__ = ["IDENTITY", "Operand", "unaliased", "resolve_format", "cast_operand", "cast_with_scale", "state_scale", "tile_for", "dequantize", "dequantized",
           "gemm", "as_bytes", "from_bytes", "MX_ROWS", "MX_COLS"]

IDENTITY = "identity"
MX_ROWS = (1, 32)  # MX blocks along the last dim (fp8pass.quantize's "mx" default)
MX_COLS = (32, 1)  # MX blocks down the rows


def resolve_format(name: str) -> Format | None:
    """A runtime format name -> Format, or None for the identity testing hook."""
    if name == IDENTITY:
        return None
    fmt = get_format(name)
    if fmt.torch_dtype is None:
        raise ValueError(f"FP8 GEMM operands need an FP8 format (e4m3, e4m3_gaudi, e5m2), got {fmt.name!r}")
    return fmt


@dataclass
class Operand:
    data: torch.Tensor
    scale: torch.Tensor
    amax: torch.Tensor
    up: torch.Tensor | None = None  # data already converted to the GEMM dtype, when asked for
    data_t: torch.Tensor | None = None  # data transposed and contiguous (GPU GEMM operand), if made
    inv_scale: torch.Tensor | None = None  # 1 / scale (the GPU GEMM's decode scale), if made with the scale
    inverted: tuple[torch.Tensor, ...] = ()  # decode scales of cast_operand's ``invert`` scales, if made


def tile_for(granularity: str, block: int, shape2d, weight: bool) -> tuple[int, int] | None:
    """Group tile of an operand: per row ``(1, cols)``; blocks ``(1, B)`` or ``(B, B)`` for weights;
    MX ``(1, 32)`` for both (32 elements along the forward GEMM's reduction dim; ``MX_COLS`` runs
    down the rows instead, what the backward GEMMs reduce over)."""
    if granularity == "tensor":
        return None
    if granularity == "mx":
        return MX_ROWS
    if granularity == "row":
        return (1, max(int(shape2d[1]), 1))
    return (block, block) if weight else (1, block)


def state_scale(state: list[torch.Tensor], amax_now: torch.Tensor | None, fmt: Format, margin, power_of_two):
    """The scale a delayed-scaling state gives now; with an empty history, the current amax's scale.

    ``state`` is the op list of a DelayedScalingState (``DelayedScalingState.OP_FIELDS``); ``amax_now``
    may be None where :func:`needs_current_amax` says so.
    """
    if state[2].device.type == "cpu":  # cheap host reads; avoid computing a current scale every call
        if amax_now is None:
            return state[1].to(torch.float32).reshape(())
        if int(state[2]) > int(state[3]) and not (bool(state[5]) and bool(outgrew(amax_now, state[1], fmt))):
            return state[1].to(torch.float32).reshape(())
        return scale_from_amax(amax_now, fmt, margin, power_of_two)
    return scale_to_cast(state, amax_now, fmt, margin, power_of_two).reshape(())


def needs_current_amax(state: list[torch.Tensor]) -> bool:
    """Whether a delayed-scaled cast must read the tensor's amax before casting.

    On GPU always (deciding would need a host read). On CPU only while the history is empty or with
    the overflow guard on; otherwise the held scale is used and the amax comes out of the cast itself.
    """
    steps, skipped, guard = state[2], state[3], state[5]
    return steps.device.type != "cpu" or int(steps) <= int(skipped) or bool(guard)


def cast_operand(
    x2d: torch.Tensor,
    fmt: Format | None,
    granularity: str = "tensor",
    tile: tuple[int, int] | None = None,
    state: list[torch.Tensor] | None = None,
    margin: float = 0.0,
    power_of_two: bool = False,
    rounding: str = "nearest",
    up: torch.dtype | None = None,
    transpose: bool = False,
    keep_codes: bool = True,
    invert: tuple[torch.Tensor, ...] = (),
    seed: torch.Tensor | None = None,
) -> Operand:
    """Cast a 2-D tensor for a GEMM.

    Args:
        x2d: [rows, cols] high-precision tensor.
        fmt: FP8 Format, or None (identity hook).
        granularity: "tensor", "row", "block" or "mx" (current scaling; delayed is per tensor only).
        tile: group tile for "row"/"block" (see :func:`tile_for`).
        state: the delayed-scaling op list (``DelayedScalingState.OP_FIELDS``), or None/[] (current).
        margin, power_of_two: scale options (recipe fields).
        rounding: "nearest" or "stochastic".
        up: also produce the codes in this dtype (CPU GEMM operand).
        transpose: also produce the transposed codes in the same pass where the device's kernels can
            (GPU: ``_scaled_mm`` wants the wgrad operands transposed).
        keep_codes: False for an operand only GEMMs read (never saved): with ``up`` and a kernel that
            has ``cast_values`` (CPU, per tensor, nearest rounding), no codes are written and ``data``
            is the values in ``up`` as well (see :func:`cast_with_scale`). Stochastic rounding keeps
            codes + upcast: a values-only stochastic loop measured 15-20% slower.
        invert: up to two scalar encode scales of other GEMM operands (a backward's saved ones) whose
            decode scales the Triton kernels compute in the same launch as this operand's scale
            (``Operand.inverted``); elsewhere ignored (empty ``inverted``).
        seed: stochastic rounding's seed, int64 [1] on x's device (a model's stream, ``runtime.sr``), for
            every granularity (row/block/MX through ``fp8pass.quantize(seed=)``); None draws from
            torch's generator.
    """
    kern = kernels.for_device(x2d.device)
    if fmt is None:
        amax = torch_family.tensor_amax(x2d)
        one = torch.ones((), dtype=torch.float32, device=x2d.device)
        data = x2d.clone()
        return Operand(data, one, amax, data if up is None else data.to(up))
    if state:
        if granularity != "tensor":
            raise ValueError(f"delayed scaling is per tensor; got granularity {granularity!r}")
        if kern.OFFERS.scale_on_device and fmt.torch_dtype is not None:  # Triton: one read, no host read
            data, data_t, sc = kern.cast_delayed(x2d, state, fmt, margin, power_of_two, rounding, transpose,
                                                 invert, seed)
            return Operand(data, sc.scale, sc.amax, None if up is None else kern.upcast(data, up), data_t,
                           sc.inv_scale, sc.inverted)
        amax_now = torch_family.tensor_amax(x2d) if needs_current_amax(state) else None
        scale = state_scale(state, amax_now, fmt, margin, power_of_two)
        return _cast_tensor(kern, x2d, scale, fmt, rounding, up, transpose, keep_codes, seed=seed)
    if granularity == "tensor" and kern.OFFERS.scale_on_device and fmt.torch_dtype is not None:
        data, data_t, sc = kern.cast_current(x2d, fmt, margin, power_of_two, rounding, transpose, invert, seed)  # Triton
        return Operand(data, sc.scale, sc.amax, None if up is None else kern.upcast(data, up), data_t, sc.inv_scale,
                       sc.inverted)
    if granularity == "tensor":
        scale = scale_from_amax(torch_family.tensor_amax(x2d), fmt, margin, power_of_two)
        return _cast_tensor(kern, x2d, scale, fmt, rounding, up, transpose, keep_codes, seed=seed)
    q = quantize(x2d, fmt, granularity="mx" if granularity == "mx" else "block", block=tile, rounding=rounding,
                 power_of_two=power_of_two, seed=seed)
    return Operand(q.data, q.scale, torch_family.tensor_amax(x2d))


def saved_transposed(device, fmt: Format | None, granularity: str) -> bool:
    """Whether the ops keep a saved GEMM operand (x, W) as its transpose's codes: on the Triton/CUDA
    path, per-tensor FP8, whose backward ``_scaled_mm`` GEMMs read x and W transposed (wgrad ``x^T``,
    dgrad ``W^T``). The forward casts both layouts in one read (``transpose_cast``), its GEMM takes the
    row-major codes, and the op saves the other copy as the ``[rows, cols]`` operand laid out column-major
    (:func:`column_major`): as many bytes as before, and no copy in backward to transpose them."""
    return fmt is not None and granularity == "tensor" and kernels.uses_triton(device)


def column_major(op: Operand) -> torch.Tensor:
    """The operand's codes ``[rows, cols]`` as a view of its transposed copy (strides ``(1, rows)``)."""
    return op.data_t.t()


def column_major_like(rows, cols, dtype, device) -> torch.Tensor:
    """An empty ``[rows, cols]`` tensor laid out as :func:`column_major` (for the ops' fake functions)."""
    return torch.empty_strided((rows, cols), (1, rows), dtype=dtype, device=device)


def cast_with_scale(x2d: torch.Tensor, scale: torch.Tensor, fmt: Format, up: torch.dtype | None = None,
                    keep_codes: bool = True, transpose: bool = False, transposed_only: bool = False) -> Operand:
    """Per-tensor RNE cast of ``x2d`` with a given fp32 scalar ``scale`` (e.g. a weight recast in
    backward with its forward's scale: the same codes again). Its ``amax`` is None: nobody reads a
    recast's amax, and the GPU then launches no reduction for it.

    Args:
        up: also produce the codes in this dtype (CPU GEMM operand), or None.
        keep_codes: False when only GEMMs read the operand: with ``up`` and a kernel that has
            ``cast_values`` (CPU) one loop writes the values in ``up`` and no codes; ``data`` and
            ``up`` are then both those values (bit-identical to upcasting the codes; GEMMs read
            ``up``). Where the GEMM takes codes (Triton/CUDA, ``up`` None) the codes are made as usual.
        transpose: also the transposed codes in the same pass where the device can (``data_t``).
        transposed_only: with ``transpose``, where the device writes ``data_t``: that copy alone, no
            row-major codes (``data`` None): for a recast whose GEMM reads only the transposed copy.
    """
    op = _cast_tensor(kernels.for_device(x2d.device), x2d, scale, fmt, "nearest", up, transpose, keep_codes=keep_codes,
                      want_amax=False, transposed_only=transposed_only)
    op.amax = None
    return op


def _cast_tensor(kern, x2d, scale, fmt, rounding, up, transpose=False, keep_codes=True, want_amax=True,
                 transposed_only=False, seed=None) -> Operand:
    if not keep_codes and up is not None and rounding == "nearest" and kern.OFFERS.values_without_codes:
        values, amax = kern.cast_values(x2d, scale, fmt, up)  # no codes: one loop, one write
        return Operand(values, scale, amax, values)
    if transpose and kern.OFFERS.transpose_cast:  # Triton: both layouts in one read, RNE or stochastic
        # without want_amax the per-tile maxima stay unreduced (no reduction launches for an unread amax)
        data, data_t, amax = kern.transpose_cast(x2d, scale, fmt, rounding=rounding, partials=not want_amax,
                                                 row_major=not transposed_only, seed=seed)
        return Operand(data, scale, amax if want_amax else None, None, data_t)
    if rounding == "nearest":
        data, amax, upc = kern.cast(x2d, scale, fmt, up, want_amax)
        return Operand(data, scale, amax, upc)
    data, amax = kern.cast_stochastic(x2d, scale, fmt, seed=seed)
    return Operand(data, scale, amax.float(), None if up is None else kern.upcast(data, up))


def unaliased(t: torch.Tensor, inputs) -> torch.Tensor:
    """``t``, or a copy where it shares memory with a tensor of ``inputs`` (tensors or lists of them).

    A custom op's outputs must not alias its inputs. A scale is usually made fresh (the GPU's scale
    kernel writes a new tensor); only one taken from a state or an argument needs the copy, so the
    fresh ones cost no copy launch.
    """
    ptr = t.untyped_storage().data_ptr()
    for i in inputs:
        for u in (i if isinstance(i, (list, tuple)) else [i]):
            if isinstance(u, torch.Tensor) and u.untyped_storage().data_ptr() == ptr:
                return t.clone()
    return t


def dequantize(data: torch.Tensor, scale: torch.Tensor, tile: tuple[int, int] | None) -> torch.Tensor:
    """fp32 values ``data / scale`` of a 2-D operand (scale per tensor or per tile)."""
    vals = data.to(torch.float32)
    if tile is None or scale.dim() == 0:
        return vals / scale
    return vals / torch_family.expand_groups(scale.reshape(-1, scale.shape[-1]), tile, vals.shape)


def dequantized(data: torch.Tensor, scale: torch.Tensor, tile: tuple[int, int] | None, dtype: torch.dtype) -> Operand:
    """A saved operand's values in ``dtype`` as an identity-format operand (scale 1): what a backward
    in high precision (``backward="high"``) multiplies instead of the codes."""
    one = torch.ones((), dtype=torch.float32, device=data.device)
    return Operand(dequantize(data, scale, tile).to(dtype), one, one)


def gemm(a: Operand, a_tile, b: Operand, b_tile, out_dtype: torch.dtype, bias: torch.Tensor | None = None,
         a_t: bool = False, b_t: bool = False, mm_dtype: torch.dtype = torch.float32,
         compute_dtype: torch.dtype | None = None, fast_accum: bool = False) -> torch.Tensor:
    """``A @ B.T (+ bias)`` of two operands; ``a_t``/``b_t`` take the operand's transpose instead.

    The result is rounded to ``compute_dtype`` (default ``out_dtype``), then converted to ``out_dtype``:
    a gradient GEMM under autocast rounds to the autocast dtype and returns the input's dtype.

    ``fast_accum``: the device GEMM may accumulate fast (``_scaled_mm(use_fast_accum=True)`` on CUDA:
    the forward GEMMs, ``Config.fast_accum``); the default accumulates precisely (the gradient GEMMs).

    Per-tensor scales use the device's fast GEMM; per-row / per-tile scales dequantize both operands
    to fp32 (exact codes, one fp32 rounding of ``data / scale``) and multiply in ``mm_dtype``: fp32,
    or bf16 (fp32 accumulation) for MX operands, whose values (codes times powers of two) bf16 holds
    exactly, when the output is bf16 anyway.
    """
    if a_tile is None and b_tile is None:
        kern = kernels.for_device(a.data.device)
        ad = (a.data_t if a.data_t is not None else a.data.t()) if a_t else a.data
        bd = (b.data_t if b.data_t is not None else b.data.t()) if b_t else b.data
        au = None if a.up is None else (a.up.t() if a_t else a.up)
        bu = None if b.up is None else (b.up.t() if b_t else b.up)
        out = kern.gemm_tensor_scaled(au if au is not None else ad, a.scale,
                                      bu if bu is not None else bd, b.scale, compute_dtype or out_dtype, bias,
                                      a_inv=a.inv_scale, b_inv=b.inv_scale, fast_accum=fast_accum)
        return out.to(out_dtype)
    av = dequantize(a.data, a.scale, a_tile)
    bv = dequantize(b.data, b.scale, b_tile)
    av = av.t() if a_t else av
    bv = bv.t() if b_t else bv
    if mm_dtype != torch.float32:
        av, bv = av.to(mm_dtype), bv.to(mm_dtype)
    if bias is None:
        out = torch.mm(av, bv.t())
    else:
        out = torch.addmm(bias.to(mm_dtype), av, bv.t())
    return out.to(compute_dtype or out_dtype).to(out_dtype)


def as_bytes(data: torch.Tensor) -> torch.Tensor:
    """FP8 codes as uint8 bytes (how the ops hand saved codes to their backward); others unchanged.

    Plain uint8 keeps the saved operands usable by every tool that inspects op outputs (opcheck
    multiplies them, which float8 dtypes do not implement on CPU).
    """
    return data.view(torch.uint8) if data.element_size() == 1 and data.dtype.is_floating_point else data


def from_bytes(data: torch.Tensor, fmt: Format | None) -> torch.Tensor:
    """Inverse of :func:`as_bytes` for the operand's format."""
    return data.view(fmt.torch_dtype) if fmt is not None and data.dtype == torch.uint8 else data
