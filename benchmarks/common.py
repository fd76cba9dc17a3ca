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


def sync(device) -> None:
    """Wait for the device's queued work (a no-op on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_rounds(cases: dict, device, repeat: int, warmup: int = 2) -> dict:
    """Seconds of every round per case; the cases run in turn each round, so that load changes on a
    shared machine hit all of them alike (the ratios are what the benchmarks report)."""
    for fn in cases.values():
        for _ in range(warmup):
            fn()
    times = {k: [] for k in cases}
    for _ in range(repeat):
        for k, fn in cases.items():
            sync(device)
            t = time.perf_counter()
            fn()
            sync(device)
            times[k].append(time.perf_counter() - t)
    return times


def baseline_dtype(device="cpu") -> torch.dtype:
    """The high-precision dtype every baseline (and the activations the FP8 ops take) runs in.

    bf16 on GPUs. On CPUs the dtype their matmuls are fast in: bf16 where oneDNN has native bf16
    (AVX512/AMX), fp32 on AVX2-only CPUs, where a bf16 matmul is ~100x slower and would make any FP8
    ratio meaningless. ``FP8PASS_CPU_GEMM_DTYPE=bf16|fp32`` forces one (the FP8 GEMMs follow it too).
    """
    if torch.device(device).type != "cpu":
        return torch.bfloat16
    from fp8pass.kernels.cpu import fast_matmul_dtype

    return fast_matmul_dtype()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def cpu_state() -> dict:
    """CPU capability (what decides bf16 vs fp32 speed) and the load other processes put on it."""
    from fp8pass.kernels.cpu import cpu_capability

    state = cpu_capability()
    try:
        state["loadavg_1_5_15"] = [round(v, 2) for v in os.getloadavg()]
    except OSError:
        state["loadavg_1_5_15"] = None
    return state


def listed(parser, text: str, valid, what: str) -> list[str]:
    """The comma-separated names of ``text`` (blanks dropped), each one of ``valid``; an unknown name is
    ``parser.error`` naming the valid ones."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    for n in names:
        if n not in valid:
            parser.error(f"unknown {what} {n!r}; valid: {', '.join(valid)}")
    return names


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
    info.update(cpu_state())
    return info
