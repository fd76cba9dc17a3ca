"""Automatic amax agreement across data-parallel ranks, owned by the compile backend.

With ``Config(amax_reduction="auto")`` (the default) and ``torch.distributed`` running more than
one rank, every delayed-scaling state the backend compiled is max-reduced over the group (the world,
or the ``ProcessGroup`` given as ``amax_reduction``) in one collective per backward, by
:class:`fp8pass.distributed.AmaxSync`'s reduction, so a plain loop needs no extra call:

* forward, with grad enabled: a hook on each differentiable output of the compiled graph; when
  backward reaches the first of them, it queues an autograd-engine callback (once per backward), which runs after
  the whole backward, every ``grad_output`` amax recorded, and reduces. Gradient accumulation
  (``no_sync``) reduces after each micro-batch's backward: the max over the micro-batches is the
  same either way.
* forward without grad (evaluation): its input/weight records are reduced before the next forward
  with grad enabled, so an evaluation on per-rank data cannot leave the ranks apart.

One reducer per process group is shared by every backend instance (:func:`shared_reducer`), so a
model compiled block by block (the FSDP2 pattern, one ``fp8pass.backend(cfg)`` per block) still
reduces in one collective per backward. The states are reduced in the order the backends first
resolved them, which is the same on every rank that runs the same program; ranks holding different
sets get a clear error (AmaxSync checks the layout once). States stay in the reduction for the life
of the process (a deleted model's few bytes each: dropping them on garbage collection could happen
at different moments on different ranks). With one rank, or without ``torch.distributed``, nothing
is done.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..numerics import DelayedScalingState
from .amax_sync import AmaxSync

__all__ = ["AmaxReducer", "shared_reducer"]


class AmaxReducer:
    """The backend's automatic reduction (see the module doc).

    Args:
        group: "auto" (the world) or a ``torch.distributed.ProcessGroup``.
    """

    def __init__(self, group="auto"):
        self.group = None if group == "auto" else group
        self._states: dict[int, DelayedScalingState] = {}  # insertion order = resolution order
        self._sync = AmaxSync(states=lambda: list(self._states.values()), group=self.group)
        self._queued = False
        self._pending_no_grad = False
        self.reductions = 0  # reductions run (tests count them)

    def add(self, state: DelayedScalingState) -> None:
        """Reduce ``state`` from now on (idempotent)."""
        self._states.setdefault(id(state), state)

    def active(self) -> bool:
        return (bool(self._states) and dist.is_available() and dist.is_initialized()
                and dist.get_world_size(self.group) > 1)

    def before_forward(self) -> None:
        """Reduce what a forward without grad recorded, before a forward with grad uses the scales."""
        if self._pending_no_grad and torch.is_grad_enabled() and self.active():
            self.reduce()

    def after_forward(self, outputs) -> None:
        """Arm the end-of-backward reduction on the graph's outputs (or note a no-grad forward)."""
        if not self.active():
            return
        if not torch.is_grad_enabled():
            self._pending_no_grad = True
            return
        for t in outputs if isinstance(outputs, (list, tuple)) else (outputs,):
            if isinstance(t, torch.Tensor) and t.requires_grad:  # every one: the loss may use any
                t.register_hook(self._on_grad)

    def _on_grad(self, grad):
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)
        return None

    def _after_backward(self) -> None:
        self._queued = False
        self.reduce()

    def reduce(self) -> None:
        """One collective over every state now (all ranks must call it alike)."""
        self._pending_no_grad = False
        self._sync.sync()
        self.reductions += 1


_SHARED: dict[object, AmaxReducer] = {}


def shared_reducer(group="auto") -> AmaxReducer:
    """The process's reducer for ``group`` ("auto": the world, or a ProcessGroup), made on first use."""
    key = "auto" if group == "auto" else id(group)
    if key not in _SHARED:
        _SHARED[key] = AmaxReducer(group)
    return _SHARED[key]
