"""Distributed benchmark: bytes all-gathered per step with FP8 all-gather vs bf16, and 2-rank step time.

Two gloo processes on CPU (one thread each) train a small Llama with FSDP2 (``fully_shard`` per
block + root, per-block compile) for a few steps, three ways:

* ``bf16``: plain model, ``MixedPrecisionPolicy(param_dtype=bf16)``, blocks compiled with aot_eager;
* ``fp8``: backend fp8 (channel Smooth-SwiGLU), FP8 all-gather of the eligible weights;
* ``fp8-token``: backend fp8 with token Smooth-SwiGLU (the down projection is then also gathered in FP8).

All-gather bytes are counted at FSDP2's collective call (what each rank contributes); step time is the
median of the timed steps. Usage::

    python -m benchmarks.distributed [--steps 6] [--json FILE] [--md FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fp8pass
from fp8pass.train.model import ModelConfig, TinyLlama

SEQ, BATCH = int(os.environ.get("BENCH_SEQ", 128)), 8


def _worker(rank, world, init_file, out, variant, steps):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    if os.environ.get("BENCH_ANOMALY"):
        torch.autograd.set_detect_anomaly(True)
    d = int(os.environ.get("BENCH_D", 128))
    model = TinyLlama(ModelConfig(d_model=d, n_layers=2, n_heads=int(os.environ.get("BENCH_HEADS", 4)), ffn=3 * d, max_seq_len=SEQ))
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(0, 256, (BATCH, SEQ + 1), generator=g)
    n = BATCH // world
    x, y = toks[rank * n:(rank + 1) * n, :-1], toks[rank * n:(rank + 1) * n, 1:]
    mesh = init_device_mesh("cpu", (world,))
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if os.environ.get("BENCH_PARAM_DTYPE") != "fp32" else None)
    kw = {} if os.environ.get("BENCH_PARAM_DTYPE") == "fp32" else {"mp_policy": mp_policy}
    if variant == "bf16":
        backend = "aot_eager"
    else:
        cfg = fp8pass.Config(compiler="aot_eager", grad_stochastic_rounding=os.environ.get("BENCH_SR") == "1", smooth_swiglu="token" if variant == "fp8-token" else "channel")
        report = fp8pass.explain(model, x, y, config=cfg)
        fp8pass.distributed.enable_fp8_all_gather(model, cfg, fp8pass.distributed.fp8_all_gather_weights(report, cfg))
        backend = fp8pass.backend(cfg)
    for block in model.layers:
        block.compile(backend=backend)
        fully_shard(block, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    if variant != "bf16":
        fp8pass.distributed.link_fp8_all_gather(model)
    sync = fp8pass.distributed.AmaxSync(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    names = [n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)]
    real = {k: getattr(dist, k) for k in names}
    gathered = []

    def counting(fn):
        def call(output, inp, *a, **k):
            gathered.append(inp.numel() * inp.element_size())
            return fn(output, inp, *a, **k)
        return call

    for k in names:
        setattr(dist, k, counting(real[k]))
    times, per_step = [], []
    for step in range(steps):
        gathered.clear()
        dist.barrier()
        t0 = time.perf_counter()
        model(x, y).backward()
        sync.sync()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.barrier()
        times.append(time.perf_counter() - t0)
        per_step.append(sum(gathered))
    if rank == 0:
        torch.save({"times": times[2:], "bytes": per_step[-1]}, out)
    dist.destroy_process_group()


def run(variant: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.pt")
        mp.start_processes(_worker, args=(2, os.path.join(d, "init"), out, variant, steps), nprocs=2,
                           join=True, start_method="spawn")
        r = torch.load(out)
    return {"variant": variant, "allgather_bytes_per_step_rank0": r["bytes"],
            "step_s_median": statistics.median(r["times"]), "step_s": r["times"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--json")
    ap.add_argument("--md")
    ap.add_argument("--variants", default="bf16,fp8,fp8-token")
    a = ap.parse_args()
    os.environ.setdefault("FP8PASS_CPU_FUSED", "0")
    res = {v: run(v, a.steps) for v in a.variants.split(",")}
    base = res["bf16"]
    lines = ["| variant | all-gather bytes/step (rank 0) | vs bf16 | step time (median, s) | vs bf16 |",
             "|---|---|---|---|---|"]
    for v, r in res.items():
        r["bytes_ratio"] = r["allgather_bytes_per_step_rank0"] / base["allgather_bytes_per_step_rank0"]
        r["time_ratio"] = r["step_s_median"] / base["step_s_median"]
        lines.append(f"| {v} | {r['allgather_bytes_per_step_rank0']} | {r['bytes_ratio']:.3f} | "
                     f"{r['step_s_median']:.3f} | {r['time_ratio']:.2f} |")
    table = "\n".join(lines)
    print(table)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    if a.md:
        with open(a.md, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
