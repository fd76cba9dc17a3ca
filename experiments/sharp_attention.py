"""Sharp attention at initialisation: the all-parameter gradient cosine of FP8 to eager fp32, with and
without the sharp-attention advisor's rules (docs/results/sharp_attention.md).

Models: fp8pass/testing/models.py ``tiny_sharp_llama`` (a tiny Muse Glimmer: q/k RMS-normalised, logits
``logit_scale * cos``, post-norm blocks, Glimmer's initialisation) and the same model with plain Llama
attention (``--logit-scale none``). Per seed, one next-token cross-entropy step on random tokens from
the freshly initialised model, gradients of every parameter concatenated and compared with eager fp32:

- ``bf16``: eager under ``torch.autocast("cpu", torch.bfloat16)``;
- ``fp8``: ``torch.compile(model, backend=fp8pass.backend(Config(compiler="aot_eager")))``, defaults;
- ``fp8 + advice``: the same with ``sharp_attention(model, probe).apply(cfg)`` (its q/k rules first);
- ``fp8, q/k high``: every q/k projection kept high whatever the advisor says (what its rule buys);
- ``fp8, attention high``: every attention projection kept high (``Rule("*.attention.*", "high")``).

``--model glimmer``: torchtitan 0.3's own Muse Glimmer (``debugmodel`` cut to 2 blocks, SDPA, vocab
2048 of which the tokens use 128), in the client environment (docs/results/client_zoo.md).

Run: ``python -m experiments.sharp_attention --seeds 0,1,2,3 [--logit-scale 43.78|none|4|8|16]``,
``/work/venv-clients/bin/python -m experiments.sharp_attention --model glimmer --seeds 0,1 [--layers 8]``
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]

import fp8pass  # noqa: E402
from fp8pass import Config, Rule  # noqa: E402
from fp8pass.monitor import sharp_attention  # noqa: E402
from fp8pass.testing.models import tiny_sharp_llama  # noqa: E402


def loss_fn(model, ids):
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def gradient(model, ids, how: str, cfg: Config | None = None) -> torch.Tensor:
    """All parameters' gradients of one step, concatenated (fp64)."""
    model.zero_grad()
    torch._dynamo.reset()
    if how == "eager":
        loss = loss_fn(model, ids)
    elif how == "bf16":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(model, ids)
    else:
        loss = loss_fn(torch.compile(model, backend=fp8pass.backend(cfg)), ids)
    loss.backward()
    g = torch.cat([p.grad.detach().double().flatten() for p in model.parameters()])
    model.zero_grad()
    torch._dynamo.reset()
    return g


def glimmer(seed: int, layers: int = 2) -> torch.nn.Module:
    """torchtitan 0.3's Muse Glimmer debug model as the client zoo builds it (2 blocks, SDPA; the client
    environment, docs/results/client_zoo.md), initialised by torchtitan; its SPMD type assertions off
    (they need a device mesh: one process has none)."""
    from torchtitan.distributed.utils import set_spmd_backend

    from fp8pass.testing import client_zoo as _client_zoo

    set_spmd_backend("none")
    cfg = _client_zoo._titan_config("muse_glimmer", "debugmodel", layers=layers)
    torch.manual_seed(seed)
    model = cfg.build()
    model.init_states()
    return model.float().train()


def measure(seed: int, logit_scale: float | None, batch: int = 4, seq: int = 64, model: str = "tiny",
            layers: int = 2) -> dict:
    if model == "glimmer":
        model, vocab = glimmer(seed, layers), 128
    else:
        model, vocab = tiny_sharp_llama(logit_scale=logit_scale, seed=seed), 256
    torch.manual_seed(1000 + seed)
    ids = torch.randint(0, vocab, (batch, seq + 1))
    advice = sharp_attention(model, ids[:, :-1])
    base = Config(compiler="aot_eager")
    runs = {"bf16": ("bf16", None), "fp8": ("fp8", base), "fp8 + advice": ("fp8", advice.apply(base)),
            "fp8, q/k high": ("fp8", Config(compiler="aot_eager", rules=[Rule("*.wq", "high"), Rule("*.wk", "high"),
                                                                    Rule("*.wqkv", "high")])),
            "fp8, attention high": ("fp8", Config(compiler="aot_eager", rules=[Rule("*.attention.*", "high")]))}
    g0 = gradient(model, ids, "eager")
    cos = {name: F.cosine_similarity(g0, gradient(model, ids, how, cfg), dim=0).item()
           for name, (how, cfg) in runs.items()}
    return {"seed": seed, "advice": advice, "cos": cos}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2,3")
    ap.add_argument("--logit-scale", default="43.78", help="a number, or 'none' for plain Llama attention")
    ap.add_argument("--model", default="tiny", choices=("tiny", "glimmer"),
                    help="tiny: fp8pass/testing/models.py tiny_sharp_llama; glimmer: torchtitan's Muse Glimmer debug model")
    ap.add_argument("--layers", type=int, default=2, help="glimmer: blocks kept of the debug model's 8")
    args = ap.parse_args(argv)
    scale = None if args.logit_scale == "none" else float(args.logit_scale)
    if args.model == "glimmer":
        args.logit_scale = f"glimmer, {args.layers} blocks"
    rows = []
    for seed in (int(s) for s in args.seeds.split(",")):
        r = measure(seed, scale, model=args.model, layers=args.layers)
        rows.append(r)
        print(f"seed {seed}: " + ", ".join(f"{k} {v:.4f}" for k, v in r["cos"].items()), flush=True)
        print(r["advice"], flush=True)
    names = list(rows[0]["cos"])
    print(f"\n| logit scale | seed | logit error | {' | '.join(names)} | advisor flags |")
    print("|---|---|---|" + "---|" * len(names) + "---|")
    for r in rows:
        flagged = ", ".join(p for s in r["advice"].sharp for p in s.projections) or "nothing"
        err = ", ".join(f"{s.logit_error:.3f}" for s in r["advice"].sites)
        print(f"| {args.logit_scale} | {r['seed']} | {err} | " + " | ".join(f"{r['cos'][n]:.4f}" for n in names)
              + f" | {flagged} |")
    print(f"| {args.logit_scale} | mean (min-max) | | " + " | ".join(
        f"{statistics.mean(r['cos'][n] for r in rows):.3f} ({min(r['cos'][n] for r in rows):.3f}-"
        f"{max(r['cos'][n] for r in rows):.3f})" for n in names) + " | |")


if __name__ == "__main__":
    main()
