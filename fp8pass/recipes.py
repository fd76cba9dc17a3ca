"""Named recipes: a whole FP8 training method picked by one name.

A named recipe fixes two things: the compile backend's :class:`~fp8pass.config.Config` (formats,
scaling, Smooth-SwiGLU) and the optimizer's moment storage (:class:`MomentOptions`, or None for fp32
moments). Pick one with ``fp8pass.Config.from_recipe("paper")`` (backend) or, for the whole run,
``python -m fp8pass train --recipe paper`` (backend and optimizer).

| name       | linears                                                   | Smooth-SwiGLU | Adam moments            | source |
|------------|-----------------------------------------------------------|---------------|-------------------------|--------|
| paper      | E4M3 fwd / E5M2 grads (SR), delayed per tensor            | per channel   | m E4M3, v E5M2 (v itself), per tensor | Fishman et al., arXiv 2409.12517 |
| reference  | E4M3 ±240 (Gaudi2) / E5M2 (SR), delayed, power-of-two scales | per token  | as paper                | the paper's reference code (Megatron-DeepSpeed fork) |
| delayed    | E4M3 / E5M2 (RNE), delayed, history 1024, max             | none          | fp32                    | Transformer Engine ``DelayedScaling`` defaults |
| blockwise  | E4M3 everywhere, current scaling, 1x128 act. / 128x128 weights | none     | fp32                    | DeepSeek-V3 (arXiv 2412.19437) |
| mxfp8      | E4M3 everywhere, 32-element blocks, E8M0 scales           | none          | fp32                    | OCP MX v1.0; NVIDIA's MXFP8 pretraining recipe |
| nvfp4      | NVFP4 (E2M1, 16-element E4M3 scales, RHT, grad SR); last ~15% of block linears BF16 | none | fp32          | NVIDIA, arXiv 2509.25149 |
| nvfp4-hcp  | nvfp4 + hot-channel patching, S-O2-B (concat, 2nd order, backward); last 4 blocks BF16 | none | fp32        | arXiv 2602.02047 |

Why ``Config.from_recipe(name)`` and not ``Config(recipe=name)``: ``Config.recipe`` holds the
scaling object (``DelayedScaling()``...), and a named recipe sets more than that field (formats,
Smooth-SwiGLU, stochastic rounding); a string there would make the field's type depend on how the
Config was built, and an explicit ``Config(recipe="paper", fwd_format="e4m3")`` could not tell an
explicit argument from a default. ``from_recipe(name, **overrides)`` applies overrides on top.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from . import config as _config
from .config import Config, CurrentScaling, DelayedScaling, HotChannelPatching, NVFP4Scaling

__all__ = ["NamedRecipe", "MomentOptions", "NAMED_RECIPES", "get_named_recipe"]


@dataclass(frozen=True)
class MomentOptions:
    """FP8 Adam moment storage (``fp8pass.optim.AdamW``'s arguments of the same names).

    Args:
        m_format, v_format: "e4m3" | "e5m2" | "bf16" | "fp32".
        v_sqrt: store sqrt(v) (True) or v itself (False, the paper's form).
        block_size: elements per fp32 scale; None = one scale per tensor (the paper's granularity).
        rounding: "nearest" | "stochastic".
        stochastic_flush: round values below the smallest subnormal stochastically to 0 or it.
    """

    m_format: str = "e4m3"
    v_format: str = "e5m2"
    v_sqrt: bool = False
    block_size: int | None = None
    rounding: str = "nearest"
    stochastic_flush: bool = False


@dataclass(frozen=True)
class NamedRecipe:
    """One named recipe.

    Args:
        name: what the user types.
        source: where its choices come from.
        build: makes the backend ``Config`` (a function, so a recipe whose numerics this build lacks
            fails when it is chosen, with its reason, not at import).
        moments: FP8 moment storage, or None for fp32 moments (``torch.optim.AdamW``).
    """

    name: str
    source: str
    build: Callable[[], Config]
    moments: MomentOptions | None

    def config(self, **overrides) -> Config:
        """The backend Config, with ``overrides`` (any Config field, e.g. ``compiler="aot_eager"``)."""
        return replace(self.build(), **overrides)


def _mx_config() -> Config:
    return Config(recipe=CurrentScaling(granularity="mx"), smooth_swiglu=None, fwd_format="e4m3",
                  bwd_format="e4m3", grad_stochastic_rounding=False)


_PAPER_MOMENTS = MomentOptions(m_format="e4m3", v_format="e5m2", v_sqrt=False, block_size=None)

NAMED_RECIPES: dict[str, NamedRecipe] = {r.name: r for r in (
    NamedRecipe("paper", "Fishman et al., Scaling FP8 training to trillion-token LLMs (arXiv 2409.12517)",
                lambda: Config(recipe=DelayedScaling(), smooth_swiglu="channel", fwd_format="e4m3",
                               bwd_format="e5m2", grad_stochastic_rounding=True),
                _PAPER_MOMENTS),
    NamedRecipe("reference", "the paper's reference implementation (Megatron-DeepSpeed fork for Gaudi2)",
                lambda: Config(recipe=DelayedScaling(power_of_two=True), smooth_swiglu="token",
                               fwd_format="e4m3_gaudi", bwd_format="e5m2", grad_stochastic_rounding=True),
                _PAPER_MOMENTS),
    NamedRecipe("delayed", "NVIDIA Transformer Engine DelayedScaling defaults (HYBRID formats, "
                "amax_history_len=1024, amax_compute_algo='max', margin 0)",
                lambda: Config(recipe=DelayedScaling(history_len=1024, algo="max"), smooth_swiglu=None,
                               fwd_format="e4m3", bwd_format="e5m2", grad_stochastic_rounding=False),
                None),
    NamedRecipe("blockwise", "DeepSeek-V3 (arXiv 2412.19437): 1x128 activation and 128x128 weight tiles, "
                "current scaling, E4M3 for all tensors",
                lambda: Config(recipe=CurrentScaling(granularity="block", block=128), smooth_swiglu=None,
                               fwd_format="e4m3", bwd_format="e4m3", grad_stochastic_rounding=False),
                None),
    NamedRecipe("mxfp8", "OCP Microscaling Formats (MX) v1.0: 32-element blocks, E8M0 scales, E4M3 elements "
                "for all tensors as in NVIDIA's MXFP8 pretraining recipe", _mx_config, None),
    NamedRecipe("nvfp4", "NVIDIA, Pretraining LLMs with NVFP4 (arXiv 2509.25149)",
                # NVIDIA keeps about the last 15% of the blocks' linears in BF16 and quantizes the rest,
                # attention projections included
                lambda: Config(recipe=NVFP4Scaling(keep_last_blocks=None, keep_last_fraction=0.15,
                                                   protect_post_qk=False), smooth_swiglu=None), None),
    NamedRecipe("nvfp4-hcp", "nvfp4 plus hot-channel patching in the S-O2-B form (arXiv 2602.02047)",
                # HotChannelPatching.backward (patching dgrad and wgrad too) is on by default
                lambda: Config(recipe=NVFP4Scaling(hcp=HotChannelPatching(mode="concat", second_order=True)),
                               smooth_swiglu=None), None),
)}


def get_named_recipe(name: str) -> NamedRecipe:
    """The named recipe ``name``; ValueError naming the valid ones otherwise."""
    try:
        return NAMED_RECIPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown named recipe {name!r}; valid: {', '.join(NAMED_RECIPES)}") from None


_config.NAMED_RECIPES.update(NAMED_RECIPES)  # Config.from_recipe reads this table (config imports nothing)
