"""The training loop: one recipe, one run directory, exact resume."""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch

from ..checkpoint import (
    SCALING_KEY,
    CheckpointError,
    atomic_write,
    load_scaling_state_dict,
    scaling_state_dict,
    set_rng_state,
)
from ..checkpoint import attach as attach_scaling_state
from ..config import DriftCheck
from ..kernels.cpu import cpu_capability
from ..monitor.callback import MonitorCallback
from ..monitor.drift import DriftMonitor
from ..monitor.precision import audit_summary, audit_version, collective_audit, precision_audit
from ..monitor.telemetry import scaling_telemetry, warn_once
from ..precision_file import rules_from_data, rules_to_data, schedule_from_data
from ..precision_switch import apply_schedule
from ..runtime.state import accumulate_scaling, kept_scaling_state
from .checkpoint import load_checkpoint, save_checkpoint
from .data import TextData, load_text_data
from .logging import MetricsWriter, ProgressBar
from .loss_scale import LossScaler, parse_loss_scale
from .model import ModelConfig, TinyLlama
from .recipes import (
    PRECISIONS,
    autocast,
    build_optimizer,
    check_moment_options,
    fp8_config,
    get_recipe,
    prepare_model,
    recipe_moments,
    resolve_precision,
)
from .run_lock import RunLock, StopSignals

__all__ = ["TrainConfig", "TrainResult", "train", "lr_at", "FROM_RECIPE"]

SCHEDULES = ("cosine", "linear", "constant")
# printed before the first FP8 step (measured: 100-195 s on 2-core CPUs with a cold Inductor cache,
# docs/results/fresh_machine.md)
COMPILE_NOTE = "compiling the FP8 graphs: first step, ~1-3 min on a CPU (the ETA leaves it out)"
FROM_RECIPE = "recipe"  # a moment field left to the recipe (resolved in __post_init__)


@dataclass
class TrainConfig:
    """One training run.

    Args:
        recipe: "bf16", "fp8", "fp8-smooth", "fp8-smooth-fp8adam", "bf16-fp8adam" or a named recipe
            ("paper", "reference", "delayed", "blockwise", "mxfp8", "nvfp4", "nvfp4-hcp"; see
            :mod:`fp8pass.train.recipes` and :mod:`fp8pass.recipes`).
        steps: optimizer steps.
        out: run directory (metrics.jsonl, checkpoint.pt, config.json).
        data: text file/folder; None = the Python standard library's sources.
        seed: model init and batch order.
        batch_size, seq_len: sequences per step and their length in bytes.
        lr, min_lr_ratio, warmup, schedule: peak lr, final lr = lr * min_lr_ratio, linear warmup steps,
            decay "cosine" | "linear" | "constant".
        weight_decay: AdamW decay on matrices (norm gains are not decayed).
        betas, eps, grad_clip: AdamW and global-norm clipping (0 disables clipping).
        scaling: fp8 scaling recipe, "delayed" | "current" (not for named recipes, which fix it).
        smooth: Smooth-SwiGLU form for the -smooth recipes, "channel" (paper) | "token" (reference code)
            (not for named recipes).
        m_format, v_format, v_sqrt, moment_block_size, moment_rounding, moment_stochastic_flush: the
            -fp8adam recipes' moment storage (``fp8pass.optim.AdamW``'s m_format, v_format, v_sqrt,
            block_size, rounding, stochastic_flush): formats "e4m3" | "e5m2" | "bf16" | "fp32", v
            stored as sqrt(v) or itself, elements per fp32 scale (None = one scale per tensor),
            "nearest" | "stochastic" rounding, stochastic flush-to-zero (docs/optim.md). Each left
            at ``FROM_RECIPE`` ("recipe", the default) takes the recipe's value (``recipe_moments``:
            the paper's form for "paper"/"reference", e4m3/e5m2/v itself/128 otherwise); a value set
            explicitly wins.
        model: the TinyLlama shape.
        eval_every, eval_batches: validation cadence and size (fixed validation batches).
        ckpt_every: checkpoint cadence (a checkpoint is always written at the end).
        monitor_every: SwiGLU diagnostics cadence (0 = off).
        compile_bf16: run the bf16 recipe through torch.compile (Inductor) too.
        precision: what the high-precision parts (the whole model in the bf16 recipes) run in:
            "auto" (bf16 where this CPU has native bf16 matmuls, else fp32) | "bf16" | "fp32". The
            run saves the resolved value, so a resume computes in the same dtype on any machine.
        compiler: what compiles the fp8 backend's rewritten graph: "inductor" | "aot_eager" (quicker
            to compile, slower steps; the tests use it).
        grad_accum: micro-batches per optimizer step (gradient accumulation, "delayed update"): each
            step draws ``batch_size * grad_accum`` sequences and runs them as ``grad_accum``
            micro-batches of ``batch_size``, each loss divided by ``grad_accum``. The FP8 scales are
            updated once per optimizer step from the amax over all micro-batches
            (:func:`fp8pass.accumulate_scaling`; docs/train.md, Gradient accumulation).
        loss_scale: None (off), "dynamic" or a static scale (float > 0): loss scaling with the
            optimizer step skipped on overflow (:class:`~fp8pass.train.loss_scale.LossScaler`), for
            ``precision="fp16"``. Skipped steps are logged (``skipped``, ``loss_scale``).
        fp8_start_step: FP8 ramp-up: an fp8 recipe trains its first ``fp8_start_step`` steps in high
            precision (the bf16 recipe's path) and compiles with the FP8 backend from that step on; the
            FP8 scales start from the first FP8 step's amaxes. 0 (default): FP8 from the start.
        recompute_glu_output: fp8 recipes: ``fp8pass.Config.recompute_glu_output`` (each GLU's output
            recomputed in backward from its FP8 gate/up instead of kept: less memory saved for backward).
        save_norm_input_fp8: fp8 recipes: ``fp8pass.Config.save_norm_input_fp8`` (each RMSNorm that feeds
            FP8 linears keeps E4M3 codes of its normalized input for backward instead of its fp32 input).
        bf16_stochastic_round: -fp8adam recipes: the model's parameters (and so its gradients) are bf16,
            with no fp32 master copy, and ``fp8pass.optim.AdamW(bf16_stochastic_round=True)`` rounds each
            updated weight stochastically (issue 31; docs/optim.md). Default False.
        precision_rules: per-module precision rules (``fp8pass.Config.rules``) as plain data, the
            ``rules`` list of a precision config file (``--precision-config FILE``; docs/precision.md):
            kept in the run's config, so a resume runs the same rules. fp8 recipes only.
        drift_check: the online drift check (``fp8pass.DriftCheck``, docs/precision.md): every this many
            steps the step's first micro-batch is replayed in high precision (``precision``) and compared
            with the FP8 step (``"drift"`` records in metrics.jsonl); 0 (default): off. fp8 recipes only.
        on_drift, drift_max_loss_diff, drift_min_grad_cosine, drift_max_local_error, drift_act_at_once,
            drift_reset_moments: the check's ``on_drift`` ("warn" | "fallback"), ``max_loss_diff``,
            ``min_grad_cosine``, ``max_local_error``, ``act_at_once`` and ``reset_moments``.
        precision_schedule: scheduled precision switches (``fp8pass.Config.schedule``) as plain data, the
            ``switch`` list of a precision config file: ``[{"at_step": 500 or "at_fraction": 0.9, "rules":
            [...], "reason": "..."}]``. Before each step the trainer makes the due ones
            (``fp8pass.apply_schedule``) and logs each as a ``precision_switch`` record; the model's
            switch history is in its checkpoint, so a resume continues in the switched precision. fp8
            recipes only (switches apply from the first FP8 step).
        eval_recipe: what validation also runs in (``fp8pass.Config.eval_recipe``): ``"high"`` or a named
            recipe without state (``"blockwise"``, ``"mxfp8"``, ``"nvfp4"``). Each evaluation then logs
            ``val_loss`` (the training recipe) and ``val_loss_eval_recipe`` (``model.eval()``, the same
            weights in this recipe). None: validation in the training recipe only. fp8 recipes only.
        max_data_bytes: cap each split (None = all).
        progress: show the progress bar.
    """

    recipe: str = "bf16"
    steps: int = 120
    out: str = "runs/demo/bf16"
    data: str | None = None
    seed: int = 0
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 20
    schedule: str = "cosine"
    weight_decay: float = 0.1
    betas: tuple = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 1.0
    scaling: str = "delayed"
    smooth: str = "channel"
    m_format: str = FROM_RECIPE
    v_format: str = FROM_RECIPE
    v_sqrt: bool | str = FROM_RECIPE
    moment_block_size: int | None | str = FROM_RECIPE
    moment_rounding: str = FROM_RECIPE
    moment_stochastic_flush: bool | str = FROM_RECIPE
    model: ModelConfig = field(default_factory=ModelConfig)
    eval_every: int = 40
    eval_batches: int = 8
    ckpt_every: int = 40
    monitor_every: int = 40
    compile_bf16: bool = False
    precision: str = "auto"
    compiler: str = "inductor"
    grad_accum: int = 1
    fp8_start_step: int = 0
    loss_scale: str | float | None = None
    precision_rules: list = field(default_factory=list)
    drift_check: int = 0
    on_drift: str = "warn"
    drift_max_loss_diff: float = DriftCheck.max_loss_diff
    drift_min_grad_cosine: float = DriftCheck.min_grad_cosine
    drift_max_local_error: float = DriftCheck.max_local_error
    drift_act_at_once: float = DriftCheck.act_at_once
    drift_reset_moments: bool = DriftCheck.reset_moments
    precision_schedule: list = field(default_factory=list)
    eval_recipe: str | None = None
    recompute_glu_output: bool = False
    save_norm_input_fp8: bool = False
    bf16_stochastic_round: bool = False
    max_data_bytes: int | None = None
    progress: bool = True

    def __post_init__(self):
        if isinstance(self.model, dict):
            self.model = ModelConfig(**self.model)
        self.betas = tuple(self.betas)
        recipe = get_recipe(self.recipe)
        for name, value in recipe_moments(self.recipe).items():
            if isinstance(getattr(self, name), str) and getattr(self, name) == FROM_RECIPE:
                setattr(self, name, value)
        if recipe.named and (self.scaling, self.smooth) != ("delayed", "channel"):
            raise ValueError(f"recipe {self.recipe!r} fixes its own scaling and Smooth-SwiGLU (fp8pass.recipes); "
                             f"scaling={self.scaling!r}/smooth={self.smooth!r} apply to the fp8* recipes only")
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}; valid: {', '.join(PRECISIONS)}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}; valid: {', '.join(SCHEDULES)}")
        if self.smooth not in ("channel", "token"):
            raise ValueError(f"unknown smooth mode {self.smooth!r}; valid: channel, token")
        if self.compiler not in ("inductor", "aot_eager", "eager"):
            raise ValueError(f"unknown compiler {self.compiler!r}; valid: inductor, aot_eager, eager")
        check_moment_options(self.m_format, self.v_format, self.moment_block_size, self.v_sqrt,
                             self.moment_rounding, self.moment_stochastic_flush)
        if self.scaling not in ("delayed", "current"):
            raise ValueError(f"unknown scaling {self.scaling!r}; valid: delayed, current")
        self.loss_scale = parse_loss_scale(self.loss_scale)
        if isinstance(self.fp8_start_step, bool) or not isinstance(self.fp8_start_step, int) or self.fp8_start_step < 0:
            raise ValueError(f"fp8_start_step must be an int >= 0 (the first FP8 step), got {self.fp8_start_step!r}")
        if self.fp8_start_step and not get_recipe(self.recipe).fp8:
            raise ValueError(f"fp8_start_step applies to the fp8 recipes; recipe {self.recipe!r} has no FP8 linears")
        if isinstance(self.grad_accum, bool) or not isinstance(self.grad_accum, int):
            raise ValueError(f"grad_accum must be an int >= 1 (micro-batches per step), got {self.grad_accum!r}")
        for name in ("steps", "batch_size", "seq_len", "eval_every", "eval_batches", "ckpt_every", "grad_accum"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not isinstance(self.recompute_glu_output, bool):
            raise ValueError(f"recompute_glu_output must be True or False, got {self.recompute_glu_output!r}")
        if self.recompute_glu_output and not recipe.fp8:
            raise ValueError(f"recompute_glu_output applies to the fp8 recipes; recipe {self.recipe!r} has no FP8 GLUs")
        if not isinstance(self.save_norm_input_fp8, bool):
            raise ValueError(f"save_norm_input_fp8 must be True or False, got {self.save_norm_input_fp8!r}")
        if self.save_norm_input_fp8 and not recipe.fp8:
            raise ValueError(f"save_norm_input_fp8 applies to the fp8 recipes; recipe {self.recipe!r} has no FP8 "
                             "linears behind its norms")
        if not isinstance(self.bf16_stochastic_round, bool):
            raise ValueError(f"bf16_stochastic_round must be True or False, got {self.bf16_stochastic_round!r}")
        if self.bf16_stochastic_round and not recipe.fp8_adam:
            raise ValueError(f"bf16_stochastic_round is an option of fp8pass.optim.AdamW: use an -fp8adam recipe, "
                             f"not {self.recipe!r}")
        if self.precision_rules and not recipe.fp8:
            raise ValueError(f"precision rules apply to the fp8 recipes; recipe {self.recipe!r} has no FP8 linears")
        self.fp8_rules()  # a bad rule fails here, naming it
        if isinstance(self.drift_check, bool) or not isinstance(self.drift_check, int) or self.drift_check < 0:
            raise ValueError(f"drift_check must be an int >= 0 (steps between drift checks; 0: off), "
                             f"got {self.drift_check!r}")
        if self.drift_check and not recipe.fp8:
            raise ValueError(f"drift_check compares FP8 steps with high precision; recipe {self.recipe!r} has no "
                             f"FP8 linears")
        self.drift()  # bad thresholds fail here, naming them
        if self.precision_schedule and not recipe.fp8:
            raise ValueError(f"a precision schedule applies to the fp8 recipes; recipe {self.recipe!r} has no FP8 "
                             "linears")
        self.fp8_schedule()
        if self.eval_recipe is not None:
            if not recipe.fp8:
                raise ValueError(f"eval_recipe applies to the fp8 recipes; recipe {self.recipe!r} has no FP8 linears "
                                 "(its validation already runs in high precision)")
            if not isinstance(self.eval_recipe, str):
                raise ValueError(f"eval_recipe must be 'high' or a named recipe's name, got {self.eval_recipe!r}")
            self.fp8_config()  # an unknown or stateful eval recipe fails here, naming it
        if self.seq_len > self.model.max_seq_len:
            raise ValueError(f"seq_len={self.seq_len} exceeds the model's max_seq_len={self.model.max_seq_len}")
        if not (self.lr > 0 and 0 <= self.min_lr_ratio <= 1 and self.warmup >= 0):
            raise ValueError("need lr > 0, 0 <= min_lr_ratio <= 1, warmup >= 0")

    def fp8_rules(self) -> tuple:
        """``precision_rules`` as ``fp8pass.Rule`` objects (validated)."""
        return tuple(rules_from_data(list(self.precision_rules), "precision_rules"))

    def drift(self) -> DriftCheck | None:
        """The ``fp8pass.DriftCheck`` of ``drift_check`` and its options (None when off)."""
        check = DriftCheck(every=max(1, self.drift_check), on_drift=self.on_drift, max_loss_diff=self.drift_max_loss_diff,
                           min_grad_cosine=self.drift_min_grad_cosine, max_local_error=self.drift_max_local_error,
                           act_at_once=self.drift_act_at_once, reset_moments=self.drift_reset_moments)
        return check if self.drift_check else None  # the options are validated even when off

    def fp8_schedule(self) -> tuple:
        """``precision_schedule`` as ``fp8pass.Switch`` objects (validated)."""
        return tuple(schedule_from_data(list(self.precision_schedule), "precision_schedule"))

    def fp8_config(self):
        """The fp8 backend's ``fp8pass.Config`` of this run (fp8 recipes)."""
        return fp8_config(get_recipe(self.recipe), self.scaling, self.smooth, self.compiler, self.fp8_rules(),
                          self.eval_recipe, self.fp8_schedule(), **self.backend_options())

    def backend_options(self) -> dict:
        """Config fields this run sets beyond the recipe's (fp8 recipes)."""
        options = {"recompute_glu_output": True} if self.recompute_glu_output else {}
        if self.save_norm_input_fp8:
            options["save_norm_input_fp8"] = True
        drift = self.drift()
        if drift is not None:
            options["drift_check"] = drift
        return options

    def resolved(self) -> "TrainConfig":
        """This configuration with ``precision="auto"`` resolved for this machine (what a run saves)."""
        return replace(self, precision=resolve_precision(self.precision))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["betas"] = list(self.betas)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        names = {f.name for f in fields(cls)}
        if "block_size" in d and "moment_block_size" not in d:  # a config saved before issue 18: the field
            # had that name, and the optimizer always stored sqrt(v) (its default until then)
            d = {**d, "moment_block_size": d["block_size"], "v_sqrt": d.get("v_sqrt", True)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class TrainResult:
    out: Path
    status: str                 # "finished" | "diverged" | "interrupted" (by ``signal``)
    steps: int
    final_loss: float
    final_val_loss: float
    losses: list = field(default_factory=list)
    tokens_per_s: float = 0.0       # all tokens over the run's wall time (compilation, evals, checkpoints in it)
    step_tokens_per_s: float = 0.0  # median of the steps' own throughput: the steady state, compiles left out
    wall_s: float = 0.0
    signal: str | None = None       # "SIGTERM" / "SIGINT" when interrupted
    grad_skips: int = 0             # steps skipped for a non-finite gradient norm, over the whole run
    final_val_loss_eval_recipe: float = float("nan")  # the last validation in TrainConfig.eval_recipe (if set)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup, then the chosen decay."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    if cfg.schedule == "constant":
        return cfg.lr
    frac = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    lo = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "linear":
        return cfg.lr - (cfg.lr - lo) * frac
    return lo + 0.5 * (cfg.lr - lo) * (1 + math.cos(math.pi * frac))


def log_precision_audit(model, log, step: int, seen: int) -> int:
    """Log a ``"precision"`` record when ``model``'s precision audit changed since version ``seen`` (its
    first compiled steps, a recompile, a precision switch); returns the version logged. Costs an integer
    comparison per step otherwise (the records are made at compile time, fp8pass/precision_audit.py)."""
    version = audit_version(model)
    if version == seen:
        return seen
    gemms = precision_audit(model)
    log({"kind": "precision", "step": step, "summary": audit_summary(gemms),
         "fallbacks": sum(r.fallback is not None for r in gemms), "gemms": [r.as_dict() for r in gemms],
         "collectives": [r.as_dict() for r in collective_audit(model)]})
    return version


@torch.no_grad()
def evaluate(fwd, data: TextData, cfg: TrainConfig) -> float:
    """Mean loss over ``eval_batches`` fixed validation batches (the same ones at every evaluation)."""
    total = 0.0
    for i in range(cfg.eval_batches):
        x, y = data.batch("val", cfg.batch_size, cfg.seq_len, cfg.seed, i)
        with autocast(cfg.precision):
            total += fwd(x, y).item()
    return total / cfg.eval_batches


def train(cfg: TrainConfig, *, resume: bool = False, data: TextData | None = None, callbacks=(),
          grad_callbacks=(), monitor: bool = True) -> TrainResult:
    """Train one recipe into ``cfg.out``.

    Args:
        cfg: the run's configuration (on resume, the saved one, with ``steps`` possibly raised).
        resume: continue from ``cfg.out/checkpoint.pt``; the losses then equal those of an
            uninterrupted run.
        data: preloaded data (else loaded from ``cfg.data``).
        callbacks: extra ``fn(step, model, log, final=False)`` called after every optimizer step,
            before that step's evaluation and checkpoint (so both see what a callback changed).
        grad_callbacks: ``fn(step, model)`` called after backward, before clipping and the
            optimizer step (gradient surgery, gradient logging).
        monitor: add the SwiGLU diagnostics callback when ``cfg.monitor_every > 0``.

    The run holds an exclusive lock on ``cfg.out`` (a second run there raises
    :class:`~fp8pass.train.run_lock.RunInUseError`). A SIGTERM or SIGINT (in the main thread) ends the
    current step, writes a checkpoint and returns status "interrupted"; a step whose gradient norm is
    not finite is skipped (weights and optimizer untouched) and counted (``grad_skips``).

    Raises:
        CheckpointError: the resume's checkpoint is invalid, or a new one could not be written or
            verified (:class:`~fp8pass.checkpoint.DiskFullError` for lack of space); the previous
            checkpoint is intact. The run's end record says ``status: "error: <type>"``.
    """
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    with RunLock(out), StopSignals() as stop:
        return _train_locked(out, cfg, resume, data, callbacks, grad_callbacks, monitor, stop)


def _train_locked(out: Path, cfg: TrainConfig, resume: bool, data, callbacks, grad_callbacks, monitor: bool,
                  stop: StopSignals) -> TrainResult:
    """:func:`train`'s body, run while it holds the run folder's lock."""
    recipe = get_recipe(cfg.recipe)
    cfg = cfg.resolved()  # saved with the precision resolved: a resume computes alike on any machine
    data = data or load_text_data(cfg.data, cfg.max_data_bytes)
    ckpt = load_checkpoint(out) if resume else None
    if ckpt is not None and ckpt["data"]["fingerprint"] != data.fingerprint:
        raise ValueError(f"--resume {out}: the data differ from the checkpoint's (fingerprint "
                         f"{data.fingerprint} vs {ckpt['data']['fingerprint']}); pass the same --data")

    torch.manual_seed(cfg.seed)
    model = TinyLlama(cfg.model)
    if cfg.bf16_stochastic_round:  # the bf16 weights are the only copy: initialised in fp32, rounded once
        model.to(torch.bfloat16)
    opt = build_optimizer(model, recipe, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=cfg.betas, eps=cfg.eps,
                          m_format=cfg.m_format, v_format=cfg.v_format, block_size=cfg.moment_block_size,
                          v_sqrt=cfg.v_sqrt, rounding=cfg.moment_rounding,
                          stochastic_flush=cfg.moment_stochastic_flush,
                          bf16_stochastic_round=cfg.bf16_stochastic_round)
    start = 0
    scaler = LossScaler(cfg.loss_scale) if cfg.loss_scale is not None else None
    if ckpt is not None and scaler is not None:
        if "loss_scaler" in ckpt:
            try:
                scaler.load_state_dict(ckpt["loss_scaler"])
            except ValueError as e:
                raise ValueError(f"--resume {out}: {e}") from None
        elif scaler.dynamic:
            raise ValueError(f"--resume {out}: a run with dynamic loss scaling cannot be resumed exactly (the "
                             "checkpoint, written before the scaler's state was saved, lacks it); start it again, "
                             "or use a static --loss-scale")
    if ckpt is not None:
        start = ckpt["step"]
        if recipe.fp8 and start >= cfg.fp8_start_step:  # the saved model state carries the scaling state
            attach_scaling_state(model, cfg.fp8_config())
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])

    def fp8_forward():
        return prepare_model(model, recipe, scaling=cfg.scaling, smooth_mode=cfg.smooth,
                             compile_bf16=cfg.compile_bf16, compiler=cfg.compiler, rules=cfg.fp8_rules(),
                             eval_recipe=cfg.eval_recipe, schedule=cfg.fp8_schedule(),
                             backend_options=cfg.backend_options())

    fp8_on = recipe.fp8 and start >= cfg.fp8_start_step
    fwd = fp8_forward() if fp8_on or not recipe.fp8 else prepare_model(
        model, get_recipe("bf16"), compile_bf16=cfg.compile_bf16)  # ramp-up: high precision until fp8_start_step
    if ckpt is not None:
        # the model state carries the scaling state, each weight's under its own rule's recipe (loaded above);
        # the separate copy is read only from checkpoints whose model state lacks it
        if ckpt.get("scaling") and not any(f".{SCALING_KEY}." in k for k in ckpt["model"]):
            load_scaling_state_dict(model, ckpt["scaling"], config=cfg.fp8_config())
        set_rng_state(ckpt["rng"])

    config_text = __import__("json").dumps(cfg.to_dict(), indent=2)
    atomic_write(out / "config.json", lambda f: f.write(config_text.encode()))
    log = MetricsWriter(out / "metrics.jsonl")
    if ckpt is not None:
        log.truncate_after(start)
    else:
        log.truncate_after(-1)
        log({"kind": "meta", "recipe": cfg.recipe, "params": model.num_params(), "data": data.source,
             "data_files": data.n_files, "train_bytes": data.train.numel(), "val_bytes": data.val.numel(),
             "data_fingerprint": data.fingerprint, "torch": torch.__version__, "threads": torch.get_num_threads(),
             "precision": cfg.precision, **cpu_capability()})
    callbacks = list(callbacks)

    def drift_monitor():  # the check of the FP8 model (None: off, or not yet in FP8)
        return DriftMonitor(fwd, log=log, optimizer=opt) if fp8_on and cfg.drift_check else None

    drift = drift_monitor()
    if monitor and cfg.monitor_every > 0:
        probe = data.batch("val", min(cfg.batch_size, 8), cfg.seq_len, cfg.seed, 10_000)[0]
        callbacks.append(MonitorCallback(probe, every=cfg.monitor_every))

    params = [p for p in model.parameters() if p.requires_grad]
    bar = ProgressBar(cfg.steps, cfg.recipe, start) if cfg.progress else None
    losses, status, val_loss, tok_s, step_rates = [], "finished", float("nan"), 0.0, []
    val_loss_eval = float("nan")
    schedule = cfg.fp8_schedule() if recipe.fp8 else ()
    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum
    if start == 0:
        for cb in callbacks:
            cb(0, model, log)
    t_run = time.perf_counter()
    step = start
    grad_skips = ckpt.get("grad_skips", 0) if ckpt is not None else 0

    def write_checkpoint(done: int) -> None:
        save_checkpoint(out, step=done, config=cfg.to_dict(), model_state=model.state_dict(),
                        optimizer_state=opt.state_dict(), scaling_state=scaling_state_dict(model) if fp8_on else None,
                        data_fingerprint=data.fingerprint,
                        loss_scaler_state=None if scaler is None else scaler.state_dict(), grad_skips=grad_skips)
    telemetry_warned: set[str] = set()
    audit_seen = 0  # the precision audit's version last logged (log_precision_audit)
    guard = contextlib.ExitStack()
    if recipe.fp8 or cfg.compile_bf16:
        # Past Dynamo's recompile limit a frame silently runs eagerly: an fp8 run would go on in bf16.
        guard.enter_context(torch._dynamo.config.patch(fail_on_recompile_limit_hit=True))
    try:
        for step in range(start, cfg.steps):
            t0 = time.perf_counter()
            first_compiled_step = step == start  # the steps whose time the ETA leaves out (restart_eta)
            if recipe.fp8 and not fp8_on and step >= cfg.fp8_start_step:
                fwd, fp8_on = fp8_forward(), True
                drift = drift_monitor()
                log({"kind": "fp8_start", "step": step})
                first_compiled_step = True
            if fp8_on and schedule:
                # "step": the first step (counted as the train records count) in the new precision
                for sw in apply_schedule(fwd, step, cfg.steps, schedule):
                    log({"kind": "precision_switch", "step": step + 1, "reason": sw.reason,
                         "rules": rules_to_data(sw.rules)})
                    first_compiled_step = True  # its graphs compile again: the ETA leaves the step out
            if first_compiled_step and fp8_on and bar is not None:  # else minutes of silence (issue 34)
                bar.note(COMPILE_NOTE)
            lr = lr_at(step, cfg)
            for g in opt.param_groups:
                g["lr"] = lr
            xs, ys = data.batch("train", cfg.batch_size * cfg.grad_accum, cfg.seq_len, cfg.seed, step)
            micro = []
            check_drift = drift is not None and drift.due(step + 1)
            drift_grads = None  # micro-batch 0's own FP8 gradients, kept when more micro-batches follow
            # FP8 scales change once per optimizer step: the micro-batches' amaxes accumulate (max)
            # and enter the delayed-scaling histories together when the context closes
            with accumulate_scaling(model, enabled=fp8_on and cfg.grad_accum > 1):
                for k in range(cfg.grad_accum):  # micro-batch k: rows [k*B, (k+1)*B) of the step's batch
                    rows = slice(k * cfg.batch_size, (k + 1) * cfg.batch_size)
                    with autocast(cfg.precision):
                        loss = fwd(xs[rows], ys[rows])
                    part = loss / cfg.grad_accum if cfg.grad_accum > 1 else loss
                    (scaler.scale(part) if scaler is not None else part).backward()
                    micro.append(loss.detach())
                    if check_drift and k == 0 and cfg.grad_accum > 1:
                        drift_grads = drift.gradients()
            if check_drift:  # before any gradient callback or optimizer step: the weights the FP8 step saw
                with autocast(cfg.precision):
                    drift.check(step + 1, xs[:cfg.batch_size], ys[:cfg.batch_size], fp8_loss=micro[0],
                                fp8_grads=drift_grads)
            if cfg.grad_accum > 1:
                loss = torch.stack(micro).float().mean()
            finite = scaler.unscale_(params) if scaler is not None else True  # callbacks see true gradients
            for cb in grad_callbacks:
                cb(step + 1, model)
            gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
            # one Inf gradient element turns into NaN weights and moments through clipping and the
            # step; read the norm now (the log reads it anyway) and skip such a step
            grad_ok = bool(torch.isfinite(gnorm))
            scale_info = {}
            if scaler is not None:
                scale_info = {"loss_scale": scaler.scale_value, "skipped": int(not finite)}
                if finite and grad_ok:
                    opt.step()
                scaler.update(finite)
                scale_info["skipped_total"] = scaler.skipped
            elif grad_ok:
                opt.step()
            if finite and not grad_ok:  # the loss scaler counts the overflows it found itself
                grad_skips += 1
                scale_info.update(grad_skipped=1, grad_skips_total=grad_skips)
            opt.zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
            lv, tok_s = loss.item(), tokens_per_step / dt
            losses.append(lv)
            step_rates.append(tok_s)
            fp8_counts = {}
            if fp8_on:  # read with the loss (the step's one host sync); warn the first time non-zero
                tele = scaling_telemetry(model)
                fp8_counts = {"fp8_skipped": tele.total_skipped, "fp8_overflows": tele.total_overflows}
                warn_once(tele, telemetry_warned)
            log({"kind": "train", "step": step + 1, "loss": lv, "lr": lr, "grad_norm": gnorm.item(),
                 "tokens_per_s": tok_s, "step_time_s": dt, **fp8_counts, **scale_info})
            if fp8_on:
                audit_seen = log_precision_audit(model, log, step + 1, audit_seen)
            if bar is not None:
                if first_compiled_step:
                    bar.restart_eta(step + 1)
                bar.update(step + 1, loss=lv, **{"tok/s": round(tok_s)})
            if not math.isfinite(lv):
                status = "diverged"
                break
            done = step + 1
            for cb in callbacks:
                cb(done, model, log, final=done == cfg.steps)
            if done % cfg.eval_every == 0 or done == cfg.steps:
                # its forwards would record amaxes: training must not depend on when it evaluated (a run
                # evaluates at its last step, so a resumed run would differ from the uninterrupted one)
                with kept_scaling_state(model):
                    val_loss = evaluate(fwd, data, cfg)
                    record = {"kind": "eval", "step": done, "val_loss": val_loss}
                    if cfg.eval_recipe is not None:  # the same weights in the eval recipe: the backend's eval graphs
                        model.eval()
                        try:
                            val_loss_eval = evaluate(fwd, data, cfg)
                        finally:
                            model.train()
                        record.update(eval_recipe=cfg.eval_recipe, val_loss_eval_recipe=val_loss_eval)
                log(record)
            # on SIGTERM/SIGINT too (preemption): the step is done, save it before stopping
            if done % cfg.ckpt_every == 0 or done == cfg.steps or stop.signum is not None:
                write_checkpoint(done)
            if stop.signum is not None:
                status = "interrupted"
                break
    except (torch._dynamo.exc.FailOnRecompileLimitHit, torch._dynamo.exc.Unsupported) as e:
        status = "error: RuntimeError"  # what is raised below
        if not isinstance(e, torch._dynamo.exc.FailOnRecompileLimitHit) and "recompile limit" not in str(e):
            status = f"error: {type(e).__name__}"
            raise
        raise RuntimeError(
            f"recipe {cfg.recipe!r}: Dynamo hit its recompile limit (torch._dynamo.config.recompile_limit="
            f"{torch._dynamo.config.recompile_limit}) compiling the model, and would have run it eagerly, "
            "i.e. without FP8, from here on. Models compiled one after another in one process share that "
            "limit: train each run in a fresh process, or call torch._dynamo.reset() between runs.") from e
    except BaseException as e:  # a crashed run must not be logged "finished"
        status = f"error: {type(e).__name__}"
        raise
    finally:
        guard.close()
        if bar is not None:
            bar.close()
        elapsed = time.perf_counter() - t_run
        n = len(losses)
        end = {"kind": "end", "step": start + n, "status": status, "wall_s": elapsed,
               "mean_tokens_per_s": n * tokens_per_step / elapsed if elapsed > 0 else 0.0, "grad_skips": grad_skips}
        if status == "interrupted":
            end["signal"] = stop.name
        try:
            log(end)
        except CheckpointError:  # MetricsWriter's write error
            if not status.startswith("error"):
                raise
            # else: a full disk that already failed the run; the error being raised says so
        finally:
            log.close()
    return TrainResult(out, status, start + len(losses), losses[-1] if losses else float("nan"), val_loss,
                       losses, len(losses) * tokens_per_step / max(elapsed, 1e-9),
                       statistics.median(step_rates) if step_rates else 0.0, elapsed,
                       stop.name if status == "interrupted" else None, grad_skips, val_loss_eval)
