"""Data-parallel and sharded FP8 training on torch.distributed (DDP, FSDP2 ``fully_shard``).

* Automatic amax agreement: the compile backend reduces every delayed-scaling amax across the
  data-parallel group in one ``all_reduce(MAX)`` per backward (``Config(amax_reduction=...)``,
  :class:`AmaxReducer`), so all ranks use identical scales with no call in the loop.
* :class:`AmaxSync` / :func:`sync_scaling_state`: the same reduction, called by hand (custom loops,
  ``amax_reduction="off"``).
* :func:`save_checkpoint` / :func:`load_checkpoint`: DCP of model + FP8 optimizer + scaling state,
  resharding from N ranks to M.
* :func:`enable_fp8_all_gather`: FSDP2 all-gathers FP8 weights as FP8 codes (half the bytes of bf16).
* Tensor parallel: DTensor sharding rules for every fp8pass op (``tensor_parallel``, registered by the
  backend when a graph has DTensor inputs); the amax reduction over the world covers both dims of an
  FSDP2 x TP mesh.

See docs/distributed.md for the recipe and a torchrun example.
"""

import importlib

from .amax_sync import AmaxSync, scaling_states, sync_scaling_state
from .auto_reduce import AmaxReducer
from .fsdp import fsdp_params, unsharded_params

# Loaded on first use: they pull in torch.distributed.checkpoint / FSDP2, which the compile backend's
# automatic amax reduction (imported with fp8pass) never needs.
_LAZY = {
    "save_checkpoint": "checkpoint", "load_checkpoint": "checkpoint",
    "distributed_scaling_state_dict": "checkpoint", "load_distributed_scaling_state_dict": "checkpoint",
    "FP8ShardWeight": "fp8_all_gather", "GatherStats": "fp8_all_gather", "enable_fp8_all_gather": "fp8_all_gather",
    "fp8_all_gather_weights": "fp8_all_gather", "link_fp8_all_gather": "fp8_all_gather",
    "precompute_fp8_scales": "fp8_all_gather",
}

__all__ = ["AmaxSync", "AmaxReducer", "scaling_states", "sync_scaling_state", "save_checkpoint", "load_checkpoint",
           "distributed_scaling_state_dict", "load_distributed_scaling_state_dict", "fsdp_params",
           "unsharded_params", "FP8ShardWeight", "GatherStats", "enable_fp8_all_gather",
           "fp8_all_gather_weights", "link_fp8_all_gather", "precompute_fp8_scales"]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(__all__) | {k for k in globals() if k.startswith("__") and k.endswith("__")})
