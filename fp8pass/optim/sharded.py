"""FP8 moments of DTensor parameters (FSDP2 shards): per-block scales on the local shard.

The step runs on each rank's local shard exactly as on a plain tensor (codes and scales of the
shard's own blocks). The state is kept as DTensors so that ``torch.distributed.checkpoint`` saves and
reshards it like the parameter itself:

* codes (or a dense bf16/fp32 moment): same shape and placements as the parameter;
* scales: ``[ceil(p.numel() / block)]`` placed ``Shard(0)`` wherever the parameter is ``Shard(0)``.
  The local shard of a row-sharded parameter is a contiguous range of the flattened tensor, so when
  every shard holds a whole number of blocks, the local blocks ARE blocks of the full tensor and the
  concatenated local scales are exactly the scales a 1-rank run keeps: a checkpoint written by N
  ranks loads into M ranks (or one process) bit for bit.

A parameter whose shards would split a block (uneven rows, or a shard not a multiple of
``block_size``; one scale per tensor, ``block_size=None``, on a sharded parameter), or that is
sharded on another dim, gets a clear error naming the fix.

bf16 stochastic rounding of the weights (``bf16_stochastic_round``) numbers the elements of the whole
flattened parameter: a row shard is the range starting at :func:`flat_offset`, and its elements take
the counters of their positions in the whole parameter (under the seed every rank draws alike), so
the sharded step rounds each weight exactly as a 1-rank step does.
"""

from __future__ import annotations

import math

import torch

from .moments import MomentSpec, init_moment, num_blocks

__all__ = ["is_dtensor", "init_sharded_moment", "local_view", "flat_offset", "shard_rows"]


def is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(t, DTensor)


def _scale_placements(p, spec: MomentSpec):
    from torch.distributed.tensor import Replicate, Shard

    out = []
    for dim_size, pl in zip(p.device_mesh.shape, p.placements):
        if isinstance(pl, Replicate):
            out.append(Replicate())
            continue
        if not (isinstance(pl, Shard) and pl.dim == 0):
            raise ValueError(
                f"fp8pass.optim: FP8 moments of a DTensor parameter need it replicated or sharded on dim 0 "
                f"(FSDP2's layout); got placements {p.placements}. Use m_format/v_format='bf16' for it.")
        rows, per_row = p.shape[0], p.numel() // max(p.shape[0], 1)
        if dim_size > 1 and spec.block >= p.numel():
            raise ValueError(
                f"fp8pass.optim: one scale per tensor (block_size=None, or a block_size >= the parameter's "
                f"{p.numel()} elements) needs the amax of the whole tensor, which no shard of a parameter of shape "
                f"{tuple(p.shape)} sharded {dim_size} ways holds. Use a block_size that divides the shards (e.g. "
                f"128), or put this parameter in a group with m_format='bf16', v_format='bf16'.")
        if rows % dim_size or ((rows // dim_size) * per_row) % spec.block:
            raise ValueError(
                f"fp8pass.optim: a parameter of shape {tuple(p.shape)} sharded {dim_size} ways has shards of "
                f"{rows / dim_size:g} rows x {per_row} = {rows / dim_size * per_row:g} elements, not a whole "
                f"number of blocks of block_size={spec.block}; the per-block scales could not be resharded. "
                f"Pick a block_size dividing {per_row * (rows // dim_size) if rows % dim_size == 0 else per_row}, "
                f"or put this parameter in a group with m_format='bf16', v_format='bf16'.")
        out.append(Shard(0))
    return out


def init_sharded_moment(state: dict, spec: MomentSpec, p) -> None:
    """Zero moment state of DTensor ``p`` (see the module doc for the layout)."""
    from torch.distributed.tensor import DTensor

    local: dict = {}
    init_moment(local, spec, p.to_local())
    mesh = p.device_mesh
    if spec.fp8:
        placements = _scale_placements(p, spec)
        nb = num_blocks(p.numel(), spec.block)
        state[spec.codes_key] = DTensor.from_local(local[spec.codes_key], mesh, p.placements, run_check=False,
                                                   shape=p.shape, stride=p.stride())
        state[spec.scale_key] = DTensor.from_local(local[spec.scale_key], mesh, placements, run_check=False,
                                                   shape=torch.Size([nb]), stride=(1,))
    else:
        state[spec.name] = DTensor.from_local(local[spec.name], mesh, p.placements, run_check=False,
                                              shape=p.shape, stride=p.stride())


def local_view(p, grad, state: dict):
    """``(p, grad, state)`` with every DTensor replaced by its local shard (same storage)."""
    def loc(t):
        return t.to_local() if is_dtensor(t) else t

    return loc(p), loc(grad), {k: loc(v) for k, v in state.items()}


def shard_rows(rows: int, mesh_sizes, coordinate, placements) -> tuple[int, int]:
    """``(first row, row count)`` of the local shard of a tensor with ``rows`` rows placed by
    ``placements`` on a mesh of ``mesh_sizes`` at ``coordinate``: each ``Shard(0)`` splits the rows
    the earlier mesh dims left as ``torch.chunk`` does (DTensor's layout: chunks of ``ceil(rows / n)``,
    the last ones shorter or empty), ``Replicate`` keeps them. Any other placement leaves no
    contiguous range of rows: a ValueError."""
    from torch.distributed.tensor import Replicate, Shard

    first, count = 0, rows
    for n, c, pl in zip(mesh_sizes, coordinate, placements):
        if isinstance(pl, Replicate):
            continue
        if type(pl) is not Shard or pl.dim != 0:
            raise ValueError(
                f"fp8pass.optim: bf16_stochastic_round numbers the elements of the whole flattened parameter, so "
                f"each rank's shard must be a range of it: replicated or sharded on dim 0 (FSDP2's layout). Got "
                f"placements {tuple(placements)}. Put this parameter in a param group with "
                f"bf16_stochastic_round=False.")
        chunk = -(-count // n)
        lo = min(c * chunk, count)
        first, count = first + lo, min(chunk, count - lo)
    return first, count


def flat_offset(p) -> int:
    """Index, in the whole flattened DTensor ``p``, of the first element of this rank's local shard
    (see :func:`shard_rows`; the shard is the contiguous range of its rows)."""
    coordinate = p.device_mesh.get_coordinate()
    if coordinate is None:  # this rank holds nothing of p
        return 0
    first, _ = shard_rows(p.shape[0] if p.dim() else 1, p.device_mesh.shape, coordinate, p.placements)
    return first * math.prod(p.shape[1:])
