"""Online drift check: replay one micro-batch in high precision and compare it with the FP8 step.

Every ``DriftCheck.every`` optimizer steps, :class:`DriftMonitor` runs the model's own eager code (the
module behind the ``torch.compile`` wrapper: no FP8 op, no scaling-state update, no stochastic-rounding
draw) on the micro-batch the FP8 step just trained on, with the same weights, and measures

* ``loss_rel_diff = (loss_fp8 - loss_high) / |loss_high|``;
* per linear weight, the cosine between the FP8 step's gradient (what ``.grad`` holds after that
  micro-batch's backward) and the high-precision gradient (``torch.autograd.grad``: ``.grad`` is
  not touched).

* per FP8 linear, the *local* error of its FP8 input cast, measured in the replay:
  ``||(Q(x) - x) W^T|| / ||x W^T||`` with ``Q`` the per-tensor E4M3 cast at the current scale (after
  the per-channel / per-token smoothing when the linear is the down projection of a Smooth-SwiGLU).
  A gradient error spreads to every layer below (and a forward error to every layer above); this
  names the layer where it starts.

A check past ``max_loss_diff``, ``min_grad_cosine`` or ``max_local_error`` warns when the next step's
check confirms it (or at once when a local error is past ``act_at_once`` times its threshold), naming
the layers to blame: those whose local error exceeds ``max_local_error`` in the confirming check or in
the check it confirms (``blame_pending``); when there are none, among the layers below
``min_grad_cosine`` the GLUs that can still be smoothed, else the ``top_k`` lowest (``cosine_blame``).
With ``on_drift="fallback"`` they switch precision for the rest of the run (``fp8pass.switch_precision``:
a GLU MLP that ran without Smooth-SwiGLU gets the per-channel form, any other linear high precision),
and with ``reset_moments`` their optimizer state restarts. Otherwise nothing changes: weights, ``.grad``,
optimizer, scaling state, stochastic-rounding streams and the RNG are as they were (tests/monitor/test_drift.py
checks each).

Usage in a plain loop (the trainer: ``--drift-check N``)::

    fwd = torch.compile(model, backend=fp8pass.backend(Config(drift_check=DriftCheck(every=100))))
    drift = fp8pass.monitor.DriftMonitor(fwd, optimizer=opt)  # the optimizer: for DriftCheck.reset_moments
    for step in range(1, steps + 1):
        loss = fwd(x, y)
        loss.backward()
        if drift.due(step):                      # after the backward, before the optimizer step
            drift.check(step, x, y, fp8_loss=loss)
        opt.step(); opt.zero_grad()
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..config import HIGH, RECIPE_FIELDS, Config, DriftCheck, NVFP4Scaling, Rule
from ..passes import compile_backend_of, inplace_compile_suspended, original_callable
from ..precision_switch import switch_precision
from ..quantized import quantize
from ..runtime.state import restart_history
from ..runtime.swiglu import channel_scales, token_scales
from ..switch_history import switched_config
from .swiglu import find_swiglus

__all__ = ["DriftMonitor", "DriftReport", "grad_cosines"]


@dataclass
class DriftReport:
    """One check (``records()`` gives the metrics record of kind ``"drift"``).

    Attributes:
        step: the optimizer step checked.
        loss_fp8, loss_high: the micro-batch's loss in the FP8 step and in the high-precision replay.
        loss_rel_diff: ``(loss_fp8 - loss_high) / |loss_high|``.
        grad_cosine: ``{weight FQN: cosine}`` for every linear weight of the model (NaN where a
            gradient is not finite).
        fp8_weights: the weights that ran in FP8 (the backend's plan); only these can be flagged.
        local_error: ``{weight FQN: local error of its FP8 input cast}`` for the FP8 weights (module docs).
        flagged: the layers the check blames, worst first (empty: no drift).
        reasons: which thresholds were crossed ("loss", "grad_cosine", "local_error").
        action: "none", "pending" (past a threshold, to be confirmed by the next step's check), "warn"
            or "fallback".
        switched: ``{weight FQN or GLU: what it switched to}`` when the fallback acted.
        seconds: wall time of the replay and comparison.
    """

    step: int
    loss_fp8: float
    loss_high: float
    loss_rel_diff: float
    grad_cosine: dict[str, float] = field(default_factory=dict)
    fp8_weights: list[str] = field(default_factory=list)
    local_error: dict[str, float] = field(default_factory=dict)
    flagged: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    action: str = "none"
    switched: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def drifted(self) -> bool:
        return bool(self.reasons)

    def worst(self, k: int) -> list[tuple[str, float]]:
        """The ``k`` FP8 weights of lowest gradient cosine (NaN first: a non-finite gradient is worst)."""
        fp8 = [(w, self.grad_cosine[w]) for w in self.fp8_weights if w in self.grad_cosine]
        return sorted(fp8, key=lambda wc: (wc[1] == wc[1], wc[1]))[:k]

    def record(self) -> dict:
        """The metrics record: ``{"kind": "drift", "step": ..., ...}`` (cosines rounded to 6 digits)."""
        return {"kind": "drift", "step": self.step, "loss_fp8": self.loss_fp8, "loss_high": self.loss_high,
                "loss_rel_diff": self.loss_rel_diff,
                "min_grad_cosine": min((c for _, c in self.worst(len(self.fp8_weights))), default=float("nan")),
                "grad_cosine": {w: round(c, 6) for w, c in self.grad_cosine.items()},
                "local_error": {w: round(e, 6) for w, e in self.local_error.items()},
                "flagged": list(self.flagged), "reasons": list(self.reasons), "action": self.action,
                "switched": dict(self.switched), "seconds": self.seconds}

    def message(self, check: DriftCheck) -> str:
        blamed = self.flagged[:check.top_k] or [w for w, _ in self.worst(check.top_k)]
        worst = ", ".join(f"{w} (gradient cosine {self.grad_cosine.get(w, float('nan')):.3f}, local FP8 error "
                          f"{self.local_error.get(w, float('nan')):.1%})" for w in blamed)
        crossed = []
        if "loss" in self.reasons:
            crossed.append(f"loss {self.loss_fp8:.4f} in FP8 vs {self.loss_high:.4f} in high precision "
                           f"({self.loss_rel_diff:+.2%}, threshold {check.max_loss_diff:.2%})")
        if "grad_cosine" in self.reasons:
            n = sum(1 for _, v in self.worst(len(self.fp8_weights)) if not v >= check.min_grad_cosine)
            crossed.append(f"{n} layer(s) with a gradient cosine below {check.min_grad_cosine}")
        if "local_error" in self.reasons:
            n = sum(1 for e in self.local_error.values() if not e <= check.max_local_error)
            crossed.append(f"{n} layer(s) whose FP8 input cast changes their output by more than "
                           f"{check.max_local_error:.0%}")
        more = f" (and {len(self.flagged) - check.top_k} more)" if len(self.flagged) > check.top_k else ""
        text = f"fp8pass: drift check at step {self.step}: {'; '.join(crossed)}. Worst layers: {worst}{more}."
        if self.action == "fallback":
            text += " Switched for the rest of the run: " + ", ".join(f"{k} -> {v}" for k, v in self.switched.items())
        else:
            text += (" DriftCheck(on_drift='fallback') would switch them (a GLU without Smooth-SwiGLU to the "
                     "per-channel form, others to high precision); docs/precision.md, Drift check.")
        return text


def grad_cosines(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    """``{name: cos(a[name], b[name])}`` in fp64 (elementwise products: no matmul that autocast would
    run in bf16), read with one host sync. Both zero: 1; one zero: 0; a non-finite gradient: NaN."""
    names = [n for n in a if n in b]
    if not names:
        return {}
    rows = []
    for n in names:
        x = a[n].detach().double().reshape(-1)
        y = b[n].detach().double().reshape(-1).to(x.device)
        rows.append(torch.stack([(x * y).sum(), (x * x).sum(), (y * y).sum()]).cpu())
    dots = torch.stack(rows).double().tolist()
    out = {}
    for n, (xy, xx, yy) in zip(names, dots):
        if xx == 0 and yy == 0:
            out[n] = 1.0
        elif xx == 0 or yy == 0:
            out[n] = 0.0 if xx == xx and yy == yy else float("nan")
        else:
            out[n] = xy / (xx * yy) ** 0.5
    return out


def _default_loss(output) -> torch.Tensor:
    """The replay's loss: the model's output when it is a scalar, else its ``.loss`` (HF models)."""
    if isinstance(output, torch.Tensor) and output.dim() == 0:
        return output
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.dim() == 0:
        return loss
    raise ValueError("DriftMonitor: the model's output is neither a scalar loss nor has a scalar .loss; pass "
                     "loss_fn=(output -> scalar loss), the same loss the training step backpropagates")


class _RNGSaved:
    """Save the CPU (and any initialised CUDA) generators' states on entry, restore them on exit."""

    def __enter__(self):
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        return self

    def __exit__(self, *exc):
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        return False


class DriftMonitor:
    """Runs the drift check of one compiled model (module docs).

    Args:
        model: the model as the training loop calls it: ``torch.compile(model, backend=fp8pass.backend(cfg))``
            or a model compiled in place (``model.compile(backend=...)``).
        check: the :class:`~fp8pass.DriftCheck`; default: the ``drift_check`` of the Config the model
            was compiled with (an error when it has none).
        loss_fn: ``output -> scalar loss`` for models whose output is not the loss (default: the output
            itself when scalar, else its ``.loss``).
        log: ``fn(record)`` receiving each check's ``{"kind": "drift", ...}`` record (the trainer's
            metrics writer), or None.
        optimizer: the training loop's optimizer; needed (only) by ``DriftCheck.reset_moments``, which
            drops the state of the switched layers' weights.
    """

    def __init__(self, model, check: DriftCheck | None = None, *, loss_fn: Callable | None = None,
                 log: Callable | None = None, optimizer: torch.optim.Optimizer | None = None):
        be = compile_backend_of(model)
        self.config: Config | None = getattr(be, "config", None) if isinstance(getattr(be, "config", None), Config) else None
        check = check if check is not None else getattr(self.config, "drift_check", None)
        if not isinstance(check, DriftCheck):
            raise ValueError("DriftMonitor needs a DriftCheck: pass check=fp8pass.DriftCheck(...), or compile the "
                             "model with fp8pass.backend(Config(drift_check=fp8pass.DriftCheck(...)))"
                             if check is None else f"DriftMonitor: check must be an fp8pass.DriftCheck, got {check!r}")
        if check.reset_moments and check.on_drift == "fallback" and optimizer is None:
            raise ValueError("DriftCheck(reset_moments=True) resets the optimizer state of the layers the fallback "
                             "switches: pass the optimizer, DriftMonitor(model, optimizer=opt)")
        self.check_cfg = check
        self.optimizer = optimizer
        self.model = model
        self.backend = be
        self.eager = original_callable(model)
        if not isinstance(self.eager, torch.nn.Module):
            raise TypeError(f"DriftMonitor needs a model (an nn.Module, compiled or not), got {type(self.eager).__name__}")
        self.loss_fn = loss_fn or _default_loss
        self.log = log
        self.reports: list[DriftReport] = []
        self._pending: int | None = None     # the step of a drift awaiting confirmation
        self._last_drift: int | None = None  # the step of the last check past a threshold that did not act
        self._pending_origin: dict[str, float] = {}  # that check's layers past max_local_error: their local errors
        self._linears = {f"{name}.weight": m.weight for name, m in self.eager.named_modules()
                         if isinstance(m, torch.nn.Linear) and m.weight.requires_grad}
        self._glu_of: dict[str, str] = {}  # a GLU projection's module FQN -> the GLU MLP's
        self._down: set[str] = set()       # the GLUs' down projections
        for site in find_swiglus(self.eager):
            prefix = f"{site.name}." if site.name else ""
            for child, _ in site.module.named_children():
                self._glu_of[prefix + child] = site.name
            self._down.add(prefix + ("w2" if site.layout == "meta" else "down_proj"))

    def due(self, step: int) -> bool:
        """Whether optimizer step ``step`` (1-based) is a check step: a multiple of ``every``, or the step
        after a drift that awaits confirmation."""
        return step % self.check_cfg.every == 0 or (self._pending is not None and step == self._pending + 1)

    def fp8_weights(self) -> list[str]:
        """The linear weights the backend's graphs run in FP8 now (all linears when unknown): those its graphs
        made FP8, less those a switch (or rule) has put in high precision since."""
        report = getattr(self.backend, "report", None)
        names = set(report().linears) if callable(report) else set()
        fp8 = [w for w in self._linears if w in names] if names else list(self._linears)
        return [w for w in fp8 if self.config is None or self.site_config(w) is not None]

    def gradients(self) -> dict[str, torch.Tensor]:
        """A copy of the linear weights' ``.grad`` now (for :meth:`check`'s ``fp8_grads`` when more
        micro-batches will accumulate into ``.grad`` before the check)."""
        return {n: w.grad.detach().clone() for n, w in self._linears.items() if w.grad is not None}

    def site_config(self, weight: str) -> Config | None:
        """The Config the linear of ``weight`` runs in now (the model's switches, then ``Config.rules``, then
        ``Config``), or None when a rule keeps it in high precision or the Config is unknown."""
        if self.config is None:
            return None
        cfg = switched_config(self.config, self.eager)
        module = weight.rsplit(".", 1)[0]
        hit = cfg.rule_for([module, weight, self._glu_of.get(module, "")])
        if hit is None:
            return cfg
        return None if hit[1].recipe == HIGH else hit[1].site_config(cfg)

    def _smoothing(self, module: str) -> str | None:
        """The Smooth-SwiGLU form that divides the input of ``module`` (a GLU's down projection), or None."""
        site = self._glu_of.get(module)
        if site is None or module not in self._down:
            return None
        cfg = self.site_config(module + ".weight")
        if cfg is None or isinstance(cfg.recipe, NVFP4Scaling) or cfg.recipe.granularity == "mx":
            return None
        return cfg.smooth_swiglu

    def replay(self, *inputs, local_errors: dict | None = None, **kwargs
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The high-precision loss and gradients of ``inputs`` (the eager model, same weights, RNG restored;
        ``.grad`` untouched). With ``local_errors`` (a dict), the FP8 linears' local input-cast errors are
        measured into it (module docs)."""
        names = list(self._linears)
        hooks = []
        if local_errors is not None:
            modules = dict(self.eager.named_modules())
            for w in self.fp8_weights():
                name = w.rsplit(".", 1)[0]
                hooks.append(modules[name].register_forward_hook(self._local_error_hook(name, w, local_errors)))
        try:
            with _RNGSaved(), torch.enable_grad(), inplace_compile_suspended(self.eager):
                loss = self.loss_fn(self.eager(*inputs, **kwargs))
                grads = torch.autograd.grad(loss, [self._linears[n] for n in names], allow_unused=True)
        finally:
            for h in hooks:
                h.remove()
        return loss.detach(), {n: g for n, g in zip(names, grads) if g is not None}

    def _local_error_hook(self, module: str, weight: str, out: dict):
        smooth = self._smoothing(module)

        def hook(mod, args, output):
            x = args[0].detach()
            with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
                xf = x.float().reshape(-1, x.shape[-1])
                w = mod.weight.detach().float()
                # the down projection's own smoothing (runtime/swiglu.py): x * c per channel, x / r per token
                if smooth == "channel":
                    s = torch.reciprocal(channel_scales(xf.abs().amax(0)))
                elif smooth == "token":
                    s = token_scales(xf)
                else:
                    s = torch.ones((), device=xf.device)
                q = quantize(xf / s, "e4m3").dequantize() * s
                ref = (xf @ w.t()).norm()
                err = ((q - xf) @ w.t()).norm()
                out[weight] = float(err / ref) if ref > 0 else 0.0
        return hook

    def check(self, step: int, *inputs, fp8_loss: torch.Tensor | float,
              fp8_grads: dict[str, torch.Tensor] | None = None, **kwargs) -> DriftReport:
        """Compare the FP8 step of ``inputs`` with its high-precision replay; warn / fall back on drift.

        Call it after the backward of the micro-batch ``inputs`` and before the optimizer step, under
        the autocast the forward ran in.

        Args:
            step: the optimizer step (for the record and the switch).
            inputs, kwargs: the micro-batch, as the model was called with it.
            fp8_loss: the loss the FP8 forward returned for it.
            fp8_grads: ``{weight FQN: gradient}`` of that micro-batch alone; default: the weights'
                ``.grad`` (right when they held nothing before this micro-batch's backward). A positive
                factor (loss scale, 1/grad_accum) does not change a cosine.
        """
        t0 = time.perf_counter()
        local: dict[str, float] = {}
        loss_high, high = self.replay(*inputs, local_errors=local, **kwargs)
        if fp8_grads is None:
            fp8_grads = {n: w.grad for n, w in self._linears.items() if w.grad is not None}
        cos = grad_cosines(fp8_grads, high)
        lf = float(fp8_loss.detach().float() if isinstance(fp8_loss, torch.Tensor) else fp8_loss)
        lh = float(loss_high.float())
        rel = (lf - lh) / abs(lh) if lh != 0 else float("inf") if lf != lh else 0.0
        report = DriftReport(step, lf, lh, rel, cos, self.fp8_weights(), local)
        self.decide(report)
        if report.action == "fallback":
            report.switched = self._fallback(report)
        report.seconds = time.perf_counter() - t0
        if report.action in ("warn", "fallback"):
            warnings.warn(report.message(self.check_cfg), RuntimeWarning, stacklevel=2)
        self.reports.append(report)
        if self.log is not None:
            self.log(report.record())
        return report

    def decide(self, report: DriftReport) -> None:
        """Set ``report``'s reasons, flagged layers and action from its measurements and the previous checks
        (DriftCheck's thresholds, ``confirm``, ``act_at_once``, ``blame_pending``, ``cosine_blame``)."""
        c, step, local = self.check_cfg, report.step, report.local_error
        low = [w for w, v in report.worst(len(report.fp8_weights)) if not v >= c.min_grad_cosine]
        over = {w: e for w, e in local.items() if not e <= c.max_local_error}
        if not abs(report.loss_rel_diff) <= c.max_loss_diff:
            report.reasons.append("loss")
        if low:
            report.reasons.append("grad_cosine")
        if over:
            report.reasons.append("local_error")
        if not report.reasons:
            self._pending, self._last_drift, self._pending_origin = None, None, {}
            return
        at_once = c.act_at_once > 0 and any(not e <= c.act_at_once * c.max_local_error for e in over.values())
        confirms = self._last_drift == step - 1
        acts = not c.confirm or confirms or at_once
        origin = dict(over)
        if acts and confirms and c.blame_pending:  # the pending check's layers, at their worse local error
            fp8 = set(report.fp8_weights)
            for w, e in self._pending_origin.items():
                if w in fp8:
                    origin[w] = max(e, origin.get(w, e))
        report.flagged = sorted(origin, key=lambda w: -origin[w]) or self._cosine_blame(low, report)
        report.action = c.on_drift if acts else "pending"
        self._pending = None if acts else step
        # after a fallback the layers run in another precision: a drift past it is a new one, confirmed on its own
        self._last_drift = None if report.action == "fallback" else step
        self._pending_origin = {} if acts else over

    def _cosine_blame(self, low: list[str], report: DriftReport) -> list[str]:
        """The layers blamed when none is past ``max_local_error``: ``low`` is those below ``min_grad_cosine``,
        lowest first (empty: only the loss crossed its threshold, and the ``top_k`` lowest are blamed)."""
        c = self.check_cfg
        if not low:
            return [w for w, _ in report.worst(c.top_k)]
        if c.cosine_blame == "all":
            return low
        if c.cosine_blame == "glu_first":
            glus = [w for w in low if self.smoothable(w)]
            if glus:
                return glus
        return low[:c.top_k]

    def smoothable(self, weight: str) -> bool:
        """Whether ``weight`` belongs to a GLU MLP that runs in an FP8 recipe with the Smooth-SwiGLU form but
        without it now (the fallback gives it the per-channel form and keeps it in FP8)."""
        cfg = self.site_config(weight)
        return (self._glu_of.get(weight.rsplit(".", 1)[0]) is not None and cfg is not None
                and cfg.smooth_swiglu is None and not isinstance(cfg.recipe, NVFP4Scaling)
                and cfg.recipe.granularity != "mx")

    def fallback_rules(self, weights) -> tuple[list[Rule], dict[str, str]]:
        """The rules that switch the linears of ``weights``: a GLU MLP that runs without Smooth-SwiGLU (an
        FP8 recipe that has the form) gets the per-channel form, any other linear high precision; and
        ``{what: to what}`` for the record."""
        rules, switched = [], {}
        for w in weights:
            module = w.rsplit(".", 1)[0]
            site = self._glu_of.get(module)
            cfg = self.site_config(w)
            if cfg is None:
                continue  # already high precision
            if self.smoothable(w):
                if site in switched:
                    continue
                recipe = Config(**{f: getattr(cfg, f) for f in RECIPE_FIELDS if f != "smooth_swiglu"},
                                smooth_swiglu="channel")
                rules.append(Rule(f"{site}.*", recipe))
                switched[site] = "Smooth-SwiGLU per channel"
            else:
                rules.append(Rule(module, HIGH))
                switched[module] = "high precision"
        return rules, switched

    def _fallback(self, report: DriftReport) -> dict[str, str]:
        rules, switched = self.fallback_rules(report.flagged)
        if rules:
            switch_precision(self.model, rules, reason=f"drift check at step {report.step}: "
                             + ", ".join(report.reasons), step=report.step)
        for site, to in switched.items():
            if to.startswith("Smooth-SwiGLU"):  # its down projection's input becomes h * c: old amaxes would scale it
                down = next(d for d in self._down if self._glu_of.get(d) == site)
                restart_history(self._linears[down + ".weight"])
        if self.check_cfg.reset_moments and self.optimizer is not None:
            for p in self.switched_parameters(switched):
                self.optimizer.state.pop(p, None)  # Adam (torch's and fp8pass.optim's) starts it again at step 0
        return switched

    def switched_parameters(self, switched: dict[str, str]) -> list[torch.nn.Parameter]:
        """The parameters of what ``switched`` names (a GLU MLP: all its projections; a linear: its weight and bias)."""
        modules = dict(self.eager.named_modules())
        return [p for name in switched for p in modules[name].parameters()]
