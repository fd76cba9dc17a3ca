"""Per-channel statistics: w1/w2 alignment from weights, and streaming activation moments."""

from __future__ import annotations

import torch

__all__ = ["weight_alignment", "ActivationAccumulator"]


def weight_alignment(w1: torch.Tensor, w2: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per channel i (row i of both): Pearson correlation and cosine of (w1ᵢ, w2ᵢ), and their norms.

    Theorem 1 of the paper predicts ``|corr| -> 1`` (w1ᵢ = ±w2ᵢ) for channels whose gate saturates
    under weight decay. A zero row has no direction: its cosine/correlation is reported as 0.
    """
    if w1.shape != w2.shape or w1.dim() != 2:
        raise ValueError(f"w1 and w2 must be matrices of one shape, got {tuple(w1.shape)} and {tuple(w2.shape)}")
    a, b = w1.detach().double(), w2.detach().double()
    n1, n2 = a.norm(dim=1), b.norm(dim=1)
    cos = (a * b).sum(1) / (n1 * n2).clamp_min(1e-300)
    ac, bc = a - a.mean(1, keepdim=True), b - b.mean(1, keepdim=True)
    corr = (ac * bc).sum(1) / (ac.norm(dim=1) * bc.norm(dim=1)).clamp_min(1e-300)
    return {"corr": corr.float(), "cos": cos.float(), "norm_w1": n1.float(), "norm_w2": n2.float()}


class ActivationAccumulator:
    """Streams batches of one layer's (z, h) and keeps what the diagnostics need.

    Per channel: max |h|, count of |z| > threshold (σ' saturation). Per layer: the first four raw
    moments of all h elements (fp64) for kurtosis, and the token count.
    """

    def __init__(self, channels: int, threshold: float):
        self.threshold = threshold
        self.max_abs_h = torch.zeros(channels)
        self.saturated = torch.zeros(channels, dtype=torch.float64)
        self.tokens = 0
        self.moments = torch.zeros(4, dtype=torch.float64)   # sum h, h^2, h^3, h^4
        self.count = 0

    def update(self, z: torch.Tensor, h: torch.Tensor) -> None:
        self.max_abs_h = torch.maximum(self.max_abs_h, h.abs().amax(0))
        self.saturated += (z.abs() > self.threshold).double().sum(0)
        self.tokens += z.shape[0]
        hd = h.double().flatten()
        p = hd.clone()
        for k in range(4):
            self.moments[k] += p.sum()
            p = p * hd
        self.count += hd.numel()

    @property
    def saturation(self) -> torch.Tensor:
        return (self.saturated / max(self.tokens, 1)).float()

    @property
    def kurtosis(self) -> float:
        """Pearson kurtosis E[(h-μ)⁴]/σ⁴ (3 for a Gaussian; heavy outliers push it far higher)."""
        if self.count == 0:
            return float("nan")
        m1, m2, m3, m4 = (self.moments / self.count).tolist()
        var = m2 - m1 * m1
        if var <= 0:
            return float("nan")
        c4 = m4 - 4 * m1 * m3 + 6 * m1 * m1 * m2 - 3 * m1 ** 4
        return c4 / (var * var)
