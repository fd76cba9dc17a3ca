"""Absolute names of a Dynamo frame's parameters, from the parameter objects themselves.

Dynamo names a parameter by its path from the compiled frame's ``self``. When a graph break makes
each decoder layer its own frame, that path is relative to the layer (``self_attn.q_proj.weight``):
distinct layers would share names, and ``keep_high_precision`` globs written with layer paths
(``model.layers.3.*``) would stop matching. Here the outermost module that holds the frame's root
(found among the locals of the calling Python frames; ``torch.compile``'s wrapper is transparent)
names every parameter by its path from there, as ``model.named_parameters()`` names it.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.weak import WeakTensorKeyDictionary

__all__ = ["FrameNames", "frame_names", "frame_root", "names_for", "top_module"]


@dataclass
class FrameNames:
    """Names for one compiled frame.

    Attributes:
        params: ``id(parameter) -> absolute FQN`` for the parameters the frame's graph takes.
        prefix: absolute FQN of the frame's root module ('' for the outermost model), which prefixes
            the module paths Dynamo records in ``nn_module_stack``.
    """

    params: dict[int, str] = field(default_factory=dict)
    prefix: str = ""
    strip: str = ""  # the frame root is a wrapper: its attribute path to the model ("module.")

    def module(self, relative: str) -> str:
        """An ``nn_module_stack`` path (relative to the frame root) made absolute."""
        if self.strip and (relative + ".").startswith(self.strip):
            relative = relative[len(self.strip):]
        if not self.prefix:
            return relative
        return f"{self.prefix}.{relative}" if relative else self.prefix


def frame_root() -> nn.Module | None:
    """The ``self`` module of the frame Dynamo is compiling now (None outside a compile or for functions).

    Only the backend call knows it: Dynamo calls the backend while its instruction translator for
    the frame is current.
    """
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
    except ImportError:  # pragma: no cover - other torch layouts
        return None
    tx = InstructionTranslator.current_tx()
    if tx is None:
        return None
    for value in getattr(tx, "f_locals", {}).values():
        if isinstance(value, nn.Module):
            return value
    return None


# wrappers that stand for the model they hold: names stay the model's own (``lm_head``, not
# ``module.lm_head``), so the default keep_high_precision globs match under DDP / FSDP1 / compile too
_WRAPPERS = {"OptimizedModule": "_orig_mod", "DistributedDataParallel": "module", "DataParallel": "module",
             "FullyShardedDataParallel": "_fsdp_wrapped_module"}


def _unwrapped(module: nn.Module) -> nn.Module:
    """The user's model inside ``torch.compile`` / DDP / DataParallel / FSDP1 wrappers."""
    while True:
        inner = getattr(module, _WRAPPERS.get(type(module).__name__, ""), None)
        if not isinstance(inner, nn.Module):
            return module
        module = inner


def _top(root: nn.Module, max_frames: int = 256) -> tuple[nn.Module, str]:
    """(outermost module that holds ``root``, ``root``'s path in it).

    The candidates are the modules in the locals of the Python frames that led to this compile: the
    user's training loop holds the model, an eagerly run ``forward`` holds its ``self``. The frame
    that called the compiled layer is on the stack by construction; walking the stack costs
    microseconds, where a search of the garbage collector's objects would cost seconds.
    """
    best, best_path = root, ""
    seen: set[int] = {id(root)}
    frame = sys._getframe(1)
    for _ in range(max_frames):
        if frame is None:
            break
        for value in frame.f_locals.values():
            if not isinstance(value, nn.Module) or id(value) in seen:
                continue
            seen.add(id(value))
            cand = _unwrapped(value)
            for path, mod in cand.named_modules(remove_duplicate=False):
                if mod is root:
                    # the outermost holder wins: the one whose path to root is longest
                    if path.count(".") + 1 > (best_path.count(".") + 1 if best_path else 0):
                        best, best_path = cand, path
                    break
        frame = frame.f_back
    return best, best_path


def top_module(root: nn.Module) -> nn.Module:
    """The user's model that holds a compiled frame's ``root`` (``root`` itself when nothing holds it)."""
    return _unwrapped(_top(root)[0])


# every parameter of every outermost module seen, by identity: a compiled frame that Dynamo reuses
# for another module of the same structure (the next decoder layer) is named from here
_ABSOLUTE = WeakTensorKeyDictionary()
_TOPS: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def _remember(top: nn.Module) -> None:
    if top in _TOPS:
        return
    _TOPS.add(top)
    for name, p in top.named_parameters(remove_duplicate=False):
        if p not in _ABSOLUTE:
            _ABSOLUTE[p] = name


def frame_names(root: nn.Module | None, example_inputs: list) -> FrameNames:
    """Absolute names of the parameters among ``example_inputs`` of a frame rooted at ``root``."""
    if root is None:
        return FrameNames()
    top, prefix = _top(root)
    strip = ""
    if top is root:  # compiled through a wrapper (torch.compile(DDP(model))): the model's own names
        inner = _unwrapped(root)
        strip = next((n + "." for n, m in root.named_modules() if m is inner and n), "")
        top = inner
    _remember(top)
    wanted = {id(v) for v in example_inputs if isinstance(v, torch.Tensor)}
    params: dict[int, str] = {}
    for name, p in top.named_parameters(remove_duplicate=False):
        if id(p) in wanted and id(p) not in params:
            params[id(p)] = name
    return FrameNames(params, prefix, strip)


def names_for(inputs: list, relative: dict[int, str]) -> FrameNames | None:
    """Names for a compiled frame called with other parameters (``relative``: input position ->
    the parameter's path from the frame root); None when a parameter was never seen."""
    params: dict[int, str] = {}
    prefix = None
    for pos, rel in relative.items():
        p = inputs[pos]
        name = _ABSOLUTE.get(p) if isinstance(p, torch.Tensor) else None
        if name is None:
            return None
        params[id(p)] = name
        if prefix is None:
            prefix = name[: -len(rel) - 1] if name.endswith("." + rel) else "" if name == rel else None
    return FrameNames(params, prefix or "")
