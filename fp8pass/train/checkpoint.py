"""Checkpoints: model, optimizer, fp8 scaling state, RNG and data position as plain tensors.

Everything is saved as tensors, numbers, strings and containers, so ``torch.load(weights_only=True)``
reads it. The data position is the number of completed steps (batches are a function of
(seed, step), see :mod:`fp8pass.train.data`).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import torch

from ..checkpoint import set_torch_rng_state, torch_rng_state

__all__ = ["save_checkpoint", "load_checkpoint", "CHECKPOINT_NAME", "rng_state", "set_rng_state"]

CHECKPOINT_NAME = "checkpoint.pt"
FORMAT_VERSION = 1


def rng_state() -> dict:
    """torch's generators (what stochastic rounding draws from), Python's and NumPy's."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    torch_state = torch_rng_state()
    return {"torch": torch_state["cpu"], "torch_cuda": torch_state["cuda"], "python": random.getstate(),
            "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached": float(cached)}}


def set_rng_state(state: dict) -> None:
    set_torch_rng_state({"cpu": state["torch"], "cuda": state.get("torch_cuda", [])})
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))


def save_checkpoint(run_dir: str | os.PathLike, *, step: int, config: dict, model_state: dict,
                    optimizer_state: dict, scaling_state: dict | None, data_fingerprint: str) -> Path:
    """Write ``run_dir/checkpoint.pt`` atomically (temp file + rename), so a kill never leaves half a file."""
    path = Path(run_dir) / CHECKPOINT_NAME
    tmp = path.with_suffix(".tmp")
    torch.save({"format": FORMAT_VERSION, "step": step, "config": config, "model": model_state,
                "optimizer": optimizer_state, "scaling": scaling_state, "rng": rng_state(),
                "data": {"position": step, "fingerprint": data_fingerprint}}, tmp)
    os.replace(tmp, path)
    return path


def load_checkpoint(run_dir: str | os.PathLike) -> dict:
    path = Path(run_dir)
    if path.is_dir():
        path = path / CHECKPOINT_NAME
    if not path.exists():
        raise FileNotFoundError(f"--resume {run_dir}: no {CHECKPOINT_NAME} there (checkpoints are written "
                                "every --ckpt-every steps and at the end of a run)")
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    if ckpt.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path}: checkpoint format {ckpt.get('format')!r}, expected {FORMAT_VERSION}")
    return ckpt
