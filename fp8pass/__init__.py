"""fp8pass: FP8 training of Llama-style models as a one-line change, ``torch.compile(model, backend="fp8")``.

This module holds the public API only; see DESIGN.md for the layout.
"""

from .config import Config, CurrentScaling, DelayedScaling
from .numerics import (
    E2M1,
    E4M3,
    E4M3_GAUDI,
    E5M2,
    E8M0,
    DelayedScalingState,
    Format,
    Quantized,
    get_format,
    quantize,
)

from . import ops
from .backend import backend, explain
from .scaling_state import load_scaling_state_dict, scaling_state_dict
from . import monitor, optim, train
from . import distributed

__version__ = "0.1.0"

__all__ = [
    "Config", "CurrentScaling", "DelayedScaling", "backend", "explain", "ops",
    "scaling_state_dict", "load_scaling_state_dict", "monitor", "optim", "train", "distributed",
    "E2M1", "E4M3", "E4M3_GAUDI", "E5M2", "E8M0", "Format", "get_format",
    "Quantized", "quantize", "DelayedScalingState",
]
