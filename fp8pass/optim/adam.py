"""``fp8pass.optim.Adam`` / ``AdamW``: torch's Adam(W) with moments stored in FP8 (one byte each).

Same hyper-parameters and semantics as ``torch.optim.Adam`` / ``AdamW`` (bias correction, decoupled
or L2 weight decay, ``maximize``, ``capturable``), plus the storage options of the moments. The state
of a parameter holds plain tensors only (see ``moments.py`` for the layout)::

    step                      fp32 scalar (on the parameter's device when capturable), as in torch
    exp_avg_codes             float8_e4m3fn, the parameter's shape     (m_format="e4m3")
    exp_avg_scale             fp32 [ceil(numel / block_size)]          ([1] with block_size=None)
    exp_avg_sq_codes          float8_e5m2, the parameter's shape       (v_format="e5m2")
    exp_avg_sq_scale          fp32 [ceil(numel / block_size)]
    (exp_avg_sq_sqrt_codes / exp_avg_sq_sqrt_scale instead with v_sqrt=True: sqrt(v) is stored)

so ``state_dict()`` / ``load_state_dict()`` round-trip exactly and ``torch.load(weights_only=True)``
reads a checkpoint. bf16/fp32 moment formats store ``exp_avg`` / ``exp_avg_sq`` like torch.
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..checkpoint.optimizer_checks import check_optimizer_state, saved_param_shapes
from ..kernels import family_name, forced
from . import compiled_step
from .moments import MomentSpec, init_moment, num_blocks, read_moment, write_moment
from .offload import StateOffload
from .options import FP8_GROUP_KEYS, check_bf16_sr, check_offload_state, check_options, check_param, moment_specs
from .sharded import flat_offset, init_sharded_moment, is_dtensor, local_view
from .torch_state_dict import from_torch_state_dict, is_torch_state_dict
from .torch_step import (
    CHUNK,
    WeightSeed,
    adam_step_torch,
    device_hyper_params,
    draw_weight_seeds,
    host_hyper_params,
)

__all__ = ["Adam", "AdamW", "state_nbytes"]

# kernels="auto" on CPU compiles the chunk update when a step updates this many elements in all (one
# compiled graph, dynamic in the block count, serves every tensor of the optimizer); smaller
# optimizers, where compiling (seconds to a minute) would not pay off, stay eager.
AUTO_COMPILE_NUMEL = 1 << 20
# Scale blocks up to this width are done by one program of the fused Triton kernel; wider ones (one
# scale for a whole large tensor) by the split-block kernels, one program per span of the block.
TRITON_MAX_BLOCK = 1 << 13


class Adam(torch.optim.Optimizer):
    """Adam with FP8 moments; ``decoupled_weight_decay=True`` makes it AdamW (as in torch).

    Args:
        params: parameters or param groups (as for any torch optimizer).
        lr, betas, eps, weight_decay, maximize, capturable, decoupled_weight_decay: as in
            ``torch.optim.Adam`` (``lr`` may be a tensor).
        amsgrad: must be False (a clear error otherwise).
        m_format: first-moment storage: "e4m3" (default), "e5m2", "bf16" or "fp32".
        v_format: second-moment storage: "e5m2" (default), "e4m3", "bf16" or "fp32".
        block_size: elements per fp32 block scale (default 128), or None for one scale per tensor
            (the paper's granularity). Blocks run over the flattened parameter; a tensor smaller
            than a block, or the tail of one, is a partial block.
        v_sqrt: store ``sqrt(v)`` instead of ``v`` when ``v_format`` is FP8 (default False: v itself,
            the paper's form; what was measured for each, in docs/optim.md).
        rounding: "nearest" (default) or "stochastic" for the FP8 moments.
        stochastic_flush: round values below the format's smallest subnormal stochastically to 0 or
            the smallest subnormal (unbiased underflow) while everything else rounds to nearest.
        bf16_stochastic_round: the parameters are bf16 and are the only copy of the weights (no fp32
            master): the new weight is computed in fp32 and rounded stochastically to bf16 (unbiased),
            so updates smaller than half a bf16 step still move the weight on average (torchao's
            option of the same name). Every parameter of such a group must be bf16. Default False.
        kernels: "auto" (Triton on CUDA; on CPU "compiled" when the optimizer's parameters hold
            >= 2**20 elements in all and "torch" for smaller ones; ``FP8PASS_KERNELS=torch|triton``
            forces a family), "torch" (eager chunks), "compiled" (the torch path's chunk update through
            ``torch.compile``, one graph for every tensor size: fastest on CPU, seconds to a minute of
            compilation at the first step) or "triton".
        generator: torch.Generator for stochastic rounding (reproducible runs).
        foreach, fused: accepted for signature compatibility and ignored (this optimizer always runs
            its own chunked torch path or its fused Triton kernel).
        differentiable: must be False.
        offload_state: keep the state (moments and their scales) in host memory between steps, pinned
            on CUDA; the step copies each parameter's state to its device on a side stream (the next
            one's while this one updates) and back (``optim/offload.py``). Default False. Not part of
            the state dict, whose format does not change.
    """

    def __init__(self, params, lr: float | torch.Tensor = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, *, maximize: bool = False,
                 capturable: bool = False, differentiable: bool = False, decoupled_weight_decay: bool = False,
                 m_format: str = "e4m3", v_format: str = "e5m2", block_size: int | None = 128, v_sqrt: bool = False,
                 rounding: str = "nearest", stochastic_flush: bool = False, kernels: str = "auto",
                 bf16_stochastic_round: bool = False,
                 generator: torch.Generator | None = None, foreach: bool | None = None,
                 fused: bool | None = None, offload_state: bool = False):
        check_offload_state(offload_state)
        check_options(lr, betas, eps, weight_decay, amsgrad, differentiable, m_format, v_format, block_size,
                       rounding, kernels)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=False,
                        maximize=maximize, capturable=capturable, differentiable=False,
                        decoupled_weight_decay=decoupled_weight_decay, foreach=foreach, fused=fused,
                        m_format=m_format, v_format=v_format, block_size=block_size, v_sqrt=v_sqrt,
                        rounding=rounding, stochastic_flush=stochastic_flush, kernels=kernels,
                        bf16_stochastic_round=bf16_stochastic_round)
        super().__init__(params, defaults)
        self.generator = generator
        self._workspaces: dict = {}
        self._numel: dict = {}  # device type -> elements of the parameters on it (for kernels="auto")
        self._host_steps = WeakIdKeyDictionary()  # CPU step tensor -> (its _version, its value) as last set
        self._offload = StateOffload(self) if offload_state else None

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        self.__dict__.setdefault("_numel", {}).clear()
        g = self.param_groups[-1]
        check_options(g["lr"], g["betas"], g["eps"], g["weight_decay"], g["amsgrad"], g["differentiable"],
                       g["m_format"], g["v_format"], g["block_size"], g["rounding"], g["kernels"])
        for p in g["params"]:
            check_param(p)
        check_bf16_sr(g)

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__.setdefault("generator", None)
        self.__dict__.setdefault("_workspaces", {})
        self.__dict__.setdefault("_host_steps", WeakIdKeyDictionary())
        self.__dict__.setdefault("_numel", {})
        self.__dict__.setdefault("_offload", None)

    # -- state ---------------------------------------------------------------------------------

    def _init_state(self, p: torch.Tensor, group: dict, state: dict) -> None:
        """Create the state of ``p``, or convert torch-layout moments (``to_fp8`` mid-training)."""
        specs = moment_specs(group, p.numel())
        if "step" not in state:
            dev = p.device if group["capturable"] else "cpu"
            state["step"] = torch.zeros((), dtype=torch.float32, device=dev)
        for spec in specs:
            if all(k in state for k in spec.keys):
                _check_moment(p, state, spec)
                continue
            old = _find_dense_moment(state, spec.name)
            if old is not None:
                value = state.pop(spec.name).to(torch.float32)
                write_moment(state, spec, value.reshape(p.shape), group["rounding"], self._generator_for(p))
            elif any(k in state for k in _fp8_keys(spec.name)):
                raise ValueError(
                    f"the optimizer state of a parameter of shape {tuple(p.shape)} stores {spec.name} as "
                    f"{sorted(k for k in state if k.startswith(spec.name))}, but its group asks for "
                    f"{list(spec.keys)} ({spec.fmt}, v_sqrt={spec.sqrt}); formats cannot change in place: "
                    f"export with fp8pass.optim.to_torch_state_dict and reload")
            elif is_dtensor(p):
                init_sharded_moment(state, spec, p)
            else:
                init_moment(state, spec, p)

    def _generator_for(self, p):
        g = self.generator
        return g if g is not None and g.device == p.device else None

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict saved by this class (exactly), or by torch's Adam/AdamW (quantized).

        A torch state dict (its groups lack ``m_format``) is converted with
        ``from_torch_state_dict`` using this optimizer's storage options. Values are checked first
        (``step`` in range, FP8 block scales finite and > 0; see ``fp8pass.checkpoint.optimizer_checks``): a bad entry raises
        ``fp8pass.checkpoint.CheckpointError`` naming it, and nothing is loaded.
        """
        check_optimizer_state(state_dict, params=saved_param_shapes(self, state_dict))  # shapes before values
        if is_torch_state_dict(state_dict):
            opts = {k: self.defaults[k] for k in FP8_GROUP_KEYS}
            state_dict = from_torch_state_dict(state_dict, **opts)
        saved = copy.deepcopy(state_dict)
        super().load_state_dict(state_dict)
        # torch casts every floating state tensor to the parameter's dtype; put back codes and scales
        # exactly as saved (on the parameter's device), and fill group keys older dicts lack.
        ids = [i for g in saved["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(ids, params):
            if i in saved["state"]:
                st = self.state[p]
                for k, v in saved["state"][i].items():
                    if isinstance(v, torch.Tensor) and k != "step":
                        st[k] = v.to(device=p.device)
        for g in self.param_groups:
            for k, v in self.defaults.items():
                g.setdefault(k, v)
            for p in g["params"]:
                if p in self.state and self.state[p]:
                    self._init_state(p, g, self.state[p])  # validates shapes and dtypes
        if self.__dict__.get("_offload") is not None:
            self._offload.evict_all(self)

    # -- step ----------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        """One optimisation step; ``closure`` re-evaluates the model and returns the loss.

        On an accelerator the step reads nothing back to the host and builds no tensor from host data:
        the step counts advance in one multi-tensor op per device, and the hyper-parameters reach the
        Triton kernels as fp32 arguments (a step count kept on the host, the default) or are computed
        on the device for all tensors at once (``capturable=True``: ``torch_step.device_hyper_params``).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        known_steps = self.__dict__.setdefault("_host_steps", WeakIdKeyDictionary())  # absent after to_fp8
        offload = self.__dict__.get("_offload")  # state in host memory: one parameter at a time, its state on its device
        for group in (offload.groups(self) if offload is not None else self.param_groups):
            decoupled = bool(group.get("decoupled_weight_decay", False))
            coupled_wd = not decoupled and group["weight_decay"] != 0
            todo = []  # (p, grad, state, m_spec, v_spec) of the parameters with a gradient
            for p in group["params"]:
                if p.grad is None:
                    continue
                _check_grad(p, p.grad)
                m_spec, v_spec = moment_specs(group, p.numel())
                state = self.state[p]
                if not state or any(k not in state for k in (*m_spec.keys, *v_spec.keys)):
                    self._init_state(p, group, state)
                todo.append((p, p.grad, state, m_spec, v_spec))
            if not todo:
                continue
            steps = [st["step"] for _, _, st, _, _ in todo]
            host = not group["capturable"] and not isinstance(group["lr"], torch.Tensor)
            counts = []  # a count kept on the CPU (the default, as in torch): known, or read there below
            for s in steps:
                known = known_steps.get(s) if host and s.device.type == "cpu" else None
                fresh = known is not None and known[0] == s._version and s.dtype in _PLUS_ONE
                counts.append(_PLUS_ONE[s.dtype](known[1]) if fresh else None)  # unchanged since this optimizer's add
            for same_device in _by_device(steps).values():  # one multi-tensor add per device
                torch._foreach_add_(same_device, 1)
            for i, s in enumerate(steps):
                if host and s.device.type == "cpu":
                    if counts[i] is None:  # a new, loaded or edited counter: one read, on the CPU
                        counts[i] = float(s)
                    known_steps[s] = (s._version, counts[i])
            hps = _hyper_params(group, decoupled, [(p.device, s, c) for (p, *_), s, c in zip(todo, steps, counts)])
            wseeds = [None] * len(todo)
            if group.get("bf16_stochastic_round"):
                wseeds = self._weight_seeds([p for p, *_ in todo])
            batches: dict = {}  # (m_spec, v_spec) -> [(p, grad, state, hp, weight seed)]: one Triton launch per kind
            wide: list = []  # (p, grad, state, hp, m_spec, v_spec, weight seed) of blocks too wide for one program
            for (p, grad, state, m_spec, v_spec), hp, wseed in zip(todo, hps, wseeds):
                if is_dtensor(p):  # FSDP2 shard: update the local shard and its blocks
                    p, grad, state = local_view(p, grad, state)
                if self._kind(group, p) == "triton" and p.is_contiguous():
                    if m_spec.block <= TRITON_MAX_BLOCK:
                        batches.setdefault((m_spec, v_spec), []).append((p, grad.contiguous(), state, hp, wseed))
                    else:
                        wide.append((p, grad.contiguous(), state, hp, m_spec, v_spec, wseed))
                else:
                    self._update(p, grad, state, group, m_spec, v_spec, hp, coupled_wd, wseed)
            opts = dict(maximize=group["maximize"], coupled_wd=coupled_wd, rounding=group["rounding"],
                        stochastic_flush=group["stochastic_flush"], generator=self.generator)
            for (m_spec, v_spec), batch in batches.items():
                from ..kernels.triton_adam import adam_step_triton_multi

                *tensors, batch_seeds = zip(*batch)
                adam_step_triton_multi(*tensors, m_spec, v_spec, weight_seeds=batch_seeds, **opts)
            if wide:  # one pair of launches for all of them, whatever their widths
                from ..kernels.triton_adam_split import adam_step_triton_split

                *tensors, wide_seeds = zip(*wide)
                adam_step_triton_split(*tensors, weight_seeds=wide_seeds, **opts)
        return loss

    def _kind(self, group, p) -> str:
        """The kernels that update ``p``: the group's choice, "auto" resolved for p's device and for the
        optimizer's size on that device (one compilation serves all its tensors)."""
        kind = group["kernels"]
        if kind == "auto":
            kind = family_name(p.device)
            if kind == "torch" and not forced() and p.device.type == "cpu" and \
                    self._device_numel("cpu") >= AUTO_COMPILE_NUMEL:
                kind = "compiled"
        return kind

    def _device_numel(self, device_type: str) -> int:
        counts = self.__dict__.setdefault("_numel", {})  # absent on an optimizer converted by to_fp8
        n = counts.get(device_type)
        if n is None:  # parameters never change size; a new param group resets the count
            n = sum(p.numel() for g in self.param_groups for p in g["params"] if p.device.type == device_type)
            counts[device_type] = n
        return n

    def _weight_seeds(self, params: list) -> list[WeightSeed]:
        """``bf16_stochastic_round``: the seed and first counter of each of a group's ``params`` (those
        updated this step, in order) for this step. All paths (torch, compiled, Triton) round with these,
        so they stay bit-identical. One draw per device (``torch_step.draw_weight_seeds``: O(1) launches,
        no host read); parameter j on a device takes that draw's seed j. The counter of a parameter's
        element i is i; an FSDP2 shard's element i takes the counter of its place in the whole flattened
        parameter (``sharded.flat_offset``), so a sharded step rounds as one process does."""
        out: list = [None] * len(params)
        for device, index in _indices_by_device(params).items():
            gen = self.generator if self.generator is not None and self.generator.device == device else None
            seeds = draw_weight_seeds(len(index), gen, device)
            for j, i in enumerate(index):
                out[i] = WeightSeed(seeds[j], flat_offset(params[i]) if is_dtensor(params[i]) else 0)
        return out

    def _update(self, p, grad, state, group, m_spec, v_spec, hp, coupled_wd, weight_seed=None) -> None:
        """The torch paths (eager or compiled) for one parameter: what the Triton kernels do not take."""
        kind = self._kind(group, p)
        opts = dict(maximize=group["maximize"], coupled_wd=coupled_wd, rounding=group["rounding"],
                    stochastic_flush=group["stochastic_flush"], generator=self._generator_for(p),
                    weight_seed=weight_seed)
        step_fn = adam_step_torch
        if kind == "compiled" and m_spec.block <= CHUNK:  # larger blocks take the two-pass torch path
            step_fn = compiled_step.adam_step_compiled  # looked up per call: tests swap it for a spy
            if group["kernels"] == "auto":
                step_fn = compiled_step.guarded(step_fn)
        ws = self._workspaces.get(p.device)
        ws = step_fn(p, grad, state, m_spec, v_spec, hp, workspace=ws, **opts)
        self._workspaces[p.device] = ws

    # -- inspection ----------------------------------------------------------------------------

    def moments(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(exp_avg, exp_avg_sq) of ``p`` dequantized to fp32 (zeros before the first step)."""
        for group in self.param_groups:
            if any(q is p for q in group["params"]):
                state = self.state.get(p)
                if not state or "step" not in state:
                    return torch.zeros_like(p, dtype=torch.float32), torch.zeros_like(p, dtype=torch.float32)
                return tuple(read_moment(state, s) for s in moment_specs(group, p.numel()))
        raise ValueError("this tensor is not a parameter of the optimizer")


class AdamW(Adam):
    """AdamW (decoupled weight decay, default 1e-2) with FP8 moments; see :class:`Adam` for the options."""

    def __init__(self, params, lr: float | torch.Tensor = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, **kwargs):
        if "decoupled_weight_decay" in kwargs and not kwargs["decoupled_weight_decay"]:
            raise ValueError("AdamW always decouples weight decay; use fp8pass.optim.Adam for L2 decay")
        kwargs["decoupled_weight_decay"] = True
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)


# count + 1 as a step tensor of the dtype computes it (fp32 stops counting at 2**24, as the tensor does)
_PLUS_ONE = {torch.float32: lambda c: float(np.float32(c) + np.float32(1)), torch.float64: lambda c: c + 1.0}


def _by_device(tensors: list) -> dict:
    """``tensors`` grouped by device, in order."""
    out: dict = {}
    for t in tensors:
        out.setdefault(t.device, []).append(t)
    return out


def _indices_by_device(tensors: list) -> dict:
    """device -> the indices of ``tensors`` on it, in order."""
    out: dict = {}
    for i, t in enumerate(tensors):
        out.setdefault(t.device, []).append(i)
    return out


def _hyper_params(group: dict, decoupled: bool, where: list) -> list:
    """Per parameter, the scalars of its step (``torch_step.HP_FIELDS``).

    Args:
        group: the param group.
        decoupled: AdamW's decay.
        where: per parameter its device, its (already advanced) step tensor and the step count known on
            the host, or None where it is not to be read (``capturable=True``, a tensor ``lr``, or a
            step tensor on a device).

    Returns:
        per parameter ``host_hyper_params``' values (Python floats, computed once per distinct count)
        when its count was read, else a row of the ``device_hyper_params`` tensor computed by a fixed
        number of ops for all such parameters on its device (steps on the CPU are copied there).
    """
    beta1, beta2 = (float(b) for b in group["betas"])
    lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
    out: list = [None] * len(where)
    on_device: dict = {}  # param device -> [(index, step tensor)]
    host: dict = {}  # step count -> host values
    for i, (device, step, count) in enumerate(where):
        if count is not None:
            if count not in host:
                host[count] = host_hyper_params(lr, beta1, beta2, eps, wd, count, decoupled)
            out[i] = host[count]
        else:
            on_device.setdefault(device, []).append((i, step))
    for device, items in on_device.items():
        rows = device_hyper_params(lr, beta1, beta2, eps, wd, [s for _, s in items], decoupled, device)
        for (i, _), row in zip(items, rows.unbind(0)):
            out[i] = row
    return out


def _check_grad(p: torch.Tensor, grad: torch.Tensor) -> None:
    if grad.is_sparse or grad.layout != torch.strided:
        raise RuntimeError("fp8pass.optim does not support sparse gradients (as torch's Adam(W)); "
                           "use torch.optim.SparseAdam for sparse embeddings")
    if torch.is_complex(grad):
        raise ValueError("fp8pass.optim does not support complex gradients")
    if grad.shape != p.shape:
        raise ValueError(f"gradient shape {tuple(grad.shape)} does not match parameter shape {tuple(p.shape)}")


def _fp8_keys(name: str) -> tuple[str, ...]:
    return tuple(f"{name}{root}_{part}" for root in ("", "_sqrt") for part in ("codes", "scale"))


def _find_dense_moment(state: dict, name: str):
    t = state.get(name)
    return t if isinstance(t, torch.Tensor) and t.is_floating_point() else None


def _check_moment(p: torch.Tensor, state: dict, spec: MomentSpec) -> None:
    if spec.fp8:
        codes, scale = state[spec.codes_key], state[spec.scale_key]
        want = num_blocks(p.numel(), spec.block)
        if codes.shape != p.shape or codes.dtype != spec.dtype or scale.shape != (want,) or \
                scale.dtype != torch.float32:
            raise ValueError(
                f"state {spec.codes_key}/{spec.scale_key} of a parameter of shape {tuple(p.shape)} has "
                f"{tuple(codes.shape)} {codes.dtype} / {tuple(scale.shape)} {scale.dtype}; expected "
                f"{tuple(p.shape)} {spec.dtype} / ({want},) float32 (block_size={spec.block})")
    else:
        t = state[spec.name]
        if t.shape != p.shape:
            raise ValueError(f"state {spec.name} has shape {tuple(t.shape)}, parameter has {tuple(p.shape)}")
        if t.dtype != spec.dtype:
            state[spec.name] = t.to(spec.dtype)


def state_nbytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of storage of all state tensors of ``optimizer`` (codes, scales, steps)."""
    total = 0
    for st in optimizer.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                total += v.numel() * v.element_size()
    return total
