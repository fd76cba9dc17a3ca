"""``quantize(x, fmt, ...)`` and the ``Quantized`` result.

Above ``numerics`` (the reference math) and ``kernels`` (its device implementations): quantize picks
a kernel family for the tensor's device, so it cannot live in the bottom layer.

Convention: ``data = saturating_cast(x * scale)`` and ``dequantize() = data / scale``, the scale
broadcast over its group. Granularities, on the matrix view ``[rows, cols]`` of ``x`` (all leading
dims folded into rows, a 1-D tensor is one row):

==========  ===========================================================================  ==============
granularity  groups                                                                      ``scale`` shape
==========  ===========================================================================  ==============
"tensor"    the whole tensor                                                              ``[]``
"row"       each row (per token for activations, per output channel for weights)          ``[..., 1]``
"block"     tiles ``block=(br, bc)``: ``(1, B)`` for activations, ``(B, B)`` for weights  ``[nr, nc]``
"mx"        OCP MX: 32 elements along the last dim (``(1, 32)``; ``block=(32, 1)``: down  ``[nr, nc]``
            the rows), power-of-two E8M0 scales (``block_scale``)
==========  ===========================================================================  ==============

``block=None`` means ``(1, 128)`` for FP8 formats and ``(1, 16)`` for E2M1; an int ``B`` means
``(1, B)``. A shape the tile does not divide gets partial tiles at its edges (as if zero-padded). A
tile larger than the matrix is clamped to it: the same groups, codes and scales, with memory bounded
by the tensor (``Quantized.block`` holds the clamped tile).

A given ``scale`` must be finite and > 0 (checked: one host read for a GPU tensor); a tensor with
no elements quantizes to empty codes with scale 1 (per row for "row").

E2M1 with "block" granularity is NVFP4: per-tile decode scales stored in E4M3 (``block_scale``) under
one fp32 tensor encode scale (``scale``); ``dequantize() = data * block_scale / scale``. E2M1 codes are
packed two per byte along the last dim, which must then be even. Under stochastic rounding the E4M3
block scale is rounded up, so no element is clipped and the rounding stays unbiased at the block
maxima (round to nearest keeps the nearest block scale; docs/nvfp4.md).

"mx" granularity is OCP Microscaling v1.0 (MXFP8 with E4M3/E5M2 elements, MXFP4 with E2M1): per block
of 32 elements the shared scale ``X = 2**(floor(log2(amax)) - fmt.emax)`` (E8M0 codes in
``block_scale``; ``scale`` holds the exact fp32 encode scales ``1 / X``), elements
``saturating_cast(x / X)``: a block max in ``(fmt.max, 2**(emax + 1)) * X`` saturates, as the spec's
conversion does. All-zero blocks get code 0 (2**-127); a block with NaN or Inf gets the NaN code 0xFF
and reads back as NaN (docs/numerics.md, MX).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kernels import kernel_family, torch_family
from .numerics.casts import check_rounding, decode
from .numerics.formats import E2M1, E8M0, Format, get_format
from .numerics.scaling import DelayedScalingState, scale_from_amax
from .scaling_recipes import GRANULARITIES

__all__ = ["Quantized", "quantize", "quantize_delayed", "normalize_block", "MX_BLOCK", "MX_FORMATS"]

MX_BLOCK = 32  # elements per MX block (OCP MX v1.0 fixes k = 32)
MX_FORMATS = ("e4m3", "e5m2", "e2m1")  # the MX element formats fp8pass implements (MXFP8, MXFP4)

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass
class Quantized:
    """A quantized tensor: codes, scales and what is needed to read them back.

    Attributes:
        data: codes; an fp8 dtype tensor of ``shape``, or packed E2M1 uint8 ``[..., cols // 2]``.
        scale: fp32 encode scale(s) (see the module table); for NVFP4 the tensor scale.
        format: the element Format.
        granularity: "tensor", "row", "block" or "mx".
        block: the tile for "block" and "mx" granularity, else None.
        shape: the logical shape of the quantized tensor.
        dtype: the dtype of the tensor that was quantized.
        block_scale: NVFP4: E4M3 per-tile decode scales ``[nr, nc]``; MX: E8M0 codes (uint8) ``[nr, nc]``.
    """

    data: torch.Tensor
    scale: torch.Tensor
    format: Format
    granularity: str
    block: tuple[int, int] | None
    shape: torch.Size
    dtype: torch.dtype
    block_scale: torch.Tensor | None = None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The represented values ``data / scale`` in ``dtype`` (computed in fp32; MX in fp64 for fp64)."""
        vals = decode(self.data, self.format, torch.float32)
        rows, cols = _matrix_shape(self.shape)
        vals = vals.reshape(rows, cols)
        if self.granularity == "tensor":
            out = vals / self.scale
        elif self.granularity == "row":
            out = vals / self.scale.reshape(rows, 1)
        elif self.granularity == "mx":  # exact: codes times powers of two (fp64 when asked, past fp32's range)
            wide = torch.float64 if dtype == torch.float64 else torch.float32
            x_dec = decode(self.block_scale, E8M0, wide)  # 2**(code - 127), NaN for 0xFF
            out = vals.to(wide) * torch_family.expand_groups(x_dec, self.block, vals.shape)
        elif self.block_scale is not None:
            d = torch_family.expand_groups(self.block_scale.to(torch.float32), self.block, vals.shape)
            out = vals * d / self.scale
        else:
            out = vals / torch_family.expand_groups(self.scale, self.block, vals.shape)
        return out.reshape(self.shape).to(dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of codes and scales together (MX: codes and one E8M0 byte per block)."""
        total = self.data.numel() * self.data.element_size()
        if self.granularity != "mx":
            total += self.scale.numel() * 4
        if self.block_scale is not None:
            total += self.block_scale.numel()
        return total


def _matrix_shape(shape: torch.Size) -> tuple[int, int]:
    if len(shape) == 0:
        return 1, 1
    cols = shape[-1]
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return rows, cols


def normalize_block(block, fmt: Format) -> tuple[int, int]:
    """``None`` -> the format's default tile, ``B`` -> ``(1, B)``, ``(br, bc)`` checked."""
    if block is None:
        return (1, 16) if fmt is E2M1 else (1, 128)
    if isinstance(block, int) and not isinstance(block, bool):
        block = (1, block)
    if (
        not isinstance(block, (tuple, list))
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block)
    ):
        raise ValueError(f"block must be None, a positive int B (1 x B tiles) or (rows, cols); got {block!r}")
    return tuple(block)


def _mx_tile(block) -> tuple[int, int]:
    """``None``/``32``/``(1, 32)``: blocks along the last dim; ``(32, 1)``: down the rows."""
    if block is None or (isinstance(block, int) and not isinstance(block, bool) and block == MX_BLOCK):
        return (1, MX_BLOCK)
    if isinstance(block, (tuple, list)) and tuple(block) in ((1, MX_BLOCK), (MX_BLOCK, 1)):
        return tuple(block)
    raise ValueError(f"MX blocks are {MX_BLOCK} elements (OCP MX v1.0): block must be None, {MX_BLOCK}, "
                     f"(1, {MX_BLOCK}) (along the last dim) or ({MX_BLOCK}, 1) (down the rows); got {block!r}")


def quantize(
    x: torch.Tensor,
    fmt: Format | str,
    scale: torch.Tensor | float | None = None,
    granularity: str = "tensor",
    block=None,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
    power_of_two: bool = False,
    seed: torch.Tensor | None = None,
) -> Quantized:
    """Quantize ``x`` to ``fmt`` with saturating round-to-nearest-even or stochastic rounding.

    Args:
        x: fp16, bf16, fp32 or fp64 tensor of any shape (non-contiguous is fine).
        fmt: E4M3, E4M3_GAUDI, E5M2, E2M1 (or a name such as "e4m3"); "mx" takes E4M3, E5M2, E2M1.
        scale: the encode scale to use (delayed scaling): a scalar for "tensor", ``[rows]`` or
            ``[..., 1]`` for "row", ``[nr, nc]`` for "block" (for NVFP4: the fp32 tensor scale).
            None: current scaling, ``fmt.max / amax`` per group. "mx" computes its scales (None only).
        granularity: "tensor", "row", "block" or "mx" (OCP MX, 32-element blocks, E8M0 scales).
        block: tile for "block" granularity (see the module docs); for "mx" None (32 along the
            last dim) or ``(32, 1)`` (32 down the rows).
        rounding: "nearest" (ties to even) or "stochastic" (unbiased; use ``generator`` to reproduce).
        generator: torch.Generator for stochastic rounding.
        power_of_two: round computed scales down to a power of two, ``2**floor(log2(max / amax))``
            (MX scales are powers of two anyway).
        seed: instead of ``generator``, stochastic rounding's bits keyed by this int64 ``[1]`` tensor on
            ``x``'s device (a model's stream draw, ``fp8pass.runtime.sr``): counter-based, no
            generator and no host read; the same seed gives the same codes (Philox keyed by it on the
            Triton kernels, ``numerics.casts.uniform_bits`` of its low 32 bits on the torch family:
            the two families' bits differ). Ignored by round-to-nearest.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize expects a torch.Tensor, got {type(x).__name__}")
    _check_seed(seed, generator, x)
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"quantize expects a float16/bfloat16/float32/float64 tensor, got {x.dtype}")
    fmt = get_format(fmt)
    if fmt.name == "e8m0":
        raise ValueError("E8M0 is a block-scale format, not an element format; quantize to e4m3, e5m2 or e2m1 "
                         "(granularity='mx' gives E8M0 block scales)")
    check_rounding(rounding)
    if granularity not in GRANULARITIES:
        raise ValueError(f"unknown granularity {granularity!r}; valid: {', '.join(GRANULARITIES)}")
    if granularity == "mx":
        return _quantize_mx(x, fmt, scale, block, rounding, generator, seed)
    if fmt.packed and (x.dim() == 0 or x.shape[-1] % 2 or (granularity == "block" and normalize_block(block, fmt)[1] % 2)):
        raise ValueError(
            f"E2M1 packs two codes per byte along the last dim, so it and the block width must be even; "
            f"got shape {tuple(x.shape)}, block {block!r}"
        )
    kernels = kernel_family(x.device)
    rows, cols = _matrix_shape(x.shape)
    if scale is not None:
        scale = _checked_scale(scale, x.device)

    if granularity == "tensor":
        if scale is None:
            scale = scale_from_amax(kernels.tensor_amax(x), fmt, power_of_two=power_of_two)
        elif scale.numel() != 1:
            raise ValueError(f"a 'tensor' scale must have one element, got shape {tuple(scale.shape)}")
        scale = scale.reshape(())
        data, _ = kernels.cast_scaled(x, scale, fmt, rounding, generator, seed=seed)
        return Quantized(_shape_data(data, x.shape, fmt), scale, fmt, "tensor", None, x.shape, x.dtype)

    x2d = x.reshape(rows, cols)
    if granularity == "row":
        tile = (1, cols if cols else 1)
        given = None
        if scale is not None:
            if scale.numel() != rows:
                raise ValueError(f"a 'row' scale needs {rows} elements (one per row), got shape {tuple(scale.shape)}")
            given = scale.reshape(rows, 1)
        if cols == 0:  # rows of no elements: empty codes, each row's scale 1 (or the given one)
            data, _ = kernels.cast_scaled(x, torch.ones((), device=x.device), fmt, rounding, generator, seed=seed)
            scales = given if given is not None else torch.ones(rows, 1, dtype=torch.float32, device=x.device)
        else:
            data, scales = kernels.quantize_groups(x2d, tile, fmt, given, power_of_two, rounding, generator, seed)
        out_scale = scales.reshape(*x.shape[:-1], 1) if x.dim() >= 1 else scales.reshape(())
        return Quantized(_shape_data(data, x.shape, fmt), out_scale, fmt, "row", None, x.shape, x.dtype)

    tile = normalize_block(block, fmt)
    # a tile past the matrix's edge holds the same elements as one clamped to it; the unclamped one
    # would be padded in memory (block=(1, 2**20) on a 64x64 tensor took +519 MB)
    tile = (min(tile[0], max(rows, 1)), min(tile[1], max(cols, 1)))
    n_tiles = (-(-rows // tile[0]), -(-cols // tile[1]))
    if fmt is E2M1:
        g = scale
        if g is None:
            g = torch_family.global_nvfp4_scale(kernels.tensor_amax(x), fmt)
        elif g.numel() != 1:
            raise ValueError("for NVFP4 (E2M1 blocks) `scale` is the one fp32 tensor scale")
        g = g.reshape(())
        # stochastic rounding rounds the block scale up: a clipped block max would bias it
        d_q, enc = torch_family.nvfp4_block_scales(kernels.group_amax(x2d, tile), g, fmt,
                                                   round_up=rounding == "stochastic")
        data, _ = kernels.quantize_groups(x2d, tile, fmt, enc, False, rounding, generator, seed)
        return Quantized(_shape_data(data, x.shape, fmt), g, fmt, "block", tile, x.shape, x.dtype, d_q)
    given = None
    if scale is not None:
        if tuple(scale.shape) != n_tiles:
            raise ValueError(f"a 'block' scale for tiles {tile} of a {rows}x{cols} matrix must have shape {n_tiles}")
        given = scale
    data, scales = kernels.quantize_groups(x2d, tile, fmt, given, power_of_two, rounding, generator, seed)
    return Quantized(_shape_data(data, x.shape, fmt), scales, fmt, "block", tile, x.shape, x.dtype)


def _check_seed(seed, generator, x: torch.Tensor) -> None:
    """A given ``seed`` is an int64 tensor of one element on ``x``'s device, and not given with a generator."""
    if seed is None:
        return
    if generator is not None:
        raise ValueError("quantize: pass generator= or seed= for stochastic rounding's bits, not both")
    if not isinstance(seed, torch.Tensor) or seed.dtype != torch.int64 or seed.numel() != 1:
        what = f"a {seed.dtype} tensor of shape {tuple(seed.shape)}" if isinstance(seed, torch.Tensor) else repr(seed)
        raise TypeError(f"quantize: seed must be an int64 tensor of one element (e.g. torch.tensor([7])), got {what}")
    if seed.device != x.device:
        raise ValueError(f"quantize: seed is on {seed.device}, x on {x.device}; put the seed on x's device")


def _checked_scale(scale, device: torch.device) -> torch.Tensor:
    """A given encode scale as fp32 on ``device``, after checking it is finite and > 0 everywhere
    (0 makes every code 0, NaN/Inf every code NaN or 0: wrong results, silently)."""
    if isinstance(scale, bool) or not isinstance(scale, (torch.Tensor, int, float)):
        raise TypeError(f"quantize: scale must be a tensor, a number or None, got {type(scale).__name__}")
    s = scale if isinstance(scale, torch.Tensor) else torch.tensor(float(scale))
    s = s.to(device=device, dtype=torch.float32)
    bad = ~(torch.isfinite(s) & (s > 0))
    if bool(bad.any()):
        value = s.reshape(-1)[bad.reshape(-1)][0].item()
        raise ValueError(f"quantize: scale must be finite and > 0 (codes = x * scale), got {value!r}"
                         + (f" in a scale of shape {tuple(s.shape)}" if s.dim() else ""))
    return s


def _quantize_mx(x, fmt, scale, block, rounding, generator, seed=None) -> Quantized:
    """OCP MX v1.0 (see the module doc): E8M0 block scales, then one cast of ``x / X`` per block."""
    if fmt.name not in MX_FORMATS:
        raise ValueError(f"MX element formats are {', '.join(MX_FORMATS)} (MXFP8 / MXFP4); got {fmt.name!r}")
    if scale is not None:
        raise ValueError("granularity='mx' computes its E8M0 block scales from each block; pass scale=None")
    tile = _mx_tile(block)
    if fmt.packed and (x.dim() == 0 or x.shape[-1] % 2):
        raise ValueError(f"MXFP4 packs two E2M1 codes per byte along the last dim, which must be even; "
                         f"got shape {tuple(x.shape)}")
    rows, cols = _matrix_shape(x.shape)
    x2d = x.reshape(rows, cols)
    codes, enc = torch_family.mx_block_scales(x2d, tile, fmt)
    data, _ = kernel_family(x.device).quantize_groups(x2d, tile, fmt, enc, False, rounding, generator, seed)
    return Quantized(_shape_data(data, x.shape, fmt), enc, fmt, "mx", tile, x.shape, x.dtype, codes)


def _shape_data(data: torch.Tensor, shape: torch.Size, fmt: Format) -> torch.Tensor:
    if fmt.packed:
        return data.reshape(*shape[:-1], shape[-1] // 2)
    return data.reshape(shape)


def quantize_delayed(
    x: torch.Tensor,
    state: DelayedScalingState,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
) -> Quantized:
    """Cast ``x`` with the scale held in ``state`` and record ``x``'s amax in the same pass.

    This is the delayed-scaling cast: one read of ``x`` yields both the codes and the amax that
    updates the history (``state.record``). With an empty history the cast scales from ``x``'s own
    amax instead (one extra amax pass, on the first step only).

    Args:
        x: floating-point tensor.
        state: the tensor's DelayedScalingState (its format is used).
        rounding: "nearest" or "stochastic".
        generator: torch.Generator for stochastic rounding.
    """
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"quantize_delayed expects a float16/bfloat16/float32/float64 tensor, got {x.dtype}")
    check_rounding(rounding)
    fmt = state.fmt
    if fmt.packed and (x.dim() == 0 or x.shape[-1] % 2):
        raise ValueError(f"E2M1 packs two codes per byte along the last dim, which must be even; got {tuple(x.shape)}")
    kernels = kernel_family(x.device)
    if bool(state.has_history):
        scale = state.scale.clone()
    else:
        scale = state.scale_for(kernels.tensor_amax(x))
    data, amax = kernels.cast_scaled(x, scale, fmt, rounding, generator, want_amax=True)
    state.record(amax)
    return Quantized(_shape_data(data, x.shape, fmt), scale, fmt, "tensor", None, x.shape, x.dtype)
