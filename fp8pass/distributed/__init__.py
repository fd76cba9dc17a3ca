"""Data-parallel and sharded FP8 training on torch.distributed (DDP, FSDP2 ``fully_shard``).

* :class:`AmaxSync` / :func:`sync_scaling_state`: every delayed-scaling amax reduced across the
  data-parallel group in one ``all_reduce(MAX)`` per step, so all ranks use identical scales.

See docs/distributed.md for the recipe and a torchrun example.
"""

from .amax_sync import AmaxSync, scaling_states, sync_scaling_state
from .fsdp import fsdp_params, unsharded_params

__all__ = ["AmaxSync", "scaling_states", "sync_scaling_state", "fsdp_params", "unsharded_params"]
