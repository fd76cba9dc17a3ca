"""``torch.distributed.checkpoint`` (DCP) of model, optimizer (FP8 moments) and FP8 scaling state.

Everything saved is a plain tensor or a DTensor: model weights and optimizer state come from
``torch.distributed.checkpoint.state_dict.get_state_dict`` (FQN keys, DDP / compile / FSDP2
wrappers removed); FP8 Adam moments are codes + per-block scales (plain tensors, DTensors under
FSDP2); the delayed-scaling state is ``{"<param FQN>.<role>.<field>": tensor}``, replicated (it is
identical on all ranks after :class:`~fp8pass.distributed.AmaxSync`). So a checkpoint written by N
ranks loads into M ranks, including one process without a process group.

Usage::

    fp8pass.distributed.save_checkpoint(path, model, optimizer)
    ...
    fp8pass.distributed.load_checkpoint(path, model, optimizer, config=cfg)
"""

from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ..config import Config, DelayedScaling
from ..runtime.state import state_for
from .amax_sync import _module_params, scaling_states

__all__ = ["save_checkpoint", "load_checkpoint", "distributed_scaling_state_dict", "load_distributed_scaling_state_dict"]

_WRAPPERS = ("module.", "_orig_mod.", "_checkpoint_wrapped_module.")


def _clean(fqn: str) -> str:
    """The FQN of the plain model (DDP's ``module.``, compile's ``_orig_mod.`` removed), as DCP keys it."""
    parts = [p for p in fqn.split(".") if p + "." not in _WRAPPERS]
    return ".".join(parts)


def distributed_scaling_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """:func:`fp8pass.scaling_state_dict` for wrapped models (DDP, compiled, FSDP2), by clean FQNs."""
    out = {}
    for key, s in scaling_states(model):
        for field, t in s.state_dict().items():
            out[f"{_clean(key)}.{field}"] = t
    return out


def load_distributed_scaling_state_dict(model: torch.nn.Module, sd: dict[str, torch.Tensor],
                                        config: Config | None = None) -> None:
    """Load a :func:`distributed_scaling_state_dict` into ``model``'s weights (creating missing state).

    Under FSDP2 the state belongs to the unsharded parameters; they exist after the first
    all-gather, so call this after ``model.unshard(); model.reshard()`` or one forward (
    :func:`load_checkpoint` does the former).
    """
    from ..scaling_state import _FIELDS
    from ..runtime.state import ROLES

    cfg = config or Config()
    if not isinstance(cfg.recipe, DelayedScaling):
        if sd:
            raise ValueError("the checkpoint holds delayed-scaling state but the config uses CurrentScaling; "
                             "pass the Config the model was trained with")
        return
    params = {}
    for name, p in _module_params(model):
        params[_clean(name)] = p  # unsharded (FSDP2) ones come last and win
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    for key, v in sd.items():
        parts = key.rsplit(".", 2)
        if len(parts) != 3 or parts[1] not in ROLES or parts[2] not in _FIELDS or parts[0] not in params:
            raise KeyError(f"scaling state key {key!r} names no parameter role of this model")
        grouped.setdefault(parts[0], {})[f"{parts[1]}.{parts[2]}"] = v
    fwd = cfg.fwd_format if cfg.fwd_format != "identity" else "e4m3"
    bwd = cfg.bwd_format if cfg.bwd_format != "identity" else "e5m2"
    for name, d in grouped.items():
        p = params[name]
        state_for(p, cfg.recipe, fwd, bwd).load_state_dict({k: t.to(p.device) for k, t in d.items()})


def _unshard_once(model: torch.nn.Module) -> None:
    """Make FSDP2 create its unsharded parameters (they own the scaling state)."""
    from .fsdp import fsdp_params

    if not any(True for _ in fsdp_params(model)):
        return
    for m in model.modules():
        if hasattr(m, "unshard") and hasattr(m, "reshard") and hasattr(m, "_get_fsdp_state"):
            m.unshard()
            m.reshard()


def _plain(sd):
    """``sd`` with FP8ShardWeight shards replaced by their plain data (same storage): DCP pickles
    local tensors, and the wrapper is only FSDP2's all-gather hook."""
    from .fp8_all_gather import FP8ShardWeight
    from ..optim.sharded import is_dtensor

    def conv(t):
        if is_dtensor(t) and isinstance(t._local_tensor, FP8ShardWeight):
            from torch.distributed.tensor import DTensor

            return DTensor.from_local(t._local_tensor._data, t.device_mesh, t.placements, run_check=False,
                                      shape=t.shape, stride=t.stride())
        if isinstance(t, FP8ShardWeight):
            return t._data
        if isinstance(t, dict):
            return {k: conv(v) for k, v in t.items()}
        return t

    return conv(sd)


def save_checkpoint(path: str | os.PathLike, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None, extra: dict | None = None) -> None:
    """Save model, optimizer and FP8 scaling state with DCP (every rank calls it).

    Args:
        path: checkpoint directory.
        model: the trained model (DDP, FSDP2, compiled, or plain).
        optimizer: e.g. ``fp8pass.optim.AdamW``; its FP8 moments are saved as codes + scales.
        extra: more plain tensors / DTensors to save (e.g. ``{"step": torch.tensor(step)}``).
    """
    msd, osd = get_state_dict(model, optimizer if optimizer is not None else [])
    sd = {"model": _plain(msd), "fp8": distributed_scaling_state_dict(model)}
    if optimizer is not None:
        sd["optim"] = _plain(osd)
    if extra:
        sd["extra"] = dict(extra)
    dcp.save(sd, checkpoint_id=str(path))


def load_checkpoint(path: str | os.PathLike, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None, config: Config | None = None,
                    extra: dict | None = None) -> None:
    """Load a :func:`save_checkpoint` into ``model`` (and ``optimizer``), resharding as needed.

    Args:
        path: checkpoint directory.
        model, optimizer: the new job's objects (any world size; FSDP2 or not).
        config: the fp8pass Config the model is compiled with (recipe of the scaling state).
        extra: templates for the saved ``extra`` entries; loaded in place.
    """
    _unshard_once(model)
    msd, osd = get_state_dict(model, optimizer if optimizer is not None else [])
    meta = dcp.FileSystemReader(str(path)).read_metadata()
    fp8 = {}
    for key, m in meta.state_dict_metadata.items():
        if key.startswith("fp8."):
            fp8[key[len("fp8."):]] = torch.empty(m.size, dtype=m.properties.dtype)
    sd = {"model": _plain(msd), "fp8": fp8}
    if optimizer is not None:
        sd["optim"] = _plain(osd)
    if extra:
        sd["extra"] = extra
    dcp.load(sd, checkpoint_id=str(path))
    set_state_dict(model, optimizer if optimizer is not None else [], model_state_dict=sd["model"],
                   optim_state_dict=sd.get("optim", {}))
    load_distributed_scaling_state_dict(model, sd["fp8"], config)
