"""The key layout of the FP8 state in checkpoints: the on-disk names every save and load path shares.

In ``model.state_dict()`` (and so in every checkpoint that carries it):

* ``"<param FQN>.fp8_scaling.<role>.<field>"``: delayed scaling, role in ``ROLES`` (``input`` /
  ``weight`` / ``grad_output``), field in :data:`DELAYED_FIELDS`;
* ``"<param FQN>.fp8_hcp.<field>"``: NVFP4 hot-channel patching, field in ``runtime.hcp.HCP_FIELDS``;
* ``"<param FQN>.fp8_sr.stream"``: the weight's stochastic-rounding stream.

On its own (:func:`fp8pass.scaling_state_dict`, the trainer's ``"scaling"`` entry, DCP's ``"fp8"``
entry) the marker is left out: ``"<param FQN>.<role>.<field>"``, ``"<param FQN>.hcp.<field>"``,
``"<param FQN>.sr.stream"``. Changing any of these names breaks every checkpoint written before.
"""

from __future__ import annotations

from typing import Container, Mapping

from ..runtime.state import ROLES

__all__ = ["SCALING_KEY", "HCP_KEY", "SR_KEY", "DELAYED_FIELDS", "DELAYED_KEYS", "missing_delayed_keys",
           "group_delayed_keys"]

SCALING_KEY = "fp8_scaling"  # "<param FQN>.fp8_scaling.<role>.<field>"
HCP_KEY = "fp8_hcp"  # "<param FQN>.fp8_hcp.<field>"
SR_KEY = "fp8_sr"  # "<param FQN>.fp8_sr.stream"
# the saved fields of one role's DelayedScalingState (the rest of its OP_FIELDS is per-step scratch)
DELAYED_FIELDS = ("amax_history", "scale", "steps", "skipped")
DELAYED_KEYS = tuple(f"{role}.{field}" for role in ROLES for field in DELAYED_FIELDS)  # one weight's entries


def missing_delayed_keys(sd: Mapping) -> list[str]:
    """The ``"<role>.<field>"`` entries of one weight's delayed-scaling state that ``sd`` lacks."""
    return [k for k in DELAYED_KEYS if k not in sd]


def group_delayed_keys(state_dict: Mapping, params: Container[str]) -> tuple[dict[str, dict], list[str]]:
    """``{"<param>.<role>.<field>": t}`` -> (``{param: {"<role>.<field>": t}}``, the keys naming no role of
    a parameter in ``params``)."""
    grouped: dict[str, dict] = {}
    unknown = []
    for key, v in state_dict.items():
        parts = key.rsplit(".", 2)
        if len(parts) != 3 or parts[1] not in ROLES or parts[2] not in DELAYED_FIELDS or parts[0] not in params:
            unknown.append(key)
            continue
        grouped.setdefault(parts[0], {})[f"{parts[1]}.{parts[2]}"] = v
    return grouped, unknown
