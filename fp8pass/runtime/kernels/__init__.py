"""Kernel table of the runtime ops, one module per device type.

=========  ==============================================================================
``cpu``    :mod:`.cpu`: Inductor-compiled fused casts, bf16 GEMMs of upcast FP8 codes
``cuda``   :mod:`.cuda`: ``torch._scaled_mm`` GEMMs, Triton fused kernels (:mod:`.triton_kernels`)
=========  ==============================================================================

``FP8PASS_KERNELS=triton`` selects the CUDA module for CPU tensors too (its Triton kernels then run in
Triton's interpreter, ``TRITON_INTERPRET=1``; its GEMMs take the fallback, never ``_scaled_mm`` on
CPU), so the tests run the GPU code path on CPU. ``torch`` or ``auto`` (default) pick by device.

An HPU module (Gaudi2: cast_to_fp8_v2 / fp8_gemm_v2) would be one more entry here; none ships
untested. The Triton kernels also run on CPU tensors under ``TRITON_INTERPRET=1``, which is how the
tests check them against the torch reference.
"""

from __future__ import annotations

from types import ModuleType

import torch

from ...numerics.kernels import family_name

__all__ = ["for_device", "uses_triton"]


def uses_triton(device: torch.device | str) -> bool:
    """Whether tensors on ``device`` take the Triton (CUDA module) path."""
    device = torch.device(device)
    return device.type == "cuda" or (device.type == "cpu" and family_name(device) == "triton")


def for_device(device: torch.device | str) -> ModuleType:
    """The kernel module for tensors on ``device``; a clear error for devices without one."""
    kind = torch.device(device).type
    if kind == "cpu" and not uses_triton(device):
        from . import cpu

        return cpu
    if kind in ("cuda", "cpu"):
        from . import cuda

        return cuda
    raise RuntimeError(
        f"fp8pass runtime ops have no kernels for device type {kind!r} (supported: cpu, cuda)"
    )
