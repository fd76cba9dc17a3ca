"""The random generators' states as plain tensors and containers: saved, checked, restored.

Stochastic rounding of the gradients draws its bits from torch's default generators (the CPU one,
and each CUDA device's), so an exact resume restores them. Two layouts, each fixed by the
checkpoints already written with it:

* :func:`torch_rng_state`: torch's generators, ``{"cpu": ByteTensor, "cuda": [ByteTensor, ...]}``
  (the ``"rng"`` entry of :func:`fp8pass.checkpoint_state`);
* :func:`rng_state`: those plus Python's and NumPy's global generators (the trainer's ``"rng"``
  entry), ``{"torch", "torch_cuda", "python", "numpy"}``; :func:`check_rng_state` tries such a state
  on scratch generators before anything global changes.

Everything is a tensor, number, string or container, so ``torch.load(weights_only=True)`` reads it.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from .errors import CheckpointError

__all__ = ["torch_rng_state", "set_torch_rng_state", "rng_state", "set_rng_state", "check_rng_state"]

_MT19937_WORDS = 624  # NumPy's legacy generator state: 624 32-bit words


def torch_rng_state() -> dict:
    """The states of torch's default generators: CPU, and every CUDA device once CUDA is in use."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    return {"cpu": torch.get_rng_state(), "cuda": list(cuda)}


def set_torch_rng_state(state: dict) -> None:
    """Restore :func:`torch_rng_state` (CUDA states only where they were saved)."""
    cpu = state.get("cpu") if isinstance(state, dict) else None
    want = torch.get_rng_state()
    if not isinstance(cpu, torch.Tensor) or cpu.dtype != want.dtype or cpu.shape != want.shape:
        raise CheckpointError(f"rng.cpu: expected a {want.dtype} tensor of shape {tuple(want.shape)} (torch's CPU "
                              f"generator state), got {getattr(cpu, 'dtype', type(cpu).__name__)} "
                              f"{tuple(getattr(cpu, 'shape', ()))}")
    torch.set_rng_state(cpu)
    if state.get("cuda"):
        if not torch.cuda.is_available() or torch.cuda.device_count() < len(state["cuda"]):
            raise RuntimeError(f"the checkpoint holds the RNG state of {len(state['cuda'])} CUDA devices; "
                               f"this process sees {torch.cuda.device_count() if torch.cuda.is_available() else 0}")
        torch.cuda.set_rng_state_all(state["cuda"])


def rng_state() -> dict:
    """torch's generators (what stochastic rounding draws from), Python's and NumPy's."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    torch_state = torch_rng_state()
    return {"torch": torch_state["cpu"], "torch_cuda": torch_state["cuda"], "python": random.getstate(),
            "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached": float(cached)}}


def _unpack(state: dict) -> tuple:
    """(torch CPU state, python state, numpy state) of a :func:`rng_state` in the forms the setters take."""
    py, n = state["python"], state["numpy"]
    return (state["torch"], (py[0], tuple(py[1]), py[2]),
            (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))


def set_rng_state(state: dict) -> None:
    """Restore :func:`rng_state` (check it first with :func:`check_rng_state`)."""
    set_torch_rng_state({"cpu": state["torch"], "cuda": state.get("torch_cuda", [])})
    _, py, n = _unpack(state)
    random.setstate(py)
    np.random.set_state(n)


def check_rng_state(state) -> None:
    """Check a :func:`rng_state` on scratch generators (their own checks; nothing global changes).

    Raises:
        CheckpointError: naming the generator whose state is malformed.
    """
    want = {"torch": tuple(torch.get_rng_state().shape), "numpy keys": (_MT19937_WORDS,)}
    got = {"torch": state.get("torch") if isinstance(state, dict) else None,
           "numpy keys": state["numpy"].get("keys") if isinstance(state, dict) and isinstance(state.get("numpy"), dict)
           else None}
    for what, t in got.items():  # shapes first: a crafted view may claim billions of elements
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != want[what]:
            raise CheckpointError(f"rng: {what} state must be a tensor of shape {want[what]}, got "
                                  f"{tuple(getattr(t, 'shape', ())) if isinstance(t, torch.Tensor) else type(t).__name__}")
    try:
        t, py, n = _unpack(state)
        torch.Generator().set_state(t)
        random.Random().setstate(py)
        np.random.RandomState().set_state(n)
    except Exception as e:  # each library raises its own types for a malformed state
        raise CheckpointError(f"rng: not a valid generator state ({type(e).__name__}: {e})") from None
