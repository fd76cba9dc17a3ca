"""Training recipes: what precision the model runs in and which optimizer holds its state.

| recipe               | linears / SwiGLU                  | optimizer moments        |
|----------------------|-----------------------------------|--------------------------|
| bf16                 | bf16 autocast (see precision)     | fp32 (torch AdamW)       |
| fp8                  | FP8 backend, plain SwiGLU         | fp32 (torch AdamW)       |
| fp8-smooth           | FP8 backend, Smooth-SwiGLU        | fp32 (torch AdamW)       |
| fp8-smooth-fp8adam   | FP8 backend, Smooth-SwiGLU        | FP8 (fp8pass.optim.AdamW)|
| bf16-fp8adam         | bf16 autocast                     | FP8 (fp8pass.optim.AdamW)|

``bf16-fp8adam`` isolates the optimizer: the moment-format ablation (experiments/moments.py) uses it.

Master weights stay fp32 in every recipe and everything the FP8 backend leaves in high precision
(embeddings, LM head, norms, attention scores) runs under bf16 autocast, so the recipes differ only
in what the table says.

Precision (``TrainConfig.precision``): "auto" (default) runs the high-precision parts in the dtype
this CPU's matmuls are fast in: bf16 where oneDNN has native bf16 (AVX512/AMX), fp32 on AVX2-only
CPUs, where a bf16 matmul is ~100x slower (:func:`fp8pass.runtime.kernels.cpu.fast_matmul_dtype`;
``FP8PASS_CPU_GEMM_DTYPE`` overrides it). The ``bf16`` recipe is then an fp32 baseline, and says so:
the resolved precision is printed and saved in the run's config.json and metrics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["RECIPES", "Recipe", "get_recipe", "build_optimizer", "prepare_model", "param_groups", "PRECISIONS",
           "resolve_precision", "describe_precision", "autocast"]

PRECISIONS = ("auto", "bf16", "fp32")


@dataclass(frozen=True)
class Recipe:
    name: str
    fp8: bool            # compile with the fp8 backend
    smooth: bool         # Smooth-SwiGLU (mode chosen by TrainConfig.smooth)
    fp8_adam: bool       # FP8 optimizer moments


RECIPES = {r.name: r for r in (
    Recipe("bf16", fp8=False, smooth=False, fp8_adam=False),
    Recipe("fp8", fp8=True, smooth=False, fp8_adam=False),
    Recipe("fp8-smooth", fp8=True, smooth=True, fp8_adam=False),
    Recipe("fp8-smooth-fp8adam", fp8=True, smooth=True, fp8_adam=True),
    Recipe("bf16-fp8adam", fp8=False, smooth=False, fp8_adam=True),
)}


def get_recipe(name: str) -> Recipe:
    try:
        return RECIPES[name]
    except KeyError:
        raise ValueError(f"unknown recipe {name!r}; valid: {', '.join(RECIPES)}") from None


def resolve_precision(precision: str) -> str:
    """"bf16" or "fp32", what the high-precision parts run in; "auto" picks this CPU's fast dtype."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; valid: {', '.join(PRECISIONS)}")
    if precision != "auto":
        return precision
    from ..runtime.kernels.cpu import fast_matmul_dtype
    return "bf16" if fast_matmul_dtype() == torch.bfloat16 else "fp32"


def describe_precision(precision: str) -> str:
    """One line for the log: the resolved precision and the CPU facts behind it."""
    from ..runtime.kernels.cpu import cpu_capability
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
    import contextlib
    if precision == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    if precision == "fp32":
        return contextlib.nullcontext()
    raise ValueError(f"autocast needs a resolved precision (bf16 or fp32), got {precision!r}")


def scaling_recipe(name: str):
    from ..config import CurrentScaling, DelayedScaling
    if name == "delayed":
        return DelayedScaling()
    if name == "current":
        return CurrentScaling()
    raise ValueError(f"unknown scaling {name!r}; valid: delayed, current")


def fp8_config(recipe: Recipe, scaling: str = "delayed", smooth_mode: str = "channel",
               compiler: str = "inductor"):
    """The backend ``Config`` for an fp8 recipe."""
    import fp8pass
    if not hasattr(fp8pass, "Config"):
        raise RuntimeError(f"recipe {recipe.name!r} needs fp8pass.Config and fp8pass.backend, which this "
                           "installation of fp8pass lacks; use --recipe bf16")
    return fp8pass.Config(recipe=scaling_recipe(scaling), smooth_swiglu=smooth_mode if recipe.smooth else None,
                          compiler=compiler)


def prepare_model(model: torch.nn.Module, recipe: Recipe, *, scaling: str = "delayed",
                  smooth_mode: str = "channel", compile_bf16: bool = False, compiler: str = "inductor"):
    """Return the callable the loop trains through (``model`` itself, or its compiled wrapper).

    The fp8 recipes compile with ``fp8pass.backend(Config(...))``; the bf16 recipe runs eager unless
    ``compile_bf16`` (then plain Inductor, for a like-for-like speed comparison).
    """
    if recipe.fp8:
        import fp8pass
        cfg = fp8_config(recipe, scaling, smooth_mode, compiler)
        return torch.compile(model, backend=fp8pass.backend(cfg))
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


def build_optimizer(model: torch.nn.Module, recipe: Recipe, *, lr: float, weight_decay: float,
                    betas=(0.9, 0.95), eps: float = 1e-8, m_format: str = "e4m3", v_format: str = "e5m2",
                    block_size: int = 128, rounding: str = "nearest"):
    groups = param_groups(model, weight_decay)
    if recipe.fp8_adam:
        try:
            from .. import optim as fp8optim
        except ImportError as e:
            raise RuntimeError(f"recipe {recipe.name!r} needs fp8pass.optim, which this installation lacks "
                               f"({e}); use --recipe fp8-smooth") from None
        return fp8optim.AdamW(groups, lr=lr, betas=betas, eps=eps, m_format=m_format, v_format=v_format,
                              block_size=block_size, rounding=rounding)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)
