"""Profile the delayed-scaling state updates of the tiny Llama fp8 step (CPU): ops, kernels, time.

Command::

    python -m tools.state_updates [--steps 3] [--d-model 256 --layers 4 --batch 8 --seq 256]

Prints one JSON line: the step's total profiled time, and for the state-update ops
(``fp8pass::delayed_record_``, ``fp8pass::delayed_record_many_``, and Inductor kernels named after
them) their call counts and self+children CPU time per step, with the machine facts (CPU capability,
native bf16, load). Ratios within one run only (the machine is shared).
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from fp8pass.train import ModelConfig, TinyLlama
from fp8pass.train.recipes import build_optimizer, get_recipe, prepare_model

STATE_OPS = ("fp8pass::delayed_record_", "fp8pass::delayed_record_many_")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--kernels", action="store_true", help="profile Inductor's CPU kernels too (names, counts)")
    ap.add_argument("--time", type=int, default=0, help="also time this many steps without the profiler")
    a = ap.parse_args(argv)
    if a.kernels:
        import torch._inductor.config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True
    cfg = ModelConfig(d_model=a.d_model, n_layers=a.layers, n_heads=max(1, a.d_model // 64),
                      ffn=int(a.d_model * 8 / 3) // 16 * 16, max_seq_len=a.seq)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (a.batch, a.seq + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    torch.manual_seed(0)
    model = TinyLlama(cfg)
    recipe = get_recipe("fp8-smooth-fp8adam")
    fwd = prepare_model(model, recipe)
    opt = build_optimizer(model, recipe, lr=1e-3, weight_decay=0.1)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = fwd(x, y)
        loss.backward()
        opt.step()

    for _ in range(2):
        step()  # compile, optimizer state
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(a.steps):
            with torch.profiler.record_function("train_step"):
                step()
    events = prof.key_averages()
    per = {}
    total_ms = 0.0
    for e in events:
        if e.key == "train_step":
            total_ms = e.cpu_time_total / 1e3 / a.steps
        if e.key in STATE_OPS or "delayed_record" in e.key:
            per[e.key] = {"calls_per_step": e.count / a.steps, "ms_per_step": e.cpu_time_total / 1e3 / a.steps}
    # aten ops run inside the state-update ops (their children): the kernels the updates cost
    children = 0
    for e in prof.events():
        if e.name in STATE_OPS or "delayed_record" in e.name:
            children += sum(1 for c in e.cpu_children)
    kernels = {}
    if a.kernels:  # Inductor's generated kernels: the state updates fused into a graph show up here
        for e in events:
            if "cpp_fused" in e.key or e.key.startswith("graph_"):
                kernels[e.key] = [e.count / a.steps, round(e.cpu_time_total / 1e3 / a.steps, 4)]
    timed = None
    if a.time:
        import time

        ts = []
        for _ in range(a.time):
            t0 = time.perf_counter()
            step()
            ts.append(time.perf_counter() - t0)
        timed = sorted(ts)[len(ts) // 2] * 1e3
    out = {"step_ms": total_ms, "step_ms_unprofiled_median": timed, "inductor_kernels": kernels, "state_ops": per, "direct_child_ops_per_step": children / a.steps,
           "cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "bf16_native": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
           "load": os.getloadavg()}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
