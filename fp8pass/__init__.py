"""fp8pass: FP8 training of Llama-style models as a one-line change, ``torch.compile(model, backend="fp8")``.

This module holds the public API only (docs/backend.md describes the layout). ``monitor``, ``train``
and ``distributed`` load on first use: they pull in ``torch.distributed.checkpoint`` and friends,
which a ``backend="fp8"`` compile never needs.
"""

import importlib

from . import (
    ops,  # noqa: E402  (fp8pass.ops.fp8_linear, fp8pass.ops.swiglu_mlp; registers the ops)
    optim,  # noqa: E402
    recipes,  # noqa: E402  (the recipe registry: fp8pass.recipes.RECIPES)
)
from .checkpoint import checkpoint_state, load_checkpoint_state, load_scaling_state_dict, scaling_state_dict  # noqa: E402
from .compile_backend import backend  # noqa: E402
from .config import Config, CurrentScaling, DelayedScaling, DriftCheck, HotChannelPatching, NVFP4Scaling, Rule, Switch
from .memory import offload_saved_activations
from .model_report import explain  # noqa: E402
from .numerics import (
    E2M1,
    E4M3,
    E4M3_GAUDI,
    E5M2,
    E8M0,
    DelayedScalingState,
    Format,
    get_format,
)
from .precision_file import load_rules  # noqa: E402
from .precision_switch import PrecisionSwitch, apply_schedule, precision_switches, switch_precision  # noqa: E402
from .quantized import Quantized, quantize, quantize_delayed
from .runtime.state import accumulate_scaling, commit_scaling  # noqa: E402

__version__ = "0.1.0"

_LAZY_SUBMODULES = ("monitor", "train", "distributed")

__all__ = [
    "Config", "CurrentScaling", "DelayedScaling", "backend", "explain", "ops", "optim",
    "scaling_state_dict", "load_scaling_state_dict", "accumulate_scaling", "commit_scaling", "checkpoint_state",
    "load_checkpoint_state",
    "monitor", "train", "distributed",
    "E2M1", "E4M3", "E4M3_GAUDI", "E5M2", "E8M0", "Format", "get_format",
    "Quantized", "quantize", "quantize_delayed", "DelayedScalingState",
    "NVFP4Scaling", "HotChannelPatching", "recipes", "Rule", "load_rules", "DriftCheck",
    "switch_precision", "precision_switches", "PrecisionSwitch", "Switch", "apply_schedule",
    "offload_saved_activations",
]


def __getattr__(name: str):
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f".{name}", __name__)  # the import also sets the attribute
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(__all__) | {k for k in globals() if k.startswith("__") and k.endswith("__")})
