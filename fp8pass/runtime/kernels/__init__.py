"""Kernel table of the runtime ops, one module per device type.

=========  ==============================================================================
``cpu``    :mod:`.cpu`: Inductor-compiled fused casts, bf16 GEMMs of upcast FP8 codes
``cuda``   :mod:`.cuda`: ``torch._scaled_mm`` GEMMs, Triton fused kernels (:mod:`.triton_kernels`)
=========  ==============================================================================

An HPU module (Gaudi2: cast_to_fp8_v2 / fp8_gemm_v2) would be one more entry here; none ships
untested. The Triton kernels also run on CPU tensors under ``TRITON_INTERPRET=1``, which is how the
tests check them against the torch reference.
"""

from __future__ import annotations

from types import ModuleType

import torch

__all__ = ["for_device"]


def for_device(device: torch.device | str) -> ModuleType:
    """The kernel module for tensors on ``device``; a clear error for devices without one."""
    kind = torch.device(device).type
    if kind == "cpu":
        from . import cpu

        return cpu
    if kind == "cuda":
        from . import cuda

        return cuda
    raise NotImplementedError(
        f"fp8pass runtime ops have no kernels for device type {kind!r} (supported: cpu, cuda)"
    )
