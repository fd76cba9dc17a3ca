"""``diagnose(model, inputs)``: SwiGLU alignment, saturation, outlier channels and kurtosis per layer."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from .stats import ActivationAccumulator, weight_alignment
from .swiglu import SwiGLUSite, find_swiglus

__all__ = ["LayerDiagnostics", "Diagnostics", "diagnose", "swiglu_alignment"]


@dataclass
class LayerDiagnostics:
    """One SwiGLU layer. Per-channel tensors have one entry per channel of h (the FFN width)."""

    name: str
    corr: torch.Tensor
    cos: torch.Tensor
    norm_w1: torch.Tensor
    norm_w2: torch.Tensor
    saturation: torch.Tensor | None = None      # fraction of tokens with |w2ᵢᵀx| > threshold
    max_abs_h: torch.Tensor | None = None       # per-channel max |hᵢ| over the inputs
    kurtosis: float | None = None               # of all h elements of the layer
    input_kurtosis: float | None = None         # of the MLP input x

    def summary(self) -> dict:
        """Scalars for logging: worst/mean alignment, and activation figures when measured."""
        out = {"layer": self.name, "max_abs_corr": self.corr.abs().max().item(),
               "mean_abs_corr": self.corr.abs().mean().item(),
               "max_norm_product": (self.norm_w1 * self.norm_w2).max().item()}
        if self.max_abs_h is not None:
            med = self.max_abs_h.median().item()
            out.update(max_abs_h=self.max_abs_h.max().item(),
                       outlier_ratio=self.max_abs_h.max().item() / med if med > 0 else float("inf"),
                       mean_saturation=self.saturation.mean().item(), kurtosis=self.kurtosis,
                       input_kurtosis=self.input_kurtosis)
        return out

    def top_channels(self, k: int = 5) -> list[dict]:
        """The k channels with the largest max |h| (by weight-norm product when no inputs were seen)."""
        key = self.max_abs_h if self.max_abs_h is not None else self.norm_w1 * self.norm_w2
        idx = key.topk(min(k, key.numel())).indices.tolist()
        rows = []
        for i in idx:
            row = {"layer": self.name, "channel": i, "corr": self.corr[i].item(), "cos": self.cos[i].item(),
                   "norm_w1": self.norm_w1[i].item(), "norm_w2": self.norm_w2[i].item()}
            if self.max_abs_h is not None:
                row.update(max_abs_h=self.max_abs_h[i].item(), saturation=self.saturation[i].item())
            rows.append(row)
        return rows


@dataclass
class Diagnostics:
    layers: list[LayerDiagnostics] = field(default_factory=list)
    threshold: float = 1.0
    tokens: int = 0

    def top_outliers(self, k: int = 5) -> list[dict]:
        """The k channels with the largest max |h| across all layers."""
        rows = [r for layer in self.layers for r in layer.top_channels(k)]
        key = "max_abs_h" if rows and "max_abs_h" in rows[0] else None
        rows.sort(key=lambda r: -(r[key] if key else r["norm_w1"] * r["norm_w2"]))
        return rows[:k]

    def records(self) -> list[dict]:
        return [layer.summary() for layer in self.layers]

    def __str__(self) -> str:
        lines = [f"SwiGLU diagnostics: {len(self.layers)} layers, {self.tokens} tokens, "
                 f"saturation = |w2ᵀx| > {self.threshold:g}"]
        hdr = f"{'layer':28s} {'max|corr|':>9s} {'mean|corr|':>10s} {'max|h|':>9s} {'max/med':>8s} {'sat':>6s} {'kurt':>8s}"
        lines.append(hdr)
        for s in self.records():
            fmt = lambda key, spec: format(s[key], spec) if s.get(key) is not None else "-"
            lines.append(f"{s['layer'][-28:]:28s} {s['max_abs_corr']:9.3f} {s['mean_abs_corr']:10.3f} "
                         f"{fmt('max_abs_h', '9.3g'):>9s} {fmt('outlier_ratio', '8.1f'):>8s} "
                         f"{fmt('mean_saturation', '6.3f'):>6s} {fmt('kurtosis', '8.2f'):>8s}")
        top = self.top_outliers(5)
        if top:
            lines.append("top outlier channels:")
            for r in top:
                extra = f" max|h|={r['max_abs_h']:.3g} sat={r['saturation']:.2f}" if "max_abs_h" in r else ""
                lines.append(f"  {r['layer']}[{r['channel']}] corr={r['corr']:+.3f} cos={r['cos']:+.3f} "
                             f"|w1|={r['norm_w1']:.3g} |w2|={r['norm_w2']:.3g}{extra}")
        return "\n".join(lines)


def _layer(site: SwiGLUSite) -> LayerDiagnostics:
    w1, w2, _ = site.weights()
    return LayerDiagnostics(site.name, **weight_alignment(w1, w2))


def swiglu_alignment(model: nn.Module) -> Diagnostics:
    """Weight-only diagnostics (no forward pass): alignment and norms per channel of every SwiGLU."""
    sites = find_swiglus(model)
    if not sites:
        raise ValueError("no SwiGLU/GLU MLP found: expected modules with gate_proj/up_proj/down_proj, "
                         "gate_up_proj/down_proj, or w1/w2/w3 linears")
    return Diagnostics([_layer(s) for s in sites])


def _call(model, inp):
    if isinstance(inp, dict):
        return model(**inp)
    if isinstance(inp, (tuple, list)):
        return model(*inp)
    return model(inp)


@torch.no_grad()
def diagnose(model: nn.Module, inputs, *, threshold: float = 1.0) -> Diagnostics:
    """Weight alignment plus activation statistics measured on ``inputs``.

    Runs ``model`` eagerly (a compiled model's ``_orig_mod``) with a forward pre-hook on each SwiGLU
    that recomputes z = w2ᵀx and h in fp32 from the weights, so the figures do not depend on the
    training precision or on torch.compile.

    Args:
        model: any module with GLU MLPs (fp8pass TinyLlama, HF Llama/Mistral/Qwen/Phi-3, Meta Llama).
        inputs: one model input (tensor, tuple of positional args, or dict of keyword args), or a list
            of such inputs (batches) to accumulate over.
        threshold: |w2ᵢᵀx| above which a token counts as saturating channel i (the theorem's premise
            σ'(w2ᵀx) -> 0; σ'(1) = 0.20 vs σ'(0) = 0.25, σ'(4) = 0.018).
    """
    model = getattr(model, "_orig_mod", model)
    sites = find_swiglus(model)
    if not sites:
        raise ValueError("no SwiGLU/GLU MLP found: expected modules with gate_proj/up_proj/down_proj, "
                         "gate_up_proj/down_proj, or w1/w2/w3 linears")
    layers = [_layer(s) for s in sites]
    accs = [ActivationAccumulator(l.corr.numel(), threshold) for l in layers]
    in_moments = [torch.zeros(5, dtype=torch.float64) for _ in sites]   # count, sum x, x², x³, x⁴

    def hook_for(i, site):
        def hook(module, args, kwargs):
            x = args[0] if args else next(iter(kwargs.values()))
            z, h = site.channel_outputs(x)
            accs[i].update(z, h)
            xd = x.detach().double().flatten()
            in_moments[i] += torch.stack([torch.tensor(float(xd.numel()), dtype=torch.float64), xd.sum(),
                                          (xd ** 2).sum(), (xd ** 3).sum(), (xd ** 4).sum()])
        return hook

    handles = [s.module.register_forward_pre_hook(hook_for(i, s), with_kwargs=True) for i, s in enumerate(sites)]
    was_training = model.training
    model.eval()
    try:
        batches = inputs if isinstance(inputs, list) else [inputs]
        for inp in batches:
            _call(model, inp)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    for layer, acc, mom in zip(layers, accs, in_moments):
        layer.saturation, layer.max_abs_h, layer.kurtosis = acc.saturation, acc.max_abs_h, acc.kurtosis
        n = mom[0].item()
        if n:
            m1, m2, m3, m4 = (mom[1:] / n).tolist()
            var = m2 - m1 * m1
            layer.input_kurtosis = (m4 - 4 * m1 * m3 + 6 * m1 * m1 * m2 - 3 * m1 ** 4) / var ** 2 if var > 0 else math.nan
    return Diagnostics(layers, threshold, accs[0].tokens if accs else 0)
