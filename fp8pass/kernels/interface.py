"""What a device module of the runtime ops offers: declared in its ``OFFERS``, never probed.

Every device module (:mod:`.cpu`, :mod:`.cuda`) provides the :data:`COMMON` functions. Beyond them it
declares an :class:`Offers`; each offer stands for the functions in :data:`OFFER_FUNCTIONS`, which the
module has exactly when it declares the offer (tests/kernels/test_kernel_families.py checks both ways), so a
caller asks ``kern.OFFERS.transpose_cast`` where it once asked ``hasattr(kern, "transpose_cast")``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import ModuleType

__all__ = ["COMMON", "OFFER_FUNCTIONS", "Offers", "declaration_errors"]

COMMON = ("cast", "cast_stochastic", "upcast", "gemm_tensor_scaled", "row_amax", "cast_rows", "grouped_gemm",
          "grouped_gemm_wgrad")


@dataclass(frozen=True)
class Offers:
    """What a device module does beyond the common functions.

    Args:
        scale_on_device: ``cast_delayed`` / ``cast_current``: the scale is picked on the device in the
            cast's own launches (delayed: from the state; current: from the amax the cast reduces), so
            no scale is computed by separate torch ops.
        transpose_cast: ``transpose_cast``: one read writes the codes in both layouts (the GEMMs of the
            backward take the transposed copy).
        values_without_codes: ``cast_values``: a GEMM-only operand cast straight to its GEMM dtype, no
            codes written (the CPU emulation's GEMMs take upcast values).
        upcast_gemm_operands: ``gemm_dtype`` / ``fused_enabled``: the GEMMs take FP8 codes upcast to a
            wider dtype (``gemm_dtype``), which the casts can write beside the codes; without it the
            GEMMs take the codes themselves.
        grouped_casts: ``cast_grouped``: rows grouped by expert (or stacked expert weights) cast with
            per-expert scales picked on the device, in a number of launches that does not depend on the
            number of experts, with the per-row decode scales the grouped GEMM takes.
        grouped_glu: ``grouped_glu_operand`` / ``grouped_glu_backward``: the grouped GLU tail's activation
            (``act(gate) * up`` with per-expert channel smoothing, and its backward) as kernels, in a
            number of launches that does not depend on the number of experts (``GLU_ACTIVATIONS``: the
            activations they take).
        fused_norm: ``rmsnorm_forward`` / ``rmsnorm_backward``: ``fp8pass::rmsnorm`` (the norm that saves its
            normalized input as FP8) in two launches each way, for the norms ``norm_supported`` accepts.
    """

    scale_on_device: bool
    transpose_cast: bool
    values_without_codes: bool
    upcast_gemm_operands: bool
    grouped_casts: bool = False
    grouped_glu: bool = False
    fused_norm: bool = False


OFFER_FUNCTIONS = {
    "scale_on_device": ("cast_delayed", "cast_current"),
    "transpose_cast": ("transpose_cast",),
    "values_without_codes": ("cast_values",),
    "upcast_gemm_operands": ("gemm_dtype", "fused_enabled"),
    "grouped_casts": ("cast_grouped",),
    "grouped_glu": ("grouped_glu_operand", "grouped_glu_backward"),
    "fused_norm": ("norm_supported", "rmsnorm_forward", "rmsnorm_backward"),
}


def declaration_errors(module: ModuleType) -> list[str]:
    """Where ``module``'s functions and its declared ``OFFERS`` disagree (empty when they agree)."""
    offers = getattr(module, "OFFERS", None)
    if not isinstance(offers, Offers):
        return [f"{module.__name__} declares no OFFERS"]
    errors = [f"{module.__name__} lacks common function {n}" for n in COMMON if not callable(getattr(module, n, None))]
    for field in dataclasses.fields(Offers):
        declared = getattr(offers, field.name)
        for name in OFFER_FUNCTIONS[field.name]:
            has = callable(getattr(module, name, None))
            if has != declared:
                errors.append(f"{module.__name__}.OFFERS.{field.name} is {declared} but {name} is "
                              f"{'present' if has else 'absent'}")
    return errors
