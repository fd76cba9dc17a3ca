"""Outlier analytics for 4-bit training: kurtosis, top-k channels, 16-element block spikes, hot-channel
persistence, per linear layer and role (input activation, weight, output gradient).

The seed document on NVFP4 pretraining describes outliers turning from transient spikes (early) into
drifting and then persistent hot channels (late). These statistics show that per layer::

    mon = OutlierMonitor(model)              # hooks on every nn.Linear (eager model)
    for step in range(n):
        loss = model(x).loss; loss.backward()
        mon.record(step)                     # stats of this step's forward/backward
    print(mon.summary())                     # last step + persistence of the hot sets
    mon.close()

``record`` reads what the hooks captured in the last forward/backward (they keep only the latest
tensors, detached). Hooks run in eager mode; for a compiled model run the monitor on the eager module
every N steps (hooks inside a compiled graph would break it). :func:`outlier_stats` is the pure
per-tensor function.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..numerics import ROLES

__all__ = ["outlier_stats", "hot_set", "overlap", "OutlierStats", "OutlierMonitor", "ROLES"]



@dataclass
class OutlierStats:
    """Statistics of one tensor (viewed as ``[rows, channels]``, channels = last dim).

    Attributes:
        kurtosis: Pearson kurtosis of all elements (3 for a Gaussian; heavy tails are larger).
        top_values / top_channels: the ``top_k`` largest per-channel absmaxes and their channels.
        channel_ratio: largest channel absmax / median channel absmax.
        block_spike: largest 1x16 block amax / median block amax ("local amax spike").
        spiky_blocks: share of blocks whose amax exceeds ``spike_factor`` x the median block amax.
        hot: the hot set: the ``hot_fraction`` channels of largest RMS (sorted indices).
    """

    kurtosis: float
    top_values: list[float]
    top_channels: list[int]
    channel_ratio: float
    block_spike: float
    spiky_blocks: float
    hot: list[int] = field(default_factory=list)


def hot_set(x: torch.Tensor, fraction: float) -> list[int]:
    """Sorted channels (last dim) with the largest RMS: ``round(fraction * channels)`` of them."""
    x2 = x.detach().reshape(-1, x.shape[-1]).to(torch.float32)
    n = min(x2.shape[1], int(round(fraction * x2.shape[1])))
    if n == 0:
        return []
    rms = x2.pow(2).mean(0)
    return sorted(torch.topk(rms, n).indices.tolist())


def overlap(a, b) -> float:
    """``|a & b| / max(|a|, |b|)`` of two channel sets (1: the same hot channels; 0: disjoint)."""
    a, b = set(a), set(b)
    if not a and not b:
        return 1.0
    return len(a & b) / max(len(a), len(b))


def outlier_stats(x: torch.Tensor, top_k: int = 8, hot_fraction: float = 0.09, block: int = 16,
                  spike_factor: float = 8.0) -> OutlierStats:
    """:class:`OutlierStats` of ``x`` (any float tensor with >= 1 dim).

    Args:
        x: activations ``[..., channels]``, a weight ``[out, in]`` or a gradient.
        top_k: channels listed in ``top_values`` / ``top_channels``.
        hot_fraction: share of channels in the hot set (0.09 as HCP's default).
        block: block length along the last dim (16: NVFP4's blocks; a ragged tail is its own block).
        spike_factor: a block is "spiky" when its amax exceeds this multiple of the median block amax.
    """
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or not x.is_floating_point():
        raise TypeError(f"outlier_stats needs a float tensor with >= 1 dim, got {getattr(x, 'shape', type(x))}")
    x2 = x.detach().reshape(-1, x.shape[-1]).to(torch.float64)
    flat = x2.reshape(-1)
    c = flat - flat.mean()
    var = c.pow(2).mean()
    kurt = float(c.pow(4).mean() / var.pow(2)) if var > 0 else 0.0
    ch = x2.abs().amax(0)
    k = min(top_k, ch.numel())
    tv, ti = torch.topk(ch, k)
    med_ch = ch.median()
    rows, cols = x2.shape
    pad = (-cols) % block
    blocks = torch.nn.functional.pad(x2.abs(), (0, pad)).reshape(rows, -1, block).amax(-1).reshape(-1)
    med_b = blocks.median()
    spike = float(blocks.max() / med_b) if med_b > 0 else (float("inf") if blocks.max() > 0 else 0.0)
    spiky = float((blocks > spike_factor * med_b).to(torch.float64).mean()) if med_b > 0 else 0.0
    return OutlierStats(
        kurtosis=kurt, top_values=tv.tolist(), top_channels=ti.tolist(),
        channel_ratio=float(ch.max() / med_ch) if med_ch > 0 else float("inf"),
        block_spike=spike, spiky_blocks=spiky, hot=hot_set(x2, hot_fraction))


class OutlierMonitor:
    """Per-layer, per-role outlier statistics over training (hooks on ``nn.Linear`` modules).

    Args:
        model: the (eager) model.
        roles: which of "input", "weight", "grad_output" to track.
        top_k, hot_fraction, block, spike_factor: see :func:`outlier_stats`.
        include: only modules whose FQN contains one of these substrings (None: all linears).

    Attributes:
        history: ``{(layer, role): [(step, OutlierStats), ...]}``.
    """

    def __init__(self, model: torch.nn.Module, roles=ROLES, top_k: int = 8, hot_fraction: float = 0.09,
                 block: int = 16, spike_factor: float = 8.0, include: list[str] | None = None):
        bad = set(roles) - set(ROLES)
        if bad:
            raise ValueError(f"unknown roles {sorted(bad)}; valid: {', '.join(ROLES)}")
        self.roles, self.kw = tuple(roles), dict(top_k=top_k, hot_fraction=hot_fraction, block=block,
                                                 spike_factor=spike_factor)
        self.history: dict[tuple[str, str], list[tuple[int, OutlierStats]]] = {}
        self._last: dict[tuple[str, str], torch.Tensor] = {}
        self._modules: dict[str, torch.nn.Linear] = {}
        self._handles = []
        for name, mod in model.named_modules():
            if not isinstance(mod, torch.nn.Linear) or (include and not any(s in name for s in include)):
                continue
            self._modules[name] = mod
            if "input" in self.roles:
                self._handles.append(mod.register_forward_pre_hook(self._pre_hook(name)))
            if "grad_output" in self.roles:
                self._handles.append(mod.register_full_backward_hook(self._bwd_hook(name)))
        if not self._modules:
            raise ValueError("OutlierMonitor: the model has no nn.Linear modules to watch")

    def _pre_hook(self, name):
        def hook(mod, args):
            if args and isinstance(args[0], torch.Tensor):
                self._last[(name, "input")] = args[0].detach()
        return hook

    def _bwd_hook(self, name):
        def hook(mod, grad_input, grad_output):
            if grad_output and isinstance(grad_output[0], torch.Tensor):
                self._last[(name, "grad_output")] = grad_output[0].detach()
        return hook

    def record(self, step: int) -> dict[tuple[str, str], OutlierStats]:
        """Statistics of the tensors captured since the last record (and of the weights now)."""
        out = {}
        if "weight" in self.roles:
            for name, mod in self._modules.items():
                self._last[(name, "weight")] = mod.weight.detach()
        for key, t in self._last.items():
            st = outlier_stats(t, **self.kw)
            self.history.setdefault(key, []).append((int(step), st))
            out[key] = st
        self._last = {}
        return out

    def persistence(self, layer: str, role: str = "input") -> list[tuple[int, float, float]]:
        """``[(step, overlap with the previous record's hot set, overlap with the first record's)]``."""
        h = self.history.get((layer, role), [])
        return [(s, overlap(st.hot, h[i - 1][1].hot) if i else 1.0, overlap(st.hot, h[0][1].hot))
                for i, (s, st) in enumerate(h)]

    def summary(self) -> str:
        """A table: the latest record per layer and role, with the mean step-to-step hot-set overlap."""
        rows = [("layer", "role", "kurtosis", "top ch", "ch/median", "block spike", "spiky", "hot overlap")]
        for (layer, role), h in sorted(self.history.items()):
            step, st = h[-1]
            per = self.persistence(layer, role)[1:]
            ov = sum(p[1] for p in per) / len(per) if per else float("nan")
            rows.append((layer, role, f"{st.kurtosis:.1f}", str(st.top_channels[:3]), f"{st.channel_ratio:.1f}",
                         f"{st.block_spike:.1f}", f"{st.spiky_blocks:.3f}", f"{ov:.2f}"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)

    def close(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
