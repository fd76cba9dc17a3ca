"""explain's accounting of matmul weights, checked against the autograd graph (a test helper any zoo calls).

``assert_accounts_for_matmul_weights(model, *args, **kwargs)`` runs ``fp8pass.explain`` on the model
and asserts that every matmul weight of the model is in the report exactly as the rule says
(docs/backend.md, Explain): ``linears`` (FP8) + kept in a graph + ran outside any graph = the model's
matmul weights, and no weight the report names as FP8 or outside is something else.

The reference set is found independently of explain's own recording (a ``TorchFunctionMode`` over
torch-level calls, fp8pass/report/report.py): from the **autograd graph** of an eager forward. A
parameter with two or more dims is a matmul weight when a matmul backward node (``mm``, ``addmm``'s
two matrices, ``bmm``, ``baddbmm``'s two batches, grouped mm) reaches its ``AccumulateGrad`` through
nodes that only view, slice, gather, cast or copy (the forms a weight may take on its way into a
matmul). Frozen parameters are made to require grad for this one forward.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

import fp8pass

# backward nodes of matmuls -> which of their inputs are matmul operands (None: all)
_MATMUL_NODES = {"MmBackward0": None, "BmmBackward0": None, "GroupedMmBackward0": None,
                 "AddmmBackward0": (1, 2), "BaddbmmBackward0": (1, 2)}
# nodes a weight goes through and stays the weight: views, slices, gathers, casts, contiguous copies
_SAME_WEIGHT = re.compile(r"(T|Transpose|Permute|View|UnsafeView|ReshapeAlias|Select|Slice|Unsqueeze|Squeeze|"
                          r"Expand|ToCopy|Clone|Index|IndexSelect|Split|SplitWithSizes|Unbind|Alias|AsStrided)"
                          r"Backward\d*$")


def _tensors(out) -> list[torch.Tensor]:
    """Every tensor in a model's output (a tensor, a tuple/list/dict of them, a ModelOutput)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    return []


def reference_matmul_weights(model: torch.nn.Module, *args, **kwargs) -> set[str]:
    """FQNs of ``model``'s matmul weights in ``model(*args, **kwargs)``, from the eager autograd graph."""
    names = {id(p): n for n, p in model.named_parameters()}
    frozen = [p for p in model.parameters() if not p.requires_grad and p.is_floating_point()]
    for p in frozen:
        p.requires_grad_(True)
    try:
        with torch.random.fork_rng(devices=[]):
            roots = [t.grad_fn for t in _tensors(model(*args, **kwargs)) if t.grad_fn is not None]
    finally:
        for p in frozen:
            p.requires_grad_(False)
    found: set[str] = set()
    seen, stack = set(), list(roots)
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        inputs = [f for f, _ in node.next_functions]
        stack += inputs
        operands = _MATMUL_NODES.get(type(node).__name__, False)
        if operands is False:
            continue
        for f in (inputs if operands is None else [inputs[i] for i in operands if i < len(inputs)]):
            while f is not None and _SAME_WEIGHT.match(type(f).__name__):
                f = next((g for g, _ in f.next_functions if g is not None), None)
            p = getattr(f, "variable", None)
            if p is not None and p.dim() >= 2 and id(p) in names:
                found.add(names[id(p)])
    return found


@dataclass
class Accounting:
    """What the report says of each matmul weight (FQN sets; a weight FP8 at one call site and kept at
    another is in both ``fp8`` and ``kept``)."""

    report: object
    expected: set[str]       # the model's matmul weights (autograd reference)
    fp8: set[str]
    kept: set[str]           # kept in high precision by a graph's plan (or taken by a graph, in no matmul of it)
    outside: set[str]        # ran eagerly between graphs


def assert_accounts_for_matmul_weights(model: torch.nn.Module, *args, report=None, config=None,
                                       **kwargs) -> Accounting:
    """Assert that ``fp8pass.explain(model, *args, config=config, **kwargs)`` (or ``report``, an explain
    report of that call) accounts for every matmul weight of ``model``: FP8 + kept + outside any graph
    == the weights the autograd graph of ``model(*args, **kwargs)`` shows entering a matmul, each listed
    weight is one of them, and the report's own count line adds up. Returns the sets for more checks."""
    if report is None:
        report = fp8pass.explain(model, *args, config=config, **kwargs)
    expected = reference_matmul_weights(model, *args, **kwargs)
    params = {n for n, _ in model.named_parameters()}
    outside = set(report.outside_graphs)
    fp8 = set(report.linears)
    kept = {w for w in (re.sub(r"\[-?\d+\]$", "", where) for where, _ in report.skipped) if w in params} - outside
    assert set(report.matmul_weights) == expected, (
        f"explain's matmul weights differ from the autograd graph's: only explain {set(report.matmul_weights) - expected}, "
        f"only autograd {expected - set(report.matmul_weights)}")
    assert fp8 <= expected, f"FP8 'linears' that are no matmul weight: {fp8 - expected}"
    assert outside <= expected and not outside & fp8, (outside - expected, outside & fp8)
    assert kept <= expected, f"weights listed as kept that are no matmul weight: {kept - expected}"
    missing = expected - fp8 - kept - outside
    assert not missing, f"matmul weights in no list of the report: {sorted(missing)}\n{report}"
    total, n_fp8, n_kept, n_outside = report.accounting()
    assert (total, n_fp8, n_outside) == (len(expected), len(fp8), len(outside)), report.accounting()
    assert n_fp8 + n_kept + n_outside == total
    return Accounting(report, expected, fp8, kept, outside)
