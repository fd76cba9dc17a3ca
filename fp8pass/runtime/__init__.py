"""Runtime ops (docstring written below)."""

from .casting import IDENTITY
from .linear import fp8_linear_op
from .state import ROLES, LinearScalingState, delayed_record_, record, state_for
from .swiglu import SMOOTH_MODES, channel_scales, fold_channel_scales, swiglu_down_op, token_scales

__all__ = ["IDENTITY", "fp8_linear_op", "swiglu_down_op", "delayed_record_", "record", "ROLES",
           "LinearScalingState", "state_for", "SMOOTH_MODES", "channel_scales", "token_scales",
           "fold_channel_scales"]
