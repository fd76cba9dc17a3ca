"""Training recipes: what precision the model runs in and which optimizer holds its state.

The recipes and their names are the registry's (:mod:`fp8pass.recipes`: ``RECIPES``, ``Recipe``,
``get_recipe`` are re-exported here); this module turns a recipe into the run's model and optimizer.
The trainer's own recipes (``bf16``, ``fp8``, ``fp8-smooth``, ``fp8-smooth-fp8adam``, ``bf16-fp8adam``)
take the scaling and Smooth-SwiGLU mode from ``TrainConfig.scaling``/``smooth``; ``bf16-fp8adam``
isolates the optimizer: the moment-format ablation (experiments/moments.py) uses it.

The named recipes (``paper``, ``reference``, ``delayed``, ``blockwise``,
``mxfp8``, ``nvfp4``, ``nvfp4-hcp``) are training recipes too: each fixes the backend Config
(``Config.from_recipe(name)``; ``TrainConfig.scaling``/``smooth`` do not apply to them) and the
moment storage (FP8 moments for ``paper`` and ``reference``, fp32 for the others); a moment option
set explicitly in ``TrainConfig`` / on the CLI overrides the recipe's.

The FP8 moments' storage (the -fp8adam recipes) is set by ``TrainConfig``'s ``m_format``,
``v_format``, ``v_sqrt`` (store sqrt(v) or v itself), ``moment_block_size`` (elements per fp32 scale,
None = one scale per tensor: the paper's granularity), ``moment_rounding`` and
``moment_stochastic_flush``; :func:`build_optimizer` passes them to ``fp8pass.optim.AdamW``.

Master weights stay fp32 in every recipe and everything the FP8 backend leaves in high precision
(embeddings, LM head, norms, attention scores) runs under bf16 autocast, so the recipes differ only
in what the table says.

Precision (``TrainConfig.precision``): "auto" (default) runs the high-precision parts in the dtype
this CPU's matmuls are fast in: bf16 where oneDNN has native bf16 (AVX512/AMX), fp32 on AVX2-only
CPUs, where a bf16 matmul is ~100x slower (:func:`fp8pass.kernels.cpu.fast_matmul_dtype`;
``FP8PASS_CPU_GEMM_DTYPE`` overrides it). The ``bf16`` recipe is then an fp32 baseline, and says so:
the resolved precision is printed and saved in the run's config.json and metrics.
"""

from __future__ import annotations

import contextlib

import torch

from .. import optim as fp8optim
from ..compile_backend import backend
from ..config import Config, CurrentScaling, DelayedScaling
from ..kernels.cpu import cpu_capability, fast_matmul_dtype
from ..recipes import BLOCK_MOMENTS, RECIPES, MomentOptions, Recipe, get_recipe

__all__ = ["RECIPES", "Recipe", "get_recipe", "recipe_moments", "DEFAULT_MOMENTS", "build_optimizer", "check_moment_options", "prepare_model",
           "param_groups", "PRECISIONS", "MOMENT_ROUNDINGS", "resolve_precision", "describe_precision", "autocast"]

PRECISIONS = ("auto", "bf16", "fp32", "fp16")
MOMENT_ROUNDINGS = ("nearest", "stochastic")


def moment_fields(moments: MomentOptions) -> dict:
    """``TrainConfig``'s moment fields for ``moments``."""
    return dict(m_format=moments.m_format, v_format=moments.v_format, v_sqrt=moments.v_sqrt,
                moment_block_size=moments.block_size, moment_rounding=moments.rounding,
                moment_stochastic_flush=moments.stochastic_flush)


# TrainConfig's moment fields when neither the recipe nor the user sets them (the -fp8adam recipes' storage)
DEFAULT_MOMENTS = moment_fields(BLOCK_MOMENTS)


def recipe_moments(name: str) -> dict:
    """TrainConfig's moment fields as recipe ``name`` sets them."""
    return moment_fields(get_recipe(name).moments or BLOCK_MOMENTS)


def resolve_precision(precision: str) -> str:
    """"bf16", "fp32" or "fp16", what the high-precision parts run in; "auto" picks this CPU's fast dtype."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; valid: {', '.join(PRECISIONS)}")
    if precision != "auto":
        return precision
    return "bf16" if fast_matmul_dtype() == torch.bfloat16 else "fp32"


def describe_precision(precision: str) -> str:
    """One line for the log: the resolved precision and the CPU facts behind it."""
    caps = cpu_capability()
    resolved = resolve_precision(precision)
    why = "native bf16 matmuls" if caps["native_bf16"] else "no native bf16 matmuls: bf16 would be ~100x slower"
    forced = caps["FP8PASS_CPU_GEMM_DTYPE"].strip().lower()
    if precision != "auto":
        how = "as asked"
    elif forced != "auto":
        how = f"forced by FP8PASS_CPU_GEMM_DTYPE={forced}"
    else:
        how = "chosen for this CPU"
    return f"high precision {resolved} ({how}; CPU {caps['cpu_capability']}, {why})"


def autocast(precision: str):
    """The autocast context of a resolved precision (fp32: none)."""
    if precision == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    if precision == "fp16":  # fp16 compute: pair it with TrainConfig.loss_scale
        return torch.autocast("cpu", dtype=torch.float16)
    if precision == "fp32":
        return contextlib.nullcontext()
    raise ValueError(f"autocast needs a resolved precision (bf16, fp32 or fp16), got {precision!r}")


def scaling_recipe(name: str):
    if name == "delayed":
        return DelayedScaling()
    if name == "current":
        return CurrentScaling()
    raise ValueError(f"unknown scaling {name!r}; valid: delayed, current")


def fp8_config(recipe: Recipe, scaling: str = "delayed", smooth_mode: str = "channel",
               compiler: str = "inductor", rules=(), eval_recipe=None, schedule=(), **options):
    """The backend ``Config`` for an fp8 recipe (a named recipe's own, with ``compiler``); ``rules``:
    ``Config.rules`` (``--precision-config``); ``eval_recipe``, ``schedule``: ``Config.eval_recipe``
    (``--eval-recipe``) and ``Config.schedule`` (the precision config's ``[[switch]]`` tables);
    ``options``: other Config fields (e.g. ``recompute_glu_output=True``)."""
    extra = dict(compiler=compiler, rules=tuple(rules), eval_recipe=eval_recipe, schedule=tuple(schedule), **options)
    if recipe.named:
        return Config.from_recipe(recipe.name, **extra)
    return Config(recipe=scaling_recipe(scaling), smooth_swiglu=smooth_mode if recipe.smooth else None,
                          **extra)


def prepare_model(model: torch.nn.Module, recipe: Recipe, *, scaling: str = "delayed",
                  smooth_mode: str = "channel", compile_bf16: bool = False, compiler: str = "inductor", rules=(),
                  eval_recipe=None, schedule=(), backend_options: dict | None = None):
    """Return the callable the loop trains through (``model`` itself, or its compiled wrapper).

    The fp8 recipes compile with ``fp8pass.backend(Config(...))`` (``backend_options``: more Config
    fields); the bf16 recipe runs eager unless ``compile_bf16`` (then plain Inductor, for a
    like-for-like speed comparison).
    """
    if backend_options and not recipe.fp8:
        raise ValueError(f"backend options {sorted(backend_options)} apply to the fp8 recipes; recipe "
                         f"{recipe.name!r} does not compile with the FP8 backend")
    if recipe.fp8:
        cfg = fp8_config(recipe, scaling, smooth_mode, compiler, rules, eval_recipe, schedule, **(backend_options or {}))
        return torch.compile(model, backend=backend(cfg))
    if compile_bf16:
        return torch.compile(model)
    return model


def param_groups(model: torch.nn.Module, weight_decay: float):
    """Weight decay on matrices (linears, embeddings), none on norm gains: the usual Llama split."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def check_moment_options(m_format: str, v_format: str, block_size: int | None, v_sqrt: bool, rounding: str,
                         stochastic_flush: bool) -> None:
    """Raise ValueError, naming the valid values, for FP8 moment options ``fp8pass.optim`` would reject."""
    for what, fmt in (("m_format", m_format), ("v_format", v_format)):
        if fmt not in fp8optim.MOMENT_FORMATS:
            raise ValueError(f"unknown {what} {fmt!r}; valid: {', '.join(fp8optim.MOMENT_FORMATS)}")
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1):
        raise ValueError(f"moment_block_size must be a positive int (elements per fp32 scale) or None (one scale "
                         f"per tensor), got {block_size!r}")
    for what, flag in (("v_sqrt", v_sqrt), ("moment_stochastic_flush", stochastic_flush)):
        if not isinstance(flag, bool):
            raise ValueError(f"{what} must be True or False, got {flag!r}")
    if rounding not in MOMENT_ROUNDINGS:
        raise ValueError(f"unknown moment_rounding {rounding!r}; valid: {', '.join(MOMENT_ROUNDINGS)}")


def build_optimizer(model: torch.nn.Module, recipe: Recipe, *, lr: float, weight_decay: float,
                    betas=(0.9, 0.95), eps: float = 1e-8, m_format: str = "e4m3", v_format: str = "e5m2",
                    block_size: int | None = 128, v_sqrt: bool = False, rounding: str = "nearest",
                    stochastic_flush: bool = False, bf16_stochastic_round: bool = False,
                    offload_state: bool = False):
    """AdamW over ``param_groups(model, weight_decay)``: ``fp8pass.optim.AdamW`` with the given moment
    storage for the -fp8adam recipes, ``torch.optim.AdamW`` (fp32 moments) otherwise.

    Args:
        model: the model to optimize.
        recipe: the run's recipe (``recipe.fp8_adam`` picks the FP8 optimizer).
        lr, weight_decay, betas, eps: AdamW's hyper-parameters.
        m_format, v_format: moment storage, "e4m3" | "e5m2" | "bf16" | "fp32".
        block_size: elements per fp32 moment scale; None = one scale per tensor.
        v_sqrt: store sqrt(v) instead of v (FP8 v_format only).
        rounding: "nearest" | "stochastic" for the FP8 moments.
        stochastic_flush: round values below the smallest subnormal stochastically to 0 or it.
        bf16_stochastic_round: bf16 parameters updated by stochastic rounding, no fp32 master
            (``fp8pass.optim.AdamW``'s option; the model must already be bf16). -fp8adam recipes only.
        offload_state: keep the optimizer state in host memory between steps (``fp8pass.optim.AdamW``'s
            option). -fp8adam recipes only.
    """
    check_moment_options(m_format, v_format, block_size, v_sqrt, rounding, stochastic_flush)
    groups = param_groups(model, weight_decay)
    if recipe.fp8_adam:
        return fp8optim.AdamW(groups, lr=lr, betas=betas, eps=eps, m_format=m_format, v_format=v_format,
                              block_size=block_size, v_sqrt=v_sqrt, rounding=rounding,
                              stochastic_flush=stochastic_flush, bf16_stochastic_round=bf16_stochastic_round,
                              offload_state=offload_state)
    if offload_state:
        raise ValueError(f"offload_state is an option of fp8pass.optim.AdamW: recipe {recipe.name!r} uses "
                         "torch.optim.AdamW; use an -fp8adam recipe")
    if bf16_stochastic_round:
        raise ValueError(f"bf16_stochastic_round is an option of fp8pass.optim.AdamW: recipe {recipe.name!r} uses "
                         "torch.optim.AdamW; use an -fp8adam recipe")
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)
