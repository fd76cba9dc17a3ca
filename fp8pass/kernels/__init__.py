"""Every kernel of fp8pass, one module per concern, chosen per device by :mod:`.selection`.

=========================  =====================================================================================
:mod:`.selection`          the one reader of ``FP8PASS_KERNELS``: the numerics family and the device module
:mod:`.interface`          what a device module offers (``OFFERS``), declared, not probed
:mod:`.torch_family`       numerics kernels in torch ops (the reference the Triton kernels equal bit for bit)
:mod:`.triton_family`      numerics kernels in Triton: amax, cast, tile quantize
:mod:`.triton_helpers`     the shared in-kernel helpers: the one exact cast (``cast_codes``), Philox bits,
                           the in-kernel scale (``tile_scale``), NaN-propagating max, autotuning, HW detection
:mod:`.cpu`                device module, CPU: Inductor-compiled fused casts, bf16 GEMMs of upcast FP8 codes
:mod:`.cuda`               device module, CUDA: ``torch._scaled_mm`` GEMMs and the Triton kernels below
:mod:`.triton_operand_casts`  GEMM operands: transpose-cast (both layouts in one read), SwiGLU operand casts
:mod:`.triton_scaling`     scales from amaxes, delayed-scaling records, channel scales (one launch each)
:mod:`.triton_grouped_casts`  MoE operands: per-expert amax, scale and cast, the wgrad's aligned token layout
:mod:`.triton_glu`         SwiGLU backward from saved FP8 codes
:mod:`.triton_grouped_glu`  MoE GLU tail: per-expert channel maxima, the smoothed operand, the GLU backward
:mod:`.triton_norm`        ``fp8pass::rmsnorm`` (the norm saving FP8 ``x_hat``): forward and backward, 2 launches each
:mod:`.adam_layout`        the FP8 AdamW state layout and step scalars, shared by the torch path and the kernels
:mod:`.triton_adam`        the FP8 AdamW step, fused, many tensors per launch
:mod:`.triton_adam_split`  the same for scale blocks wider than one program
=========================  =====================================================================================

``FP8PASS_KERNELS=triton`` selects the CUDA module for CPU tensors too (its Triton kernels then run in
Triton's interpreter, ``TRITON_INTERPRET=1``; its GEMMs take a fallback, never ``_scaled_mm`` on CPU),
so the tests run the GPU code path on CPU. Triton is optional for CPU users: nothing here imports it
until a Triton kernel is chosen. An HPU module (Gaudi2: cast_to_fp8_v2 / fp8_gemm_v2) would be one
more device module declaring its ``OFFERS``; none ships untested.
"""

from __future__ import annotations

from .interface import COMMON, Offers
from .selection import (
           FAMILIES,
           family_name,
           for_device,
           forced,
           kernel_family,
           requested,
           run_fused,
           triton_available,
           uses_triton,
)

__all__ = ["COMMON", "FAMILIES", "Offers", "family_name", "for_device", "forced", "kernel_family", "requested",
           "run_fused", "triton_available", "uses_triton"]
