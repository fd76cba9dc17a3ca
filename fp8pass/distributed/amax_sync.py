"""Scale agreement across data-parallel ranks: every delayed-scaling state reduced in ONE collective.

Each rank records the amaxes of its own micro-batch into the weights' delayed-scaling state (the
runtime ops do that in forward and backward). Before the next forward, :func:`sync_scaling_state`
concatenates every state's ``amax_history`` (and ``skipped`` counter) into one flat fp32 buffer,
runs a single ``all_reduce(MAX)`` over the data-parallel group, copies the result back and
recomputes the scales from the reduced histories with the recipe's own rule (``scale_from_amax``).

Why the result equals one process seeing the global batch: histories are identical on all ranks
after a sync, so after the next step rank r holds ``[a_r, h0, h1, ...]`` and the element-wise max is
``[max_r a_r, h0, h1, ...]`` -- the history of one process whose batch is the union of the ranks'
batches (the amax of a union is the max of the amaxes). The scale is recomputed exactly where
``delayed_scaling_update`` would have recomputed it, so scales are bit-identical on all ranks.

Documented limits: the very first step (empty history) casts with each rank's *current* amax, as the
single-process bootstrap does with its own batch; and if only some ranks saw a NaN/Inf amax in a
step, the reduced history takes the max of the rolled and unrolled histories (still identical on all
ranks; the ``skipped`` counter is max-reduced so the warning fires everywhere).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ..numerics import DelayedScalingState, scale_from_amax
from ..runtime.state import _GROUPED_REGISTRY, _REGISTRY
from .fsdp import unsharded_params

__all__ = ["scaling_states", "sync_scaling_state", "AmaxSync", "note_weight_amax"]

# weight amaxes noted by FSDP2's FP8 pre-all-gather (shard amax), keyed by id(state)
_WEIGHT_AMAX: dict[int, tuple[DelayedScalingState, torch.Tensor]] = {}


def note_weight_amax(state: DelayedScalingState, shard_amax: torch.Tensor) -> None:
    """Record the true amax of this rank's shard of a weight for the next sync.

    Under FSDP2's FP8 all-gather the op sees the gathered (already FP8-rounded) weight, whose amax
    can differ from the true one by the rounding (or saturate); the sync overwrites the entries
    recorded since the last sync with the shard amax before the MAX reduction, which turns it into
    the amax of the whole weight.
    """
    _WEIGHT_AMAX[id(state)] = (state, shard_amax.detach().float())


def _module_params(model: torch.nn.Module):
    """``(fqn, tensor)`` for every parameter that can own scaling state, FSDP2's unsharded ones too."""
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            yield name, p
    # FSDP2 (fully_shard) swaps its DTensor shards for unsharded Parameters during forward; the
    # compiled graphs see (and key state by) those. They are persistent objects, reachable here.
    for name, p in unsharded_params(model):
        if id(p) not in seen:
            seen.add(id(p))
            yield name, p


def scaling_states(model: torch.nn.Module) -> list[tuple[str, DelayedScalingState]]:
    """Every delayed-scaling state of ``model``: ``("<param FQN>.<role>", state)``, in a fixed order.

    The order is the parameters' registration order, so it is the same on all ranks of a
    data-parallel group running the same model.
    """
    out = []
    for name, p in _module_params(model):
        st = _REGISTRY.get(p)
        if st is None:  # a MoE expert stack: one history row per expert ([E, history])
            st = _GROUPED_REGISTRY.get(p)
        if st is None:
            continue
        for role, s in st.roles().items():
            out.append((f"{name}.{role}", s))
    return out


@dataclass
class _Layout:
    states: list[DelayedScalingState]
    buffer: torch.Tensor  # [sum(history numel) + sum(skipped numel)] fp32
    checked: bool = False  # all ranks' layouts were seen to agree


class AmaxSync:
    """Reduces all scaling state of a model across a process group, one collective per call.

    Args:
        model: the (compiled, DDP- or FSDP-wrapped) model whose weights own delayed-scaling state.
        group: the data-parallel process group (default: the world).
        states: instead of ``model``, a function giving the states to reduce, in an order that is
            the same on every rank (the compile backend's automatic reduction passes its own).

    The backend reduces by itself when ``torch.distributed`` runs more than one rank
    (``Config(amax_reduction="auto")``, the default); this class is for custom loops and
    ``amax_reduction="off"``. Call :meth:`sync` once per optimizer step, after the backward(s) and
    before the next forward (for example right before ``optimizer.step()``). The flat buffer is
    built on the first call and rebuilt if the set of states changes (a recompile that adds
    linears). Every rank must call it. Each collective also carries the layout's size, so ranks
    whose sets of states differ get a clear error instead of mixing unrelated amaxes.
    """

    def __init__(self, model: torch.nn.Module | None = None, group: dist.ProcessGroup | None = None,
                 states: Callable[[], list[DelayedScalingState]] | None = None):
        if (model is None) == (states is None):
            raise TypeError("AmaxSync needs exactly one of model= and states=")
        self.model = model
        self.group = group
        self._states = states if states is not None else (lambda: [s for _, s in scaling_states(model)])
        self._layout: _Layout | None = None
        self.calls = 0  # collectives issued (tests check one per sync)
        self._synced_steps: dict[int, int] = {}

    def _build(self, states: list[DelayedScalingState]) -> _Layout:
        n = sum(s.amax_history.numel() + s.skipped.numel() + s.pending.numel() for s in states)
        dev = states[0].amax_history.device if states else torch.device("cpu")
        return _Layout(states, torch.empty(n, dtype=torch.float32, device=dev))

    def _check_layout(self, lay: _Layout) -> None:
        """Once per layout: all ranks reduce buffers of one size (else a clear error, not a hang or a mix)."""
        size = float(lay.buffer.numel())
        probe = torch.tensor([size, -size], device=lay.buffer.device)
        dist.all_reduce(probe, op=dist.ReduceOp.MAX, group=self.group)
        largest, smallest = probe.tolist()
        if largest != size or -smallest != size:
            raise RuntimeError(
                f"fp8pass amax reduction: the ranks hold different sets of delayed-scaling state ({len(lay.states)} "
                f"states, {int(size)} values on this rank; the largest rank has {int(largest)}, the smallest "
                f"{int(-smallest)}). Every rank must compile the same model with the same fp8pass Config and run "
                f"the same graphs in each step.")
        lay.checked = True

    @torch.no_grad()
    def sync(self) -> int:
        """Reduce every state now; returns the number of states reduced (0: nothing to do, no collective)."""
        states = self._states()
        lay = self._layout
        if lay is None or len(lay.states) != len(states) or any(a is not b for a, b in zip(lay.states, states)):
            lay = self._layout = self._build(states)
        if not lay.states:
            return 0
        for s in lay.states:
            noted = _WEIGHT_AMAX.pop(id(s), None)
            if noted is not None and noted[0] is s:
                # entries recorded since the last sync (one per forward; the weight did not change)
                k = min(_steps(s) - self._synced_steps.get(id(s), 0), s.amax_history.numel())
                if k > 0 and int(s.skipped) == 0:
                    s.amax_history[:k] = noted[1]
        hists = [s.amax_history for s in lay.states]
        skipped = [s.skipped.reshape(-1).to(torch.float32) for s in lay.states]
        # amaxes accumulated inside fp8pass.accumulate_scaling (-1: none) agree too, so the commit at
        # the end of the accumulation enters the same max on every rank
        pending = [s.pending.reshape(-1) for s in lay.states]
        buf = lay.buffer
        torch.cat([h.reshape(-1) for h in hists] + skipped + pending, out=buf)
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            if not lay.checked:
                self._check_layout(lay)
            dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self.group)
            self.calls += 1
        off = 0
        for s in lay.states:
            n = s.amax_history.numel()
            s.amax_history.copy_(buf[off:off + n].view(s.amax_history.shape))
            off += n
        for s in lay.states:
            n = s.skipped.numel()
            s.skipped.copy_(buf[off:off + n].view(s.skipped.shape).to(s.skipped.dtype))
            off += n
        for s in lay.states:
            n = s.pending.numel()
            s.pending.copy_(buf[off:off + n].view(s.pending.shape))
            off += n
        _recompute_scales(lay.states)
        for s in lay.states:
            self._synced_steps[id(s)] = _steps(s)
        return len(lay.states)


def _steps(s: DelayedScalingState) -> int:
    """Records so far (per-expert states advance every expert at every call: they agree)."""
    return int(s.steps.max()) if s.steps.numel() else 0


def _recompute_scales(states: list[DelayedScalingState]) -> None:
    """Scales from the reduced histories, where ``delayed_scaling_update`` recomputes them.

    It recomputes when ``steps % interval == 0`` or on the first finite amax, and only once some
    amax was finite. ``steps - skipped == 1`` covers the first finite amax; when that holds after a
    skipped step instead, the history is unchanged since its recompute, so recomputing is a no-op.
    """
    groups: dict[tuple, list[DelayedScalingState]] = {}
    for s in states:
        r = s.recipe
        key = (s.fmt.name, r.margin, r.power_of_two, r.algo, r.interval, tuple(s.amax_history.shape))
        groups.setdefault(key, []).append(s)
    for (fmt, margin, p2, algo, interval, _), ss in groups.items():
        hist = torch.stack([s.amax_history for s in ss])   # [N, H] or, per expert, [N, E, H]
        steps = torch.stack([s.steps for s in ss])
        skipped = torch.stack([s.skipped for s in ss])
        reduced = hist.amax(dim=-1) if algo == "max" else hist[..., 0]
        fresh = scale_from_amax(reduced, fmt, margin, p2)
        update = (((steps % interval) == 0) | ((steps - skipped) == 1)) & (steps > skipped)
        new = torch.where(update, fresh, torch.stack([s.scale for s in ss]))
        for s, v in zip(ss, new):
            s.scale.copy_(v)


def sync_scaling_state(model: torch.nn.Module, group: dist.ProcessGroup | None = None) -> int:
    """One-shot :meth:`AmaxSync.sync` (rebuilds the layout each call; keep an AmaxSync in a loop)."""
    return AmaxSync(model, group).sync()
