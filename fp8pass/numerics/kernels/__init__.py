"""Kernel families for the numerics core, chosen per device.

``FP8PASS_KERNELS`` forces a family: ``auto`` (default: Triton on CUDA when triton imports, torch
elsewhere), ``torch``, or ``triton`` (on CPU this needs ``TRITON_INTERPRET=1``: Triton's interpreter).
Both families expose the same functions and give bit-identical results.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from . import torch_family

__all__ = ["FAMILIES", "family_name", "kernel_family"]

FAMILIES = ("auto", "torch", "triton")


def family_name(device: torch.device | str) -> str:
    """'torch' or 'triton' for a device, honouring FP8PASS_KERNELS."""
    choice = os.environ.get("FP8PASS_KERNELS", "auto").lower()
    if choice not in FAMILIES:
        raise ValueError(f"FP8PASS_KERNELS={choice!r} is not one of {', '.join(FAMILIES)}")
    device = torch.device(device)
    if choice == "auto":
        return "triton" if device.type == "cuda" and _triton_available() else "torch"
    if choice == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "FP8PASS_KERNELS=triton on CPU tensors needs Triton's interpreter: set TRITON_INTERPRET=1 "
            "before importing triton (or use FP8PASS_KERNELS=torch)"
        )
    return choice


def kernel_family(device: torch.device | str) -> ModuleType:
    """The module implementing the kernels for ``device``."""
    if family_name(device) == "triton":
        from . import triton_family

        return triton_family
    return torch_family


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
