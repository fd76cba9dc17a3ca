"""The ``fp8`` torch.compile backend: copy Dynamo's graph, plan, rewrite, wire state, compile.

``torch.compile(model, backend="fp8")`` resolves the name through the ``torch_dynamo_backends``
entry point (pyproject.toml) to :func:`fp8_backend`, without importing fp8pass first; nothing here
registers the name at import (a second registration raises "duplicate name" in Dynamo).
``torch.compile(model, backend=fp8pass.backend(cfg))`` uses a configured :class:`Backend`.

Per graph Dynamo hands us (torch level: one ``F.linear`` per linear, no autograd yet):

1. copy it (Dynamo re-reads its own graph after the backend returns) and annotate every node once
   (absolute weight names from the parameter objects, example values, owning module, side effects);
2. plan: GLU MLPs, MoE expert stacks and linears by declarative patterns, the keep-high-precision
   policy, graph breaks; every matmul left in high precision is listed with its reason;
3. rewrite the copy into ``torch.ops.fp8pass`` ops with the weights' delayed-scaling state as extra
   inputs (the state belongs to the weight Parameter, so it survives recompiles and
   ``torch._dynamo.reset()`` and is shared by tied weights);
4. compile with Inductor (``mode=`` / ``options=`` translated to config patches), AOT autograd
   building the FP8 backward from the ops' registered autograd.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import fx

from . import runtime  # noqa: F401  (registers torch.ops.fp8pass.*)
from .checkpoint import attach_weights
from .config import Config, DelayedScaling
from .graph_breaks import BreakWatch, break_counts, break_note, runs_region_eagerly
from .passes import (
    FrameNames,
    StateInput,
    annotate_graph,
    apply_plan,
    copy_graph_module,
    frame_names,
    frame_root,
    names_for,
    plan_graph,
    relative_param_names,
    top_module,
    unmatched_rules,
)
from .precision_audit import check_fallbacks, graph_gemms, kept_gemms, register
from .report import Report, SwiGLUEntry, decided_by, expert_entries, merge_reports, no_fp8_message
from .runtime.hcp import hcp_state_for
from .runtime.sr import stream_for, stream_key
from .runtime.state import grouped_state_for, state_for
from .switch_history import epoch as switch_epoch
from .switch_history import eval_config, mark_compiled, switched_config

__all__ = ["Backend", "backend", "fp8_backend", "GraphBreakError"]

_MAX_RECORDS = 256


class GraphBreakError(RuntimeError):
    """A graph break split a GLU, or left an activation-checkpointed region outside every graph, and
    ``Config(on_graph_break="error")`` was set."""


# Dynamo's graph-break count when the backend module loaded: ``backend="fp8"`` loads it at the
# torch.compile call, before anything is traced, and makes its Backend only at the first graph
_BREAKS_AT_IMPORT = break_counts()


@dataclass
class GraphRecord:
    """What the backend did to one graph (kept on the Backend for explain and tests)."""

    report: Report
    extra_inputs: list[StateInput] = field(default_factory=list)
    pass_seconds: float = 0.0
    gemms: list = field(default_factory=list)  # precision_audit.GemmRecord per GEMM of the graph


def _calls_fp8pass_ops(gm) -> bool:
    """Whether the rewritten graph (or a higher-order op body in it) calls an ``fp8pass::`` custom op."""
    for n in gm.graph.nodes:
        if n.op == "call_function" and isinstance(n.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) \
                and str(n.target).startswith("fp8pass."):
            return True
        sub = getattr(gm, n.target, None) if n.op == "get_attr" and isinstance(n.target, str) else None
        if isinstance(sub, fx.GraphModule) and _calls_fp8pass_ops(sub):
            return True
    return False


def _code(gm: fx.GraphModule) -> str:
    """The graph's code, then each higher-order op body's (activation checkpointing, wrap, cond), depth first."""
    parts = [gm.code]
    for node in gm.graph.nodes:
        sub = getattr(gm, node.target, None) if node.op == "get_attr" and isinstance(node.target, str) else None
        if isinstance(sub, fx.GraphModule):
            parts.append(f"# body {node.target}\n{_code(sub)}")
    return "\n".join(parts)


def _inductor_patches(mode: str | None, options: dict | None, dynamic) -> dict:
    """``torch.compile``'s mode/options as Inductor config patches (compile_fx takes neither)."""
    patches: dict[str, Any] = {}
    if mode and mode != "default":
        from torch._inductor import list_mode_options

        patches.update(list_mode_options(mode, dynamic))
    if options:
        from torch._inductor import config as inductor_config

        known = inductor_config.get_config_copy()
        for key, val in options.items():
            name = key.replace("-", "_")
            if name not in known:
                raise RuntimeError(f"fp8 backend: unknown Inductor option {key!r} in options=")
            patches[name] = val
    return patches


class Backend:
    """A configured fp8 backend; pass it as ``torch.compile(model, backend=fp8pass.backend(cfg))``.

    Args:
        config: what to rewrite and how (``fp8pass.Config``).

    Attributes:
        records: one :class:`GraphRecord` per graph compiled, in order (explain reads them).
        compiles: how many rewritten graphs this backend has compiled (Dynamo's graphs, the variants
            of a reused frame whose plan differs, the re-plans after a precision switch).
    """

    def __init__(self, config: Config | None = None):
        if config is not None and not isinstance(config, Config):
            raise TypeError(f"fp8pass.backend(config) takes an fp8pass.Config, got {type(config).__name__}")
        self.config = config or Config()
        self.records: list[GraphRecord] = []
        self.compiles = 0
        self._split_modules: dict[str, str] = {}
        self._warned: set[str] = set()
        self._breaks = BreakWatch()  # Dynamo's graph breaks since this backend was made (_check_breaks)
        # models (id of the user's module; "" for compiled functions) with a graph holding an FP8 op, and the
        # records of their graphs without one: a model with none gets one warning (_watch_for_fp8)
        self._models_with_fp8: set = set()
        self._records_without_fp8: dict = {}
        self.__name__ = "fp8"
        self._amax_reducer = None
        # stochastic-rounding streams (runtime/sr.py): the seed, drawn once if the config has none, and
        # per model (None: compiled functions) how many streams its graphs have made
        self._sr_seed = self.config.sr_seed
        self._sr_made: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._sr_made_unowned = 0
        self._fallbacks_warned: set = set()  # (weight, GEMM, reason) warned about (Config.on_fallback)

    @property
    def _reducer(self):
        return self._reducer_for(self.config)

    def _reducer_for(self, cfg: Config):
        """The automatic cross-rank amax reduction of graphs planned with ``cfg`` (None: no delayed recipe
        in it, or turned off).

        Made on first use: ``fp8pass.distributed`` loads with the first compiled graph that has
        delayed-scaling state, not with ``import fp8pass``.
        """
        reduction = cfg.amax_reduction
        delayed = [cfg.recipe] + [r.scaling for r in cfg.rules]
        if not any(isinstance(r, DelayedScaling) for r in delayed) or reduction in ("off", None):
            return None
        if self._amax_reducer is None:
            from .distributed.auto_reduce import shared_reducer

            self._amax_reducer = shared_reducer(reduction)
        return self._amax_reducer

    def _sr_keys(self, model: torch.nn.Module | None) -> Callable[[], int]:
        """The key of ``model``'s next stochastic-rounding stream: ``stream_key(seed, i)`` for its i-th,
        so a model's streams do not depend on what else the process compiles."""
        def next_key() -> int:
            if self._sr_seed is None:  # CPU generator: no device sync
                self._sr_seed = int(torch.randint(0, 2**62, (), dtype=torch.int64).item())
            if model is None:
                i, self._sr_made_unowned = self._sr_made_unowned, self._sr_made_unowned + 1
            else:
                i = self._sr_made.get(model, 0)
                self._sr_made[model] = i + 1
            return stream_key(self._sr_seed, i)

        return next_key

    def _precision_key(self, model: torch.nn.Module | None) -> tuple[int, bool]:
        """(the model's precision epoch, whether its eval recipe applies now): what a graph's plan depends on
        beyond its weights. Read at every call of a compiled graph: two attribute reads."""
        if model is None:
            return (0, False)
        return (switch_epoch(model), self.config.eval_recipe is not None and not model.training)

    def _config_at(self, model: torch.nn.Module | None, key: tuple[int, bool]) -> Config:
        """The Config the model's graphs are planned with at precision ``key``: ``eval_recipe`` when
        evaluating, else the model's precision switches' rules before ``Config.rules``."""
        return eval_config(self.config) if key[1] else switched_config(self.config, model)

    # torch.compile calls backend(gm, example_inputs, **{"mode": .., "options": ..})
    def __call__(self, gm: fx.GraphModule, example_inputs: list, mode: str | None = None,
                 options: dict | None = None) -> Callable:
        if any(isinstance(v, torch.Tensor) and v.device.type == "meta" for v in example_inputs):
            # nothing is computed on meta tensors (shape inference, FLOP counting): no FP8 to apply
            self._warn_once("meta", "fp8pass: the model's tensors are on the meta device; this graph is compiled "
                                    "without FP8. Materialize the model (model.to_empty(device=...) and initialize "
                                    "it, or load a checkpoint) before compiling it for training.")
            return self._compile(gm, list(example_inputs), mode, options)
        if any(isinstance(v, torch.Tensor) and v.device.type == "cpu" for v in example_inputs):
            _hint_at_oversubscription_once()
        t0 = time.perf_counter()
        root = frame_root()
        model = top_module(root) if root is not None else None
        if model is not None:
            mark_compiled(model)
        pkey = self._precision_key(model)
        cfg = self._config_at(model, pkey)
        self._check_breaks(cfg)
        new_gm, record = self.transform(gm, example_inputs, root, config=cfg)
        if any("float64" in reason for _, reason in record.report.skipped):
            self._warn_once("float64", "fp8pass: float64 weights or activations stay in float64 (FP8 applies to "
                                       "fp32/bf16/fp16 models); fp8pass.explain(model, ...) lists what was kept.")
        record.pass_seconds = time.perf_counter() - t0
        self._audit(record, model, keep=not pkey[1])
        self.records.append(record)
        del self.records[:-_MAX_RECORDS]  # a long job recompiling often keeps only recent reports
        sr_keys = self._sr_keys(model)
        reducer = self._reducer_for(cfg)
        extras = _resolve_state(record.extra_inputs, example_inputs, cfg, reducer, sr_keys)
        compiled = self._compile(new_gm, list(example_inputs) + _static_fakes(extras), mode, options)
        if not pkey[1]:  # an evaluation graph may hold no FP8 op by choice (eval_recipe="high")
            compiled = self._watch_for_fp8(compiled, new_gm, record, root)
        relative = relative_param_names(gm.graph, example_inputs)
        if not extras and not relative:
            return compiled

        # Dynamo calls what a backend returns with positional arguments (compile_fx's result takes
        # them too, though it carries a copied ``_boxed_call`` attribute); append the state.
        # Dynamo reuses one compiled frame for every module instance of the same structure (the
        # decoder layers of a model whose layers break the graph, the blocks of a per-block compile;
        # their weights are graph inputs). Per set of weights passed: the state is looked up from
        # those weights, and the plan is made again under their absolute names; where the policy
        # decides differently (``keep_high_precision=("layers.2.*",)``) that set gets its own graph.
        # Per precision key too (``_precision_key``): after ``fp8pass.switch_precision(model, ...)`` the
        # next call plans the graph again under the switched rules, and in eval mode under
        # ``eval_recipe``; a rewrite equal to one compiled before reuses it (``compiled_by_code``), so a
        # switch costs at most one compile per distinct rewritten graph, and none where nothing changes.
        params = sorted(relative)
        variants: dict[tuple, tuple] = {}
        model_ref = weakref.ref(model) if model is not None else None
        compiled_by_code = {new_gm.code: compiled}
        first = (pkey, compiled, record, cfg)

        def key_of(args) -> tuple:
            return tuple(id(args[i]) for i in params)

        variants[(key_of(example_inputs), pkey)] = ([weakref.ref(example_inputs[i]) for i in params], compiled,
                                                    extras, reducer if extras else None)

        def run(*args):
            m = model_ref() if model_ref is not None else None
            key = (key_of(args), self._precision_key(m))
            hit = variants.get(key)
            if hit is None or any(r() is not args[i] for r, i in zip(hit[0], params)):
                hit = self._variant(gm, list(args), first, relative, mode, options, sr_keys, m, key[1],
                                    compiled_by_code)
                if len(variants) > _MAX_RECORDS:
                    variants.clear()
                if len(compiled_by_code) > _MAX_RECORDS:
                    compiled_by_code.clear()
                variants[key] = hit
            fn, state, red = hit[1], hit[2], hit[3]
            if red is None:
                return fn(*args, *state)
            red.before_forward()
            out = fn(*args, *state)
            red.after_forward(out)
            return out

        return run

    def _variant(self, gm, args, first, relative, mode, options, sr_keys, model, pkey, compiled_by_code):
        """(weight refs, compiled fn, state tensors, amax reducer) for a compiled frame called with other
        weights, or at another precision key (a switch, eval mode) than ``first`` = (its key, compiled fn,
        record, Config) was compiled at."""
        first_key, compiled, record, cfg = first
        names = names_for(args, relative)
        refs = [weakref.ref(args[i]) for i in sorted(relative)]
        if names is None and pkey == first_key:  # weights of a module never seen: the graph as planned
            reducer = self._reducer_for(cfg)
            extras = _resolve_state(record.extra_inputs, args, cfg, reducer, sr_keys)
            return refs, compiled, extras, reducer if extras else None
        if pkey != first_key:
            cfg = self._config_at(model, pkey)
        gm2, rec2 = self.transform(gm, args, names=names, config=cfg)
        self._audit(rec2, model, keep=not pkey[1])
        self.records.append(rec2)
        del self.records[:-_MAX_RECORDS]
        reducer = self._reducer_for(cfg)
        extras = _resolve_state(rec2.extra_inputs, args, cfg, reducer, sr_keys)
        fn = compiled_by_code.get(gm2.code)  # the same rewrite: reuse the compiled graph
        if fn is None:
            fn = compiled_by_code[gm2.code] = self._compile(gm2, list(args) + extras, mode, options)
        return refs, fn, extras, reducer if extras else None

    def transform(self, gm: fx.GraphModule, example_inputs: list | None = None,
                  root: torch.nn.Module | None = None, names: FrameNames | None = None,
                  config: Config | None = None) -> tuple[fx.GraphModule, GraphRecord]:
        """Plan and rewrite a copy of ``gm``; returns (rewritten copy, record). ``gm`` is untouched.

        Args:
            gm: Dynamo's graph.
            example_inputs: its real inputs (parameters among them are named by identity).
            root: the compiled frame's ``self`` module (absolute names across graph breaks).
            names: the frame's names, when known otherwise (a reused frame, see ``__call__``).
            config: plan with this Config instead of the backend's (a model's switched precision, its
                evaluation recipe).
        """
        cfg = config if config is not None else self.config
        if root is not None and self.config.rules:
            self._warn_unmatched_rules(top_module(root))
        new_gm = copy_graph_module(gm)
        names = names if names is not None else frame_names(root, example_inputs or [])
        annotate_graph(new_gm.graph, names, example_inputs)
        before = _code(gm)  # Dynamo already generated it; the copy's code would cost a codegen
        plan = plan_graph(new_gm.graph, cfg, self._split_modules)
        self._split_modules.update(plan.split_modules)
        plans = list(plan.walk())  # the graph's and its higher-order op bodies' (activation checkpointing)
        report = Report(
            swiglus=[SwiGLUEntry(s.gate, s.up, s.down, s.variant, len(self.records)) for p in plans for s in p.glus],
            experts=[e for p in plans for e in expert_entries(p, len(self.records))],
            skipped=list(plan.skipped), graph_breaks=list(plan.graph_breaks), graph_before=before,
            num_graphs=1, config=cfg,
        )
        if plan.graph_breaks:
            msg = "fp8pass: " + "; ".join(plan.graph_breaks)
            if cfg.on_graph_break == "error":
                raise GraphBreakError(msg + ". Remove the graph break (fullgraph=True shows it) or "
                                            "set Config(on_graph_break='warn').")
            if cfg.on_graph_break == "warn":
                warnings.warn(msg + ". The cut GLU's down projection stays in high precision; "
                                    "see fp8pass.explain(model, ...).", RuntimeWarning, stacklevel=2)
        extra: list[StateInput] = []
        if not plan.empty():
            new_gm, extra, fp8, kept = apply_plan(new_gm, plan, cfg)
            report.linears = fp8
            report.skipped += kept
            report.decided_by = decided_by(plan, set(fp8))
        report.graph_after = _code(new_gm)
        gemms = graph_gemms(new_gm, report.decided_by) + kept_gemms(report.skipped)
        return new_gm, GraphRecord(report, extra, gemms=gemms)

    def _compile(self, gm, inputs, mode, options):
        self.compiles += 1
        if _has_dtensor(inputs):  # tensor parallel: DTensor dispatch needs the ops' sharding rules
            from .distributed.tensor_parallel import check_reduction_group, register_sharding_rules

            register_sharding_rules()
            check_reduction_group(self.config.amax_reduction, inputs)
        return self._compile_graph(gm, inputs, mode, options)

    def _compile_graph(self, gm, inputs, mode, options):
        which = self.config.compiler
        if which == "eager":
            if mode or options:
                raise ValueError("mode=/options= need Config(compiler='inductor')")
            return gm.forward
        if which == "aot_eager":
            from torch._dynamo.backends.registry import lookup_backend

            if mode or options:
                raise ValueError("mode=/options= need Config(compiler='inductor')")
            return lookup_backend("aot_eager")(gm, inputs)
        from torch._functorch import config as functorch_config
        from torch._inductor.compile_fx import compile_fx

        patches = _inductor_patches(mode, options, None)
        if not _calls_fp8pass_ops(gm):
            return compile_fx(gm, inputs, config_patches=patches or None)
        # AOTAutograd's on-disk cache keys on the graph, not on our ops' Python autograd formulas: after
        # an fp8pass upgrade it replayed a stale backward ("Expected Tensor for up_data, found list").
        with functorch_config.patch(enable_autograd_cache=False):
            return compile_fx(gm, inputs, config_patches=patches or None)

    def _watch_for_fp8(self, compiled: Callable, new_gm: fx.GraphModule, record: GraphRecord,
                       root: torch.nn.Module | None) -> Callable:
        """``compiled``, or for a graph without FP8 op a wrapper that warns on its second call when no
        graph of the same model holds one: the model then trains in high precision (issue 34).

        Not at compile time: a model whose graph breaks compiles its pieces one by one as its first
        call reaches them, and a piece without linears (the embedding before a break) is normal. By
        a graph's second call every piece of the first call has been compiled.
        """
        model = top_module(root) if root is not None else None
        key = id(model) if model is not None else ""
        if _calls_fp8pass_ops(new_gm):
            self._models_with_fp8.add(key)
            return compiled
        reports = self._records_without_fp8.setdefault(key, [])
        reports.append(record.report)
        del reports[:-8]  # a few graphs' reasons make the message; a model recompiling often keeps no more
        calls = 0

        def watched(*args):
            nonlocal calls
            calls += 1
            if calls == 2 and key not in self._models_with_fp8:
                name = type(model).__name__ if model is not None else "a function"
                self._warn_once(f"no-fp8:{key}", no_fp8_message(name, self._records_without_fp8.get(key, [])))
            return compiled(*args)

        return watched

    def _audit(self, record: GraphRecord, model: torch.nn.Module | None, keep: bool = True) -> None:
        """Keep a compiled graph's GEMM records for ``fp8pass.monitor.precision_audit(model)`` and apply
        ``Config.on_fallback`` to them (fp8pass/precision_audit.py), before the graph runs. An evaluation
        graph under ``Config.eval_recipe`` (``keep=False``) is checked but not kept: the audit lists the
        training precision, which an evaluation would otherwise overwrite until the next recompile."""
        if keep:
            register(model, record.gemms)
        check_fallbacks(record.gemms, self.config.on_fallback, self._fallbacks_warned)

    def _warn_unmatched_rules(self, model: torch.nn.Module) -> None:
        """Once per model: a warning naming each ``Config.rules`` pattern that matches nothing in it."""
        key = f"rules:{id(model)}"
        if key in self._warned:
            return
        self._warned.add(key)
        for pattern in unmatched_rules(self.config, model):
            warnings.warn(f"fp8pass: Config.rules pattern {pattern!r} matches no module or parameter of "
                          f"{type(model).__name__} (its FQNs look like {_sample_fqn(model)!r}); the rule decides "
                          f"nothing", UserWarning, stacklevel=3)

    def _check_breaks(self, cfg: Config) -> None:
        """Warn about (``Config.on_graph_break``) each graph break Dynamo counted since the previous graph
        that left a higher-order op's body (an activation-checkpointed layer) outside every graph: its
        matmuls run eagerly in high precision and no graph of ours shows them. Breaks between graphs need
        nothing: the code after them is the next graph, planned as usual."""
        for reason in self._breaks.new_reasons():
            if not runs_region_eagerly(reason) or cfg.on_graph_break == "ignore":
                continue
            msg = "fp8pass: " + break_note(reason)
            if cfg.on_graph_break == "error":
                raise GraphBreakError(msg + ". Or set Config(on_graph_break='warn') to train with that region "
                                            "in high precision.")
            self._warn_once(f"break:{reason}", msg + ". fp8pass.explain(model, ...) lists the matmuls left out.")

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def reset(self):
        """Called by ``torch._dynamo.reset()``: forget graph records (the scaling state is kept)."""
        self.records.clear()
        self._split_modules.clear()
        self._models_with_fp8.clear()
        self._records_without_fp8.clear()

    def report(self) -> Report:
        """All graphs compiled so far merged into one Report."""
        return merge_reports([r.report for r in self.records], self.config)

    def __repr__(self) -> str:
        return f"fp8pass.backend({self.config})"


def _has_dtensor(values) -> bool:
    """Whether a graph's inputs hold a DTensor (only possible once torch.distributed.tensor is loaded)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and any(isinstance(v, mod.DTensor) for v in values)


def oversubscription_hint(threads: int, cores: int, load_average: float) -> str | None:
    """A hint to lower torch's CPU threads when other jobs already load the cores, else None.

    torch's intra-op threads wait for each other at every op; on cores that other processes hold, a
    user's FP8 steps took 9.5-20 s with torch's default 2 threads against 0.9 s with one (issue 34).
    The compile that calls this keeps about one core busy itself: one unit of the load is ours.
    """
    others = max(0.0, load_average - 1.0)
    if threads <= 1 or others + threads <= cores:
        return None
    return (f"fp8pass: torch runs {threads} threads on {cores} CPU core(s) that other jobs already load (load "
            f"average {load_average:.1f}); its threads then wait on each other, and FP8 steps ran 10-20x slower "
            f"than with one thread on such a machine. Call torch.set_num_threads(1) (or at most the number of "
            f"idle cores) before training (docs/backend.md, Threads on a shared CPU).")


def _cpu_threads_cores_load() -> tuple[int, int, float] | None:
    """(torch's threads, cores this process may use, 1-minute load average); None where unknown."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # not on every platform
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return torch.get_num_threads(), cores, load


_THREADS_CHECKED = False


def _hint_at_oversubscription_once() -> None:
    """At the first compile of a CPU graph in this process: warn when torch's threads oversubscribe the cores."""
    global _THREADS_CHECKED
    if _THREADS_CHECKED:
        return
    _THREADS_CHECKED = True
    measured = _cpu_threads_cores_load()
    hint = oversubscription_hint(*measured) if measured is not None else None
    if hint is not None:
        warnings.warn(hint, RuntimeWarning, stacklevel=3)


def _sample_fqn(model: torch.nn.Module) -> str:
    """A linear's module FQN in ``model`` (the form the rules' globs match), for messages."""
    return next((n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)), "") or \
        next((n for n, _ in model.named_parameters()), "")


def _static_fakes(extras: list) -> list:
    """The state inputs as AOT autograd should trace them: fake tensors of static shape in Dynamo's fake
    mode. Left to AOT they get symbolic sizes that no Dynamo source names, and a guard on one (the
    grouped ops' per-expert state check, a clone's stride check) fails Dynamo's guard generation."""
    tc = torch._guards.TracingContext.try_get()
    if tc is None or tc.fake_mode is None:
        return extras
    return [tc.fake_mode.from_tensor(t, static_shapes=True) for t in extras]


def _resolve_state(extra: list[StateInput], example_inputs: list, cfg: Config,
                   reducer=None, sr_keys: Callable[[], int] | None = None) -> list[torch.Tensor]:
    """The live state tensors for the extra inputs (created on the weight's first use).

    The delayed-scaling states are handed to ``reducer`` (the automatic cross-rank reduction); a new
    stochastic-rounding stream takes its key from ``sr_keys`` (``Backend._sr_keys``).
    """
    if not extra:
        return []
    # the weights' modules carry their scaling state in model.state_dict() from now on, each under the
    # Config of its site (Config.rules)
    by_config: dict = {}
    for s in extra:
        by_config.setdefault(s.config or cfg, []).append(example_inputs[s.weight_pos])
    for site_cfg, weights in by_config.items():
        attach_weights(weights, site_cfg)
    out = []
    for s in extra:
        c = s.config or cfg
        weight = example_inputs[s.weight_pos]
        if s.kind == "sr":  # the weight's stochastic-rounding stream (runtime/sr.py)
            out.append(stream_for(weight, sr_keys).stream)
            continue
        if s.kind == "hcp":  # NVFP4 hot-channel patching (passes/rewrite_nvfp4.py)
            out.append(hcp_state_for(weight, c.recipe.hcp).op_args()[s.field])
            continue
        fwd = c.fwd_format if c.fwd_format != "identity" else "e4m3"
        bwd = c.bwd_format if c.bwd_format != "identity" else "e5m2"
        if s.kind == "experts":  # one scale per expert of a 3-D expert weight (passes/rewrite_grouped.py)
            st = grouped_state_for(weight, c.recipe, fwd, bwd)
        else:
            st = state_for(weight, c.recipe, fwd, bwd)
        role = st.roles()[s.role]
        if reducer is not None:
            reducer.add(role)
        out.append(role.op_tensors()[s.field])
    if _has_dtensor(example_inputs):  # tensor parallel: the state enters the ops' DTensor rules as Replicate
        from .distributed.tensor_parallel import replicated

        out = replicated(out, example_inputs)
    return out


_DEFAULT: Backend | None = None


def fp8_backend(gm: fx.GraphModule, example_inputs: list, **kwargs) -> Callable:
    """The ``torch_dynamo_backends`` entry point ``fp8``: the default :class:`Config`."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = Backend(Config())
        _DEFAULT._breaks = BreakWatch(since=_BREAKS_AT_IMPORT)  # this first graph's own breaks count too
    return _DEFAULT(gm, example_inputs, **kwargs)


def _reset_default() -> None:
    if _DEFAULT is not None:
        _DEFAULT.reset()


fp8_backend.reset = _reset_default  # torch._dynamo.reset() calls it through torch.compile's wrapper


def backend(config: Config | None = None) -> Backend:
    """A backend for ``torch.compile(model, backend=fp8pass.backend(cfg))``."""
    return Backend(config)
