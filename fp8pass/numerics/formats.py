"""Low-precision number formats as plain objects.

A :class:`Format` describes a sign-exponent-mantissa format well enough to round onto its grid:
exponent and mantissa widths, the exponent bias, the largest finite value (which may be lower than
what the encoding allows: E4M3_GAUDI uses the E4M3 encoding clamped to +-240), and how NaN is coded.

Formats that torch has a dtype for (E4M3, E5M2) store their codes in that dtype; E2M1 (NVFP4/MXFP4
element) has no usable torch dtype on every supported torch version, so its codes are packed two per
``uint8`` byte (element ``2k`` in the low nibble, ``2k+1`` in the high nibble, as in the PTX
``cvt.e2m1x2`` and torch ``float4_e2m1fn_x2`` conventions).

E8M0 is the MX block-scale format: an unsigned power of two, ``2**(code - 127)``; code 255 is NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "Format",
    "E4M3",
    "E4M3_GAUDI",
    "E5M2",
    "E2M1",
    "E8M0",
    "FORMATS",
    "get_format",
]


@dataclass(frozen=True)
class Format:
    """A floating-point element or scale format.

    Args:
        name: canonical lower-case name ("e4m3", "e5m2", ...).
        ebits: exponent bits.
        mbits: explicit mantissa bits.
        bias: exponent bias.
        max: largest finite magnitude a saturating cast produces.
        nan_code: the code written for NaN inputs, or None when the format has no NaN (E2M1).
        torch_dtype: the torch dtype holding one code, or None when codes are packed in uint8.
        signed: False only for the unsigned scale format E8M0.
    """

    name: str
    ebits: int
    mbits: int
    bias: int
    max: float
    nan_code: int | None
    torch_dtype: torch.dtype | None
    signed: bool = True

    @property
    def bits(self) -> int:
        return int(self.signed) + self.ebits + self.mbits

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal number."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """Exponent of the largest power of two not above ``max`` (E4M3 8, E5M2 15, E2M1 2): what the
        OCP MX shared scale subtracts from a block's exponent."""
        return int(math.floor(math.log2(self.max)))

    @property
    def min_normal(self) -> float:
        return 2.0**self.emin

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (self.emin - self.mbits)

    @property
    def max_code(self) -> int:
        """Code (without sign) of ``max``: codes grow monotonically with magnitude."""
        exp = math.frexp(self.max)[1] - 1  # floor(log2(max)), exact, on the host
        mant = int(round((self.max / 2.0**exp - 1.0) * 2**self.mbits))
        return ((exp + self.bias) << self.mbits) | mant

    @property
    def packed(self) -> bool:
        """True when two codes share one uint8 byte."""
        return self.torch_dtype is None and self.bits <= 4

    def __repr__(self) -> str:  # short, so reports and errors stay readable
        return f"Format({self.name}, max={self.max:g})"


E4M3 = Format("e4m3", ebits=4, mbits=3, bias=7, max=448.0, nan_code=0x7F, torch_dtype=torch.float8_e4m3fn)
E4M3_GAUDI = Format(
    "e4m3_gaudi", ebits=4, mbits=3, bias=7, max=240.0, nan_code=0x7F, torch_dtype=torch.float8_e4m3fn
)
E5M2 = Format("e5m2", ebits=5, mbits=2, bias=15, max=57344.0, nan_code=0x7F, torch_dtype=torch.float8_e5m2)
E2M1 = Format("e2m1", ebits=2, mbits=1, bias=1, max=6.0, nan_code=None, torch_dtype=None)
E8M0 = Format(
    "e8m0", ebits=8, mbits=0, bias=127, max=2.0**127, nan_code=0xFF, torch_dtype=None, signed=False
)

FORMATS: dict[str, Format] = {f.name: f for f in (E4M3, E4M3_GAUDI, E5M2, E2M1, E8M0)}
_ALIASES = {"float8_e4m3fn": "e4m3", "fp8_e4m3": "e4m3", "float8_e5m2": "e5m2", "fp8_e5m2": "e5m2",
            "fp4": "e2m1", "float4_e2m1fn": "e2m1", "nvfp4": "e2m1"}


def get_format(fmt: Format | str) -> Format:
    """Return the Format for a Format or a name; raise ValueError listing valid names otherwise."""
    if isinstance(fmt, Format):
        return fmt
    if isinstance(fmt, str):
        key = fmt.lower()
        key = _ALIASES.get(key, key)
        if key in FORMATS:
            return FORMATS[key]
    raise ValueError(
        f"unknown format {fmt!r}; valid formats: {', '.join(sorted(FORMATS))} "
        f"(or the objects fp8pass.E4M3, E4M3_GAUDI, E5M2, E2M1, E8M0)"
    )
