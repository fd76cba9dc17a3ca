"""bf16 weights with stochastic rounding (``AdamW(bf16_stochastic_round=True)``) under FSDP2 and DCP:
helpers for tests/distributed/test_bf16_sr_sharded.py.

A small bf16 MLP whose parameters cover the shard layouts: a weight whose shards hold whole
128-element blocks (FP8 moments), rows split unevenly (17 + 16), a shard of 4 rows that is not a
whole number of blocks, vectors, and a 1-row weight one rank holds nothing of (those with bf16
moments: FP8 moments need whole blocks per shard). Every rank trains on the same batch, so the
gradient FSDP2 reduce-scatters is the mean of equal values (exact) and the sharded step is compared
with one process bit for bit. Weights and moments are returned whole (``full_tensor``) by FQN.
"""

from __future__ import annotations

import os

import _dist
import torch
import torch.distributed as dist
import torch.nn as nn

import fp8pass
from fp8pass.optim.sharded import flat_offset

STEPS, CKPT_STEP = 4, 2
GEN_SEED = 7  # the optimizer's generator: seeded alike on every rank, so every rank draws the same seeds


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 64)  # weight [64, 32]: 2 shards of 1024 elements, 8 blocks each
        self.b = nn.Linear(64, 33)  # weight [33, 64]: shards of 17 and 16 rows
        self.c = nn.Linear(33, 8, bias=False)  # weight [8, 33]: shards of 132 elements
        self.tiny = nn.Parameter(torch.zeros(1, 8))  # 1 row: rank 1's shard is empty

    def forward(self, x):
        h = torch.relu(self.b(torch.relu(self.a(x))))
        return (self.c(h) + self.tiny).float().square().mean()


def make_model() -> Net:
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        model.tiny.normal_()
    return model.to(torch.bfloat16)


def make_optimizer(model: nn.Module) -> fp8pass.optim.AdamW:
    fp8 = [p for n, p in model.named_parameters() if n == "a.weight"]
    dense = [p for n, p in model.named_parameters() if n != "a.weight"]
    return fp8pass.optim.AdamW([{"params": fp8}, {"params": dense, "m_format": "bf16", "v_format": "bf16"}],
                               lr=3e-3, weight_decay=0.1, block_size=128, bf16_stochastic_round=True,
                               kernels="torch", generator=torch.Generator().manual_seed(GEN_SEED))


def batch(step: int) -> torch.Tensor:
    return torch.randn(8, 32, generator=torch.Generator().manual_seed(100 + step)).to(torch.bfloat16)


def _whole(t: torch.Tensor) -> torch.Tensor:
    if not hasattr(t, "full_tensor"):
        return t.detach().clone()
    if t.dtype.itemsize == 1 and t.dtype.is_floating_point:  # gloo gathers no float8: gather the bytes
        from torch.distributed.tensor import DTensor

        raw = DTensor.from_local(t.to_local().view(torch.uint8), t.device_mesh, t.placements, run_check=False,
                                 shape=t.shape, stride=t.stride())
        return raw.full_tensor().view(t.dtype)
    return t.full_tensor().detach().clone()


def snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """Every weight and every optimizer state tensor, whole, by FQN (a collective under FSDP2)."""
    names = {p: n for n, p in model.named_parameters()}
    return {"weights": {n: _whole(p) for n, p in model.named_parameters()},
            "state": {f"{names[p]}.{k}": _whole(v) for p, st in opt.state.items() for k, v in st.items()}}


def train(model, opt, first: int, last: int, out: list) -> None:
    for step in range(first, last):
        model(batch(step)).backward()
        out.append({"grads": {n: _whole(p.grad) for n, p in model.named_parameters()}})
        opt.step()
        opt.zero_grad(set_to_none=True)
        out[-1].update(snapshot(model, opt))


def shard(model: nn.Module, world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    return fully_shard(model, mesh=init_device_mesh("cpu", (world,)))


def single_process(first: int = 0, last: int = STEPS, load: str | None = None, save: str | None = None) -> list:
    """One process, no FSDP: steps ``[first, last)``, after loading the DCP checkpoint ``load`` (its
    saved generator state restored) or from the start; saves a checkpoint at the end when ``save``."""
    model = make_model()
    opt = make_optimizer(model)
    if load is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()  # the checkpoint must supply every value
        load_with_generator(load, model, opt)
    out: list = []
    train(model, opt, first, last, out)
    if save is not None:
        save_with_generator(save, model, opt)
    return out


def save_with_generator(path: str, model, opt) -> None:
    """The optimizer's generator is not optimizer state (as in torch): an exact resume saves it too."""
    fp8pass.distributed.save_checkpoint(path, model, opt, extra={"generator": opt.generator.get_state()})


def load_with_generator(path: str, model, opt) -> None:
    extra = {"generator": torch.empty_like(opt.generator.get_state())}
    fp8pass.distributed.load_checkpoint(path, model, opt, extra=extra)
    opt.generator.set_state(extra["generator"])  # after the load: DCP's state init steps the optimizer once


def fsdp_worker(rank: int, world: int, init_file: str, out_dir: str, one_process_ckpt: str) -> None:
    """FSDP2 on ``world`` ranks: an uninterrupted run saving a DCP checkpoint after ``CKPT_STEP`` steps
    (``ckpt_fsdp``), and a run resumed from ``one_process_ckpt`` (written by one process)."""
    _dist.init(rank, world, init_file)
    model = shard(make_model(), world)
    opt = make_optimizer(model)
    run: list = []
    train(model, opt, 0, CKPT_STEP, run)
    save_with_generator(os.path.join(out_dir, "ckpt_fsdp"), model, opt)
    train(model, opt, CKPT_STEP, STEPS, run)
    offsets = {n: flat_offset(p) for n, p in model.named_parameters()}

    model = shard(make_model(), world)
    opt = make_optimizer(model)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    load_with_generator(one_process_ckpt, model, opt)
    resumed: list = []
    train(model, opt, CKPT_STEP, STEPS, resumed)
    torch.save({"run": run, "resumed": resumed, "offsets": offsets}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()
