"""What the compile backend does: :class:`Config`, its per-module :class:`Rule`, :class:`Switch` and :class:`DriftCheck`.

The scaling objects a Config holds (``DelayedScaling``, ``CurrentScaling``, ``NVFP4Scaling``,
``HotChannelPatching``) are in ``scaling_recipes.py`` and the named recipes (``Config.from_recipe``,
``Rule(pattern, "paper")``) in ``recipes.py``, both below this module; it re-exports the scaling
objects, so ``fp8pass.config`` stays the one place users import configuration from.
"""

from __future__ import annotations

import fnmatch
import sys
from dataclasses import dataclass, replace

from .numerics.formats import get_format
from .recipes import get_named_recipe, named_recipe_names
from .scaling_recipes import (
    ALGOS,
    GRANULARITIES,
    HCP_MODES,
    CurrentScaling,
    DelayedScaling,
    HotChannelPatching,
    NVFP4Scaling,
    _check_bool,
    _check_choice,
    _check_int,
    _check_number,
)

__all__ = ["CurrentScaling", "DelayedScaling", "NVFP4Scaling", "HotChannelPatching", "Config", "Rule", "Switch",
           "DriftCheck", "GRANULARITIES", "ALGOS", "HCP_MODES", "BACKWARDS", "ON_DRIFT"]

BACKWARDS = ("fp8", "high")  # Rule.backward: dgrad and wgrad GEMMs in FP8, or in high precision
ON_DRIFT = ("warn", "fallback")  # DriftCheck.on_drift


SMOOTH_SWIGLU = ("channel", "token", None)
COMPILERS = ("inductor", "aot_eager", "eager")
ON_GRAPH_BREAK = ("warn", "error", "ignore")
ON_FALLBACK = ("warn", "error")  # Config.on_fallback (fp8pass/precision_audit.py)
AMAX_REDUCTIONS = ("auto", "off")  # or a torch.distributed.ProcessGroup
DEFAULT_KEEP_HIGH_PRECISION = ("lm_head", "output", "*embed*", "*wte*", "*wpe*")

HIGH = "high"  # Rule.recipe that keeps the linears it matches in high precision
# the Config fields a recipe object (a Config, or a named recipe's) carries into the linears its rule matches
RECIPE_FIELDS = ("recipe", "smooth_swiglu", "fwd_format", "bwd_format", "grad_stochastic_rounding", "fast_accum")


@dataclass(frozen=True)
class Rule:
    """One per-module precision rule of ``Config.rules`` (docs/precision.md).

    Args:
        pattern: fnmatch glob, matched like ``Config.keep_high_precision``: against the linear's
            module FQN (``model.layers.3.self_attn.o_proj``), its weight's FQN (``...o_proj.weight``)
            and the FQN of the module that calls it.
        recipe: what the matched linears run in: ``"high"`` (kept in the model's dtype); a named
            recipe (``"paper"``, ``"reference"``, ``"delayed"``, ``"blockwise"``, ``"mxfp8"``,
            ``"nvfp4"``, ``"nvfp4-hcp"``: its scaling, formats, Smooth-SwiGLU mode and stochastic
            rounding); a :class:`Config` (its ``recipe``, ``smooth_swiglu``, ``fwd_format``,
            ``bwd_format``, ``grad_stochastic_rounding`` and ``fast_accum``); or a scaling object
            (``DelayedScaling(...)``, ``CurrentScaling(granularity=...)``, ``NVFP4Scaling(...)``: only
            the scaling; formats and the rest from the enclosing Config).
        backward: "fp8" (default) or "high": the forward runs in the rule's FP8 recipe and the dgrad
            and wgrad GEMMs in high precision (the saved operands dequantized, ``dy`` not cast).
            FP8 recipes only (the NVFP4 op has no such backward; a rule asking for it is an error),
            and MoE expert stacks on grouped GEMMs stay in high precision under it (explain says so).
        reason: why the rule is there, printed by explain after the rule (an advisor's measurement,
            e.g. ``fp8pass.monitor.sharp_attention``'s); no effect on what runs.
    """

    pattern: str
    recipe: object
    backward: str = "fp8"
    reason: str = ""

    def __post_init__(self):
        if not isinstance(self.pattern, str) or not self.pattern:
            raise ValueError(f"Rule.pattern must be a non-empty FQN glob string, got {self.pattern!r}")
        r = self.recipe
        if isinstance(r, str):
            if r != HIGH and r not in named_recipe_names():
                raise ValueError(f"Rule({self.pattern!r}): unknown recipe {r!r}; valid: {HIGH!r} or a named recipe "
                                 f"({', '.join(named_recipe_names())}), a Config or a scaling object")
        elif isinstance(r, Config):
            if r.rules:
                raise ValueError(f"Rule({self.pattern!r}): the recipe Config has rules of its own; a rule's Config "
                                 f"gives one recipe (its rules would never be read)")
        elif not isinstance(r, (CurrentScaling, DelayedScaling, NVFP4Scaling)):
            raise TypeError(f"Rule({self.pattern!r}): recipe must be {HIGH!r}, a named recipe name, an fp8pass.Config "
                            f"or DelayedScaling/CurrentScaling/NVFP4Scaling, got {type(r).__name__}")
        _check_choice(f"Rule({self.pattern!r}).backward", self.backward, BACKWARDS)
        if not isinstance(self.reason, str):
            raise ValueError(f"Rule({self.pattern!r}).reason must be a string, got {self.reason!r}")
        if self.backward == "high" and isinstance(self.scaling, NVFP4Scaling):
            raise ValueError(f"Rule({self.pattern!r}): backward='high' is for FP8 recipes; the NVFP4 linear has no "
                             f"high-precision backward (use an FP8 recipe for these linears, or backward='fp8')")

    @property
    def scaling(self):
        """The scaling object the rule's linears use (None for ``"high"``)."""
        r = self.recipe
        if r == HIGH:
            return None
        if isinstance(r, str):
            return _named_config(r).recipe
        return r.recipe if isinstance(r, Config) else r

    def site_config(self, cfg: "Config") -> "Config":
        """``cfg`` with this rule's recipe fields: the Config the matched linears are rewritten with."""
        r = self.recipe
        if isinstance(r, str):
            r = _named_config(r)
        if isinstance(r, Config):  # a named recipe leaves fast_accum (a speed knob) to the enclosing Config
            named = r is not self.recipe
            return replace(cfg, rules=(), **{f: getattr(r, f) for f in RECIPE_FIELDS if not (named and f == "fast_accum")})
        return replace(cfg, rules=(), recipe=r)

    def describe(self) -> str:
        """``'*.o_proj' -> delayed`` (with ``, backward high``): how explain names the rule."""
        r = self.recipe
        what = r if isinstance(r, str) else (
            f"Config({type(r.recipe).__name__}, {r.fwd_format}/{r.bwd_format})" if isinstance(r, Config) else repr(r))
        return (f"{self.pattern!r} -> {what}" + (", backward high" if self.backward == "high" else "")
                + (f" [{self.reason}]" if self.reason else ""))


@dataclass(frozen=True)
class DriftCheck:
    """The online high-precision shadow check of ``Config.drift_check`` (docs/precision.md, Drift check).

    Every ``every`` optimizer steps one micro-batch is replayed through the same weights in high
    precision (the model's own eager code, no FP8 op, no state change) and compared with the FP8 step
    of the same micro-batch: the relative loss difference and, per linear weight, the cosine between
    the FP8 gradient and the high-precision one. :class:`fp8pass.monitor.DriftMonitor` runs it (the
    trainer: ``--drift-check N``); the backend itself sees graphs, not steps, and runs nothing.

    Args:
        every: check every this many optimizer steps (steps ``every``, ``2 * every``, ...).
        on_drift: what a check past a threshold does: "warn" (a RuntimeWarning naming the worst layers,
            and the metrics record) or "fallback" (the same, then those layers switch precision for the
            rest of the run through ``fp8pass.switch_precision``: a GLU MLP that ran without
            Smooth-SwiGLU gets the per-channel form, any other linear high precision).
        max_loss_diff: threshold on ``|loss_fp8 - loss_high| / loss_high`` of the micro-batch.
        min_grad_cosine: threshold on each FP8 linear weight's gradient cosine (FP8 vs high precision).
        max_local_error: threshold on each FP8 linear's local error, what its FP8 input cast changes in its
            output (``||(Q(x) - x) W^T|| / ||x W^T||``, measured in the replay; clean runs: 2-3%). A drift is
            blamed on the linears past it; when none is, on those below ``min_grad_cosine``.
        confirm: a check past a threshold is repeated on the next step, and only a drift seen twice in a
            row warns or falls back (one FP8 step can stray alone: a clean run's measured once to a
            cosine of 0.48, docs/results/drift.md); False acts on the first.
        top_k: layers named in the warning and, when only the loss crossed its threshold, the lowest-
            cosine layers the fallback switches.
        blame_pending: a confirming check blames the union of its own layers past ``max_local_error`` and
            those of the check it confirms (a GLU's local error can dip under the threshold on one batch
            and pass it on the next; docs/results/drift.md). False: the confirming check's alone.
        cosine_blame: whom a drift with no layer past ``max_local_error`` blames among the layers below
            ``min_grad_cosine`` (a gradient error spreads to every layer below its origin, so after an
            outlier most layers are low): "glu_first" (default) the GLU MLPs among them that still run
            without Smooth-SwiGLU (their switch keeps them in FP8), else the ``top_k`` lowest; "lowest" the
            ``top_k`` lowest; "all" every one of them.
        act_at_once: a check whose worst local error exceeds this many times ``max_local_error`` acts
            without waiting for confirmation (clean runs: local errors <= 3%, so the default 3.0 means >=
            30%); 0: always wait when ``confirm``. A drift after a fallback is a new drift: it is confirmed
            (or acts at once) on its own.
        reset_moments: when the fallback switches layers, the optimizer state (Adam's moments, which hold
            the FP8 steps' gradients) of their weights is dropped, so they restart as at step 0. Needs the
            optimizer (``DriftMonitor(..., optimizer=opt)``; the trainer passes it). Default False
            (docs/results/drift.md).
    """

    every: int = 100
    on_drift: str = "warn"
    max_loss_diff: float = 0.01
    min_grad_cosine: float = 0.5
    max_local_error: float = 0.1
    confirm: bool = True
    top_k: int = 3
    blame_pending: bool = True
    cosine_blame: str = "glu_first"
    act_at_once: float = 3.0
    reset_moments: bool = False

    def __post_init__(self):
        _check_int("DriftCheck.every", self.every, 1, " (optimizer steps between checks)")
        _check_choice("DriftCheck.on_drift", self.on_drift, ON_DRIFT)
        _check_number("DriftCheck.max_loss_diff", self.max_loss_diff, 0, 1e9,
                      meaning=" (a relative loss difference: 0.02 is 2%)")
        _check_number("DriftCheck.min_grad_cosine", self.min_grad_cosine, -1, 1)
        _check_number("DriftCheck.max_local_error", self.max_local_error, 0, 1e9)
        _check_bool("DriftCheck.confirm", self.confirm)
        _check_int("DriftCheck.top_k", self.top_k, 1, " (layers named per check)")
        _check_bool("DriftCheck.blame_pending", self.blame_pending)
        _check_choice("DriftCheck.cosine_blame", self.cosine_blame, ("glu_first", "lowest", "all"))
        _check_number("DriftCheck.act_at_once", self.act_at_once, 0, 1e9,
                      meaning=" (a multiple of max_local_error; 0: always wait for confirmation)")
        _check_bool("DriftCheck.reset_moments", self.reset_moments)


@dataclass(frozen=True)
class Switch:
    """One scheduled precision switch of ``Config.schedule`` (docs/precision.md, Scheduled switches).

    At optimizer step ``at_step`` (0-based: the switch applies from that step's forward on), or at
    ``at_fraction`` of the run's steps (``round(at_fraction * steps)``; 0.9: the last 10%), the rules
    take precedence over the earlier switches and ``Config.rules`` (``fp8pass.switch_precision``).
    Give exactly one of ``at_step`` and ``at_fraction``. ``fp8pass.apply_schedule(model, step, steps)``
    (the trainer calls it before every step) makes the switches that are due.

    Args:
        rules: a non-empty sequence of :class:`Rule`, e.g. ``[Rule("*", "high")]``.
        at_step: the step (an int >= 0).
        at_fraction: the share of the run's steps before the switch (a number in [0, 1]).
        reason: kept in the switch's record (metrics, checkpoints).
    """

    rules: tuple[Rule, ...]
    at_step: int | None = None
    at_fraction: float | None = None
    reason: str = ""

    def __post_init__(self):
        rules = self.rules
        if isinstance(rules, Rule) or not isinstance(rules, (tuple, list)) or not rules:
            raise TypeError(f"Switch.rules must be a non-empty list of fp8pass.Rule, got {rules!r}")
        for i, r in enumerate(rules):
            if not isinstance(r, Rule):
                raise TypeError(f"Switch.rules[{i}] must be an fp8pass.Rule(pattern, recipe, backward=...), got {r!r}")
        object.__setattr__(self, "rules", tuple(rules))
        if (self.at_step is None) == (self.at_fraction is None):
            raise ValueError(f"Switch takes exactly one of at_step (a step) and at_fraction (a share of the run's "
                             f"steps), got at_step={self.at_step!r}, at_fraction={self.at_fraction!r}")
        if self.at_step is not None:
            _check_int("Switch.at_step", self.at_step, 0, " (the 0-based step the switch applies from)")
        else:
            _check_number("Switch.at_fraction", self.at_fraction, 0, 1, meaning=" (a share of the run's steps)")
        if not isinstance(self.reason, str):
            raise TypeError(f"Switch.reason must be a string, got {self.reason!r}")

    def step(self, total_steps: int | None) -> int:
        """The 0-based step the switch applies from, in a run of ``total_steps`` steps."""
        if self.at_step is not None:
            return self.at_step
        if total_steps is None:
            raise ValueError(f"Switch(at_fraction={self.at_fraction}) needs the run's number of steps "
                             f"(fp8pass.apply_schedule(model, step, total_steps=...))")
        return int(round(self.at_fraction * total_steps))


def _check_eval_recipe(recipe) -> None:
    """``Config.eval_recipe``: a recipe as a Rule takes it, keeping no state that evaluation would change."""
    try:
        rule = Rule("*", recipe)
    except (ValueError, TypeError) as e:
        raise type(e)(f"Config.eval_recipe: {e}".replace("Rule('*'): ", "")) from None
    scaling = rule.scaling
    if isinstance(scaling, DelayedScaling) or (isinstance(scaling, NVFP4Scaling) and scaling.hcp is not None):
        raise ValueError(f"Config.eval_recipe={recipe!r} keeps state (delayed-scaling amax histories / hot-channel "
                         f"statistics) that evaluation batches would change; use 'high', a current-scaling recipe "
                         f"('blockwise', 'mxfp8', CurrentScaling(...), NVFP4Scaling()) or None (evaluate in the "
                         f"training recipe)")


@dataclass(frozen=True)
class Config:
    """What the ``fp8`` torch.compile backend does to a model (``fp8pass.backend(cfg)``).

    Args:
        recipe: scaling of the FP8 linears: ``DelayedScaling()`` (default, amax histories kept per
            weight and role across steps), ``CurrentScaling()`` or ``NVFP4Scaling()`` (4-bit linears,
            see docs/nvfp4.md; ``fwd_format``/``bwd_format`` then apply to its FP8-protected linears).
        smooth_swiglu: Smooth-SwiGLU form for every matched GLU: "channel" (the paper: one scale per
            channel of the GLU output, folded into the down-projection weight), "token" (the
            authors' reference code: one scale per token) or None (plain FP8 down projection).
            "token" protects less: its scale comes from the linear branch, which an aligned
            large-norm channel dominates on every token (docs/results/instability.md). Not applied
            under NVFP4 or MX granularity: their GLU projections are three plain linears.
        keep_high_precision: fnmatch globs; a linear whose weight FQN, or the FQN of the module that
            calls it, matches any of them stays in the model's dtype. The default keeps the LM head
            (HF ``lm_head``, torchtitan ``output``) and embeddings, as the paper does.
        min_dim: linears with in- or out-features below this stay high precision (the FP8 casts cost
            more than they save on tiny GEMMs).
        dim_multiple: FP8 GEMMs need both feature dims divisible by this (16 for ``_scaled_mm``);
            other linears stay high precision. 1 disables the check.
        grad_stochastic_rounding: round gradients (E5M2) stochastically instead of to nearest even.
        sr_seed: seed of the model's stochastic-rounding streams (an int in [0, 2**63)): each FP8 or NVFP4
            weight whose gradient is cast stochastically (any granularity; MoE expert stacks: one per
            stack) draws its rounding bits from a stream of its own, kept
            in the scaling state (``model.state_dict()``, checkpoints), keyed by this seed and the order
            in which the model's graphs first use the weight; a model with the same seed and config
            rounds the same way whatever else the process trains (docs/backend.md, Stochastic
            rounding streams). None (default): the seed is drawn from torch's global generator once, when
            the backend first needs one (after ``torch.manual_seed(s)`` the same each run).
        fast_accum: on CUDA, the forward GEMMs accumulate with ``torch._scaled_mm(use_fast_accum=True)``
            (Hopper's FP8 tensor cores then promote partial sums to fp32 less often: faster, a little less
            precise), as Transformer Engine and torchao do; the dgrad and wgrad GEMMs always accumulate
            precisely (gradients sum many small terms). False: precise accumulation everywhere. The CPU's
            emulated GEMMs accumulate in fp32 either way (docs/runtime.md, GEMMs).
        fwd_format, bwd_format: formats of the forward operands (input, weight) and of the gradient
            (``"e4m3"`` / ``"e5m2"``; ``"e4m3_gaudi"`` for Gaudi2's range). ``"identity"`` turns
            quantization off inside the same ops (a testing hook: the rewritten model then computes
            the original math).
        compiler: what compiles the rewritten graph: "inductor" (default), "aot_eager" (AOT autograd
            without code generation, quick; useful for debugging) or "eager" (run the rewritten FX
            graph as is).
        on_graph_break: what to do when a graph break splits a GLU across graphs, or makes Dynamo run
            a higher-order op's body eagerly (a side effect in an activation-checkpointed layer's forward:
            the whole layer in high precision): "warn" (default: warn once per reason, report it in
            ``explain``, keep the split GLU's linears / the region in high precision), "error" (raise)
            or "ignore" (same handling, no warning).
        amax_reduction: agreement of delayed-scaling state across data-parallel ranks. "auto"
            (default): when ``torch.distributed`` is initialised with more than one rank, the amaxes
            recorded in a step are max-reduced over the world in one collective at the end of each
            backward, so every rank casts with the same scales (a single process: nothing happens);
            a ``torch.distributed.ProcessGroup``: the same over that group (every rank holding a piece
            or a replica of the same tensors: under tensor parallel, the dp and tp ranks both); "off": each rank keeps its own state (reduce it yourself with
            ``fp8pass.distributed.AmaxSync``).
        keep_first_layers, keep_last_layers: the first / last this many numbered blocks (``layers.0``,
            ``h.11``: an FQN's prefix up to its first numeric component) of each compiled graph keep
            their linears in high precision, counted over the blocks whose parameters the graph holds
            (a model compiled whole holds them all). 0 (default) keeps none; see docs/train.md, FP8 ramp-up.
        rules: per-module recipes, an ordered sequence of :class:`Rule` (the first whose pattern matches a
            linear decides its recipe; a linear no rule matches takes this Config's). Applied after
            ``keep_high_precision`` and ``keep_first_layers``/``keep_last_layers``, which keep their
            linears high whatever a rule says; a rule's ``"high"`` keeps more (docs/precision.md).
            ``fp8pass.load_rules(path)`` reads them from a TOML or JSON file.
        on_fallback: what to do when a GEMM the plan made FP8 cannot run its FP8 kernel on this device
            (two E5M2 operands, a GPU without FP8 GEMMs, grouped dims ``torch._scaled_grouped_mm``
            cannot take) and runs as dequantize + fp32 matmul instead (same numerics, slower): "warn"
            (default: one warning per weight and GEMM, naming them) or "error" (raise, naming the
            weights), when the graph is compiled. ``fp8pass.monitor.precision_audit(model)`` lists every
            GEMM's precision and kernel (docs/precision.md, Runtime precision audit).
        drift_check: a :class:`DriftCheck` (or None, off): the online comparison of FP8 steps with a
            high-precision replay, run by :class:`fp8pass.monitor.DriftMonitor` and the trainer.
        eval_recipe: what the model's evaluation graphs run in (compiled while ``model.training`` is False,
            i.e. after ``model.eval()``): a recipe as :class:`Rule` takes it (``"high"``, a named recipe, a
            Config, a scaling object), applied to every linear that ``keep_high_precision`` and
            ``keep_first_layers``/``keep_last_layers`` leave eligible, the same weights as training. Not a
            delayed-scaling recipe (evaluation would record its batches into the training's amax
            histories) nor NVFP4 with hot-channel patching (the same). None (default): evaluation runs in
            the training recipe (docs/precision.md, Evaluation precision).
        schedule: precision switches at given steps, a sequence of :class:`Switch` (e.g. ``[Switch([Rule("*",
            "high")], at_fraction=0.9)]``: the last 10% of the steps in high precision). The backend cannot
            count steps: ``fp8pass.apply_schedule(model, step, total_steps)`` makes the due switches (the
            trainer calls it before each step); each is a ``fp8pass.switch_precision`` with reason
            ``"schedule[i]..."`` and made once (a resumed model's history says which were made).
        recompute_glu_output: memory (docs/runtime.md, Saved for backward): backward recomputes each FP8
            GLU's output (the down projection's operand, smoothed) from the FP8 gate and up outputs it
            keeps anyway, and casts it with forward's scale, instead of keeping its E4M3 codes: 1 byte
            per GLU element (``tokens x ffn``) less saved per GLU, one more elementwise pass in backward;
            its wgrad then sees gate/up's E4M3 rounding too. Per-tensor FP8 GLUs only (a GLU with
            row/block scales keeps its codes); MoE expert stacks keep theirs.
        save_norm_input_fp8: memory (docs/runtime.md, Saved for backward): an RMSNorm whose output only
            FP8 linears read (q/k/v, gate/up; through a dtype cast too) becomes ``fp8pass::rmsnorm``,
            which keeps for backward its normalized input ``x_hat = x * rstd`` as E4M3 codes (one
            per-tensor current scale) and ``rstd`` (fp32, one per row) instead of the fp32 input:
            1 byte instead of 4 per residual-stream element per norm. The forward is the original norm's
            math unchanged (bit for bit); ``dx``/``dw`` see x_hat's E4M3 rounding (relative error
            <= 2^-4). A norm with another reader (the final norm before a high-precision LM head) is
            left as it is, listed by explain with the reason. Off: graphs are not touched.
    """

    recipe: CurrentScaling | DelayedScaling | NVFP4Scaling = DelayedScaling()
    smooth_swiglu: str | None = "channel"
    keep_high_precision: tuple[str, ...] = DEFAULT_KEEP_HIGH_PRECISION
    min_dim: int = 16
    dim_multiple: int = 16
    grad_stochastic_rounding: bool = True
    fast_accum: bool = True
    fwd_format: str = "e4m3"
    bwd_format: str = "e5m2"
    compiler: str = "inductor"
    on_graph_break: str = "warn"
    amax_reduction: object = "auto"
    keep_first_layers: int = 0
    keep_last_layers: int = 0
    rules: tuple[Rule, ...] = ()
    sr_seed: int | None = None
    on_fallback: str = "warn"
    drift_check: DriftCheck | None = None
    eval_recipe: object = None
    schedule: tuple[Switch, ...] = ()
    recompute_glu_output: bool = False
    save_norm_input_fp8: bool = False

    @classmethod
    def from_recipe(cls, name: str, **overrides) -> "Config":
        """The Config of the named recipe ``name`` ("paper", "reference", "delayed", "blockwise",
        "mxfp8", "nvfp4", "nvfp4-hcp"; see ``fp8pass.recipes`` and docs/train.md), with ``overrides``
        (any Config field) applied on top, e.g. ``Config.from_recipe("paper", compiler="aot_eager")``."""
        return cls(**{**get_named_recipe(name).fields(), **overrides})

    def __post_init__(self):
        if isinstance(self.recipe, str):  # a named recipe's name: its Config comes from from_recipe
            raise TypeError(
                f"Config(recipe=...) takes a scaling object; {self.recipe!r} is "
                + (f"a named recipe: use fp8pass.Config.from_recipe({self.recipe!r}) (other Config fields as "
                   f"keyword overrides)" if self.recipe in named_recipe_names() else
                   f"no named recipe either (fp8pass.Config.from_recipe(name) takes {', '.join(named_recipe_names())})")
                + "; or pass fp8pass.DelayedScaling(...), fp8pass.CurrentScaling(...) or fp8pass.NVFP4Scaling(...)")
        if not isinstance(self.recipe, (CurrentScaling, DelayedScaling, NVFP4Scaling)):
            raise TypeError(
                f"recipe must be fp8pass.DelayedScaling(...), fp8pass.CurrentScaling(...) or "
                f"fp8pass.NVFP4Scaling(...), "
                f"got {type(self.recipe).__name__}"
            )
        _check_choice("smooth_swiglu", self.smooth_swiglu, SMOOTH_SWIGLU)
        _check_choice("compiler", self.compiler, COMPILERS)
        _check_choice("on_graph_break", self.on_graph_break, ON_GRAPH_BREAK)
        _check_choice("on_fallback", self.on_fallback, ON_FALLBACK)
        if isinstance(self.amax_reduction, str) or self.amax_reduction is None:
            _check_choice("amax_reduction", self.amax_reduction, AMAX_REDUCTIONS)
        else:  # a process group exists only once torch.distributed is imported: no import needed here
            group_type = getattr(sys.modules.get("torch.distributed"), "ProcessGroup", None)
            if group_type is None or not isinstance(self.amax_reduction, group_type):
                raise ValueError(f"Config.amax_reduction must be 'auto', 'off' or a torch.distributed.ProcessGroup, "
                                 f"got {self.amax_reduction!r}")
        _check_bool("Config.grad_stochastic_rounding", self.grad_stochastic_rounding)
        if self.sr_seed is not None:
            _check_int("Config.sr_seed", self.sr_seed, 0, " (the stochastic-rounding seed) or None")
            if self.sr_seed >= 2**63:
                raise ValueError(f"Config.sr_seed must be an int in [0, 2**63) or None, got {self.sr_seed!r}")
        _check_bool("Config.fast_accum", self.fast_accum)
        _check_bool("Config.recompute_glu_output", self.recompute_glu_output)
        _check_bool("Config.save_norm_input_fp8", self.save_norm_input_fp8)
        keep = self.keep_high_precision
        if isinstance(keep, str):  # a lone glob would otherwise be iterated character by character
            keep = (keep,)
        if not isinstance(keep, (tuple, list, set, frozenset)) or not all(isinstance(k, str) for k in keep):
            raise TypeError(f"Config.keep_high_precision must be FQN glob strings (a tuple; () keeps every linear "
                            f"eligible), got {keep!r}")
        keep = tuple(keep)
        object.__setattr__(self, "keep_high_precision", keep)
        for name in ("fwd_format", "bwd_format"):
            v = getattr(self, name)
            if not isinstance(v, str):
                v = getattr(v, "name", v)  # a numerics Format object
                object.__setattr__(self, name, v)
            if v != "identity":
                if get_format(v).torch_dtype is None:
                    raise ValueError(f"{name} must be an FP8 format (e4m3, e4m3_gaudi, e5m2) or "
                                     f"'identity', got {v!r}")
        for name in ("keep_first_layers", "keep_last_layers"):
            _check_int(name, getattr(self, name), 0, " (a number of blocks)")
        for name in ("min_dim", "dim_multiple"):
            _check_int(f"Config.{name}", getattr(self, name), 1)
        rules = self.rules
        if isinstance(rules, Rule) or not isinstance(rules, (tuple, list)):
            raise TypeError(f"Config.rules must be a list of fp8pass.Rule, got {rules!r}")
        for i, r in enumerate(rules):
            if not isinstance(r, Rule):
                raise TypeError(f"Config.rules[{i}] must be an fp8pass.Rule(pattern, recipe, backward=...), got {r!r}")
        object.__setattr__(self, "rules", tuple(rules))
        if self.drift_check is not None and not isinstance(self.drift_check, DriftCheck):
            raise TypeError(f"Config.drift_check must be an fp8pass.DriftCheck(every=..., on_drift=...) or None, "
                            f"got {self.drift_check!r}")
        if self.eval_recipe is not None:
            _check_eval_recipe(self.eval_recipe)
        schedule = self.schedule
        if isinstance(schedule, Switch) or not isinstance(schedule, (tuple, list)):
            raise TypeError(f"Config.schedule must be a list of fp8pass.Switch, got {schedule!r}")
        for i, sw in enumerate(schedule):
            if not isinstance(sw, Switch):
                raise TypeError(f"Config.schedule[{i}] must be an fp8pass.Switch(rules, at_step=... or "
                                f"at_fraction=...), got {sw!r}")
        object.__setattr__(self, "schedule", tuple(schedule))

    def rule_for(self, names) -> tuple[int, Rule] | None:
        """``(index, rule)`` of the first rule whose pattern matches one of ``names`` (FQNs), or None."""
        for i, rule in enumerate(self.rules):
            if any(name and fnmatch.fnmatchcase(name, rule.pattern) for name in names):
                return i, rule
        return None


def _named_config(name: str) -> Config:
    """The Config of the named recipe ``name`` with every other field at its default (what a Rule naming it gives)."""
    return Config(**get_named_recipe(name).fields())
