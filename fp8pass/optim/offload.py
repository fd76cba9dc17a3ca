"""Optimizer state in host memory (``fp8pass.optim.AdamW(..., offload_state=True)``).

Between steps every state tensor of a parameter but its step count (FP8 codes and their scales, or
bf16/fp32 moments) lives in host memory: pinned on CUDA, a plain copy on the CPU (where "host" and
"device" are one memory; the path is the same so it runs and is tested there). The step then updates
one parameter at a time: :meth:`StateOffload.groups` yields each param group as one-parameter groups
to the optimizer's own step body (the same routing and kernels as without offload), with that
parameter's state copied to its device first and copied back after. The copies run on side streams,
one per direction (``fp8pass.memory.HostTransfer``): the next parameter's state is copied to the device
while the current one updates, and the copy back starts once its update is queued, so the compute
stream waits only for the copy of the state it is about to use (and a copy in for the copy out that
last wrote its host tensor), and nothing is read back to the host.

The costs: a parameter's state crosses the host link twice per step; one update launch per parameter
instead of one for all tensors of a kind (Triton); on the CPU, two copies of the state per step for no
memory saved. The state dict format is unchanged (the same keys, dtypes and shapes; the tensors are on
the host): a state dict saved with offload loads without it and vice versa. ``state_dict()`` waits for
the copies back of the last step (the only host wait, at checkpoint time); read the state tensors
directly on CUDA only after ``torch.cuda.synchronize()``.
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..memory import HostTransfer
from .sharded import is_dtensor

__all__ = ["StateOffload", "is_host_copy", "device_state_nbytes"]

_HOST_COPIES = WeakIdKeyDictionary()  # host tensor made by an offload -> True (on the CPU the device is the host)


def is_host_copy(t: torch.Tensor) -> bool:
    """``t`` is a host copy of optimizer state made by an offload (not resident on the parameter's device)."""
    return t in _HOST_COPIES


def device_state_nbytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's state tensors resident on their parameter's device between steps: every
    state tensor on that device that is not an offload's host copy (with offload: the step counts when
    they live there, ``capturable=True`` or a CPU model; without: everything on the device)."""
    total = 0
    for p, st in optimizer.state.items():
        for v in st.values():
            if isinstance(v, torch.Tensor) and v.device == p.device and not is_host_copy(v):
                total += v.numel() * v.element_size()
    return total


class StateOffload:
    """The host copies of one optimizer's state and the transfers that move them (see the module doc)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self._transfers: dict = {}  # device -> HostTransfer
        self._written = WeakIdKeyDictionary()  # host tensor -> event of the copy that last wrote it (CUDA)
        optimizer.register_state_dict_pre_hook(lambda opt: self.wait())

    def wait(self) -> None:
        """Block the host until the copies back of the last step are done (before a state dict is read)."""
        for done in list(self._written.values()):
            done.synchronize()
        self._written.clear()

    def evict_all(self, optimizer: torch.optim.Optimizer) -> None:
        """Move every state tensor still on a device (a loaded state dict's) to host memory; the
        optimizer's ``load_state_dict`` calls it last."""
        for p, state in optimizer.state.items():
            self._evict(p, state, {})

    def groups(self, optimizer: torch.optim.Optimizer):
        """The optimizer's param groups, as one group per parameter with a gradient (a shallow copy with
        ``params=[p]``); while a group is out, its parameter's state is on the parameter's device."""
        todo = [(g, p) for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        for _, p in todo:
            if is_dtensor(p):
                raise ValueError("fp8pass.optim: offload_state=True does not support DTensor (FSDP2 / TP) "
                                 "parameters yet; leave offload_state off for sharded models (their state is "
                                 "already split across ranks)")
        fetched = self._fetch(todo[0][1], optimizer.state[todo[0][1]]) if todo else {}
        for i, (group, p) in enumerate(todo):
            state, here = optimizer.state[p], fetched
            transfer = self._transfer(p.device)
            for key, (_, dev, done) in here.items():
                state[key] = transfer.ready(dev, done)
            if i + 1 < len(todo):  # queued now, it runs while this parameter updates
                nxt = todo[i + 1][1]
                fetched = self._fetch(nxt, optimizer.state[nxt])
            try:
                yield {**group, "params": [p]}
            finally:
                self._evict(p, state, here)

    def _transfer(self, device: torch.device) -> HostTransfer:
        t = self._transfers.get(device)
        if t is None:
            t = self._transfers[device] = HostTransfer(device)
        return t

    def _fetch(self, p: torch.Tensor, state: dict) -> dict:
        """Start copying ``p``'s host state to its device: key -> (host tensor, device tensor, event)."""
        transfer = self._transfer(p.device)
        out = {}
        for key, v in state.items():
            if key != "step" and isinstance(v, torch.Tensor) and is_host_copy(v):
                out[key] = (v, *transfer.to_device(v, after=self._written.get(v)))
        return out

    def _evict(self, p: torch.Tensor, state: dict, fetched: dict) -> None:
        """Copy ``p``'s state on the device back to host memory (into the host tensors it came from, else
        new ones) and put the host tensors in the state."""
        transfer = self._transfer(p.device)
        for key, v in list(state.items()):
            if key == "step" or not isinstance(v, torch.Tensor) or is_host_copy(v):
                continue
            host = fetched[key][0] if key in fetched and fetched[key][0].shape == v.shape \
                and fetched[key][0].dtype == v.dtype else None
            host, done = transfer.to_host(v, out=host)
            _HOST_COPIES[host] = True
            state[key] = host
            if done is not None:
                self._written[host] = done
