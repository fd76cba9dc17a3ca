"""Multi-process helpers for tests/distributed/test_distributed.py: gloo on CPU, one thread per rank, tiny model.

Each worker trains a tiny Llama compiled with backend fp8 (aot_eager, round-to-nearest gradients so
runs are deterministic) on its slice of a fixed global batch and writes its per-step losses and
scaling state to ``out_dir/rank{r}.pt``.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import fp8pass
from fp8pass.distributed import AmaxSync, scaling_states
from fp8pass.train.model import ModelConfig, TinyLlama

GLOBAL_BATCH, SEQ = 4, 16


def tiny_config(**kw):
    return ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, ffn=64, max_seq_len=SEQ, **kw)


def fp8_config(amax_reduction="auto"):
    recipe = fp8pass.CurrentScaling() if os.environ.get("FP8PASS_TEST_RECIPE") == "current" else fp8pass.DelayedScaling()
    return fp8pass.Config(compiler="aot_eager", grad_stochastic_rounding=False, recipe=recipe,
                          amax_reduction=amax_reduction)


def global_batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, 64, (GLOBAL_BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def local_batch(step: int, rank: int, world: int):
    x, y = global_batch(step)
    n = GLOBAL_BATCH // world
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def make_model():
    torch.manual_seed(0)
    return TinyLlama(tiny_config())


def make_optimizer(params, kind: str):
    if kind == "fp8adam":
        # FP8 moments for the matrices; vectors (norm weights) keep fp32 moments: under FSDP2 their
        # shards are smaller than one 128-element block (see fp8pass/optim/sharded.py)
        params = list(params)
        return fp8pass.optim.AdamW([{"params": [p for p in params if p.dim() >= 2]},
                                    {"params": [p for p in params if p.dim() < 2], "m_format": "fp32",
                                     "v_format": "fp32"}], lr=3e-3, weight_decay=0.1, block_size=128)
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1)


def scales(model) -> dict[str, torch.Tensor]:
    return {k: torch.cat([s.scale.reshape(1), s.amax_history]).clone() for k, s in scaling_states(model)}


def init(rank: int, world: int, init_file: str):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)


def mean_over_ranks(loss: torch.Tensor) -> float:
    t = loss.detach().clone()
    if dist.is_initialized():
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return float(t)


def run_steps(model, compiled, opt, sync, steps, rank, world, out, first=0):
    for step in range(first, first + steps):
        x, y = local_batch(step, rank, world)
        loss = compiled(x, y)
        loss.backward()
        if sync is not None:
            sync.sync()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["loss"].append(mean_over_ranks(loss))
        out["scales"].append(scales(model))
        out.setdefault("weights", []).append({n: p.detach().clone() for n, p in model.named_parameters()
                                              if not hasattr(p, "device_mesh")})
        out["sync_calls"] = sync.calls if sync is not None else 0


def ddp_worker(rank: int, world: int, init_file: str, out_dir: str, steps: int, optim: str, ckpt_step: int = 0):
    """DDP(model) compiled with backend fp8; AmaxSync before each optimizer step; DCP after ``ckpt_step`` steps."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    init(rank, world, init_file)
    model = make_model()
    ddp = DDP(model)
    compiled = torch.compile(ddp, backend=fp8pass.backend(fp8_config()))
    opt = make_optimizer(ddp.parameters(), optim)
    out = {"loss": [], "scales": []}
    sync = AmaxSync(ddp)
    first = ckpt_step or steps
    run_steps(model, compiled, opt, sync, first, rank, world, out)
    if ckpt_step:
        fp8pass.distributed.save_checkpoint(os.path.join(out_dir, "ckpt"), ddp, opt)
        run_steps(model, compiled, opt, sync, steps - first, rank, world, out, first=first)
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def plain_loop_worker(rank: int, world: int, init_file: str, out_dir: str, steps: int, kind: str, reduction: str):
    """The plain loop with no AmaxSync call: DDP(model) compiled with backend fp8 (``kind="ddp"``), or
    FSDP2 over per-block compiles (``kind="fsdp"``); each rank trains on its own data."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    init(rank, world, init_file)
    model = make_model()
    cfg = fp8_config(reduction)
    if kind == "ddp":
        wrapped = DDP(model)
        compiled = torch.compile(wrapped, backend=fp8pass.backend(cfg))
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.layers:
            block.compile(backend=fp8pass.backend(cfg))  # a backend per block: still one reduction
            fully_shard(block, mesh=mesh)
        wrapped = compiled = fully_shard(model, mesh=mesh)
    opt = make_optimizer(wrapped.parameters(), "adamw")
    out = {"loss": [], "scales": []}
    run_steps(model, compiled, opt, None, steps, rank, world, out)
    from fp8pass.distributed.auto_reduce import shared_reducer

    out["reductions"] = shared_reducer().reductions
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def single_process(steps: int, optim: str):
    """The reference: one process, the whole global batch, no collectives."""
    torch._dynamo.reset()
    model = make_model()
    compiled = torch.compile(model, backend=fp8pass.backend(fp8_config()))
    opt = make_optimizer(model.parameters(), optim)
    out = {"loss": [], "scales": []}
    run_steps(model, compiled, opt, None, steps, 0, 1, out)
    return out


def resume_single_process(path: str, first: int, steps: int, optim: str, blocks: bool = False):
    """One process loads a DCP checkpoint (written by any number of ranks) and trains on."""
    torch._dynamo.reset()
    model = make_model()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # the checkpoint must supply every value
    opt = make_optimizer(model.parameters(), optim)
    fp8pass.distributed.load_checkpoint(path, model, opt, config=fp8_config())
    if blocks:
        for block in model.layers:
            block.compile(backend=fp8pass.backend(fp8_config()))
        compiled = model
    else:
        compiled = torch.compile(model, backend=fp8pass.backend(fp8_config()))
    out = {"loss": [], "scales": []}
    run_steps(model, compiled, opt, None, steps, 0, 1, out, first=first)
    return out


def spawn(fn, world: int, tmp_path, *args):
    """Run ``fn(rank, world, init_file, out_dir, *args)`` on ``world`` processes; returns per-rank outputs."""
    import torch.multiprocessing as mp

    init_file = str(tmp_path / "init")
    out_dir = str(tmp_path)
    mp.start_processes(fn, args=(world, init_file, out_dir, *args), nprocs=world, join=True, start_method="spawn")
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=True) for r in range(world)]


def shard_model(model, world: int, fp8_all_gather: bool = False):
    """FSDP2 the usual way: compile each block with backend fp8, fully_shard blocks then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    if fp8_all_gather:
        report = fp8pass.explain(model, *global_batch(0), config=fp8_config())
        weights = fp8pass.distributed.fp8_all_gather_weights(report, fp8_config())
        fp8pass.distributed.enable_fp8_all_gather(model, fp8_config(), weights)
    for i, block in enumerate(model.layers):
        block.compile(backend=fp8pass.backend(fp8_config()))
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if fp8_all_gather:
        fp8pass.distributed.link_fp8_all_gather(model)
    return model


def fsdp_worker(rank: int, world: int, init_file: str, out_dir: str, steps: int, optim: str,
                fp8_all_gather: bool = False, ckpt_step: int = 0):
    init(rank, world, init_file)
    model = shard_model(make_model(), world, fp8_all_gather)
    gathered = []
    # what FSDP2 puts on the wire (torch 2.13 calls all_gather_single, 2.11 all_gather_into_tensor)
    names = [n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)]
    real = {n: getattr(dist, n) for n in names}

    def counting(fn):
        def call(output, input, *a, **k):
            gathered.append((input.dtype, input.numel() * input.element_size()))
            return fn(output, input, *a, **k)
        return call

    for n in names:
        setattr(dist, n, counting(real[n]))
    opt = make_optimizer(model.parameters(), optim)
    out = {"loss": [], "scales": []}
    sync = AmaxSync(model)
    first = ckpt_step or steps
    run_steps(model, model, opt, sync, first, rank, world, out)
    if ckpt_step:
        fp8pass.distributed.save_checkpoint(os.path.join(out_dir, "ckpt"), model, opt)
        run_steps(model, model, opt, sync, steps - first, rank, world, out, first=first)
    for n in names:
        setattr(dist, n, real[n])
    out["fp8_bytes_in"] = fp8pass.distributed.GatherStats.bytes_in  # over the same steps as "gathered"
    # one more forward/backward + sync: the weights' newest amax must be the full weight's true amax
    # (the gathered weight is FP8-rounded; FP8ShardWeight notes the shard amax for the sync)
    x, y = local_batch(steps, rank, world)
    model(x, y).backward()
    sync.sync()
    out["sync_calls"] = sync.calls
    opt.zero_grad(set_to_none=True)
    st = dict(scaling_states(model))
    out["weight_amax"] = {n: (float(st[n + ".weight"].amax_history[0]), float(p.full_tensor().abs().max()))
                          for n, p in model.named_parameters()
                          if n + ".weight" in st and type(p.to_local()).__name__ == "FP8ShardWeight"}
    out["gathered"] = [(str(d), n) for d, n in gathered]
    out["local_dtypes"] = {n: type(p.to_local()).__name__ for n, p in model.named_parameters()}
    from fp8pass.monitor import collective_audit

    out["collectives"] = [(r.weight, r.precision, r.dtype, r.note is not None) for r in collective_audit(model)]
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def fsdp_current_worker(rank: int, world: int, init_file: str, out_dir: str, steps: int):
    """CurrentScaling + FP8 all-gather: precompute_fp8_scales gives all weight scales in one all-reduce."""
    os.environ["FP8PASS_TEST_RECIPE"] = "current"
    init(rank, world, init_file)
    model = shard_model(make_model(), world, True)
    opt = make_optimizer(model.parameters(), "adamw")
    real = dist.all_reduce
    reduces = []

    def counting(t, *a, **k):
        reduces.append(t.numel())
        return real(t, *a, **k)

    dist.all_reduce = counting
    out = {"loss": [], "reduces": [], "n_weights": fp8pass.distributed.precompute_fp8_scales(model)}
    for step in range(steps):
        reduces.clear()
        x, y = local_batch(step, rank, world)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        fp8pass.distributed.precompute_fp8_scales(model)
        out["loss"].append(mean_over_ranks(loss))
        out["reduces"].append(list(reduces))
    dist.all_reduce = real
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def single_process_blocks(steps: int, optim: str):
    """Reference for FSDP2: one process, per-block compile (same graphs as the sharded run)."""
    torch._dynamo.reset()
    model = make_model()
    for block in model.layers:
        block.compile(backend=fp8pass.backend(fp8_config()))
    opt = make_optimizer(model.parameters(), optim)
    out = {"loss": [], "scales": []}
    run_steps(model, model, opt, None, steps, 0, 1, out)
    return out
