"""What a precision switch inside a run costs (issue 30 item 4), ratios measured in one run.

The tiny Llama (fp8pass.train.TinyLlama, 4 blocks) trains with ``backend=fp8pass.backend(cfg)``: a
first step (it compiles), steady steps, then ``fp8pass.switch_precision(model, [Rule(SWITCHED,
"high")])``, the switch step (it compiles the changed graph again) and steady steps after it. Printed:
the backend's compile count before and after the switch, the switch step's time against the first
step's (both compile the model's graph: the switch costs one compile, not a restart), the steady step
times before and after, and the per-call cost of the check that reads the model's precision epoch
and mode, against a steady step.

Usage: python -m tools.precision_switch [--compiler inductor|aot_eager] [--switched 'layers.[23].*']
         [--threads 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import timeit
from pathlib import Path

import torch

import fp8pass
from fp8pass import Config, Rule
from fp8pass.train import ModelConfig, TinyLlama


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compiler", default="inductor", choices=("inductor", "aot_eager"))
    ap.add_argument("--switched", default="layers.[23].*", help="glob of the linears switched to high precision")
    ap.add_argument("--steady", type=int, default=5, help="steady steps timed before and after the switch")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: a shared CPU)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    model = TinyLlama(ModelConfig())
    be = fp8pass.backend(Config(compiler=args.compiler))
    fwd = torch.compile(model, backend=be)
    x, y = torch.randint(0, 256, (8, 128)), torch.randint(0, 256, (8, 128))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> float:
        t0 = time.perf_counter()
        fwd(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    first = step()
    before = statistics.median(step() for _ in range(args.steady))
    compiles_before = be.compiles
    fp8pass.switch_precision(model, [Rule(args.switched, "high")], reason="benchmark")
    switch = step()
    after = statistics.median(step() for _ in range(args.steady))
    n = 100_000
    check = timeit.timeit(lambda: be._precision_key(model), number=n) / n
    out = {"compiler": args.compiler, "switched": args.switched, "first_step_s": first, "steady_before_s": before,
           "switch_step_s": switch, "steady_after_s": after, "compiles_before": compiles_before,
           "compiles_after": be.compiles, "switch_over_first": switch / first,
           "check_us": check * 1e6, "check_over_step": check / before}
    print(f"compiles: {compiles_before} before the switch, {be.compiles} after ({args.compiler})")
    print(f"first step {first:.2f} s, switch step {switch:.2f} s: ratio {switch / first:.2f}")
    print(f"steady step {before * 1e3:.1f} ms before, {after * 1e3:.1f} ms after (ratio {after / before:.2f})")
    print(f"precision check per graph call {check * 1e6:.2f} us = {check / before:.2e} of a steady step")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
