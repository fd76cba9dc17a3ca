"""Stability diagnostics for GLU MLPs: w1/w2 alignment, σ' saturation, outlier channels, kurtosis;
and the FP8 casts' own telemetry (:func:`scaling_telemetry`: skipped non-finite amaxes, casts past
their delayed scale).

Standalone::

    from fp8pass.monitor import diagnose, swiglu_alignment
    print(diagnose(model, batch))          # any model with SwiGLU MLPs, HF Llama family included
    print(swiglu_alignment(model))         # weights only, no forward pass

In the trainer: :class:`MonitorCallback` (``python -m fp8pass train --monitor-every N``).
Which precision and kernel each GEMM and collective runs: :func:`precision_audit`, :func:`collective_audit`.
Online FP8-vs-high-precision drift check: :class:`DriftMonitor` (``--drift-check N``; docs/precision.md).
Format choice per tensor role (E4M3, E5M2 or high precision): :func:`advise` / :func:`format_advice`.
Attention that amplifies the q/k projections' FP8 error (q/k norm and a large logit scale):
:func:`sharp_attention` measures it and returns the rules that keep those projections high.
"""

from .advisor import FormatAdvice, advise, format_advice, measure_formats
from .attention import AttentionAdvice, AttentionSite, sharp_attention
from .callback import MonitorCallback
from .drift import DriftMonitor, DriftReport
from .outliers import OutlierMonitor, outlier_stats
from .precision import audit_summary, audit_version, collective_audit, precision_audit
from .report import Diagnostics, LayerDiagnostics, diagnose, swiglu_alignment
from .stats import ActivationAccumulator, weight_alignment
from .swiglu import SwiGLUSite, find_swiglus
from .telemetry import ScalingTelemetry, check_scaling, scaling_telemetry

__all__ = ["MonitorCallback", "Diagnostics", "LayerDiagnostics", "diagnose", "swiglu_alignment",
           "ActivationAccumulator", "weight_alignment", "SwiGLUSite", "find_swiglus",
           "OutlierMonitor", "outlier_stats", "ScalingTelemetry", "scaling_telemetry", "check_scaling",
           "FormatAdvice", "advise", "format_advice", "measure_formats", "precision_audit", "collective_audit",
           "audit_version", "audit_summary", "AttentionAdvice", "AttentionSite", "sharp_attention", "DriftMonitor",
           "DriftReport"]
