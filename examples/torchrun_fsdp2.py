"""Multi-GPU (or multi-process CPU) FP8 training with FSDP2: run with torchrun.

    torchrun --nproc_per_node 2 examples/torchrun_fsdp2.py            # GPUs (nccl) or CPU (gloo)
    torchrun --nproc_per_node 2 examples/torchrun_fsdp2.py --ddp      # DDP instead of FSDP2

Each rank trains a TinyLlama on its slice of random tokens, saves a distributed checkpoint at the
end, and rank 0 prints the losses.
"""

import argparse
import os

import torch
import torch.distributed as dist

import fp8pass
import fp8pass.distributed as fdist
from fp8pass.train.model import ModelConfig, TinyLlama


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ddp", action="store_true")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--ckpt", default="/tmp/fp8pass_ckpt")
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)

    cfg = fp8pass.Config(compiler="inductor" if cuda else "aot_eager")
    torch.manual_seed(0)
    model = TinyLlama(ModelConfig(d_model=128, n_layers=2, n_heads=4, ffn=384, max_seq_len=128)).to(device)
    tokens = torch.randint(0, 256, (8, 129), generator=torch.Generator().manual_seed(rank)).to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]

    if a.ddp:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
        step_model = torch.compile(model, backend=fp8pass.backend(cfg))
    else:
        from torch.distributed.fsdp import fully_shard

        # FP8 all-gather for the weights the backend casts per tensor (decided by explain)
        report = fp8pass.explain(model, x, y, config=cfg)
        fdist.enable_fp8_all_gather(model, cfg, fdist.fp8_all_gather_weights(report, cfg))
        for block in model.layers:
            block.compile(backend=fp8pass.backend(cfg))
            fully_shard(block)
        fully_shard(model)
        fdist.link_fp8_all_gather(model)
        step_model = model

    # FP8 moments for matrices; vectors keep fp32 moments (their FSDP2 shards are below one block)
    params = list(model.parameters())
    opt = fp8pass.optim.AdamW([{"params": [p for p in params if p.dim() >= 2]},
                               {"params": [p for p in params if p.dim() < 2], "m_format": "fp32",
                                "v_format": "fp32"}], lr=1e-3)
    sync = fdist.AmaxSync(model)  # one all_reduce(MAX) of every amax per step
    for step in range(a.steps):
        loss = step_model(x, y)
        loss.backward()
        sync.sync()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            print(f"step {step + 1}: loss {loss.item():.4f}")
    fdist.save_checkpoint(a.ckpt, model, opt)  # loads into any world size: fdist.load_checkpoint
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
