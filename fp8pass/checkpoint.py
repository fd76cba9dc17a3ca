"""Exact-resume checkpoints for your own training loop: model (with its scaling state), optimizer, RNG.

Stochastic rounding of the gradients draws its bits from torch's default generators (the CPU one,
and each CUDA device's), so a resume that restores weights, optimizer and scaling state but not
those generators rounds differently from the first resumed backward on. :func:`checkpoint_state`
carries all of it as plain tensors, numbers and containers (``torch.load(weights_only=True)``
reads it)::

    torch.save(fp8pass.checkpoint_state(model, optimizer), path)
    ...  # fresh process: build model and optimizer as before
    fp8pass.load_checkpoint_state(model, optimizer, torch.load(path, weights_only=True), config=cfg)
    model.compile(backend=fp8pass.backend(cfg))

Call it between steps (after ``optimizer.step()``), like any checkpoint.
"""

from __future__ import annotations

import torch

from .config import Config
from .scaling_state import _unwrap, attach

__all__ = ["checkpoint_state", "load_checkpoint_state", "torch_rng_state", "set_torch_rng_state"]


def torch_rng_state() -> dict:
    """The states of torch's default generators: CPU, and every CUDA device once CUDA is in use."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    return {"cpu": torch.get_rng_state(), "cuda": list(cuda)}


def set_torch_rng_state(state: dict) -> None:
    """Restore :func:`torch_rng_state` (CUDA states only where they were saved)."""
    torch.set_rng_state(state["cpu"])
    if state.get("cuda"):
        if not torch.cuda.is_available() or torch.cuda.device_count() < len(state["cuda"]):
            raise RuntimeError(f"the checkpoint holds the RNG state of {len(state['cuda'])} CUDA devices; "
                               f"this process sees {torch.cuda.device_count() if torch.cuda.is_available() else 0}")
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoint_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Everything an exact resume needs: ``{"model", "optimizer", "rng"}``.

    ``"model"`` is ``model.state_dict()`` of the module under a ``torch.compile`` wrapper (no
    ``_orig_mod.`` prefix), which carries the FP8 scaling state (see :mod:`fp8pass.scaling_state`);
    ``"rng"`` is :func:`torch_rng_state`.
    """
    attach(model)  # the hooks, also where no compiled step registered them yet
    return {"model": _unwrap(model).state_dict(),
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "rng": torch_rng_state()}


def load_checkpoint_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, state: dict,
                          config: Config | None = None, strict: bool = True) -> None:
    """Restore a :func:`checkpoint_state`, before or after compiling ``model``.

    Args:
        model: the model (compiled or not).
        optimizer: its optimizer, or None.
        state: from :func:`checkpoint_state`.
        config: the Config the model is compiled with (creates the scaling state of a model that has
            not run a compiled step yet; default ``Config()``).
        strict: passed to ``model.load_state_dict``.
    """
    attach(model, config)
    _unwrap(model).load_state_dict(state["model"], strict=strict)
    if optimizer is not None and state.get("optimizer") is not None:
        optimizer.load_state_dict(state["optimizer"])
    set_torch_rng_state(state["rng"])
