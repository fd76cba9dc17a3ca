"""Sharp-attention advisor: attention whose logits amplify the FP8 cast error of its q/k projections.

An attention logit is ``L_ij = scale * q_i . k_j = s_ij * cos(q_i, k_j)`` with ``s_ij = scale * |q_i| |k_j|``,
the **effective logit scale**. A relative error ``e`` that an FP8 cast puts into the q/k projections
becomes a logit error of ~``sqrt(2) * s * e / sqrt(head_dim)`` nats: an absolute error, which the
softmax turns into a relative error of the attention weights of the same size. Plain Llama attention
at initialisation has ``s`` below 1 and its logits move by ~0.003 nats; standard q/k-norm attention
(Qwen3, OLMo 2: ``s = sqrt(head_dim)``) by ``sqrt(2) * e`` ~ 0.05; attention that RMS-normalises q and
k and scales the logits further (torchtitan's Muse Glimmer: ``s = 43.8`` on every token pair) by
~0.3, and its FP8 gradients change direction (docs/results/sharp_attention.md).

:func:`sharp_attention` measures this per attention call (every ``F.scaled_dot_product_attention``
the model makes) on a probe batch, eagerly: once as the model is, then once per attention with only
that attention's q/k projections run on FP8-cast operands (``fwd_format``, current per-tensor scale:
delayed scaling's first step), the layers before it untouched. It reports per attention module:

- ``logit_scale``: the median effective logit scale ``s`` over token pairs;
- ``normalised``: whether ``|q|`` and ``|k|`` are the same on every token (q/k norm);
- ``qk_error``: the relative error the cast put into the q/k projections' outputs;
- ``logit_error``: the RMS change of the logits (nats) over the pairs the mask allows;
- ``amplification``: ``logit_error / qk_error``, nats of logit error per unit of relative cast error;
- ``attention_error``: the mean total-variation distance between the attention rows (the share of
  attention mass the cast moved to other keys).

An attention is **sharp** when ``logit_error >= threshold`` (0.1 nats by default, twice what standard
q/k-norm attention gets: docs/monitor.md says why). The advice keeps its q/k projections (or its fused
qkv projection) in high precision: :meth:`AttentionAdvice.rules` returns the ``fp8pass.Rule``\\ s, :meth:`AttentionAdvice.apply` puts
them before a Config's rules, and ``fp8pass.explain`` then names the advice for each kept projection.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..config import HIGH, Config, Rule
from ..numerics import get_format
from ..passes.uncompiled import inplace_compile_suspended, original_callable
from ..quantized import quantize
from ..report.report import _state_kept

__all__ = ["AttentionSite", "AttentionAdvice", "sharp_attention", "DEFAULT_THRESHOLD", "NORMALISED_SPREAD"]

DEFAULT_THRESHOLD = 0.1    # nats of RMS logit error from casting one attention's q/k projections (docs/monitor.md)
NORMALISED_SPREAD = 0.02   # |q| (|k|) varying less than this (std / mean over tokens): q/k-normalised

# the last FQN component of q, k and fused qkv projections in the model code fp8pass knows
Q_NAMES = ("wq", "q_proj", "query", "to_q", "q")
K_NAMES = ("wk", "k_proj", "key", "to_k", "k")
QKV_NAMES = ("wqkv", "qkv_proj", "qkv", "Wqkv", "query_key_value", "in_proj", "c_attn")


@dataclass(frozen=True)
class AttentionSite:
    """One attention call of the probe forward, measured (module docstring)."""

    module: str                     # FQN of the innermost module holding both projections
    projections: tuple[str, ...]    # q and k projection FQNs, or the fused qkv projection's
    logit_scale: float
    normalised: bool
    qk_error: float
    logit_error: float
    attention_error: float
    sharp: bool

    @property
    def amplification(self) -> float:
        return self.logit_error / self.qk_error if self.qk_error > 0 else 0.0

    def describe(self) -> str:
        """``sharp attention: logit scale 43.8 on normalised q/k, FP8 q/k cast error 0.037 -> logit error
        0.288 nats (x7.8), 4.8% of attention mass moved`` (a Rule's ``reason``, printed by explain)."""
        kind = "normalised q/k" if self.normalised else "q/k"
        verdict = "sharp attention" if self.sharp else "attention"
        return (f"{verdict}: logit scale {self.logit_scale:.1f} on {kind}, FP8 q/k cast error {self.qk_error:.3f} "
                f"-> logit error {self.logit_error:.3f} nats (x{self.amplification:.1f}), "
                f"{self.attention_error:.1%} of attention mass moved")


@dataclass
class AttentionAdvice:
    """What :func:`sharp_attention` found: one :class:`AttentionSite` per attention call.

    Attributes:
        sites: the measured attention calls, in the order they ran.
        threshold: the logit error (nats) from which an attention counts as sharp.
        notes: attention calls that could not be measured and why (no q/k projection found).
    """

    sites: list[AttentionSite] = field(default_factory=list)
    threshold: float = DEFAULT_THRESHOLD
    notes: list[str] = field(default_factory=list)

    @property
    def sharp(self) -> list[AttentionSite]:
        return [s for s in self.sites if s.sharp]

    def rules(self) -> list[Rule]:
        """``Rule(projection FQN, "high")`` for the q/k projections of every sharp attention, each with
        the measurement as its ``reason`` (explain prints it)."""
        out, seen = [], set()
        for s in self.sharp:
            for p in s.projections:
                if p not in seen:
                    seen.add(p)
                    out.append(Rule(p, HIGH, reason=f"advisor: {s.describe()}"))
        return out

    def apply(self, config: Config | None = None) -> Config:
        """``config`` (default ``Config()``) with :meth:`rules` before its own rules (first match wins)."""
        config = Config() if config is None else config
        if not isinstance(config, Config):
            raise TypeError(f"AttentionAdvice.apply takes an fp8pass.Config, got {type(config).__name__}")
        return replace(config, rules=tuple(self.rules()) + tuple(config.rules))

    def __str__(self) -> str:
        head = (f"sharp-attention advice: {len(self.sharp)} of {len(self.sites)} attention call(s) sharp "
                f"(logit error >= {self.threshold:g} nats)")
        rows = [["module", "projections", "logit scale", "q/k norm", "cast err", "logit err", "amplif.",
                 "mass moved", "advice"]]
        for s in self.sites:
            rows.append([s.module, ", ".join(p.rsplit(".", 1)[-1] for p in s.projections), f"{s.logit_scale:.1f}",
                         "yes" if s.normalised else "no", f"{s.qk_error:.4f}", f"{s.logit_error:.4f}",
                         f"{s.amplification:.1f}", f"{s.attention_error:.2%}",
                         "keep q/k high" if s.sharp else "FP8 ok"])
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [head] + ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


class _Stop(Exception):
    """Ends a perturbed forward once the attention it measures has run."""


class _SDPARecorder(TorchFunctionMode):
    """Records the q, k, scale and mask of every ``F.scaled_dot_product_attention`` call, with the q/k
    projections that ran since the previous call; ``stop_at``: raise :class:`_Stop` after that call."""

    def __init__(self, stop_at: int | None = None):
        super().__init__()
        self.calls: list[dict] = []
        self.recent: dict[str, str] = {}
        self.stack: list[str] = []
        self.stop_at = stop_at

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        a = dict(zip(names, args), **kwargs)
        if "q" in self.recent and "k" in self.recent:
            projections = (self.recent["q"], self.recent["k"])
        elif "qkv" in self.recent:
            projections = (self.recent["qkv"],)
        else:
            projections = ()
        self.recent = {}
        self.calls.append({"q": a["query"].detach(), "k": a["key"].detach(), "mask": a.get("attn_mask"),
                           "causal": bool(a.get("is_causal", False)), "scale": a.get("scale"),
                           "projections": projections, "stack": list(self.stack)})
        out = func(*args, **kwargs)
        if self.stop_at is not None and len(self.calls) - 1 == self.stop_at:
            raise _Stop
        return out


def _role(fqn: str) -> str | None:
    last = fqn.rsplit(".", 1)[-1]
    return "q" if last in Q_NAMES else "k" if last in K_NAMES else "qkv" if last in QKV_NAMES else None


def _fake_fp8_linear(module: torch.nn.Linear, x: torch.Tensor, fmt) -> torch.Tensor:
    """``module(x)`` with input and weight cast to ``fmt`` at their current per-tensor scale."""
    xq = quantize(x.detach().float(), fmt).dequantize()
    wq = quantize(module.weight.detach().float(), fmt).dequantize()
    b = None if module.bias is None else module.bias.detach().float()
    return F.linear(xq, wq, b)


def _rng_state():
    return torch.get_rng_state(), (torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None)


def _set_rng_state(state) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def _run(model, inputs, kwargs, recorder: _SDPARecorder, perturb: set[str], fmt, errors: dict) -> None:
    """One eager forward under ``recorder``; the linears named in ``perturb`` run FP8-cast (their
    relative output error into ``errors``)."""
    hooks = []
    for name, m in model.named_modules():
        def pre(mod, args, _n=name):
            recorder.stack.append(_n)

        def post(mod, args, out, _n=name):
            recorder.stack.pop()
            role = _role(_n) if isinstance(mod, torch.nn.Linear) else None
            if role is not None:
                recorder.recent[role] = _n
            if _n in perturb and isinstance(out, torch.Tensor):
                y = _fake_fp8_linear(mod, args[0], fmt)
                errors[_n] = float((y - out.float()).norm() / out.float().norm().clamp_min(1e-30))
                return y.to(out.dtype)
            return None

        hooks += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
    try:
        with recorder:
            model(*inputs, **kwargs)
    except _Stop:
        pass
    finally:
        for h in hooks:
            h.remove()


def _logits(call: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits with the mask's additive part, allowed positions) of one recorded SDPA call, fp64."""
    q, k = call["q"].double(), call["k"].double()
    if k.shape[-3] != q.shape[-3]:   # grouped-query attention: each k head serves several q heads
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    scale = call["scale"] if call["scale"] is not None else 1.0 / math.sqrt(q.shape[-1])
    logits = scale * (q @ k.transpose(-2, -1))
    allowed = torch.ones_like(logits, dtype=torch.bool)
    if call["causal"]:
        allowed = allowed & torch.ones(logits.shape[-2:], dtype=torch.bool, device=logits.device).tril()
    mask = call["mask"]
    if isinstance(mask, torch.Tensor):
        if mask.dtype == torch.bool:
            allowed = allowed & mask
        else:
            logits = logits + mask.double()
            allowed = allowed & torch.isfinite(logits)
    return logits, allowed


def _measure(clean: dict, fp8: dict, qk_error: float, module: str, threshold: float) -> AttentionSite:
    logits, allowed = _logits(clean)
    logits8, _ = _logits(fp8)
    diff = torch.where(allowed, logits8 - logits, torch.zeros_like(logits))
    logit_error = math.sqrt(float(diff.square().sum() / allowed.sum().clamp_min(1)))
    neg = torch.finfo(torch.float64).min
    p = torch.softmax(torch.where(allowed, logits, neg), -1)
    p8 = torch.softmax(torch.where(allowed, logits8, neg), -1)
    attention_error = float(0.5 * (p8 - p).abs().sum(-1).mean())
    q, k = clean["q"].double(), clean["k"].double()
    qn, kn = q.norm(dim=-1), k.norm(dim=-1)
    scale = clean["scale"] if clean["scale"] is not None else 1.0 / math.sqrt(q.shape[-1])
    logit_scale = float(scale * qn.median() * kn.median())

    def spread(n):  # per (batch, head) over tokens
        return float((n.std(dim=-1) / n.mean(dim=-1).clamp_min(1e-30)).mean()) if n.shape[-1] > 1 else 0.0

    normalised = spread(qn) < NORMALISED_SPREAD and spread(kn) < NORMALISED_SPREAD
    return AttentionSite(module, clean["projections"], logit_scale, normalised, qk_error, logit_error,
                         attention_error, logit_error >= threshold)


def _site_module(call: dict) -> str:
    """The innermost module on the call stack that holds all the call's projections."""
    for name in reversed(call["stack"]):
        if all(p.startswith(name + ".") or not name for p in call["projections"]):
            return name
    return ""


def sharp_attention(model: torch.nn.Module, *inputs, config: Config | None = None,
                    threshold: float = DEFAULT_THRESHOLD, **kwargs) -> AttentionAdvice:
    """Measure how much each attention of ``model`` amplifies the FP8 cast error of its q/k projections
    (module docstring) on the probe ``model(*inputs, **kwargs)``, and advise.

    Runs eagerly under ``no_grad`` (a compiled model's own code; RNG and buffers restored afterwards):
    one clean forward, then one forward per attention call that has q/k projections, stopped after that
    call. Attention must be computed by ``F.scaled_dot_product_attention`` (torchtitan, Hugging Face's
    default "sdpa", fp8pass's TinyLlama); q/k projections are the ``nn.Linear`` modules named ``wq``/
    ``wk``, ``q_proj``/``k_proj``, ``query``/``key``, ``to_q``/``to_k``, ``q``/``k``, or a fused
    ``wqkv``/``qkv_proj``/``qkv``/``Wqkv``/``query_key_value``/``in_proj``/``c_attn`` that ran since the
    previous attention call.

    Args:
        config: the Config whose ``fwd_format`` the casts use (default ``Config()``: E4M3; "identity"
            measures E4M3). The cast is per tensor whatever the recipe: row, block and MX casts err
            less, NVFP4's E2M1 far more (its q/k error is not what is measured here).
        threshold: RMS logit error (nats) from which an attention is sharp (> 0).

    Raises:
        ValueError: a bad threshold, or a forward that calls ``F.scaled_dot_product_attention`` nowhere.
    """
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not (
            math.isfinite(threshold) and threshold > 0):
        raise ValueError(f"sharp_attention threshold must be a number of nats > 0, got {threshold!r}")
    config = Config() if config is None else config
    fmt_name = config.fwd_format if config.fwd_format != "identity" else "e4m3"
    fmt = get_format(fmt_name)
    model = original_callable(model)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"sharp_attention takes an nn.Module, got {type(model).__name__}")
    advice = AttentionAdvice(threshold=float(threshold))
    with _state_kept(model), inplace_compile_suspended(model), torch.compiler.set_stance("force_eager"), \
            torch.no_grad():
        rng = _rng_state()   # every pass draws the same random numbers (dropout): only the cast differs
        clean = _SDPARecorder()
        _run(model, inputs, kwargs, clean, set(), fmt, {})
        if not clean.calls:
            raise ValueError("sharp_attention: the forward called F.scaled_dot_product_attention nowhere; the "
                             "advisor measures SDPA attention only (Hugging Face: attn_implementation='sdpa')")
        for i, call in enumerate(clean.calls):
            if not call["projections"]:
                advice.notes.append(f"attention call {i} (in {call['stack'][-1] if call['stack'] else 'model'}): "
                                    f"no q/k projection ran before it (names: {', '.join(Q_NAMES + QKV_NAMES)}); "
                                    f"not measured")
                continue
            errors: dict[str, float] = {}
            _set_rng_state(rng)
            fp8 = _SDPARecorder(stop_at=i)
            _run(model, inputs, kwargs, fp8, set(call["projections"]), fmt, errors)
            qk_error = math.sqrt(sum(e * e for e in errors.values()) / max(len(errors), 1))
            advice.sites.append(_measure(call, fp8.calls[i], qk_error, _site_module(call), threshold))
    return advice
