"""Triton kernel family: fused amax + cast kernels, bit-identical to ``torch_family``.

Codes come from ``cast_codes``. On an sm_89+ NVIDIA GPU (``hardware_cast``) E4M3 and E5M2 take the
hardware conversion: Triton's fp32 -> float8e4nv / float8e5 lowers there to ``cvt.rn.satfinite.
{e4m3,e5m2}x2.f32`` (one SASS ``F2FP.SATFINITE`` per two elements), which rounds and saturates as the
reference does except for NaN's sign, fixed up in the kernel; stochastic rounding is done on the fp32
bits first (``stochastic_grid``) so that conversion is exact. Everywhere else (the interpreter, whose
fp32 -> fp8 conversion drops the mantissa carry and rounds ties away from zero: docs/background.md,
Traps; E2M1; E4M3_GAUDI) ``encode`` computes the codes with the integer algorithm documented in
``fp8pass/numerics/casts.py`` (``encode`` there is its torch reference). Both paths give the same codes
for the same random bits (tests/kernels/test_cast_hw.py, tests/gpu). Scales use the correctly rounded
``div_rn`` as torch does.

Kernels:
    ``_amax_kernel``          partial max |x| per program (NaN-propagating, like torch.aminmax).
    ``_cast_tensor_kernel``   codes of ``x * scale`` for one scale, optionally the partial amaxes of
                              x in the same read (delayed scaling records the amax while casting);
                              E2M1 codes are packed two per byte in the kernel (an odd element count
                              leaves the high nibble of the last byte 0 and reads nothing past the end).
    ``_quantize_tiles_kernel`` one program per group of tiles: amax over each tile, scale, cast
                              (current scaling, rows or blocks), or the cast alone with given scales;
                              a tile of more than 4096 elements (128 x 128 blocks) is one program
                              taking 32 of its rows at a time (amax, then a second, cached read to
                              cast), so no build spills, aligned or not.

Every index is int64 (``program_id`` widened before it is multiplied), so tensors of more than 2**31
elements are addressed exactly. Stochastic rounding draws its seed on the tensor's device (no host
synchronisation) and keys Philox by the element's 64-bit index: element i takes output ``i % 4`` at
counter ``i // 4``, one Philox call per four elements. ``_amax_kernel`` and
``_cast_tensor_kernel`` are autotuned (``triton.autotune``, keyed on the size class ``n.bit_length()``);
under Triton's interpreter each has one fixed config, so the CPU tests never benchmark.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..numerics.formats import E4M3, Format
from ..numerics.scaling import MAX_SCALE
from . import torch_family
from .triton_helpers import (
    INTERPRETING,
    abs_max,
    abs_max_2d,
    autotune,
    cast_codes,
    check_interpretable,
    encode,
    hardware_cast,
    max_propagating_nan,
    philox4,
    philox_at,
    philox_pick,
    random_bits_at,
    random_seed,
    size_class,
    tile_scale,
)

# Tiles of the tile kernel per program, in elements. The interpreter runs each program as numpy
# calls: large blocks amortise its per-program overhead.
_BLOCK = 1 << 16 if INTERPRETING else 1024

__all__ = ["tensor_amax", "cast_scaled", "cast_flat", "group_amax", "quantize_groups"]


_FLAT_CONFIGS = [triton.Config({"BLOCK": b}, num_warps=w)
                 for b, w in ((1024, 4), (2048, 4), (4096, 4), (4096, 8), (8192, 8))]
_FLAT_INTERPRET = triton.Config({"BLOCK": 1 << 16}, num_warps=4)
_MIN_FLAT_BLOCK = min(c.kwargs["BLOCK"] for c in ([_FLAT_INTERPRET] if INTERPRETING else _FLAT_CONFIGS))


@autotune(_FLAT_CONFIGS, key=["n_class"], interpret=_FLAT_INTERPRET)
@triton.jit
def _amax_kernel(x_ptr, partial_ptr, n, n_class, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(partial_ptr + pid, abs_max(x))


def _prune_flat_configs(configs, named_args, **kwargs):
    """The configs a cast may take: a stochastic FP8 one those of >= 32 elements per thread, which spread
    the program's fixed cost (index set-up, the amax reduction) thin next to its Philox and encoder; a
    stochastic E2M1 one (BLOCK counts bytes, two elements each) those of <= 32, which do not spill."""
    if not kwargs.get("STOCHASTIC"):
        return configs
    if kwargs.get("PACKED"):
        return [c for c in configs if 2 * c.kwargs["BLOCK"] <= 32 * 32 * c.num_warps] or configs[:1]
    return [c for c in configs if c.kwargs["BLOCK"] >= 32 * 32 * c.num_warps] or configs[-1:]


@autotune(_FLAT_CONFIGS, key=["n_class", "PACKED", "STOCHASTIC"], interpret=_FLAT_INTERPRET,
          prune_configs_by={"early_config_prune": _prune_flat_configs})
@triton.jit
def _cast_tensor_kernel(x_ptr, out_ptr, scale_ptr, partial_ptr, seed_ptr, n, n_class,
                        MBITS: tl.constexpr, BIAS: tl.constexpr, MAX_CODE: tl.constexpr,
                        NAN_CODE: tl.constexpr, SIGN_SHIFT: tl.constexpr, STOCHASTIC: tl.constexpr,
                        PACKED: tl.constexpr, WANT_AMAX: tl.constexpr, BLOCK: tl.constexpr, HW: tl.constexpr = 0):
    """Codes of ``x[i] * scale`` for i < n (one program per BLOCK codes or BLOCK packed bytes).

    ``code[i] = cast(x[i] * scale)`` (``cast_codes``; reference ``torch_family.cast_scaled``), and with
    WANT_AMAX ``partial[pid] = max |x|`` over the program's elements (NaN-propagating). Stochastic bits:
    element i takes output ``i % 4`` of Philox at counter ``i // 4`` (``random_bits4``: one call per
    four elements).
    """
    pid = tl.program_id(0).to(tl.int64)
    scale = tl.load(scale_ptr)
    seed = 0
    if STOCHASTIC:
        seed = tl.load(seed_ptr)
    if PACKED:
        # BLOCK output bytes, each holding elements 2i (low nibble) and 2i+1 (high nibble); with n odd
        # the last byte's high element does not exist: masked, so it reads as 0 and encodes as 0.
        pairs = pid * BLOCK + tl.arange(0, BLOCK)
        lo_offs = 2 * pairs
        lo_mask = lo_offs < n
        hi_mask = lo_offs + 1 < n
        lo = tl.load(x_ptr + lo_offs, mask=lo_mask, other=0.0).to(tl.float32)
        hi = tl.load(x_ptr + lo_offs + 1, mask=hi_mask, other=0.0).to(tl.float32)
        if WANT_AMAX:
            tl.store(partial_ptr + pid, max_propagating_nan(abs_max(lo), abs_max(hi)))
        r_lo = 0
        r_hi = 0
        if STOCHASTIC:
            # pairs 2k and 2k+1 hold elements 4k .. 4k+3: one Philox call serves both bytes
            r0, r1, r2, r3 = philox4(seed, pid * (BLOCK // 2) + tl.arange(0, BLOCK // 2))
            r_lo = (tl.reshape(tl.join(r0, r2), [BLOCK]) & 0x3FFFFFFF).to(tl.int32)
            r_hi = (tl.reshape(tl.join(r1, r3), [BLOCK]) & 0x3FFFFFFF).to(tl.int32)
        c_lo = encode(lo * scale, r_lo, MBITS, BIAS, MAX_CODE, NAN_CODE, SIGN_SHIFT, STOCHASTIC)
        c_hi = encode(hi * scale, r_hi, MBITS, BIAS, MAX_CODE, NAN_CODE, SIGN_SHIFT, STOCHASTIC)
        tl.store(out_ptr + pairs, (c_lo | (c_hi << 4)).to(tl.uint8), mask=lo_mask)
    else:
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if WANT_AMAX:
            tl.store(partial_ptr + pid, abs_max(x))
        rbits = 0
        if STOCHASTIC:
            rbits = philox_at(seed, offs)  # encode and stochastic_grid use at most 30 of the bits
        code = cast_codes(x * scale, rbits, MBITS, BIAS, MAX_CODE, NAN_CODE, SIGN_SHIFT, STOCHASTIC, HW)
        tl.store(out_ptr + offs, code.to(tl.uint8), mask=mask)


@triton.jit
def _quantize_tiles_kernel(x_ptr, out_ptr, scales_ptr, amax_ptr, seed_ptr, rows, cols, n_row_tiles, n_col_tiles,
                           TR: tl.constexpr, TC: tl.constexpr, TRP: tl.constexpr,
                           TCP: tl.constexpr, GR: tl.constexpr, GC: tl.constexpr,
                           MBITS: tl.constexpr, BIAS: tl.constexpr, MAX_CODE: tl.constexpr,
                           NAN_CODE: tl.constexpr, SIGN_SHIFT: tl.constexpr,
                           STOCHASTIC: tl.constexpr, PACKED: tl.constexpr, FMAX: tl.constexpr,
                           MAX_SCALE_C: tl.constexpr, POW2: tl.constexpr, NAN_SCALE: tl.constexpr,
                           MODE: tl.constexpr, HW: tl.constexpr = 0, SR4: tl.constexpr = False,
                           CR: tl.constexpr = 0):
    """GR x GC tiles of TR x TC elements of a contiguous [rows, cols] matrix, as one 4-D block; or (CR > 0)
    one tile per program, CR of its rows at a time (``_tile_in_row_chunks``).

    The block is [GR, TRP, GC, TCP] (TRP, TCP: TR, TC rounded up to powers of two, masked); the
    per-tile amax is a max over axes 3 and 1. MODE 0: amax -> scale -> cast (current scaling);
    1: cast with the given per-tile scales; 2: per-tile amax only. For PACKED (E2M1) formats TCP
    counts byte columns, each holding elements 2b (low nibble) and 2b+1 (high nibble) of the tile
    (``cols`` is even there: the caller checks). HW: the hardware RNE conversion (``cast_codes``).
    Stochastic bits are those of the flat cast for the element's flat index (``philox_at``; SR4, when
    TC and cols are multiples of 4: one Philox call per four elements of a row).
    """
    pid_r = tl.program_id(0).to(tl.int64)
    pid_c = tl.program_id(1).to(tl.int64)
    if CR > 0:
        _tile_in_row_chunks(x_ptr, out_ptr, scales_ptr, amax_ptr, seed_ptr, rows, cols, n_col_tiles, pid_r, pid_c,
                            TR, TC, TCP, CR, MBITS, BIAS, MAX_CODE, NAN_CODE, SIGN_SHIFT, STOCHASTIC, FMAX,
                            MAX_SCALE_C, POW2, NAN_SCALE, MODE, HW, SR4)
        return
    gr = pid_r * GR + tl.arange(0, GR)[:, None, None, None]
    gc = pid_c * GC + tl.arange(0, GC)[None, None, :, None]
    i = tl.arange(0, TRP)[None, :, None, None]
    j = tl.arange(0, TCP)[None, None, None, :]
    r = gr * TR + i
    seed = 0
    if STOCHASTIC:
        seed = tl.load(seed_ptr)
    if PACKED:
        c = gc * TC + 2 * j
        m = (i < TR) & (2 * j < TC) & (r < rows) & (c < cols) & (gr < n_row_tiles) & (gc < n_col_tiles)
        m_hi = m & (c + 1 < cols)
        lo = tl.load(x_ptr + r * cols + c, mask=m, other=0.0).to(tl.float32)
        hi = tl.load(x_ptr + r * cols + c + 1, mask=m_hi, other=0.0).to(tl.float32)
        a = max_propagating_nan(tl.abs(lo), tl.abs(hi))
    else:
        c = gc * TC + j
        m = (i < TR) & (j < TC) & (r < rows) & (c < cols) & (gr < n_row_tiles) & (gc < n_col_tiles)
        x = tl.load(x_ptr + r * cols + c, mask=m, other=0.0).to(tl.float32)
        a = tl.abs(x)
    tiles_r = pid_r * GR + tl.arange(0, GR)[:, None]
    tiles_c = pid_c * GC + tl.arange(0, GC)[None, :]
    tile = tiles_r * n_col_tiles + tiles_c
    tile_ok = (tiles_r < n_row_tiles) & (tiles_c < n_col_tiles)
    if MODE != 1:
        has_nan = tl.max(tl.max((a != a).to(tl.int32), axis=3), axis=1)
        amax = tl.max(tl.max(a, axis=3), axis=1)
        amax = tl.where(has_nan > 0, float("nan"), amax)
        if MODE == 2:
            tl.store(amax_ptr + tile, amax, mask=tile_ok)
            return
        scale = tile_scale(amax, FMAX, MAX_SCALE_C, POW2, NAN_SCALE)
        tl.store(scales_ptr + tile, scale, mask=tile_ok)
    else:
        scale = tl.load(scales_ptr + tile, mask=tile_ok, other=1.0)
    s = scale[:, None, :, None]
    if PACKED:
        r_lo = 0
        r_hi = 0
        if STOCHASTIC:
            r_lo = random_bits_at(seed, r * cols + c)
            r_hi = random_bits_at(seed, r * cols + c + 1)
        c_lo = encode(lo * s, r_lo, MBITS, BIAS, MAX_CODE, NAN_CODE, SIGN_SHIFT, STOCHASTIC)
        c_hi = encode(hi * s, r_hi, MBITS, BIAS, MAX_CODE, NAN_CODE, SIGN_SHIFT, STOCHASTIC)
        tl.store(out_ptr + r * (cols // 2) + c // 2, (c_lo | (c_hi << 4)).to(tl.uint8), mask=m)
    else:
        rbits = 0
        if STOCHASTIC:
            if SR4:  # TC and cols multiples of 4: the four elements of a quad share one Philox call
                rbits = philox_pick(seed, (r * cols + gc * TC) // 4 + j // 4, j % 4)
            else:
                rbits = philox_at(seed, r * cols + c)
        code = cast_codes(x * s, rbits, MBITS, BIAS, MAX_CODE, NAN_CODE, SIGN_SHIFT, STOCHASTIC, HW)
        tl.store(out_ptr + r * cols + c, code.to(tl.uint8), mask=m)


@triton.jit
def _tile_in_row_chunks(x_ptr, out_ptr, scales_ptr, amax_ptr, seed_ptr, rows, cols, n_col_tiles, pid_r, pid_c,
                        TR: tl.constexpr, TC: tl.constexpr, TCP: tl.constexpr, CR: tl.constexpr,
                        MBITS: tl.constexpr, BIAS: tl.constexpr, MAX_CODE: tl.constexpr, NAN_CODE: tl.constexpr,
                        SIGN_SHIFT: tl.constexpr, STOCHASTIC: tl.constexpr, FMAX: tl.constexpr,
                        MAX_SCALE_C: tl.constexpr, POW2: tl.constexpr, NAN_SCALE: tl.constexpr, MODE: tl.constexpr,
                        HW: tl.constexpr, SR4: tl.constexpr):
    """Tile ``(pid_r, pid_c)`` of ``_quantize_tiles_kernel`` (unpacked formats), ``CR`` rows at a time: its
    amax over the chunks, then each chunk cast (a second read, from the cache). A 128 x 128 tile held whole
    (32 elements a thread) spilled in builds without alignment (scalar loads: an address per element)."""
    i = tl.arange(0, CR)[:, None]
    j = tl.arange(0, TCP)[None, :]
    c = pid_c * TC + j
    in_cols = (j < TC) & (c < cols)
    tile = pid_r * n_col_tiles + pid_c
    if MODE != 1:
        amax = tl.zeros([], tl.float32)
        for r0 in range(0, TR, CR):
            r = pid_r * TR + r0 + i
            m = (r0 + i < TR) & (r < rows) & in_cols
            x = tl.load(x_ptr + r * cols + c, mask=m, other=0.0).to(tl.float32)
            amax = max_propagating_nan(amax, abs_max_2d(x))
        if MODE == 2:
            tl.store(amax_ptr + tile, amax)
            return
        scale = tile_scale(amax, FMAX, MAX_SCALE_C, POW2, NAN_SCALE)
        tl.store(scales_ptr + tile, scale)
    else:
        scale = tl.load(scales_ptr + tile)
    seed = 0
    if STOCHASTIC:
        seed = tl.load(seed_ptr)
    for r0 in range(0, TR, CR):
        r = pid_r * TR + r0 + i
        m = (r0 + i < TR) & (r < rows) & in_cols
        x = tl.load(x_ptr + r * cols + c, mask=m, other=0.0).to(tl.float32)
        rbits = 0
        if STOCHASTIC:
            if SR4:
                rbits = philox_pick(seed, (r * cols + pid_c * TC) // 4 + j // 4, j % 4)
            else:
                rbits = philox_at(seed, r * cols + c)
        code = cast_codes(x * scale, rbits, MBITS, BIAS, MAX_CODE, NAN_CODE, SIGN_SHIFT, STOCHASTIC, HW)
        tl.store(out_ptr + r * cols + c, code.to(tl.uint8), mask=m)


@functools.lru_cache(maxsize=None)
def _fmt_args(fmt: Format) -> dict:
    return dict(
        MBITS=fmt.mbits,
        BIAS=fmt.bias,
        MAX_CODE=fmt.max_code,
        NAN_CODE=fmt.nan_code if fmt.nan_code is not None else 0,
        SIGN_SHIFT=fmt.bits - 1,
    )


def _seed_arg(rounding: str, generator, device, unused: torch.Tensor, seed: torch.Tensor | None = None) -> torch.Tensor:
    """The kernels' seed pointer: for stochastic rounding ``seed`` (int64 [1]) or a drawn one; otherwise
    any tensor (unread)."""
    if rounding != "stochastic":
        return unused
    return seed if seed is not None else random_seed(generator, device)


def _storage(codes: torch.Tensor, fmt: Format) -> torch.Tensor:
    return codes.view(fmt.torch_dtype) if fmt.torch_dtype is not None else codes


def _supported(x: torch.Tensor) -> bool:
    # fp64 keeps its exact fp64 arithmetic in the torch family (the kernels compute in fp32).
    return x.dtype != torch.float64 and x.numel() > 0


def _check_even(x: torch.Tensor, fmt: Format) -> None:
    """E2M1 packs along the last dim: the same error as the torch family's ``pack_e2m1``."""
    if fmt.packed and (x.dim() == 0 or x.shape[-1] % 2):
        raise ValueError(f"E2M1 packing needs an even last dimension, got shape {tuple(x.shape)}")


def _programs_used(kernel, n: int) -> int:
    """Programs the autotuned flat ``kernel`` just ran over n work items (its chosen BLOCK)."""
    return triton.cdiv(n, kernel.best_config.kwargs["BLOCK"])


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as an fp32 scalar: per-program partial maxima, then one small torch reduction."""
    if not _supported(x):
        return torch_family.tensor_amax(x)
    check_interpretable(x.device)
    flat = x.contiguous().view(-1)
    n = flat.numel()
    partial = torch.empty(triton.cdiv(n, _MIN_FLAT_BLOCK), dtype=torch.float32, device=x.device)
    _amax_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](flat, partial, n, size_class(n))
    return partial[: _programs_used(_amax_kernel, n)].max()


def cast_flat(flat: torch.Tensor, scale: torch.Tensor, fmt: Format, rounding="nearest", generator=None,
              want_amax=False, seed=None):
    """Codes of a contiguous 1-D ``flat * scale``: uint8 [n] or, for E2M1, [ceil(n / 2)] packed bytes
    (an odd n leaves the last byte's high nibble 0); and the amax of ``flat`` if ``want_amax``."""
    check_interpretable(flat.device)
    n = flat.numel()
    nout = triton.cdiv(n, 2) if fmt.packed else n
    out = torch.empty(nout, dtype=torch.uint8, device=flat.device)
    partial = torch.empty(triton.cdiv(nout, _MIN_FLAT_BLOCK) if want_amax else 1, dtype=torch.float32,
                          device=flat.device)
    s = scale.to(device=flat.device, dtype=torch.float32).reshape(1)
    _cast_tensor_kernel[lambda meta: (triton.cdiv(nout, meta["BLOCK"]),)](
        flat, out, s, partial, _seed_arg(rounding, generator, flat.device, s, seed), n, size_class(n),
        STOCHASTIC=rounding == "stochastic", PACKED=fmt.packed, WANT_AMAX=want_amax, **_fmt_args(fmt),
        HW=0 if fmt.packed else hardware_cast(flat.device, fmt),
    )
    amax = partial[: _programs_used(_cast_tensor_kernel, nout)].max() if want_amax else None
    return out, amax


def cast_scaled(x, scale, fmt: Format, rounding="nearest", generator=None, want_amax=False, seed=None):
    """Codes of ``x * scale`` (one scale); with ``want_amax``, the amax of x from the same read.
    ``seed``: stochastic rounding's seed (int64 [1] on x's device) instead of a draw from ``generator``."""
    if not _supported(x):
        return torch_family.cast_scaled(x, scale, fmt, rounding, generator, want_amax, seed)
    _check_even(x, fmt)
    out, amax = cast_flat(x.contiguous().view(-1), scale, fmt, rounding, generator, want_amax, seed)
    shape = (*x.shape[:-1], x.shape[-1] // 2) if fmt.packed else x.shape
    return _storage(out, fmt).view(shape), amax


# A tile of more elements is taken a block of rows at a time (``_tile_in_row_chunks``), about this many.
_CHUNK_ELEMENTS = 4096


def _row_chunk(tile: tuple[int, int], packed: bool) -> int:
    """CR of the tile kernel: rows per step of a tile larger than ``_CHUNK_ELEMENTS`` (unpacked formats;
    a power of two), 0 for tiles taken whole."""
    trp, tcp, _, _ = _tiles_per_program(tile, packed)
    if packed or trp * tcp <= _CHUNK_ELEMENTS:
        return 0
    return max(1, _CHUNK_ELEMENTS // tcp)


def _tile_warps(tile: tuple[int, int], packed: bool) -> int:
    """Warps of a tile-kernel program: <= 32 elements per thread (16 for a tile taken in row chunks)."""
    trp, tcp, gr, gc = _tiles_per_program(tile, packed)
    cr = _row_chunk(tile, packed)
    if cr:
        return max(4, min(16, cr * tcp // (16 * 32)))
    return max(4, min(16, gr * gc * trp * tcp // (32 * 32)))


def _tiles_per_program(tile: tuple[int, int], packed: bool) -> tuple[int, int, int, int]:
    """(TRP, TCP, GR, GC): padded tile block and how many tiles one program takes (~_BLOCK elements)."""
    tr, tc = tile
    trp = triton.next_power_of_2(tr)
    tcp = triton.next_power_of_2(max(tc // 2 if packed else tc, 1))
    per_tile = trp * tcp
    budget = max(1, _BLOCK // per_tile)
    gc = min(budget, 16)
    gr = max(1, budget // gc)
    return trp, tcp, gr, gc


def _launch_tiles(x2d, tile, fmt, mode, scales=None, power_of_two=False, rounding="nearest", generator=None,
                  seed=None):
    check_interpretable(x2d.device)
    rows, cols = x2d.shape
    nr, nc = -(-rows // tile[0]), -(-cols // tile[1])
    x2d = x2d.contiguous()
    out = torch.empty((rows, cols // 2 if fmt.packed else cols), dtype=torch.uint8, device=x2d.device)
    if scales is None:
        scales = torch.empty((nr, nc), dtype=torch.float32, device=x2d.device)
    else:
        scales = scales.to(torch.float32).contiguous()
    amax = torch.empty((nr, nc), dtype=torch.float32, device=x2d.device)
    trp, tcp, gr, gc = _tiles_per_program(tile, fmt.packed)
    cr = _row_chunk(tile, fmt.packed)
    if cr:
        gr = gc = 1
    grid = (triton.cdiv(nr, gr), triton.cdiv(nc, gc))
    _quantize_tiles_kernel[grid](
        x2d, out, scales, amax, _seed_arg(rounding, generator, x2d.device, amax, seed), rows, cols, nr, nc,
        TR=tile[0], TC=tile[1], TRP=trp, TCP=tcp, GR=gr, GC=gc, STOCHASTIC=rounding == "stochastic",
        PACKED=fmt.packed, FMAX=fmt.max, MAX_SCALE_C=MAX_SCALE, POW2=power_of_two,
        NAN_SCALE=fmt.nan_code is None, MODE=mode, **_fmt_args(fmt),
        HW=0 if mode == 2 else hardware_cast(x2d.device, fmt),
        SR4=rounding == "stochastic" and tile[1] % 4 == 0 and cols % 4 == 0, CR=cr, num_warps=_tile_warps(tile, fmt.packed),
    )
    return out, scales, amax


def group_amax(x2d: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Per-tile max |x| [nr, nc] (NaN where a tile holds NaN)."""
    if not _supported(x2d):
        return torch_family.group_amax(x2d, block)
    return _launch_tiles(x2d, block, E4M3, mode=2)[2]


def quantize_groups(x2d, block, fmt: Format, scales=None, power_of_two=False, rounding="nearest", generator=None,
                    seed=None):
    """Fused per-tile amax -> scale -> cast, or the cast with given per-tile scales. ``seed``: stochastic
    rounding's Philox key (int64 [1] on x's device) instead of a draw from ``generator``."""
    if not _supported(x2d):
        return torch_family.quantize_groups(x2d, block, fmt, scales, power_of_two, rounding, generator, seed)
    if fmt.packed and block[1] % 2:
        raise ValueError(f"E2M1 tiles need an even column count to pack two codes per byte, got {block}")
    _check_even(x2d, fmt)
    out, scales, _ = _launch_tiles(x2d, block, fmt, 1 if scales is not None else 0, scales, power_of_two,
                                   rounding, generator, seed)
    return _storage(out, fmt), scales
