"""Data-parallel and sharded FP8 training on torch.distributed (DDP, FSDP2 ``fully_shard``).

* :class:`AmaxSync` / :func:`sync_scaling_state`: every delayed-scaling amax reduced across the
  data-parallel group in one ``all_reduce(MAX)`` per step, so all ranks use identical scales.
* :func:`save_checkpoint` / :func:`load_checkpoint`: DCP of model + FP8 optimizer + scaling state,
  resharding from N ranks to M.
* :func:`enable_fp8_all_gather`: FSDP2 all-gathers FP8 weights as FP8 codes (half the bytes of bf16).

See docs/distributed.md for the recipe and a torchrun example.
"""

from .amax_sync import AmaxSync, scaling_states, sync_scaling_state
from .checkpoint import (distributed_scaling_state_dict, load_checkpoint, load_distributed_scaling_state_dict,
                         save_checkpoint)
from .fp8_all_gather import (FP8ShardWeight, GatherStats, enable_fp8_all_gather, fp8_all_gather_weights,
                             link_fp8_all_gather, precompute_fp8_scales)
from .fsdp import fsdp_params, unsharded_params

__all__ = ["AmaxSync", "scaling_states", "sync_scaling_state", "save_checkpoint", "load_checkpoint",
           "distributed_scaling_state_dict", "load_distributed_scaling_state_dict", "fsdp_params",
           "unsharded_params", "FP8ShardWeight", "GatherStats", "enable_fp8_all_gather",
           "fp8_all_gather_weights", "link_fp8_all_gather", "precompute_fp8_scales"]
