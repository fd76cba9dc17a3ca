"""Format advisor: each FP8 tensor role's measured range against E4M3 and E5M2, and a format per role.

For every tensor a rewritten linear casts (its ``input``, ``weight`` and ``grad_output``), the
advisor casts a sample to each candidate format at the scale the recipe would use (the current
per-tensor scale ``fmt.max / amax``, rounded down to a power of two when the recipe does so, or a
scale you pass, e.g. a delayed scale) and measures:

- ``underflow``: the share of the non-zero values that become 0 (below half the smallest subnormal
  after scaling: lost to the format's range at the low end);
- ``saturate``: the share past ``fmt.max`` after scaling (clipped; only a scale that lags the tensor,
  delayed scaling after a jump, produces these);
- ``rel_error``: ``||Q(x) - x|| / ||x||``, the cast's relative error (precision and range together);
- ``binades``: ``log2(amax / min |x|>0)``, the tensor's dynamic range.

The recommendation per role is by range: "e4m3" (3 mantissa bits, the precise one) when at most
``max_lost`` of the values underflow or saturate in it; else "e5m2" (2 mantissa bits, 13 more
binades below) when that loses at most ``max_lost``; else "high" (keep the linear in high
precision). Block and MX recipes scale per block and lose less at the low end than these per-tensor
numbers say.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..model_report import explain
from ..numerics import get_format
from ..quantized import quantize

__all__ = ["FormatStats", "RoleAdvice", "FormatAdvice", "measure_formats", "format_advice", "advise"]

CANDIDATES = ("e4m3", "e5m2")


@dataclass(frozen=True)
class FormatStats:
    """One tensor cast to one format (shares are of the tensor's elements; see the module docs)."""

    format: str
    scale: float
    underflow: float
    saturate: float
    rel_error: float


@dataclass(frozen=True)
class RoleAdvice:
    role: str               # "<weight FQN>.<input|weight|grad_output>" or a name you chose
    amax: float
    binades: float
    stats: dict[str, FormatStats]
    recommended: str        # "e4m3" | "e5m2" | "high"


@dataclass
class FormatAdvice:
    roles: list[RoleAdvice] = field(default_factory=list)

    def recommended(self) -> dict[str, str]:
        return {r.role: r.recommended for r in self.roles}

    def __str__(self) -> str:
        lines = [f"{'role':50s} {'binades':>7s} " + " ".join(
            f"{f + ' under/sat/err':>24s}" for f in CANDIDATES) + "  advice"]
        for r in self.roles:
            cells = " ".join(f"{s.underflow:8.2%}/{s.saturate:6.2%}/{s.rel_error:7.4f}"
                             for s in (r.stats[f] for f in CANDIDATES))
            lines.append(f"{r.role:50s} {r.binades:7.1f} {cells}  {r.recommended}")
        return "\n".join(lines)


def measure_formats(x: torch.Tensor, fmt, *, scale: float | None = None, power_of_two: bool = False) -> FormatStats:
    """Cast ``x`` to ``fmt`` (per tensor, round to nearest) at ``scale`` (None: the current scale)."""
    fmt = get_format(fmt)
    x = x.detach().float().reshape(-1)
    if x.numel() == 0 or not torch.isfinite(x).all():
        raise ValueError("measure_formats needs a non-empty tensor of finite values")
    amax = float(x.abs().max())
    if scale is None:
        scale = 1.0 if amax == 0 else fmt.max / amax
        if power_of_two and amax > 0:
            scale = 2.0 ** math.floor(math.log2(scale))
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
    q = quantize(x, fmt, scale=torch.tensor(float(scale))).dequantize()
    nonzero = x != 0
    n = x.numel()
    underflow = float(((q == 0) & nonzero).sum()) / n
    saturate = float((x.abs() * scale > fmt.max).sum()) / n
    norm = float(x.norm())
    rel = float((q - x).norm()) / norm if norm > 0 else 0.0
    return FormatStats(fmt.name, float(scale), underflow, saturate, rel)


def format_advice(tensors: dict[str, torch.Tensor], *, power_of_two: bool = False,
                  scales: dict[str, dict[str, float]] | None = None,
                  max_lost: float = 0.01) -> FormatAdvice:
    """Measure each named tensor against E4M3 and E5M2 and recommend a format.

    Args:
        tensors: ``{role: sample}``.
        power_of_two: round the current scales down to a power of two (the reference recipe).
        scales: ``{role: {format: scale}}`` to measure at instead of the current scale.
        max_lost: the share of values a format may lose (underflow + saturate) and still be chosen.
    """
    out = FormatAdvice()
    for role, x in tensors.items():
        xf = x.detach().float()
        stats = {f: measure_formats(xf, f, scale=(scales or {}).get(role, {}).get(f), power_of_two=power_of_two)
                 for f in CANDIDATES}
        mag = xf.abs()
        nz = mag[mag > 0]
        amax = float(mag.max()) if mag.numel() else 0.0
        binades = math.log2(amax / float(nz.min())) if nz.numel() else 0.0
        ok = [f for f in CANDIDATES if stats[f].underflow + stats[f].saturate <= max_lost]
        rec = ok[0] if ok else "high"
        out.roles.append(RoleAdvice(role, amax, binades, stats, rec))
    return out


def advise(model: torch.nn.Module, *inputs, config=None, power_of_two: bool | None = None,
           max_lost: float = 0.01, **kwargs) -> FormatAdvice:
    """Run ``model(*inputs)`` once eagerly (forward and backward) and advise on every tensor role of
    the linears ``fp8pass.explain`` says the backend would rewrite with ``config``.

    The model should return its loss (a scalar), so the gradients are the training ones; a non-scalar
    output is reduced with ``.float().square().mean()``. Parameter gradients are left as they were.
    """
    if power_of_two is None:
        power_of_two = bool(getattr(getattr(config, "recipe", None), "power_of_two", False))
    weights = set(explain(model, *inputs, config=config).linears)
    modules = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)
               and f"{name}.weight" in weights}
    if not modules:
        raise ValueError("advise: the backend rewrites no nn.Linear of this model (see fp8pass.explain)")
    seen: dict[str, torch.Tensor] = {}
    hooks = []
    for name, m in modules.items():
        def fwd_hook(mod, args, _n=name):
            seen[f"{_n}.input"] = args[0].detach()
            seen[f"{_n}.weight"] = mod.weight.detach()

        def bwd_hook(mod, grad_input, grad_output, _n=name):
            seen[f"{_n}.grad_output"] = grad_output[0].detach()

        hooks += [m.register_forward_pre_hook(fwd_hook), m.register_full_backward_hook(bwd_hook)]
    saved = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    try:
        out = model(*inputs, **kwargs)
        loss = out if out.dim() == 0 else out.float().square().mean()
        loss.backward()
    finally:
        for h in hooks:
            h.remove()
        for n, p in model.named_parameters():
            p.grad = saved[n]
    order = sorted(seen, key=lambda k: (list(modules).index(k.rsplit(".", 1)[0]), k.rsplit(".", 1)[1]))
    return format_advice({k: seen[k] for k in order}, power_of_two=power_of_two, max_lost=max_lost)
