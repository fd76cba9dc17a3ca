"""bf16 weights with stochastic rounding (AdamW(bf16_stochastic_round=True), issue 31): FSDP2 shards it,
DCP reshards it, bit for bit.

The 2-process test carries the ``distributed`` marker (``python -m pytest -m distributed
tests/distributed/test_bf16_sr_sharded.py``); it compiles nothing and takes seconds, so it is not
``slow``. The single-process checks of the counter numbering run everywhere.
"""

import _dist
import _dist_sr
import pytest
import torch

from fp8pass.numerics.casts import uniform_bits
from fp8pass.optim.sharded import shard_rows


def _hash(counters, seed: int) -> torch.Tensor:
    """uniform_bits written out in Python integers for any counters: murmur3's finalizer of
    ``i * golden + seed`` mod 2**32, as int32."""
    m = 0xFFFFFFFF
    out = []
    for i in counters:
        h = (i * 0x9E3779B1 + seed) & m
        h = ((h ^ (h >> 16)) * 0x85EBCA6B) & m
        h = ((h ^ (h >> 13)) * 0xC2B2AE35) & m
        h ^= h >> 16
        out.append(h - 2**32 if h >= 2**31 else h)
    return torch.tensor(out, dtype=torch.int32)


@pytest.mark.parametrize("seed", [0, 12345, 2**31 - 1, -2**31])
def test_a_counter_start_draws_the_bits_of_the_shifted_counters(seed):
    s = torch.tensor(seed, dtype=torch.int32)
    assert torch.equal(uniform_bits(10, s), _hash(range(10), seed))  # the reference is the hash
    for offset in (0, 1, 1000, 2**20 + 3, 2**31 - 10):
        got = uniform_bits(10, s, start=offset)
        assert torch.equal(got, _hash(range(offset, offset + 10), seed)), offset
    assert torch.equal(uniform_bits(7, s, start=93), uniform_bits(100, s)[93:])


def test_shard_rows_follow_torch_chunk_and_refuse_other_layouts():
    from torch.distributed.tensor import Replicate, Shard

    for rows in range(0, 13):
        for n in (1, 2, 3, 4, 5):
            chunks = torch.arange(rows).chunk(n)
            for c in range(n):
                want = chunks[c].tolist() if c < len(chunks) else []
                first, count = shard_rows(rows, (n,), (c,), (Shard(0),))
                assert count == len(want) and (not want or first == want[0]), (rows, n, c)
    # HSDP (replicate, shard) and nested row shards: rows split by the earlier mesh dim first
    assert shard_rows(10, (2, 2), (1, 1), (Replicate(), Shard(0))) == (5, 5)
    assert shard_rows(10, (2, 2), (1, 1), (Shard(0), Shard(0))) == (8, 2)
    assert shard_rows(10, (2, 2), (0, 1), (Shard(0), Shard(0))) == (3, 2)
    with pytest.raises(ValueError, match="bf16_stochastic_round numbers the elements .*Shard\\(dim=1\\)"):
        shard_rows(10, (2,), (0,), (Shard(1),))


def _assert_bits_equal(got: dict, want: dict, what: str):
    assert got.keys() == want.keys(), what
    for k in want:
        a, b = got[k], want[k]
        assert a.dtype == b.dtype and a.shape == b.shape, (what, k)
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), f"{what}: {k} differs"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process (uninterrupted; and 2 steps then a DCP save), then 2 FSDP2 ranks (uninterrupted with a
    save at step 2; and resumed from the one-process save), then one process resumed from the ranks' save."""
    tmp = tmp_path_factory.mktemp("bf16sr")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run
    try:
        ref = _dist_sr.single_process()
        _dist_sr.single_process(0, _dist_sr.CKPT_STEP, save=str(tmp / "ckpt_one"))
        outs = _dist.spawn(_dist_sr.fsdp_worker, 2, tmp, str(tmp / "ckpt_one"))
        resumed = _dist_sr.single_process(_dist_sr.CKPT_STEP, _dist_sr.STEPS, load=str(tmp / "ckpt_fsdp"))
    finally:
        torch.set_num_threads(threads)
    return ref, outs, resumed


@pytest.mark.distributed
def test_fsdp2_step_is_bit_identical_to_one_process(runs):
    """Each rank updates its shard; the whole weights and moments equal one process's after every step:
    each shard's elements take the counters of their places in the whole parameter, every rank the
    same seed (the optimizer's generator seeded alike), FP8 block scales per whole block of a shard."""
    ref, outs, _ = runs
    assert outs[0]["offsets"] == {"a.weight": 0, "a.bias": 0, "b.weight": 0, "b.bias": 0, "c.weight": 0,
                                  "tiny": 0}
    assert outs[1]["offsets"] == {"a.weight": 32 * 32, "a.bias": 32, "b.weight": 17 * 64, "b.bias": 17,
                                  "c.weight": 4 * 33, "tiny": 8}  # rank 1 holds no row of tiny
    assert len(outs[0]["run"]) == len(ref) == _dist_sr.STEPS
    for step, want in enumerate(ref):
        for out in outs:  # every rank gathers the same whole tensors
            got = out["run"][step]
            _assert_bits_equal(got["grads"], want["grads"], f"step {step} gradients")  # FSDP2's mean of equal grads
            _assert_bits_equal(got["weights"], want["weights"], f"step {step} weights")
            _assert_bits_equal(got["state"], want["state"], f"step {step} optimizer state")
    assert {"a.weight.exp_avg_codes", "a.weight.exp_avg_scale", "b.weight.exp_avg"} <= ref[-1]["state"].keys()
    assert not torch.equal(ref[-1]["weights"]["a.weight"], _dist_sr.make_model().a.weight.detach())


@pytest.mark.distributed
def test_dcp_reshards_2_ranks_to_1_and_1_to_2_and_training_continues_bit_identically(runs):
    """DCP after 2 steps: written by 2 FSDP2 ranks and loaded into one process, or written by one process
    and loaded into 2 ranks; steps 3-4 then equal the uninterrupted run's bit for bit (weights, FP8
    codes and block scales, dense moments, step counts), with the optimizer's generator saved beside."""
    ref, outs, resumed = runs
    for step in range(_dist_sr.CKPT_STEP, _dist_sr.STEPS):
        want = ref[step]
        got = resumed[step - _dist_sr.CKPT_STEP]
        _assert_bits_equal(got["weights"], want["weights"], f"2 -> 1, step {step} weights")
        _assert_bits_equal(got["state"], want["state"], f"2 -> 1, step {step} optimizer state")
        for rank, out in enumerate(outs):
            got = out["resumed"][step - _dist_sr.CKPT_STEP]
            _assert_bits_equal(got["weights"], want["weights"], f"1 -> 2, rank {rank}, step {step} weights")
            _assert_bits_equal(got["state"], want["state"], f"1 -> 2, rank {rank}, step {step} optimizer state")
