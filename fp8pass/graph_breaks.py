"""Dynamo's graph-break reasons as Dynamo counts them, for the backend's warnings and ``explain``.

``ExplainWithBackend`` and ``torch._dynamo.explain`` list the breaks that end a captured graph. A break
inside a higher-order op's body is not among them: Dynamo gives up on the whole op, runs it eagerly, and
only ``torch._dynamo.utils.counters["graph_break"]`` (reason -> count) records why. The case that matters
here is activation checkpointing (``torch.utils.checkpoint.checkpoint``, HF's
``gradient_checkpointing_enable()``) of a layer whose forward mutates an object that lives outside it:
transformers 5.25 routes attention through the ``kernels`` package, which sets a module-level variable on
every call, so each checkpointed decoder layer runs eagerly and its matmuls stay in high precision.
"""

from __future__ import annotations

import sys
from collections import Counter

__all__ = ["BreakWatch", "break_counts", "break_note", "runs_region_eagerly"]

# Dynamo's own remedy for a side effect in a checkpointed forward (torch 2.11 and 2.13 name it the same)
SKIP_SIDE_EFFECTS_FLAG = "torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint"


def break_counts() -> Counter:
    """Dynamo's graph-break counter now (empty while Dynamo is not loaded: nothing was traced yet)."""
    utils = sys.modules.get("torch._dynamo.utils")
    return Counter(utils.counters["graph_break"]) if utils is not None else Counter()


class BreakWatch:
    """The graph-break reasons Dynamo counted since the last look (or since ``since``)."""

    def __init__(self, since: Counter | None = None):
        self._seen = break_counts() if since is None else Counter(since)

    def new_reasons(self) -> list[str]:
        now = break_counts()
        new = [reason for reason, n in now.items() if n > self._seen.get(reason, 0)]
        self._seen = now
        return new


def runs_region_eagerly(reason: str) -> bool:
    """A break inside a higher-order op (``HOP: ...``): the op's whole body, an activation-checkpointed
    layer, runs outside every graph."""
    return reason.startswith("HOP")


def _context(reason: str) -> str:
    for line in reason.splitlines():
        if line.strip().startswith("Developer debug context:"):
            return line.strip()[len("Developer debug context:"):].strip()
    return ""


def break_note(reason: str) -> str:
    """One line for a report or a warning: Dynamo's reason (its first line and the object involved) and,
    for a break that leaves a checkpointed region eager, what that costs and how to lift it."""
    head = reason.splitlines()[0].strip() if reason.strip() else "(no reason given)"
    ctx = _context(reason)
    note = f"Dynamo graph break: {head}" + (f" ({ctx})" if ctx else "")
    if "save_on_cpu" in reason:  # HF activation_checkpointing_enable(offload=True) wraps each checkpoint in it
        note += ("; torch.autograd.graph.save_on_cpu is not traced, so the code it wraps (with HF's "
                 "activation_checkpointing_enable(offload=True): every checkpointed layer) runs eagerly, in high "
                 "precision. fp8pass.offload_saved_activations() around the forward call moves the saved "
                 "tensors to host memory and keeps the graphs")
    if not runs_region_eagerly(reason):
        return note
    note += ("; Dynamo runs that higher-order op's whole body eagerly (e.g. an activation-checkpointed layer: "
             "torch.utils.checkpoint, HF gradient_checkpointing_enable()), so its matmuls stay in high "
             "precision")
    if "side effect" in head.lower():
        note += (f". The checkpointed forward changes an object that lives outside it; if the change is undone "
                 f"within the forward (transformers 5.25's `kernels` routing variable is), set "
                 f"{SKIP_SIDE_EFFECTS_FLAG} = True before the first call, else move the change out of the "
                 f"checkpointed code")
    return note
