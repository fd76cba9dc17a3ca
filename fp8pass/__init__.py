"""fp8pass: FP8 training of Llama-style models as a one-line change, ``torch.compile(model, backend="fp8")``.

This module holds the public API only; see DESIGN.md for the layout.
"""

from .config import Config, CurrentScaling, DelayedScaling, HotChannelPatching, NVFP4Scaling
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
    quantize_delayed,
)

from . import ops  # noqa: E402  (fp8pass.ops.fp8_linear, fp8pass.ops.swiglu_mlp; registers the ops)
from . import optim  # noqa: E402
from .backend import backend, explain  # noqa: E402
from .scaling_state import load_scaling_state_dict, scaling_state_dict  # noqa: E402
from . import monitor, train  # noqa: E402
from . import distributed  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "Config", "CurrentScaling", "DelayedScaling", "backend", "explain", "ops", "optim",
    "scaling_state_dict", "load_scaling_state_dict", "monitor", "train", "distributed",
    "E2M1", "E4M3", "E4M3_GAUDI", "E5M2", "E8M0", "Format", "get_format",
    "Quantized", "quantize", "quantize_delayed", "DelayedScalingState",
    "NVFP4Scaling", "HotChannelPatching",
]
