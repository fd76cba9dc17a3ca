"""FP8 linear and Smooth-SwiGLU MLP vs the high-precision baseline, fwd+bwd, ratios measured in one run.

    python -m benchmarks.linear [--device cpu|cuda] [--tokens 4096] [--repeat 5] [--json FILE]

Cases: an FP8 linear (tokens x 2048 -> 2048) and a Llama-like MLP (2048 -> 5632 -> 2048) with
Smooth-SwiGLU, each against the same math in high precision (``F.linear``); recipes: current
per-tensor and delayed scaling. The baseline and the activations run in the machine's fast dtype
(``benchmarks.common.baseline_dtype``): bf16 on GPUs and on CPUs with native bf16 matmuls, fp32 on
AVX2-only CPUs (``FP8PASS_CPU_GEMM_DTYPE=bf16|fp32`` forces one); the JSON records which. When
torchao is installed, also ``torchao.float8.Float8Linear`` (compiled), reported as fp8pass / torchao
(on CUDA only by default: torchao's CPU path is ``_scaled_mm``, ~10,000x slower than a bf16 matmul
there). Timings are the median of ``--repeat`` rounds after warm-up, the cases interleaved within each
round; on a shared CPU they are noisy, so compare the ratios of one run, not absolute times
across runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import fp8pass
from benchmarks.common import baseline_dtype, cpu_state, dtype_name, sync, time_rounds
from fp8pass import ops


def timeit(fn, device, repeat: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def time_interleaved(cases: dict, device, repeat: int, warmup: int = 2) -> dict:
    """Median seconds per case over interleaved rounds (:func:`benchmarks.common.time_rounds`)."""
    return {k: statistics.median(v) for k, v in time_rounds(cases, device, repeat, warmup).items()}


def linear_cases(t, d_in, d_out, device, dtype, wrap=None):
    """fwd+bwd steps of F.linear and the FP8 linear (current, delayed); ``wrap`` (e.g. ``torch.compile``)
    is applied to each forward function."""
    wrap = wrap or (lambda fn: fn)
    x = torch.randn(t, d_in, device=device, dtype=dtype, requires_grad=True)
    w = (torch.randn(d_out, d_in, device=device, dtype=dtype) / d_in**0.5).requires_grad_()
    g = torch.randn(t, d_out, device=device, dtype=dtype)

    def run(f):
        f = wrap(f)

        def step():
            x.grad = w.grad = None
            f(x, w).backward(g)
        return step

    delayed = fp8pass.DelayedScaling()
    return {
        "baseline": run(lambda a, b: F.linear(a, b)),
        "fp8_current": run(lambda a, b: ops.fp8_linear(a, b)),
        "fp8_delayed": run(lambda a, b: ops.fp8_linear(a, b, recipe=delayed)),
    }, (x, w, g)


def mlp_cases(t, d, f, device, dtype, smooth="channel", wrap=None):
    """fwd+bwd steps of the bf16 SwiGLU MLP and the FP8 Smooth-SwiGLU one (current, delayed); ``wrap``
    (e.g. ``torch.compile``) is applied to each forward function."""
    wrap = wrap or (lambda fn: fn)
    x = torch.randn(t, d, device=device, dtype=dtype, requires_grad=True)
    wg = (torch.randn(f, d, device=device, dtype=dtype) / d**0.5).requires_grad_()
    wu = (torch.randn(f, d, device=device, dtype=dtype) / d**0.5).requires_grad_()
    wd = (torch.randn(d, f, device=device, dtype=dtype) / f**0.5).requires_grad_()
    g = torch.randn(t, d, device=device, dtype=dtype)

    def run(fn):
        fn = wrap(fn)

        def step():
            x.grad = wg.grad = wu.grad = wd.grad = None
            fn().backward(g)
        return step

    def baseline():
        return F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)

    delayed = fp8pass.DelayedScaling()
    return {
        "baseline": run(baseline),
        "fp8_current": run(lambda: ops.swiglu_mlp(x, wg, wu, wd, smooth=smooth)),
        "fp8_delayed": run(lambda: ops.swiglu_mlp(x, wg, wu, wd, smooth=smooth, recipe=delayed)),
    }, (x, wg, wu, wd, g)


def torchao_case(kind, tensors, device, force=False):
    if device.type == "cpu" and not force:
        return None  # torchao's CPU path is torch._scaled_mm, ~10,000x slower (docs/background.md)
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError:
        return None
    if kind == "linear":
        x, w, g = tensors
        mod = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=device, dtype=w.dtype)
    else:
        x, wg, wu, wd, g = tensors

        class MLP(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.gate = torch.nn.Linear(wg.shape[1], wg.shape[0], bias=False)
                self.up = torch.nn.Linear(wu.shape[1], wu.shape[0], bias=False)
                self.down = torch.nn.Linear(wd.shape[1], wd.shape[0], bias=False)

            def forward(self, a):
                return self.down(F.silu(self.gate(a)) * self.up(a))

        mod = MLP().to(device=device, dtype=x.dtype)
    convert_to_float8_training(mod)
    cmod = torch.compile(mod)

    def step():
        x.grad = None
        cmod(x).backward(g)
    return step


def cpu_breakdown(t, d_in, d_out, repeat, dtype):
    """Where the fp8 linear's CPU time goes: each piece timed alone (ms)."""
    from fp8pass import E4M3
    from fp8pass.kernels import cpu

    up = cpu.gemm_dtype(dtype)
    x = torch.randn(t, d_in, dtype=dtype)
    w = torch.randn(d_out, d_in, dtype=dtype) / d_in**0.5
    xu, wu = x.to(up), w.to(up)
    s = torch.tensor(100.0)
    codes, _, _ = cpu.cast(x, s, E4M3)
    dev = torch.device("cpu")
    pieces = {
        "amax x (torch.aminmax)": lambda: torch.aminmax(x),
        "cast x -> e4m3 + amax": lambda: cpu.cast(x, s, E4M3),
        f"upcast x e4m3 -> {dtype_name(up)}": lambda: cpu.upcast(codes, up),
        f"{dtype_name(up)} GEMM x W^T": lambda: torch.mm(xu, wu.t()),
        f"{dtype_name(up)} GEMM, alpha (addmm)": lambda: torch.addmm(xu.new_zeros(()).expand(t, d_out), xu, wu.t(),
                                                                    beta=0, alpha=0.5),
    }
    return {k: timeit(f, dev, repeat) * 1e3 for k, f in pieces.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", type=Path)
    p.add_argument("--torchao-on-cpu", action="store_true",
                   help="also time torchao on CPU (its _scaled_mm CPU path takes minutes per step)")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    dtype = baseline_dtype(device)
    torch.manual_seed(0)
    result = {"device": str(device), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "tokens": a.tokens, "dim": a.dim, "ffn": a.ffn, "repeat": a.repeat,
              "baseline_dtype": dtype_name(dtype), "cases": {}}
    if device.type == "cpu":
        result["cpu"] = cpu_state()
        from fp8pass.kernels.cpu import gemm_dtype
        result["fp8_gemm_dtype"] = dtype_name(gemm_dtype(dtype))
    print(f"baseline dtype {dtype_name(dtype)}" + (f" (CPU {result['cpu']['cpu_capability']}, native bf16 "
          f"{result['cpu']['native_bf16']}, fp8 GEMMs in {result['fp8_gemm_dtype']}, load "
          f"{result['cpu']['loadavg_1_5_15']})" if device.type == "cpu" else ""))
    for kind, (cases, tensors) in {
        "linear": linear_cases(a.tokens, a.dim, a.dim, device, dtype),
        "mlp_smooth_swiglu": mlp_cases(a.tokens, a.dim, a.ffn, device, dtype),
    }.items():
        ao = torchao_case(kind, tensors, device, a.torchao_on_cpu)
        if ao is not None:
            cases["torchao_float8_compiled"] = ao
        times = time_interleaved(cases, device, a.repeat)
        row = {"seconds": times}
        for name in ("fp8_current", "fp8_delayed"):
            row[f"{name}/baseline"] = times[name] / times["baseline"]
            if "torchao_float8_compiled" in times:
                row[f"{name}/torchao"] = times[name] / times["torchao_float8_compiled"]
        result["cases"][kind] = row
        print(f"{kind}: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in times.items()))
        print("   " + ", ".join(f"{k} = {v:.3f}" for k, v in row.items() if k != "seconds"))
    if device.type == "cpu":
        result["cpu_breakdown_ms"] = cpu_breakdown(a.tokens, a.dim, a.dim, a.repeat, dtype)
        print("breakdown (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in result["cpu_breakdown_ms"].items()))
    if a.json:
        a.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
