"""FP8 Adam step time and state memory against torch.optim.AdamW(foreach=True), on CPU.

Builds ``--params`` parameters (default 100M) as Llama-like matrices plus a few small vectors, gives
them fixed gradients and times ``optimizer.step()`` for each optimizer, interleaving the optimizers
round by round so that load from other processes hits all of them alike; the median of ``--rounds``
steps is kept. Prints, for each optimizer, step seconds, the ratio to torch AdamW(foreach=True) in the
same run (goal <= 1.5 for fp8pass), and the bytes of optimizer state per parameter (sum of the state
tensors' storage; torch fp32 AdamW: 8). torchao's AdamWFp8 / AdamW8bit are included when torchao
imports. Usage::

    python -m benchmarks.optim [--params 100e6] [--rounds 5] [--threads 1] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

import fp8pass.optim as fo


def make_params(total: int) -> list[torch.nn.Parameter]:
    """Matrices of 2048 x 2048 (as in a small Llama) until ``total``, the rest as one tensor, plus norms."""
    g = torch.Generator().manual_seed(0)
    shapes, left = [], int(total)
    while left >= 2048 * 2048:
        shapes.append((2048, 2048))
        left -= 2048 * 2048
    shapes += [(2048,)] * min(8, left // 2048)
    left -= 2048 * min(8, left // 2048)
    if left:
        shapes.append((left,))
    params = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    return params


def state_bytes(opt) -> int:
    total = 0
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                if hasattr(v, "__tensor_flatten__"):  # torchao subclasses: count their inner tensors
                    names, _ = v.__tensor_flatten__()
                    total += sum(getattr(v, n).numel() * getattr(v, n).element_size() for n in names)
                else:
                    total += v.numel() * v.element_size()
    return total


def optimizers(params):
    kw = dict(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    out = {
        "torch AdamW(foreach=True)": lambda: torch.optim.AdamW(params, foreach=True, **kw),
        "fp8pass AdamW default, v (auto = compiled here)": lambda: fo.AdamW(params, **kw),
        "fp8pass AdamW compiled, sqrt(v) instead of v": lambda: fo.AdamW(params, v_sqrt=True, **kw),
        "fp8pass AdamW eager (kernels='torch')": lambda: fo.AdamW(params, kernels="torch", **kw),
    }
    try:
        from torchao.optim import AdamW8bit, AdamWFp8

        out["torchao AdamWFp8"] = lambda: AdamWFp8(params, **kw)
        out["torchao AdamW8bit"] = lambda: AdamW8bit(params, **kw)
    except ImportError:
        print("torchao not installed: its AdamWFp8 / AdamW8bit are skipped")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=100e6)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1 by default: on a shared machine OpenMP threads that wait for "
                         "each other make every op up to 100x slower, for every optimizer)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    params = make_params(int(args.params))
    n = sum(p.numel() for p in params)
    start = [p.detach().clone() for p in params]
    makers = optimizers(params)
    times: dict[str, list[float]] = {k: [] for k in makers}
    nbytes = {}
    opts = {}
    for name, make in makers.items():  # one warm-up step each creates the state
        opts[name] = make()
        opts[name].step()
        nbytes[name] = state_bytes(opts[name])
    for _ in range(args.rounds):
        for name, opt in opts.items():
            t0 = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - t0)
    with torch.no_grad():
        for p, s in zip(params, start):
            p.copy_(s)
    base = statistics.median(times["torch AdamW(foreach=True)"])
    rows = []
    print(f"{n / 1e6:.1f}M parameters in {len(params)} tensors, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
    print(f"| optimizer | step s (median of {args.rounds}) | / torch AdamW(foreach) | state bytes/param |")
    print("|---|---|---|---|")
    for name in makers:
        med = statistics.median(times[name])
        rows.append(dict(optimizer=name, step_s=med, ratio=med / base, bytes_per_param=nbytes[name] / n,
                         all_steps_s=times[name]))
        print(f"| {name} | {med:.3f} | {med / base:.2f} | {nbytes[name] / n:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(params=n, torch=torch.__version__, threads=torch.get_num_threads(), rows=rows), f,
                      indent=1)


if __name__ == "__main__":
    main()
