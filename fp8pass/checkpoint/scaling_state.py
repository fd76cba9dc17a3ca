"""The scaling state of a model's weights as plain tensors: in ``model.state_dict()`` and on its own.

The state lives beside the weights (``fp8pass.runtime.state``, keyed by the Parameter object). It
travels two ways (the key names are :mod:`fp8pass.checkpoint.keys`):

* **in ``model.state_dict()``** (so Trainer, Lightning, DCP or a plain ``torch.save`` carry it):
  state-dict hooks on the modules that own weights with state add
  ``"<param FQN>.fp8_scaling.<role>.<field>"`` (delayed scaling; role ``input`` / ``weight`` /
  ``grad_output``, field ``amax_history`` / ``scale`` / ``steps`` / ``skipped``) and
  ``"<param FQN>.fp8_hcp.<field>"`` (NVFP4 hot-channel patching; ``err`` / ``hot`` / ``step``) and
  ``"<param FQN>.fp8_sr.stream"`` (the weight's stochastic-rounding stream, :mod:`fp8pass.runtime.sr`),
  e.g. ``"model.layers.0.mlp.down_proj.weight.fp8_scaling.grad_output.scale"``. The
  values are the live state tensors (like the weights in a state dict). The backend registers the
  hooks when it first compiles a weight; :func:`attach` registers them on a model that has not been
  compiled yet, so ``load_state_dict`` (``strict=True`` too) restores the state before the first step.
* **on its own**: :func:`scaling_state_dict` gives the same tensors (cloned) keyed
  ``"<param FQN>.<role>.<field>"``, ``"<param FQN>.hcp.<field>"`` and ``"<param FQN>.sr.stream"``;
  :func:`load_scaling_state_dict` loads them.

A model must have the hooks before it loads such a checkpoint (:func:`attach`;
:func:`fp8pass.load_checkpoint_state` and the Trainer integration call it): without them
``load_state_dict(strict=True)`` reports the keys as unexpected (the state would be lost). Into a
model that is not to train in FP8 (a bf16 reference copy, an inference export), load
:func:`without_scaling_state` of it. A checkpoint without the keys loads into any model and leaves
the state as it is.

Every loaded value is validated first (:mod:`fp8pass.checkpoint.scaling_checks`: scales finite and > 0,
histories finite and >= 0, counters in range, shapes the weight's); a violation raises
:class:`~fp8pass.checkpoint.CheckpointError` naming the key. :func:`load_scaling_state_dict` with
``strict=True`` reports unexpected and missing keys like ``nn.Module.load_state_dict``.

Usage::

    fp8pass.checkpoint.attach(model, cfg)           # only needed before the first compiled step
    model.load_state_dict(torch.load(path, weights_only=True))
    model.compile(backend=fp8pass.backend(cfg))
"""

from __future__ import annotations

import gc
import weakref

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from ..config import Config, DelayedScaling, HotChannelPatching, NVFP4Scaling
from ..numerics import get_format
from ..runtime.hcp import _REGISTRY as _HCP_REGISTRY
from ..runtime.hcp import HCP_FIELDS, hcp_state_for
from ..runtime.sr import _REGISTRY as _SR_REGISTRY
from ..runtime.sr import SRStream
from ..runtime.state import delayed_state_of, grouped_state_for, state_for
from ..switch_history import HISTORY_KEY, history, history_from_tensor, history_to_tensor, set_history, switched_config
from .errors import CheckpointError
from .keys import DELAYED_FIELDS, DELAYED_KEYS, HCP_KEY, SCALING_KEY, SR_KEY, group_delayed_keys, missing_delayed_keys
from .scaling_checks import check_delayed_state, check_hcp_state, check_sr_stream

__all__ = ["scaling_state_dict", "load_scaling_state_dict", "attach", "attach_weights", "without_scaling_state",
           "hook_precision_history", "load_delayed_state", "load_sr_stream"]

_HOOKED = "_fp8pass_state_dict_config"  # module attribute: hooks registered, and the Config they create state with


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module under ``torch.compile``'s wrapper, so keys never carry ``_orig_mod.``."""
    while hasattr(model, "_orig_mod") and isinstance(model._orig_mod, torch.nn.Module):
        model = model._orig_mod
    return model


def _formats(cfg: Config) -> tuple[str, str]:
    return (cfg.fwd_format if cfg.fwd_format != "identity" else "e4m3",
            cfg.bwd_format if cfg.bwd_format != "identity" else "e5m2")


# ---- hooks: the state in model.state_dict() ---------------------------------------------------

def _save_hook(module, state_dict, prefix, local_metadata) -> None:
    for name, p in module._parameters.items():
        if p is None:
            continue
        st = delayed_state_of(p)
        if st is not None:
            # DCP maps every key to an object by getattr along its dotted path; make the path real.
            setattr(p, SCALING_KEY, st)
            for role, s in st.roles().items():
                for field in DELAYED_FIELDS:
                    state_dict[f"{prefix}{name}.{SCALING_KEY}.{role}.{field}"] = getattr(s, field)
        hcp = _HCP_REGISTRY.get(p)
        if hcp is not None:
            setattr(p, HCP_KEY, hcp)
            for field in HCP_FIELDS:
                state_dict[f"{prefix}{name}.{HCP_KEY}.{field}"] = getattr(hcp, field)
        sr = _SR_REGISTRY.get(p)
        if sr is not None:
            setattr(p, SR_KEY, sr)
            state_dict[f"{prefix}{name}.{SR_KEY}.stream"] = sr.stream


def _load_hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
               error_msgs) -> None:
    cfg = module.__dict__.get(_HOOKED) or Config()
    for name, p in module._parameters.items():
        if p is None:
            continue
        base = f"{prefix}{name}.{SCALING_KEY}."
        keys = {k: base + k for k in DELAYED_KEYS}
        found = {k: state_dict.pop(full) for k, full in keys.items() if full in state_dict}
        if found:
            try:
                load_delayed_state(p, found, cfg, base[:-1])
            except (KeyError, ValueError) as e:
                error_msgs.append(str(e.args[0]) if e.args else repr(e))
        base = f"{prefix}{name}.{HCP_KEY}."
        found = {f"hcp.{f}": state_dict.pop(base + f) for f in HCP_FIELDS if base + f in state_dict}
        if found:
            try:
                _load_hcp_one(p, found, cfg, base[:-1])
            except (KeyError, ValueError) as e:
                error_msgs.append(str(e.args[0]) if e.args else repr(e))
        key = f"{prefix}{name}.{SR_KEY}.stream"
        if key in state_dict:
            try:
                load_sr_stream(p, state_dict.pop(key), key)
            except ValueError as e:
                error_msgs.append(str(e.args[0]) if e.args else repr(e))


def load_sr_stream(p: torch.Tensor, t: torch.Tensor, key: str) -> None:
    """Validate and load one weight's stochastic-rounding stream (made with the saved key if the
    weight has none yet: its graphs then continue the saved stream)."""
    check_sr_stream(t, key)
    st = _SR_REGISTRY.get(p)
    if st is None:
        _SR_REGISTRY[p] = SRStream(t.detach().to(device=p.device, dtype=torch.int64, copy=True))
        return
    st.load_state_dict({"sr.stream": t})


def load_delayed_state(p: torch.Tensor, sd: dict[str, torch.Tensor], cfg: Config, name: str) -> None:
    """Validate and load one weight's delayed-scaling state (creating it with ``cfg``'s recipe)."""
    missing = missing_delayed_keys(sd)
    if missing:
        raise KeyError(f"{name}: incomplete delayed-scaling state, missing {missing}")
    st = delayed_state_of(p)
    recipe = st.recipe if st is not None else (cfg.recipe if isinstance(cfg.recipe, DelayedScaling)
                                                 else DelayedScaling())
    hist = sd["input.amax_history"]
    saved_len = hist.shape[-1] if isinstance(hist, torch.Tensor) and hist.dim() else None
    if saved_len != recipe.history_len:
        raise CheckpointError(f"{name}: saved amax_history has {saved_len} entries, the config's recipe "
                              f"history_len={recipe.history_len}; pass (or attach) the Config the state was "
                              "saved with")
    check_delayed_state(sd, name, p.shape, recipe.history_len)
    if st is None:
        if p.dim() == 3:
            st = grouped_state_for(p, recipe, *_formats(cfg))
        else:
            st = state_for(p, recipe, *_formats(cfg))
    st.load_state_dict({k: t.to(p.device) for k, t in sd.items()})
    _EXPECTS_STATE.pop(p, None)


def _load_hcp_one(p: torch.Tensor, sd: dict[str, torch.Tensor], cfg: Config, name: str) -> None:
    missing = [k for k in (f"hcp.{f}" for f in HCP_FIELDS) if k not in sd]
    if missing:
        raise KeyError(f"{name}: incomplete hot-channel-patching state, missing {missing}")
    check_hcp_state(sd, name, int(p.shape[1]) if p.dim() == 2 else None)
    st = _HCP_REGISTRY.get(p)
    if st is None:
        hcp = cfg.recipe.hcp if isinstance(cfg.recipe, NVFP4Scaling) and cfg.recipe.hcp else HotChannelPatching()
        st = hcp_state_for(p, hcp)
    try:
        st.load_state_dict({k: t.to(p.device) for k, t in sd.items()})
    except ValueError as e:
        raise CheckpointError(f"{name}: {e}") from None


def _hook_once(module: torch.nn.Module, marker: str, config: Config | None, save, load) -> None:
    """Register a save/load pair of state-dict hooks on ``module`` once, marked by ``marker`` (a deep copy
    carries the hooks and the marker alike); a later call with a config only updates the config."""
    if marker in module.__dict__:
        if config is not None:
            module.__dict__[marker] = config
        return
    module.__dict__[marker] = config
    module.register_state_dict_post_hook(save)
    module.register_load_state_dict_pre_hook(load)


def _hook_module(module: torch.nn.Module, config: Config | None) -> None:
    """Register the scaling-state hooks on ``module`` once."""
    _hook_once(module, _HOOKED, config, _save_hook, _load_hook)


def attach(model: torch.nn.Module, config: Config | None = None) -> torch.nn.Module:
    """Put the scaling state of ``model``'s weights into its ``state_dict()`` / ``load_state_dict()``.

    The backend does this itself on the first compiled step; call it before loading a checkpoint
    into a model that has not run a compiled step yet. ``config`` (default ``Config()``) is the
    recipe the loaded state is created with; pass the Config you compile with. Idempotent. With
    ``config.rules``, a module that a rule matches (by its FQN or its parameters') gets that rule's
    recipe, as the backend gives its linears.

    The model's precision-switch history (``fp8pass.switch_precision``) travels in the state dict too
    (``"fp8_precision_switches"``, a uint8 tensor of its JSON): loading it restores the history, and the
    modules then load their state under the switched rules (``config``'s rules after the switches').

    Returns:
        ``model``.
    """
    top = _unwrap(model)
    hook_precision_history(top, config)
    config = switched_config(config, top) if config is not None else None
    for name, module in top.named_modules():
        if module._parameters:
            _hook_module(module, _module_config(config, name, module))
    return model


_HISTORY_HOOKED = "_fp8pass_history_config"  # model attribute: history hooks registered, and attach's Config


def hook_precision_history(model: torch.nn.Module, config: Config | None = None) -> None:
    """State-dict hooks on the user's model that save and load its precision-switch history (once)."""
    _hook_once(model, _HISTORY_HOOKED, config, _save_history_hook, _load_history_hook)


def _save_history_hook(module, state_dict, prefix, local_metadata) -> None:
    switches = history(module)
    if switches:
        state_dict[prefix + HISTORY_KEY] = history_to_tensor(switches)


def _load_history_hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                       error_msgs) -> None:
    if prefix + HISTORY_KEY not in state_dict:
        return
    try:
        switches = history_from_tensor(state_dict.pop(prefix + HISTORY_KEY), prefix + HISTORY_KEY)
    except ValueError as e:
        error_msgs.append(str(e))
        return
    set_history(module, switches)
    config = module.__dict__.get(_HISTORY_HOOKED)
    if config is not None and switches:  # the submodules load next (the root's pre-hook runs first)
        attach(module, config)


def _module_config(config: Config | None, name: str, module: torch.nn.Module) -> Config | None:
    """``config``, or the Config of the first of its rules matching the module (a "high" rule: ``config``)."""
    found = config.rule_for([name, *(f"{name}.{p}" if name else p for p in module._parameters)]) \
        if config is not None and config.rules else None
    if found is None or found[1].scaling is None:
        return config
    return found[1].site_config(config)


_ATTACHED = WeakTensorKeyDictionary()  # weights whose owners got the hooks (so a recompile costs nothing)
_OWNERS = WeakTensorKeyDictionary()  # parameter -> [(weakref(module), name)], from the last scan
# weights of a model that loaded scaling state strictly without an entry for them -> their FQN: if one
# becomes FP8 later (its first compile), the checkpoint lacked its state (see load_scaling_state_dict)
_EXPECTS_STATE = WeakTensorKeyDictionary()


def _scan_owners() -> None:
    """Map every registered parameter in the process to the modules holding it (one gc pass)."""
    _OWNERS.clear()
    for obj in gc.get_objects():
        # type(), not isinstance: isinstance asks __class__, which proxies and lazy modules forward
        if issubclass(type(obj), torch.nn.Module):
            for name, p in obj._parameters.items():
                if p is not None:
                    _OWNERS.setdefault(p, []).append((weakref.ref(obj), name))


def attach_weights(weights: list, config: Config) -> None:
    """Backend side of :func:`attach`, for the weights of one graph (the backend never sees the model).

    Finds the modules owning ``weights`` (a gc pass the first time a weight is seen: Dynamo hands
    the backend tensors, not modules), registers the state-dict hooks on them, and lets state that
    a checkpoint created before this compile (see :func:`attach`) take ``config``'s recipe.
    """
    if isinstance(config.recipe, DelayedScaling):
        missing = sorted({_EXPECTS_STATE[w] for w in weights if w in _EXPECTS_STATE and delayed_state_of(w) is None})
        if missing:
            raise KeyError(f"fp8pass: weights {missing[:5]}{' ...' if len(missing) > 5 else ''} run in FP8, but "
                           "the scaling state loaded into this model with load_scaling_state_dict(strict=True) "
                           "had no entry for them (missing keys); load the state saved from this model, or "
                           "pass strict=False to start those weights with fresh state")
    pending = [w for w in weights if isinstance(w, torch.nn.Parameter) and w not in _ATTACHED]
    if not pending:
        return
    if any(w not in _OWNERS for w in pending):
        _scan_owners()
    for w in pending:
        for ref, _ in _OWNERS.get(w, []):
            module = ref()
            if module is not None:
                _hook_module(module, config)
        _ATTACHED[w] = True
        _adopt_recipe(w, config)


def _adopt_recipe(weight: torch.Tensor, cfg: Config) -> None:
    """State loaded under another (or the default) Config takes the compiling Config's recipe.

    The state tensors do not depend on the recipe beyond the history length, so only that must match.
    """
    st = delayed_state_of(weight)
    if st is None or not isinstance(cfg.recipe, DelayedScaling):
        return
    fwd, bwd = (get_format(f) for f in _formats(cfg))
    if st.recipe == cfg.recipe and st.input.fmt == fwd and st.grad_output.fmt == bwd:
        return
    if st.recipe.history_len != cfg.recipe.history_len:
        raise ValueError(f"fp8pass: a weight's loaded scaling state has history_len={st.recipe.history_len}, "
                         f"the compile Config's recipe {cfg.recipe.history_len}; load the checkpoint with "
                         f"fp8pass.checkpoint.attach(model, config) using the Config it was saved with")
    st.recipe = cfg.recipe
    st.fwd_format, st.bwd_format = fwd, bwd
    for role, s in st.roles().items():
        s.recipe = cfg.recipe
        s.fmt = bwd if role == "grad_output" else fwd


def without_scaling_state(state_dict: dict) -> dict:
    """``state_dict`` less the scaling-state keys (for a model that will not train in FP8)."""
    markers = (f".{SCALING_KEY}.", f".{HCP_KEY}.", f".{SR_KEY}.")
    return type(state_dict)((k, v) for k, v in state_dict.items()
                            if not any(m in k for m in markers) and k.rsplit(".", 1)[-1] != HISTORY_KEY)


# ---- the state on its own ----------------------------------------------------------------------

def scaling_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """All scaling state of ``model``'s weights (cloned plain tensors; empty before step 1).

    The same tensors ``model.state_dict()`` carries, keyed by parameter FQN. ``model`` may be the
    compiled wrapper or the module itself (same keys). Tied weights appear once, under the first
    FQN ``named_parameters()`` gives.
    """
    model = _unwrap(model)
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        st = delayed_state_of(p)
        if st is not None:
            for k, v in st.state_dict().items():
                out[f"{name}.{k}"] = v
        hcp = _HCP_REGISTRY.get(p)
        if hcp is not None:  # NVFP4 hot-channel patching: "<param>.hcp.<field>"
            for k, v in hcp.state_dict().items():
                out[f"{name}.{k}"] = v
        sr = _SR_REGISTRY.get(p)
        if sr is not None:  # the stochastic-rounding stream, whatever the recipe: "<param>.sr.stream"
            for k, v in sr.state_dict().items():
                out[f"{name}.{k}"] = v
    return out


_SR_SUFFIX = ".sr.stream"


def _split_streams(model, state_dict, strict: bool) -> tuple[dict, list]:
    """``state_dict`` less its ``"<param>.sr.stream"`` entries, and those as ``[(param, tensor, key)]``,
    each validated (``check_sr_stream``); with ``strict``, a stream key naming no parameter and a
    weight whose stream this model has but ``state_dict`` lacks raise KeyError."""
    params = dict(model.named_parameters())
    rest, streams, unknown = {}, [], []
    for key, v in state_dict.items():
        if not key.endswith(_SR_SUFFIX):
            rest[key] = v
        elif key[:-len(_SR_SUFFIX)] in params:
            check_sr_stream(v, key)
            streams.append((params[key[:-len(_SR_SUFFIX)]], v, key))
        else:
            unknown.append(key)
    named = {key[:-len(_SR_SUFFIX)] for _, _, key in streams}
    missing = sorted(n for n, p in params.items() if n not in named and _SR_REGISTRY.get(p) is not None)
    if strict and (unknown or missing):
        raise KeyError(_key_report(unknown, missing, "weights with a stochastic-rounding stream in this model"))
    return rest, streams


def load_scaling_state_dict(model: torch.nn.Module, state_dict: dict[str, torch.Tensor],
                            config: Config | None = None, strict: bool = True) -> None:
    """Load a :func:`scaling_state_dict` into ``model``'s weights (copies into live state tensors).

    Every entry is validated first (see :func:`check_delayed_state`); nothing is loaded when one fails.
    The stochastic-rounding streams (``"<param>.sr.stream"``) load under any recipe.

    Args:
        model: the model (compiled or not; a compiled model's graphs see the loaded values at once).
        state_dict: from :func:`scaling_state_dict`.
        config: the Config the model is compiled with (its recipe and formats create missing states;
            default ``Config()``). The history length must equal its recipe's ``history_len``.
        strict: like ``nn.Module.load_state_dict``: raise on keys that name no parameter of ``model``
            (unexpected) and on weights that have state in ``model`` but none in ``state_dict``
            (missing). A weight of a model that has not compiled yet has no state to compare with: it is
            checked when it first becomes FP8, and a weight without saved state then raises (a
            state from a 2-layer model loaded into a 4-layer one fails at the first step).

    Raises:
        KeyError: unexpected or missing keys (``strict``), or an incomplete state of one weight.
        CheckpointError: a value out of range or a shape that differs from this model's (names the key).
    """
    model = _unwrap(model)
    cfg = config or Config()
    state_dict, streams = _split_streams(model, state_dict, strict)
    if isinstance(cfg.recipe, NVFP4Scaling):
        _load_hcp(model, state_dict, cfg.recipe, strict)
    elif not isinstance(cfg.recipe, DelayedScaling):
        if state_dict:
            raise ValueError("load_scaling_state_dict: the config uses CurrentScaling, which keeps no scaling "
                             "state besides the stochastic-rounding streams; pass the Config with the DelayedScaling "
                             f"recipe the state was saved under (keys: {sorted(state_dict)[:3]})")
    else:
        _load_delayed_states(model, state_dict, cfg, strict)
    for p, t, key in streams:  # last: a bad entry above left everything as it was
        load_sr_stream(p, t, key)


def _load_delayed_states(model, state_dict, cfg: Config, strict: bool) -> None:
    """The delayed-scaling half of :func:`load_scaling_state_dict`."""
    params = dict(model.named_parameters())
    grouped, unknown = group_delayed_keys(state_dict, params)
    missing = sorted(n for n, p in params.items() if n not in grouped and delayed_state_of(p) is not None)
    if strict and (unknown or missing):
        raise KeyError(_key_report(unknown, missing, "weights with delayed-scaling state in this model"))
    for name, sd in grouped.items():  # all first: a bad entry leaves the model untouched
        p = params[name]
        miss = missing_delayed_keys(sd)
        if miss:
            raise KeyError(f"{name}: incomplete delayed-scaling state, missing {miss}")
        if delayed_state_of(p) is not None:  # an existing state must have this recipe (else ValueError)
            (grouped_state_for if p.dim() == 3 else state_for)(p, cfg.recipe, *_formats(cfg))
        hist = sd["input.amax_history"]
        if not isinstance(hist, torch.Tensor) or hist.shape[-1:] != (cfg.recipe.history_len,):
            raise CheckpointError(f"{name}: saved amax_history has shape "
                                  f"{tuple(getattr(hist, 'shape', ()))}, the config's recipe history_len="
                                  f"{cfg.recipe.history_len}; pass the config the state was saved with")
        check_delayed_state(sd, name, p.shape, cfg.recipe.history_len)
    for name, sd in grouped.items():
        load_delayed_state(params[name], sd, cfg, name)
    if strict and grouped:
        for name, p in params.items():
            if name not in grouped and delayed_state_of(p) is None:
                _EXPECTS_STATE[p] = name


def _key_report(unknown: list[str], missing: list[str], holders: str) -> str:
    parts = [f"{what}: {keys[:5]}{' ...' if len(keys) > 5 else ''}" for what, keys in
             (("unexpected keys (they name no parameter role of this model)", unknown),
              (f"missing keys ({holders} but no entry in the state dict)", missing)) if keys]
    return "load_scaling_state_dict: " + "; ".join(parts) + " (strict=False ignores them)"


def _load_hcp(model, state_dict, recipe: NVFP4Scaling, strict: bool) -> None:
    """The NVFP4 recipe keeps only hot-channel-patching state (``<param>.hcp.<field>``)."""
    params = dict(model.named_parameters())
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    unknown = []
    for key, v in state_dict.items():
        parts = key.rsplit(".", 2)
        if len(parts) != 3 or parts[1] != "hcp" or parts[2] not in HCP_FIELDS or parts[0] not in params:
            unknown.append(key)
            continue
        grouped.setdefault(parts[0], {})[f"hcp.{parts[2]}"] = v
    missing = sorted(n for n, p in params.items() if n not in grouped and _HCP_REGISTRY.get(p) is not None)
    if strict and (unknown or missing):
        raise KeyError(_key_report(unknown, missing, "weights with HCP state in this model"))
    if grouped and recipe.hcp is None:
        raise ValueError("load_scaling_state_dict: the state holds HCP tensors but the config's NVFP4Scaling "
                         "has hcp=None; pass the config the state was saved with")
    for name, sd in grouped.items():
        miss = [f"hcp.{f}" for f in HCP_FIELDS if f"hcp.{f}" not in sd]
        if miss:
            raise KeyError(f"{name}: incomplete hot-channel-patching state, missing {miss}")
        check_hcp_state(sd, f"{name}.hcp", int(params[name].shape[1]) if params[name].dim() == 2 else None)
    for name, sd in grouped.items():
        p = params[name]
        try:
            hcp_state_for(p, recipe.hcp).load_state_dict({k: t.to(p.device) for k, t in sd.items()})
        except ValueError as e:
            raise CheckpointError(f"{name}.hcp: {e}") from None
