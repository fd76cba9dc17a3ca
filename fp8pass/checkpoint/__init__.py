"""Checkpoints: every part of saving and restoring fp8pass state, one concern per module.

Modules, one concern each:

* ``errors``: :class:`CheckpointError`, :class:`DiskFullError`, what every path raises.
* ``files``: files that survive kills and reveal corruption: atomic writes, SHA-256 manifests, verified
  reads, ``torch.save`` / ``torch.load`` through them (:func:`save_file`, :func:`load_file`).
* ``keys``: the key layout of the FP8 state in checkpoints (the on-disk names).
* ``scaling_state``: the FP8 scaling state in ``model.state_dict()`` (hooks, :func:`attach`) and on its
  own (:func:`scaling_state_dict` / :func:`load_scaling_state_dict`).
* ``weight_checks``, ``scaling_checks``, ``optimizer_checks``: validation of saved weights, scaling
  state (delayed, hot-channel patching, SR streams) and optimizer state, before anything is loaded.
* ``rng``: the random generators' states: save, check, restore.
* ``resume``: exact resume of your own loop: :func:`checkpoint_state`, :func:`save`, :func:`load`.

Users of these (upper layers): the trainer's ``checkpoint.pt`` (:mod:`fp8pass.train.checkpoint`: its
format, validated against the model its configuration builds) and DCP checkpoints
(:mod:`fp8pass.distributed.checkpoint`). They import the names below and nothing private.

Usage::

    fp8pass.checkpoint.save("ckpt.pt", model, optimizer)
    fp8pass.checkpoint.load("ckpt.pt", model, optimizer, config=cfg)
"""

from .errors import CheckpointError, DiskFullError
from .files import (
    ALLOW_UNVERIFIED_ENV,
    MANIFEST_SUFFIX,
    allow_unverified,
    atomic_write,
    file_digest,
    fsync_dir,
    load_file,
    manifest_path,
    open_append,
    read_verified,
    save_file,
    verify_files,
    write_failed,
    write_manifest,
    write_with_manifest,
)
from .keys import DELAYED_FIELDS, DELAYED_KEYS, HCP_KEY, SCALING_KEY, SR_KEY, group_delayed_keys, missing_delayed_keys
from .optimizer_checks import MAX_FP32_STEP, check_optimizer_state, saved_param_shapes
from .resume import checkpoint_state, load, load_checkpoint_state, save
from .rng import check_rng_state, rng_state, set_rng_state, set_torch_rng_state, torch_rng_state
from .scaling_checks import (
    MAX_COUNTER,
    check_delayed_state,
    check_hcp_state,
    check_model_state_dict,
    check_scaling_state_dict,
    check_sr_stream,
)
from .scaling_state import (
    attach,
    attach_weights,
    hook_precision_history,
    load_delayed_state,
    load_scaling_state_dict,
    load_sr_stream,
    scaling_state_dict,
    without_scaling_state,
)
from .weight_checks import check_weights

__all__ = [
    # errors
    "CheckpointError", "DiskFullError",
    # files
    "ALLOW_UNVERIFIED_ENV", "MANIFEST_SUFFIX", "allow_unverified", "atomic_write", "file_digest", "fsync_dir",
    "load_file", "manifest_path", "open_append", "read_verified", "save_file", "verify_files", "write_failed",
    "write_manifest", "write_with_manifest",
    # keys
    "DELAYED_FIELDS", "DELAYED_KEYS", "HCP_KEY", "SCALING_KEY", "SR_KEY", "group_delayed_keys", "missing_delayed_keys",
    # validation
    "check_weights", "MAX_COUNTER", "check_delayed_state", "check_hcp_state", "check_model_state_dict",
    "check_scaling_state_dict", "check_sr_stream", "MAX_FP32_STEP", "check_optimizer_state", "saved_param_shapes",
    # rng
    "check_rng_state", "rng_state", "set_rng_state", "set_torch_rng_state", "torch_rng_state",
    # scaling state in state dicts
    "attach", "attach_weights", "hook_precision_history", "load_delayed_state", "load_scaling_state_dict",
    "load_sr_stream", "scaling_state_dict", "without_scaling_state",
    # exact resume
    "checkpoint_state", "load_checkpoint_state", "save", "load",
]
