"""A design experiment, not fp8pass's code path: the tiny train step with FP8 linears written as an
``autograd.Function`` of plain aten math, so that Inductor compiles the casts inside the model's own graphs
(no custom ops, no compiled loop called through its own Dynamo frame), against bf16-Inductor and fp8pass's
recipes, the variants' steps interleaved in one process.

    python -m tools.prototype_in_graph_casts

The same rounding as fp8pass's CPU kernels (RNE values of E4M3 codes; E5M2 dy by the stochastic integer
rounding), per-tensor current scaling, x saved as E4M3 codes, weights recast in backward; plain SwiGLU (no
smoothing) and torch AdamW. Result and reading: docs/results/step.md (the table of this run is in that page's git history, run 6).
"""
import statistics
import time

import torch
import torch.nn as nn

from benchmarks import train_step as ts
from fp8pass import E4M3, E5M2
from fp8pass.kernels.cpu import _stochastic_cast_math, rne_constants, rne_values_math
from fp8pass.train.model import ModelConfig, TinyLlama

torch.set_num_threads(1)

E4 = (E4M3.max, *rne_constants(E4M3))

def q_values(x, fmt_args):
    xf = x.float()
    amax = xf.abs().amax()
    s = torch.where(amax > 0, fmt_args[0] / amax, torch.ones_like(amax))
    return rne_values_math(xf, s, *fmt_args, torch.bfloat16), s

class FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        x2 = x.reshape(-1, x.shape[-1])
        xv, xs = q_values(x2, E4)
        wv, wscale = q_values(w, E4)
        y = (xv @ wv.t()).float() / (xs * wscale)
        ctx.save_for_backward(xv.to(torch.float8_e4m3fn), xs, w, wscale)
        ctx.shape = x.shape
        return y.to(torch.bfloat16).view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, dy):
        xc, xs, w, wscale = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        amax = dy2.float().abs().amax()
        gs = torch.where(amax > 0, E5M2.max / amax, torch.ones_like(amax))
        seed = torch.randint(0, 2 ** 31 - 1, (), dtype=torch.int32)
        codes, _ = _stochastic_cast_math(dy2.reshape(-1), gs, seed, E5M2.max, E5M2.mbits, E5M2.emin, torch.float8_e5m2)
        gv = codes.view(dy2.shape).to(torch.float32).to(torch.bfloat16)
        wv = rne_values_math(w.float(), wscale, *E4, torch.bfloat16)
        dx = (gv @ wv).float() / (gs * wscale)
        dw = (gv.t() @ xc.to(torch.float32).to(torch.bfloat16)).float() / (gs * xs)
        return dx.to(dy.dtype).view(ctx.shape), dw.to(w.dtype)

class ProtoLinear(nn.Linear):
    def forward(self, x):
        return FP8Linear.apply(x, self.weight)

def build_proto():
    s = ts.SHAPES["tiny"]
    cfg = ModelConfig(vocab_size=ts.VOCAB, d_model=s["d_model"], n_layers=s["n_layers"], n_heads=s["n_heads"],
                      ffn=s["ffn"], max_seq_len=s["seq"])
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (s["batch"], s["seq"] + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    torch.manual_seed(0)
    model = TinyLlama(cfg)
    for blk in model.layers:
        for mod in (blk.self_attn, blk.mlp):
            for name, child in list(mod.named_children()):
                if isinstance(child, nn.Linear):
                    child.__class__ = ProtoLinear
    fwd = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = fwd(x, y)
        loss.backward(); opt.step()
        return loss
    return step

def main():
    steps = {"bf16 inductor": ts.build("tiny", "bf16 inductor", "cpu", torch.bfloat16)[-1],
             "fp8pass fp8-smooth": ts.build("tiny", "fp8-smooth", "cpu", torch.bfloat16)[-1],
             "fp8pass fp8-smooth-fp8adam": ts.build("tiny", "fp8-smooth-fp8adam", "cpu", torch.bfloat16)[-1],
             "proto in-graph fp8 linears": build_proto()}
    steps = {k: v for k, v in steps.items() if v is not None}
    for s in steps.values():
        for _ in range(3): s()
    res = {k: [] for k in steps}
    for r in range(5):
        for k, s in steps.items():
            t = time.perf_counter(); s(); res[k].append(time.perf_counter() - t)
    base = statistics.median(res["bf16 inductor"])
    for k, v in res.items():
        print(f"{k:30s} {statistics.median(v)*1e3:7.1f} ms  ratio {statistics.median(v)/base:.2f}  rounds {[round(x*1e3) for x in v]}")


if __name__ == "__main__":
    main()
