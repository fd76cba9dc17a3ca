"""Roofline context measured in the same run: matmul FLOP/s and copy bandwidth of this machine.

The matmul is timed in bf16 and fp32: on CPUs without native bf16 (AVX2 only) bf16 runs ~100x slower
than fp32, which is why the baselines and the FP8 GEMMs there run in fp32 (``fast_matmul_dtype``).
On such a CPU the bf16 matmul is timed at a smaller size, so this suite stays quick.

On a GPU the card's datasheet peaks are reported beside the measurements, so every kernel can be shown
as a fraction of its limit.

    python -m benchmarks.roofline [--json FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.common import baseline_dtype, dtype_name, machine, time_fn

# Dense datasheet peaks (TFLOP/s, TB/s) for the GPUs we are lent.
GPU_PEAKS = {"H200": {"bf16_tflops": 989.0, "fp8_tflops": 1979.0, "hbm_tbs": 4.8},
             "H100": {"bf16_tflops": 989.0, "fp8_tflops": 1979.0, "hbm_tbs": 3.35}}


def matmul_gflops(n: int, device: str, dtype: torch.dtype) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    t = time_fn(lambda: a @ b, warmup=2, repeat=5)["median"]
    return 2 * n**3 / t / 1e9


def measure(device: str = "cpu", n: int | None = None, copy_mib: int = 256) -> dict:
    n = n or (8192 if device == "cuda" else 2048)
    fast = baseline_dtype(device)
    # A slow bf16 (no native support) is timed at a quarter of the size: 64x fewer FLOPs.
    n_bf16 = n if fast == torch.bfloat16 else max(256, n // 4)
    gflops = matmul_gflops(n_bf16, device, torch.bfloat16)
    fp32_gflops = matmul_gflops(n, device, torch.float32)
    x = torch.empty(copy_mib * 2**20 // 4, device=device)
    y = torch.empty_like(x)
    tc = time_fn(lambda: y.copy_(x), warmup=2, repeat=5)["median"]
    gbs = 2 * x.numel() * 4 / tc / 1e9  # read + write
    out = {"device": device, "matmul_n": n, "bf16_matmul_n": n_bf16, "bf16_matmul_gflops": gflops,
           "fp32_matmul_gflops": fp32_gflops, "fast_dtype": dtype_name(fast), "copy_gbs": gbs}
    if device == "cuda":
        name = torch.cuda.get_device_name()
        for key, peaks in GPU_PEAKS.items():
            if key in name:
                out.update(peaks)
                out["bf16_fraction_of_peak"] = gflops / 1e3 / peaks["bf16_tflops"]
                out["copy_fraction_of_peak"] = gbs / 1e3 / peaks["hbm_tbs"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json")
    args = p.parse_args(argv)
    res = {"machine": machine(), "roofline": measure(args.device)}
    for k, v in res["roofline"].items():
        print(f"{k:>24}: {v:.4g}" if isinstance(v, float) else f"{k:>24}: {v}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
