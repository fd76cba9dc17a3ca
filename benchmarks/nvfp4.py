"""Cost of the NVFP4 recipe on this CPU (ratios measured in one run; emulation, no FP4 hardware).

1. one linear, fwd + bwd (bf16 activations and weights, ``tokens x in -> out``):
   NVFP4 / bf16 ``F.linear`` (the emulation cost), NVFP4+HCP / NVFP4 (goal <= 1.10), both HCP modes;
2. a training step (fwd + bwd) of the 4-layer tiny Llama of experiments/nvfp4.py, compiled with
   ``fp8pass.backend(Config(recipe=NVFP4Scaling(...), compiler="eager"))``: NVFP4 / fp32 eager,
   NVFP4+HCP / NVFP4.

Timings round-robin over the variants, ``--repeat`` rounds after one warm-up; a ratio is the
median of the ratios measured within a round. The machine is shared: absolute times are noisy,
the ratios (measured back to back in one process) less so.

Usage: python -m benchmarks.nvfp4 [--tokens 1024] [--dim 256] [--repeat 5] [--json out.json]
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
from benchmarks.common import baseline_dtype, dtype_name
from fp8pass import Config, HotChannelPatching, NVFP4Scaling
from fp8pass.runtime import HCPState


def _interleaved(fns: dict, repeat: int) -> tuple[dict, list[dict]]:
    """Round-robin timings (one warm-up each): per-name medians and the per-round timings, so a
    ratio can be taken within a round (the shared CPU's load drifts between rounds)."""
    for f in fns.values():
        f()
    rounds = []
    for _ in range(repeat):
        r = {}
        for name, f in fns.items():
            t0 = time.perf_counter()
            f()
            r[name] = time.perf_counter() - t0
        rounds.append(r)
    return {n: statistics.median(r[n] for r in rounds) for n in fns}, rounds


def _ratio(rounds, a, b):
    """Median over rounds of ``t_a / t_b`` measured in the same round."""
    return statistics.median(r[a] / r[b] for r in rounds)


def bench_linear(tokens, dim, repeat):
    g = torch.Generator().manual_seed(0)
    dtype = baseline_dtype("cpu")  # bf16, or fp32 on CPUs without native bf16 matmuls
    x = torch.randn(tokens, dim, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(dim, dim, generator=g) * dim ** -0.5).to(dtype).requires_grad_()
    dy = torch.randn(tokens, dim, generator=g).to(dtype)

    def step(f):
        def run():
            x.grad = w.grad = None
            f().backward(dy)
        return run

    plain = NVFP4Scaling()
    fns = {"bf16": step(lambda: F.linear(x, w)),
           "nvfp4": step(lambda: fp8pass.ops.nvfp4_linear(x, w, recipe=plain))}
    for mode, bwd in (("split", False), ("concat", False), ("split", True)):  # forward HCP; + gradients
        hcp = HotChannelPatching(mode=mode, backward=bwd)
        st, r = HCPState(hcp, dim), NVFP4Scaling(hcp=hcp)
        fns[f"nvfp4+hcp({mode}{',bwd' if bwd else ''})"] = step(
            lambda r=r, st=st: fp8pass.ops.nvfp4_linear(x, w, recipe=r, hcp_state=st))
    return _interleaved(fns, repeat)


def bench_model(repeat):
    from fp8pass.train import ModelConfig, TinyLlama  # the model of experiments/nvfp4.py

    x = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(0))
    fns = {}
    last = dict(keep_last_blocks=None)  # 1 of the 4 blocks kept (the default 4 would keep all)
    for name, recipe in (("fp32", None), ("nvfp4", NVFP4Scaling(**last)),
                         ("nvfp4+hcp", NVFP4Scaling(hcp=HotChannelPatching(backward=False), **last))):
        torch.manual_seed(0)
        model = TinyLlama(ModelConfig(d_model=64, n_layers=4, n_heads=4, ffn=176, max_seq_len=64))
        f = model if recipe is None else torch.compile(model, backend=fp8pass.backend(
            Config(recipe=recipe, compiler="eager")))

        def run(model=model, f=f):
            model.zero_grad(set_to_none=True)
            F.cross_entropy(f(x).reshape(-1, 256), x.reshape(-1)).backward()
        fns[name] = run
    return _interleaved(fns, repeat)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    lin, lin_rounds = bench_linear(args.tokens, args.dim, args.repeat)
    mod, mod_rounds = bench_model(args.repeat)
    ratios = {  # medians of same-round ratios
        "linear nvfp4 / bf16": _ratio(lin_rounds, "nvfp4", "bf16"),
        "linear hcp(split) / nvfp4": _ratio(lin_rounds, "nvfp4+hcp(split)", "nvfp4"),
        "linear hcp(concat) / nvfp4": _ratio(lin_rounds, "nvfp4+hcp(concat)", "nvfp4"),
        "linear hcp(split,bwd) / nvfp4": _ratio(lin_rounds, "nvfp4+hcp(split,bwd)", "nvfp4"),
        "model step nvfp4 / fp32": _ratio(mod_rounds, "nvfp4", "fp32"),
        "model step hcp / nvfp4": _ratio(mod_rounds, "nvfp4+hcp", "nvfp4"),
    }
    dtype = dtype_name(baseline_dtype("cpu"))
    print(f"linear {args.tokens}x{args.dim}->{args.dim} in {dtype} (the 'bf16' row's dtype), fwd+bwd, "
          f"median of {args.repeat} (s):")
    for k, v in lin.items():
        print(f"  {k:20s} {v:.4f}")
    print("tiny Llama training step (s):")
    for k, v in mod.items():
        print(f"  {k:20s} {v:.4f}")
    print("ratios:")
    for k, v in ratios.items():
        goal = "  (goal <= 1.10: " + ("met" if v <= 1.10 else "NOT met") + ")" if "hcp" in k else ""
        print(f"  {k:28s} {v:6.2f}{goal}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "baseline_dtype": dtype, "linear_s": lin,
                                               "model_step_s": mod,
                                               "ratios": ratios, "linear_rounds": lin_rounds,
                                               "model_rounds": mod_rounds}, indent=1))


if __name__ == "__main__":
    main()
