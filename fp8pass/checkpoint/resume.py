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

:func:`save` / :func:`load` do the file part too: an fsynced temp file renamed into place, a
SHA-256 manifest beside it (``path.manifest.json``, see :mod:`fp8pass.checkpoint.files`) verified before
anything is unpickled, and errors that name the file::

    fp8pass.checkpoint.save("ckpt.pt", model, optimizer)
    fp8pass.checkpoint.load("ckpt.pt", model, optimizer, config=cfg)

Every load path validates the state before loading it (shapes equal to the model's, checked before
any value is computed on; weights and moments finite, scales finite and > 0, amax histories finite
and >= 0, counters in range) and raises :class:`~fp8pass.checkpoint.CheckpointError` naming the key.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..config import Config, DelayedScaling
from .errors import CheckpointError
from .files import load_file, save_file
from .optimizer_checks import check_optimizer_state, saved_param_shapes
from .rng import set_torch_rng_state, torch_rng_state
from .scaling_checks import check_model_state_dict
from .scaling_state import _unwrap, attach
from .weight_checks import check_weights

__all__ = ["checkpoint_state", "load_checkpoint_state", "save", "load"]


def checkpoint_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Everything an exact resume needs: ``{"model", "optimizer", "rng"}``.

    ``"model"`` is ``model.state_dict()`` of the module under a ``torch.compile`` wrapper (no
    ``_orig_mod.`` prefix), which carries the FP8 scaling state (see :mod:`fp8pass.checkpoint.scaling_state`);
    ``"rng"`` is :func:`torch_rng_state`.
    """
    attach(model)  # the hooks, also where no compiled step registered them yet
    return {"model": _unwrap(model).state_dict(),
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "rng": torch_rng_state()}


def load_checkpoint_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, state: dict,
                          config: Config | None = None, strict: bool = True) -> None:
    """Restore a :func:`checkpoint_state`, before or after compiling ``model``.

    The state is validated before anything is loaded (see the module docstring).

    Args:
        model: the model (compiled or not).
        optimizer: its optimizer, or None.
        state: from :func:`checkpoint_state`.
        config: the Config the model is compiled with (creates the scaling state of a model that has
            not run a compiled step yet; default ``Config()``).
        strict: passed to ``model.load_state_dict``.

    Raises:
        CheckpointError: a value out of range or a shape that differs from the model's, naming the key.
    """
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict) or "rng" not in state:
        raise CheckpointError("not a checkpoint_state(): expected a dict with 'model', 'optimizer' and 'rng'")
    cfg = config or Config()
    shapes = {n: tuple(p.shape) for n, p in _unwrap(model).named_parameters()}
    check_weights(state["model"], shapes)
    check_model_state_dict(state["model"], shapes,
                           cfg.recipe.history_len if isinstance(cfg.recipe, DelayedScaling) else None)
    opt_state = state.get("optimizer")
    if optimizer is not None and opt_state is not None:
        names = {id(p): n for n, p in _unwrap(model).named_parameters()}
        check_optimizer_state(opt_state, params=saved_param_shapes(optimizer, opt_state, names))
    attach(model, config)
    _unwrap(model).load_state_dict(state["model"], strict=strict)
    if optimizer is not None and opt_state is not None:
        optimizer.load_state_dict(opt_state)
    set_torch_rng_state(state["rng"])


def save(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Path:
    """Write :func:`checkpoint_state` to ``path`` with its manifest (see
    :func:`~fp8pass.checkpoint.files.save_file`). Returns ``path``.

    Raises:
        CheckpointError: a weight or an optimizer moment is not finite (nothing is written, a previous
            ``path`` stays as it was), or the write failed (see :func:`~fp8pass.checkpoint.files.save_file`).
    """
    state = checkpoint_state(model, optimizer)
    names = {id(p): n for n, p in _unwrap(model).named_parameters()}
    try:  # a checkpoint that cannot resume training must not replace one that can
        check_weights(state["model"], {n: tuple(p.shape) for n, p in _unwrap(model).named_parameters()})
        if optimizer is not None:
            check_optimizer_state(state["optimizer"], params=saved_param_shapes(optimizer, state["optimizer"], names))
    except CheckpointError as e:
        raise CheckpointError(f"{path}: not saved, {e}; the previous checkpoint there (if any) is intact") from None
    return save_file(path, state)


def load(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
         config: Config | None = None, strict: bool = True, allow_unverified: bool | None = None) -> None:
    """Verify, validate and restore a :func:`save` (see :func:`~fp8pass.checkpoint.files.load_file`,
    :func:`load_checkpoint_state`)."""
    load_checkpoint_state(model, optimizer, load_file(path, allow_unverified), config=config, strict=strict)
