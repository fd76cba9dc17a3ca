"""CPU fast path of ``fp8_grouped_swiglu_down`` (:mod:`.grouped_swiglu`), ``channel``/``none`` smoothing.

The generic path materialises ``h = act(gate) up``, ``|h|``, the gathered per-row ``c`` and
``A = h c`` (fp32 [S, F], 4 bytes/element each). Here one compiled pass gives the channel amax of every
aligned chunk of rows (the experts' channel amaxes follow from those, max being exact in any order),
one compiled pass casts ``((act(g) u) c) s`` straight to codes (and their GEMM values), ``B = W_down / c``
is cast without being written out, and the GLU backward gathers ``c`` per row inside its own loop.
The same operations in the same order as the generic path: the same bits (tests/runtime/test_runtime_grouped.py).
"""

from __future__ import annotations

import torch

from .. import kernels
from ..kernels import cpu
from ..numerics import scale_from_amax
from .grouped_casting import GroupedOperand, expert_scales, gemm_up, with_ones
from .swiglu import channel_scales, glu_activation, glu_activation_backward

__all__ = ["cpu_fast", "fused_glu_operand", "fused_smoothed_weight_operand", "glu_backward_rows",
           "glu_backward_rows_joined", "scaled_values", "times"]

_AMAX_CHUNK = 16  # rows per partial channel maximum


def cpu_fast(t) -> bool:
    """Whether ``t`` (gate, [S, F]) takes the compiled CPU path."""
    return t.device.type == "cpu" and not kernels.uses_triton(t.device) and t.shape[1] > 0


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
        part = cpu.run_fused(_glu_chunk_amax, (gate[:full], up[:full]), (activation,))
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


def fused_glu_operand(gate, up, offs, ids, experts, smooth, activation, fmt, a_state, margin, power_of_two, dt):
    """(GroupedOperand of A, smoothing scales) without materialising A."""
    col_amax = _glu_group_col_amax(gate, up, cpu.group_bounds(offs, gate.shape[0]), activation)
    c = channel_scales(col_amax) if smooth == "channel" else torch.ones_like(col_amax)
    amax = (col_amax * c).amax(dim=1)  # = max |h c| per expert, exactly (c is a power of two)
    scale = expert_scales(amax, a_state, fmt, margin, power_of_two)
    tensors, static = (gate, up, with_ones(c), ids, with_ones(scale)), (activation, fmt.max, fmt.torch_dtype)
    up_dtype = gemm_up(cpu, fmt, dt)
    codes, values = (cpu.run_fused(_glu_cast_rows_up, tensors, static + (up_dtype,)) if up_dtype is not None
                     else (cpu.run_fused(_glu_cast_rows, tensors, static), None))
    s = c if smooth == "channel" else torch.ones((), dtype=torch.float32, device=gate.device)
    return GroupedOperand(codes, scale, amax, values), s


def _scaled_expert_amax(w, inv_c):
    return (w.float() * inv_c).abs().amax(dim=(1, 2))


def _scaled_expert_cast(w, inv_c, scale, fmax, dtype):
    return ((w.float() * inv_c) * scale[:, None, None]).clamp(-fmax, fmax).to(dtype)


def _scaled_expert_cast_up(w, inv_c, scale, fmax, dtype, gemm_dtype):
    codes = _scaled_expert_cast(w, inv_c, scale, fmax, dtype)
    return codes, codes.to(torch.float32).to(gemm_dtype)


def fused_smoothed_weight_operand(w_down, inv_c, fmt, margin, power_of_two, dt) -> GroupedOperand:
    """``B = W_down * inv_c`` (``inv_c`` = 1/c broadcast over W's F dim) cast per expert with current
    scaling, its amax and codes in compiled passes (B never written out)."""
    b_amax = cpu.run_fused(_scaled_expert_amax, (w_down, inv_c), ())
    b_scale = scale_from_amax(b_amax, fmt, margin, power_of_two)
    up_dtype = gemm_up(cpu, fmt, dt)
    if up_dtype is None:
        return GroupedOperand(cpu.run_fused(_scaled_expert_cast, (w_down, inv_c, b_scale), (fmt.max, fmt.torch_dtype)),
                              b_scale, b_amax)
    codes, values = cpu.run_fused(_scaled_expert_cast_up, (w_down, inv_c, b_scale),
                                  (fmt.max, fmt.torch_dtype, up_dtype))
    return GroupedOperand(codes, b_scale, b_amax, values)


def glu_backward_rows(da, gate, up, col_scale, ids, activation, gate_dtype, up_dtype):
    """(dgate, dup) from dA, ``col_scale`` [E + 1, F] gathered per row (the GLU's channel scales, ones
    for ``none``)."""
    # the ops of swiglu._glu_backward_math (autograd's own activation backward), c gathered per row
    g = gate.float()
    dh = da.float() * col_scale[ids]
    dgate = glu_activation_backward(dh * up.float(), g, activation)
    return dgate.to(gate_dtype), (dh * glu_activation(g, activation)).to(up_dtype)


def glu_backward_rows_joined(da, gate, up, col_scale, ids, activation, gate_dtype, up_dtype):
    """:func:`glu_backward_rows` as one [S, 2F] tensor ``[dgate | dup]``, the gradient of a fused gate_up
    output split by ``chunk(2, -1)``: in one compiled loop nest Inductor writes both halves in place,
    so no ``cat`` pass (the backward of ``chunk``) reads and writes them again."""
    dgate, dup = glu_backward_rows(da, gate, up, col_scale, ids, activation, gate_dtype, up_dtype)
    return torch.cat((dgate, dup), dim=1)


def times(t, factor):
    return t * factor


def scaled_values(codes, col_scale, ids, dtype):
    """The codes' values times each row's expert channel scales, in ``dtype`` (a GEMM operand)."""
    # codes -> fp32 (exact; vectorised, unlike float8 -> bf16) times each row's expert channel scales
    return (codes.to(torch.float32) * col_scale[ids]).to(dtype)
