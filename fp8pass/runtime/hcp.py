"""Hot-channel patching (HCP) state and the op that updates it.

The state of one NVFP4 linear is three plain tensors ``[err, hot, step]``:

* ``err`` fp32 ``[in_features]``: EMA of the forward GEMM's error through each input channel, from
  both operands (:func:`channel_error`);
* ``hot`` int64 ``[n_hot]``: the hot channels (sorted), ``n_hot = HotChannelPatching.num_hot(in)``;
* ``step`` int64 ``[]``: forward calls recorded.

``fp8pass::nvfp4_linear`` reads it (never mutates it; at ``step == 0`` it picks the hot set from the
current error) and returns the current per-channel error; ``fp8pass::hcp_update_`` then folds that
error into the EMA and, every ``update_interval`` steps, refreshes ``hot`` as the top ``n_hot``
channels of the EMA. Same split as the delayed-scaling state (fp8pass.runtime.state).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..config import HotChannelPatching
from ..op_schema import HCPUpdateKnobs, knob_op

__all__ = ["HCPState", "hcp_state_for", "hcp_update_", "select_hot", "channel_error", "HCP_FIELDS"]

HCP_FIELDS = ("err", "hot", "step")


def channel_error(x: torch.Tensor, xq: torch.Tensor, w: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """Per input channel ``c``: ``||X_c W_c^T - Q(X)_c Q(W)_c^T||_F**2``, the error both quantized
    operands put into ``X W^T`` through channel ``c`` (what patching ``c`` with second order removes).

    With ``dX = X - Q(X)`` and ``dW = W - Q(W)`` the channel's term is ``dX_c W_c^T + Q(X)_c dW_c^T``, a
    sum of two outer products, so its squared norm is
    ``|dX_c|^2 |W_c|^2 + |Q(X)_c|^2 |dW_c|^2 + 2 (dX_c . Q(X)_c)(W_c . dW_c)``: sums over tokens and over
    output rows only, no GEMM, and no cancellation between large terms.

    Args:
        x, xq: ``[tokens, in]`` input and its quantized values.
        w, wq: ``[out, in]`` weight and its quantized values.

    Returns:
        fp32 ``[in]``.
    """
    x, w = x.to(torch.float32), w.to(torch.float32)
    dx, dw = x - xq, w - wq
    err = ((dx * dx).sum(0) * (w * w).sum(0) + (xq * xq).sum(0) * (dw * dw).sum(0)
           + 2.0 * (dx * xq).sum(0) * (w * dw).sum(0))
    return torch.clamp(err, min=0.0)  # rounding can leave a tiny negative where the error is ~0


def select_hot(err: torch.Tensor, n: int) -> torch.Tensor:
    """Indices (sorted ascending) of the ``n`` largest entries of ``err`` (NaN counts as largest)."""
    if n == 0:
        return torch.zeros(0, dtype=torch.int64, device=err.device)
    return torch.sort(torch.topk(torch.nan_to_num(err, nan=float("inf")), n).indices).values


@knob_op("fp8pass::hcp_update_", "Tensor err, Tensor hot, Tensor step, Tensor chan_err", HCPUpdateKnobs, "()",
         mutates_args=("err", "hot", "step"))
def hcp_update_(err, hot, step, chan_err, *knobs) -> None:
    """Fold ``chan_err`` into the EMA ``err``; refresh ``hot`` when ``step % interval == 0``; ``step += 1``."""
    decay, interval = knobs
    first = step == 0
    new_err = torch.where(first, chan_err, decay * err + (1.0 - decay) * chan_err)
    if hot.numel():
        refresh = (step % interval) == 0
        hot.copy_(torch.where(refresh, select_hot(new_err, hot.numel()), hot))
    err.copy_(new_err)
    step.add_(1)


@hcp_update_.register_fake
def _(err, hot, step, chan_err, *knobs):
    return None


@dataclass
class HCPState:
    """HCP state of one linear (plain tensors; see the module doc).

    Args:
        config: the HotChannelPatching settings.
        in_features: the linear's input features.
        device: where the tensors live.
    """

    config: HotChannelPatching
    in_features: int
    device: torch.device | str = "cpu"

    def __post_init__(self):
        n = self.config.num_hot(self.in_features)
        self.err = torch.zeros(self.in_features, dtype=torch.float32, device=self.device)
        self.hot = torch.arange(n, dtype=torch.int64, device=self.device)
        self.step = torch.zeros((), dtype=torch.int64, device=self.device)

    def op_args(self) -> list[torch.Tensor]:
        """The live ``[err, hot, step]`` (the ops' ``hcp_state`` argument)."""
        return [self.err, self.hot, self.step]

    def update(self, chan_err: torch.Tensor) -> None:
        torch.ops.fp8pass.hcp_update_(self.err, self.hot, self.step, chan_err.detach(),
                                      float(self.config.decay), int(self.config.update_interval))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"hcp.{k}": getattr(self, k).clone() for k in HCP_FIELDS}

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        for k in HCP_FIELDS:
            v = sd[f"hcp.{k}"]
            cur = getattr(self, k)
            if tuple(v.shape) != tuple(cur.shape):
                raise ValueError(f"HCP state {k}: saved shape {tuple(v.shape)} but this config needs "
                                 f"{tuple(cur.shape)} (fraction or in_features differ)")
            cur.copy_(v)


_REGISTRY: "WeakIdKeyDictionary" = WeakIdKeyDictionary()


def hcp_state_for(weight: torch.Tensor, config: HotChannelPatching) -> HCPState:
    """The HCPState kept for ``weight`` (created on first use; freed with the weight)."""
    st = _REGISTRY.get(weight)
    if st is None:
        st = HCPState(config, int(weight.shape[1]), weight.device)
        _REGISTRY[weight] = st
    elif st.config != config:
        raise ValueError(f"this weight already has HCP state for {st.config}; pass state= explicitly to use "
                         f"{config}")
    return st
