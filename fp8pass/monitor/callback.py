"""Trainer callback: run :func:`diagnose` on a fixed probe batch every ``every`` steps."""

from __future__ import annotations

from .report import Diagnostics, diagnose

__all__ = ["MonitorCallback"]


class MonitorCallback:
    """Logs per-layer SwiGLU diagnostics as ``{"kind": "monitor", ...}`` metric records.

    Args:
        probe: the model input diagnostics are measured on (kept fixed so steps compare).
        every: run every this many optimizer steps (and after the last step).
        threshold: saturation threshold for |w2ᵀx|.
        top_k: outlier channels to log per call.
    """

    def __init__(self, probe, every: int = 50, threshold: float = 1.0, top_k: int = 3):
        if every < 1:
            raise ValueError(f"MonitorCallback every must be >= 1, got {every}")
        self.probe, self.every, self.threshold, self.top_k = probe, every, threshold, top_k
        self.last: Diagnostics | None = None

    def __call__(self, step: int, model, log, final: bool = False) -> None:
        if step % self.every and not final:
            return
        self.last = diagnose(model, self.probe, threshold=self.threshold)
        for rec in self.last.records():
            log({"kind": "monitor", "step": step, **rec})
        for rec in self.last.top_outliers(self.top_k):
            log({"kind": "outlier", "step": step, **rec})
