"""Conversions between torch's Adam/AdamW state dicts and fp8pass.optim's.

* ``to_torch_state_dict(sd)``: an fp8pass state dict -> one ``torch.optim.AdamW`` (or ``Adam``)
  loads: dequantized fp32 ``exp_avg`` / ``exp_avg_sq``, fp8pass group keys dropped.
* ``from_torch_state_dict(sd, ...)``: a torch Adam(W) state dict -> an fp8pass one (quantized).
  ``fp8pass.optim.AdamW.load_state_dict`` also accepts a torch state dict directly (it calls this).
"""

from __future__ import annotations

import torch

from .moments import read_moment, write_moment
from .options import FP8_GROUP_KEYS, check_options, moment_specs

__all__ = ["to_torch_state_dict", "from_torch_state_dict", "is_torch_state_dict"]


def is_torch_state_dict(sd: dict) -> bool:
    """True for a state dict of torch's Adam/AdamW (its groups carry no fp8pass storage keys)."""
    groups = sd.get("param_groups", [])
    return bool(groups) and all("m_format" not in g for g in groups)


def _param_groups_by_id(sd: dict) -> dict:
    return {i: g for g in sd["param_groups"] for i in g["params"]}


def to_torch_state_dict(sd: dict) -> dict:
    """An fp8pass Adam(W) state dict as torch's Adam(W) state dict (fp32 moments, dequantized).

    Load the result with ``torch.optim.AdamW(params, ...).load_state_dict(...)`` (AdamW groups keep
    ``decoupled_weight_decay``; for ``Adam`` with L2 decay use ``torch.optim.Adam``).
    """
    if is_torch_state_dict(sd):
        raise ValueError("this is already a torch Adam/AdamW state dict (no m_format in its param groups)")
    by_id = _param_groups_by_id(sd)
    state = {}
    for i, st in sd["state"].items():
        numel = next(v.numel() for k, v in st.items() if k.endswith("_codes") or k in ("exp_avg", "exp_avg_sq"))
        specs = moment_specs(by_id[i], numel)
        out = {"step": st["step"].clone()}
        for spec in specs:
            out[spec.name] = read_moment(st, spec)
        state[i] = out
    groups = []
    for g in sd["param_groups"]:
        ng = {k: v for k, v in g.items() if k not in FP8_GROUP_KEYS}
        ng["amsgrad"] = False
        groups.append(ng)
    return {"state": state, "param_groups": groups}


def from_torch_state_dict(sd: dict, *, m_format: str = "e4m3", v_format: str = "e5m2", block_size: int | None = 128,
                          v_sqrt: bool = False, rounding: str = "nearest", stochastic_flush: bool = False,
                          kernels: str = "auto", bf16_stochastic_round: bool = False) -> dict:
    """A torch Adam(W) state dict as an fp8pass one: moments quantized with the given storage.

    Raises:
        ValueError: amsgrad state (``max_exp_avg_sq``), or bad options.
    """
    if not is_torch_state_dict(sd):
        raise ValueError("not a torch Adam/AdamW state dict (its param groups already carry m_format)")
    extra = dict(m_format=m_format, v_format=v_format, block_size=block_size, v_sqrt=v_sqrt, rounding=rounding,
                 stochastic_flush=stochastic_flush, kernels=kernels, bf16_stochastic_round=bf16_stochastic_round)
    groups = []
    for g in sd["param_groups"]:
        check_options(g.get("lr", 1e-3), g.get("betas", (0.9, 0.999)), g.get("eps", 1e-8),
                       g.get("weight_decay", 0.0), g.get("amsgrad", False), g.get("differentiable", False),
                       m_format, v_format, block_size, rounding, kernels)
        ng = dict(g, **extra)
        ng.setdefault("decoupled_weight_decay", False)
        groups.append(ng)
    new = {"state": {}, "param_groups": groups}
    by_id = _param_groups_by_id(new)
    for i, st in sd["state"].items():
        if "max_exp_avg_sq" in st:
            raise ValueError("the torch state holds amsgrad's max_exp_avg_sq; fp8pass.optim has no amsgrad")
        out = {"step": st["step"].clone() if isinstance(st["step"], torch.Tensor)
               else torch.tensor(float(st["step"]))}
        for spec in moment_specs(by_id[i], st["exp_avg"].numel()):
            write_moment(out, spec, st[spec.name].to(torch.float32), rounding)
        new["state"][i] = out
    return new
