"""``fp8pass.explain(model, *inputs)``: what the fp8 backend would do to a model, without doing it.

Above the backend (it plans every graph with a :class:`~fp8pass.compile_backend.Backend`), while the
report package it fills (``fp8pass.report``) sits below the backend: the two cannot share a package
without an import cycle.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch
from torch import fx

from .compile_backend import Backend, fp8_backend
from .config import Config
from .graph_breaks import BreakWatch, break_note
from .passes import (
    compile_backend_of,
    frame_root,
    inplace_compile_suspended,
    names_for,
    original_callable,
    relative_param_names,
)
from .report.from_plan import merge_reports
from .report.report import Report, graph_tensors, matmul_weights, planned_weights, weights_outside_graphs
from .switch_history import epoch as switch_epoch
from .switch_history import switched_config

__all__ = ["explain"]


def explain(model: Callable, *example_inputs, config: Config | None = None, **example_kwargs) -> Report:
    """What ``torch.compile(model, backend=fp8pass.backend(config))`` would do, without doing it.

    Runs ``model(*example_inputs, **example_kwargs)`` once through Dynamo (the original model code
    executes; no FP8 op runs and no scaling state changes), plans and rewrites a copy of every graph;
    then once eagerly to find the model's matmul weights (``report.matmul_weights``: RNG and
    buffers restored), so that each one is in ``linears`` or ``skipped``, those whose matmul ran in no
    graph as "ran eagerly between graphs".

    ``model`` may be the model as built, a ``torch.compile(model, backend=...)`` wrapper or a model
    compiled in place (``model.compile(backend=...)``, the Trainer / Accelerate / FSDP recipes): the
    model's own code is traced either way. Without ``config``, a model compiled with
    ``fp8pass.backend(cfg)`` is planned with ``cfg``, else with the default ``Config()``; a model's
    precision switches (``fp8pass.switch_precision``) put their rules before the Config's.

    Returns:
        a :class:`~fp8pass.report.Report`: ``swiglus``, ``linears``, ``skipped``,
        ``graph_breaks`` (Dynamo's break reasons plus GLUs a break split), ``graph_before`` /
        ``graph_after``, ``notes``, ``matmul_weights``; ``print(report)`` shows a table.
    """
    # imported here: it loads all of Dynamo, which ``import fp8pass`` should not pay for (1.5 s goal)
    from torch._dynamo.backends.debugging import ExplainWithBackend

    if not callable(model):
        raise TypeError(f"fp8pass.explain(model, *example_inputs) takes the model (an nn.Module, compiled or not) "
                        f"or a function, got {type(model).__name__}")
    compiled_with = compile_backend_of(model)
    target = original_callable(model)
    notes = []
    if config is None and isinstance(compiled_with, Backend):
        config = compiled_with.config  # the plan the compiled model really gets
    elif compiled_with is not None and not isinstance(compiled_with, Backend) and compiled_with is not fp8_backend:
        name = (getattr(compiled_with, "compiler_name", None) or getattr(compiled_with, "__name__", None)
                or type(compiled_with).__name__)
        notes.append(f"the model is compiled with backend {name!r}, not fp8pass's: this report shows what "
                     f"backend=\"fp8\" (or fp8pass.backend(config)) would do")
    if isinstance(target, torch.nn.Module) and switch_epoch(target):  # fp8pass.switch_precision: the plan it runs now
        config = switched_config(config or Config(), target)
        notes.append(f"the model's {switch_epoch(target)} precision switch(es) put their rules first (rules[0] ...); "
                     f"fp8pass.precision_switches(model) lists them")
    be = Backend(config)
    records = []
    graph_inputs: set[int] = set()  # every tensor a graph was called with (expert stacks in no graph)

    def plan_only(gm: fx.GraphModule, inputs: list):
        graph_inputs.update(graph_tensors(gm, inputs))
        _, rec = be.transform(gm, inputs, frame_root())
        records.append(rec.report)
        relative = relative_param_names(gm.graph, inputs)
        seen = {tuple(id(inputs[i]) for i in sorted(relative))}

        def run(*args):  # the original graph runs: no FP8 op, no state change
            graph_inputs.update(graph_tensors(gm, args))
            key = tuple(id(args[i]) for i in sorted(relative))
            names = names_for(list(args), relative) if key not in seen else None
            if names is not None:  # Dynamo reuses this frame for another module: plan it under its names
                seen.add(key)
                records.append(be.transform(gm, list(args), names=names)[1].report)
            return gm.forward(*args)

        return run

    recorder = ExplainWithBackend(plan_only)
    torch._dynamo.reset()  # as torch._dynamo.explain: every frame is traced anew, nothing cached reused
    breaks = BreakWatch()  # the breaks the recorder does not see (inside activation checkpointing)
    try:
        with warnings.catch_warnings(), inplace_compile_suspended(target):
            warnings.simplefilter("ignore", RuntimeWarning)  # breaks are in the report itself
            torch.compile(target, backend=recorder)(*example_inputs, **example_kwargs)
    finally:
        torch._dynamo.reset()
    report = merge_reports(records, be.config)
    reasons = []
    for br in recorder.break_reasons:
        where = ""
        if getattr(br, "user_stack", None):
            fr = br.user_stack[-1]
            where = f" at {fr.filename}:{fr.lineno}"
        reasons.append(f"Dynamo graph break{where}: {str(br.reason).splitlines()[0]}")
    seen = {str(br.reason) for br in recorder.break_reasons}
    reasons += [break_note(r) for r in breaks.new_reasons() if r not in seen]
    report.graph_breaks = reasons + report.graph_breaks
    try:
        weights = matmul_weights(target, example_inputs, example_kwargs)
    except Exception as e:  # noqa: BLE001 - the plan above stands; the report says what it lacks
        weights = {}
        notes.append(f"the eager run that finds the model's matmul weights failed ({type(e).__name__}: {e}); "
                     f"weights whose matmul ran outside every graph are not listed")
    report.skipped += weights_outside_graphs(weights, planned_weights(report), graph_inputs)
    report.matmul_weights = list(weights)
    if not records:
        notes.append(f"Dynamo captured no graph from {type(target).__name__}: its code ran outside torch.compile "
                     f"(a torch.compiler.disable'd forward, or a wrapper explain does not see through); pass the "
                     f"model as you built it: fp8pass.explain(model, *example_inputs)")
    report.notes = notes
    return report
