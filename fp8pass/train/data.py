"""Byte-level text data: the interpreter's own standard library by default, or a user's files.

The default corpus is on every machine that runs Python, so the demo needs no download: every
``*.py`` file of ``sysconfig.get_paths()["stdlib"]`` outside ``site-packages`` and test folders, read
in sorted order. The split is fixed per file (CRC32 of the relative path, 1 file in 20 to validation),
so it does not depend on the seed, the file count or the order files are found in. Different Python
versions ship different stdlibs; :attr:`TextData.fingerprint` identifies the exact corpus.

Batches are random windows drawn by a generator seeded from ``(seed, step)``: the data position is
just the step number, which makes ``--resume`` exact without saving any sampler state.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["TextData", "load_text_data", "stdlib_files", "VAL_EVERY"]

VAL_EVERY = 20          # one file in 20 goes to validation
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
_TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".json", ".csv", ".html", ".xml", ".c", ".h", ".tex", ""}


def stdlib_files() -> tuple[Path, list[Path]]:
    """(root, sorted ``.py`` files) of the running interpreter's standard library."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [f for f in root.rglob("*.py") if not _SKIP_DIRS.intersection(f.relative_to(root).parts[:-1])]
    return root, sorted(files)


def _user_files(path: Path) -> tuple[Path, list[Path]]:
    if path.is_file():
        return path.parent, [path]
    if path.is_dir():
        files = sorted(f for f in path.rglob("*") if f.is_file() and f.suffix.lower() in _TEXT_SUFFIXES
                       and not any(part.startswith(".") for part in f.relative_to(path).parts))
        if not files:
            raise ValueError(f"--data {path}: no text files found (looked for {sorted(_TEXT_SUFFIXES - {''})} "
                             "and files without a suffix)")
        return path, files
    raise FileNotFoundError(f"--data {path}: no such file or folder")


@dataclass
class TextData:
    """Train/validation byte streams (uint8 tensors) and where they came from."""

    train: torch.Tensor
    val: torch.Tensor
    source: str
    n_files: int
    fingerprint: str

    vocab_size: int = 256

    def check_fits(self, seq_len: int) -> None:
        """Raise ValueError, before training starts, when a split is too short for ``seq_len`` windows."""
        if min(self.train.numel(), self.val.numel()) < seq_len + 1:
            need = (seq_len + 1) * VAL_EVERY  # the smaller split, validation, is 1/VAL_EVERY of the text
            raise ValueError(f"--data {self.source}: too little text for --seq-len {seq_len} (train "
                             f"{self.train.numel()} bytes, validation {self.val.numel()} bytes; "
                             f"each split needs at least {seq_len + 1}); pass at least ~{need} bytes of text or a "
                             f"shorter --seq-len")

    def batch(self, split: str, batch_size: int, seq_len: int, seed: int, step: int):
        """``(inputs, targets)`` int64 of shape (batch_size, seq_len) for this (seed, step)."""
        stream = self.train if split == "train" else self.val
        n = stream.numel() - seq_len - 1
        if n <= 0:
            raise ValueError(f"{split} split has {stream.numel()} bytes, fewer than seq_len+1={seq_len + 1}; "
                             "use more data or a shorter --seq-len")
        # Separate generators for train and val, keyed by step: any step's batch is reproducible alone.
        g = torch.Generator().manual_seed((seed * 1_000_003 + step * 2 + (split != "train")) % (2 ** 63))
        starts = torch.randint(0, n, (batch_size,), generator=g)
        idx = starts[:, None] + torch.arange(seq_len + 1)
        win = stream[idx].long()
        return win[:, :-1], win[:, 1:]


def load_text_data(path: str | os.PathLike | None = None, max_bytes: int | None = None) -> TextData:
    """Read the corpus and split it by file.

    Args:
        path: a text file or a folder of text files; ``None`` for the standard library's sources.
        max_bytes: keep at most this many bytes of each split (files in order), ``None`` for all.
    """
    if path is None:
        root, files = stdlib_files()
        source = f"python stdlib {root}"
    else:
        root, files = _user_files(Path(path))
        source = str(path)
    if not any(f.stat().st_size for f in files):
        raise ValueError(f"--data {path}: no text in it (0 bytes); pass a file or folder with text")
    train, val = [], []
    for f in files:
        rel = f.relative_to(root).as_posix()
        data = f.read_bytes() + b"\n"
        (val if zlib.crc32(rel.encode()) % VAL_EVERY == 0 else train).append(data)
    if len(files) == 1 or not val or not train:
        # One file (or an unlucky split): hold out its last 5% instead.
        blob = b"".join(train + val)
        cut = int(len(blob) * 0.95)
        train, val = [blob[:cut]], [blob[cut:]]
    tr, va = b"".join(train), b"".join(val)
    if max_bytes is not None:
        tr, va = tr[:max_bytes], va[:max_bytes]
    fp = hashlib.sha256(tr).hexdigest()[:12] + "/" + hashlib.sha256(va).hexdigest()[:12]
    # frombuffer rejects an empty buffer (a short file's 5% validation tail can be empty)
    as_tensor = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8) if b else torch.empty(0, dtype=torch.uint8)
    return TextData(as_tensor(tr), as_tensor(va), source, len(files), fp)
