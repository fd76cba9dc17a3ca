"""The planted outlier channel of experiment 2 (experiments/instability.py): where it points, how it
is written into a model, and the trainer callback that keeps it there.

In every layer, SwiGLU channel 0 gets ``w_gate[0] = w_up[0] = α·u`` (w1 = w2, the aligned state of
Theorem 1) and ``w_down[:, 0]`` is divided by α², so the model's function barely changes in exact
arithmetic. ``u`` is a unit direction fitted on the layer's MLP inputs: u·x > 0 on the tokens of a
trigger byte, and, per :data:`PLANTS`, far below 0 (``saturated``) or near 0 (``sparse``) elsewhere.
"""

from __future__ import annotations

import torch

BYTE = ord("#")
# How the planted channel's pre-activation u·x behaves on the tokens that do not trigger it.
PLANTS = {
    "saturated": "u·x < 0 (far from 0) on other tokens: the neuron is saturated everywhere, Theorem 1's "
                 "premise (σ′ → 0); its linear branch is large on every token",
    "sparse": "u·x ≈ 0 on other tokens: the channel is large only where it fires",
}


@torch.no_grad()
def mlp_inputs(model, tokens):
    xs = {}
    hooks = [layer.mlp.register_forward_pre_hook(
        lambda mod, a, i=i: xs.__setitem__(i, a[0].detach().reshape(-1, a[0].shape[-1]).float()))
        for i, layer in enumerate(model.layers)]
    try:
        model(tokens)
    finally:
        for h in hooks:
            h.remove()
    return xs


def fit_sample(data, seed, trigger=BYTE, min_hits=8):
    """Training windows to fit the plant on: 4 random batches, plus, if they hold fewer than
    ``min_hits`` trigger tokens (a rare trigger byte; ``#`` has 29-91 there for seeds 0-7), 64 windows
    that contain the trigger."""
    tokens = torch.cat([data.batch("train", 16, 128, seed + 777, s)[0] for s in range(4)])
    if int((tokens == trigger).sum()) < min_hits:
        pos = (data.train[:-129] == trigger).nonzero().flatten()
        if pos.numel() == 0:
            raise ValueError(f"trigger byte {chr(trigger)!r} does not occur in the training data; pick another")
        g = torch.Generator().manual_seed(seed + 778)
        pick = pos[torch.randperm(pos.numel(), generator=g)[:64]]
        starts = (pick - torch.randint(0, 128, (pick.numel(),), generator=g)).clamp(min=0)
        tokens = torch.cat([tokens, data.train[starts[:, None] + torch.arange(128)].long()])
    return tokens


def fit_directions(model, data, seed, kind="saturated", trigger=BYTE):
    """Per layer, a unit direction u for the planted channel (see PLANTS), fitted on that layer's MLP
    inputs for a fixed sample of training tokens (:func:`fit_sample`)."""
    if kind not in PLANTS:
        raise ValueError(f"unknown plant {kind!r}; valid: {', '.join(PLANTS)}")
    tokens = fit_sample(data, seed, trigger)
    labels = (tokens.reshape(-1) == trigger).float()
    weight = torch.where(labels > 0, 1.0 / labels.mean(), 1.0)
    dirs, stats = [], []
    for i, x in sorted(mlp_inputs(model, tokens).items()):
        if kind == "saturated":  # u·x > 0 on the trigger, < 0 elsewhere: logistic regression, no bias
            u = torch.zeros(x.shape[1], requires_grad=True)
            opt = torch.optim.Adam([u], lr=0.05)
            for _ in range(300):
                loss = torch.nn.functional.binary_cross_entropy_with_logits(x @ u, labels, weight=weight)
                opt.zero_grad()
                loss.backward()
                opt.step()
            u = u.detach()
        else:  # u·x ≈ 1 on the trigger, ≈ 0 elsewhere: weighted ridge regression, closed form
            xw = x * weight[:, None]
            u = torch.linalg.solve(xw.T @ x + 1e-3 * x.shape[0] * torch.eye(x.shape[1]), xw.T @ labels)
        u = u / u.norm()
        z = x @ u
        off = z[labels == 0]
        stats.append({"layer": i, "ux_on_trigger_mean": z[labels > 0].mean().item(), "trigger_tokens": int(labels.sum()),
                      "others_positive_frac": (off > 0).float().mean().item(),
                      "others_abs_mean": off.abs().mean().item(), "others_abs_q99": off.abs().quantile(0.99).item()})
        dirs.append(u)
    return dirs, stats


def plant(model, dirs, alpha, down_cols):
    with torch.no_grad():
        for layer, u, col in zip(model.layers, dirs, down_cols):
            layer.mlp.gate_proj.weight[0] = alpha * u
            layer.mlp.up_proj.weight[0] = alpha * u
            layer.mlp.down_proj.weight[:, 0] = col / alpha ** 2


class Planter:
    """Trainer callback: plant at ``at``, then re-pin after every step."""

    def __init__(self, data, at, alpha, seed, log_to, kind="saturated", trigger=BYTE):
        self.data, self.at, self.alpha, self.seed, self.log_to = data, at, alpha, seed, log_to
        self.kind, self.trigger = kind, trigger
        self.dirs = None

    def __call__(self, step, model, log, final=False):
        if step < self.at:
            return
        if self.dirs is None:
            self.dirs, stats = fit_directions(model, self.data, self.seed, self.kind, self.trigger)
            self.cols = [layer.mlp.down_proj.weight[:, 0].detach().clone() for layer in model.layers]
            log({"kind": "plant", "step": step, "alpha": self.alpha, "plant": self.kind, "directions": stats})
            self.log_to.update(directions=stats)
        plant(model, self.dirs, self.alpha, self.cols)

    def zero_grads(self, step, model):
        if self.dirs is None:
            return
        for layer in model.layers:
            mlp = layer.mlp
            for w, idx in ((mlp.gate_proj.weight, 0), (mlp.up_proj.weight, 0)):
                if w.grad is not None:
                    w.grad[idx] = 0
            if mlp.down_proj.weight.grad is not None:
                mlp.down_proj.weight.grad[:, 0] = 0
