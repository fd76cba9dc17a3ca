"""Save and restore the delayed-scaling state of a model as plain tensors keyed by parameter FQN.

The state lives beside the weights (``fp8pass.runtime.state``, keyed by the Parameter object), not
in the module, so ``model.state_dict()`` is unchanged and still loads strictly into a model that
never used fp8pass. Keys: ``"<param FQN>.<role>.<field>"`` with role ``input`` / ``weight`` /
``grad_output`` and field ``amax_history`` / ``scale`` / ``steps`` / ``skipped``, e.g.
``"layers.0.mlp.down_proj.weight.grad_output.amax_history"``. For tied weights the state is stored
once, under the first FQN ``named_parameters()`` gives.

Usage::

    torch.save({"model": model.state_dict(), "fp8": fp8pass.scaling_state_dict(model)}, path)
    ...
    model.load_state_dict(ck["model"])
    fp8pass.load_scaling_state_dict(model, ck["fp8"], config=cfg)   # before or after compiling
"""

from __future__ import annotations

import torch

from .config import Config, DelayedScaling
from .runtime.state import ROLES, _REGISTRY, state_for

__all__ = ["scaling_state_dict", "load_scaling_state_dict"]

_FIELDS = ("amax_history", "scale", "steps", "skipped")


def scaling_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """All delayed-scaling state of ``model``'s weights (cloned plain tensors; empty before step 1)."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        st = _REGISTRY.get(p)
        if st is None:
            continue
        for k, v in st.state_dict().items():
            out[f"{name}.{k}"] = v
    return out


def load_scaling_state_dict(model: torch.nn.Module, state_dict: dict[str, torch.Tensor],
                            config: Config | None = None, strict: bool = True) -> None:
    """Load a :func:`scaling_state_dict` into ``model``'s weights (copies into live state tensors).

    Args:
        model: the model (compiled or not; a compiled model's graphs see the loaded values at once).
        state_dict: from :func:`scaling_state_dict`.
        config: the Config the model is compiled with (its recipe and formats create missing states;
            default ``Config()``). The history length is taken from the saved tensors.
        strict: raise on keys that name no parameter of ``model``.
    """
    cfg = config or Config()
    if not isinstance(cfg.recipe, DelayedScaling):
        if state_dict:
            raise ValueError("load_scaling_state_dict: the config uses CurrentScaling, which keeps no "
                             "state; pass the Config with the DelayedScaling recipe the state was saved under")
        return
    params = dict(model.named_parameters())
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    unknown = []
    for key, v in state_dict.items():
        parts = key.rsplit(".", 2)
        if len(parts) != 3 or parts[1] not in ROLES or parts[2] not in _FIELDS or parts[0] not in params:
            unknown.append(key)
            continue
        grouped.setdefault(parts[0], {})[f"{parts[1]}.{parts[2]}"] = v
    if unknown and strict:
        raise KeyError(f"load_scaling_state_dict: keys that name no parameter role of this model: "
                       f"{unknown[:5]}{' ...' if len(unknown) > 5 else ''} (strict=False ignores them)")
    for name, sd in grouped.items():
        p = params[name]
        hist = sd.get("input.amax_history")
        recipe = cfg.recipe
        if hist is not None and hist.numel() != recipe.history_len:
            raise ValueError(f"{name}: saved amax_history has {hist.numel()} entries, the config's recipe "
                             f"history_len={recipe.history_len}; pass the config the state was saved with")
        fwd = cfg.fwd_format if cfg.fwd_format != "identity" else "e4m3"
        bwd = cfg.bwd_format if cfg.bwd_format != "identity" else "e5m2"
        state_for(p, recipe, fwd, bwd).load_state_dict({k: t.to(p.device) for k, t in sd.items()})
