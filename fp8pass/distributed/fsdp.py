"""FSDP2 (``fully_shard``) support: the unsharded parameters the compiled blocks see.

FSDP2 all-gathers each sharded DTensor parameter into one persistent unsharded ``nn.Parameter``
(its storage is freed and re-allocated, the object stays), and swaps it onto the module for forward
and backward. A block compiled with backend "fp8" therefore keys its delayed-scaling state by that
unsharded Parameter. :func:`unsharded_params` finds them, with the FQNs of the sharded parameters,
so the amax sync and the scaling state dict can reach that state.
"""

from __future__ import annotations

import torch

from ..passes.annotate import fsdp_param_groups

__all__ = ["unsharded_params", "fsdp_params"]


def fsdp_params(model: torch.nn.Module):
    """``(fqn, FSDPParam)`` for every parameter managed by ``fully_shard`` inside ``model``."""
    by_id = {id(p): n for n, p in model.named_parameters()}
    for mod in model.modules():
        get_state = getattr(mod, "_get_fsdp_state", None)
        if get_state is None:
            continue
        for group in fsdp_param_groups(get_state()):
            for fp in group.fsdp_params:
                name = by_id.get(id(fp.sharded_param))
                if name is not None:
                    yield name, fp


def unsharded_params(model: torch.nn.Module):
    """``(fqn of the sharded parameter, unsharded Parameter)`` for those all-gathered at least once."""
    for name, fp in fsdp_params(model):
        up = getattr(fp, "_unsharded_param", None)
        if up is not None:
            yield name, up
