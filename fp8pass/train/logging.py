"""Metrics to JSONL and a dependency-free progress bar."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

from ..checkpoint import atomic_write, open_append, write_failed

__all__ = ["MetricsWriter", "ProgressBar", "read_metrics"]


def _clean(v):
    # JSON has no NaN/Inf: write them as strings so every line stays valid JSON.
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


class MetricsWriter:
    """Appends one JSON object per line; ``truncate_after(step)`` drops records past a resumed step.

    A kill while appending leaves at most a torn last line, which :func:`read_metrics` skips; a kill
    while truncating loses nothing (the kept records go to a new file that replaces the old one).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open_append(self.path)  # never through a link planted at that name

    def __call__(self, record: dict) -> None:
        try:
            self._f.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
            self._f.flush()
        except OSError as e:  # e.g. a full disk: name the file (at most this record is torn, and skipped on read)
            raise write_failed(self.path, e, "the records before this one are intact") from e

    def truncate_after(self, step: int) -> None:
        """Keep records of steps <= ``step`` (minus old "end" records), so a resumed run logs each step once.

        Writes the kept records to a new temp file (:func:`fp8pass.checkpoint.atomic_write`: fsynced,
        renamed over the old file): at any kill point the file holds either all old records or the kept ones.
        """
        self._f.close()
        kept = [r for r in read_metrics(self.path) if r.get("step", -1) <= step and r.get("kind") != "end"]
        text = "".join(json.dumps({k: _clean(v) for k, v in r.items()}) + "\n" for r in kept)
        atomic_write(self.path, lambda f: f.write(text.encode("utf-8")))
        self._f = open_append(self.path)

    def close(self) -> None:
        self._f.close()


def read_metrics(path: str | os.PathLike, kind: str | None = None) -> list[dict]:
    """The records of a metrics.jsonl (of ``kind`` if given); [] if it does not exist.

    A last line without its newline that does not parse is a write a kill interrupted: skipped.
    Any other line that does not parse raises ValueError naming the file and line.
    """
    path = Path(path)
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:  # no newline after it: torn by a kill mid-append
                continue
            raise ValueError(f"{path}:{i + 1}: not a JSON record ({e}); fix or remove that line") from None
        if not isinstance(r, dict):
            raise ValueError(f"{path}:{i + 1}: expected a JSON object, got {type(r).__name__}")
        if kind is None or r.get("kind") == kind:
            out.append({k: float(v) if v in ("nan", "inf", "-inf") else v for k, v in r.items()})
    return out


class ProgressBar:
    """``name [#####.....] step/total loss tok/s eta`` on a terminal; a line every ~10% otherwise.

    The ETA extrapolates the steps since the start or the last :meth:`restart_eta`.
    """

    def __init__(self, total: int, name: str = "", start: int = 0, stream=None, width: int = 24):
        self.total, self.name, self.width = max(total, 1), name, width
        self.stream = stream or sys.stderr
        self.tty = getattr(self.stream, "isatty", lambda: False)()
        self.t0, self.s0 = time.perf_counter(), start
        self._last_pct = -1

    def update(self, step: int, **fields) -> None:
        done = step / self.total
        elapsed = time.perf_counter() - self.t0
        rate = (step - self.s0) / elapsed if elapsed > 0 else 0.0
        eta = f"{(self.total - step) / rate:4.0f}s" if rate > 0 else "   ?"
        info = " ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in fields.items())
        bar = "#" * int(done * self.width) + "." * (self.width - int(done * self.width))
        line = f"{self.name} [{bar}] {step}/{self.total} {info} eta {eta}"
        if self.tty:
            self.stream.write("\r" + line)
            self.stream.flush()
        elif int(done * 10) != self._last_pct or step == self.total:
            self._last_pct = int(done * 10)
            self.stream.write(line + "\n")
            self.stream.flush()

    def restart_eta(self, step: int) -> None:
        """Measure the ETA's rate from now on, ``step`` being done: the steps before compiled graphs
        (minutes on a CPU, once), and an ETA that counted them read 20000 s after the first FP8 step
        (issue 34). Until the next step completes the ETA shows "?"."""
        self.t0, self.s0 = time.perf_counter(), step

    def note(self, text: str) -> None:
        """``text`` on a line of its own (on a terminal it replaces the bar's line; the next update redraws it)."""
        self.stream.write(("\r\033[K" if self.tty else "") + text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
