"""Tensor parallel helpers for tests/distributed/test_tensor_parallel.py: FSDP2 x TP on a (dp, tp) mesh of gloo ranks.

A tiny Llama-like model (embedding, blocks of attention + SwiGLU MLP, final norm, LM head) whose
attention reshapes to ``-1`` heads, as tensor-parallel model code does (each TP rank holds
``n_heads / tp`` of them). The TP plan: q/k/v/gate/up colwise, o/down rowwise, optionally the norms
sequence parallel; FSDP2 shards every block over ``dp``; each block is compiled with backend fp8.
"""

from __future__ import annotations

import os

import _dist
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import fp8pass
from fp8pass.distributed import scaling_states
from fp8pass.train.model import RMSNorm

D, FFN, HEADS, VOCAB, LAYERS = 32, 64, 4, 64, 2
STEPS = 3
_BACKENDS: list = []  # this process's compile backends (their reports name the FP8 linears)
# FP8 weights: q, k, v, o, gate, up per block (the channel-smoothed down projection is not eligible)
FP8_GATHERED = ["layers.*.attn.q.weight", "layers.*.attn.k.weight", "layers.*.attn.v.weight",
                "layers.*.attn.o.weight", "layers.*.mlp.gate.weight", "layers.*.mlp.up.weight"]


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.head_dim = D // HEADS
        self.q, self.k, self.v, self.o = (nn.Linear(D, D, bias=False) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape

        def heads(y):  # -1: the heads this rank holds
            return y.view(b, t, -1, self.head_dim).transpose(1, 2)

        y = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)), is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.up = nn.Linear(D, FFN, bias=False), nn.Linear(D, FFN, bias=False)
        self.down = nn.Linear(FFN, D, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_norm, self.attn, self.mlp_norm, self.mlp = RMSNorm(D), Attention(), RMSNorm(D), MLP()

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = RMSNorm(D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        for block in self.layers:
            x = block(x)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def make_model():
    torch.manual_seed(0)
    return Model()


def fp8_config():
    return fp8pass.Config(compiler="aot_eager", grad_stochastic_rounding=False)


def tp_plan(sequence_parallel: bool) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    plan = {}
    if sequence_parallel:  # norms on sequence shards; the linears' inputs gathered before them
        seq = Shard(1)
        plan.update({"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel(),
                     "attn": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
                     "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))})
    out = Shard(1) if sequence_parallel else Replicate()
    plan.update({f"attn.{n}": ColwiseParallel() for n in ("q", "k", "v")})
    plan.update({f"mlp.{n}": ColwiseParallel() for n in ("gate", "up")})
    plan.update({"attn.o": RowwiseParallel(output_layouts=out), "mlp.down": RowwiseParallel(output_layouts=out)})
    return plan


def parallelize(model, mesh, sequence_parallel: bool, fp8_all_gather: bool):
    """TP on ``mesh["tp"]``, then FP8 all-gather wrapping, per-block compile and FSDP2 on ``mesh["dp"]``."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    cfg = fp8_config()
    _BACKENDS.clear()
    for block in model.layers:
        parallelize_module(block, mesh["tp"], tp_plan(sequence_parallel))
        if sequence_parallel:  # the block's input and output are sequence shards (plain local tensors)
            _shard_sequence(block, mesh["tp"])
    if fp8_all_gather:
        fp8pass.distributed.enable_fp8_all_gather(model, cfg, FP8_GATHERED)
    for block in model.layers:
        _BACKENDS.append(fp8pass.backend(cfg))
        block.compile(backend=_BACKENDS[-1])
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    if fp8_all_gather:
        fp8pass.distributed.link_fp8_all_gather(model)
    return model


def _shard_sequence(block, tp_mesh):
    """Blocks take and return the full sequence; inside, the residual stream is this rank's sequence
    shard as a plain tensor (as in torchtitan), which the SP norms and the plan's layouts expect."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def pre(mod, args):
        x = DTensor.from_local(args[0], tp_mesh, [Replicate()], run_check=False)
        return (x.redistribute(tp_mesh, [Shard(1)]).to_local(),)

    def post(mod, args, out):
        return DTensor.from_local(out, tp_mesh, [Shard(1)], run_check=False).redistribute(tp_mesh, [Replicate()]).to_local()

    block.register_forward_pre_hook(pre)
    block.register_forward_hook(post)


def states(model) -> dict[str, torch.Tensor]:
    return {k: torch.cat([s.scale.reshape(1), s.amax_history, s.steps.reshape(1).float()]).clone()
            for k, s in scaling_states(model)}


def mesh_worker(rank: int, world: int, init_file: str, out_dir: str, dp: int, tp: int, sequence_parallel: bool,
                fp8_all_gather: bool):
    """Train ``STEPS`` steps on a (dp, tp) mesh; each dp rank takes its slice of the global batch."""
    from torch.distributed.device_mesh import init_device_mesh

    _dist.init(rank, world, init_file)
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = parallelize(make_model(), mesh, sequence_parallel, fp8_all_gather)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    dp_rank = mesh["dp"].get_local_rank()
    out = {"loss": [], "states": []}
    gathered_before = fp8pass.distributed.GatherStats.calls
    for step in range(STEPS):
        x, y = _dist.local_batch(step, dp_rank, dp)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t = loss.detach().clone()
        dist.all_reduce(t)
        out["loss"].append(float(t) / world)
        out["states"].append(states(model))
    from fp8pass.distributed.auto_reduce import shared_reducer

    out["reductions"] = shared_reducer().reductions
    out["fp8_gathers"] = fp8pass.distributed.GatherStats.calls - gathered_before
    out["local_types"] = {n: type(p.to_local()).__name__ for n, p in model.named_parameters()}
    out["tp_weights"] = sorted(n for n, p in model.named_parameters()
                               if any(not pl.is_replicate() for pl in p.placements[1:]))
    out["fp8_linears"] = sorted({w for be in _BACKENDS for w in be.report().linears})
    out["swiglus"] = [s.down for be in _BACKENDS for s in be.report().swiglus]  # one per block
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def single_process() -> dict:
    """The reference: the same model, one process, the whole global batch, per-block compile."""
    torch._dynamo.reset()
    model = make_model()
    backends = [fp8pass.backend(fp8_config()) for _ in model.layers]
    for block, be in zip(model.layers, backends):
        block.compile(backend=be)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    out = {"loss": [], "states": []}
    for step in range(STEPS):
        x, y = _dist.global_batch(step)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["loss"].append(float(loss))
        out["states"].append(states(model))
    out["swiglus"] = [s.down for be in backends for s in be.report().swiglus]  # one per block
    return out


def _knobs(fmt: str, glu: bool = False) -> tuple:
    from fp8pass.op_schema import GLUKnobs, LinearKnobs

    base = dict(fwd_format=fmt, bwd_format=fmt if fmt == "identity" else "e5m2", granularity="tensor", block=128,
                power_of_two=False, grad_rounding="nearest", margin=0.0, interval=1, algo="max", out_dtype=None,
                fast_accum=False)
    if glu:
        return GLUKnobs(**base, activation="silu", smooth="channel").args()
    return LinearKnobs(**base).args()


def _run_ops(x, w, gate, up, w_down, fmt):
    """``fp8_linear(x, w)`` and ``swiglu_down(gate, up, w_down)`` with their gradients (current scaling);
    returns their outputs and swiglu_down's per-channel smoothing scales."""
    ops = torch.ops.fp8pass
    y = ops.fp8_linear(x, w, None, [], [], [], None, *_knobs(fmt))[0]
    glu = ops.swiglu_down(gate, up, w_down, [], [], [], None, *_knobs(fmt, glu=True))
    z = glu[0]
    (y.float().pow(2).sum() + z.float().pow(2).sum()).backward()
    return y, z, glu[7]


def op_rules_worker(rank: int, world: int, init_file: str, out_dir: str):
    """Each rule's placements on 2 real ranks vs the unsharded op: colwise and rowwise fp8_linear, the
    rowwise swiglu_down, forward and backward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    _dist.init(rank, world, init_file)
    mesh = init_device_mesh("cpu", (world,))
    import fp8pass.distributed.tensor_parallel as tpr

    tpr.register_sharding_rules()
    out = {}
    for fmt in ("identity", "e4m3"):
        g = torch.Generator().manual_seed(7)
        full = {"x": torch.randn(2, 8, 32, generator=g), "w": torch.randn(64, 32, generator=g),
                "gate": torch.randn(2, 8, 64, generator=g), "up": torch.randn(2, 8, 64, generator=g),
                "w_down": torch.randn(32, 64, generator=g)}
        plain = {k: v.clone().requires_grad_() for k, v in full.items()}
        y_ref, z_ref, c_ref = _run_ops(*plain.values(), fmt)
        for case, (xp, wp) in {"colwise": (Replicate(), Shard(0)), "rowwise": (Shard(2), Shard(1))}.items():
            place = {"x": xp, "w": wp, "gate": Shard(2), "up": Shard(2), "w_down": Shard(1)}
            dt = {k: distribute_tensor(v, mesh, [place[k]]).requires_grad_() for k, v in full.items()}
            y, z, c = _run_ops(*dt.values(), fmt)
            res = {"y": (y.full_tensor(), y_ref), "z": (z.full_tensor(), z_ref),
                   "placements": (str(y.placements), str(z.placements), str(c.placements)),
                   "channel_scales": (c.full_tensor(), c_ref)}
            for k in full:
                res["d" + k] = (dt[k].grad.full_tensor(), plain[k].grad)
            out[f"{fmt} {case}"] = {k: tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in v)
                                    for k, v in res.items()}
    # a reduction group that leaves out a TP rank is refused; the world passes
    w = [distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)])]
    rank0_only = dist.new_group([0])
    tpr.check_reduction_group(dist.group.WORLD, w)
    try:
        tpr.check_reduction_group(rank0_only, w)
        refused = None
    except ValueError as e:
        refused = str(e)
    torch.save({"rules": out, "refused": refused}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def explain_worker(rank: int, world: int, init_file: str, out_dir: str):
    """``fp8pass.explain`` of one block on a 1 x 1 mesh under four TP plans: the usual one, with sequence
    parallel norms, and two whose gate/up outputs are gathered (Replicate) before the GLU product, forms
    the fused op does not take: the down projection's input then redistributed to Shard(-1) (a form the
    patterns do not follow) or declared Shard(-1) directly (matched, refused by the layout check).
    Saves each plan's GLUs, FP8 linears and "not fused" reasons."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    _dist.init(rank, world, init_file)
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    gathered = {**tp_plan(False), "mlp.gate": ColwiseParallel(output_layouts=Replicate()),
                "mlp.up": ColwiseParallel(output_layouts=Replicate()),
                "mlp.down": RowwiseParallel(input_layouts=Replicate())}
    redistributed = {**gathered, "mlp.down": RowwiseParallel()}
    out = {}
    for name, plan, sp in (("tp", tp_plan(False), False), ("tp_sp", tp_plan(True), True), ("gathered", gathered, False),
                           ("redistributed", redistributed, False)):
        torch.manual_seed(0)
        block = Block()
        parallelize_module(block, mesh["tp"], plan)
        if sp:
            _shard_sequence(block, mesh["tp"])
        report = fp8pass.explain(block, torch.randn(2, 16, D), config=fp8_config())
        out[name] = {"swiglus": [s.down for s in report.swiglus], "linears": sorted(set(report.linears)),
                     "not_fused": [f"{w}: {r}" for w, r in report.skipped if r.startswith("not fused")]}
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()



def conversions_worker(rank: int, world: int, init_file: str, out_dir: str):
    """The DTensor conversions of a TP plan's hooks (``from_local``, ``redistribute``, ``to_local``) as the
    installed torch's Dynamo records them: per call node of the graph, which conversion
    ``annotate.dtensor_call`` names and whether it has side effects. (``run_check=True`` is not traced:
    its ``all_gather_object`` stops Dynamo on torch 2.11 and 2.13.)"""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from fp8pass.passes.annotate import dtensor_call, has_side_effects

    _dist.init(rank, world, init_file)
    mesh = init_device_mesh("cpu", (1,))
    seen = []

    def record(gm, example_inputs):
        seen.extend((dtensor_call(n), has_side_effects(n)) for n in gm.graph.nodes if n.op.startswith("call_"))
        return gm.forward

    def hooks(x):
        d = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        return d.redistribute(mesh, [Shard(-1)]).to_local() * 2

    torch.compile(hooks, backend=record, fullgraph=True)(torch.randn(2, 8))
    torch.save({"nodes": seen}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()
