"""Tiny modules, one per GLU form real code uses, and a torchtitan-style Llama (shared by tests)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

D, H = 32, 64


class SiluMul(nn.Module):  # HF Llama / Qwen2 / Mistral: down(act(gate(x)) * up(x))
    variant = "swiglu"

    def __init__(self, d=D, h=H, bias=False, act=None):
        super().__init__()
        self.gate_proj = nn.Linear(d, h, bias=bias)
        self.up_proj = nn.Linear(d, h, bias=bias)
        self.down_proj = nn.Linear(h, d, bias=bias)
        self.act = act or nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class MulSilu(SiluMul):  # u * F.silu(g)
    def forward(self, x):
        return self.down_proj(self.up_proj(x) * F.silu(self.gate_proj(x)))


class SigmoidFn(SiluMul):  # g * torch.sigmoid(g) * u
    def forward(self, x):
        g = self.gate_proj(x)
        return self.down_proj(g * torch.sigmoid(g) * self.up_proj(x))


class SigmoidMethod(SiluMul):  # g.sigmoid() * g * u, operands swapped
    def forward(self, x):
        g = self.gate_proj(x)
        return self.down_proj(self.up_proj(x) * (g.sigmoid() * g))


class MatmulWT(nn.Module):  # raw parameters, x @ W.T (+ b)
    variant = "swiglu"

    def __init__(self, d=D, h=H, bias=False):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(h, d) / d**0.5)
        self.w3 = nn.Parameter(torch.randn(h, d) / d**0.5)
        self.w2 = nn.Parameter(torch.randn(d, h) / h**0.5)
        self.b1 = nn.Parameter(torch.randn(h) * 0.1) if bias else None
        self.b3 = nn.Parameter(torch.randn(h) * 0.1) if bias else None

    def forward(self, x):
        g = x @ self.w1.T
        u = x @ self.w3.t()
        if self.b1 is not None:
            g = g + self.b1
            u = u + self.b3
        return torch.matmul(F.silu(g) * u, self.w2.T)


class Fused(nn.Module):  # one gate_up projection, then chunk / split / slicing / unbind
    variant = "swiglu (fused gate_up)"

    def __init__(self, how="chunk", d=D, h=H, bias=False):
        super().__init__()
        self.how = how
        self.h = h
        self.gate_up_proj = nn.Linear(d, 2 * h, bias=bias)
        self.down_proj = nn.Linear(h, d, bias=bias)

    def forward(self, x):
        y = self.gate_up_proj(x)
        h = self.h
        if self.how == "chunk":
            g, u = y.chunk(2, dim=-1)
        elif self.how == "split":
            g, u = y.split(h, dim=-1)
        elif self.how == "split_list":
            g, u = torch.split(y, [h, h], dim=-1)
        elif self.how == "slice":
            g, u = y[..., :h], y[..., h:]
        elif self.how == "unbind":
            g, u = y.view(*y.shape[:-1], 2, h).unbind(-2)
        elif self.how == "unbind_interleaved":
            g, u = y.view(*y.shape[:-1], h, 2).unbind(-1)
        else:
            raise ValueError(self.how)
        return self.down_proj(F.silu(g) * u)


class GeGLU(SiluMul):  # Gemma: gelu(tanh) gate
    def __init__(self, approximate="tanh", **kw):
        super().__init__(act=nn.GELU(approximate=approximate), **kw)
        self.variant = "geglu-tanh" if approximate == "tanh" else "geglu"


class ReGLU(SiluMul):  # relu gate
    variant = "reglu"

    def __init__(self, **kw):
        super().__init__(act=nn.ReLU(), **kw)


class GeluMLP(nn.Module):  # no gate: FP8 linears only
    variant = None

    def __init__(self, d=D, h=H):
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


# ---- a torchtitan-style Llama (its model code, written from its structure) -----------------------

class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope(x, base=10000.0):
    b, s, nh, hd = x.shape
    inv = 1.0 / (base ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd))
    ang = torch.outer(torch.arange(s, device=x.device, dtype=torch.float32), inv)
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
    out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    return out.type_as(x)


class Attention(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = rope(self.wq(x).view(b, s, self.n_heads, self.head_dim))
        k = rope(self.wk(x).view(b, s, self.n_heads, self.head_dim))
        v = self.wv(x).view(b, s, self.n_heads, self.head_dim)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class SharpAttention(Attention):
    """Muse Glimmer's attention (torchtitan): q and k RMS-normalised per head without a gain, q scaled so
    that the logits are ``logit_scale * cos(q, k)`` (Glimmer: 43.78); sharp at initialisation already."""

    def __init__(self, dim, n_heads, logit_scale=43.78):
        super().__init__(dim, n_heads)
        self.q_scale = logit_scale / self.head_dim**0.5   # SDPA's 1/sqrt(hd) times |q||k| = hd gives logit_scale

    def forward(self, x):
        b, s, _ = x.shape
        hd = (self.head_dim,)
        q = rope(F.rms_norm(self.wq(x).view(b, s, self.n_heads, self.head_dim), hd) * self.q_scale)
        k = rope(F.rms_norm(self.wk(x).view(b, s, self.n_heads, self.head_dim), hd))
        v = self.wv(x).view(b, s, self.n_heads, self.head_dim)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):  # torchtitan: w2(F.silu(w1(x)) * w3(x))
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim, n_heads, hidden, attention=Attention):
        super().__init__()
        self.attention = attention(dim, n_heads)
        self.feed_forward = FeedForward(dim, hidden)
        self.attention_norm = RMSNorm(dim)
        self.ffn_norm = RMSNorm(dim)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class PostNormBlock(TransformerBlock):
    """Muse Glimmer's block: each branch's output RMS-normalised before the residual add."""

    def __init__(self, dim, n_heads, hidden, attention=Attention):
        super().__init__(dim, n_heads, hidden, attention)
        self.post_attention_norm = RMSNorm(dim)
        self.post_ffn_norm = RMSNorm(dim)

    def forward(self, x):
        h = x + self.post_attention_norm(self.attention(self.attention_norm(x)))
        return h + self.post_ffn_norm(self.feed_forward(self.ffn_norm(h)))


class TitanLlama(nn.Module):
    def __init__(self, vocab=128, dim=32, n_layers=2, n_heads=4, hidden=64, attention=Attention,
                 block=TransformerBlock):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): block(dim, n_heads, hidden, attention) for i in range(n_layers)})
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


def tiny_titan_llama(n_layers=2):
    torch.manual_seed(0)
    return TitanLlama(n_layers=n_layers)


def tiny_sharp_llama(n_layers=2, dim=128, n_heads=2, logit_scale=43.78, vocab=256, seed=0):
    """A tiny Muse Glimmer: :class:`SharpAttention` (head dim 64 as Glimmer's debug model) in
    :class:`PostNormBlock` blocks, linears initialised N(0, 0.02) and the LM head N(0, 1/dim) as
    Glimmer's; ``logit_scale=None``: the same model with plain Llama attention. The pair the
    sharp-attention advisor is checked on (docs/results/sharp_attention.md)."""
    torch.manual_seed(seed)
    attention = Attention if logit_scale is None else (lambda d, h: SharpAttention(d, h, logit_scale))
    model = TitanLlama(vocab=vocab, dim=dim, n_layers=n_layers, n_heads=n_heads, hidden=2 * dim,
                       attention=attention, block=PostNormBlock)
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=dim**-0.5 if name == "output" else 0.02)
    return model


def capture_with_inputs(model, *inputs, **compile_kw):
    """Dynamo's torch-level graphs for ``model(*inputs)`` with their example inputs, as
    ``[(GraphModule, [inputs])]`` (a capturing backend; nothing compiled)."""
    graphs = []

    def cap(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=cap, **compile_kw)(*inputs)
    return graphs


def capture(model, *inputs, **compile_kw):
    """Dynamo's torch-level graphs for ``model(*inputs)`` (a capturing backend; nothing compiled)."""
    return [gm for gm, _ in capture_with_inputs(model, *inputs, **compile_kw)]


def tiny_titan_llama_with_inputs():
    """Factory for ``python -m fp8pass inspect fp8pass.testing.models:tiny_titan_llama_with_inputs``."""
    return tiny_titan_llama(), (torch.randint(0, 128, (2, 8)),)


def dynamo_graph_under_autocast(model, *args):
    """(GraphModule, example inputs) of Dynamo's one full graph of ``model(*args)`` traced under
    ``autocast(cpu, bf16)``: what the backend receives, for tests that rewrite it themselves."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ((gm, inputs),) = capture_with_inputs(model, *args, fullgraph=True)
    return gm, inputs


class FillRecorder(TorchDispatchMode):
    """Records the shape of every tensor made by a zero-fill (``zeros``, ``fill_``, ``zero_``,
    ``new_zeros``, ``zeros_like``) while active: what autograd's materialized gradients would show."""

    FILLS = (torch.ops.aten.zeros.default, torch.ops.aten.fill_.Scalar, torch.ops.aten.zero_.default,
             torch.ops.aten.new_zeros.default, torch.ops.aten.zeros_like.default)

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.FILLS:
            self.shapes.append(tuple(out.shape))
        return out
