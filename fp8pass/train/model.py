"""A small Llama-style decoder: RMSNorm, RoPE, causal SDPA attention, SwiGLU MLP.

Module names follow Hugging Face's Llama (``embed_tokens``, ``q_proj`` ... ``o_proj``, ``gate_proj``,
``up_proj``, ``down_proj``, ``lm_head``) so that fp8pass's policy patterns (``lm_head``, ``*embed*``)
and the diagnostics in :mod:`fp8pass.monitor` treat it exactly like an HF model. ``fused_gate_up``
switches the MLP to one ``gate_up_proj`` followed by a chunk (Phi-3 style), the other SwiGLU variant
the backend matches.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ModelConfig", "TinyLlama", "SwiGLUMLP", "RMSNorm"]


@dataclass
class ModelConfig:
    """Shape of :class:`TinyLlama`.

    Args:
        vocab_size: tokens (256 for the byte-level data).
        d_model: hidden size.
        n_layers: decoder blocks.
        n_heads: attention heads (``d_model`` must divide evenly).
        ffn: SwiGLU inner size (channels of h).
        max_seq_len: longest sequence RoPE tables are built for.
        fused_gate_up: one ``gate_up_proj`` linear + chunk instead of ``gate_proj`` and ``up_proj``.
        rope_theta: RoPE base.
        norm_eps: RMSNorm epsilon.
        tie_embeddings: share the embedding matrix with the LM head.
    """

    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    ffn: int = 352
    max_seq_len: int = 256
    fused_gate_up: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "ffn", "max_seq_len"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {getattr(self, name)}")
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ValueError(
                f"d_model={self.d_model} must split into n_heads={self.n_heads} heads of even size (RoPE)")

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # Normalise in fp32 whatever the autocast dtype, as Llama does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight).to(x.dtype)


def rope_tables(head_dim: int, max_len: int, theta: float):
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    ang = torch.outer(torch.arange(max_len, dtype=torch.float32), inv)
    return torch.cos(ang), torch.sin(ang)


def apply_rope(x, cos, sin):
    """Rotate pairs (x[..., :h/2], x[..., h/2:]) by the position angle (HF's rotate_half layout)."""
    t = x.shape[-2]
    cos = torch.cat([cos[:t], cos[:t]], -1).to(x.dtype)
    sin = torch.cat([sin[:t], sin[:t]], -1).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.o_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x, cos, sin):
        b, t, d = x.shape
        def heads(y):
            return y.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        q = apply_rope(heads(self.q_proj(x)), cos, sin)
        k = apply_rope(heads(self.k_proj(x)), cos, sin)
        v = heads(self.v_proj(x))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, d))


class SwiGLUMLP(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``.

    In the paper's notation, channel i computes ``(w1ᵢᵀx) · Swish(w2ᵢᵀx)``: w1 = ``up_proj`` rows (the
    linear branch), w2 = ``gate_proj`` rows (inside Swish), W3 = ``down_proj``.
    """

    def __init__(self, d_model: int, ffn: int, fused_gate_up: bool = False):
        super().__init__()
        self.fused_gate_up = fused_gate_up
        if fused_gate_up:
            self.gate_up_proj = nn.Linear(d_model, 2 * ffn, bias=False)   # [gate; up], as Phi-3
        else:
            self.gate_proj = nn.Linear(d_model, ffn, bias=False)
            self.up_proj = nn.Linear(d_model, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, d_model, bias=False)

    def forward(self, x):
        if self.fused_gate_up:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLUMLP(cfg.d_model, cfg.ffn, cfg.fused_gate_up)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class TinyLlama(nn.Module):
    """Decoder-only LM; ``forward(tokens[, targets])`` returns logits, or the mean cross-entropy."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        cos, sin = rope_tables(cfg.d_model // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta)
        # Non-persistent: derived from the config, so checkpoints hold only learned weights.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self):
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() == 2:
                # GPT-2 style: residual-writing projections scaled down by depth.
                s = std / math.sqrt(2 * self.config.n_layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else std
                nn.init.normal_(p, 0.0, s)

    def forward(self, tokens, targets=None):
        if tokens.shape[-1] > self.config.max_seq_len:
            raise ValueError(f"sequence length {tokens.shape[-1]} exceeds max_seq_len={self.config.max_seq_len}")
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, self.rope_cos, self.rope_sin)
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
