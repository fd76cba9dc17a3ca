"""Validation of a model's saved weights before they are loaded: the model's shapes, finite values.

Every single-process load path (:func:`fp8pass.load_checkpoint_state`, :func:`fp8pass.checkpoint.save`
before it writes, the trainer's resume) calls :func:`check_weights` before it copies a value.
"""

from __future__ import annotations

import torch

from .errors import CheckpointError

__all__ = ["check_weights"]


def check_weights(state_dict: dict, shapes: dict, prefix: str = "model") -> None:
    """The parameters of ``state_dict`` (keys of ``shapes``, the model's parameter shapes by FQN):
    each a tensor of the model's shape (checked before any value is read) and finite.

    Buffers are left out: a buffer may legitimately hold -inf (an attention mask).

    Raises:
        CheckpointError: naming the key.
    """
    present = [(k, state_dict[k]) for k in shapes if k in state_dict]
    for k, v in present:
        if not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(shapes[k]):
            raise CheckpointError(f"{prefix}.{k}: shape {tuple(getattr(v, 'shape', ()))}, the model has "
                                  f"{tuple(shapes[k])}")
    for k, v in present:
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            bad = v.reshape(-1)[~torch.isfinite(v.reshape(-1))][0].item()
            raise CheckpointError(f"{prefix}.{k}: weights must be finite, got {bad!r}; the state was saved after "
                                  "training diverged or a non-finite gradient reached the optimizer")
