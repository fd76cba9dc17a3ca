"""FP8 all-gather for FSDP2: weights cast to FP8 *before* the all-gather (1 byte per element).

FSDP2's documented extension point: when the local tensor of a sharded parameter defines
``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``, FSDP2 all-gathers what the first returns and
builds the unsharded parameter with the second. :class:`FP8ShardWeight` wraps a weight's local shard
(it behaves as its plain data for every other op: optimizer, state dict, DCP):

* pre-all-gather: cast the shard with the weight's delayed-scaling scale (identical on all ranks
  after :class:`~fp8pass.distributed.AmaxSync`; on the very first step, before any history, the scale
  of the global amax, one ``all_reduce(MAX)``) and hand FSDP2 the FP8 codes as uint8 (gloo and NCCL
  move bytes; FSDP2 packs mixed dtypes as bytes anyway). The shard's true amax is noted for the
  next AmaxSync, which folds it into the weight's history within its one collective.
* post-all-gather: the unsharded weight is ``decode(codes) / scale`` in the parameter dtype. The
  compiled block's FP8 linear casts it again with the same scale, which reproduces the same codes
  exactly (``c / s * s`` rounds back to ``c``: the error is far below half an FP8 step), so the
  numerics equal the unsharded run; only the bytes on the wire change (E4M3: half of bf16).

Only weights whose FP8 cast is a plain per-tensor cast qualify: the FP8 linears of
``fp8pass.explain(model, ...).linears`` minus down projections of channel-smoothed SwiGLUs (their
columns are rescaled before the cast). :func:`enable_fp8_all_gather` picks exactly those.
"""

from __future__ import annotations

import fnmatch
import sys

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from .. import kernels
from ..config import Config, DelayedScaling
from ..numerics import decode, get_format, scale_from_amax
from ..precision_audit import CollectiveRecord
from ..runtime.casting import _cast_tensor
from ..runtime.state import _REGISTRY
from .amax_sync import note_weight_amax
from .fsdp import fsdp_params

__all__ = ["FP8ShardWeight", "enable_fp8_all_gather", "link_fp8_all_gather", "fp8_all_gather_weights",
           "precompute_fp8_scales", "GatherStats", "gather_records"]

aten = torch.ops.aten
# ops whose result is still (a view/copy of) the wrapped shard: FSDP2 chunks, pads and copies it
_KEEP_WRAPPED = {
    aten.detach.default, aten.alias.default, aten.view.default, aten.as_strided.default,
    aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
    aten.new_zeros.default, aten.empty_like.default, aten.clone.default, aten.copy_.default,
    aten._to_copy.default, aten._pin_memory.default,
}


class GatherStats:
    """Bytes this process handed to FP8 all-gathers (its shards), for tests and the benchmark."""

    bytes_in = 0
    calls = 0


class _Ctx:
    """Per-weight settings shared by every view of its shard."""

    def __init__(self, fqn: str, config: Config):
        self.fqn = fqn
        self.config = config
        self.fsdp_param = None  # set by link_fp8_all_gather after fully_shard
        self.precomputed_scale: torch.Tensor | None = None  # from precompute_fp8_scales


class FP8ShardWeight(torch.Tensor):
    """A weight shard that FSDP2 all-gathers as FP8 codes; any other op sees the plain tensor.

    Args:
        data: the plain shard (or the full weight, before ``fully_shard`` chunks it).
        ctx: per-weight settings (FQN, fp8pass Config).
    """

    @staticmethod
    def __new__(cls, data: torch.Tensor, ctx: _Ctx):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), storage_offset=data.storage_offset(), dtype=data.dtype,
            device=data.device, requires_grad=data.requires_grad)

    def __init__(self, data: torch.Tensor, ctx: _Ctx):
        self._data = data
        self._ctx = ctx

    def __repr__(self):
        return f"FP8ShardWeight({self._ctx.fqn}, {self._data!r})"

    def __tensor_flatten__(self):
        return ["_data"], self._ctx

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return FP8ShardWeight(inner["_data"], ctx)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        ctx = None

        def unwrap(t):
            nonlocal ctx
            if isinstance(t, FP8ShardWeight):
                ctx = t._ctx
                return t._data
            return t

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        if func not in _KEEP_WRAPPED:
            return out
        return tree_map(lambda t: FP8ShardWeight(t, ctx) if isinstance(t, torch.Tensor) else t, out)

    # -- FSDP2 extension hooks ---------------------------------------------------------------

    def fsdp_pre_all_gather(self, mesh, outer_size=None, outer_stride=None, module=None, mp_policy=None):
        cfg = self._ctx.config
        fmt = get_format(cfg.fwd_format)
        recipe = cfg.recipe
        margin = float(getattr(recipe, "margin", 0.0))
        p2 = bool(getattr(recipe, "power_of_two", False))
        shard = self._data
        local_amax = shard.detach().abs().amax().float() if shard.numel() else torch.zeros((), device=shard.device)
        state = self._weight_state()
        if state is not None and isinstance(recipe, DelayedScaling) and bool(state.steps > state.skipped):
            scale = state.scale.clone()
            note_weight_amax(state, local_amax)
        elif self._ctx.precomputed_scale is not None:  # current scaling: one all-reduce for all weights
            scale = self._ctx.precomputed_scale
            if state is not None and isinstance(recipe, DelayedScaling):
                note_weight_amax(state, local_amax)
        else:  # no history yet (or current scaling): the global amax's scale, one tiny all-reduce
            amax = local_amax.clone()
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=_shard_group(mesh))
            scale = scale_from_amax(amax, fmt, margin, p2)
            if state is not None and isinstance(recipe, DelayedScaling):
                note_weight_amax(state, local_amax)
        codes = _cast_with_scale(shard.detach(), scale, fmt)
        GatherStats.bytes_in += codes.numel() * codes.element_size()
        GatherStats.calls += 1
        return (codes.view(torch.uint8),), (scale, fmt.name)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        (codes,) = all_gather_outputs
        scale, fmt_name = metadata
        fmt = get_format(fmt_name)
        with torch.no_grad():
            value = (decode(codes.view(fmt.torch_dtype), fmt, torch.float32) / scale).to(param_dtype)
            if out is not None:
                if _is_dtensor(out):  # tensor parallel: FSDP2's unsharded parameter is this rank's TP shard
                    out = out._local_tensor
                out.copy_(value.view(out.shape) if value.numel() == out.numel() else value)
                return None
        return value, (value,)

    def _weight_state(self):
        fp = self._ctx.fsdp_param
        up = getattr(fp, "_unsharded_param", None) if fp is not None else None
        st = _REGISTRY.get(up) if up is not None else None
        return st.weight if st is not None else None


def _is_dtensor(t) -> bool:
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def _shard_group(mesh):
    """The process group a weight is sharded over (the last mesh dim; HSDP replicates over the first)."""
    return mesh.get_group(mesh.ndim - 1)


def _cast_with_scale(x: torch.Tensor, scale: torch.Tensor, fmt):
    """FP8 codes of ``x * scale`` by the runtime's own per-tensor cast (bit-identical to the op's)."""
    x2d = x.reshape(-1, x.shape[-1]) if x.dim() > 1 else x.reshape(1, -1)
    op = _cast_tensor(kernels.for_device(x.device), x2d, scale.to(torch.float32).reshape(()), fmt, "nearest", None)
    return op.data.reshape(x.shape)


def fp8_all_gather_weights(report, config: Config) -> list[str]:
    """Weight FQNs whose FP8 cast is a plain per-tensor cast (see the module doc)."""
    smoothed = {s.down for s in report.swiglus} if config.smooth_swiglu == "channel" else set()
    return [w for w in report.linears if w not in smoothed]


def enable_fp8_all_gather(model: torch.nn.Module, config: Config, weights) -> list[str]:
    """Wrap ``weights`` (FQNs or globs) of ``model`` so FSDP2 all-gathers them as FP8.

    Call it before ``fully_shard`` (after ``parallelize_module`` under tensor parallel: a TP-sharded
    weight's local shard is wrapped) and :func:`link_fp8_all_gather` after it. ``weights`` usually is
    ``fp8_all_gather_weights(fp8pass.explain(model, *example_inputs, config=config), config)``.
    Returns the FQNs wrapped.
    """
    if config.fwd_format in ("identity",):
        raise ValueError("FP8 all-gather needs an FP8 forward format; Config(fwd_format='identity') casts nothing")
    if isinstance(config.recipe, DelayedScaling) is False and config.recipe.granularity != "tensor":
        raise ValueError(f"FP8 all-gather needs per-tensor weight scales; the recipe is {config.recipe}")
    patterns = list(weights)
    done = []
    for mod_name, mod in model.named_modules():
        for pname, p in list(mod.named_parameters(recurse=False)):
            fqn = f"{mod_name}.{pname}" if mod_name else pname
            if not any(fnmatch.fnmatchcase(fqn, pat) for pat in patterns):
                continue
            if isinstance(p, FP8ShardWeight) or isinstance(getattr(p, "data", None), FP8ShardWeight) or \
                    isinstance(getattr(p, "_local_tensor", None), FP8ShardWeight):
                continue
            if p.dim() != 2:
                raise ValueError(f"{fqn}: FP8 all-gather wraps 2-D linear weights, got shape {tuple(p.shape)}")
            if _is_dtensor(p):  # tensor parallel: wrap this rank's TP shard, FSDP2 shards it further
                from torch.distributed.tensor import DTensor

                local = FP8ShardWeight(p.to_local().detach(), _Ctx(fqn, config))
                data = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                          stride=p.stride())
            else:
                data = FP8ShardWeight(p.detach(), _Ctx(fqn, config))
            wrapped = torch.nn.Parameter(data, requires_grad=p.requires_grad)
            setattr(mod, pname, wrapped)
            done.append(fqn)
    missing = [pat for pat in patterns if not any(fnmatch.fnmatchcase(f, pat) for f in done)]
    if missing:
        raise ValueError(f"enable_fp8_all_gather: no parameter of the model matches {missing[:5]}")
    return done


@torch.no_grad()
def precompute_fp8_scales(model: torch.nn.Module) -> int:
    """Scales of all FP8-gathered weights from their global amaxes, in ONE ``all_reduce(MAX)``.

    With ``CurrentScaling`` each weight's scale needs the amax of the whole weight, i.e. of all its
    shards; call this after every ``optimizer.step()`` (and once before the first step) so the next
    all-gathers use it instead of one all-reduce per weight. Under ``DelayedScaling`` it only serves
    the first step (afterwards the delayed scale is used). Returns the number of weights.
    """
    shards = []
    for _, fp in fsdp_params(model):
        local = fp._sharded_local_tensor
        if isinstance(local, FP8ShardWeight):
            shards.append(local)
    if not shards:
        return 0
    amax = torch.stack([s._data.abs().amax().float() if s._data.numel() else
                        torch.zeros((), device=s._data.device) for s in shards])
    if dist.is_initialized() and dist.get_world_size() > 1:
        group = _shard_group(shards[0]._ctx.fsdp_param.mesh_info.mesh)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    for s, a in zip(shards, amax):
        cfg = s._ctx.config
        r = cfg.recipe
        s._ctx.precomputed_scale = scale_from_amax(a, get_format(cfg.fwd_format), float(getattr(r, "margin", 0.0)),
                                                   bool(getattr(r, "power_of_two", False)))
    return len(shards)


def link_fp8_all_gather(model: torch.nn.Module) -> int:
    """After ``fully_shard``: let each wrapped shard find its FSDPParam (for its scaling state)."""
    n = 0
    for _, fp in fsdp_params(model):
        local = fp._sharded_local_tensor
        if isinstance(local, FP8ShardWeight):
            local._ctx.fsdp_param = fp
            n += 1
    return n


def gather_records(model: torch.nn.Module, fp8_weights=()) -> list:
    """One :class:`~fp8pass.precision_audit.CollectiveRecord` per parameter FSDP2 all-gathers in ``model``:
    FP8 codes (a wrapped shard, :func:`enable_fp8_all_gather`) or its high-precision dtype (the mixed
    precision policy's ``param_dtype``, else the parameter's). Read from the model's FSDP2 state (no
    collective, no device work). ``fp8_weights``: FQNs whose forward GEMM is per-tensor FP8 (a
    high-precision gather of one of them notes that an FP8 all-gather could take it)."""
    fp8_weights = set(fp8_weights)
    out = []
    for fqn, fp in fsdp_params(model):
        local = getattr(fp, "_sharded_local_tensor", None)
        if isinstance(local, FP8ShardWeight):
            fmt = get_format(local._ctx.config.fwd_format)
            out.append(CollectiveRecord(fqn, "all-gather", "fp8", fmt.name, 1))
            continue
        dtype = getattr(fp, "param_dtype", None) or fp.sharded_param.dtype
        note = ("its forward GEMM is per-tensor FP8: fp8pass.distributed.enable_fp8_all_gather would gather it as "
                "FP8 codes (1 byte/element)") if fqn in fp8_weights else None
        out.append(CollectiveRecord(fqn, "all-gather", "high", str(dtype).removeprefix("torch."),
                                    torch.empty(0, dtype=dtype).element_size(), note))
    return out
