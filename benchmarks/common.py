"""Shared timing helpers: warm-up, repeated timing, median and spread, machine description."""

from __future__ import annotations

import os
import platform
import statistics
import time

import torch


def time_fn(fn, warmup: int = 2, repeat: int = 7) -> dict:
    """Median / min / max wall time in seconds of ``fn()`` over ``repeat`` runs after ``warmup``."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return {"median": statistics.median(times), "min": min(times), "max": max(times)}


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    info["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return info
