"""Numerics core: formats, saturating casts (RNE and stochastic), scales, delayed-scaling state.

The bottom layer: it imports nothing else from fp8pass (checked by the import-linter contract in
pyproject.toml). ``quantize`` picks a device kernel, so it lives above, in ``fp8pass.quantized``.
"""

from .casts import ROUNDINGS, decode, e8m0_encode, encode, pack_e2m1, saturating_cast, unpack_e2m1
from .formats import E2M1, E4M3, E4M3_GAUDI, E5M2, E8M0, FORMATS, Format, get_format
from .scaling import ROLES, DelayedScalingState, delayed_scaling_update, scale_from_amax

__all__ = [
    "ROUNDINGS", "decode", "e8m0_encode", "encode", "pack_e2m1", "saturating_cast", "unpack_e2m1",
    "E2M1", "E4M3", "E4M3_GAUDI", "E5M2", "E8M0", "FORMATS", "Format", "get_format",
    "ROLES", "DelayedScalingState", "delayed_scaling_update", "scale_from_amax",
]
