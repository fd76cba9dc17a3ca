"""Checkpoint files that survive kills and reveal corruption: fsynced atomic writes and SHA-256 manifests.

Every checkpoint fp8pass writes (the trainer's ``checkpoint.pt``, :func:`fp8pass.checkpoint.save`,
:func:`fp8pass.distributed.save_checkpoint`) carries a manifest: a JSON file beside it with the size
and SHA-256 digest of each file, written last (temp file, fsync, rename, fsync of the folder).
Loading verifies it before anything is unpickled; a mismatch names the file and raises
:class:`CheckpointError`.

A single-file checkpoint ``X`` and its manifest ``X.manifest.json`` are replaced as a pair by
:func:`write_with_manifest`: the new file and the new manifest are both complete and fsynced
(``X.tmp``, ``X.manifest.json.tmp``) before the first rename, so a kill between the two renames
leaves the new ``X`` with the new manifest still in ``X.manifest.json.tmp``, which
:func:`read_verified` accepts (it can only match the file the interrupted write produced).

A checkpoint without a manifest (written before fp8pass had them, or by other tools) is refused with
a :class:`CheckpointError` unless the caller opts out: ``allow_unverified=True``, or the environment
variable ``FP8PASS_ALLOW_UNVERIFIED_CHECKPOINT=1`` (for the CLI). It is then loaded with a warning;
the values are still validated.

Every file fp8pass writes goes through :func:`atomic_write` / :func:`write_with_manifest` (or
:func:`open_append` for the trainer's metrics log): temp files are created with
``O_CREAT|O_EXCL|O_NOFOLLOW`` (``tempfile.mkstemp`` in the destination folder, per-process names),
so a symlink planted in a shared folder is never written through, and renamed into place (a rename
replaces a link, never its target). A write that fails raises :class:`CheckpointError` naming the
file and the cause (:class:`DiskFullError` for "no space left on device"), removes its temp file and
says the previous version is intact; torch's own message for a failed write (``unexpected pos``)
is replaced by the OS error that caused it.

:func:`save_file` / :func:`load_file` are the torch side: ``torch.save`` of an object through
:func:`write_with_manifest`, and ``torch.load(weights_only=True)`` of the bytes :func:`read_verified`
checked.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Callable, Iterable

import torch

from .errors import CheckpointError, DiskFullError

__all__ = ["atomic_write", "open_append", "write_failed",
           "ALLOW_UNVERIFIED_ENV", "MANIFEST_SUFFIX", "manifest_path", "write_with_manifest",
           "write_manifest", "read_verified", "verify_files", "file_digest", "fsync_dir", "allow_unverified",
           "save_file", "load_file"]

ALLOW_UNVERIFIED_ENV = "FP8PASS_ALLOW_UNVERIFIED_CHECKPOINT"
MANIFEST_SUFFIX = ".manifest.json"
_FORMAT = "fp8pass.manifest"
_VERSION = 1
_CHUNK = 1 << 20


_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def allow_unverified(flag: bool | None) -> bool:
    """``flag``, or when None, whether ``FP8PASS_ALLOW_UNVERIFIED_CHECKPOINT`` is set to 1/true/yes."""
    if flag is not None:
        return bool(flag)
    return os.environ.get(ALLOW_UNVERIFIED_ENV, "").strip().lower() in ("1", "true", "yes")


def manifest_path(path: str | os.PathLike) -> Path:
    """The manifest of single-file checkpoint ``path``: ``path`` + ``.manifest.json``."""
    path = Path(path)
    return path.with_name(path.name + MANIFEST_SUFFIX)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename inside folder ``path`` durable (no-op where folders cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class _RecordingFile:
    """A binary file on ``fd`` that keeps the first OSError of a write: torch.save reports a failed
    write as ``RuntimeError: ... unexpected pos A vs B``, which hides the cause (e.g. no space)."""

    def __init__(self, fd: int):
        self._f = os.fdopen(fd, "wb")
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            return self._f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        self._f.flush()

    def fileno(self) -> int:
        return self._f.fileno()

    def close(self) -> None:
        self._f.close()


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass  # already gone: nothing left to clean up


def write_failed(path: str | os.PathLike, cause: BaseException, kept: str | None = None) -> CheckpointError:
    """The error for a write to ``path`` that failed with ``cause``: :class:`DiskFullError` for lack of
    space, else :class:`CheckpointError`, naming the file, the cause and what is ``kept`` (default: a
    temp-file write, whose temp file was removed, the previous ``path`` untouched)."""
    path = Path(path)
    kept = kept or f"the partial temp file was removed and {path} (its previous version, if any) is intact"
    if isinstance(cause, OSError) and cause.errno in _DISK_FULL:
        return DiskFullError(f"{path}: no space left on device while writing it ({cause.strerror}); {kept}. "
                             "Free space (or write elsewhere) and run again")
    if isinstance(cause, OSError):
        return CheckpointError(f"{path}: could not write it ({cause.strerror or cause}); {kept}")
    return CheckpointError(f"{path}: write interrupted ({type(cause).__name__}); {kept}")


def _write_temp(path: Path, write: Callable, fixed_name: Path | None = None) -> Path:
    """Write ``write(f)`` into a new fsynced temp file beside ``path`` and return its path.

    The temp file is created with ``O_CREAT|O_EXCL|O_NOFOLLOW``: by ``mkstemp`` (a per-process
    name) or, with ``fixed_name``, at that name (which must not exist). On any failure it is removed
    and the error is raised as :func:`write_failed` (an OSError or an interrupt) or as it was.
    """
    if fixed_name is None:
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        tmp = Path(name)
    else:
        tmp = fixed_name
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
        except FileExistsError:
            raise CheckpointError(f"{tmp}: already exists (another process is writing {path}, or a link was "
                                  "planted there); refusing to write through it") from None
        except OSError as e:
            raise write_failed(path, e) from e
    f = None
    try:
        f = _RecordingFile(fd)
        try:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        finally:
            f.close()
    except (OSError, RuntimeError, KeyboardInterrupt) as e:
        _unlink_quietly(tmp)
        cause = (f.error if f is not None else None) or e
        if isinstance(cause, (OSError, KeyboardInterrupt)):
            raise write_failed(path, cause) from e
        raise
    except BaseException:
        _unlink_quietly(tmp)
        raise
    return tmp


def atomic_write(path: str | os.PathLike, write: Callable, verify: Callable | None = None) -> Path:
    """Replace ``path`` with what ``write(f)`` writes to a binary file: a new temp file in its folder
    (never through a link), fsynced, checked by ``verify(temp_path)`` if given, renamed into place.

    Raises:
        CheckpointError: the write failed (:class:`DiskFullError` when for lack of space) or
            ``verify`` rejected it; the temp file is removed, ``path`` untouched.
    """
    path = Path(path)
    tmp = _write_temp(path, write)
    try:
        if verify is not None:
            verify(tmp)
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    fsync_dir(path.parent)
    return path


def open_append(path: str | os.PathLike):
    """``path`` opened for appending text (created if absent), refusing a symlink at ``path``."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointError(f"{path}: is a symbolic link; fp8pass does not write through links "
                                  "(remove it, or choose another output folder)") from None
        raise write_failed(path, e) from e
    return os.fdopen(fd, "a", encoding="utf-8")


def file_digest(path: str | os.PathLike) -> dict:
    """``{"bytes": size, "sha256": hexdigest}`` of a file, read in 1 MiB chunks."""
    h, n = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            n += len(chunk)
    return {"bytes": n, "sha256": h.hexdigest()}


def _manifest_bytes(files: dict[str, dict]) -> bytes:
    doc = {"format": _FORMAT, "version": _VERSION, "algorithm": "sha256", "files": dict(sorted(files.items()))}
    return (json.dumps(doc, indent=1) + "\n").encode()


def write_with_manifest(path: str | os.PathLike, write: Callable, verify: Callable | None = None) -> Path:
    """Write single-file checkpoint ``path`` with ``write(f)`` (binary file), then its manifest.

    Both are written to temp files and fsynced before either is renamed (see the module docstring);
    ``verify(temp_path)``, if given, checks the new file first: until both pass, the previous pair
    stays in place. Returns ``path``.

    Raises:
        CheckpointError: as :func:`atomic_write`.
    """
    path = Path(path)
    man = manifest_path(path)
    man_tmp = man.with_name(man.name + ".tmp")  # a fixed name: read_verified looks for it (module docstring)
    _settle(path, man, man_tmp)
    tmp = _write_temp(path, write)
    pending = installed = False
    try:
        if verify is not None:
            verify(tmp)
        manifest = _manifest_bytes({path.name: file_digest(tmp)})
        _write_temp(man, lambda f: f.write(manifest), fixed_name=man_tmp)
        pending = True
        os.replace(tmp, path)
        installed = True
        fsync_dir(path.parent)
        os.replace(man_tmp, man)
        fsync_dir(path.parent)
    except BaseException:
        if not installed:  # the previous pair is intact; once installed, the pending manifest is the valid one
            _unlink_quietly(tmp)
            if pending:
                _unlink_quietly(man_tmp)
        raise
    return path


def _settle(path: Path, man: Path, man_tmp: Path) -> None:
    """Finish a write a kill interrupted between its two renames (the pending manifest matches the
    file), before this write reuses the temp name; drop a pending manifest that matches nothing."""
    if not man_tmp.exists():
        return
    try:
        pending = _read_manifest(man_tmp).get(path.name)
    except CheckpointError:
        pending = None
    if pending is not None and path.exists() and file_digest(path) == pending:
        os.replace(man_tmp, man)
        fsync_dir(path.parent)
    else:
        man_tmp.unlink()


def write_manifest(folder: str | os.PathLike, names: Iterable[str], manifest_name: str = "manifest.json") -> Path:
    """Write ``folder/manifest_name`` with the digests of the files ``names`` in ``folder`` (fsynced, atomic)."""
    folder = Path(folder)
    manifest = _manifest_bytes({n: file_digest(folder / n) for n in names})
    return atomic_write(folder / manifest_name, lambda f: f.write(manifest))


def _read_manifest(path: Path) -> dict[str, dict]:
    """The ``files`` of a manifest, or CheckpointError naming what is wrong with it."""
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{path}: not a valid fp8pass checkpoint manifest ({why}); the manifest is "
                               "corrupted or was edited, so the checkpoint beside it cannot be verified")
    try:
        doc = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"{type(e).__name__}: {e}") from None
    if not isinstance(doc, dict) or set(doc) != {"format", "version", "algorithm", "files"}:
        raise bad("unexpected fields")
    if doc["format"] != _FORMAT or doc["version"] != _VERSION or doc["algorithm"] != "sha256":
        raise bad(f"format {doc['format']!r} version {doc['version']!r} algorithm {doc['algorithm']!r}")
    files = doc["files"]
    if not isinstance(files, dict) or not files:
        raise bad("no files listed")
    for name, entry in files.items():
        if (not isinstance(entry, dict) or set(entry) != {"bytes", "sha256"} or type(entry["bytes"]) is not int
                or not isinstance(entry["sha256"], str) or len(entry["sha256"]) != 64
                or entry["sha256"].strip("0123456789abcdef")):
            raise bad(f"entry of {name!r} malformed")
        if name != Path(name).name or name in (".", ".."):
            raise bad(f"file name {name!r} is not a plain name in the checkpoint's folder")
    return files


def _mismatch(folder: Path, name: str, entry: dict, manifest: Path) -> str | None:
    """Why ``folder/name`` does not match ``entry``, or None if it does."""
    f = folder / name
    if not f.is_file():
        return f"{f}: listed in {manifest.name} but missing"
    got = file_digest(f)
    if got["bytes"] != entry["bytes"]:
        return f"{f}: {got['bytes']} bytes, its manifest {manifest.name} says {entry['bytes']} (truncated or overwritten)"
    if got["sha256"] != entry["sha256"]:
        return f"{f}: SHA-256 differs from its manifest {manifest.name} (the file is corrupted or was modified)"
    return None


def _unverified(what: Path, manifest: Path, allow: bool | None) -> None:
    if not allow_unverified(allow):
        raise CheckpointError(
            f"{what}: no manifest ({manifest.name}) to verify it against. Checkpoints written by fp8pass carry "
            f"one; it is absent when the checkpoint predates it, comes from another tool, or its write was "
            f"interrupted. To load it anyway (its values are still validated), pass allow_unverified=True "
            f"or set {ALLOW_UNVERIFIED_ENV}=1.")
    warnings.warn(f"fp8pass: loading {what} without integrity check (no {manifest.name}); values are still "
                  f"validated. The next save writes a manifest.", RuntimeWarning, stacklevel=3)


def read_verified(path: str | os.PathLike, allow_unverified: bool | None = None) -> bytes:
    """The bytes of single-file checkpoint ``path`` after checking them against its manifest.

    Reading once and hashing those bytes means what is verified is what gets loaded.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CheckpointError: size or digest differ from the manifest, the manifest is malformed, or it
            is absent and unverified loading is not allowed (see the module docstring).
    """
    path = Path(path)
    data = path.read_bytes()
    man = manifest_path(path)
    if not man.exists():
        _unverified(path, man, allow_unverified)
        return data
    files = _read_manifest(man)
    digest = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    if set(files) != {path.name}:
        raise CheckpointError(f"{man}: lists {sorted(files)}, not {path.name!r}; the manifest belongs to another "
                              "file or was edited")
    if files[path.name] == digest:
        return data
    # a kill between the two renames of write_with_manifest: the new manifest is still in its temp file
    pending = man.with_name(man.name + ".tmp")
    if pending.exists():
        try:
            if _read_manifest(pending).get(path.name) == digest:
                return data
        except CheckpointError:
            pass
    why = _mismatch(path.parent, path.name, files[path.name], man)
    raise CheckpointError(f"{why}; refusing to load it. Restore the file from a copy, or resume from an "
                          "earlier checkpoint.")


def verify_files(folder: str | os.PathLike, manifest_name: str = "manifest.json", allow_unverified: bool | None = None,
                 shard: tuple[int, int] = (0, 1)) -> dict[str, dict] | None:
    """Check the files of checkpoint folder ``folder`` against ``folder/manifest_name``.

    Args:
        folder: the checkpoint folder.
        manifest_name: its manifest's file name.
        allow_unverified: see :func:`allow_unverified`; applies only when the manifest is absent.
        shard: ``(i, n)``: hash only every n-th listed file from the i-th (the ranks of a distributed
            load split the work); the manifest itself is always checked whole.

    Returns:
        The manifest's ``files`` (name -> size and digest), or None when it is absent and that is allowed.

    Raises:
        CheckpointError: naming the first file that is missing or differs.
    """
    folder = Path(folder)
    man = folder / manifest_name
    if not man.exists():
        _unverified(folder, man, allow_unverified)
        return None
    files = _read_manifest(man)
    i, n = shard
    for name in sorted(files)[i::n]:
        why = _mismatch(folder, name, files[name], man)
        if why is not None:
            raise CheckpointError(f"{why}; refusing to load the checkpoint in {folder}.")
    return files


def save_file(path: str | os.PathLike, obj, verify=None) -> Path:
    """``torch.save(obj)`` to ``path`` with a SHA-256 manifest, both fsynced and renamed into place.

    ``verify(temp_path)`` may check the written file first (the previous ``path`` stays until it
    passes). Raises :class:`CheckpointError` naming the file and the cause when the write fails
    (:class:`DiskFullError` for lack of space).
    """
    return write_with_manifest(path, lambda f: torch.save(obj, f), verify)


def load_file(path: str | os.PathLike, allow_unverified: bool | None = None):
    """``torch.load(path, weights_only=True)`` of a :func:`save_file`, verified against its manifest.

    Raises:
        FileNotFoundError: no such file.
        CheckpointError: the file differs from its manifest, has none (unless ``allow_unverified``,
            see the module docstring), or is not a readable checkpoint (truncated, empty, corrupted);
            the message names the file.
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
