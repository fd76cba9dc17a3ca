"""FP8 linear and Smooth-SwiGLU MLP vs bf16, fwd+bwd, ratios measured in one run.

    python benchmarks/linear.py [--device cpu|cuda] [--tokens 4096] [--repeat 5] [--json FILE]

Cases: an FP8 linear (tokens x 2048 -> 2048) and a Llama-like MLP (2048 -> 5632 -> 2048) with
Smooth-SwiGLU, each against the same math in bf16 (``F.linear``); recipes: current per-tensor and
delayed scaling. When torchao is installed, also ``torchao.float8.Float8Linear`` (compiled), reported
as fp8pass / torchao. Timings are the median of ``--repeat`` runs after warm-up; on a shared CPU they
are noisy, so compare the ratios of one run, not absolute times across runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fp8pass  # noqa: E402
from fp8pass import ops  # noqa: E402


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timeit(fn, device, repeat: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def linear_cases(t, d_in, d_out, device, dtype):
    x = torch.randn(t, d_in, device=device, dtype=dtype, requires_grad=True)
    w = (torch.randn(d_out, d_in, device=device, dtype=dtype) / d_in**0.5).requires_grad_()
    g = torch.randn(t, d_out, device=device, dtype=dtype)

    def run(f):
        def step():
            x.grad = w.grad = None
            f(x, w).backward(g)
        return step

    delayed = fp8pass.DelayedScaling()
    return {
        "bf16": run(lambda a, b: F.linear(a, b)),
        "fp8_current": run(lambda a, b: ops.fp8_linear(a, b)),
        "fp8_delayed": run(lambda a, b: ops.fp8_linear(a, b, recipe=delayed)),
    }, (x, w, g)


def mlp_cases(t, d, f, device, dtype, smooth="channel"):
    x = torch.randn(t, d, device=device, dtype=dtype, requires_grad=True)
    wg = (torch.randn(f, d, device=device, dtype=dtype) / d**0.5).requires_grad_()
    wu = (torch.randn(f, d, device=device, dtype=dtype) / d**0.5).requires_grad_()
    wd = (torch.randn(d, f, device=device, dtype=dtype) / f**0.5).requires_grad_()
    g = torch.randn(t, d, device=device, dtype=dtype)

    def run(f):
        def step():
            x.grad = wg.grad = wu.grad = wd.grad = None
            f().backward(g)
        return step

    def bf16():
        return F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)

    delayed = fp8pass.DelayedScaling()
    return {
        "bf16": run(bf16),
        "fp8_current": run(lambda: ops.swiglu_mlp(x, wg, wu, wd, smooth=smooth)),
        "fp8_delayed": run(lambda: ops.swiglu_mlp(x, wg, wu, wd, smooth=smooth, recipe=delayed)),
    }, (x, wg, wu, wd, g)


def torchao_case(kind, tensors, device):
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    device = torch.device(a.device)
    dtype = torch.bfloat16
    torch.manual_seed(0)
    result = {"device": str(device), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "tokens": a.tokens, "dim": a.dim, "ffn": a.ffn, "repeat": a.repeat, "cases": {}}
    for kind, (cases, tensors) in {
        "linear": linear_cases(a.tokens, a.dim, a.dim, device, dtype),
        "mlp_smooth_swiglu": mlp_cases(a.tokens, a.dim, a.ffn, device, dtype),
    }.items():
        times = {name: timeit(fn, device, a.repeat) for name, fn in cases.items()}
        ao = torchao_case(kind, tensors, device)
        if ao is not None:
            times["torchao_float8_compiled"] = timeit(ao, device, a.repeat)
        row = {"seconds": times}
        for name in ("fp8_current", "fp8_delayed"):
            row[f"{name}/bf16"] = times[name] / times["bf16"]
            if "torchao_float8_compiled" in times:
                row[f"{name}/torchao"] = times[name] / times["torchao_float8_compiled"]
        result["cases"][kind] = row
        print(f"{kind}: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in times.items()))
        print("   " + ", ".join(f"{k} = {v:.3f}" for k, v in row.items() if k != "seconds"))
    if a.json:
        a.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
