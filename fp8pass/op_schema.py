"""The static knobs of the runtime ops, declared once per op as a frozen dataclass.

``torch.library`` custom ops take tensors, scalars, strings and dtypes only, so the knobs are
flattened into the op's schema as its last arguments, in field order. Everything else is built from
the one declaration: the schema text (:func:`knob_op`), the values to pass (:meth:`Knobs.args`),
the unpacking inside the op, its fake and its ``setup_context`` (:meth:`Knobs.take`), and the
backward's ``None`` for every knob (:meth:`Knobs.no_grads`). Adding a knob is one new field.

No knob has a default in the schema (the dispatcher drops arguments equal to their defaults, which
would change the backward's input structure), so every call passes all of them.
"""

from __future__ import annotations

import functools
import re
import typing
from dataclasses import dataclass, fields

import torch

from .config import Config, CurrentScaling, DelayedScaling, NVFP4Scaling

__all__ = ["Knobs", "LinearKnobs", "GLUKnobs", "GroupedLinearKnobs", "GroupedGLUKnobs", "NVFP4Knobs", "NVFP4GradKnobs",
           "HCPUpdateKnobs", "NormKnobs", "knob_op",
           "smooth_knob", "SR_STREAM", "SR_SEED"]

# The stochastic-rounding stream of the op's weight (``fp8pass.runtime.sr``): the last tensor argument of
# ``fp8_linear``, ``fp8_linear_precast`` and ``swiglu_down`` (None: gradient casts draw from torch's
# generator); their backward ops take the seed drawn from it (None: the same).
SR_STREAM = "Tensor? sr_stream"
SR_SEED = "Tensor? sr_seed"

# Python annotation (as written in the dataclass) -> schema type
_SCHEMA_TYPES = {str: "str", int: "int", float: "float", bool: "bool", torch.dtype: "ScalarType",
                 typing.Optional[torch.dtype]: "ScalarType?"}


@dataclass(frozen=True)
class Knobs:
    """Base of an op's knob declaration: subclasses list the knobs as typed fields."""

    @classmethod
    def schema(cls) -> str:
        """The knobs as schema arguments, ``"str fwd_format, ..."``."""
        hints = typing.get_type_hints(cls)
        return ", ".join(f"{_SCHEMA_TYPES[hints[f.name]]} {f.name}" for f in fields(cls))

    @classmethod
    def count(cls) -> int:
        return len(fields(cls))

    @classmethod
    def of(cls, args: tuple, check=None) -> "Knobs":
        """``cls(*args)``, made once per distinct ``args``: a rewritten graph passes the same knobs on
        every call, so per call this is one dict lookup instead of building and validating a dataclass.

        Args:
            args: the op's knob values, in schema order.
            check: validation run on a new instance (raises on bad values); a tuple that fails it is
                not kept, so every call with it raises again.
        """
        key = (cls, args)
        try:
            k = _MADE.get(key)
        except TypeError:  # an unhashable value (a symbolic scalar): build it, uncached
            key, k = None, None
        if k is None:
            k = cls(*args)
            if check is not None:
                check(k)
            if key is not None and len(_MADE) < _MADE_MAX:
                _MADE[key] = k
        return k

    @classmethod
    def take(cls, args, check=None) -> "Knobs":
        """The knobs from an op's full argument list (they are its last ``count()`` arguments)."""
        return cls.of(tuple(args[len(args) - cls.count():]), check)

    @classmethod
    def no_grads(cls) -> tuple:
        """One ``None`` gradient per knob (the tail of the backward's return)."""
        return (None,) * cls.count()

    def args(self) -> tuple:
        """The values to pass to the op, in schema order."""
        return tuple(getattr(self, f.name) for f in fields(self))

    def replace(self, **changes) -> "Knobs":
        return type(self)(**{**self.kwargs(), **changes})

    def kwargs(self) -> dict:
        """The knobs by name, in schema order (a graph node's keyword arguments)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


# Knobs.of's instances by (class, values); bounded: graphs pass a handful of distinct tuples, and a
# caller sweeping values past the bound just builds instances again
_MADE: dict[tuple, "Knobs"] = {}
_MADE_MAX = 1024


@dataclass(frozen=True)
class LinearKnobs(Knobs):
    """Knobs of ``fp8_linear`` (and, after its per-call arguments, ``fp8_linear_backward``).

    Attributes:
        fwd_format, bwd_format: formats of the forward operands and of grad_output ("identity": no
            quantization, a testing hook).
        granularity, block: scale granularity ("tensor" | "row" | "block" | "mx") and tile edge.
        power_of_two: round scales down to powers of two.
        grad_rounding: "nearest" | "stochastic" for grad_output.
        margin, interval, algo: the DelayedScaling recipe's fields.
        out_dtype: dtype of the op's output and of its GEMMs' rounding: the dtype the replaced node
            produced (under autocast, the autocast dtype); None means the input's dtype.
        fast_accum: the forward GEMM accumulates fast (``_scaled_mm(use_fast_accum=True)`` on CUDA;
            ``Config.fast_accum``); backward GEMMs always accumulate precisely.
        backward: "fp8" (dgrad and wgrad GEMMs in FP8: ``dy`` cast to ``bwd_format``) or "high" (both
            in high precision: ``dy`` as it is, the saved forward operands dequantized; ``Rule(backward=)``).
    """

    fwd_format: str
    bwd_format: str
    granularity: str
    block: int
    power_of_two: bool
    grad_rounding: str
    margin: float
    interval: int
    algo: str
    out_dtype: typing.Optional[torch.dtype]
    fast_accum: bool
    backward: str = "fp8"

    @classmethod
    def from_recipe(cls, recipe: CurrentScaling | DelayedScaling, fwd_format: str, bwd_format: str,
                    grad_rounding: str, fast_accum: bool, backward: str = "fp8",
                    out_dtype: torch.dtype | None = None) -> "LinearKnobs":
        """The FP8 linear ops' knobs for a scaling recipe (the one recipe-to-knobs mapping of the FP8 ops:
        the compile backend's rewriters and ``fp8pass.ops`` both build their knobs here)."""
        delayed = isinstance(recipe, DelayedScaling)
        return LinearKnobs(
            fwd_format=fwd_format, bwd_format=bwd_format,
            granularity=recipe.granularity, block=int(getattr(recipe, "block", 128)),
            power_of_two=bool(recipe.power_of_two), grad_rounding=grad_rounding,
            margin=float(recipe.margin) if delayed else 0.0,
            interval=int(recipe.interval) if delayed else 1,
            algo=recipe.algo if delayed else "max",
            out_dtype=out_dtype, fast_accum=fast_accum, backward=backward)

    @classmethod
    def from_config(cls, cfg: Config, backward: str = "fp8", out_dtype: torch.dtype | None = None) -> "LinearKnobs":
        """:meth:`from_recipe` of a Config (its recipe, formats, gradient rounding and ``fast_accum``;
        ``backward``: the site's ``Rule.backward``)."""
        return LinearKnobs.from_recipe(cfg.recipe, cfg.fwd_format, cfg.bwd_format,
                                       "stochastic" if cfg.grad_stochastic_rounding else "nearest",
                                       cfg.fast_accum, backward, out_dtype)


def smooth_knob(smooth: str | None) -> str:
    """The GLU ops' ``smooth`` knob for a Smooth-SwiGLU mode as users spell it (``Config.smooth_swiglu``,
    ``fp8pass.ops.swiglu_mlp``): "channel", "token", or None for no smoothing, which the ops' string
    schema spells "none" (here only)."""
    if smooth is None:
        return "none"
    if smooth not in ("channel", "token"):
        raise ValueError(f"unknown smooth mode {smooth!r}; valid: 'channel', 'token', None (no smoothing)")
    return smooth


@dataclass(frozen=True)
class GLUKnobs(LinearKnobs):
    """Knobs of ``swiglu_down`` (and ``swiglu_down_backward``): the linear's plus the GLU's.

    Attributes:
        activation: "silu" | "gelu" | "gelu_tanh" | "relu".
        smooth: Smooth-SwiGLU mode, "channel" | "token" | "none".
        recast_weight: backward recasts ``W_down`` (``/ c``) with the forward's scale instead of keeping
            its FP8 codes from forward (per-tensor FP8 only; the same codes, bit for bit). Off where a
            weight may be rebuilt between forward and backward (FSDP2 re-gathers it).
        recompute_output: backward recomputes the down GEMM's operand ``A`` (the GLU output, smoothed)
            from the FP8 ``gate``/``up`` it keeps anyway and casts it with forward's scale, instead of
            keeping ``A``'s codes (per-tensor FP8 only; ``Config.recompute_glu_output``).
    """

    activation: str = "silu"
    smooth: str = "channel"
    recast_weight: bool = False
    recompute_output: bool = False

    @classmethod
    def from_linear(cls, k: LinearKnobs, activation: str, smooth: str | None, recast_weight: bool,
                    recompute_output: bool = False) -> "GLUKnobs":
        """The GLU's knobs over its linear's (``smooth`` as users spell it: None is off)."""
        return GLUKnobs(*k.args(), activation, smooth_knob(smooth), recast_weight, recompute_output)



@dataclass(frozen=True)
class GroupedLinearKnobs(Knobs):
    """Knobs of ``fp8_grouped_linear`` (and, after its per-call arguments, ``fp8_grouped_linear_backward``):
    :class:`LinearKnobs` without ``granularity``/``block`` (the grouped ops always scale per tensor per
    expert), with the same meanings (``fast_accum``: the forward grouped GEMM's)."""

    fwd_format: str
    bwd_format: str
    power_of_two: bool
    grad_rounding: str
    margin: float
    interval: int
    algo: str
    out_dtype: typing.Optional[torch.dtype]
    fast_accum: bool

    @classmethod
    def from_config(cls, cfg: Config, out_dtype: torch.dtype | None = None) -> "GroupedLinearKnobs":
        """:meth:`LinearKnobs.from_config` less the knobs the grouped ops do not take."""
        k = LinearKnobs.from_config(cfg, out_dtype=out_dtype)
        return GroupedLinearKnobs(**{f.name: getattr(k, f.name) for f in fields(GroupedLinearKnobs)})


@dataclass(frozen=True)
class GroupedGLUKnobs(GroupedLinearKnobs):
    """Knobs of ``fp8_grouped_swiglu_down`` (and its backward): the grouped linear's plus the GLU's
    ``activation`` and ``smooth``, as in :class:`GLUKnobs`."""

    activation: str
    smooth: str

    @classmethod
    def from_config(cls, cfg: Config, out_dtype: torch.dtype | None = None,
                    activation: str = "silu") -> "GroupedGLUKnobs":
        """The grouped linear's knobs of ``cfg`` plus the GLU's (``Config.smooth_swiglu``)."""
        k = GroupedLinearKnobs.from_config(cfg, out_dtype)
        return GroupedGLUKnobs(*k.args(), activation, smooth_knob(cfg.smooth_swiglu))


@dataclass(frozen=True)
class NVFP4GradKnobs(Knobs):
    """The knobs of ``nvfp4_linear_backward`` (the forward's, less those only the forward reads).

    Attributes:
        weight_2d, rht, rht_seed: ``NVFP4Scaling``'s fields.
        grad_sr: ``NVFP4Scaling.grad_stochastic_rounding``.
        hcp_second_order: ``HotChannelPatching.second_order`` (True without HCP).
    """

    weight_2d: bool
    rht: bool
    rht_seed: int
    grad_sr: bool
    hcp_second_order: bool


@dataclass(frozen=True)
class NVFP4Knobs(NVFP4GradKnobs):
    """The knobs of ``nvfp4_linear``: its backward's, then ``hcp_mode`` and ``hcp_backward``
    (``HotChannelPatching``'s ``mode`` and ``backward``; "split" and False without HCP)."""

    hcp_mode: str
    hcp_backward: bool

    @classmethod
    def from_recipe(cls, recipe: NVFP4Scaling) -> "NVFP4Knobs":
        hcp = recipe.hcp
        return NVFP4Knobs(recipe.weight_2d, recipe.rht, recipe.rht_seed, recipe.grad_stochastic_rounding,
                          True if hcp is None else hcp.second_order, "split" if hcp is None else hcp.mode,
                          False if hcp is None else hcp.backward)

    def grad(self) -> NVFP4GradKnobs:
        """The knobs its backward op takes."""
        return NVFP4GradKnobs(self.weight_2d, self.rht, self.rht_seed, self.grad_sr, self.hcp_second_order)


@dataclass(frozen=True)
class HCPUpdateKnobs(Knobs):
    """The knobs of ``hcp_update_``: ``HotChannelPatching``'s ``decay`` and ``update_interval``."""

    decay: float
    interval: int


@dataclass(frozen=True)
class NormKnobs(Knobs):
    """The knobs of ``rmsnorm`` (and ``rmsnorm_backward``): which RMSNorm form it computes, bit for bit.

    ``x_hat = x.float() * rsqrt(mean(x.float()^2, -1) + eps)``; then ``y = cast(x_hat, hat_dtype) * w``
    and ``y = y.to(out_dtype)``.

    Attributes:
        eps: the norm's epsilon.
        hat_dtype: the dtype ``x_hat`` is cast to before the weight multiplies it (Hugging Face's
            ``weight * hidden.to(input_dtype)``), or None: the fp32 ``x_hat`` (fp8pass's TinyLlama).
        out_dtype: the dtype of the final cast (``(x_hat * w).to(x.dtype)``), or None: none (the
            product's dtype).
        fwd_format: the format of the saved ``x_hat`` codes ("e4m3"; "identity": saved as fp32 values,
            a testing hook).
    """

    eps: float
    hat_dtype: typing.Optional[torch.dtype]
    out_dtype: typing.Optional[torch.dtype]
    fwd_format: str


def _mutable(tensors: str, mutates_args: tuple[str, ...]) -> str:
    """``tensors`` with each argument named in ``mutates_args`` marked as written in place
    (``Tensor(a0!) err``), the alias annotation ``torch.library`` checks ``mutates_args`` against."""
    for i, name in enumerate(mutates_args):
        tensors, found = re.subn(rf"\bTensor {name}\b", f"Tensor(a{i}!) {name}", tensors)
        if found != 1:
            raise ValueError(f"knob_op: mutates_args names {name!r}, which is not a 'Tensor {name}' argument "
                             f"of {tensors!r}")
    return tensors


def knob_op(name: str, tensors: str, knobs: type[Knobs], returns: str, mutates_args: tuple[str, ...] = (),
            ambient_autocast: bool = False):
    """``torch.library.custom_op`` decorator whose schema is ``(tensors, knobs) -> returns``.

    The decorated function takes the tensor arguments by name, then ``*knobs`` (positional).

    Args:
        mutates_args: the tensor arguments the op writes in place (their schema alias annotations
            are added here).
        ambient_autocast: run the op under the caller's autocast. By default it runs with autocast
            off: the op chooses its GEMM dtypes itself (``out_dtype``); an ambient autocast would
            otherwise recast the GEMMs inside it (to bf16 on CPUs where bf16 matmuls are ~100x slower).
    """
    schema = f"({_mutable(tensors, tuple(mutates_args))}, {knobs.schema()}) -> {returns}"

    def decorate(fn):
        @functools.wraps(fn)
        def without_autocast(*args):
            with torch._C._DisableAutocast():
                return fn(*args)

        return torch.library.custom_op(name, mutates_args=tuple(mutates_args),
                                       schema=schema)(fn if ambient_autocast else without_autocast)

    return decorate
