"""Which kernels run for a device: the one place that reads ``FP8PASS_KERNELS``.

``FP8PASS_KERNELS`` chooses a family: ``auto`` (default: Triton on CUDA when triton imports, torch
elsewhere), ``torch``, or ``triton`` (on CPU tensors this needs ``TRITON_INTERPRET=1``: the CUDA code
path then runs in Triton's interpreter, which is how the tests check it without a GPU).

Two things are chosen per device, both here:

* the **numerics family** (:func:`kernel_family`): :mod:`.torch_family` or :mod:`.triton_family`, the
  kernels behind ``fp8pass.quantize`` (bit-identical to each other);
* the **device module** of the runtime ops (:func:`for_device`): :mod:`.cpu` for CPU tensors,
  :mod:`.cuda` for CUDA tensors and for CPU tensors under ``FP8PASS_KERNELS=triton``. What each offers
  is declared in its ``OFFERS`` (:mod:`.interface`); callers read that, never probe the module.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from types import ModuleType

import torch

__all__ = ["ENV", "FAMILIES", "requested", "forced", "family_name", "kernel_family", "uses_triton", "for_device",
           "triton_available"]

ENV = "FP8PASS_KERNELS"
FAMILIES = ("auto", "torch", "triton")


def requested() -> str:
    """The family ``FP8PASS_KERNELS`` asks for ("auto" when unset); a clear error for any other value."""
    choice = os.environ.get(ENV, "auto").lower()
    if choice not in FAMILIES:
        raise ValueError(f"{ENV}={choice!r} is not one of {', '.join(FAMILIES)}")
    return choice


def forced() -> bool:
    """Whether ``FP8PASS_KERNELS`` names a family (not "auto"): automatic choices defer to it."""
    return requested() != "auto"


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """Whether triton is installed (it is an optional dependency: ``pip install fp8pass[triton]``)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a broken or blocked installation counts as none
        return False


def family_name(device: torch.device | str) -> str:
    """'torch' or 'triton': the numerics family for ``device``, honouring ``FP8PASS_KERNELS``."""
    choice = requested()
    device = torch.device(device)
    if choice == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if choice == "triton":
        _check_triton(device)
    return choice


def kernel_family(device: torch.device | str) -> ModuleType:
    """The numerics kernels for ``device``: :mod:`.torch_family` or :mod:`.triton_family`."""
    if family_name(device) == "triton":
        from . import triton_family

        return triton_family
    from . import torch_family

    return torch_family


def uses_triton(device: torch.device | str) -> bool:
    """Whether the runtime ops on ``device`` take the CUDA module (Triton kernels, ``_scaled_mm`` GEMMs)."""
    device = torch.device(device)
    return device.type == "cuda" or (device.type == "cpu" and family_name(device) == "triton")


def run_fused(fn, tensors: tuple, static: tuple = ()):
    """``fn(*tensors, *static)``, as one Inductor-compiled loop nest where the CPU module runs the ops
    (``cpu.run_fused``: large CPU inputs), eager torch ops elsewhere: on a GPU, and on the CUDA code path
    run on CPU, which must issue what CUDA issues (the launch counter counts it)."""
    if uses_triton(tensors[0].device):
        return fn(*tensors, *static)
    from . import cpu

    return cpu.run_fused(fn, tensors, static)


def for_device(device: torch.device | str) -> ModuleType:
    """The device module of the runtime ops for tensors on ``device``; a clear error where none exists."""
    device = torch.device(device)
    if device.type == "cpu" and not uses_triton(device):
        from . import cpu

        return cpu
    if device.type in ("cuda", "cpu"):
        _check_triton(device)
        from . import cuda

        return cuda
    raise RuntimeError(
        f"fp8pass runtime ops have no kernels for device type {device.type!r} (supported: cpu, cuda)"
    )


def _check_triton(device: torch.device) -> None:
    if not triton_available():
        raise RuntimeError(
            f"fp8pass's kernels for {device.type} tensors here are Triton kernels, and triton is not installed: "
            "pip install 'fp8pass[triton]' (CUDA builds of torch bring it), or use the torch kernels on CPU "
            f"({ENV}=torch)")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"{ENV}=triton on CPU tensors needs Triton's interpreter: set TRITON_INTERPRET=1 "
            f"before importing triton (or use {ENV}=torch)"
        )
