"""One trainer per run folder, and a clean stop on SIGTERM / SIGINT.

:class:`RunLock` holds an exclusive ``flock`` on ``<out>/.lock`` for the run's lifetime (created
without following links, the holder's pid written into it): a second trainer on the same folder
(another process, or another thread of this one) is refused at once with :class:`RunInUseError`
naming the holder's pid, instead of both writing the same metrics and checkpoint. The lock ends
with the process, so a killed run never leaves a stale lock. Where ``fcntl`` is missing (Windows)
there is no lock.

:class:`StopSignals` turns the first SIGTERM (what clusters send before SIGKILL) or SIGINT (Ctrl-C)
into a request the training loop reads between steps: it finishes the step, writes a checkpoint and
stops. A second signal stops at once (``KeyboardInterrupt``), without that checkpoint.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no flock
    fcntl = None

__all__ = ["RunLock", "RunInUseError", "StopSignals", "LOCK_NAME"]

LOCK_NAME = ".lock"


class RunInUseError(RuntimeError):
    """Another trainer holds the run folder's lock."""


class RunLock:
    """Exclusive lock on run folder ``out`` (a context manager; see the module docstring)."""

    def __init__(self, out: str | os.PathLike):
        self.path = Path(out) / LOCK_NAME
        self._fd: int | None = None

    def __enter__(self) -> "RunLock":
        if fcntl is None:
            return self
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
        except OSError as e:
            raise RunInUseError(f"{self.path}: cannot open the run's lock file ({e.strerror}); if it is a "
                                "symbolic link, remove it (fp8pass does not write through links)") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise RunInUseError(f"{self.path.parent} is in use by another fp8pass train run (pid {holder}); wait "
                                "for it to finish, or choose another --out") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the flock; the file stays (removing it would race a new holder)
            self._fd = None


class StopSignals:
    """Defer SIGTERM / SIGINT to the end of the current step (a context manager).

    ``signum`` is the first signal received (None until then). Handlers are installed only in the
    main thread (Python delivers signals there); elsewhere this does nothing and signals act as usual.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:  # the second request: stop now, without the checkpoint
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def name(self) -> str | None:
        return signal.Signals(self.signum).name if self.signum is not None else None

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
