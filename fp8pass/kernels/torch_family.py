"""Torch kernel family: the vectorised CPU path and the reference for the Triton kernels.

Every function here computes exactly what its Triton twin in ``triton_family.py`` computes; the tests
compare the two bit for bit. Groups are 2-D tiles ``(br, bc)`` of a matrix view ``[rows, cols]`` of
the input (all leading dims folded into rows): per-row scaling is the tile ``(1, cols)``. A shape the
tile does not divide gets partial tiles at its edges, computed as zero padding (zeros change no amax).
"""

from __future__ import annotations

import torch

from ..numerics.casts import saturating_cast
from ..numerics.formats import E4M3, Format
from ..numerics.scaling import MAX_SCALE, scale_from_amax

__all__ = [
    "tensor_amax",
    "cast_scaled",
    "group_amax",
    "cast_groups",
    "expand_groups",
    "nvfp4_block_scales",
    "global_nvfp4_scale",
    "mx_block_scales",
    "quantize_groups",
]

# Elements per chunk of the chunked fp32 cast: large enough to amortise the Python loop, small enough
# that the fp32 staging buffer stays in cache.
CHUNK = 1 << 20


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as an fp32 scalar (NaN if x holds NaN; 0 for an empty tensor)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    lo, hi = torch.aminmax(x)
    return torch.maximum(lo.abs(), hi.abs()).to(torch.float32)


def cast_scaled(
    x: torch.Tensor,
    scale: torch.Tensor,
    fmt: Format,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
    want_amax: bool = False,
    seed: torch.Tensor | None = None,
):
    """``saturating_cast(x * scale)`` for a scalar scale; optionally also the amax of ``x``.
    ``seed``: stochastic rounding's bits from this int64 [1] tensor instead of ``generator``.

    Returns:
        (data, amax or None). ``x * scale`` is computed in fp32 (fp64 for fp64 inputs).
    """
    fast = rounding == "nearest" and fmt.torch_dtype is not None and x.dtype != torch.float64
    if not fast:
        amax = tensor_amax(x) if want_amax else None
        wide = x if x.dtype == torch.float64 else x.float()
        return saturating_cast(wide * scale.to(wide.dtype), fmt, rounding, generator, seed), amax
    # Chunked: one read of x, the fp32 staging buffer stays in cache, one write of the codes.
    flat = x.reshape(-1)
    out = torch.empty(flat.shape, dtype=fmt.torch_dtype, device=x.device)
    buf = torch.empty(min(CHUNK, flat.numel()), dtype=torch.float32, device=x.device)
    s = scale.to(torch.float32)
    amaxes = []
    for start in range(0, flat.numel(), CHUNK):
        part = flat[start : start + CHUNK]
        b = buf[: part.numel()]
        b.copy_(part)
        if want_amax:
            lo, hi = torch.aminmax(b)
            amaxes.append(torch.maximum(lo.abs(), hi.abs()))
        b.mul_(s).clamp_(-fmt.max, fmt.max)
        out[start : start + CHUNK].copy_(b)
    amax = None
    if want_amax:
        amax = torch.stack(amaxes).max() if amaxes else torch.zeros((), device=x.device)
    return out.view(x.shape), amax


def _tiles(x2d: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Zero-pad ``x2d`` to whole tiles and view it as [n_row_tiles, br, n_col_tiles, bc]."""
    br, bc = block
    rows, cols = x2d.shape
    pr, pc = (-rows) % br, (-cols) % bc
    if pr or pc:
        x2d = torch.nn.functional.pad(x2d, (0, pc, 0, pr))
    return x2d.reshape((rows + pr) // br, br, (cols + pc) // bc, bc)


def group_amax(x2d: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Per-tile max |x|, fp32 [n_row_tiles, n_col_tiles] (NaN where a tile holds NaN)."""
    if x2d.numel() == 0:
        br, bc = block
        return torch.zeros((-(-x2d.shape[0] // br), -(-x2d.shape[1] // bc)), device=x2d.device)
    return _tiles(x2d, block).abs().amax(dim=(1, 3)).to(torch.float32)


def expand_groups(values: torch.Tensor, block: tuple[int, int], shape: torch.Size) -> torch.Tensor:
    """Broadcast per-tile values [nr, nc] to a full [rows, cols] matrix."""
    br, bc = block
    full = values.repeat_interleave(br, dim=0).repeat_interleave(bc, dim=1)
    return full[: shape[0], : shape[1]]


def cast_groups(
    x2d: torch.Tensor,
    scales: torch.Tensor,
    block: tuple[int, int],
    fmt: Format,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
    seed: torch.Tensor | None = None,
) -> torch.Tensor:
    """``saturating_cast(x * scale_of_its_tile)`` for per-tile fp32 scales [nr, nc]; stochastic bits
    from ``generator`` or ``seed`` (``numerics.casts.encode``), counted over ``x2d``'s elements."""
    rows, cols = x2d.shape
    fast = rounding == "nearest" and fmt.torch_dtype is not None and x2d.dtype != torch.float64
    if not fast:
        wide = x2d if x2d.dtype == torch.float64 else x2d.float()
        t = _tiles(wide, block) * scales.to(wide.dtype)[:, None, :, None]
        t = t.reshape(t.shape[0] * t.shape[1], t.shape[2] * t.shape[3])[:rows, :cols]
        return saturating_cast(t, fmt, rounding, generator, seed)
    # Chunks of whole tile rows, so the fp32 temporary stays in cache; clamp in place, cast once.
    out = torch.empty((rows, cols), dtype=fmt.torch_dtype, device=x2d.device)
    br = block[0]
    step = max(br, (CHUNK // max(cols, 1)) // br * br)
    scales = scales.to(torch.float32)
    for r0 in range(0, rows, step):
        part = x2d[r0 : r0 + step]
        t = _tiles(part.float(), block) * scales[r0 // br : r0 // br + -(-part.shape[0] // br), None, :, None]
        t = t.reshape(t.shape[0] * t.shape[1], t.shape[2] * t.shape[3])[: part.shape[0], :cols]
        out[r0 : r0 + step] = t.clamp_(-fmt.max, fmt.max)
    return out


def nvfp4_block_scales(amax_blocks: torch.Tensor, global_scale: torch.Tensor, fmt: Format, round_up: bool = False):
    """Two-level NVFP4 scales from per-block amaxes and the fp32 tensor encode scale ``g``.

    The block decode scale ``d = amax_b / fmt.max * g`` is stored in E4M3 (saturating), so the block
    scales use E4M3's whole range; elements are encoded with ``g / d_q``. Rounded to nearest (even),
    ``d_q`` can land below ``d``, and then the block's largest element scales past ``fmt.max`` and is
    clipped. ``round_up`` takes the smallest E4M3 value ``>= d`` instead, so no element of the block
    scales past ``fmt.max`` (up to one fp32 rounding of the encode scale): what stochastic rounding
    needs to stay unbiased at the block maxima.

    Returns:
        (d_q as float8_e4m3fn codes [nr, nc], per-block fp32 encode scales [nr, nc]).
    """
    d = amax_blocks.to(torch.float32) / fmt.max * global_scale
    d_q = saturating_cast(d, E4M3)
    if round_up:
        # E4M3 codes of positive values grow with the value: one code up is the next value; never
        # past the largest finite code (d is at most 448 up to rounding; NaN stays NaN)
        below = d_q.to(torch.float32) < d
        codes = d_q.view(torch.uint8)
        codes = torch.where(below & (codes < E4M3.max_code), codes + 1, codes)
        d_q = codes.view(torch.float8_e4m3fn)
    d_val = d_q.to(torch.float32)
    encode = torch.where(d_val > 0, global_scale / d_val, torch.zeros_like(d_val))
    encode = torch.where(torch.isnan(d_val), torch.nan, encode)
    return d_q, encode


def global_nvfp4_scale(amax: torch.Tensor, fmt: Format) -> torch.Tensor:
    """fp32 tensor encode scale ``fmt.max * 448 / amax`` (1 for a zero or non-finite amax)."""
    amax = amax.to(torch.float32)
    ok = (amax > 0) & torch.isfinite(amax)
    scale = torch.clamp(torch.full_like(amax, fmt.max * E4M3.max) / amax, max=MAX_SCALE)
    return torch.where(ok, scale, torch.ones_like(amax))


def mx_block_scales(x2d: torch.Tensor, block: tuple[int, int], fmt: Format):
    """OCP MX v1.0 block scales: ``X = 2**(floor(log2(amax_b)) - fmt.emax)`` in E8M0.

    ``amax_b`` is taken in the input's own precision (fp64 stays fp64, so its floor(log2) is exact);
    the exponent is clamped to E8M0's range [-127, 127]. An all-zero block gets code 0 (2**-127; its
    elements are zeros either way); a block holding NaN or +-Inf gets the NaN code 0xFF and NaN
    encode scales, so all of its elements read back as NaN (E8M0 has no other non-finite value).

    Returns:
        (E8M0 codes uint8 [nr, nc], fp32 encode scales ``1 / X`` [nr, nc], exact powers of two).
    """
    br, bc = block
    n_tiles = (-(-x2d.shape[0] // br), -(-x2d.shape[1] // bc))
    if x2d.numel() == 0:
        return (torch.zeros(n_tiles, dtype=torch.uint8, device=x2d.device),
                torch.ones(n_tiles, dtype=torch.float32, device=x2d.device))
    wide = x2d if x2d.dtype in (torch.float32, torch.float64) else x2d.float()
    amax = _tiles(wide, block).abs().amax(dim=(1, 3))
    finite = torch.isfinite(amax)
    positive = finite & (amax > 0)
    _, exp = torch.frexp(torch.where(positive, amax, torch.ones_like(amax)))  # amax = m * 2**exp, m in [0.5, 1)
    e = torch.where(positive, exp.to(torch.int32) - 1 - fmt.emax, torch.full_like(exp, -127, dtype=torch.int32))
    e = torch.clamp(e, -127, 127)
    codes = torch.where(finite, e + 127, torch.full_like(e, 0xFF)).to(torch.uint8)
    k = -e  # encode scale 2**k, built from its bits (2**-127 is an fp32 subnormal)
    bits = torch.where(k >= -126, (k + 127) << 23, torch.full_like(k, 1 << 22))
    encode = torch.where(finite, bits.view(torch.float32), torch.full_like(amax, torch.nan, dtype=torch.float32))
    return codes, encode


def quantize_groups(
    x2d: torch.Tensor,
    block: tuple[int, int],
    fmt: Format,
    scales: torch.Tensor | None = None,
    power_of_two: bool = False,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
    seed: torch.Tensor | None = None,
):
    """Per-tile current scaling (amax -> scale -> cast) or a cast with given per-tile scales
    (``seed``: see :func:`cast_groups`).

    Returns:
        (data [rows, cols] codes, fp32 scales [nr, nc]).
    """
    if scales is None:
        scales = scale_from_amax(group_amax(x2d, block), fmt, power_of_two=power_of_two)
    return cast_groups(x2d, scales, block, fmt, rounding, generator, seed), scales
