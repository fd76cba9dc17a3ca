"""MoE expert layer in FP8 (grouped ops) vs bf16 grouped experts, fwd+bwd, ratios measured in one run.

    python -m benchmarks.moe [--tokens 4096] [--experts 8] [--topk 2] [--dim 1024] [--ffn 2816]
                             [--repeat 5] [--quick] [--threads N] [--grad-rounding nearest] [--json FILE]

A Mixtral-style expert block on the routed rows (tokens x topk rows sorted by expert; the router and
the token permutation are the same in both variants and left out): fused gate/up ``[E, 2 ffn, dim]``,
SwiGLU, down ``[E, dim, ffn]``. FP8: ``fp8pass::fp8_grouped_linear`` + ``fp8pass::fp8_grouped_swiglu_down``
(Smooth-SwiGLU channel mode), current and delayed per-expert scaling; gradients rounded to nearest
(the recorded results) or, ``--grad-rounding stochastic``, as the backend's default. bf16 baselines: the same math
with ``torch._grouped_mm`` and with one bf16 matmul per expert; the ratio is taken against the faster
of the two (the honest baseline on this machine). Medians (and minima) of ``--repeat`` interleaved
rounds after warm-up (the order rotated every round); on a shared CPU compare the ratios of one run,
not absolute times across runs.
Each round's process CPU time (all threads, ``time.process_time``) is recorded too: on a CPU shared
with other processes, wall time also counts the time this process waited for a core, CPU time does
not (OpenMP threads that spin while waiting for each other still count), so its ratios move less.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

import fp8pass  # noqa: F401  (registers the ops)
from benchmarks.common import machine, time_rounds
from fp8pass.op_schema import GroupedGLUKnobs, GroupedLinearKnobs
from fp8pass.runtime import LinearScalingState

# out_dtype None: the input's (bf16)
FP8 = GroupedLinearKnobs("e4m3", "e5m2", False, "nearest", 0.0, 1, "max", None, True)
FP8_GLU = GroupedGLUKnobs(*FP8.args(), activation="silu", smooth="channel")



def routed_offsets(tokens: int, experts: int, topk: int, seed: int = 0) -> torch.Tensor:
    """int32 [E] cumulative ends of the rows each expert gets from a random top-k routing."""
    g = torch.Generator().manual_seed(seed)
    choice = torch.rand(tokens, experts, generator=g).topk(topk, dim=1).indices.reshape(-1)
    return torch.bincount(choice, minlength=experts).cumsum(0).to(torch.int32)


def cases(tokens, experts, topk, dim, ffn, device, split_glu=False, grad_rounding="nearest", wrap=None):
    """fwd+bwd steps of the expert block: bf16 (grouped, per expert) and FP8 (current, delayed);
    ``wrap`` (e.g. ``torch.compile``) is applied to each forward function."""
    wrap = wrap or (lambda fn: fn)
    dtype = torch.bfloat16
    offs = routed_offsets(tokens, experts, topk).to(device)
    rows = tokens * topk
    x = torch.randn(rows, dim, device=device, dtype=dtype, requires_grad=True)
    w_gu = (torch.randn(experts, 2 * ffn, dim, device=device, dtype=dtype) / dim**0.5).requires_grad_()
    w_d = (torch.randn(experts, dim, ffn, device=device, dtype=dtype) / ffn**0.5).requires_grad_()
    dy = torch.randn(rows, dim, device=device, dtype=dtype)
    bounds = [0] + offs.tolist()

    def run(f):
        f = wrap(f)

        def step():
            x.grad = w_gu.grad = w_d.grad = None
            f().backward(dy)
        return step

    def bf16_grouped():
        gate, up = torch._grouped_mm(x, w_gu.transpose(1, 2), offs=offs).chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(gate) * up, w_d.transpose(1, 2), offs=offs)

    def bf16_loop():
        outs = []
        for e in range(experts):
            xs = x[bounds[e]:bounds[e + 1]]
            gate, up = (xs @ w_gu[e].t()).chunk(2, dim=-1)
            outs.append((F.silu(gate) * up) @ w_d[e].t())
        return torch.cat(outs)

    delayed = fp8pass.DelayedScaling()
    st_gu, st_d = LinearScalingState(delayed, device, experts=experts), LinearScalingState(delayed, device,
                                                                                           experts=experts)

    lin_knobs = replace(FP8, grad_rounding=grad_rounding)
    glu_knobs = replace(FP8_GLU, grad_rounding=grad_rounding)

    def fp8(states, split_glu=False):
        def f():
            s1 = states[0].op_args() if states else ([], [], [])
            s2 = states[1].op_args() if states else ([], [], [])
            out = torch.ops.fp8pass.fp8_grouped_linear(x, w_gu, offs, False, *s1, None, *lin_knobs.args())
            # gate_up whole (up=None), as the backend passes a chunk(2, -1) split: no cat in backward;
            # split_glu: the chunk's two views instead (autograd cats their gradients)
            gate, up = out[0].chunk(2, dim=-1) if split_glu else (out[0], None)
            o2 = torch.ops.fp8pass.fp8_grouped_swiglu_down(gate, up, w_d, offs, False, *s2, None, *glu_knobs.args())
            if states:
                states[0].record_forward(out[1], out[2])
                states[1].record_forward(o2[1], o2[2])
            return o2[0]
        return f

    fns = {
        "bf16_grouped_mm": run(bf16_grouped),
        "bf16_per_expert": run(bf16_loop),
        "fp8_current": run(fp8(None)),
        "fp8_delayed": run(fp8((st_gu, st_d))),
    }
    if split_glu:
        fns["fp8_current_split_glu"] = run(fp8(None, split_glu=True))
    return fns, offs


def profile_steps(fns: dict, top: int) -> None:
    """Print each case's ``top`` ops of one warm step by self CPU time (torch.profiler). The compiled CPU
    kernels are labelled with their function (``K:<name>``, total time) beside Inductor's anonymous
    ``CompiledFxGraph`` entries. On a shared machine compare ops within one step, not wall times."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from fp8pass.kernels import cpu as cpu_kernels

    run_compiled = cpu_kernels._run_compiled

    def labelled(fn, eager, *args):
        with record_function("K:" + getattr(fn, "__name__", "?")[:60]):
            return run_compiled(fn, eager, *args)

    cpu_kernels._run_compiled = labelled  # diagnostic only; restored below
    try:
        for name, fn in fns.items():
            fn(), fn()  # warm
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                t = time.perf_counter()
                fn()
                wall = time.perf_counter() - t
            events = prof.key_averages()
            print(f"== {name}: wall {wall * 1e3:.0f} ms, {sum(e.count for e in events)} op events, "
                  f"load {os.getloadavg()[0]:.2f}, threads {torch.get_num_threads()}")
            ms = {e.key: (e.cpu_time_total if e.key.startswith("K:") else e.self_cpu_time_total) / 1e3 for e in events}
            for e in sorted(events, key=lambda e: -ms[e.key])[:top]:
                print(f"  {ms[e.key]:8.1f} ms {e.count:5d}  {e.key[:100]}")
    finally:
        cpu_kernels._run_compiled = run_compiled


def rotating_rounds(cases: dict, device, repeat: int) -> dict:
    """:func:`time_rounds`, the order of the cases rotated every round: with a fixed order each case
    always ran right after the same other one (fp8 delayed after fp8 current), whatever that leaves
    behind (freed memory, a descheduled thread) landing on the same case every round."""
    names = list(cases)
    times = {k: [] for k in names}
    for r in range(repeat):
        order = names[r % len(names):] + names[:r % len(names)]
        got = time_rounds({k: cases[k] for k in order}, device, 1, warmup=2 if r == 0 else 0)
        for k, v in got.items():
            times[k] += v
    return times


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=2816)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="1024 tokens, 3 rounds (the suite's size)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's); 1 gives CPU times without OpenMP waits on a shared CPU")
    p.add_argument("--split-glu", action="store_true",
                   help="also time fp8 current scaling with the GLU op given chunk(2)'s gate and up views "
                        "(the form before the op took gate_up whole)")
    p.add_argument("--grad-rounding", choices=("nearest", "stochastic"), default="nearest",
                   help="rounding of the FP8 gradients (the backend's default is stochastic)")
    p.add_argument("--json", type=Path)
    p.add_argument("--profile", type=int, metavar="TOP", default=0,
                   help="instead of timing: profile one warm step of each case and print its TOP ops by self "
                        "CPU time, with call counts (compiled CPU kernels named)")
    a = p.parse_args(argv)
    if a.quick:
        a.tokens, a.repeat = 1024, 3
    device = torch.device(a.device)
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    load_before = os.getloadavg()
    fns, offs = cases(a.tokens, a.experts, a.topk, a.dim, a.ffn, device, a.split_glu, a.grad_rounding)
    if a.profile:
        profile_steps(fns, a.profile)
        return None
    cpu_rounds = {k: [] for k in fns}

    def cpu_timed(k, fn):
        def f():
            t = time.process_time()
            fn()
            cpu_rounds[k].append(time.process_time() - t)
        return f

    rounds = rotating_rounds({k: cpu_timed(k, fn) for k, fn in fns.items()}, device, a.repeat)
    cpu_rounds = {k: v[-a.repeat:] for k, v in cpu_rounds.items()}  # the timed rounds (not the warm-up)
    cpu_times = {k: statistics.median(v) for k, v in cpu_rounds.items()}
    cpu_base = min(cpu_times["bf16_grouped_mm"], cpu_times["bf16_per_expert"])
    times = {k: statistics.median(v) for k, v in rounds.items()}
    best = {k: min(v) for k, v in rounds.items()}  # other processes only ever add time: min is the least noisy
    base = min(times["bf16_grouped_mm"], times["bf16_per_expert"])
    base_min = min(best["bf16_grouped_mm"], best["bf16_per_expert"])
    result = {
        "device": str(device), "machine": machine(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
        "shape": {"tokens": a.tokens, "experts": a.experts, "topk": a.topk, "dim": a.dim, "ffn": a.ffn,
                  "rows_per_expert": torch.diff(offs.cpu(), prepend=offs.new_zeros(1).cpu()).tolist()},
        "grad_rounding": a.grad_rounding, "repeat": a.repeat, "seconds": times, "seconds_min": best, "rounds": rounds,
        "bf16_baseline": "bf16_grouped_mm" if base == times["bf16_grouped_mm"] else "bf16_per_expert",
        "fp8_current/bf16": times["fp8_current"] / base,
        "fp8_delayed/bf16": times["fp8_delayed"] / base,
        "fp8_current/bf16 (min)": best["fp8_current"] / base_min,
        "fp8_delayed/bf16 (min)": best["fp8_delayed"] / base_min,
        "cpu_seconds": cpu_times, "cpu_rounds": cpu_rounds,
        "fp8_current/bf16 (cpu time)": cpu_times["fp8_current"] / cpu_base,
        "fp8_delayed/bf16 (cpu time)": cpu_times["fp8_delayed"] / cpu_base,
    }
    if a.split_glu:
        result["fp8_current/fp8_current_split_glu"] = times["fp8_current"] / times["fp8_current_split_glu"]
    print(f"machine: {result['machine']['cpu']}, capability {result['cpu_capability']}, "
          f"threads {result['machine']['threads']}, load {load_before} -> {result['loadavg_after']}")
    print(f"shape: {result['shape']}")
    print(", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in times.items()))
    print(f"baseline {result['bf16_baseline']}: fp8_current/bf16 = {result['fp8_current/bf16']:.3f}, "
          f"fp8_delayed/bf16 = {result['fp8_delayed/bf16']:.3f} (medians); by the fastest round: "
          f"{result['fp8_current/bf16 (min)']:.3f}, {result['fp8_delayed/bf16 (min)']:.3f}")
    print("process CPU time (median): " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in cpu_times.items())
          + f"; fp8_current/bf16 = {result['fp8_current/bf16 (cpu time)']:.3f}, "
          f"fp8_delayed/bf16 = {result['fp8_delayed/bf16 (cpu time)']:.3f}")
    if a.split_glu:
        print(f"fp8_current (gate_up whole) / fp8_current_split_glu (chunk views) = "
              f"{result['fp8_current/fp8_current_split_glu']:.3f} (medians)")
    if a.json:
        a.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
