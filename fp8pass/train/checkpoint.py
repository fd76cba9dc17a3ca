"""Checkpoints: model, optimizer, fp8 scaling state, RNG and data position as plain tensors.

Everything is saved as tensors, numbers, strings and containers, so ``torch.load(weights_only=True)``
reads it. The data position is the number of completed steps (batches are a function of
(seed, step), see :mod:`fp8pass.train.data`).

``checkpoint.pt`` is written to a temp file, fsynced, read back and validated like a resume would
(:func:`validate_checkpoint`: finite weights and moments too), and only then renamed over the
previous one, with its SHA-256 manifest ``checkpoint.pt.manifest.json`` (see :mod:`fp8pass.checkpoint.files`).
:func:`load_checkpoint` verifies the manifest, then validates everything it can before a model exists: the step
against the saved configuration, weight names and shapes against the model that configuration builds, the
scaling state and the optimizer state (:func:`validate_checkpoint`). Every failure is a
:class:`~fp8pass.checkpoint.CheckpointError` naming the file and the key.

This module holds what is the trainer's own: the file's entries and their validation against the model
its configuration builds (:mod:`fp8pass.train.model`, :mod:`fp8pass.train.recipes`). Everything else
(files and manifests, the RNG state, the checks of weights, scaling and optimizer state) is
:mod:`fp8pass.checkpoint`'s.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..checkpoint import (
    HCP_KEY,
    SCALING_KEY,
    SR_KEY,
    CheckpointError,
    check_model_state_dict,
    check_optimizer_state,
    check_rng_state,
    check_scaling_state_dict,
    check_weights,
    load_file,
    rng_state,
    save_file,
)
from ..config import DelayedScaling, NVFP4Scaling
from ..precision_file import rules_from_data, schedule_from_data
from ..switch_history import HISTORY_KEY, history_from_tensor
from .model import ModelConfig, TinyLlama
from .recipes import fp8_config, get_recipe, param_groups

__all__ = ["save_checkpoint", "load_checkpoint", "validate_checkpoint", "CHECKPOINT_NAME"]

CHECKPOINT_NAME = "checkpoint.pt"
FORMAT_VERSION = 1


def save_checkpoint(run_dir: str | os.PathLike, *, step: int, config: dict, model_state: dict,
                    optimizer_state: dict, scaling_state: dict | None, data_fingerprint: str,
                    loss_scaler_state: dict | None = None, grad_skips: int = 0) -> Path:
    """Write ``run_dir/checkpoint.pt`` and its manifest atomically (fsynced temp files + renames), so a
    kill never leaves half a file or a checkpoint its manifest rejects. ``loss_scaler_state``
    (:meth:`~fp8pass.train.loss_scale.LossScaler.state_dict`) is stored under ``"loss_scaler"``,
    ``grad_skips`` (steps skipped for a non-finite gradient norm) under ``"grad_skips"``.

    The new file is read back and validated (:func:`validate_checkpoint`) before it replaces the
    previous checkpoint.

    Raises:
        CheckpointError: the new checkpoint is invalid (e.g. a non-finite weight) or could not be
            written (:class:`~fp8pass.checkpoint.DiskFullError`); the previous checkpoint is intact.
    """
    ckpt = {"format": FORMAT_VERSION, "step": step, "config": config, "model": model_state,
            "optimizer": optimizer_state, "scaling": scaling_state, "rng": rng_state(),
            "data": {"position": step, "fingerprint": data_fingerprint}, "grad_skips": grad_skips}
    if loss_scaler_state is not None:
        ckpt["loss_scaler"] = loss_scaler_state
    path = Path(run_dir) / CHECKPOINT_NAME

    def verify(tmp: Path) -> None:
        try:
            validate_checkpoint(torch.load(tmp, map_location="cpu", weights_only=True))
        except CheckpointError as e:
            raise CheckpointError(f"{path}: the checkpoint of step {step} is not written ({e}); the previous "
                                  "checkpoint is intact") from None

    return save_file(path, ckpt, verify)


def load_checkpoint(run_dir: str | os.PathLike, allow_unverified: bool | None = None) -> dict:
    """Read, verify and validate ``run_dir/checkpoint.pt`` (or the file ``run_dir``).

    Args:
        run_dir: the run folder, or the checkpoint file.
        allow_unverified: load a checkpoint without manifest (with a warning); default: the
            ``FP8PASS_ALLOW_UNVERIFIED_CHECKPOINT`` environment variable (see :mod:`fp8pass.checkpoint.files`).

    Raises:
        FileNotFoundError: no checkpoint there.
        CheckpointError: corrupted, truncated, unverifiable or invalid, naming the file and the key.
    """
    path = Path(run_dir)
    if path.is_dir():
        path = path / CHECKPOINT_NAME
    if not path.exists():
        raise FileNotFoundError(f"--resume {run_dir}: no {CHECKPOINT_NAME} there (checkpoints are written "
                                "every --ckpt-every steps and at the end of a run)")
    ckpt = load_file(path, allow_unverified)
    try:
        validate_checkpoint(ckpt)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    return ckpt


def _int(key: str, v, lo: int, hi: int) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise CheckpointError(f"{key}: expected an integer in [{lo}, {hi}], got {v!r}")
    return v


def validate_checkpoint(ckpt) -> None:
    """Check a loaded trainer checkpoint against the model its own configuration builds.

    Rules: ``format`` is this version; ``step`` (= data position) an integer in ``[0, config.steps]``;
    the weights exactly the keys and shapes of ``TinyLlama(config.model)`` (shapes checked before any
    value is read), the parameters finite; ``grad_skips`` in ``[0, step]``; the delayed-scaling state
    (in the model state and under ``"scaling"``) valid for those weights and the recipe's history
    length (:func:`fp8pass.checkpoint.check_delayed_state`); the optimizer's state one entry per
    parameter at most, its ``step`` <= the checkpoint's step, FP8 moment scales finite and > 0, moment
    shapes the parameters' (:func:`fp8pass.checkpoint.check_optimizer_state`); the generator states
    valid (:func:`fp8pass.checkpoint.check_rng_state`).

    Raises:
        CheckpointError: naming the key.
    """
    if not isinstance(ckpt, dict):
        raise CheckpointError(f"not a trainer checkpoint (a {type(ckpt).__name__}, expected a dict)")
    if ckpt.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint format {ckpt.get('format')!r}, expected {FORMAT_VERSION}")
    missing = [k for k in ("step", "config", "model", "optimizer", "scaling", "rng", "data") if k not in ckpt]
    if missing:
        raise CheckpointError(f"missing entries {missing}")
    config = ckpt["config"]
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise CheckpointError("config: expected the run's configuration (a dict with 'model')")
    total = _int("config.steps", config.get("steps"), 1, 2**31 - 1)
    step = _int("step", ckpt["step"], 0, total)
    data = ckpt["data"]
    if not isinstance(data, dict) or data.get("position") != step or not isinstance(data.get("fingerprint"), str):
        raise CheckpointError(f"data: expected {{'position': {step}, 'fingerprint': str}}, got {data!r}")
    try:
        with torch.device("meta"):
            model = TinyLlama(ModelConfig(**config["model"]))
        recipe = get_recipe(config.get("recipe", "bf16"))
        fp8 = fp8_config(recipe, config.get("scaling", "delayed"), config.get("smooth", "channel"),
                         config.get("compiler", "inductor"),
                         rules_from_data(config.get("precision_rules", []), "config.precision_rules"),
                         config.get("eval_recipe"),
                         schedule_from_data(config.get("precision_schedule", []), "config.precision_schedule"),
                         ) if recipe.fp8 else None
    except (TypeError, ValueError, KeyError) as e:
        raise CheckpointError(f"config: cannot build the run's model ({e})") from None
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    msd = ckpt["model"]
    if not isinstance(msd, dict):
        raise CheckpointError("model: expected a state dict")
    marker = f".{SCALING_KEY}."
    state_keys = [k for k in msd if marker in k or f".{HCP_KEY}." in k or f".{SR_KEY}." in k]
    if HISTORY_KEY in msd and fp8 is None:  # the model's precision switches (checked with the state below)
        raise CheckpointError(f"model.{HISTORY_KEY}: precision switches in a run of recipe {config.get('recipe')!r}, "
                              "which has no FP8 linears")
    weights = {k: v for k, v in msd.items() if k not in set(state_keys) and k != HISTORY_KEY}
    extra, absent = sorted(set(weights) - set(want)), sorted(set(want) - set(weights))
    if extra or absent:
        raise CheckpointError(f"model: keys differ from the model of this configuration (missing {absent[:5]}, "
                              f"unexpected {extra[:5]})")
    for k, v in weights.items():
        if not isinstance(v, torch.Tensor) or tuple(v.shape) != want[k]:
            raise CheckpointError(f"model.{k}: shape {tuple(getattr(v, 'shape', ()))}, the model has {want[k]}")
    check_weights(weights, shapes)
    if "grad_skips" in ckpt:  # absent from checkpoints written before issue 33
        _int("grad_skips", ckpt["grad_skips"], 0, step)
    # every scaling the run's weights may use: the recipe's, its rules' and schedule's, the saved switches'
    scalings = [] if fp8 is None else [fp8.recipe, *(r.scaling for r in fp8.rules),
                                       *(r.scaling for sw in fp8.schedule for r in sw.rules)]
    if fp8 is not None and HISTORY_KEY in msd:
        try:
            saved = history_from_tensor(msd[HISTORY_KEY], f"model.{HISTORY_KEY}")
        except ValueError as e:
            raise CheckpointError(str(e)) from None
        scalings += [r.scaling for sw in saved for r in sw.rules]
    lengths = {r.history_len for r in scalings if isinstance(r, DelayedScaling)}
    history_len = next(iter(lengths)) if len(lengths) == 1 else None  # None: consistent within each weight
    kinds = (("delayed",) if lengths else ()) + (
        ("hcp",) if any(isinstance(r, NVFP4Scaling) and r.hcp is not None for r in scalings) else ())
    stray = [k for k in state_keys if k.split(".fp8_", 1)[0] not in shapes]
    if stray:
        raise CheckpointError(f"model: scaling-state keys for no parameter of the model: {stray[:5]}")
    for marker_, kind in ((marker, "delayed"), (f".{HCP_KEY}.", "hcp")):
        if kind not in kinds and any(marker_ in k for k in state_keys):
            raise CheckpointError(f"model: {kind} state ({marker_.strip('.')} keys), but recipe "
                                  f"{config.get('recipe')!r} with scaling {config.get('scaling')!r} keeps none")
    _prefixed("model", check_model_state_dict, msd, shapes, history_len)
    scaling = ckpt["scaling"]
    if scaling is not None and not isinstance(scaling, dict):
        raise CheckpointError("scaling: expected None or {'<param>.<role>.<field>': tensor}")
    if scaling:
        _prefixed("scaling", check_scaling_state_dict, scaling, shapes, history_len, kinds)
    opt = ckpt["optimizer"]
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for g in param_groups(model, 0.0) for p in g["params"]]
    try:
        ids = [i for g in opt["param_groups"] for i in g["params"]]
    except (KeyError, TypeError):
        raise CheckpointError("optimizer: not an optimizer state dict (expected 'state' and 'param_groups')") from None
    if len(ids) != len(order):
        raise CheckpointError(f"optimizer: {len(ids)} parameters in its param_groups, the model has {len(order)}")
    check_optimizer_state(opt, params={i: (n, shapes[n]) for i, n in zip(ids, order)}, max_step=step)
    check_rng_state(ckpt["rng"])


def _prefixed(prefix: str, check, *args) -> None:
    try:
        check(*args)
    except (CheckpointError, KeyError) as e:
        raise CheckpointError(f"{prefix}.{e.args[0] if e.args else e}") from None
