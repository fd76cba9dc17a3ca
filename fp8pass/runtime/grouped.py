"""Grouped (MoE expert) FP8 ops: ``fp8pass::fp8_grouped_linear`` and ``fp8pass::fp8_grouped_swiglu_down``.

The tokens routed to E experts arrive as one 2-D tensor ``x`` [S, K] whose rows are sorted by expert;
``offs`` (int32 [E]) holds the cumulative END row of each expert's group, exactly as
``torch._grouped_mm(x, w, offs=offs)`` takes it: group e is rows ``offs[e-1]:offs[e]`` (``offs[-1]``
for e = 0 is 0), groups may be empty, and rows past ``offs[-1]`` (padding) give zeros in ``y`` and
get zero gradient. Expert weights are stacked: ``[E, N, K]`` (each expert an ``nn.Linear`` weight,
``y_g = x_g W_e^T``) or, with ``w_transposed``, ``[E, K, N]`` (``y_g = x_g W_e``).

Scaling is per expert: the rows of expert e are cast with one scale from their own amax (``x_amax``
[E]; an empty group has amax 0 and scale 1) and each expert's weight with its own (``w_amax`` [E]);
``dy`` in backward likewise. Delayed scaling keeps a stack of E states per role (history [E, H],
scale/steps/skipped [E]; :func:`fp8pass.runtime.grouped_state_for`), read by the ops and recorded by
the same ``fp8pass::delayed_record_`` op as the dense ops (it broadcasts over the expert dim). An
expert whose history is still empty casts with its current amax's scale (``torch.where``, no host
sync). Saved for backward: the FP8 codes (1 byte/element) and the [E] scales; the GLU op also keeps
``gate``/``up`` for the activation derivative, as :mod:`fp8pass.runtime.swiglu` does.

``out_dtype`` (the replaced node's dtype, passed by the rewrite; None: the input's) is the dtype the ops
compute and output in, as for ``fp8_linear``: under autocast(bf16) the outputs are bf16 whatever the
inputs' dtype, the GEMMs of both passes round to it (CPU: bf16 GEMMs of the codes where this CPU's bf16
matmul is native, :func:`fp8pass.runtime.kernels.cpu.gemm_dtype`), each gradient takes its input's
dtype, and autocast is off inside the ops (it would recast their GEMMs).

Kernels (:mod:`fp8pass.runtime.kernels`): CPU = compiled per-row casts + one GEMM per group on the
upcast codes (bf16 or fp32, :func:`fp8pass.runtime.kernels.cpu.gemm_dtype`); the GLU op's channel and
none modes also compute ``A``'s codes, ``W_down / c``'s codes and the GLU backward in compiled passes
that never materialise fp32 [S, F] temporaries (same bits as the generic path, tested). CUDA =
``torch._scaled_grouped_mm`` for the forward where available, else a ``torch._scaled_mm`` loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..config import ALGOS
from ..numerics import ROUNDINGS, DelayedScalingState, Format, scale_from_amax
from ..numerics.scaling import scale_to_cast
from . import kernels
from .casting import as_bytes, from_bytes, resolve_format
from .swiglu import (ACTIVATIONS, SMOOTH_MODES, _glu_backward_math, _on_cpu, _swiglu_backward_math, channel_scales,
                     glu_activation, glu_activation_backward, swiglu_operand)

__all__ = ["fp8_grouped_linear_op", "fp8_grouped_swiglu_down_op", "group_ids", "GroupedOperand",
           "cast_grouped_rows", "cast_experts"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_common(op, x, weight, offs, fwd_format, bwd_format, grad_rounding, algo, out_dtype=None):
    if x.dim() != 2:
        raise ValueError(f"{op}: needs 2-D rows grouped by expert [S, K], got {tuple(x.shape)}")
    if weight.dim() != 3:
        raise ValueError(f"{op}: needs stacked expert weights [E, rows, cols], got {tuple(weight.shape)}")
    if offs.dim() != 1 or offs.dtype != torch.int32 or offs.numel() != weight.shape[0]:
        raise ValueError(f"{op}: offs must be int32 [E] = [{weight.shape[0]}] cumulative group ends, got "
                         f"{offs.dtype} {tuple(offs.shape)}")
    for name, t in (("x", x), ("weight", weight)):
        if t.dtype not in _FLOATS:
            raise TypeError(f"{op}: {name} must be float16/bfloat16/float32/float64, got {t.dtype}")
    resolve_format(fwd_format)
    resolve_format(bwd_format)
    if grad_rounding not in ROUNDINGS:
        raise ValueError(f"unknown grad_rounding {grad_rounding!r}; valid: {', '.join(ROUNDINGS)}")
    if algo not in ALGOS:
        raise ValueError(f"unknown algo {algo!r}; valid: {', '.join(ALGOS)}")
    if out_dtype is not None and out_dtype not in _FLOATS:
        raise TypeError(f"{op}: out_dtype must be None or float16/bfloat16/float32/float64, got {out_dtype}")


def _compute_dtype(out_dtype, x_dtype):
    """The dtype an op computes and outputs in: ``out_dtype`` (the replaced node's), else its input's."""
    return x_dtype if out_dtype is None else out_dtype


def _autocast_off():
    """The ops choose their GEMM dtypes themselves (``out_dtype``, :func:`kernels.cpu.gemm_dtype`): an
    ambient autocast must not recast the GEMMs inside them (bf16 is ~100x slow on AVX2-only CPUs)."""
    return torch._C._DisableAutocast()


def _out_features(weight, w_transposed):
    """(contraction, output) sizes of one expert of a stacked weight."""
    return (weight.shape[1], weight.shape[2]) if w_transposed else (weight.shape[2], weight.shape[1])


def _check_state(op, name, state, experts):
    if state and (len(state) != len(DelayedScalingState.OP_FIELDS) or tuple(state[1].shape) != (experts,)):
        raise ValueError(f"{op}: {name} must be [] or [history [E, H], scale [E], steps, skipped, overflows, guard] with "
                         f"E = {experts}; got {[tuple(t.shape) for t in state]}")


def check_grouped_linear_args(x, weight, offs, w_transposed, states, fwd_format, bwd_format, grad_rounding, algo,
                              out_dtype=None):
    """Clear errors for bad arguments of ``fp8_grouped_linear`` (what was wrong and what is valid)."""
    op = "fp8_grouped_linear"
    _check_common(op, x, weight, offs, fwd_format, bwd_format, grad_rounding, algo, out_dtype)
    k, _ = _out_features(weight, w_transposed)
    if x.shape[1] != k:
        layout = "[E, K, N]" if w_transposed else "[E, N, K]"
        raise ValueError(f"{op}: x has {x.shape[1]} features, weight {tuple(weight.shape)} ({layout}, "
                         f"w_transposed={w_transposed}) expects K = {k}")
    for name, st in zip(("x_state", "w_state", "g_state"), states):
        _check_state(op, name, st, weight.shape[0])


def group_ids(offs: torch.Tensor, rows: int) -> torch.Tensor:
    """Expert index of every row (int64 [rows]); rows past ``offs[-1]`` get E (no expert)."""
    r = torch.arange(rows, device=offs.device, dtype=offs.dtype)
    return torch.searchsorted(offs, r, right=True)


def _group_amax(row_amax: torch.Tensor, ids: torch.Tensor, experts: int) -> torch.Tensor:
    """Per-expert max of per-row amaxes, fp32 [E] (0 for empty groups; padding rows left out)."""
    out = torch.zeros(experts + 1, dtype=torch.float32, device=row_amax.device)
    out = out.scatter_reduce(0, ids, row_amax, "amax", include_self=True)
    return out[:experts]


def _expert_scales(amax: torch.Tensor, state: list[torch.Tensor], fmt: Format, margin, power_of_two):
    """fp32 [E] scales: current from ``amax``, or the delayed state's (current while its history is empty)."""
    if not state:
        return scale_from_amax(amax, fmt, margin, power_of_two)
    return scale_to_cast(state, amax, fmt, margin, power_of_two)


@dataclass
class GroupedOperand:
    data: torch.Tensor | None  # codes (or the values themselves for the identity format); None when not kept
    scale: torch.Tensor  # fp32 [E] encode scales
    amax: torch.Tensor  # fp32 [E]
    values: torch.Tensor | None = None  # CPU: the codes' values in the GEMM dtype, made by the cast's own loop

    def gemm_input(self, kern, out_dtype):
        """The codes as the device's GEMM takes them. CPU: the values the cast wrote beside the codes,
        else one upcast here (once, also when the operand feeds two GEMMs)."""
        if self.values is not None:
            return self.values
        if not hasattr(kern, "gemm_dtype"):
            return self.data
        return kern.upcast(self.data, kern.gemm_dtype(out_dtype, self.data))


def _gemm_up(kern, fmt, out_dtype):
    """The dtype the CPU GEMM takes FP8 codes in (for casts that also write the GEMM operand), or None
    (no FP8 codes, or a device whose GEMM takes the codes themselves)."""
    if fmt is None or not hasattr(kern, "gemm_dtype") or not kern.fused_enabled():
        return None
    return kern.gemm_dtype(out_dtype, torch.empty(0, dtype=fmt.torch_dtype))


def _with_ones(t):
    """``t`` [E, ...] with a row of ones appended: the value for padding rows (group id E)."""
    return torch.cat([t, t.new_ones(1, *t.shape[1:])])


def _cast(kern, x2d, row_scale, fmt, rounding, up, keep_codes):
    """(codes or None, GEMM values or None) of the rows, from one cast loop."""
    if up is None:
        return kern.cast_rows(x2d, row_scale, fmt, rounding), None
    out = kern.cast_rows(x2d, row_scale, fmt, rounding, up=up, keep_codes=keep_codes)
    return out if keep_codes else (None, out)


def cast_grouped_rows(x2d, ids, experts, fmt, state, margin, power_of_two, rounding="nearest", gemm_out=None,
                      keep_codes=True) -> GroupedOperand:
    """Cast rows grouped by expert, each group with its expert's scale (padding rows get scale 1).

    Args:
        x2d: [S, K] rows; ids: :func:`group_ids` of the rows; experts: E.
        fmt: FP8 Format, or None (identity format: the values themselves, scales 1).
        state: [] (current scaling) or the per-expert delayed state (the op list, ``DelayedScalingState.OP_FIELDS``).
        margin, power_of_two, rounding: cast options.
        gemm_out: the dtype of the GEMM this operand feeds: on CPU the cast loop then also writes the
            GEMM operand (``values``), so it is not upcast in a second pass; None: codes only.
        keep_codes: False for an operand only the GEMMs read (a gradient): ``data`` is then None.
    """
    kern = kernels.for_device(x2d.device)
    amax = _group_amax(kern.row_amax(x2d), ids, experts)
    if fmt is None:
        return GroupedOperand(x2d.clone(), torch.ones(experts, dtype=torch.float32, device=x2d.device), amax)
    scale = _expert_scales(amax, state, fmt, margin, power_of_two)
    up = _gemm_up(kern, fmt, gemm_out) if gemm_out is not None else None
    codes, values = _cast(kern, x2d, _with_ones(scale)[ids], fmt, rounding, up, keep_codes or up is None)
    return GroupedOperand(codes, scale, amax, values)


def cast_experts(w, fmt, state, margin, power_of_two, gemm_out=None) -> GroupedOperand:
    """Cast stacked expert weights [E, ...] with one scale per expert (``gemm_out``: as :func:`cast_grouped_rows`)."""
    kern = kernels.for_device(w.device)
    flat = w.reshape(w.shape[0], -1)
    amax = kern.row_amax(flat)
    if fmt is None:
        return GroupedOperand(w.clone(), torch.ones(w.shape[0], dtype=torch.float32, device=w.device), amax)
    scale = _expert_scales(amax, state, fmt, margin, power_of_two)
    up = _gemm_up(kern, fmt, gemm_out) if gemm_out is not None else None
    codes, values = _cast(kern, flat, scale, fmt, "nearest", up, True)
    return GroupedOperand(codes.view(w.shape), scale, amax, values.view(w.shape) if values is not None else None)


def _fwd_b(w, w_transposed):
    """The expert weight as the ``[E, N, K]`` right operand of ``a @ b^T`` (forward)."""
    return w.transpose(1, 2) if w_transposed else w


def _dgrad_b(w, w_transposed):
    """The expert weight as the ``[E, K, N]`` right operand of ``dy @ b^T`` (input gradient)."""
    return w if w_transposed else w.transpose(1, 2)


def _wgrad(kern, xo_data, xo_scale, go_data, go_scale, offs, w_transposed, out_dtype):
    """Per-expert weight gradient in the weight's layout: ``dy_g^T x_g`` [N, K] or ``x_g^T dy_g`` [K, N]."""
    if w_transposed:
        return kern.grouped_gemm_wgrad(xo_data, xo_scale, go_data, go_scale, offs, out_dtype)
    return kern.grouped_gemm_wgrad(go_data, go_scale, xo_data, xo_scale, offs, out_dtype)


# --- fp8_grouped_linear ------------------------------------------------------------------------


@torch.library.custom_op("fp8pass::fp8_grouped_linear", mutates_args=())
def fp8_grouped_linear_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    offs: torch.Tensor,
    w_transposed: bool,
    x_state: list[torch.Tensor],
    w_state: list[torch.Tensor],
    g_state: list[torch.Tensor],
    fwd_format: str,
    bwd_format: str,
    power_of_two: bool,
    grad_rounding: str,
    margin: float,
    interval: int,
    algo: str,
    out_dtype: Optional[torch.dtype],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(y, x_amax, w_amax, x_data, x_scale, w_data, w_scale)``; see the module doc."""
    check_grouped_linear_args(x, weight, offs, w_transposed, (x_state, w_state, g_state), fwd_format, bwd_format,
                              grad_rounding, algo, out_dtype)
    with _autocast_off():
        fmt = resolve_format(fwd_format)
        dt = _compute_dtype(out_dtype, x.dtype)
        if fmt is None:  # identity: the values themselves, in the dtype the replaced node computed in
            x, weight = x.to(dt), weight.to(dt)
        experts = weight.shape[0]
        kern = kernels.for_device(x.device)
        xo = cast_grouped_rows(x, group_ids(offs, x.shape[0]), experts, fmt, x_state, margin, power_of_two,
                               gemm_out=dt)
        wo = cast_experts(weight, fmt, w_state, margin, power_of_two, gemm_out=dt)
        y = kern.grouped_gemm(xo.gemm_input(kern, dt), xo.scale, _fwd_b(wo.gemm_input(kern, dt), w_transposed),
                              wo.scale, offs, dt)
    return y, xo.amax, wo.amax, as_bytes(xo.data), xo.scale.clone(), as_bytes(wo.data), wo.scale.clone()


@fp8_grouped_linear_op.register_fake
def _(x, weight, offs, w_transposed, x_state, w_state, g_state, fwd_format, bwd_format, power_of_two, grad_rounding,
      margin, interval, algo, out_dtype):
    check_grouped_linear_args(x, weight, offs, w_transposed, (x_state, w_state, g_state), fwd_format, bwd_format,
                              grad_rounding, algo, out_dtype)
    fmt = resolve_format(fwd_format)
    dt = _compute_dtype(out_dtype, x.dtype)
    experts = weight.shape[0]
    _, n = _out_features(weight, w_transposed)
    f32 = dict(dtype=torch.float32, device=x.device)
    return (x.new_empty(x.shape[0], n, dtype=dt), torch.empty(experts, **f32), torch.empty(experts, **f32),
            x.new_empty(x.shape, dtype=dt if fmt is None else torch.uint8), torch.empty(experts, **f32),
            weight.new_empty(weight.shape, dtype=dt if fmt is None else torch.uint8),
            torch.empty(experts, **f32))


@torch.library.custom_op("fp8pass::fp8_grouped_linear_backward", mutates_args=())
def fp8_grouped_linear_backward_op(
    dy: torch.Tensor,
    x_data: torch.Tensor,
    x_scale: torch.Tensor,
    w_data: torch.Tensor,
    w_scale: torch.Tensor,
    offs: torch.Tensor,
    g_state: list[torch.Tensor],
    w_transposed: bool,
    x_dtype: torch.dtype,
    w_dtype: torch.dtype,
    fwd_format: str,
    bwd_format: str,
    power_of_two: bool,
    grad_rounding: str,
    margin: float,
    out_dtype: Optional[torch.dtype],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, dW, dy_amax [E])`` from ``dy`` and the saved FP8 operands (no state mutation). The GEMMs
    round to the forward's compute dtype, then each gradient takes its input's dtype (as autocast's
    backward does)."""
    with _autocast_off():
        fmt = resolve_format(bwd_format)
        x_data = from_bytes(x_data, resolve_format(fwd_format))
        w_data = from_bytes(w_data, resolve_format(fwd_format))
        dt = _compute_dtype(out_dtype, x_dtype)
        kern = kernels.for_device(dy.device)
        go = cast_grouped_rows(dy, group_ids(offs, dy.shape[0]), w_data.shape[0], fmt, g_state, margin, power_of_two,
                               grad_rounding, gemm_out=dt, keep_codes=False)
        g_in = go.gemm_input(kern, dt)
        dx = kern.grouped_gemm(g_in, go.scale, _dgrad_b(w_data, w_transposed), w_scale, offs, dt).to(x_dtype)
        dw = _wgrad(kern, x_data, x_scale, g_in, go.scale, offs, w_transposed, dt).to(w_dtype)
    return dx, dw, go.amax


@fp8_grouped_linear_backward_op.register_fake
def _(dy, x_data, x_scale, w_data, w_scale, offs, g_state, w_transposed, x_dtype, w_dtype, fwd_format, bwd_format,
      power_of_two, grad_rounding, margin, out_dtype):
    return (dy.new_empty(x_data.shape, dtype=x_dtype), dy.new_empty(w_data.shape, dtype=w_dtype),
            dy.new_empty(w_data.shape[0], dtype=torch.float32))


def _out_rows(w_data, w_transposed):
    """N, the output features of a stacked weight (or its saved codes) [E, N, K] / [E, K, N]."""
    return _out_features(w_data, w_transposed)[1]


def _record_grad(ctx, g_amax, bwd_format):
    if ctx.g_state and resolve_format(bwd_format) is not None:
        m, interval, algo, p2 = ctx.recipe
        torch.ops.fp8pass.delayed_record_(*ctx.g_state, g_amax, bwd_format, m, interval, algo, p2)


def _linear_setup_context(ctx, inputs, output):
    (x, weight, offs, w_transposed, x_state, w_state, g_state, fwd_format, bwd_format, power_of_two, grad_rounding,
     margin, interval, algo, out_dtype) = inputs
    _, _, _, x_data, x_scale, w_data, w_scale = output
    ctx.save_for_backward(x_data, x_scale, w_data, w_scale, offs)
    ctx.set_materialize_grads(False)  # no zero-filled gradients for the saved codes (never differentiated)
    ctx.g_state = list(g_state)
    ctx.n_states = (len(x_state), len(w_state), len(g_state))
    ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
    ctx.args = (w_transposed, fwd_format, bwd_format, power_of_two, grad_rounding, margin, out_dtype)
    ctx.recipe = (margin, interval, algo, power_of_two)


def _linear_backward(ctx, dy, *unused):
    x_data, x_scale, w_data, w_scale, offs = ctx.saved_tensors
    if dy is None:  # only the amaxes or codes were used: y's gradient is zero
        dy = x_data.new_zeros(x_data.shape[0], _out_rows(w_data, ctx.args[0]),
                              dtype=_compute_dtype(ctx.args[-1], ctx.x_dtype))
    w_transposed, fwd_format, bwd_format, power_of_two, grad_rounding, margin, out_dtype = ctx.args
    dx, dw, g_amax = torch.ops.fp8pass.fp8_grouped_linear_backward(
        dy, x_data, x_scale, w_data, w_scale, offs, ctx.g_state, w_transposed, ctx.x_dtype, ctx.w_dtype, fwd_format,
        bwd_format, power_of_two, grad_rounding, margin, out_dtype)
    _record_grad(ctx, g_amax, bwd_format)
    nx, nw, ng = ctx.n_states
    return (dx, dw, None, None, [None] * nx, [None] * nw, [None] * ng) + (None,) * 8


fp8_grouped_linear_op.register_autograd(_linear_backward, setup_context=_linear_setup_context)


# --- fp8_grouped_swiglu_down ---------------------------------------------------------------------


def check_grouped_swiglu_args(gate, up, w_down, offs, w_transposed, states, activation, smooth, fwd_format,
                              bwd_format, grad_rounding, algo, out_dtype=None):
    """Clear errors for bad arguments of ``fp8_grouped_swiglu_down``."""
    op = "fp8_grouped_swiglu_down"
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown GLU activation {activation!r}; valid: {', '.join(map(repr, ACTIVATIONS))}")
    if smooth not in SMOOTH_MODES:
        raise ValueError(f"unknown smooth mode {smooth!r}; valid: {', '.join(map(repr, SMOOTH_MODES))}")
    if gate.shape != up.shape:
        raise ValueError(f"{op}: gate and up must have the same shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    _check_common(op, gate, w_down, offs, fwd_format, bwd_format, grad_rounding, algo, out_dtype)
    f, _ = _out_features(w_down, w_transposed)
    if gate.shape[1] != f:
        layout = "[E, F, D]" if w_transposed else "[E, D, F]"
        raise ValueError(f"{op}: gate/up have {gate.shape[1]} channels, w_down {tuple(w_down.shape)} ({layout}, "
                         f"w_transposed={w_transposed}) expects F = {f}")
    for name, st in zip(("a_state", "b_state", "g_state"), states):
        _check_state(op, name, st, w_down.shape[0])


def _grouped_operand(gate, up, ids, experts, smooth, activation):
    """The down GEMM's left operand ``A`` (fp32 [S, F]) and the smoothing scales.

    ``channel``: per-expert per-channel ``c`` [E, F] from each expert's own rows (:func:`channel_scales`
    of the per-expert channel amax; 1 for an expert without rows); ``token``: ``r`` [S, 1]; ``none``: [].
    """
    if smooth != "channel":
        return swiglu_operand(gate, up, smooth, activation)
    h, _ = swiglu_operand(gate, up, "none", activation)
    amax = torch.zeros(experts + 1, h.shape[1], dtype=torch.float32, device=h.device)
    amax = amax.scatter_reduce(0, ids[:, None].expand(h.shape), h.abs(), "amax", include_self=True)[:experts]
    c = channel_scales(amax)
    return h * _row_scales(c, ids), c


def _row_scales(c, ids):
    """Each row's expert channel scales ``c[e]`` ([S, F]; 1 for padding rows)."""
    return _with_ones(c)[ids]


def _per_channel(c, w_transposed):
    """``c`` [E, F] shaped to broadcast over the F dim of ``w_down`` ([E, D, F] or [E, F, D])."""
    return c[:, :, None] if w_transposed else c[:, None, :]


# --- CPU fast path of the GLU operand (channel / none): two reads of gate/up, no fp32 [S, F] temporaries.
# The generic path materialises h, |h|, the gathered per-row c and A = h c (fp32, 4 bytes/element each);
# here one compiled pass gives the channel amax of every aligned chunk of rows (the experts' channel
# amaxes follow from those, max being exact in any order), and one compiled pass casts ((act(g) u) c) s
# straight to codes (and their GEMM values), the same operations in the same order (same bits).

_AMAX_CHUNK = 16  # rows per partial channel maximum

def _run_fused(fn, tensors, static):
    from .kernels import cpu

    return cpu.run_fused(fn, tensors, static)


def _glu_chunk_amax(gate, up, activation):
    # [S / chunk, F]: a reduction over the rows of each chunk, which Inductor vectorises along the
    # rows' memory; a column reduction over a whole group's rows walks memory with a row stride (~4x slower)
    h = (glu_activation(gate.float(), activation) * up.float()).abs()
    return h.view(-1, _AMAX_CHUNK, h.shape[1]).amax(dim=1)


def _glu_group_col_amax(gate, up, bounds, activation):
    """Per-expert channel amax ``max |act(gate) up|`` over each group's rows, fp32 [E, F] (0 for an
    empty group): whole chunks from :func:`_glu_chunk_amax`, the < chunk rows at a group's edges directly
    (gathered into one tensor). Each source reaches its expert's row by one ``scatter_reduce`` (max is
    exact in any order); chunks that straddle a group edge or lie past ``offs[-1]`` go to a spare row.
    A handful of ops per call, not a few per expert (each one an OpenMP region: slow on a loaded CPU)."""
    r, experts, f = _AMAX_CHUNK, len(bounds), gate.shape[1]
    chunk_ids = [experts] * (gate.shape[0] // r)
    edge_rows: list[int] = []
    edge_ids: list[int] = []
    for e, (lo, hi) in enumerate(bounds):
        c0, c1 = -(-lo // r), hi // r
        edges = [(lo, hi)]
        if c1 > c0:
            chunk_ids[c0:c1] = [e] * (c1 - c0)
            edges = [(lo, c0 * r), (c1 * r, hi)]
        for a, b in edges:
            edge_rows += range(a, b)
            edge_ids += [e] * (b - a)
    out = gate.new_zeros(experts + 1, f, dtype=torch.float32)
    if any(e < experts for e in chunk_ids):
        full = len(chunk_ids) * r
        part = _run_fused(_glu_chunk_amax, (gate[:full], up[:full]), (activation,))
        out = _scatter_amax(out, chunk_ids, part)
    if edge_rows:
        rows = torch.tensor(edge_rows, device=gate.device)
        out = _scatter_amax(out, edge_ids, _glu_abs(gate[rows], up[rows], activation))
    return out[:experts]


def _scatter_amax(out, ids, src):
    """``out[ids[i]] = max(out[ids[i]], src[i])`` row by row (``ids``: a host list)."""
    index = torch.tensor(ids, device=src.device)[:, None].expand(src.shape)
    return out.scatter_reduce(0, index, src, "amax", include_self=True)


def _glu_abs(gate, up, activation):
    return (glu_activation(gate.float(), activation) * up.float()).abs()


def _glu_cast_rows(gate, up, col_scale, ids, row_scale, activation, fmax, dtype):
    a = (glu_activation(gate.float(), activation) * up.float()) * col_scale[ids]
    return (a * row_scale[ids][:, None]).clamp(-fmax, fmax).to(dtype)


def _glu_cast_rows_up(gate, up, col_scale, ids, row_scale, activation, fmax, dtype, gemm_dtype):
    codes = _glu_cast_rows(gate, up, col_scale, ids, row_scale, activation, fmax, dtype)
    return codes, codes.to(torch.float32).to(gemm_dtype)


def _glu_backward_rows(da, gate, up, col_scale, ids, activation, gate_dtype, up_dtype):
    # the ops of swiglu._glu_backward_math (autograd's own activation backward), c gathered per row
    g = gate.float()
    dh = da.float() * col_scale[ids]
    dgate = glu_activation_backward(dh * up.float(), g, activation)
    return dgate.to(gate_dtype), (dh * glu_activation(g, activation)).to(up_dtype)


def _scaled_expert_amax(w, inv_c):
    return (w.float() * inv_c).abs().amax(dim=(1, 2))


def _scaled_expert_cast(w, inv_c, scale, fmax, dtype):
    return ((w.float() * inv_c) * scale[:, None, None]).clamp(-fmax, fmax).to(dtype)


def _scaled_expert_cast_up(w, inv_c, scale, fmax, dtype, gemm_dtype):
    codes = _scaled_expert_cast(w, inv_c, scale, fmax, dtype)
    return codes, codes.to(torch.float32).to(gemm_dtype)


def _times(t, factor):
    return t * factor


def _scaled_values(codes, col_scale, ids, dtype):
    # codes -> fp32 (exact; vectorised, unlike float8 -> bf16) times each row's expert channel scales
    return (codes.to(torch.float32) * col_scale[ids]).to(dtype)


def _cpu_fast(t):
    return t.device.type == "cpu" and not kernels.uses_triton(t.device) and t.shape[1] > 0


def _fused_glu_operand(gate, up, offs, ids, experts, smooth, activation, fmt, a_state, margin, power_of_two, dt):
    """CPU, ``channel``/``none``: (GroupedOperand of A, smoothing scales) without materialising A."""
    from .kernels import cpu

    col_amax = _glu_group_col_amax(gate, up, cpu.group_bounds(offs, gate.shape[0]), activation)
    c = channel_scales(col_amax) if smooth == "channel" else torch.ones_like(col_amax)
    amax = (col_amax * c).amax(dim=1)  # = max |h c| per expert, exactly (c is a power of two)
    scale = _expert_scales(amax, a_state, fmt, margin, power_of_two)
    tensors, static = (gate, up, _with_ones(c), ids, _with_ones(scale)), (activation, fmt.max, fmt.torch_dtype)
    up_dtype = _gemm_up(cpu, fmt, dt)
    codes, values = (_run_fused(_glu_cast_rows_up, tensors, static + (up_dtype,)) if up_dtype is not None
                     else (_run_fused(_glu_cast_rows, tensors, static), None))
    s = c if smooth == "channel" else torch.ones((), dtype=torch.float32, device=gate.device)
    return GroupedOperand(codes, scale, amax, values), s


@torch.library.custom_op("fp8pass::fp8_grouped_swiglu_down", mutates_args=())
def fp8_grouped_swiglu_down_op(
    gate: torch.Tensor,
    up: torch.Tensor,
    w_down: torch.Tensor,
    offs: torch.Tensor,
    w_transposed: bool,
    a_state: list[torch.Tensor],
    b_state: list[torch.Tensor],
    g_state: list[torch.Tensor],
    activation: str,
    smooth: str,
    fwd_format: str,
    bwd_format: str,
    power_of_two: bool,
    grad_rounding: str,
    margin: float,
    interval: int,
    algo: str,
    out_dtype: Optional[torch.dtype],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor]:
    """Returns ``(y, a_amax, b_amax, a_data, a_scale, b_data, b_scale, smooth_scales)``; see the module doc."""
    check_grouped_swiglu_args(gate, up, w_down, offs, w_transposed, (a_state, b_state, g_state), activation, smooth,
                              fwd_format, bwd_format, grad_rounding, algo, out_dtype)
    with _autocast_off():
        return _swiglu_forward(gate, up, w_down, offs, w_transposed, a_state, b_state, activation, smooth,
                               resolve_format(fwd_format), power_of_two, margin, _compute_dtype(out_dtype, gate.dtype))


def _swiglu_forward(gate, up, w_down, offs, w_transposed, a_state, b_state, activation, smooth, fmt, power_of_two,
                    margin, dt):
    experts = w_down.shape[0]
    ids = group_ids(offs, gate.shape[0])
    kern = kernels.for_device(gate.device)
    if fmt is None:  # identity: the weight's values in the dtype the replaced node computed in
        w_down = w_down.to(dt)
    if fmt is not None and smooth != "token" and _cpu_fast(gate):
        ao, s = _fused_glu_operand(gate, up, offs, ids, experts, smooth, activation, fmt, a_state, margin,
                                   power_of_two, dt)
    else:
        a, s = _grouped_operand(gate, up, ids, experts, smooth, activation)
        ao = cast_grouped_rows(a, ids, experts, fmt, a_state, margin, power_of_two, gemm_out=dt)
    if smooth == "channel" and fmt is not None and _cpu_fast(gate):
        # B = W_down / c without materialising it: amax and codes of W * (1/c) in compiled passes
        inv_c = _per_channel(1 / s, w_transposed)
        b_amax = _run_fused(_scaled_expert_amax, (w_down, inv_c), ())
        b_scale = scale_from_amax(b_amax, fmt, margin, power_of_two)
        up_dtype = _gemm_up(kern, fmt, dt)
        if up_dtype is None:
            bo = GroupedOperand(_run_fused(_scaled_expert_cast, (w_down, inv_c, b_scale), (fmt.max, fmt.torch_dtype)),
                                b_scale, b_amax)
        else:
            codes, values = _run_fused(_scaled_expert_cast_up, (w_down, inv_c, b_scale),
                                       (fmt.max, fmt.torch_dtype, up_dtype))
            bo = GroupedOperand(codes, b_scale, b_amax, values)
    elif smooth == "channel":  # B = W_down / c per expert: changes every call, so current-scaled
        # times 1/c: the same bits as dividing (c is a power of two), and a multiply is cheaper
        b = w_down * _per_channel(1 / s, w_transposed).to(w_down.dtype)
        bo = cast_experts(b, fmt, [], margin, power_of_two, gemm_out=dt)
    else:
        bo = cast_experts(w_down, fmt, b_state, margin, power_of_two, gemm_out=dt)
    y = kern.grouped_gemm(ao.gemm_input(kern, dt), ao.scale, _fwd_b(bo.gemm_input(kern, dt), w_transposed),
                          bo.scale, offs, dt)
    if smooth == "token":
        y = (y.float() * s).to(dt)
    return (y, ao.amax, bo.amax, as_bytes(ao.data), ao.scale.clone(), as_bytes(bo.data), bo.scale.clone(),
            s.clone())


@fp8_grouped_swiglu_down_op.register_fake
def _(gate, up, w_down, offs, w_transposed, a_state, b_state, g_state, activation, smooth, fwd_format, bwd_format,
      power_of_two, grad_rounding, margin, interval, algo, out_dtype):
    check_grouped_swiglu_args(gate, up, w_down, offs, w_transposed, (a_state, b_state, g_state), activation, smooth,
                              fwd_format, bwd_format, grad_rounding, algo, out_dtype)
    fmt = resolve_format(fwd_format)
    dt = _compute_dtype(out_dtype, gate.dtype)
    experts, rows, f = w_down.shape[0], gate.shape[0], gate.shape[1]
    _, n = _out_features(w_down, w_transposed)
    f32 = dict(dtype=torch.float32, device=gate.device)
    s_shape = {"channel": (experts, f), "token": (rows, 1), "none": ()}[smooth]
    return (gate.new_empty(rows, n, dtype=dt), torch.empty(experts, **f32), torch.empty(experts, **f32),
            gate.new_empty(rows, f, dtype=torch.float32 if fmt is None else torch.uint8), torch.empty(experts, **f32),
            w_down.new_empty(w_down.shape, dtype=dt if fmt is None else torch.uint8),
            torch.empty(experts, **f32), torch.empty(s_shape, **f32))


@torch.library.custom_op("fp8pass::fp8_grouped_swiglu_down_backward", mutates_args=())
def fp8_grouped_swiglu_down_backward_op(
    dy: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    a_data: torch.Tensor,
    a_scale: torch.Tensor,
    b_data: torch.Tensor,
    b_scale: torch.Tensor,
    smooth_scales: torch.Tensor,
    offs: torch.Tensor,
    g_state: list[torch.Tensor],
    w_transposed: bool,
    w_dtype: torch.dtype,
    activation: str,
    smooth: str,
    fwd_format: str,
    bwd_format: str,
    power_of_two: bool,
    grad_rounding: str,
    margin: float,
    out_dtype: Optional[torch.dtype],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dgate, dup, dW_down, dy_amax [E])`` (no state mutation); GEMMs in the forward's compute dtype,
    each gradient in its input's dtype."""
    with _autocast_off():
        return _grouped_swiglu_backward(dy, gate, up, a_data, a_scale, b_data, b_scale, smooth_scales, offs,
                                        g_state, w_transposed, w_dtype, activation, smooth, fwd_format, bwd_format,
                                        power_of_two, grad_rounding, margin, _compute_dtype(out_dtype, gate.dtype))


def _grouped_swiglu_backward(dy, gate, up, a_data, a_scale, b_data, b_scale, smooth_scales, offs, g_state,
                             w_transposed, w_dtype, activation, smooth, fwd_format, bwd_format, power_of_two,
                             grad_rounding, margin, dt):
    fmt = resolve_format(bwd_format)
    a_data = from_bytes(a_data, resolve_format(fwd_format))
    b_data = from_bytes(b_data, resolve_format(fwd_format))
    kern = kernels.for_device(dy.device)
    experts = b_data.shape[0]
    ids = group_ids(offs, dy.shape[0])
    s = smooth_scales
    g = dy.float() * s if smooth == "token" else dy
    go = cast_grouped_rows(g, ids, experts, fmt, g_state, margin, power_of_two, grad_rounding, gemm_out=dt,
                           keep_codes=False)
    g_in = go.gemm_input(kern, dt)
    da = kern.grouped_gemm(g_in, go.scale, _dgrad_b(b_data, w_transposed), b_scale, offs, dt)  # dA [S, F]
    # B = W / c => dW = dB / c (exact: powers of two); on CPU the 1/c scales A's columns as its codes
    # are upcast for the GEMM (the same bits: every step scales exactly by a power of two), not dB after it
    fold = (smooth == "channel" and resolve_format(fwd_format) is not None and _cpu_fast(gate)
            and hasattr(kern, "gemm_dtype"))
    a_in = (_run_fused(_scaled_values, (a_data, _with_ones(1 / s), ids), (kern.gemm_dtype(dt, g_in),)) if fold
            else a_data)
    db = _wgrad(kern, a_in, a_scale, g_in, go.scale, offs, w_transposed, dt).to(w_dtype)  # dB (dW), w_down's layout
    if smooth == "channel" and not fold:
        db = _run_fused(_times, (db, _per_channel(1 / s, w_transposed).to(db.dtype)), ())
    if smooth != "token" and _cpu_fast(gate):
        col = _with_ones(s) if smooth == "channel" else gate.new_ones(experts + 1, gate.shape[1], dtype=torch.float32)
        dgate, dup = _run_fused(_glu_backward_rows, (da, gate, up, col, ids), (activation, gate.dtype, up.dtype))
        return dgate, dup, db, go.amax
    if smooth == "channel":
        s = _row_scales(s, ids)
    if activation == "silu":
        dgate, dup = _on_cpu(_swiglu_backward_math, da, gate, up, s, smooth)
    else:  # eager torch math, as swiglu_down
        dgate, dup = _glu_backward_math(da, gate, up, s, smooth, activation)
    return dgate.to(gate.dtype), dup.to(up.dtype), db, go.amax


@fp8_grouped_swiglu_down_backward_op.register_fake
def _(dy, gate, up, a_data, a_scale, b_data, b_scale, smooth_scales, offs, g_state, w_transposed, w_dtype, activation,
      smooth, fwd_format, bwd_format, power_of_two, grad_rounding, margin, out_dtype):
    return (gate.new_empty(gate.shape), up.new_empty(up.shape), dy.new_empty(b_data.shape, dtype=w_dtype),
            dy.new_empty(b_data.shape[0], dtype=torch.float32))


def _swiglu_setup_context(ctx, inputs, output):
    (gate, up, w_down, offs, w_transposed, a_state, b_state, g_state, activation, smooth, fwd_format, bwd_format,
     power_of_two, grad_rounding, margin, interval, algo, out_dtype) = inputs
    _, _, _, a_data, a_scale, b_data, b_scale, s = output
    ctx.save_for_backward(gate, up, a_data, a_scale, b_data, b_scale, s, offs)
    ctx.set_materialize_grads(False)  # as _linear_setup_context
    ctx.g_state = list(g_state)
    ctx.n_states = (len(a_state), len(b_state), len(g_state))
    ctx.w_dtype = w_down.dtype
    ctx.args = (w_transposed, activation, smooth, fwd_format, bwd_format, power_of_two, grad_rounding, margin,
                out_dtype)
    ctx.recipe = (margin, interval, algo, power_of_two)


def _swiglu_backward(ctx, dy, *unused):
    gate, up, a_data, a_scale, b_data, b_scale, s, offs = ctx.saved_tensors
    if dy is None:  # as _linear_backward
        dy = gate.new_zeros(gate.shape[0], _out_rows(b_data, ctx.args[0]),
                            dtype=_compute_dtype(ctx.args[-1], gate.dtype))
    w_transposed, activation, smooth, fwd_format, bwd_format, power_of_two, grad_rounding, margin, out_dtype = ctx.args
    dgate, dup, dw, g_amax = torch.ops.fp8pass.fp8_grouped_swiglu_down_backward(
        dy, gate, up, a_data, a_scale, b_data, b_scale, s, offs, ctx.g_state, w_transposed, ctx.w_dtype, activation,
        smooth, fwd_format, bwd_format, power_of_two, grad_rounding, margin, out_dtype)
    _record_grad(ctx, g_amax, bwd_format)
    na, nb, ng = ctx.n_states
    return (dgate, dup, dw, None, None, [None] * na, [None] * nb, [None] * ng) + (None,) * 10


fp8_grouped_swiglu_down_op.register_autograd(_swiglu_backward, setup_context=_swiglu_setup_context)
