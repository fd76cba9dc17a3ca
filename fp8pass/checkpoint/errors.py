"""The errors of every checkpoint path: a file that fails verification or cannot be written, a value that fails
validation. Each message names the file or the key and says what to do."""

from __future__ import annotations

__all__ = ["CheckpointError", "DiskFullError"]


class CheckpointError(ValueError):
    """A checkpoint failed verification (manifest, format) or validation (a value out of range), or a
    file could not be written (the message names the file and the cause)."""


class DiskFullError(CheckpointError):
    """A write failed for lack of space (ENOSPC, or EDQUOT: over quota); its temp file was removed."""
