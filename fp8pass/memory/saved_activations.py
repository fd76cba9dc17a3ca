"""Offloading the tensors autograd saves for backward to host memory (opt-in).

``with fp8pass.offload_saved_activations(min_bytes=2**20) as off: loss = model(x)`` moves every saved
tensor of at least ``min_bytes`` (parameters and smaller tensors stay where they are) to host memory as
the forward saves it, and brings it back when backward needs it, through
``torch.autograd.graph.saved_tensors_hooks``. It works for eager modules and for graphs compiled with
``torch.compile(backend="fp8")`` (an AOT-compiled graph saves its tensors with ``ctx.save_for_backward``,
which runs the same hooks; the backward is only entered inside the ``with`` if the forward was).

On CUDA the copies run on side streams into pinned host memory (``memory/transfer.py``): the forward
does not wait for them (each pack keeps the event its copy completes at, which the copy back waits
for on the device), and each unpack starts copying back the next ``prefetch`` tensors that backward
will need. Backward unpacks roughly in the reverse order of the packs (last saved, first used), so the
packs are chained newest to oldest and an unpack prefetches along the chain; a tensor that was not
prefetched is copied back when it is unpacked. On the CPU the host copy is a plain copy (the same path,
with no streams): it saves nothing there, it exists so the logic runs and is tested everywhere.

What stays on the device: ``torch.nn.Parameter`` objects and views of them (``w.t()``, which eager
linears save; the weights are resident anyway), tensors
under ``min_bytes``, tensors whose elements do not fill their memory exactly once (expanded or gapped
views: a copy with their strides is not possible), tensor subclasses, and tensors on devices other than
CUDA and the CPU. :attr:`SavedActivationOffload.stats` counts what was moved and what stayed.

A saved tensor that something else still references when backward unpacks it (a buffer, an input the
caller holds, fp8pass's own scaling or stochastic-rounding state, which the compiled backward updates in
place) is handed back itself, not its host copy: it occupied the device all along, and the copy would
miss those in-place updates. Only tensors that were freed after the forward come back from host memory
(``stats.restored_tensors``), which is where the device memory was saved.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch

from .transfer import HostTransfer

__all__ = ["SavedActivationOffload", "OffloadStats", "offload_saved_activations"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_DEVICES = ("cuda", "cpu")


@dataclasses.dataclass
class OffloadStats:
    """What the hooks did since the context was created (or :meth:`SavedActivationOffload.reset`)."""

    offloaded_tensors: int = 0  # saved tensors copied to host memory
    offloaded_bytes: int = 0  # their bytes (elements x element size): what the device does not keep
    kept_tensors: int = 0  # saved tensors left on the device (small, not dense, subclasses, other devices)
    kept_bytes: int = 0
    parameters: int = 0  # saved parameters or views of them (left in place, not counted in kept_*)
    restored_tensors: int = 0  # unpacks from host copies (a tensor used twice by backward counts twice)
    originals_alive: int = 0  # unpacks that returned the saved tensor itself: something else still held it
    originals_alive_bytes: int = 0  # their bytes: on the device all along, though offloaded_bytes counts them
    prefetched_tensors: int = 0  # copies back started ahead of their unpack


class _Offloaded:
    """A saved tensor's host copy, the copy back once started, and the tensor packed before it."""

    __slots__ = ("host", "copied", "original", "transfer", "prev", "fetched", "used", "__weakref__")

    def __init__(self, host: torch.Tensor, copied, original: torch.Tensor, transfer: HostTransfer, prev):
        self.host = host
        self.copied = copied  # the event of the copy to host (None on the CPU): a copy back waits for it
        self.original = weakref.ref(original)  # alive at unpack: something else kept it, use it
        self.transfer = transfer
        self.prev = prev  # weakref to the previously packed _Offloaded, or None
        self.fetched = None  # (device tensor, event) while a copy back is ready or in flight
        self.used = False  # unpacked at least once: no longer worth prefetching


class SavedActivationOffload:
    """The context manager of :func:`offload_saved_activations`; reusable, one ``with`` at a time."""

    def __init__(self, min_bytes: int = 1 << 20, prefetch: int = 2):
        for name, value in (("min_bytes", min_bytes), ("prefetch", prefetch)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"offload_saved_activations: {name} must be an int >= 0, got {value!r} "
                                 f"(min_bytes: smallest saved tensor moved to host memory, in bytes; "
                                 f"prefetch: copies back started ahead of backward's use)")
        self.min_bytes = min_bytes
        self.prefetch = prefetch
        self.stats = OffloadStats()
        self._transfers: dict = {}  # device -> HostTransfer (its two side streams)
        self._last = None  # weakref to the _Offloaded packed last
        self._hooks = None

    def reset(self) -> None:
        """Zero :attr:`stats`."""
        self.stats = OffloadStats()

    def __enter__(self) -> SavedActivationOffload:
        if self._hooks is not None:
            raise RuntimeError("offload_saved_activations: this context is already active; nest a new one instead")
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        hooks, self._hooks = self._hooks, None
        hooks.__exit__(*exc)

    def _offloadable(self, t: torch.Tensor) -> bool:
        return (type(t) is torch.Tensor and t.device.type in _DEVICES and _dense(t)
                and t.numel() * t.element_size() >= self.min_bytes)

    def _pack(self, t):
        if not isinstance(t, torch.Tensor):
            return t
        if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter):  # eager saves w.t()
            self.stats.parameters += 1
            return t
        nbytes = t.numel() * t.element_size()
        if type(t) not in _PLAIN or not self._offloadable(t):
            self.stats.kept_tensors += 1
            self.stats.kept_bytes += nbytes
            return t
        transfer = self._transfers.get(t.device)
        if transfer is None:
            transfer = self._transfers[t.device] = HostTransfer(t.device)
        host, copied = transfer.to_host(t)
        packed = _Offloaded(host, copied, t, transfer, self._last)
        self._last = weakref.ref(packed)
        self.stats.offloaded_tensors += 1
        self.stats.offloaded_bytes += nbytes
        return packed

    def _unpack(self, packed):
        if not isinstance(packed, _Offloaded):
            return packed
        fetched, packed.fetched, packed.used = packed.fetched, None, True
        self._prefetch_before(packed)
        original = packed.original()
        if original is not None:  # still referenced elsewhere (state, a buffer, an input): no memory was
            self.stats.originals_alive += 1  # saved, and backward may update it in place: hand it back
            self.stats.originals_alive_bytes += original.numel() * original.element_size()
            return original
        if fetched is None:
            fetched = packed.transfer.to_device(packed.host, after=packed.copied)
        self.stats.restored_tensors += 1
        return packed.transfer.ready(*fetched)

    def _prefetch_before(self, packed: _Offloaded) -> None:
        """Start copying back the ``prefetch`` tensors packed before ``packed`` that are not back yet;
        tensors already used are unlinked from the chain on the way (it stays short to walk)."""
        node, todo = packed, self.prefetch
        while todo:
            prev = node.prev() if node.prev is not None else None
            while prev is not None and prev.used:  # skip (and unlink) what backward already took
                prev = prev.prev() if prev.prev is not None else None
            node.prev = None if prev is None else weakref.ref(prev)
            if prev is None:
                return
            if prev.fetched is None and prev.original() is None:  # an original still alive comes back itself
                prev.fetched = prev.transfer.to_device(prev.host, after=prev.copied)
                self.stats.prefetched_tensors += 1
            node, todo = prev, todo - 1


def _dense(t: torch.Tensor) -> bool:
    """``t``'s elements fill its memory exactly once (no overlaps, no gaps), so ``empty_like`` makes a
    copy with the same strides: its dimensions, ordered by stride, step by the product of the sizes below."""
    step = 1
    for size, stride in sorted((d for d in zip(t.shape, t.stride()) if d[0] != 1), key=lambda d: d[1]):
        if stride != step:
            return False
        step *= size
    return True


def offload_saved_activations(min_bytes: int = 1 << 20, prefetch: int = 2) -> SavedActivationOffload:
    """A context manager that keeps the tensors autograd saves inside it in host memory until backward.

    Args:
        min_bytes: smallest saved tensor moved, in bytes (default 1 MiB); smaller ones, and parameters,
            stay on the device.
        prefetch: how many of the next tensors backward will unpack are copied back ahead of it
            (default 2; 0: each is copied back when unpacked).

    Returns:
        the context; its ``stats`` (:class:`OffloadStats`) count what was moved and what stayed.
    """
    return SavedActivationOffload(min_bytes=min_bytes, prefetch=prefetch)
