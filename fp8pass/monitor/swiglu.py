"""Find SwiGLU / GLU MLPs in a model and read their weights in the paper's notation.

Channel i of a GLU MLP computes ``hᵢ = (w1ᵢᵀx) · act(w2ᵢᵀx)``; the output is ``W3 h``. Naming
conventions recognised (checked in this order):

| layout                      | w1 (linear branch) | w2 (gated, inside act) | W3          |
|-----------------------------|--------------------|------------------------|-------------|
| HF Llama / fp8pass TinyLlama| ``up_proj``        | ``gate_proj``          | ``down_proj``|
| HF Phi-3 (fused)            | 2nd half of ``gate_up_proj`` | 1st half     | ``down_proj``|
| Meta Llama reference        | ``w3``             | ``w1``                 | ``w2``      |
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SwiGLUSite", "find_swiglus"]


@dataclass
class SwiGLUSite:
    """One GLU MLP: its module FQN, the module, and its naming layout."""

    name: str
    module: nn.Module
    layout: str          # "hf" | "fused" | "meta"

    def weights(self):
        """``(w1, w2, w3)``: linear-branch rows (ffn, d), gate rows (ffn, d), down matrix (d, ffn)."""
        m = self.module
        if self.layout == "hf":
            return m.up_proj.weight, m.gate_proj.weight, m.down_proj.weight
        if self.layout == "fused":
            gate, up = m.gate_up_proj.weight.chunk(2, dim=0)
            return up, gate, m.down_proj.weight
        return m.w3.weight, m.w1.weight, m.w2.weight

    def activation(self):
        """The gate's activation: the module's ``act_fn`` when it has one (HF), else SiLU."""
        act = getattr(self.module, "act_fn", None)
        return act if callable(act) else F.silu

    def channel_outputs(self, x: torch.Tensor):
        """``(z, h)`` in fp32 for inputs ``x`` (..., d): gate pre-activations w2ᵀx and h = (w1ᵀx)·act(z)."""
        w1, w2, _ = self.weights()
        xf = x.detach().reshape(-1, x.shape[-1]).float()
        z = xf @ w2.detach().float().t()
        return z, (xf @ w1.detach().float().t()) * self.activation()(z)


def _layout(m: nn.Module) -> str | None:
    def lin(name):
        return isinstance(getattr(m, name, None), nn.Linear)
    if lin("down_proj") and lin("gate_proj") and lin("up_proj"):
        return "hf"
    if lin("down_proj") and lin("gate_up_proj"):
        return "fused"
    if lin("w1") and lin("w2") and lin("w3"):
        return "meta"
    return None


def find_swiglus(model: nn.Module) -> list[SwiGLUSite]:
    """All GLU MLPs of ``model`` in module order (a compiled model's ``_orig_mod`` is looked through)."""
    model = getattr(model, "_orig_mod", model)
    sites = []
    for name, m in model.named_modules():
        layout = _layout(m)
        if layout is not None:
            sites.append(SwiGLUSite(name, m, layout))
    return sites
