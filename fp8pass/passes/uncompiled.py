"""The user's own model behind torch.compile's two forms, for explain and inspect.

``torch.compile(model, backend=...)`` returns a wrapper (``OptimizedModule``) holding the model as
``_orig_mod``; ``model.compile(backend=...)`` (the form the Trainer, Accelerate and FSDP recipes need)
compiles in place: the module keeps its class and signature, and ``_compiled_call_impl`` holds the
compiled call. ``fp8pass.explain`` traces the model's code again with its own recorder backend; under
an in-place compile the model's call would go to the already compiled function and the recorder would
see no graph at all (issue 34: "0 graph(s), 0 FP8 linear weight(s)"). Here the in-place compile is set
aside for the duration of the trace.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

__all__ = ["original_callable", "inplace_compile_suspended", "compile_backend_of"]


def original_callable(obj: Callable) -> Callable:
    """The model or function that ``torch.compile`` wrapped (``obj`` itself when it is not a wrapper)."""
    while True:
        if isinstance(obj, torch.nn.Module) and isinstance(getattr(obj, "_orig_mod", None), torch.nn.Module):
            obj = obj._orig_mod  # torch.compile(model)
        elif not isinstance(obj, torch.nn.Module) and callable(getattr(obj, "_torchdynamo_orig_callable", None)):
            obj = obj._torchdynamo_orig_callable  # torch.compile(fn)
        else:
            return obj


@contextlib.contextmanager
def inplace_compile_suspended(model: Any) -> Iterator[None]:
    """Inside: every submodule of ``model`` compiled in place (``model.compile()``, ``block.compile()``)
    runs its plain Python ``forward``, so an outer ``torch.compile`` traces its code; restored on exit."""
    suspended = []
    if isinstance(model, torch.nn.Module):
        for module in model.modules():
            impl = getattr(module, "_compiled_call_impl", None)
            if impl is not None:
                suspended.append((module, impl))
                module._compiled_call_impl = None
    try:
        yield
    finally:
        for module, impl in suspended:
            module._compiled_call_impl = impl


def _compiled_functions(obj: Any) -> list:
    """The functions torch.compile made for ``obj``: its wrapper, or its in-place compiled call."""
    if isinstance(obj, torch.nn.Module):
        impl = getattr(obj, "_compiled_call_impl", None)
        return [] if impl is None else [impl]
    return [obj]


def compile_backend_of(obj: Any) -> Any:
    """The ``backend=`` that ``obj`` (a ``torch.compile`` wrapper, a model compiled in place, or a
    compiled function) was compiled with, or None when it was not compiled or torch hides it.

    Best effort through torch's private wrappers (Dynamo's frame callback keeps the backend it wraps
    as ``_torchdynamo_orig_backend``, a string backend sits in ``compiler_fn``): a torch version that
    lays them out otherwise gives None, and explain then plans with the Config it is given.
    """
    contexts = []
    dynamo_ctx = getattr(obj, "dynamo_ctx", None)  # torch.compile(model)'s OptimizedModule
    if dynamo_ctx is not None:
        contexts.append(dynamo_ctx)
    for fn in _compiled_functions(obj):  # model.compile() / torch.compile(fn): the context is in the closure
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if hasattr(value, "callback"):
                contexts.append(value)
    for ctx in contexts:
        backend = getattr(ctx, "callback", None)
        for _ in range(8):  # the wrappers' chain is 3-4 deep in torch 2.11-2.13
            inner = getattr(backend, "_torchdynamo_orig_backend", None)
            if inner is None:
                inner = getattr(backend, "compiler_fn", None)
            if inner is None:
                break
            backend = inner
        if backend is not None and not hasattr(backend, "_torchdynamo_orig_backend"):
            return backend
    return None
