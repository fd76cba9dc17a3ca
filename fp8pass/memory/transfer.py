"""Copies between a device and host memory that do not block the device's compute stream.

One :class:`HostTransfer` per device (and user). On CUDA the host copies are pinned and the copies run
on two side streams, one per direction, so a copy out and a copy in can use both copy engines at once:
:meth:`to_host` and :meth:`to_device` return at once with the event their copy completes at. Whoever
uses a result waits on that event on the device, never on the host: the compute stream before using a
device copy (:meth:`ready`), a copy back to the device before reading a host copy that may still be
being written (``to_device(host, after=event)``). Nothing is read back to the host. On the CPU (no
streams, no separate host memory) the same calls are plain copies with no events, so the code above
runs the same path on both.

Memory reuse across streams is the caching allocator's: a tensor read on a side stream is marked with
``record_stream`` so its block is not handed out again before the copy has read it, and a device copy is
allocated on the side stream that writes it and marked for the compute stream that consumes it.
"""

from __future__ import annotations

import torch

__all__ = ["HostTransfer"]


class HostTransfer:
    """Moves tensors of ``device`` to host memory and back (see the module doc)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._out = torch.cuda.Stream(self.device) if self.cuda else None  # device -> host
        self._in = torch.cuda.Stream(self.device) if self.cuda else None  # host -> device

    def to_host(self, t: torch.Tensor, out: torch.Tensor | None = None):
        """A host copy of ``t`` (into ``out`` when given, else a new tensor with ``t``'s strides) and the
        event the copy completes at (None on the CPU). On CUDA the copy starts after the work queued so
        far on the compute stream (which produced ``t``, or last used ``out``'s previous contents)."""
        t = t.detach()  # the copy is data only, never a node of the autograd graph
        if out is None:
            out = torch.empty_like(t, device="cpu", pin_memory=self.cuda)
        if not self.cuda:
            return out.copy_(t), None
        self._out.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._out):
            out.copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._out)
        t.record_stream(self._out)  # t may be freed now: its block waits for the copy
        return out, done

    def to_device(self, host: torch.Tensor, after=None):
        """A device copy of ``host`` (same strides) and the event it completes at (None on the CPU). On
        CUDA it is queued on the copy-in stream, after ``after`` (the event of the copy that wrote
        ``host``, when that may not have finished), not after the compute stream: it overlaps compute."""
        if not self.cuda:
            return host.clone(memory_format=torch.preserve_format), None
        with torch.cuda.stream(self._in):
            if after is not None:
                self._in.wait_event(after)
            out = torch.empty_like(host, device=self.device)  # allocated on the stream that writes it
            out.copy_(host, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._in)
        return out, done

    def ready(self, t: torch.Tensor, done) -> torch.Tensor:
        """``t`` (a copy made by :meth:`to_device`) for use on the current stream: the stream waits for
        ``done`` on the device (the host does not), and ``t``'s block stays reserved until its work ends."""
        if done is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(done)
            t.record_stream(stream)
        return t
