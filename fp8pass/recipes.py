"""The recipe registry: every recipe name fp8pass knows, the backend's and the trainer's, in one table.

``RECIPES`` maps a name to a :class:`Recipe`; each is registered where it is defined
(:func:`register_recipe`), and nothing else fills the table. Names resolve here for
``Config.from_recipe(name)``, ``Rule(pattern, name)``, ``Config.eval_recipe`` and the trainer's
``--recipe``; an unknown name is a ValueError listing the known ones.

Two kinds of recipe share the table. A **named recipe** (``recipe.named``) fixes the backend's Config
fields (``recipe.fields()``) and, for the whole run, the optimizer's moment storage; the trainer's
recipes (``bf16``, ``fp8``, ``fp8-smooth``, ``fp8-smooth-fp8adam``, ``bf16-fp8adam``) say only whether the
linears are FP8, whether Smooth-SwiGLU is on and whether the moments are FP8, and leave the scaling
and Smooth-SwiGLU mode to ``TrainConfig`` (``fp8pass.train.recipes`` builds their Config and optimizer).

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

| trainer recipe      | linears / SwiGLU                  | optimizer moments        |
|---------------------|-----------------------------------|--------------------------|
| bf16                | bf16 autocast                     | fp32 (torch AdamW)       |
| fp8                 | FP8 backend, plain SwiGLU         | fp32 (torch AdamW)       |
| fp8-smooth          | FP8 backend, Smooth-SwiGLU        | fp32 (torch AdamW)       |
| fp8-smooth-fp8adam  | FP8 backend, Smooth-SwiGLU        | FP8, 128-element blocks  |
| bf16-fp8adam        | bf16 autocast                     | FP8, 128-element blocks  |

This module sits below ``config.py`` (which looks names up here): a named recipe's ``fields`` are the
keyword arguments of ``Config``, not a Config.

Why ``Config.from_recipe(name)`` and not ``Config(recipe=name)``: ``Config.recipe`` holds the
scaling object (``DelayedScaling()``...), and a named recipe sets more than that field (formats,
Smooth-SwiGLU, stochastic rounding); a string there would make the field's type depend on how the
Config was built, and an explicit ``Config(recipe="paper", fwd_format="e4m3")`` could not tell an
explicit argument from a default. ``from_recipe(name, **overrides)`` applies overrides on top.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable, Iterator

from .scaling_recipes import CurrentScaling, DelayedScaling, HotChannelPatching, NVFP4Scaling

__all__ = ["Recipe", "MomentOptions", "RECIPES", "NAMED_RECIPES", "register_recipe", "get_recipe", "get_named_recipe",
           "named_recipe_names"]


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
class Recipe:
    """One recipe of the registry.

    Args:
        name: what the user types (``--recipe``, ``Config.from_recipe``, ``Rule(pattern, name)``).
        source: where its choices come from (a named recipe) or what it is for (a trainer recipe).
        fp8: the linears go through the fp8 backend.
        smooth: Smooth-SwiGLU, in the mode ``TrainConfig.smooth`` picks (trainer recipes; a named
            recipe's mode is in its ``fields``).
        moments: FP8 moment storage, or None for fp32 moments (``torch.optim.AdamW``).
        fields: makes the backend ``Config``'s keyword arguments (a named recipe; a function, so a
            recipe whose numerics this build lacks fails when it is chosen, with its reason, not at
            import); None for a trainer recipe, whose Config ``TrainConfig`` decides.
    """

    name: str
    source: str
    fp8: bool
    smooth: bool = False
    moments: MomentOptions | None = None
    fields: Callable[[], dict] | None = None

    @property
    def named(self) -> bool:
        """Whether the recipe fixes the backend Config (``Config.from_recipe`` and ``Rule`` take it)."""
        return self.fields is not None

    @property
    def fp8_adam(self) -> bool:
        """Whether the optimizer keeps FP8 moments (``fp8pass.optim.AdamW``)."""
        return self.moments is not None


RECIPES: dict[str, Recipe] = {}


def register_recipe(recipe: Recipe) -> Recipe:
    """Add ``recipe`` to the registry under its name (a name is registered once); returns it."""
    if not isinstance(recipe, Recipe):
        raise TypeError(f"register_recipe takes an fp8pass.recipes.Recipe, got {type(recipe).__name__}")
    if not isinstance(recipe.name, str) or not recipe.name or recipe.name == "high":
        raise ValueError(f"a recipe's name must be a non-empty string other than 'high' (Rule's keep-high-precision "
                         f"recipe), got {recipe.name!r}")
    if recipe.name in RECIPES:
        raise ValueError(f"recipe {recipe.name!r} is registered already; pick another name")
    if recipe.named and not recipe.fp8:
        raise ValueError(f"recipe {recipe.name!r} fixes a backend Config (fields), so it must be fp8=True")
    RECIPES[recipe.name] = recipe
    return recipe


def get_recipe(name: str) -> Recipe:
    """The recipe ``name`` (either kind); ValueError naming the valid ones otherwise."""
    try:
        return RECIPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown recipe {name!r}; valid: {', '.join(RECIPES)}") from None


def named_recipe_names() -> tuple[str, ...]:
    """The names of the recipes that fix a backend Config, in registration order."""
    return tuple(n for n, r in RECIPES.items() if r.named)


def get_named_recipe(name: str) -> Recipe:
    """The named recipe ``name`` (one that fixes the backend Config); ValueError naming the valid ones otherwise."""
    recipe = RECIPES.get(name) if isinstance(name, str) else None
    if recipe is not None and recipe.named:
        return recipe
    why = (f"{name!r} is a recipe of the trainer (fp8pass train --recipe), whose Config TrainConfig's scaling and "
           f"smooth decide" if recipe is not None else f"unknown named recipe {name!r}")
    raise ValueError(f"{why}; valid: {', '.join(named_recipe_names())}")


class _NamedRecipes(Mapping):
    """The named recipes of the registry, by name: a live view of ``RECIPES``, not a second table."""

    def __getitem__(self, name: str) -> Recipe:
        recipe = RECIPES[name]
        if not recipe.named:
            raise KeyError(name)
        return recipe

    def __iter__(self) -> Iterator[str]:
        return iter(named_recipe_names())

    def __len__(self) -> int:
        return len(named_recipe_names())


NAMED_RECIPES: Mapping[str, Recipe] = _NamedRecipes()

# FP8 moments with one fp32 scale per 128 elements: the trainer's -fp8adam recipes (TrainConfig's defaults)
BLOCK_MOMENTS = MomentOptions(m_format="e4m3", v_format="e5m2", v_sqrt=False, block_size=128)
# the paper's moments: m E4M3, v E5M2 (v itself), one scale per tensor
PAPER_MOMENTS = MomentOptions(m_format="e4m3", v_format="e5m2", v_sqrt=False, block_size=None)

# the trainer's recipes: the scaling and Smooth-SwiGLU mode come from TrainConfig
register_recipe(Recipe("bf16", "the high-precision baseline: bf16 autocast, torch AdamW", fp8=False))
register_recipe(Recipe("fp8", "FP8 linears, plain SwiGLU, torch AdamW", fp8=True))
register_recipe(Recipe("fp8-smooth", "FP8 linears with Smooth-SwiGLU, torch AdamW", fp8=True, smooth=True))
register_recipe(Recipe("fp8-smooth-fp8adam", "FP8 linears with Smooth-SwiGLU, FP8 Adam moments", fp8=True, smooth=True,
                       moments=BLOCK_MOMENTS))
register_recipe(Recipe("bf16-fp8adam", "bf16 linears, FP8 Adam moments: the optimizer alone (experiments/moments.py)",
                       fp8=False, moments=BLOCK_MOMENTS))


def _mx_fields() -> dict:
    return dict(recipe=CurrentScaling(granularity="mx"), smooth_swiglu=None, fwd_format="e4m3", bwd_format="e4m3",
                grad_stochastic_rounding=False)


# the named recipes: each fixes the backend Config
register_recipe(Recipe(
    "paper", "Fishman et al., Scaling FP8 training to trillion-token LLMs (arXiv 2409.12517)", fp8=True,
    moments=PAPER_MOMENTS,
    fields=lambda: dict(recipe=DelayedScaling(), smooth_swiglu="channel", fwd_format="e4m3", bwd_format="e5m2",
                        grad_stochastic_rounding=True)))
register_recipe(Recipe(
    "reference", "the paper's reference implementation (Megatron-DeepSpeed fork for Gaudi2)", fp8=True,
    moments=PAPER_MOMENTS,
    fields=lambda: dict(recipe=DelayedScaling(power_of_two=True), smooth_swiglu="token", fwd_format="e4m3_gaudi",
                        bwd_format="e5m2", grad_stochastic_rounding=True)))
register_recipe(Recipe(
    "delayed", "NVIDIA Transformer Engine DelayedScaling defaults (HYBRID formats, amax_history_len=1024, "
    "amax_compute_algo='max', margin 0)", fp8=True,
    fields=lambda: dict(recipe=DelayedScaling(history_len=1024, algo="max"), smooth_swiglu=None, fwd_format="e4m3",
                        bwd_format="e5m2", grad_stochastic_rounding=False)))
register_recipe(Recipe(
    "blockwise", "DeepSeek-V3 (arXiv 2412.19437): 1x128 activation and 128x128 weight tiles, current scaling, "
    "E4M3 for all tensors", fp8=True,
    fields=lambda: dict(recipe=CurrentScaling(granularity="block", block=128), smooth_swiglu=None, fwd_format="e4m3",
                        bwd_format="e4m3", grad_stochastic_rounding=False)))
register_recipe(Recipe(
    "mxfp8", "OCP Microscaling Formats (MX) v1.0: 32-element blocks, E8M0 scales, E4M3 elements for all tensors as "
    "in NVIDIA's MXFP8 pretraining recipe", fp8=True, fields=_mx_fields))
register_recipe(Recipe(
    "nvfp4", "NVIDIA, Pretraining LLMs with NVFP4 (arXiv 2509.25149)", fp8=True,
    # NVIDIA keeps about the last 15% of the blocks' linears in BF16 and quantizes the rest, attention
    # projections included
    fields=lambda: dict(recipe=NVFP4Scaling(keep_last_blocks=None, keep_last_fraction=0.15, protect_post_qk=False),
                        smooth_swiglu=None)))
register_recipe(Recipe(
    "nvfp4-hcp", "nvfp4 plus hot-channel patching in the S-O2-B form (arXiv 2602.02047)", fp8=True,
    # HotChannelPatching.backward (patching dgrad and wgrad too) is on by default
    fields=lambda: dict(recipe=NVFP4Scaling(hcp=HotChannelPatching(mode="concat", second_order=True)),
                        smooth_swiglu=None)))
