"""2-rank worker for the gradient-accumulation agreement test (tests/numerics/test_scaling.py): DDP over the
tiny Llama of tests/_dist.py compiled with backend fp8, micro-batches inside
``fp8pass.accumulate_scaling``, each rank on its own rows; writes the scaling state after every
optimizer step."""

from __future__ import annotations

import os

import _dist
import torch
import torch.distributed as dist

import fp8pass
from fp8pass.distributed import scaling_states


def accumulate_worker(rank: int, world: int, init_file: str, out_dir: str, steps: int, micro: int):
    from torch.nn.parallel import DistributedDataParallel as DDP

    _dist.init(rank, world, init_file)
    model = _dist.make_model()
    compiled = torch.compile(DDP(model), backend=fp8pass.backend(_dist.fp8_config("auto")))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    out = {"states": []}
    for step in range(steps):
        with fp8pass.accumulate_scaling(model):
            for k in range(micro):
                x, y = _dist.local_batch(step * micro + k, rank, world)
                compiled(x, y).backward()
        opt.step()
        opt.zero_grad()
        out["states"].append({k: torch.cat([s.scale.reshape(1), s.amax_history, s.steps.reshape(1).float()]).clone()
                              for k, s in scaling_states(model)})
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()
