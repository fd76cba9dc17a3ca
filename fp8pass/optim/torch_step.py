"""Torch path of the FP8 Adam step: dequantize -> update -> requantize, chunk by chunk.

Each parameter is processed in chunks of whole blocks (``CHUNK`` elements) through fp32 workspace
buffers that stay in cache, so the moments are read and written once, as bytes, and the fp32 copies
never exist for the whole tensor. The update is written with single-rounding ops (no lerp, addcmul or
addcdiv, which CPU kernels evaluate with FMA) so that the Triton kernel can reproduce it bit for bit::

    g  = -grad if maximize else grad;      g = g + l2 * p            (Adam's coupled weight decay)
    m  = m * beta1 + g * (1 - beta1)
    v  = v * beta2 + (g * g) * (1 - beta2)
    p  = p * decay                                                 (AdamW: decay = 1 - lr * wd)
    p  = p - ((m / ((sqrt(v) * inv_bc2_sqrt) + eps)) * step_size)
    step_size = lr / (1 - beta1**t),  inv_bc2_sqrt = 1 / sqrt(1 - beta2**t)

All scalars are fp32 (``hp``, see ``hyper_params``). Then each FP8 moment is requantized per block:
``scale = scale_from_amax(amax over the block's finite values)``, ``codes = saturating_cast(x * scale)``.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..kernels.adam_layout import HP_FIELDS, MomentSpec, WeightSeed
from ..numerics import saturating_cast, scale_from_amax
from ..numerics.casts import stochastic_round_bf16
from .moments import finite_block_amax

__all__ = ["CHUNK", "HP_FIELDS", "host_hyper_params", "device_hyper_params", "hyper_params", "as_tensor_hp",
           "adam_step_torch", "cast_moment", "draw_weight_seeds", "WeightSeed"]

# Elements per chunk (a multiple of the block is used): 6 fp32 buffers of 1 MiB stay in L2/L3.
CHUNK = 1 << 18


def host_hyper_params(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: float,
                      decoupled: bool) -> tuple[float, ...]:
    """The scalars of ``HP_FIELDS`` for a step count known on the host: computed in float64 and rounded
    once to fp32 (as torch does with Python scalars), returned as Python floats that are fp32 values,
    so that a kernel taking them as fp32 arguments sees exactly these numbers.

    Args:
        lr, beta1, beta2, eps, weight_decay: the group's hyper-parameters (Python numbers).
        step: the step count after this step's increment.
        decoupled: AdamW's decoupled decay (else Adam's L2 term ``l2``).
    """
    step = float(step)
    bc1 = 1 - beta1**step
    bc2 = 1 - beta2**step
    vals = (beta1, 1 - beta1, beta2, 1 - beta2, 1 / math.sqrt(bc2), eps, lr / bc1,
            1 - lr * weight_decay if decoupled else 1.0, 0.0 if decoupled else weight_decay)
    return tuple(float(np.float32(v)) for v in vals)


def device_hyper_params(lr, beta1: float, beta2: float, eps: float, weight_decay: float, steps: list,
                        decoupled: bool, device) -> torch.Tensor:
    """The fp32 scalars of ``HP_FIELDS`` for step counts held in tensors (capturable): one row per
    step tensor, [len(steps), len(HP_FIELDS)] on ``device``, computed there by a fixed number of ops
    whatever the number of tensors, with no host read and no tensor built from host data.

    The bias corrections are fp32 on the device (``1 - beta**t`` with the fp32 beta), so they differ
    from ``host_hyper_params``'s float64 ones in the last bits. Each column is written through a strided
    view: CPU kernels then take their scalar loops, so every value is the one a 0-dim computation gives
    (ATen's vectorised CPU ``pow`` differs from its scalar one in the last bit for some inputs).

    Args:
        lr: a Python number or a tensor (moved to ``device``: keep it there to avoid a copy).
        beta1, beta2, eps, weight_decay, decoupled: as in ``host_hyper_params``.
        steps: fp32 step-count tensors (after this step's increment); moved to ``device`` if elsewhere.
        device: where the result lives.
    """
    hp = torch.empty((len(steps), len(HP_FIELDS)), dtype=torch.float32, device=device)
    t = torch.stack(steps) if len(steps) > 1 else steps[0].reshape(1)
    t = t.to(device=device, dtype=torch.float32)
    col = dict(zip(HP_FIELDS, hp.unbind(1)))  # strided [k] views
    for name, value in (("beta1", beta1), ("one_minus_beta1", 1 - beta1), ("beta2", beta2),
                        ("one_minus_beta2", 1 - beta2), ("eps", eps),
                        ("l2", 0.0 if decoupled else weight_decay)):
        col[name].fill_(value)  # rounds the float64 value once to fp32
    if isinstance(lr, torch.Tensor):
        lr_t = lr.to(device=device, dtype=torch.float32)
    else:
        lr_t = torch.full((), float(lr), dtype=torch.float32, device=device)
    bc1, inv_bc2s = col["step_size"], col["inv_bc2_sqrt"]
    torch.pow(col["beta1"], t, out=bc1)  # the fp32 beta to the fp32 step count
    bc1.neg_().add_(1)  # 1 - x, rounded once
    torch.div(lr_t, bc1, out=bc1)  # step_size = lr / (1 - beta1**t)
    torch.pow(col["beta2"], t, out=inv_bc2s)
    inv_bc2s.neg_().add_(1)
    torch.rsqrt(inv_bc2s, out=inv_bc2s)
    if decoupled:
        torch.mul(lr_t.expand(len(steps)), float(weight_decay), out=col["decay"])
        col["decay"].neg_().add_(1)
    else:
        col["decay"].fill_(1.0)
    return hp


def hyper_params(lr, beta1, beta2, eps, weight_decay, step, decoupled: bool, device) -> torch.Tensor:
    """The fp32 scalars of one step as a tensor [len(HP_FIELDS)] on ``device``.

    ``step`` is a Python number (``host_hyper_params``; the tensor is built from host values, so on an
    accelerator this is a host-to-device copy: the Triton step takes the host values as kernel
    arguments instead), or a tensor (capturable: ``device_hyper_params``, no host read).
    """
    if isinstance(step, torch.Tensor) or isinstance(lr, torch.Tensor):
        if not isinstance(step, torch.Tensor):
            step = torch.tensor(float(step), dtype=torch.float32)
        return device_hyper_params(lr, beta1, beta2, eps, weight_decay, [step], decoupled, device)[0]
    vals = host_hyper_params(lr, beta1, beta2, eps, weight_decay, step, decoupled)
    return torch.tensor(vals, dtype=torch.float32, device=device)


def as_tensor_hp(hp, device) -> torch.Tensor:
    """``hp`` as the fp32 [len(HP_FIELDS)] tensor the torch paths read: a tensor as it is, host values
    (``host_hyper_params``) built into one on ``device``."""
    if isinstance(hp, torch.Tensor):
        return hp
    return torch.tensor(hp, dtype=torch.float32, device=device)


def cast_moment(x: torch.Tensor, spec: MomentSpec, rounding: str, stochastic_flush: bool,
                generator: torch.Generator | None) -> torch.Tensor:
    """FP8 codes of already-scaled values ``x`` (saturating), with the optional stochastic flush.

    Stochastic flush-to-zero: a value below the format's smallest subnormal (which nearest rounding
    flushes to 0, or lifts to it) is rounded stochastically to 0 or +-min_subnormal, so underflow is
    unbiased even when everything else rounds to nearest.
    """
    fmt = spec.format
    codes = saturating_cast(x, fmt, rounding, generator)
    if stochastic_flush and rounding == "nearest":
        tiny = x.abs() < fmt.min_subnormal
        if x.device.type != "cpu":  # no host read on an accelerator: round every value both ways, pick
            flushed = saturating_cast(x, fmt, "stochastic", generator)
            return torch.where(tiny, flushed.view(torch.uint8), codes.view(torch.uint8)).view(codes.dtype)
        if bool(tiny.any()):  # CPU: the host read is free, and only the tiny values draw random numbers
            u8 = codes.view(torch.uint8)
            u8[tiny] = saturating_cast(x[tiny], fmt, "stochastic", generator).view(torch.uint8)
    return codes


def draw_weight_seeds(count: int, generator: torch.Generator | None, device) -> torch.Tensor:
    """The int32 seeds [count] of ``count`` parameters' stochastic weight updates on ``device`` for one
    step (``bf16_stochastic_round``): one draw from ``generator`` (the device's default generator when
    None), one launch whatever the count, nothing read on the host. Parameter ``j`` of the draw takes
    ``seeds[j]`` (a view) in every path (torch, compiled, Triton), so all of them round the same."""
    return torch.randint(-2**31, 2**31 - 1, (count,), generator=generator, device=device, dtype=torch.int32)


class _Workspace:
    """fp32 chunk buffers, allocated once per step and device (malloc of MiB buffers per chunk is slow)."""

    def __init__(self, size: int, device):
        self.g, self.m, self.v, self.p, self.t, self.u = (
            torch.empty(size, dtype=torch.float32, device=device) for _ in range(6))


def adam_step_torch(p: torch.Tensor, grad: torch.Tensor, state: dict, m_spec: MomentSpec,
                    v_spec: MomentSpec, hp: torch.Tensor, maximize: bool = False, coupled_wd: bool = False,
                    rounding: str = "nearest",
                    stochastic_flush: bool = False, generator: torch.Generator | None = None,
                    workspace: _Workspace | None = None, weight_seed: WeightSeed | None = None) -> _Workspace:
    """One Adam/AdamW update of ``p`` (in place) and its moments in ``state`` (in place).

    Blocks of at most ``CHUNK`` elements are processed whole, several per chunk, in one pass. A
    larger block (one scale per tensor of a large tensor) spans several chunks, and its scale needs
    the amax of the whole block's new moments: each such block takes two passes over its chunks,
    the first computing the new moments for their amax only, the second computing them again (the
    same ops, so the same values) and writing the parameter and the codes. The fp32 moments never
    exist for more than one chunk, at the price of computing them twice.

    Args:
        p: the parameter (any float dtype; updated in fp32 and written back).
        grad: its dense gradient.
        state: the parameter's optimizer state with the keys of ``m_spec`` / ``v_spec``.
        m_spec, v_spec: storage of the first and second moments (same block size).
        hp: the fp32 scalars: a tensor from ``hyper_params`` / a row of ``device_hyper_params``, or the
            values of ``host_hyper_params``.
        maximize: ascend instead of descend.
        coupled_wd: Adam's L2 weight decay (``g + l2 * p``) is on; AdamW's decay is in ``hp``.
        rounding: "nearest" or "stochastic" for the FP8 moments.
        stochastic_flush: stochastic flush-to-zero (see ``cast_moment``).
        generator: torch.Generator for stochastic rounding.
        workspace: reusable buffers (from a previous call on the same device), or None.
        weight_seed: bf16 ``p`` only (``bf16_stochastic_round``): the new weight, computed in fp32,
            is stored by ``numerics.casts.stochastic_round_bf16`` under ``weight_seed.seed``, element i
            of the flattened parameter taking counter ``weight_seed.counter + i``, instead of rounding
            to nearest. Rounded chunk by chunk, as each chunk is updated.

    A parameter that is not fp32 (or not contiguous) is updated chunk by chunk through an fp32
    workspace buffer and written back in its dtype, so no fp32 copy of the whole parameter exists.

    Returns:
        the workspace, to pass to the next call.
    """
    if weight_seed is not None and p.dtype != torch.bfloat16:
        raise ValueError(f"weight_seed (bf16 stochastic rounding of the weight) needs a bf16 parameter, got {p.dtype}")
    if weight_seed is not None and not isinstance(weight_seed, WeightSeed):
        raise TypeError(f"weight_seed must be a kernels.adam_layout.WeightSeed(seed, counter), got "
                        f"{type(weight_seed).__name__}")
    hp = as_tensor_hp(hp, p.device)
    n = p.numel()
    block = m_spec.block
    whole = block <= CHUNK  # chunks of whole blocks; else every block spans several chunks
    chunk = (CHUNK // block) * block if whole else CHUNK
    size = min(chunk, n) + (block if whole else 0)  # room for a partial block's zero padding
    ws = workspace if workspace is not None and workspace.g.numel() >= size else None
    if ws is None:
        ws = _Workspace(size, p.device)
    # a non-contiguous parameter is updated in a contiguous copy of its dtype, copied back at the end
    p_flat = p.detach().view(-1) if p.is_contiguous() else p.detach().reshape(-1).clone()
    run = _Chunks(p_flat, grad.reshape(-1), state, m_spec, v_spec, hp, ws, maximize, coupled_wd,
                  rounding, stochastic_flush, generator, weight_seed)
    if whole:
        for s in range(0, n, chunk):
            k = min(n, s + chunk) - s
            nb = -(-k // block)
            run.update(s, k, nb, block)
    else:
        fp8 = [spec for spec in (m_spec, v_spec) if spec.fp8]
        for b0 in range(0, n, block):
            spans = [(s, min(n, b0 + block, s + chunk) - s) for s in range(b0, min(n, b0 + block), chunk)]
            scales = None
            if fp8:  # pass 1: the block's amax of each new FP8 moment
                amax = {spec.name: torch.zeros(1, dtype=torch.float32, device=p.device) for spec in fp8}
                for s, k in spans:
                    for spec, x in run.update(s, k, 1, k, measure_only=True):
                        if spec.fp8:
                            torch.maximum(amax[spec.name], finite_block_amax(x.view(1, k), out=ws.u[:k].view(1, k)),
                                          out=amax[spec.name])
                scales = {spec.name: scale_from_amax(amax[spec.name], spec.format) for spec in fp8}
            for s, k in spans:  # pass 2: update and store the codes with the block's new scales
                run.update(s, k, 1, k, scales=scales)
            for spec in fp8:  # only now: every span of pass 2 decoded its old codes with the old scale
                run.flats[spec.scale_key][b0 // block].copy_(scales[spec.name][0])
    if not p.is_contiguous():
        p.copy_(p_flat.view(p.shape))
    return ws


class _Chunks:
    """The update of one chunk of a parameter: elements [s, s+k) seen as ``rows`` x ``width`` scale
    blocks (whole blocks, the last one zero-padded), or as one span of a larger block (rows = 1)."""

    def __init__(self, p_flat, g_flat, state, m_spec, v_spec, hp, ws, maximize, coupled_wd, rounding,
                 stochastic_flush, generator, weight_seed=None):
        self.p_flat, self.g_flat, self.ws = p_flat, g_flat, ws
        self.weight_seed = weight_seed
        self.flats = {k: v.view(-1) for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
        self.m_spec, self.v_spec, self.hp = m_spec, v_spec, hp.unbind()
        self.maximize, self.coupled_wd = maximize, coupled_wd
        self.copy_g = maximize or coupled_wd or g_flat.dtype != torch.float32
        self.cast = (rounding, stochastic_flush, generator)

    def update(self, s: int, k: int, rows: int, width: int, measure_only: bool = False, scales=None):
        """Update elements [s, s+k). ``measure_only``: compute the new moments and return
        ``[(spec, values)]`` (values as stored: sqrt(v) for a sqrt-storing v) without writing
        anything. Otherwise write the parameter and the moments, each FP8 moment with the scale of
        ``scales[name]`` if given, else with the amax of each of its ``rows`` blocks."""
        b1, omb1, b2, omb2, inv_bc2s, eps, step_size, decay, l2 = self.hp
        ws, flats, m_spec, v_spec = self.ws, self.flats, self.m_spec, self.v_spec
        stored = self.p_flat[s : s + k]
        pc = stored
        if stored.dtype != torch.float32:  # updated in fp32 in the workspace, written back below
            pc = ws.p[:k]
            pc.copy_(stored)
        if self.copy_g:
            g = ws.g[:k]
            g.copy_(self.g_flat[s : s + k])
            if self.maximize:
                g.neg_()
            if self.coupled_wd:
                torch.mul(pc, l2, out=ws.t[:k])
                g.add_(ws.t[:k])
        else:
            g = self.g_flat[s : s + k]
        m = _load(ws.m, flats, m_spec, s, k, rows, width)
        v = _load(ws.v, flats, v_spec, s, k, rows, width)
        t, u = ws.t[:k], ws.u[:k]
        # m = m * b1 + g * (1 - b1)
        m.mul_(b1)
        torch.mul(g, omb1, out=t)
        m.add_(t)
        # v = v * b2 + (g * g) * (1 - b2)
        v.mul_(b2)
        torch.mul(g, g, out=t)
        t.mul_(omb2)
        v.add_(t)
        _sqrt_rn(v, t)  # kept in t: it is what a sqrt-storing v moment stores
        v_src = ws.t if v_spec.stores_sqrt else ws.v
        if measure_only:
            return [(m_spec, m), (v_spec, v_src[:k])]
        # p = p * decay - (m / (sqrt(v) * inv_bc2_sqrt + eps)) * step_size
        pc.mul_(decay)
        torch.mul(t, inv_bc2s, out=u)
        u.add_(eps)
        torch.div(m, u, out=u)
        u.mul_(step_size)
        pc.sub_(u)
        if self.weight_seed is not None:
            seed, counter = self.weight_seed
            stored.copy_(stochastic_round_bf16(pc, seed, counter + s))
        elif pc is not stored:
            stored.copy_(pc)
        for src, spec in ((ws.m, m_spec), (v_src, v_spec)):
            _store(src, ws.u, flats, spec, s, k, rows, width, *self.cast,
                   scale=None if scales is None else scales.get(spec.name))
        return None


def _sqrt_rn(x: torch.Tensor, out: torch.Tensor) -> None:
    """Correctly rounded fp32 sqrt. torch's CPU sqrt (2.13, AVX512 build) is not: ~20% of values in
    [0, 1) come out one ulp off, and it is ~70x slower than a multiply there; numpy's is IEEE (and fast)."""
    if x.device.type == "cpu":
        np.sqrt(x.numpy(), out=out.numpy())
    else:
        torch.sqrt(x, out=out)


def _load(buf, flats, spec: MomentSpec, s: int, k: int, rows: int, width: int) -> torch.Tensor:
    """fp32 values of the moment's elements [s, s+k) in ``buf[:k]`` (exact decode, then / scale).

    The elements are ``rows`` consecutive scale blocks of ``width`` (the last one zero-padded), or,
    with ``rows=1``, a span of one block larger than a chunk."""
    if not spec.fp8:
        buf[:k].copy_(flats[spec.name][s : s + k])
        return buf[:k]
    padded = rows * width
    buf[:k].copy_(flats[spec.codes_key][s : s + k])  # fp8 -> fp32 is exact (numerics.decode)
    if padded > k:
        buf[k:padded].zero_()
    b0 = s // spec.block
    buf[:padded].view(rows, width).div_(flats[spec.scale_key][b0 : b0 + rows, None])
    if spec.stores_sqrt:
        buf[:k].mul_(buf[:k])
    return buf[:k]


def _store(src, tmp, flats, spec: MomentSpec, s: int, k: int, rows: int, width: int, rounding: str,
           stochastic_flush: bool, generator, scale: torch.Tensor | None = None) -> None:
    """Write fp32 values ``src[:k]`` as the moment's elements [s, s+k), requantized per block of
    ``width`` (``rows`` of them) and their new scales stored; or, with ``scale`` ([1], the new scale
    of a block larger than the chunk), only the codes: the caller stores that scale after the
    block's last chunk."""
    if not spec.fp8:
        flats[spec.name][s : s + k].copy_(src[:k])
        return
    padded = rows * width
    if padded > k:
        src[k:padded].zero_()
    blocks = src[:padded].view(rows, width)
    scratch = tmp[:padded].view(rows, width)
    new_scale = scale is None
    if new_scale:
        scale = scale_from_amax(finite_block_amax(blocks, out=scratch), spec.format)
    torch.mul(blocks, scale[:, None], out=scratch)
    flats[spec.codes_key][s : s + k].copy_(
        cast_moment(tmp[:k], spec, rounding, stochastic_flush, generator))
    if new_scale:
        b0 = s // spec.block
        flats[spec.scale_key][b0 : b0 + rows].copy_(scale)
