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
SHA-256 manifest beside it (``path.manifest.json``, see :mod:`fp8pass.integrity`) verified before
anything is unpickled, and errors that name the file::

    fp8pass.checkpoint.save("ckpt.pt", model, optimizer)
    fp8pass.checkpoint.load("ckpt.pt", model, optimizer, config=cfg)

Every load path validates the state before loading it (shapes equal to the model's, checked before
any value is computed on; weights and moments finite, scales finite and > 0, amax histories finite
and >= 0, counters in range) and raises :class:`~fp8pass.integrity.CheckpointError` naming the key.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import torch

from .config import Config, DelayedScaling
from .integrity import CheckpointError, read_verified, write_with_manifest
from .optim.state_check import check_optimizer_state, saved_param_shapes
from .scaling_checks import check_model_state_dict
from .scaling_state import _unwrap, attach

__all__ = ["checkpoint_state", "load_checkpoint_state", "torch_rng_state", "set_torch_rng_state", "save", "load",
           "load_file", "save_file", "check_weights"]


def torch_rng_state() -> dict:
    """The states of torch's default generators: CPU, and every CUDA device once CUDA is in use."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    return {"cpu": torch.get_rng_state(), "cuda": list(cuda)}


def set_torch_rng_state(state: dict) -> None:
    """Restore :func:`torch_rng_state` (CUDA states only where they were saved)."""
    cpu = state.get("cpu") if isinstance(state, dict) else None
    want = torch.get_rng_state()
    if not isinstance(cpu, torch.Tensor) or cpu.dtype != want.dtype or cpu.shape != want.shape:
        raise CheckpointError(f"rng.cpu: expected a {want.dtype} tensor of shape {tuple(want.shape)} (torch's CPU "
                              f"generator state), got {getattr(cpu, 'dtype', type(cpu).__name__)} "
                              f"{tuple(getattr(cpu, 'shape', ()))}")
    torch.set_rng_state(cpu)
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


def check_weights(state_dict: dict, shapes: dict, prefix: str = "model") -> None:
    """The parameters of ``state_dict`` (keys of ``shapes``, the model's parameter shapes by FQN):
    each a tensor of the model's shape (checked before any value is read) and finite.

    Buffers are left out: a buffer may legitimately hold -inf (an attention mask).

    Raises:
        CheckpointError: naming the key.
    """
    present = [(k, state_dict[k]) for k in shapes if k in state_dict]
    for k, v in present:
        if not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(shapes[k]):
            raise CheckpointError(f"{prefix}.{k}: shape {tuple(getattr(v, 'shape', ()))}, the model has "
                                  f"{tuple(shapes[k])}")
    for k, v in present:
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            bad = v.reshape(-1)[~torch.isfinite(v.reshape(-1))][0].item()
            raise CheckpointError(f"{prefix}.{k}: weights must be finite, got {bad!r}; the state was saved after "
                                  "training diverged or a non-finite gradient reached the optimizer")


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


def save_file(path: str | os.PathLike, obj, verify=None) -> Path:
    """``torch.save(obj)`` to ``path`` with a SHA-256 manifest, both fsynced and renamed into place.

    ``verify(temp_path)`` may check the written file first (the previous ``path`` stays until it
    passes). Raises :class:`~fp8pass.integrity.CheckpointError` naming the file and the cause when
    the write fails (:class:`~fp8pass.integrity.DiskFullError` for lack of space).
    """
    return write_with_manifest(path, lambda f: torch.save(obj, f), verify)


def load_file(path: str | os.PathLike, allow_unverified: bool | None = None):
    """``torch.load(path, weights_only=True)`` of a :func:`save_file`, verified against its manifest.

    Raises:
        FileNotFoundError: no such file.
        CheckpointError: the file differs from its manifest, has none (unless ``allow_unverified``,
            see :mod:`fp8pass.integrity`), or is not a readable checkpoint (truncated, empty,
            corrupted); the message names the file.
    """
    path = Path(path)
    data = read_verified(path, allow_unverified)
    if not data:
        raise CheckpointError(f"{path}: empty file, not a checkpoint")
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # torch.load raises many types for damaged files (RuntimeError, UnpicklingError, ...)
        raise CheckpointError(f"{path}: not a readable checkpoint ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}); it is truncated or corrupted, or not "
                              "written by torch.save") from None


def save(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Path:
    """Write :func:`checkpoint_state` to ``path`` with its manifest (see :func:`save_file`). Returns ``path``.

    Raises:
        CheckpointError: a weight or an optimizer moment is not finite (nothing is written, a previous
            ``path`` stays as it was), or the write failed (see :func:`save_file`).
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
    """Verify, validate and restore a :func:`save` (see :func:`load_file`, :func:`load_checkpoint_state`)."""
    load_checkpoint_state(model, optimizer, load_file(path, allow_unverified), config=config, strict=strict)
