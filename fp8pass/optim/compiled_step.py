"""Compiled torch path: the chunk update of ``torch_step`` as one ``torch.compile``d function.

Inductor fuses dequantize -> update -> block amax -> requantize into a few loops over a chunk, where
eager torch makes ~35 passes over it. The graph is compiled once per (formats, flags, dtypes) with a
dynamic number of blocks, so every tensor of a model (pieces of up to ``CHUNK`` elements) runs through
the same code; only a partial last block, and tensors of fewer than two blocks, take the eager path.
The math is the same single-rounding sequence as ``torch_step`` (IEEE sqrt and division), the casts
are ``fp8pass.numerics`` ones, and the tests check the result bit for bit against the eager path.
Compiling takes seconds to a minute on a loaded CPU: ``kernels="auto"`` uses it on CPU when the
optimizer holds >= 2**20 elements, and falls back to the eager path (one warning) if compiling fails,
for example without a C++ compiler. The step reads nothing back to the host.
"""

from __future__ import annotations

import functools
import warnings

import torch

from ..numerics import saturating_cast, scale_from_amax
from ..numerics.casts import hash_bits, stochastic_round_bf16
from .moments import MomentSpec
from .torch_step import CHUNK, _Workspace, adam_step_torch, as_tensor_hp

__all__ = ["adam_step_compiled", "guarded"]

_BROKEN: list[str] = []  # the first compile error, if torch.compile failed in this process


def _chunk(p, g, m_st, m_sc, v_st, v_sc, hp, seed, first, *, m_spec, v_spec, maximize, coupled_wd, bf16_sr):
    """One full chunk; moments are codes [nb, B] + scales [nb] (FP8) or dense [nb, B]. In place.
    ``bf16_sr``: bf16 ``p`` is stored by stochastic rounding under the int32 0-dim ``seed``, the chunk's
    element j taking counter ``first + j`` (``first``: an int32 0-dim tensor, so that one graph serves
    every chunk); else ``seed`` and ``first`` are unused."""
    b1, omb1, b2, omb2, inv_bc2s, eps, step_size, decay, l2 = hp.unbind()
    p32 = p.float()
    g = g.float()
    if maximize:
        g = -g
    if coupled_wd:
        g = g + p32 * l2
    m = m_st.float() / m_sc[:, None] if m_spec.fp8 else m_st.float()
    v = v_st.float() / v_sc[:, None] if v_spec.fp8 else v_st.float()
    if v_spec.stores_sqrt:
        v = v * v
    m = m * b1 + g * omb1
    v = v * b2 + (g * g) * omb2
    r = torch.sqrt(v)
    p32 = p32 * decay
    p32 = p32 - (m / (r * inv_bc2s + eps)) * step_size
    if bf16_sr:
        counters = torch.arange(p.numel(), dtype=torch.int32, device=p.device).view(p.shape) + first
        p.copy_(stochastic_round_bf16(p32, seed, bits=hash_bits(counters, seed)))
    else:
        p.copy_(p32)
    for x, st, sc, spec in ((m, m_st, m_sc, m_spec), (r if v_spec.stores_sqrt else v, v_st, v_sc, v_spec)):
        if spec.fp8:
            scale = scale_from_amax(_finite_amax(x), spec.format)
            st.copy_(saturating_cast(x * scale[:, None], spec.format))
            sc.copy_(scale)
        else:
            st.copy_(x)


def _finite_amax(blocks):
    """``moments.finite_block_amax`` written as one compare and select (``|x| < inf`` is False for
    NaN and Inf), which Inductor vectorizes; ``nan_to_num``'s isnan it lowers to a scalar loop."""
    a = blocks.abs()
    return torch.where(a < float("inf"), a, 0.0).amax(dim=1)


@functools.lru_cache(maxsize=None)
def _compiled(m_spec: MomentSpec, v_spec: MomentSpec, maximize: bool, coupled_wd: bool, bf16_sr: bool):
    fn = functools.partial(_chunk, m_spec=m_spec, v_spec=v_spec, maximize=maximize, coupled_wd=coupled_wd,
                           bf16_sr=bf16_sr)
    # The row count (blocks) is dynamic: one graph serves every tensor size; the block width is static.
    return torch.compile(fn, dynamic=None, fullgraph=True)


_MARKED: set = set()  # (graph, dtypes) compiled with a dynamic row count: later calls match without marks


def _call(fn, args, hp, seed, first) -> None:
    key = (fn, *(a.dtype for a in args))
    if key not in _MARKED:  # mark only until the dynamic graph exists (marking costs ~10 us a tensor)
        for a in args:
            if a is not hp:
                torch._dynamo.mark_dynamic(a, 0)
    fn(*args, hp, seed, first)
    _MARKED.add(key)


def adam_step_compiled(p, grad, state, m_spec: MomentSpec, v_spec: MomentSpec, hp, maximize=False,
                       coupled_wd=False, rounding="nearest", stochastic_flush=False, generator=None,
                       workspace: _Workspace | None = None, weight_seed=None):
    """Same contract as ``torch_step.adam_step_torch`` (nearest rounding of the moments; their
    stochastic options and non-contiguous tensors fall back to it). The bf16 stochastic weight update
    (``weight_seed``) is computed in the compiled chunk, bit-identical to the eager path.

    The whole blocks of ``p`` go through one compiled call in pieces of at most ``CHUNK`` elements
    (so that an intermediate Inductor keeps is never larger than a chunk); a partial last block, and
    tensors of fewer than two blocks, take the eager path.
    """
    hp = as_tensor_hp(hp, p.device)
    block = m_spec.block
    n = p.numel()
    if rounding != "nearest" or stochastic_flush \
            or not (p.is_contiguous() and grad.is_contiguous()) or n < 2 * block:
        return adam_step_torch(p, grad, state, m_spec, v_spec, hp, maximize, coupled_wd, rounding,
                               stochastic_flush, generator, workspace, weight_seed)
    if weight_seed is not None and p.dtype != torch.bfloat16:
        raise ValueError(f"weight_seed (bf16 stochastic rounding of the weight) needs a bf16 parameter, got {p.dtype}")
    fn = _compiled(m_spec, v_spec, maximize, coupled_wd, weight_seed is not None)
    seed = weight_seed.seed if weight_seed is not None else hp  # unread without bf16_sr
    chunk = max(1, CHUNK // block) * block
    pf, gf = p.detach().view(-1), grad.view(-1)

    def parts(spec):
        if spec.fp8:
            return state[spec.codes_key].view(-1), state[spec.scale_key]
        return state[spec.name].view(-1), None

    mc, ms = parts(m_spec)
    vc, vs = parts(v_spec)
    full = (n // block) * block
    s = 0
    while s < full:
        k = min(chunk, full - s)
        if k < 2 * block:  # a single block would make Dynamo specialise on size 1: merge it into the tail
            break
        nb, b0 = k // block, s // block
        args = [pf[s : s + k].view(nb, block), gf[s : s + k].view(nb, block), mc[s : s + k].view(nb, block),
                ms[b0 : b0 + nb] if ms is not None else hp, vc[s : s + k].view(nb, block),
                vs[b0 : b0 + nb] if vs is not None else hp]
        first = seed
        if weight_seed is not None:  # built on the host: free on CPU, where this path is meant to run
            first = torch.tensor(weight_seed.counter + s, dtype=torch.int32, device=p.device)
        _call(fn, args, hp, seed, first)
        s += k
    if s < n:
        tail = _tail_state(state, m_spec, v_spec, s, n)
        tail_seed = None if weight_seed is None else weight_seed._replace(counter=weight_seed.counter + s)
        workspace = adam_step_torch(pf[s:], gf[s:], tail, m_spec, v_spec, hp, maximize, coupled_wd,
                                    rounding, stochastic_flush, generator, workspace, tail_seed)
    return workspace


def _tail_state(state, m_spec, v_spec, start, n):
    """Views of the state for elements [start, n) (start is a multiple of the block)."""
    out = {}
    for spec in (m_spec, v_spec):
        if spec.fp8:
            out[spec.codes_key] = state[spec.codes_key].view(-1)[start:n]
            out[spec.scale_key] = state[spec.scale_key][start // spec.block :]
        else:
            out[spec.name] = state[spec.name].view(-1)[start:n]
    return out


def guarded(step_fn):
    """``step_fn`` that falls back to the eager path for good (with one warning) if compiling fails."""

    @functools.wraps(step_fn)
    def run(*args, **kwargs):
        if _BROKEN:
            return adam_step_torch(*args, **kwargs)
        try:
            return step_fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - any compiler failure: the eager path is always correct
            _BROKEN.append(repr(e))
            warnings.warn(f"fp8pass.optim: torch.compile of the Adam chunk update failed ({e!r:.200}); "
                          f"using the eager torch path (kernels='torch') from now on", RuntimeWarning, stacklevel=3)
            return adam_step_torch(*args, **kwargs)

    return run
