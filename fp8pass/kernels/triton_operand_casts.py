"""Triton kernels of the runtime ops (GPU; on CPU tensors they run under ``TRITON_INTERPRET=1``).

=============================  ===========================================================================
``_swiglu_colamax_kernel``     per-tile column max of ``|silu(gate) * up|`` (channel smoothing's input);
                               ``INPUT_MAX``: per-tile max ``|gate|`` and ``|up|`` from the same read
``_swiglu_cast_kernel``        one read of gate/up: ``A`` = ``silu(g)*u`` (``*c[col]`` channel,
                               ``silu(g)*(u/r[row])`` token), per-tile max ``|A|``, E4M3 codes of
                               ``A * s`` (one write, 1 byte/element); ``INPUTS``: the codes of the saved
                               gate and up copies too (exact: ``saturating_cast(g * s_g)``);
                               ``TRANSPOSE``: A's codes transposed too (``[F, T]``, the wgrad operand)
``_transpose_cast_kernel``     one read of ``x``: codes of ``x * s`` (nearest or stochastic) in both layouts
                               (``[R, C]`` and ``[C, R]``; the transposed copy is the wgrad / dgrad GEMM
                               operand that ``_scaled_mm`` wants column-major) and per-tile max ``|x|``;
                               conditionally (a device flag) as the recast of a delayed-scaled cast;
                               ``DIVIDE``: of ``x / d[col]`` (``W_down / c``, exact as torch divides)
=============================  ===========================================================================

Codes come from ``cast_codes`` of ``fp8pass.kernels.triton_family``, the one in-kernel cast: on
an sm_89+ NVIDIA GPU the hardware conversion (``cvt.rn.satfinite``, NaN's sign fixed up; stochastic
rounding done on the fp32 bits first), elsewhere the integer encoder ``encode`` (the algorithm of
``fp8pass.numerics.casts.encode``; Triton's own fp32 -> fp8 conversion is wrong in the interpreter:
docs/background.md, Traps). Both are bit-identical to ``saturating_cast`` and to each other.

What is exact and what is bounded against the torch references (``fp8pass.numerics``'s
``saturating_cast`` / ``quantize`` and ``fp8pass.runtime.swiglu.swiglu_operand``):

* ``_transpose_cast_kernel``: codes and amax bit-identical (tests/kernels/test_runtime_triton.py on CPU,
  tests/gpu on CUDA).
* the SwiGLU kernels: ``silu(g) = g / (1 + exp(-g))`` uses ``tl.exp``, which is an approximate
  ``ex2`` on NVIDIA GPUs (numpy's ``exp`` under the interpreter) while torch uses its own ``exp``: the
  fp32 values of ``A`` can differ in the last bits, so a value within a few ulp of an FP8 rounding
  boundary may take the neighbouring code. The tests bound it: every code within one step of the
  reference, fewer than 0.2% of codes differ, amax within 1e-6 relative. Where silu is exact in both
  (``g = 0``, large ``g``) the codes are bit-identical, and that is tested too.

Every index is int64 (``program_id`` widened first). ``_transpose_cast_kernel`` is autotuned over
tile shapes (``triton.autotune``, keyed on the size classes of R and C; one fixed tile under the
interpreter); its transposed copy is transposed in registers (``tl.trans``) so that both stores write
contiguous runs of memory.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..numerics.formats import E4M3, Format
from ..numerics.scaling import scale_from_amax
from . import torch_family, triton_scaling
from .triton_helpers import (  # the one exact in-kernel cast, shared tuning helpers
    abs_max_2d,
    autotune,
    cast_codes,
    check_interpretable,
    hardware_cast,
    philox_pick,
    random_seed,
    size_class,
)

# the scale a delayed cast's last program picks; W_down / c divided in the cast
from .triton_scaling import divided_in, reciprocal_rn, scale_by_last_program

__all__ = ["swiglu_colamax", "swiglu_amax", "swiglu_cast", "swiglu_cast_with_inputs", "transpose_cast", "MODES"]

MODES = {"none": 0, "channel": 1, "token": 2}


@triton.jit
def _silu(g):
    """silu in fp32; ``tl.exp`` is approximate on GPUs, so the last bits may differ from torch's."""
    return g / (1.0 + tl.exp(-g))


@triton.jit
def _gate_up_tile(g_ptr, u_ptr, T, F, BT: tl.constexpr, BF: tl.constexpr):
    """This program's [BT, BF] tile of gate and up ([T, F] row-major) in fp32, zeros past the edges,
    with its program ids (int64), row and column indices, mask and offsets."""
    pid_t, pid_f = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    rows = pid_t * BT + tl.arange(0, BT)
    cols = pid_f * BF + tl.arange(0, BF)
    mask = (rows[:, None] < T) & (cols[None, :] < F)
    offs = rows[:, None] * F + cols[None, :]
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return pid_t, pid_f, rows, cols, mask, offs, g, u


@triton.jit
def _swiglu_colamax_kernel(g_ptr, u_ptr, out_ptr, gu_ptr, T, F, BT: tl.constexpr, BF: tl.constexpr,
                           INPUT_MAX: tl.constexpr = False):
    """out[pid_t, col] = max over this tile's rows of |silu(g) * u| (NaN-propagating); INPUT_MAX: also
    max |g| and max |u| of the tile at ``gu[tile]`` and ``gu[tiles + tile]`` (the saved copies' amaxes)."""
    pid_t, pid_f, rows, cols, mask, offs, g, u = _gate_up_tile(g_ptr, u_ptr, T, F, BT, BF)
    h = _silu(g) * u
    m = tl.max(tl.abs(h), axis=0)
    nan = tl.max((h != h).to(tl.int32), axis=0)
    m = tl.where(nan > 0, float("nan"), m)
    tl.store(out_ptr + pid_t * F + cols, m, mask=cols < F)
    if INPUT_MAX:
        tile = pid_t * tl.num_programs(1) + pid_f
        tl.store(gu_ptr + tile, abs_max_2d(g))
        tl.store(gu_ptr + tl.num_programs(0) * tl.num_programs(1) + tile, abs_max_2d(u))


@triton.jit
def _swiglu_cast_kernel(g_ptr, u_ptr, c_ptr, r_ptr, scale_ptr, out_ptr, amax_ptr, g_scale_ptr, u_scale_ptr,
                        g_out_ptr, u_out_ptr, out_t_ptr, T, F,
                        MODE: tl.constexpr, STORE: tl.constexpr, BT: tl.constexpr, BF: tl.constexpr,
                        MBITS: tl.constexpr, BIAS: tl.constexpr, MAX_CODE: tl.constexpr,
                        NAN_CODE: tl.constexpr, HW: tl.constexpr = 0, INPUTS: tl.constexpr = False,
                        TRANSPOSE: tl.constexpr = False):
    """A tile of the down GEMM operand: A, max |A| (per program) and, if STORE, codes of A * scale;
    INPUTS (with STORE): also the codes of ``g * g_scale`` and ``u * u_scale`` (the saved copies of gate
    and up, from the same read: what ``transpose_cast`` of each gives); TRANSPOSE (with STORE): also A's
    codes transposed, ``[F, T]`` row-major at ``out_t`` (the wgrad GEMM's operand, as ``transpose_cast``
    writes its transposed copy)."""
    pid_t, pid_f, rows, cols, mask, offs, g, u = _gate_up_tile(g_ptr, u_ptr, T, F, BT, BF)
    if MODE == 2:
        r = tl.load(r_ptr + rows, mask=rows < T, other=1.0)
        a = _silu(g) * (u / r[:, None])
    else:
        a = _silu(g) * u
        if MODE == 1:
            c = tl.load(c_ptr + cols, mask=cols < F, other=1.0)
            a = a * c[None, :]
    tl.store(amax_ptr + pid_t * tl.num_programs(1) + pid_f, abs_max_2d(a))
    if STORE:
        s = tl.load(scale_ptr)
        code = cast_codes(a * s, 0, MBITS, BIAS, MAX_CODE, NAN_CODE, 7, False, HW)
        tl.store(out_ptr + offs, code.to(tl.uint8), mask=mask)
        if TRANSPOSE:  # [BF, BT] in registers: consecutive lanes write consecutive bytes of a row of A^T
            mask_t = (cols[:, None] < F) & (rows[None, :] < T)
            tl.store(out_t_ptr + cols[:, None] * T + rows[None, :], tl.trans(code.to(tl.uint8)), mask=mask_t)
        if INPUTS:
            g_code = cast_codes(g * tl.load(g_scale_ptr), 0, MBITS, BIAS, MAX_CODE, NAN_CODE, 7, False, HW)
            tl.store(g_out_ptr + offs, g_code.to(tl.uint8), mask=mask)
            u_code = cast_codes(u * tl.load(u_scale_ptr), 0, MBITS, BIAS, MAX_CODE, NAN_CODE, 7, False, HW)
            tl.store(u_out_ptr + offs, u_code.to(tl.uint8), mask=mask)


# Tiles of 2-8K elements, 16-32 per thread (64 x 64 on 4 warps spills unaligned with triton 3.6). A
# stochastic cast holds four Philox states per quad in flight: it keeps the tiles of at most 16
# elements per thread, so no config spills, in the aligned build or not (benchmarks/gpu_static.py).
_TILE_CONFIGS = [triton.Config({"BR": br, "BC": bc}, num_warps=w)
                 for br, bc, w in ((32, 64, 4), (64, 64, 8), (64, 128, 8), (128, 64, 8))]
_TILE_INTERPRET = triton.Config({"BR": 32, "BC": 64}, num_warps=4)


def _prune_tile_configs(configs, named_args, **kwargs):
    """The configs a launch may take: for stochastic rounding those of <= 16 elements per thread."""
    if not kwargs.get("STOCHASTIC"):
        return configs
    return [c for c in configs if c.kwargs["BR"] * c.kwargs["BC"] <= 16 * 32 * c.num_warps] or configs[:1]


def _max_programs(r: int, c: int) -> int:
    """Programs of the config with the most tiles over [r, c]: room for every config's partial amaxes."""
    return max(triton.cdiv(r, k.kwargs["BR"]) * triton.cdiv(c, k.kwargs["BC"]) for k in _TILE_CONFIGS + [_TILE_INTERPRET])


@autotune(_TILE_CONFIGS, key=["r_class", "c_class", "TRANSPOSE", "STOCHASTIC", "CONDITIONAL", "DELAYED", "DIVIDE",
                              "ROW_MAJOR"],
          interpret=_TILE_INTERPRET, prune_configs_by={"early_config_prune": _prune_tile_configs})
@triton.jit
def _transpose_cast_kernel(x_ptr, scale_ptr, out_ptr, out_t_ptr, amax_ptr, seed_ptr, flag_ptr, div_ptr, R, C, r_class,
                           c_class, counter_ptr, steps_ptr, skipped_ptr, guard_ptr, inv0_in, inv1_in, amax_out,
                           scale_out, inv_out, recast_out, inv0_out, inv1_out,
                           TRANSPOSE: tl.constexpr, STOCHASTIC: tl.constexpr, CONDITIONAL: tl.constexpr,
                           MBITS: tl.constexpr, BIAS: tl.constexpr, MAX_CODE: tl.constexpr, NAN_CODE: tl.constexpr,
                           BR: tl.constexpr, BC: tl.constexpr, HW: tl.constexpr = 0, SR4: tl.constexpr = False,
                           DELAYED: tl.constexpr = False, N_INVERT: tl.constexpr = 0, TARGET: tl.constexpr = 1.0,
                           FMT_MAX: tl.constexpr = 1.0, MAX_SCALE_C: tl.constexpr = 1.0, HUGE: tl.constexpr = 1.0,
                           POW2: tl.constexpr = False, NAN_SCALE: tl.constexpr = False, RBLOCK: tl.constexpr = 1024,
                           DIVIDE: tl.constexpr = False, ROW_MAJOR: tl.constexpr = True):
    """codes of x * s stored as [R, C] (and, if TRANSPOSE, as [C, R]), and max |x| of the tile.
    Without ROW_MAJOR (with TRANSPOSE) only the [C, R] copy is stored (a recast whose GEMM reads it alone).

    ``code = cast(x * s)`` (``cast_codes``; HW: the hardware RNE conversion), reference
    ``saturating_cast(x * s)``; ``amax[tile] = max |x|`` over the tile, NaN-propagating. STOCHASTIC:
    the flat cast's random bits for the element's flat index ``r * C + c`` (output ``(r * C + c) % 4``
    of Philox at counter ``(r * C + c) // 4``), so the codes are the flat stochastic cast's for the same
    seed; SR4 (``C % 4 == 0``): four elements of a row share one Philox call, otherwise each takes one.
    CONDITIONAL: only where ``*flag_ptr != 0``; otherwise every load and store is masked off (no memory
    traffic: a launch that does nothing) and no amax is written.
    DELAYED (a cast with a delayed-scaling state's held scale ``*scale_ptr``): the program that stores
    its tile's max last (an acquire-release arrival counter, reset by it) reduces every tile's max
    and runs the scale epilogue (``triton_scaling.scale_by_last_program``): the amax, the scale the cast should have used
    (``scale_to_cast``), its decode scale, the recast flag, ``1 / inv_in``; one launch less per cast.
    DIVIDE: ``x`` is ``x / div[c]`` as torch divides in x's dtype (fp32 or bf16; ``div`` powers of two:
    ``triton_scaling.divided_in``): Smooth-SwiGLU's ``B = W_down / c`` cast without writing ``B`` out first.
    """
    pid_r, pid_c = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    rows = pid_r * BR + tl.arange(0, BR)
    cols = pid_c * BC + tl.arange(0, BC)
    r_end = R
    if CONDITIONAL:  # no rows at all unless the flag is set
        r_end = tl.where(tl.load(flag_ptr) != 0, R, 0)
    mask = (rows[:, None] < r_end) & (cols[None, :] < C)
    mask_t = (cols[:, None] < C) & (rows[None, :] < r_end)
    x = tl.load(x_ptr + rows[:, None] * C + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if DIVIDE:
        inv = reciprocal_rn(tl.load(div_ptr + cols, mask=cols < C, other=1.0))
        x = divided_in(x, inv[None, :], x_ptr.dtype.element_ty)
    if not CONDITIONAL:
        tl.store(amax_ptr + pid_r * tl.num_programs(1) + pid_c, abs_max_2d(x))
        if DELAYED:
            scale_by_last_program(amax_ptr, tl.num_programs(0) * tl.num_programs(1), counter_ptr, scale_ptr,
                                  steps_ptr, skipped_ptr, guard_ptr, inv0_in, inv1_in, amax_out, scale_out, inv_out,
                                  recast_out, inv0_out, inv1_out, N_INVERT, True, TARGET, FMT_MAX, MAX_SCALE_C, HUGE,
                                  POW2, NAN_SCALE, RBLOCK)
    rbits = 0
    if STOCHASTIC:
        if SR4:  # C % 4 == 0: quads never straddle rows, and the four of a quad share one Philox call
            quad = (rows[:, None] * C + pid_c * BC) // 4 + (tl.arange(0, BC) // 4)[None, :]
            lane = (tl.arange(0, BC) % 4)[None, :]
        else:
            flat = rows[:, None] * C + cols[None, :]
            quad = flat >> 2
            lane = flat & 3
        rbits = philox_pick(tl.load(seed_ptr), quad, lane)
    v = cast_codes(x * tl.load(scale_ptr), rbits, MBITS, BIAS, MAX_CODE, NAN_CODE, 7, STOCHASTIC, HW).to(tl.uint8)
    if ROW_MAJOR:
        tl.store(out_ptr + rows[:, None] * C + cols[None, :], v, mask=mask)
    if TRANSPOSE:
        # [BC, BR] in registers: consecutive lanes write consecutive bytes of a row of the [C, R] copy.
        tl.store(out_t_ptr + cols[:, None] * R + rows[None, :], tl.trans(v), mask=mask_t)


@functools.lru_cache(maxsize=None)
def _fmt_kw(fmt: Format) -> dict:
    return dict(MBITS=fmt.mbits, BIAS=fmt.bias, MAX_CODE=fmt.max_code, NAN_CODE=fmt.nan_code)


def _reduce_amax(partial: torch.Tensor) -> torch.Tensor:
    if partial.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=partial.device)
    return torch_family.tensor_amax(partial)  # NaN-propagating max of the partials


def swiglu_colamax(gate2d: torch.Tensor, up2d: torch.Tensor, bt: int = 32, bf: int = 64,
                   partials: bool = False, input_maxima: bool = False):
    """fp32 [F]: max over tokens of ``|silu(gate) * up|`` per channel; with ``partials`` the per-tile
    maxima [token tiles, F] instead (``triton_scaling.channel_scales`` reduces them). ``input_maxima``
    (with ``partials``, T and F > 0): returns ``(partials, maxima)``, ``maxima`` fp32 [2, tiles] the
    per-tile max ``|gate|`` and ``|up|`` from the same read (``triton_scaling.smooth_scales``)."""
    t, f = gate2d.shape
    check_interpretable(gate2d.device)
    nt = triton.cdiv(t, bt)
    part = torch.empty(max(nt, 1), f, dtype=torch.float32, device=gate2d.device)
    if input_maxima and not (partials and t and f):
        raise ValueError("swiglu_colamax: input_maxima needs partials and a non-empty input")
    if t == 0:  # no tokens: column maxima 0 (channel scales 1)
        return part.zero_() if partials else part.zero_()[0]
    grid = (nt, triton.cdiv(f, bf))
    maxima = torch.empty(2, grid[0] * grid[1], dtype=torch.float32, device=gate2d.device) if input_maxima else part
    _swiglu_colamax_kernel[grid](gate2d.contiguous(), up2d.contiguous(), part, maxima, t, f, BT=bt, BF=bf,
                                 INPUT_MAX=input_maxima)
    if input_maxima:
        return part, maxima
    return part if partials else part.amax(0)  # amax propagates NaN: no host synchronisation needed


def _cast_launch_args(gate2d, up2d, mode: str, smooth_scales, bt: int, bf: int):
    """``(gate, up, c, r, unread, grid)`` of a ``_swiglu_cast_kernel`` launch: contiguous inputs, the
    smoothing scales where the mode reads them (an unread placeholder otherwise) and the tile grid."""
    check_interpretable(gate2d.device)
    g, u = gate2d.contiguous(), up2d.contiguous()
    dummy = _unread(g.device)
    c = smooth_scales.reshape(-1).contiguous() if mode == "channel" else dummy
    r = smooth_scales.reshape(-1).contiguous() if mode == "token" else dummy
    return g, u, c, r, dummy, (triton.cdiv(gate2d.shape[0], bt), triton.cdiv(gate2d.shape[1], bf))


def swiglu_cast(gate2d, up2d, mode: str, fmt: Format, scale: torch.Tensor | None,
                smooth_scales: torch.Tensor | None = None, bt: int = 32, bf: int = 64, want_amax: bool = True):
    """Codes of the down GEMM's operand ``A`` (see the module doc) and ``max |A|``.

    Args:
        gate2d, up2d: [T, F] contiguous.
        mode: "none", "channel" or "token".
        fmt: the FP8 format of A.
        scale: fp32 scalar encode scale, or None for current scaling (``fmt.max / max|A|``, one more
            read of gate/up).
        smooth_scales: ``c`` [F] (channel) or ``r`` [T, 1] (token), fp32.
        want_amax: False: the amax is not reduced (None; a caller that has it from
            :func:`swiglu_amax` saves the launches).

    Returns:
        (codes [T, F], amax of A fp32 scalar or None, the scale used).
    """
    t, f = gate2d.shape
    g, u, c, r, dummy, grid = _cast_launch_args(gate2d, up2d, mode, smooth_scales, bt, bf)
    out = torch.empty(t, f, dtype=fmt.torch_dtype, device=g.device)
    part = torch.empty(grid[0] * grid[1], dtype=torch.float32, device=g.device)
    if t == 0 or f == 0:
        zero = torch.zeros((), dtype=torch.float32, device=g.device)
        return out, zero, scale if scale is not None else torch.ones_like(zero)
    kw = dict(MODE=MODES[mode], BT=bt, BF=bf, **_fmt_kw(fmt), HW=hardware_cast(g.device, fmt))
    unused = (dummy, dummy, out.view(torch.uint8), out.view(torch.uint8), out.view(torch.uint8))
    if scale is None:
        _swiglu_cast_kernel[grid](g, u, c, r, dummy, out.view(torch.uint8), part, *unused, t, f, STORE=False, **kw)
        scale = scale_from_amax(_reduce_amax(part), fmt)
    scale = scale.to(torch.float32).reshape(1).contiguous()
    _swiglu_cast_kernel[grid](g, u, c, r, scale, out.view(torch.uint8), part, *unused, t, f, STORE=True, **kw)
    return out, _reduce_amax(part) if want_amax else None, scale.reshape(())


def swiglu_cast_with_inputs(gate2d, up2d, mode: str, fmt: Format, scale: torch.Tensor,
                            smooth_scales: torch.Tensor | None, gate_scale: torch.Tensor, up_scale: torch.Tensor,
                            bt: int = 32, bf: int = 64, transpose: bool = False):
    """Codes of ``A`` (:func:`swiglu_cast` with a given ``scale``) and of the saved copies of gate and up,
    ``saturating_cast(gate * gate_scale)`` and ``saturating_cast(up * up_scale)`` (``fmt``; fp32 scalar
    scales), in one read of gate and up and one launch (T and F > 0). ``transpose``: also A's codes
    transposed (``[F, T]`` contiguous) from the same launch.

    Returns:
        (codes of A, codes of gate, codes of up), each [T, F]; with ``transpose`` a fourth, A's
        transposed codes.
    """
    t, f = gate2d.shape
    if not (t and f):
        raise ValueError("swiglu_cast_with_inputs needs a non-empty [T, F] input")
    g, u, c, r, dummy, grid = _cast_launch_args(gate2d, up2d, mode, smooth_scales, bt, bf)
    out, g_out, u_out = (torch.empty(t, f, dtype=fmt.torch_dtype, device=g.device) for _ in range(3))
    out_t = torch.empty(f, t, dtype=fmt.torch_dtype, device=g.device) if transpose else out
    part = torch.empty(grid[0] * grid[1], dtype=torch.float32, device=g.device)  # written, not read
    scales = [x.to(torch.float32).reshape(1).contiguous() for x in (scale, gate_scale, up_scale)]
    _swiglu_cast_kernel[grid](g, u, c, r, scales[0], out.view(torch.uint8), part, scales[1], scales[2],
                              g_out.view(torch.uint8), u_out.view(torch.uint8), out_t.view(torch.uint8), t, f,
                              MODE=MODES[mode], STORE=True, BT=bt, BF=bf, **_fmt_kw(fmt),
                              HW=hardware_cast(g.device, fmt), INPUTS=True, TRANSPOSE=transpose)
    return (out, g_out, u_out, out_t) if transpose else (out, g_out, u_out)


def swiglu_amax(gate2d, up2d, mode: str, smooth_scales: torch.Tensor | None = None, bt: int = 32,
                bf: int = 64, partials: bool = False) -> torch.Tensor:
    """max |A| of the down GEMM operand (one read of gate/up, nothing written but partial maxima);
    with ``partials`` the per-tile maxima instead (``triton_scaling.operand_scale`` reduces them)."""
    t, f = gate2d.shape
    if t == 0 or f == 0:
        return torch.zeros(1 if partials else (), dtype=torch.float32, device=gate2d.device)
    g, u, c, r, dummy, grid = _cast_launch_args(gate2d, up2d, mode, smooth_scales, bt, bf)
    part = torch.empty(grid[0] * grid[1], dtype=torch.float32, device=g.device)
    out = torch.empty(1, dtype=torch.uint8, device=g.device)
    _swiglu_cast_kernel[grid](g, u, c, r, dummy, out, part, dummy, dummy, out, out, out, t, f, MODE=MODES[mode],
                              STORE=False, BT=bt, BF=bf, **_fmt_kw(E4M3))
    return part if partials else _reduce_amax(part)


_UNREAD: dict[torch.device, torch.Tensor] = {}


def _unread(device: torch.device) -> torch.Tensor:
    """A pointer argument the kernel's mode never reads (one per device, made once: no fill launch)."""
    if device not in _UNREAD:
        _UNREAD[device] = torch.ones(1, dtype=torch.float32, device=device)
    return _UNREAD[device]


def transpose_cast(x2d: torch.Tensor, scale: torch.Tensor, fmt: Format, transpose: bool = True,
                   rounding: str = "nearest", only_if: torch.Tensor | None = None, out=None,
                   partials: bool = False, delayed: tuple | None = None, divisor: torch.Tensor | None = None,
                   row_major: bool = True, seed: torch.Tensor | None = None):
    """``(codes [R, C], codes [C, R] or None, max |x|)`` of ``saturating_cast(x * scale)``, one read of x.

    Args:
        rounding: "nearest" or "stochastic" (a seed drawn on the device; no host sync).
        seed: stochastic rounding's seed, int64 [1] on x's device (a stream's draw, ``runtime.sr``),
            instead of a draw from the device's generator.
        only_if: a bool or int32 tensor on the device: cast only if it is nonzero, into ``out`` =
            ``(codes, codes_t)`` from an earlier call (a recast with another scale; when zero the
            launch reads and writes nothing). Returns ``out`` and amax None.
        partials: return the per-tile maxima of ``|x|`` (fp32 [tiles]) instead of their max, for a
            kernel that reduces them itself (``triton_scaling.operand_scale``: no torch reduction).
        delayed: ``(state, margin, power_of_two, invert)``: ``scale`` is the state's held scale and the
            kernel's last program also computes the scale to cast with (see the kernel's DELAYED);
            returns a ``triton_scaling.OperandScale`` in place of the amax.
        divisor: fp32 [C] powers of two: cast (and take the amax of) ``x / divisor`` (columns divided, in
            x's dtype as torch divides; x fp32 or bf16) instead of ``x``: ``W_down / c`` without writing it
            out. (Another divisor gets ``x * (1 / divisor)``, not the quotient.)
        row_major: False (with ``transpose``, without ``out``): the ``[C, R]`` codes alone, the ``[R, C]``
            codes neither written nor allocated (returned as None): a recast whose GEMM reads only the
            transposed copy saves ``R * C`` bytes of writes.
    """
    r, c = x2d.shape
    if not row_major and (not transpose or out is not None):
        raise ValueError("transpose_cast: row_major=False writes the transposed codes alone: it needs "
                         "transpose=True and no out")
    x = x2d.contiguous()
    if divisor is not None and (x.dtype not in (torch.float32, torch.bfloat16) or divisor.numel() != c):
        raise ValueError(f"transpose_cast: a divisor needs an fp32 or bf16 x and one value per column, got "
                         f"{x.dtype} {tuple(x.shape)} and {tuple(divisor.shape)}")
    if out is not None:
        out, out_t = out
        out_t = out_t if out_t is not None else torch.empty(0, r, dtype=fmt.torch_dtype, device=x.device)
    else:
        out_t = torch.empty(c if transpose else 0, r, dtype=fmt.torch_dtype, device=x.device)
        # without row_major the kernel's row-major pointer is the transposed buffer's, never written
        out = torch.empty(r, c, dtype=fmt.torch_dtype, device=x.device) if row_major else out_t
    if not (r and c):
        zero = torch.zeros(1 if partials or delayed else (), dtype=torch.float32, device=x.device)
        codes = out if row_major else None
        if delayed:  # the scale of an empty tensor: from its zero amax, as for any other
            return codes, (out_t if transpose else None), triton_scaling.operand_scale(zero, fmt, delayed[1],
                                                                                       delayed[2], delayed[0], delayed[3])
        return codes, (out_t if transpose else None), zero
    check_interpretable(x.device)
    # room for the partial amaxes of the smallest tiles; the tuned config decides how many are written
    part = torch.empty(_max_programs(r, c) if only_if is None else 1, dtype=torch.float32, device=x.device)
    s = scale.to(torch.float32).reshape(1).contiguous()
    if rounding != "stochastic":
        seed = s  # unread
    elif seed is None:
        seed = random_seed(None, x.device)
    flag = s if only_if is None else only_if.reshape(1).to(torch.int32)
    if delayed is not None:
        state, margin, power_of_two, invert = delayed
        sc, epi, epi_consts = triton_scaling.epilogue_args(fmt, margin, power_of_two, state, invert, x.device)
        epi, counter = epi[1:], triton_scaling.counter(x.device)  # the held scale is ``s``
    else:
        sc, epi, epi_consts, counter = None, [s] * 11, {}, s
    _transpose_cast_kernel[lambda meta: (triton.cdiv(r, meta["BR"]), triton.cdiv(c, meta["BC"]))](
        x, s, out.view(torch.uint8), out_t.view(torch.uint8), part, seed, flag,
        s if divisor is None else divisor.to(torch.float32).reshape(-1).contiguous(), r, c, size_class(r),
        size_class(c), counter, *epi, TRANSPOSE=transpose, STOCHASTIC=rounding == "stochastic",
        CONDITIONAL=only_if is not None, **_fmt_kw(fmt), HW=hardware_cast(x.device, fmt), SR4=c % 4 == 0,
        **epi_consts, RBLOCK=triton.next_power_of_2(min(_max_programs(r, c), 1024)), DIVIDE=divisor is not None,
        ROW_MAJOR=row_major)
    out = out if row_major else None
    if only_if is not None:
        return out, (out_t if transpose else None), None
    if sc is not None:
        return out, (out_t if transpose else None), sc
    cfg = _transpose_cast_kernel.best_config.kwargs
    used = triton.cdiv(r, cfg["BR"]) * triton.cdiv(c, cfg["BC"])
    return out, (out_t if transpose else None), part[:used] if partials else _reduce_amax(part[:used])
