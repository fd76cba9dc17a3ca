"""NVFP4 recipe experiment: tiny Llama, byte-level, BF16-style high precision vs NVFP4 vs NVFP4+HCP, ablations.

    python experiments/nvfp4.py --steps 150 --out docs/results/nvfp4

Every run: same seed, same data order, AdamW; the model compiled with ``fp8pass.backend`` and
``Config(recipe=NVFP4Scaling(...), compiler="eager")`` (the rewritten graph runs as is: compiling with
Inductor changes nothing numerically and costs minutes on a shared CPU). The baseline is the same
model in fp32 without the backend. Validation: mean loss over fixed held-out windows, computed with
the run's own numerics. Writes ``<out>.json`` and ``<out>.png``.

Corpus: the interpreter's standard library ``*.py`` files (every machine has them), bytes as tokens;
files whose sorted index is divisible by 20 are validation. This mirrors fp8pass.train.data (trainer
branch) without depending on it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's fp8pass

import torch
import torch.nn.functional as F
from torch import nn

import fp8pass
from fp8pass import Config, HotChannelPatching, NVFP4Scaling


def load_corpus(max_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
    files = sorted(f for f in root.rglob("*.py") if not skip.intersection(f.relative_to(root).parts[:-1]))
    train, val = bytearray(), bytearray()
    for i, f in enumerate(files):
        (val if i % 20 == 0 else train).extend(f.read_bytes())
        if len(train) >= max_bytes and len(val) >= max_bytes // 10:
            break
    return (torch.frombuffer(bytearray(train[:max_bytes]), dtype=torch.uint8).long(),
            torch.frombuffer(bytearray(val[:max_bytes // 10]), dtype=torch.uint8).long())


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def rope(x):
    b, s, h, d = x.shape
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = torch.outer(torch.arange(s, dtype=torch.float32), inv)
    cos, sin = ang.cos()[None, :, None], ang.sin()[None, :, None]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)


class Block(nn.Module):
    def __init__(self, d, heads, hidden):
        super().__init__()
        self.heads = heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.w1, self.w3 = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)
        self.n1, self.n2 = RMSNorm(d), RMSNorm(d)

    def forward(self, x):
        b, s, d = x.shape
        h = self.n1(x)
        q = rope(self.wq(h).view(b, s, self.heads, -1)).transpose(1, 2)
        k = rope(self.wk(h).view(b, s, self.heads, -1)).transpose(1, 2)
        v = self.wv(h).view(b, s, self.heads, -1).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self.wo(o)
        h = self.n2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class TinyLlama(nn.Module):
    def __init__(self, d=64, layers=4, heads=4, hidden=176, vocab=256):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d, heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        for blk in self.layers:
            h = blk(h)
        return self.lm_head(self.norm(h))


def batch(data, step, bsz, seq, seed):
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    idx = torch.randint(0, data.numel() - seq - 1, (bsz,), generator=g)
    w = torch.stack([data[i:i + seq + 1] for i in idx.tolist()])
    return w[:, :-1], w[:, 1:]


RUNS = {
    "high precision": None,
    "nvfp4": NVFP4Scaling(),
    "nvfp4+hcp": "hcp",
    "nvfp4 no RHT": NVFP4Scaling(rht=False),
    "nvfp4 no SR": NVFP4Scaling(grad_stochastic_rounding=False),
    "nvfp4 no 2D weight blocks": NVFP4Scaling(weight_2d=False),
    "nvfp4 no post-QK protection": NVFP4Scaling(protect_post_qk=False),
}


def run(name, recipe, args, train, val):
    torch.manual_seed(args.seed)
    model = TinyLlama(layers=args.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 10) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    torch._dynamo.reset()
    fwd = model if recipe is None else torch.compile(model, backend=fp8pass.backend(Config(recipe=recipe,
                                                                                          compiler="eager")))
    losses, t0 = [], time.perf_counter()
    for step in range(args.steps):
        x, y = batch(train, step, args.batch, args.seq, args.seed)
        loss = F.cross_entropy(fwd(x).reshape(-1, 256), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
    secs = time.perf_counter() - t0
    with torch.no_grad():
        vl = [F.cross_entropy(fwd(x).reshape(-1, 256), y.reshape(-1)).item()
              for x, y in (batch(val, 10_000 + i, args.batch, args.seq, 12345) for i in range(args.val_batches))]
    out = {"name": name, "recipe": repr(recipe), "train_loss": losses, "val_loss": sum(vl) / len(vl),
           "seconds": secs}
    print(f"{name:30s} val {out['val_loss']:.4f}  final train {sum(losses[-10:]) / 10:.4f}  {secs:.0f}s",
          flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--val-batches", type=int, default=8)
    ap.add_argument("--hcp-interval", type=int, default=10, help="HCP refresh interval (short runs)")
    ap.add_argument("--runs", default=",".join(RUNS))
    ap.add_argument("--out", default="docs/results/nvfp4")
    args = ap.parse_args()
    torch.set_num_threads(1)
    train, val = load_corpus(2_000_000)
    results = []
    for name in args.runs.split(","):
        recipe = RUNS[name]
        if recipe == "hcp":
            recipe = NVFP4Scaling(hcp=HotChannelPatching(update_interval=args.hcp_interval))
        results.append(run(name, recipe, args, train, val))
    base = next((r for r in results if r["name"] == "high precision"), None)
    if base:
        for r in results:
            r["val_gap_pct"] = 100 * (r["val_loss"] - base["val_loss"]) / base["val_loss"]
            print(f"{r['name']:30s} gap to high precision {r['val_gap_pct']:+.2f}%")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
        k = 10
        for r in results:
            tl = r["train_loss"]
            sm = [sum(tl[max(0, i - k + 1):i + 1]) / len(tl[max(0, i - k + 1):i + 1]) for i in range(len(tl))]
            ax[0].plot(sm, label=r["name"])
        ax[0].set_xlabel("step"); ax[0].set_ylabel(f"train loss ({k}-step mean)"); ax[0].legend(fontsize=7)
        names = [r["name"] for r in results]
        ax[1].barh(names, [r.get("val_gap_pct", 0.0) for r in results])
        ax[1].set_xlabel("validation loss gap to high precision (%)")
        fig.tight_layout()
        fig.savefig(args.out + ".png", dpi=110)
    except ImportError:
        print("matplotlib missing: no plot")


if __name__ == "__main__":
    main()
