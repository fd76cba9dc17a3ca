"""Split-block Triton Adam step: scale blocks too wide for one program, their spans in parallel.

The fused kernel (``triton_adam``) gives each scale block to one program, which walks a wide block in
spans serially; with one scale per tensor (``block_size=None``) a large tensor would be one program.
Here every span of ``MAX_SPAN`` elements of every wide block is a program, in two launches over all
the wide blocks of a group of tensors:

* phase 1 computes each span's new m and v (``_span_update``: the fused kernel's ops, in its order)
  without writing anything, and folds the span's finite amax into its block's row of a zeroed
  scratch buffer with an atomic max on the int32 view (non-negative fp32 values order like their bit
  patterns, so the max is exact and independent of the order the programs run in); the first span
  of a block also saves the block's old scales there;
* phase 2 computes the same update again (same ops, same values), takes the block's scale from the
  amax (``_block_scale``), and writes the parameter and the codes; the old codes are decoded with the
  saved old scales, because the first span of each block stores the new scales meanwhile.

So the result is bit-identical to ``torch_step.adam_step_torch`` (and to the fused kernel), for 3
passes over the inputs instead of 2. Stochastic rounding keys Philox exactly as the fused kernel
does (one seed per launch, drawn on the device; the same counter per element: ``triton_adam._span_bits``;
m and v round with its two 16-bit halves), so the two kernels draw the same bits for the same tensors
and seed. Each program finds its tensor, offsets and span once, on scalars (as the fused kernel's
programs do). No host synchronisation; one fixed launch configuration (one span of ``MAX_SPAN`` lanes
per program, 2 warps, untuned). With moments stored in bf16/fp32 there are no scales, and phase 1 is
skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import triton_adam as fused
from .adam_layout import MomentSpec, num_blocks
from .triton_adam import (
    _COLS,
    _base_args,
    _block_scale,
    _finite_amax,
    _hp_args,
    _hyper_params,
    _launch_groups,
    _launch_seed,
    _program_tensor,
    _span_update,
    _step_meta,
    _table,
    _tensor_offsets,
    _tensor_rows,
    _weight_seed,
    _weight_seed_base,
    _write_span,
)

__all__ = ["adam_step_triton_split"]

# The fused kernel's table columns, plus each tensor's block width and the launch index of its first span.
_SPLIT_COLS = (*_COLS, "block", "first_span")
_BLOCK_COL = tl.constexpr(_SPLIT_COLS.index("block"))
_FIRST_SPAN_COL = tl.constexpr(_SPLIT_COLS.index("first_span"))
# Per block in the scratch buffer: new m amax, new v amax, old m scale, old v scale.
_SLOT = 4
# one span of MAX_SPAN lanes per program on 2 warps: 16 lanes per thread, which spreads the program's
# fixed work (table search, scales, amax, the division slow paths) over twice the lanes of 4 warps
_NUM_WARPS = 2


def _num_warps(bf16_sr: bool) -> int:
    """Warps per program: ``_NUM_WARPS``; with the bf16 weight's stochastic rounding 4 (8 lanes per
    thread): on 2 warps the build without alignment specialisation spilled 16 bytes on sm_90
    (128 registers, triton 3.9)."""
    return 4 if bf16_sr else _NUM_WARPS


@triton.jit
def _split_kernel(p_ptr, g_ptr, m_ptr, ms_ptr, v_ptr, vs_ptr, hp_ptr, seed_ptr, wseed_ptr, table_ptr, scratch_ptr,
                  n_tensors,
                  b1_arg, omb1_arg, b2_arg, omb2_arg, inv_bc2s_arg, eps_arg, step_size_arg, decay_arg, l2_arg,
                  M_KIND: tl.constexpr, M_MBITS: tl.constexpr, M_BIAS: tl.constexpr, M_MAX_CODE: tl.constexpr,
                  M_NAN_CODE: tl.constexpr, M_FMAX: tl.constexpr, M_MIN_SUB: tl.constexpr, M_IEEE: tl.constexpr,
                  M_HW: tl.constexpr,
                  V_KIND: tl.constexpr, V_MBITS: tl.constexpr, V_BIAS: tl.constexpr, V_MAX_CODE: tl.constexpr,
                  V_NAN_CODE: tl.constexpr, V_FMAX: tl.constexpr, V_MIN_SUB: tl.constexpr, V_IEEE: tl.constexpr,
                  V_HW: tl.constexpr,
                  V_SQRT: tl.constexpr, MAXIMIZE: tl.constexpr, COUPLED_WD: tl.constexpr,
                  STOCHASTIC: tl.constexpr, SFLUSH: tl.constexpr, SCALE_CAP: tl.constexpr,
                  HP_TABLE: tl.constexpr, WRITE: tl.constexpr, SPAN: tl.constexpr, SEARCH_STEPS: tl.constexpr,
                  ALIGNED: tl.constexpr, RAND4: tl.constexpr, W: tl.constexpr, SLOT: tl.constexpr,
                  BF16_SR: tl.constexpr):
    """Phase 1 (``WRITE`` False) or phase 2 of the split-block step on one span of one wide block
    (see the module doc): the tensor, its offsets, the span's place and the hyper-parameters are
    computed once per program, on scalars."""
    pid = tl.program_id(0).to(tl.int64)  # compared with and offset by the table's int64 entries
    t = _program_tensor(table_ptr, pid, n_tensors, _FIRST_SPAN_COL, W, SEARCH_STEPS)
    p_off, g_off, m_off, v_off, numel = _tensor_offsets(t, ALIGNED)
    block = tl.load(t + _BLOCK_COL)
    # int32 (both below the grid's 2**31 programs): an int64 division would call a ~80-instruction
    # subroutine (sm_90)
    spans_per_block = ((block + SPAN - 1) // SPAN).to(tl.int32)
    local = (pid - tl.load(t + _FIRST_SPAN_COL)).to(tl.int32)
    blk32 = local // spans_per_block
    s0 = (local - blk32 * spans_per_block) * SPAN  # the span's first element in its block
    blk = blk32.to(tl.int64)
    start = blk * block + s0
    if ALIGNED:  # blocks and spans are multiples of 16 elements
        start = tl.multiple_of(start, 16)
    left = tl.minimum(tl.minimum(block - s0, numel - start), SPAN).to(tl.int32)  # the span's elements (<= 0: none)
    if ALIGNED:  # so the masks are constant over 16 lanes: vector loads and stores
        left = tl.multiple_of(left, 16)
    one = tl.arange(0, 1)  # the span as the update's one row
    first_span = (s0 + one) == 0  # [1]; saves (phase 1) and writes (phase 2) its block's scales
    slot = scratch_ptr + (tl.load(t + 8) + blk) * SLOT + one
    ms = ms_ptr + tl.load(t + 3) + blk + one
    vs = vs_ptr + tl.load(t + 5) + blk + one
    old_ms, old_vs = ms, vs
    if WRITE:  # the state's scales are being overwritten: decode with the copies phase 1 saved
        old_ms, old_vs = slot + 2, slot + 3
    m_old = tl.load(old_ms) if M_KIND == 0 else tl.zeros([1], dtype=tl.float32) + 1.0
    v_old = tl.load(old_vs) if V_KIND == 0 else tl.zeros([1], dtype=tl.float32) + 1.0
    m_inv = tl.math.div_rn(1.0 + m_old * 0.0, m_old)
    v_inv = tl.math.div_rn(1.0 + v_old * 0.0, v_old)
    b1, omb1, b2, omb2, inv_bc2s, eps, step_size, decay, l2 = _hyper_params(
        hp_ptr, t, (b1_arg, omb1_arg, b2_arg, omb2_arg, inv_bc2s_arg, eps_arg, step_size_arg, decay_arg, l2_arg),
        HP_TABLE)
    e = tl.arange(0, SPAN)[None, :]
    mask = e < left
    p_t, m_t, v_t = p_ptr + p_off + start, m_ptr + m_off + start, v_ptr + v_off + start
    p, m, v = _span_update(p_t, g_ptr + g_off + start, m_t, m_old, m_inv, v_t, v_old, v_inv, e, mask, b1, omb1, b2,
                           omb2, inv_bc2s, eps, step_size, decay, l2, M_KIND, M_MBITS, M_BIAS, M_IEEE, V_KIND, V_MBITS,
                           V_BIAS, V_IEEE, V_SQRT, MAXIMIZE, COUPLED_WD, M_HW, V_HW)
    if WRITE:
        m_scale = tl.zeros([1], dtype=tl.float32) + 1.0
        v_scale = tl.zeros([1], dtype=tl.float32) + 1.0
        if M_KIND == 0:
            m_scale = _block_scale(tl.load(slot + 0), M_FMAX, SCALE_CAP)
        if V_KIND == 0:
            v_scale = _block_scale(tl.load(slot + 1), V_FMAX, SCALE_CAP)
        seed = 0
        key = 0
        if STOCHASTIC or SFLUSH:
            seed = tl.load(seed_ptr)
            key = tl.load(t + 9) + start  # Philox counter of the span's first element (element e: key + e)
        wseed, wkey = _weight_seed(wseed_ptr, t, start, BF16_SR)
        _write_span(p, m, v, p_t, m_t, v_t, e, mask, m_scale, v_scale, seed, key, wseed, wkey, M_KIND, M_MBITS,
                    M_BIAS, M_MAX_CODE, M_NAN_CODE, M_MIN_SUB, V_KIND, V_MBITS, V_BIAS, V_MAX_CODE, V_NAN_CODE,
                    V_MIN_SUB, STOCHASTIC, SFLUSH, M_HW, V_HW, RAND4, 1, SPAN, BF16_SR)
        if M_KIND == 0:
            tl.store(ms, m_scale, mask=first_span)
        if V_KIND == 0:
            tl.store(vs, v_scale, mask=first_span)
    else:
        bits = slot.to(tl.pointer_type(tl.int32))  # amax >= 0: its int32 bits order like the value
        if M_KIND == 0:
            tl.atomic_max(bits + 0, _finite_amax(m).to(tl.int32, bitcast=True))
            tl.store(slot + 2, tl.load(ms, mask=first_span, other=1.0), mask=first_span)
        if V_KIND == 0:
            tl.atomic_max(bits + 1, _finite_amax(v).to(tl.int32, bitcast=True))
            tl.store(slot + 3, tl.load(vs, mask=first_span, other=1.0), mask=first_span)


def _common_specs(m_specs, v_specs) -> tuple[MomentSpec, MomentSpec]:
    """The storage shared by all tensors of one call (formats and sqrt; the widths may differ)."""
    kinds = {(m.fmt, v.fmt, v.stores_sqrt) for m, v in zip(m_specs, v_specs)}
    if len(kinds) > 1 or any(m.block != v.block for m, v in zip(m_specs, v_specs)):
        raise ValueError(f"adam_step_triton_split: one call needs one moment storage for all tensors (got "
                         f"{sorted(kinds)}) and equal m and v block widths per tensor")
    return m_specs[0], v_specs[0]


def _launch_split(items, blocks, m_spec: MomentSpec, v_spec: MomentSpec, opts: dict) -> None:
    """The two launches over ``items`` (of one device and one pair of dtypes), ``blocks`` their widths."""
    args = _base_args(items, m_spec, v_spec)
    device, hp0 = args[0].device, args[-1]
    span = min(triton.next_power_of_2(max(blocks)), fused.MAX_SPAN)
    rows, n_blocks, _, aligned = _tensor_rows(items, m_spec, v_spec, blocks)
    n_spans = 0
    for i, block in enumerate(blocks):
        rows[i] = (*rows[i], block, n_spans)
        n_spans += num_blocks(items[i][0].numel(), block) * triton.cdiv(block, span)
    table = _table(rows, device)
    scratch = torch.zeros((n_blocks, _SLOT), dtype=torch.float32, device=device)
    seed = _launch_seed(opts, device, hp0)
    wseed = _weight_seed_base(items, hp0)
    meta = dict(BF16_SR=items[0][4] is not None, **_step_meta(m_spec, v_spec, opts, device), **_hp_args(items), SPAN=span,
                SEARCH_STEPS=max(1, len(items).bit_length()),
                ALIGNED=aligned and span % 16 == 0 and all(b % 16 == 0 for b in blocks),
                RAND4=span % 4 == 0 and all(b % 4 == 0 for b in blocks), W=len(_SPLIT_COLS), SLOT=_SLOT,
                num_warps=_num_warps(items[0][4] is not None),
                enable_fp_fusion=False)  # no FMA: bit-identical to the torch path's single-rounding ops
    if m_spec.fp8 or v_spec.fp8:
        _split_kernel[(n_spans,)](*args, seed, wseed, table, scratch, len(items), WRITE=False, **meta)
    _split_kernel[(n_spans,)](*args, seed, wseed, table, scratch, len(items), WRITE=True, **meta)


def adam_step_triton_split(params, grads, states, hps, m_specs, v_specs, maximize: bool = False,
                           coupled_wd: bool = False, rounding: str = "nearest", stochastic_flush: bool = False,
                           generator: torch.Generator | None = None, weight_seeds=None) -> None:
    """``torch_step.adam_step_torch`` for many parameters whose scale blocks are wider than one program
    should walk: two launches per (device, parameter dtype, gradient dtype) among them.

    Args:
        params, grads, states, hps: per parameter its contiguous tensor, dense gradient, state dict and
            hyper-parameters (host values or a device row: see ``triton_adam.adam_step_triton_multi``).
        m_specs, v_specs: per parameter its moments' storage: one format pair for all, any block widths
            (one scale per tensor gives each tensor its own).
        maximize, coupled_wd, rounding, stochastic_flush: as in ``adam_step_torch``.
        generator: for stochastic rounding, used for the tensors on its device (the device's default
            generator for the others).
        weight_seeds: per parameter a ``WeightSeed`` (bf16 stochastic rounding of the weight, the torch
            path's bits) or None; None: all None.
    """
    m_spec, v_spec = _common_specs(m_specs, v_specs)
    opts = dict(maximize=maximize, coupled_wd=coupled_wd, rounding=rounding, stochastic_flush=stochastic_flush,
                generator=generator)
    for items, blocks in _launch_groups(params, grads, states, hps, [s.block for s in m_specs], weight_seeds):
        _launch_split(items, blocks, m_spec, v_spec, opts)
