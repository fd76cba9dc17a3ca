"""Tensor parallel: DTensor sharding rules for every ``fp8pass::`` op.

With ``parallelize_module`` (ColwiseParallel / RowwiseParallel / SequenceParallel), Dynamo traces
DTensor weights and activations, and the backend's ops reach DTensor's dispatcher, which needs a
sharding rule per op. The rules say how each op computes on the local shards:

* ``fp8_linear`` / ``fp8_linear_precast`` (and ``fp8_cast_input``): colwise (``x`` Replicate, ``W``
  Shard(0), bias Shard(0); ``y`` Shard(-1)), rowwise (``x`` Shard(-1), ``W`` Shard(1), bias Partial;
  ``y`` Partial), batch-sharded ``x`` (Shard(0), ``W`` Replicate; ``y`` Shard(0)), or all Replicate.
* ``swiglu_down``: gate/up Shard(-1) with ``W_down`` Shard(1) (the rowwise down projection of a
  colwise gate/up; ``y`` Partial), batch-sharded gate/up, or all Replicate.
* the backward ops: the saved codes and scales stay as the forward left them (the rule reads their
  placements) and ``dy`` is brought to the matching placement; ``dW`` is Shard like ``W`` or Partial
  when the tokens were sharded.
* ``rmsnorm`` (``Config.save_norm_input_fp8``) and its backward: all Replicate. Its saved ``x_hat``
  codes have one current scale from the whole tensor's amax; on token shards each rank would scale by
  its own shard's amax, so the rule gathers instead (SequenceParallel's norms: leave the knob off).
* every other op (MoE grouped GEMMs, NVFP4, the state records): all Replicate (DTensor gathers the
  operands first: correct, no sharded compute).

Why computing on shards is exact: with per-tensor scales, each rank casts its shard with the same
delayed scale the whole tensor has, so the codes are the whole tensor's codes, and the GEMM on shards is
the sharded GEMM of the same codes. The scale agrees across ranks because the backend's amax
reduction (``Config(amax_reduction="auto")``) max-reduces every history over the *world*, i.e. over
both mesh dimensions of an FSDP2 x TP mesh: a weight's history is the max over the ranks that hold
its shards (TP) and over the data-parallel replicas, an activation's or gradient's over every rank
that holds a piece of it. So the amaxes an op returns are the amaxes of its local shard, declared
Replicate: each rank records them into its own state, and the one reduction per step makes the
states equal, as it does for data parallel. On the first step (no history yet) each rank casts its
shard with the shard's own amax, as data parallel does with its own batch. Row, block and MX scales
are not per tensor: ops with those granularities take the all-Replicate rule.

Extra tensor arguments (state lists, seeds) are Replicate: the rules name the activation and weight
arguments by their schema names and give every other tensor argument Replicate, so an argument added
to a schema later needs no change here. The scaling state enters the graph as Replicate DTensors
(:func:`replicated`).
"""

from __future__ import annotations

from dataclasses import fields

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from ..op_schema import LinearKnobs
from ..runtime.casting import resolve_format, saved_transposed
from ..runtime.linear import compute_dtype
from ..runtime.precast import _up_dtype

__all__ = ["register_sharding_rules", "replicated", "check_reduction_group", "RULES"]

R = Replicate()
KEEP = "keep"  # the input keeps the placement it has (saved codes and scales)

_registered = False


def replicated(tensors: list, example_inputs: list) -> list:
    """The scaling-state tensors as Replicate DTensors on the mesh of the graph's first DTensor input.

    They are views of the state (a Replicate DTensor's local tensor is the tensor itself), so the
    records the ops make, the reduction and checkpoints all act on the one state. Passed as plain
    tensors, DTensor's dispatch would refuse them next to DTensors (or, told to replicate them
    implicitly, fails on the functional tensors AOT autograd traces with).
    """
    mesh = next(v.device_mesh for v in example_inputs if isinstance(v, DTensor))
    placements = [R] * mesh.ndim
    return [DTensor.from_local(t, mesh, placements, run_check=False) for t in tensors]


def check_reduction_group(group, example_inputs: list) -> None:
    """Raise if ``Config(amax_reduction=group)`` leaves out ranks that hold shards of the graph's DTensors.

    The states of a TP-sharded tensor agree only when the reduction spans the ranks of its mesh; a
    group of one mesh dimension (the data-parallel one) would leave each TP shard its own scale.
    """
    import torch.distributed as dist

    if not isinstance(group, dist.ProcessGroup):
        return  # "auto" (the world) spans every mesh; "off": the user reduces
    covered = set(dist.get_process_group_ranks(group))
    for v in example_inputs:
        if isinstance(v, DTensor):
            outside = sorted(set(v.device_mesh.mesh.flatten().tolist()) - covered)
            if outside:
                raise ValueError(
                    f"fp8pass: Config(amax_reduction=<ProcessGroup>) does not contain ranks {outside[:8]}, which hold "
                    f"shards of this graph's tensor-parallel DTensors (mesh {v.device_mesh}); their scales would "
                    f"differ. Use amax_reduction='auto' (the world: every mesh dimension) or a group spanning the "
                    f"data-parallel and tensor-parallel ranks (docs/distributed.md, Tensor parallel).")


def _placement(spec) -> Placement:
    """The placement of a 1-D mesh spec (the TP dimension)."""
    return spec.placements[0]


def _ndim(spec) -> int:
    return len(spec.tensor_meta.shape)


def _per_tensor(kwargs: dict, args: dict) -> bool:
    """Whether the op scales per tensor (or not at all): only then do shards share one scale."""
    granularity = kwargs.get("granularity", args.get("granularity", "tensor"))
    return granularity == "tensor"


# -- per-op layouts: (outputs, {input name: placement}) per case; unnamed tensor inputs are Replicate --

def _linear_cases(a: dict, kw: dict, x: str = "x", weight: str = "weight", saved=()):
    """Cases of a linear ``y = x W^T (+ b)`` with outputs ``[y, *rest]``; ``saved``: output positions
    holding ``x``'s codes (sharded as ``x``'s rows/columns) and ``W``'s codes."""
    n = _ndim(a[x])
    cases = []

    def case(y, x_p, w_p, b_p, x_codes, w_codes):
        outs = [y]
        for kind in saved:
            outs.append(x_codes if kind == "x" else w_codes if kind == "w" else R)
        cases.append((outs, {x: x_p, weight: w_p, "bias": b_p}))

    case(R, R, R, R, R, R)
    case(Shard(n - 1), R, Shard(0), Shard(0), R, Shard(0))          # colwise
    case(Partial(), Shard(n - 1), Shard(1), Partial(), Shard(1), Shard(1))  # rowwise
    if n >= 2:
        case(Shard(0), Shard(0), R, R, Shard(0), R)                # tokens sharded (batch dim)
    return cases


def _fp8_linear(a, kw):
    # (y, x_amax, w_amax, x_data, x_scale, w_data, w_scale)
    return _linear_cases(a, kw, saved=("amax", "amax", "x", "scale", "w", "scale"))


def _x_alt_is_2d(a: dict, named: dict) -> bool:
    """Whether ``fp8_cast_input``'s ``x_alt`` is ``x``'s cast again ([rows, in]: column-major codes on
    the GPU, GEMM-dtype values on the CPU) rather than an empty tensor, as the op itself decides."""
    # the knobs the op takes (knobs it does not take, e.g. ``backward``, keep their defaults)
    k = LinearKnobs(**{f.name: named[f.name] for f in fields(LinearKnobs) if f.name in named})
    device = torch.device(a["x"].mesh.device_type)
    dt = compute_dtype(k, a["x"].tensor_meta.dtype)
    return saved_transposed(device, resolve_format(k.fwd_format), k.granularity) or \
        _up_dtype(k, device, dt) is not None


def _fp8_cast_input(a, kw):
    # (x_data, x_scale, x_amax, x_alt): x_alt sharded like x's codes when it holds them (backward may save it)
    n = _ndim(a["x"])
    alt = _x_alt_is_2d(a, kw)
    cases = [([R, R, R, R], {"x": R}), ([Shard(1), R, R, Shard(1) if alt else R], {"x": Shard(n - 1)})]
    if n >= 2:
        cases.append(([Shard(0), R, R, Shard(0) if alt else R], {"x": Shard(0)}))
    return cases


def _x_cast_placement(x_data_spec, n: int):
    """``x``'s placement implied by the placement of its saved codes ``[rows, in]``."""
    p = _placement(x_data_spec)
    if p == Shard(1):
        return Shard(n - 1)
    if p == Shard(0):
        return Shard(0)
    return R


def _fp8_linear_precast(a, kw):
    # (y, w_amax, w_scale); x's cast (x_data, x_scale, x_alt) keeps its placement, x must match it
    x_p = _x_cast_placement(a["x_data"], _ndim(a["x"]))
    cases = _linear_cases(a, kw, saved=("amax", "scale"))
    out = []
    for outs, ins in cases:
        if ins["x"] == x_p:
            out.append((outs, {**ins, "x_data": KEEP, "x_scale": KEEP, "x_alt": KEEP}))
    return out


def _linear_backward(a, kw, w_codes: str):
    """``(dx2d, dW, db, dy_amax)`` from the saved codes' placements (kept as they are)."""
    x_p, w_p = _placement(a["x_data"]), _placement(a[w_codes])
    n = _ndim(a["dy"])
    keep = {name: KEEP for name in a if name not in ("dy", "g_state")}
    if x_p == R and w_p == Shard(0):      # colwise: dy sharded on out-features
        return [([Partial(), Shard(0), Shard(0), R], {**keep, "dy": Shard(n - 1)})]
    if x_p == Shard(1) and w_p == Shard(1):  # rowwise: dy replicated
        return [([Shard(1), Shard(1), R, R], {**keep, "dy": R})]
    if x_p == Shard(0) and w_p == R:      # tokens sharded: dW summed over them
        return [([Shard(0), Partial(), Partial(), R], {**keep, "dy": Shard(0)})]
    return [([R, R, R, R], {**keep, "dy": R})]


def _fp8_linear_backward(a, kw):
    return _linear_backward(a, kw, "w_data")


def _fp8_linear_precast_backward(a, kw):
    return _linear_backward(a, kw, "weight")


def _swiglu_down(a, kw):
    # (y, a_amax, b_amax, a_data, a_scale, b_data, b_scale, smooth_scales, gate_data, gate_scale,
    #  up_data, up_scale); smooth scales: per channel [f] ("channel"), per token, or none
    n = _ndim(a["gate"])
    smooth = kw.get("smooth", "channel")
    cases = [([R] * 12, {"gate": R, "up": R, "w_down": R})]
    s_ffn = Shard(0) if smooth == "channel" else R   # per-channel scales follow the ffn shards
    cases.append(([Partial(), R, R, Shard(1), R, Shard(1), R, s_ffn, Shard(1), R, Shard(1), R],
                  {"gate": Shard(n - 1), "up": Shard(n - 1), "w_down": Shard(1)}))
    if n >= 2:
        s_tok = Shard(0) if smooth == "token" else R
        cases.append(([Shard(0), R, R, Shard(0), R, R, R, s_tok, Shard(0), R, Shard(0), R],
                      {"gate": Shard(0), "up": Shard(0), "w_down": R}))
    return cases


def _swiglu_down_backward(a, kw):
    # (dgate, dup, dW_down, dy_amax); a_data is None when A is recomputed from gate/up (recompute_output):
    # gate's codes then stand for it (the forward rules place them alike; the recomputation is elementwise)
    a_p = _placement(a["a_data"] if a.get("a_data") is not None else a["gate_data"])
    b_p = _placement(a["b_data"])
    n = _ndim(a["dy"])
    keep = {name: KEEP for name in a if name not in ("dy", "g_state")}
    if a_p == Shard(1) and b_p == Shard(1):
        return [([Shard(1), Shard(1), Shard(1), R], {**keep, "dy": R})]
    if a_p == Shard(0) and b_p == R:
        return [([Shard(0), Shard(0), Partial(), R], {**keep, "dy": Shard(0) if n >= 1 else R})]
    return [([R, R, R, R], {**keep, "dy": R})]


def _rmsnorm(a, kw):
    # (y, x_hat_data, x_hat_scale, rstd): one per-tensor current scale of x_hat, so not on shards
    return [([R, R, R, R], {"x": R, "weight": R})]


def _rmsnorm_backward(a, kw):
    # (dx, dw) from the Replicate codes, rstd and weight
    return [([R, R], {name: R for name in a})]


RULES = {
    "fp8_linear": _fp8_linear,
    "fp8_linear_backward": _fp8_linear_backward,
    "fp8_cast_input": _fp8_cast_input,
    "fp8_linear_precast": _fp8_linear_precast,
    "fp8_linear_precast_backward": _fp8_linear_precast_backward,
    "swiglu_down": _swiglu_down,
    "swiglu_down_backward": _swiglu_down_backward,
    "rmsnorm": _rmsnorm,
    "rmsnorm_backward": _rmsnorm_backward,
}
"""Op name -> ``rule(tensor args by name, other args by name)`` giving ``[(outputs, inputs), ...]``."""


# -- generic machinery: schema-driven argument order, Replicate for what a rule does not name --------

def _bind(schema, args: tuple, kwargs: dict) -> dict:
    named = {arg.name: v for arg, v in zip(schema.arguments, args)}
    named.update(kwargs)
    return named


def _leaf_placements(schema, args: tuple, kwargs: dict, inputs: dict) -> list:
    """One placement per DTensor-spec leaf, in DTensor's flattening order (positional args, then
    kwargs; list elements in order)."""
    out = []

    def visit(name, value):
        if isinstance(value, (list, tuple)):
            for v in value:
                visit(name, v)
        elif hasattr(value, "placements"):
            p = inputs.get(name, R)
            out.append(_placement(value) if p == KEEP else p)

    for arg, v in zip(schema.arguments, args):
        visit(arg.name, v)
    for k, v in kwargs.items():
        visit(k, v)
    return out


def _mesh_ndim(named: dict) -> int:
    for v in named.values():
        for leaf in (v if isinstance(v, (list, tuple)) else [v]):
            if hasattr(leaf, "placements"):
                return len(leaf.placements)
    return 1


def _make_rule(op, cases_fn):
    schema = op._schema
    n_out = len(schema.returns)

    def rule(*args, **kwargs):
        named = _bind(schema, args, kwargs)
        tensors = {k: v for k, v in named.items() if hasattr(v, "placements")}
        # sharded compute needs one scale per tensor, and a 1-D (TP) mesh: on a DTensor mesh of more
        # dims the saved codes could be sharded differently per dim; there the ops gather their operands
        if cases_fn is None or _mesh_ndim(named) != 1 or not _per_tensor(kwargs, named):
            cases = [([R] * n_out, {})]
        else:
            cases = cases_fn(tensors, named)
        return [(list(outs), _leaf_placements(schema, args, kwargs, ins)) for outs, ins in cases]

    return rule


def _fp8pass_ops():
    """Every overload in the ``fp8pass`` namespace (``import fp8pass`` registers them: fp8pass.runtime)."""
    ns = torch.ops.fp8pass
    names = set(RULES) | {"delayed_record_", "delayed_record_many_", "hcp_update_"}
    names |= {n for n in dir(ns) if not n.startswith("_")}
    ops = []
    for name in sorted(names):
        try:
            packet = getattr(ns, name)
        except (AttributeError, RuntimeError):
            continue
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        for overload in packet.overloads():
            ops.append((name, getattr(packet, overload)))
    return ops


def register_sharding_rules() -> int:
    """Register the DTensor rule of every ``fp8pass::`` op (idempotent); returns the ops covered.

    ``delayed_record_`` is composite (its aten ops have DTensor's own rules) and is skipped.
    """
    global _registered
    from torch.distributed.tensor.experimental import register_sharding

    ops = [(n, op) for n, op in _fp8pass_ops() if n != "delayed_record_"]
    if not _registered:
        for name, op in ops:
            register_sharding(op)(_make_rule(op, RULES.get(name)))
        _registered = True
    return len(ops)
