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

Safety and integrity (see docs/distributed.md):

* torch's ``FileSystemReader`` unpickles ``.metadata`` with plain ``pickle.load`` and DCP's default
  planner loads non-tensor entries with ``torch.load(weights_only=False)``: a crafted checkpoint
  folder runs code when it is loaded. :func:`load_checkpoint` reads ``.metadata`` with an allow-list
  unpickler (:class:`SafeFileSystemReader`: DCP's metadata classes and the torch types they hold,
  nothing else) and non-tensor entries with ``weights_only=True`` (:class:`SafeLoadPlanner`).
* :func:`save_checkpoint` writes ``manifest.json`` (SHA-256 of every file, written last by the
  coordinator after all ranks wrote theirs); :func:`load_checkpoint` verifies it (the ranks split
  the files) before it unpickles anything, and validates the loaded values before applying them.
* Every tensor the metadata declares is checked against the model's own before anything is read or
  allocated for it (:meth:`SafeLoadPlanner.create_local_plan`; the FP8 scaling state against the
  shapes the model's weights and the config's history length give): a crafted ``.metadata``
  claiming 2**34 elements is refused, not allocated.
* DCP's ``FileSystemWriter`` opens its files with a plain ``open``: :func:`save_checkpoint` refuses
  a folder that is, or holds, a symbolic link (a link planted in a shared folder would make the
  save overwrite the file it points at), and its writer creates every file (``__<rank>_<n>.distcp``,
  ``.metadata.tmp``) with ``O_NOFOLLOW``, so a link planted at one of those names after that check
  fails the save (:class:`~fp8pass.checkpoint.CheckpointError` naming the file) instead of being
  written through; ``.metadata`` itself is renamed into place (a link there is replaced, not
  followed). Left open: the checkpoint folder itself swapped for a link between the check and
  the writes (``O_NOFOLLOW`` guards a path's last component only).
* Every failure of DCP's save or load reaches the caller as a
  :class:`~fp8pass.checkpoint.CheckpointError` with a one-line cause (DCP raises a
  ``CheckpointException``, a ``BaseException`` that ``except Exception`` does not catch), a lack of
  space as :class:`~fp8pass.checkpoint.DiskFullError`.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import pickle
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ..checkpoint import (
    DELAYED_FIELDS,
    SR_KEY,
    CheckpointError,
    check_delayed_state,
    check_model_state_dict,
    check_optimizer_state,
    group_delayed_keys,
    load_delayed_state,
    load_sr_stream,
    missing_delayed_keys,
    verify_files,
    write_failed,
    write_manifest,
)
from ..config import Config, DelayedScaling
from ..runtime.state import ROLES
from .amax_sync import _module_params, scaling_states

__all__ = ["save_checkpoint", "load_checkpoint", "distributed_scaling_state_dict", "load_distributed_scaling_state_dict",
           "SafeFileSystemReader", "SafeLoadPlanner", "MANIFEST_NAME"]

MANIFEST_NAME = "manifest.json"
_METADATA = ".metadata"

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

    Every entry is validated first (:func:`fp8pass.checkpoint.check_delayed_state`, against the
    weight's shape and the config's history length); nothing is loaded when one fails.

    Under FSDP2 the state belongs to the unsharded parameters; they exist after the first
    all-gather, so call this after ``model.unshard(); model.reshard()`` or one forward (
    :func:`load_checkpoint` does the former).
    """
    cfg = config or Config()
    for p, name, d in _checked_scaling_state(model, sd, cfg):
        load_delayed_state(p, d, cfg, name)


def _checked_scaling_state(model: torch.nn.Module, sd: dict[str, torch.Tensor], cfg: Config) -> list:
    """``[(parameter, "fp8.<FQN>", {"<role>.<field>": tensor})]`` for ``sd``, every entry validated."""
    if not isinstance(cfg.recipe, DelayedScaling):
        if sd:
            raise ValueError("the checkpoint holds delayed-scaling state but the config uses CurrentScaling; "
                             "pass the Config the model was trained with")
        return []
    params = {}
    for name, p in _module_params(model):
        params[_clean(name)] = p  # unsharded (FSDP2) ones come last and win
    grouped, unknown = group_delayed_keys(sd, params)
    if unknown:
        raise KeyError(f"scaling state key {unknown[0]!r} names no parameter role of this model")
    out = []
    for name, d in grouped.items():
        miss = missing_delayed_keys(d)
        if miss:
            raise CheckpointError(f"fp8.{name}: incomplete delayed-scaling state, missing {miss}")
        check_delayed_state(d, f"fp8.{name}", params[name].shape, cfg.recipe.history_len)
        out.append((params[name], f"fp8.{name}", d))
    return out


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
    from ..optim.sharded import is_dtensor
    from .fp8_all_gather import FP8ShardWeight

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


class _NoFollowFileSystem(FileSystem):
    """DCP's local file system, creating the files it writes with ``O_NOFOLLOW``: a symbolic link at a
    file's name fails the write (CheckpointError) instead of redirecting it."""

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        if "r" in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(path, flags, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise CheckpointError(f"{path} is a symbolic link (planted after the save checked the folder?); "
                                      "refusing to write through it") from None
            raise
        with os.fdopen(fd, mode) as stream:
            yield stream


class _ManifestWriter(FileSystemWriter):
    """``FileSystemWriter`` that creates its files without following links (:class:`_NoFollowFileSystem`)
    and writes ``manifest.json`` after ``.metadata`` (coordinator only, once every rank's files are
    written): the SHA-256 of ``.metadata`` and of every data file."""

    def __init__(self, path: str, **kwargs) -> None:
        super().__init__(path, **kwargs)
        self.fs = _NoFollowFileSystem()

    def finish(self, metadata: Metadata, results) -> None:
        super().finish(metadata, results)
        names = {_METADATA} | {wr.storage_data.relative_path for rank in results for wr in rank}
        write_manifest(self.path, sorted(names), MANIFEST_NAME)


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` unpickles with an allow-list (see
    :class:`_MetadataUnpickler`) and checks that every data file it names is a plain file name in the
    checkpoint folder. A crafted ``.metadata`` raises :class:`~fp8pass.checkpoint.CheckpointError`
    and runs nothing."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = Path(self.path) / _METADATA
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except CheckpointError as e:
            raise CheckpointError(f"{path}: {e}") from None
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: no DCP checkpoint there (no .metadata)") from None
        except Exception as e:  # truncated or damaged pickle: many exception types
            raise CheckpointError(f"{path}: not a readable DCP metadata file ({type(e).__name__}: {e})") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path}: holds a {type(metadata).__name__}, not DCP Metadata")
        for index, info in (metadata.storage_data or {}).items():
            rel = getattr(info, "relative_path", None)
            if not isinstance(rel, str) or rel in ("", ".", "..") or Path(rel).name != rel or "\\" in rel:
                raise CheckpointError(f"{path}: entry {getattr(index, 'fqn', index)!r} points at {rel!r}, not a file "
                                      "of the checkpoint folder")
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _allowed_globals() -> dict[tuple[str, str], object]:
    import pathlib

    from torch.distributed.checkpoint import filesystem, metadata
    from torch.serialization import _get_layout

    allowed = {(metadata.__name__, n): getattr(metadata, n) for n in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")}
    allowed[(filesystem.__name__, "_StorageInfo")] = filesystem._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = _get_layout  # a name -> torch.layout lookup
    for cls in (pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath, pathlib.PureWindowsPath):
        allowed[(cls.__module__, cls.__name__)] = cls  # StorageMeta.checkpoint_id
        allowed[("pathlib", cls.__name__)] = cls
    for name, value in vars(torch).items():
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            allowed[("torch", name)] = value
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP ``Metadata`` only: any global outside :func:`_allowed_globals` is refused before
    it is looked up, so no ``__reduce__`` payload can name a callable that runs code."""

    _ALLOWED: dict | None = None

    def find_class(self, module: str, name: str):
        if _MetadataUnpickler._ALLOWED is None:
            _MetadataUnpickler._ALLOWED = _allowed_globals()
        obj = _MetadataUnpickler._ALLOWED.get((module, name))
        if obj is None:
            raise CheckpointError(f"refusing to unpickle {module}.{name}: not a DCP metadata type. The file was not "
                                  "written by torch.distributed.checkpoint or was tampered with; nothing was executed")
        return obj


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that unpickles non-tensor entries (optimizer hyper-parameters, ``extra``
    values) with ``torch.load(weights_only=True)`` instead of ``weights_only=False``, and checks each
    saved tensor's declared shape and chunks against the tensor it loads into before reading any."""

    def create_local_plan(self):
        for fqn, target in self.state_dict.items():
            saved = self.metadata.state_dict_metadata.get(fqn)
            if isinstance(target, torch.Tensor) and saved is not None:
                _check_saved_tensor(fqn, saved, tuple(target.size()))
        return super().create_local_plan()

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:
            raise CheckpointError(f"entry {read_item.dest_index.fqn!r}: refusing to unpickle it with anything but "
                                  f"plain tensors and Python values ({type(e).__name__}: {str(e).splitlines()[0]})"
                                  ) from None
        safe = io.BytesIO()
        torch.save(obj, safe)  # re-serialized from plain values: the parent's unrestricted load is harmless now
        safe.seek(0)
        super().load_bytes(read_item, safe)


def _check_saved_tensor(fqn: str, saved, shape: tuple) -> None:
    """``.metadata``'s entry ``fqn`` declares a tensor of ``shape`` whose chunks lie inside it."""
    if not isinstance(saved, TensorStorageMetadata):
        raise CheckpointError(f"entry {fqn!r}: saved as {type(saved).__name__}, this model holds a tensor there")
    if tuple(saved.size) != shape:
        raise CheckpointError(f"entry {fqn!r}: .metadata declares shape {tuple(saved.size)}, this model's tensor "
                              f"has {shape}")
    for chunk in saved.chunks:
        if len(chunk.offsets) != len(shape) or len(chunk.sizes) != len(shape) or any(
                o < 0 or n < 0 or o + n > d for o, n, d in zip(chunk.offsets, chunk.sizes, shape)):
            raise CheckpointError(f"entry {fqn!r}: a chunk at {tuple(chunk.offsets)} of size {tuple(chunk.sizes)} "
                                  f"lies outside the tensor's shape {shape}")


def _fp8_templates(meta: Metadata, model: torch.nn.Module, cfg: Config) -> dict[str, torch.Tensor]:
    """Empty tensors to load the saved FP8 scaling state into, after checking each declared shape
    against the one the model's weight and ``cfg``'s history length give (the allocation is then
    bounded by what the model holds)."""
    saved = {k[len("fp8."):]: m for k, m in meta.state_dict_metadata.items() if k.startswith("fp8.")}
    if not saved:
        return {}
    if not isinstance(cfg.recipe, DelayedScaling):
        raise CheckpointError("the checkpoint holds delayed-scaling state but the config uses "
                              f"{type(cfg.recipe).__name__}; pass the Config the model was trained with")
    params = {_clean(name): p for name, p in _module_params(model)}
    out = {}
    for key, m in saved.items():
        parts = key.rsplit(".", 2)
        if len(parts) != 3 or parts[1] not in ROLES or parts[2] not in DELAYED_FIELDS or parts[0] not in params:
            raise CheckpointError(f"fp8.{key}: names no parameter role of this model")
        p = params[parts[0]]
        lead = (int(p.shape[0]),) if p.dim() == 3 else ()
        want = lead + (cfg.recipe.history_len,) if parts[2] == "amax_history" else lead
        _check_saved_tensor(f"fp8.{key}", m, want)
        out[key] = torch.empty(want, dtype=m.properties.dtype)
    return out


def _stream_templates(meta: Metadata, model: torch.nn.Module, msd: dict) -> dict[str, tuple]:
    """``{model state-dict key: (parameter, empty int64 [2])}`` for the saved stochastic-rounding streams
    (``runtime.sr``) of parameters that have none yet (a model not compiled before the load: its state
    dict lacks them, so DCP would skip them), after checking each declared shape."""
    suffix = f".{SR_KEY}.stream"
    params = {_clean(name): p for name, p in _module_params(model)}
    out = {}
    for key, m in meta.state_dict_metadata.items():
        if not (key.startswith("model.") and key.endswith(suffix)) or key[len("model."):] in msd:
            continue
        name = key[len("model."):-len(suffix)]
        if name not in params:
            raise CheckpointError(f"{key}: names no parameter of this model")
        _check_saved_tensor(key, m, (2,))
        out[key[len("model."):]] = (params[name], torch.empty(2, dtype=torch.int64))
    return out


def _dcp_failure(path: Path, action: str, e: BaseException) -> CheckpointError:
    """A one-line CheckpointError for a failed DCP ``action`` ("save" / "load") of ``path``."""
    inner = _unwrap_dcp_error(e) if isinstance(e, CheckpointException) else e
    if isinstance(inner, CheckpointError):
        return type(inner)(f"{path}: {inner}")
    if isinstance(inner, OSError) and action == "save":
        return write_failed(path, inner, "this folder's files are incomplete and it has no manifest, so it will "
                                         "not load; earlier checkpoint folders are untouched")
    first = (str(inner).strip().splitlines() or [""])[0][:300] or "no message: a file is likely truncated or damaged"
    return CheckpointError(f"{path}: DCP {action} failed ({type(inner).__name__}: {first})")


def _refuse_links(path: Path) -> None:
    """DCP writes with a plain ``open``: refuse a checkpoint folder that is or holds a symbolic link."""
    links = [path] if path.is_symlink() else []
    if path.is_dir():
        links += [p for p in path.iterdir() if p.is_symlink()]
    if links:
        raise CheckpointError(f"{path}: refusing to save a DCP checkpoint into a folder holding symbolic links "
                              f"({', '.join(str(p) for p in links[:3])}): the save would write through them. "
                              "Remove them, or save into a new folder")


def _copy_state_entries(sd):
    """``sd`` with copies of its small state tensors: scaling state (``.fp8_scaling.`` / ``.fp8_hcp.``
    keys), optimizer ``step`` and ``*_scale`` entries."""
    def conv(key, v):
        if isinstance(v, dict):
            return {k: conv(k, x) for k, x in v.items()}
        if isinstance(v, torch.Tensor) and (".fp8_" in str(key) or key == "step" or str(key).endswith("_scale")):
            return v.detach().clone()
        return v

    return conv("", sd)


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _agree(check) -> None:
    """Run ``check()`` on every rank and raise the first rank's CheckpointError on all of them (a rank
    that raised alone would leave the others waiting in the next collective)."""
    error = None
    try:
        check()
    except CheckpointError as e:
        error = str(e)
    rank, world = _rank_world()
    if world > 1:
        errors = [None] * world
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e is not None), None)
    if error is not None:
        raise CheckpointError(error)


def _unwrap_dcp_error(e: CheckpointException) -> BaseException:
    """The first rank's original exception inside DCP's CheckpointException."""
    for _, failure in sorted(e.failures.items()):
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, BaseException):
            return inner
    return e


def save_checkpoint(path: str | os.PathLike, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None, extra: dict | None = None) -> None:
    """Save model, optimizer and FP8 scaling state with DCP (every rank calls it).

    Args:
        path: checkpoint directory.
        model: the trained model (DDP, FSDP2, compiled, or plain).
        optimizer: e.g. ``fp8pass.optim.AdamW``; its FP8 moments are saved as codes + scales.
        extra: more plain tensors / DTensors to save (e.g. ``{"step": torch.tensor(step)}``), or plain
            Python values (numbers, strings, containers: what ``torch.load(weights_only=True)`` reads).

    Every file is fsynced (DCP's ``sync_files``); ``manifest.json`` is written last, by the
    coordinator. Save each checkpoint into a new folder: a save interrupted over an existing one
    leaves files its (removed) manifest no longer vouches for.
    """
    path = Path(path)
    _agree(lambda: _refuse_links(path))
    msd, osd = get_state_dict(model, optimizer if optimizer is not None else [])
    sd = {"model": _plain(msd), "fp8": distributed_scaling_state_dict(model)}
    if optimizer is not None:
        sd["optim"] = _plain(osd)
    if extra:
        sd["extra"] = dict(extra)
    manifest = path / MANIFEST_NAME
    if _rank_world()[0] == 0 and manifest.exists():
        manifest.unlink()  # stale until the new one is written: an interrupted save must not verify
    try:
        dcp.save(sd, storage_writer=_ManifestWriter(str(path)))
    except (CheckpointException, Exception) as e:  # CheckpointException is a BaseException
        raise _dcp_failure(path, "save", e) from None


def load_checkpoint(path: str | os.PathLike, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None, config: Config | None = None,
                    extra: dict | None = None, allow_unverified: bool | None = None) -> None:
    """Load a :func:`save_checkpoint` into ``model`` (and ``optimizer``), resharding as needed.

    Verifies ``manifest.json`` first (each rank hashes its share of the files), reads ``.metadata``
    with :class:`SafeFileSystemReader` and the entries with :class:`SafeLoadPlanner`, validates the
    FP8 scaling state and the optimizer state, and only then applies them.

    Args:
        path: checkpoint directory.
        model, optimizer: the new job's objects (any world size; FSDP2 or not).
        config: the fp8pass Config the model is compiled with (recipe of the scaling state).
        extra: templates for the saved ``extra`` entries; loaded in place.
        allow_unverified: load a folder without ``manifest.json`` (written before fp8pass had one),
            with a warning; default: the ``FP8PASS_ALLOW_UNVERIFIED_CHECKPOINT`` environment variable.

    Raises:
        CheckpointError: a file differs from the manifest, the metadata is not DCP's, or a value is
            out of range (naming the file or the key); raised on every rank.
    """
    path = Path(path)
    if not (path / _METADATA).exists():
        raise FileNotFoundError(f"{path}: no DCP checkpoint there (no {_METADATA})")
    listed = {}

    def verify():
        files = verify_files(path, MANIFEST_NAME, allow_unverified, shard=_rank_world())
        if files is not None and _METADATA not in files:
            raise CheckpointError(f"{path / MANIFEST_NAME}: does not list {_METADATA}")
        listed["files"] = files

    _agree(verify)  # before anything is unpickled
    meta = SafeFileSystemReader(str(path)).read_metadata()
    if listed["files"] is not None:
        unlisted = sorted({i.relative_path for i in meta.storage_data.values()} - set(listed["files"]))
        if unlisted:
            raise CheckpointError(f"{path / _METADATA}: names data files its manifest does not list: {unlisted[:5]}")
    _unshard_once(model)
    msd, osd = get_state_dict(model, optimizer if optimizer is not None else [])
    cfg = config or Config()
    try:
        fp8 = _fp8_templates(meta, model, cfg)
        streams = _stream_templates(meta, model, msd)
    except CheckpointError as e:
        raise CheckpointError(f"{path / _METADATA}: {e}") from None
    # DCP loads in place: the scaling state, steps and moment scales go into copies, validated before
    # set_state_dict applies them (the model's state-dict values are its live state tensors)
    sd = {"model": dict(_copy_state_entries(_plain(msd)), **{k: t for k, (_, t) in streams.items()}), "fp8": fp8}
    if optimizer is not None:
        sd["optim"] = _copy_state_entries(_plain(osd))
    if extra:
        sd["extra"] = extra
    try:
        dcp.load(sd, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner())
    except (CheckpointException, Exception) as e:  # CheckpointException is a BaseException
        raise _dcp_failure(path, "load", e) from None
    history_len = cfg.recipe.history_len if isinstance(cfg.recipe, DelayedScaling) else None
    scaling = []

    def validate():
        try:
            check_model_state_dict(sd["model"], None, history_len)
            scaling.extend(_checked_scaling_state(model, sd["fp8"], cfg))
            if optimizer is not None:
                check_optimizer_state(sd["optim"], name="optim")
        except (CheckpointError, KeyError) as e:
            raise CheckpointError(f"{path}: {e.args[0] if e.args else e}") from None

    _agree(validate)
    new_streams = {k: sd["model"].pop(k) for k in streams}  # the model has no such key: loaded below
    set_state_dict(model, optimizer if optimizer is not None else [], model_state_dict=sd["model"],
                   optim_state_dict=sd.get("optim", {}))
    for key, t in new_streams.items():
        load_sr_stream(streams[key][0], t, key)
    for p, name, d in scaling:
        load_delayed_state(p, d, cfg, name)
