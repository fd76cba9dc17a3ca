"""Single-process checks of the amax reduction rule (fast; the multi-process runs are in test_distributed.py)."""

import pytest
import torch

import fp8pass
from fp8pass.distributed.amax_sync import _recompute_scales


@pytest.mark.parametrize("recipe", [fp8pass.DelayedScaling(history_len=4),
                                    fp8pass.DelayedScaling(history_len=4, interval=3, margin=1, power_of_two=True),
                                    fp8pass.DelayedScaling(history_len=4, algo="most_recent")])
def test_max_of_rank_histories_equals_one_process_on_the_union(recipe):
    """Rank states recording their own amaxes, then max-reduced + rescaled, equal one state recording the max."""
    g = torch.Generator().manual_seed(0)
    ranks = [fp8pass.DelayedScalingState(recipe, fp8pass.E4M3) for _ in range(2)]
    single = fp8pass.DelayedScalingState(recipe, fp8pass.E4M3)
    for step in range(7):
        amaxes = torch.rand(2, generator=g) * 10 ** (step % 3)
        for s, a in zip(ranks, amaxes):
            s.record(a)
        single.record(amaxes.max())
        reduced = torch.maximum(ranks[0].amax_history, ranks[1].amax_history)  # what all_reduce(MAX) gives
        for s in ranks:
            s.amax_history.copy_(reduced)
        _recompute_scales(ranks)
        for s in ranks:
            assert torch.equal(s.amax_history, single.amax_history)
            assert torch.equal(s.scale, single.scale), (step, s.scale, single.scale)


def test_sync_without_process_group_keeps_state():
    """One process (no process group): sync issues no collective and leaves scales as recorded."""
    model = torch.nn.Sequential(torch.nn.Linear(32, 32))
    cfg = fp8pass.Config(compiler="eager", grad_stochastic_rounding=False)
    out = torch.compile(model, backend=fp8pass.backend(cfg))(torch.randn(4, 32))
    out.sum().backward()
    before = {k: v.clone() for k, v in fp8pass.scaling_state_dict(model).items()}
    sync = fp8pass.distributed.AmaxSync(model)
    assert sync.sync() == 3 and sync.calls == 0
    after = fp8pass.scaling_state_dict(model)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(32, 32)

    def forward(self, x):
        return self.proj(x)


def test_per_block_compile_with_one_backend_keeps_each_blocks_state():
    """Dynamo reuses one compiled frame for same-structure modules (their weights are graph inputs);
    each block must still record into its own weights' state (FSDP2's per-block compile pattern)."""
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(_Block() for _ in range(2))
    with torch.no_grad():
        blocks[1].proj.weight.mul_(4)
    be = fp8pass.backend(fp8pass.Config(compiler="eager", grad_stochastic_rounding=False))
    for b in blocks:
        b.compile(backend=be)
    x = torch.randn(4, 32)
    blocks[1](blocks[0](x)).sum().backward()
    sd = fp8pass.scaling_state_dict(blocks)
    for i, b in enumerate(blocks):
        assert int(sd[f"{i}.proj.weight.weight.steps"]) == 1
        assert sd[f"{i}.proj.weight.weight.amax_history"][0] == b.proj.weight.detach().abs().max()


def test_expert_states_join_the_all_reduce(monkeypatch):
    """Per-expert ([E, history]) states are reduced with the dense ones: after a (simulated) 2-rank
    MAX all-reduce, each expert's history is the max over ranks and its scale follows from it."""
    import torch.distributed as dist

    from fp8pass.runtime.state import grouped_state_for

    recipe = fp8pass.DelayedScaling(history_len=4)
    model = torch.nn.Module()
    model.experts = torch.nn.Parameter(torch.randn(3, 32, 16))
    st = grouped_state_for(model.experts, recipe)
    st.record_forward(torch.tensor([1.0, 2.0, 4.0]), torch.tensor([0.5, 0.5, 0.5]))
    other_rank = {"input": torch.tensor([[8.0, 0, 0, 0], [1.0, 0, 0, 0], [2.0, 0, 0, 0]])}

    def fake_all_reduce(buf, op=None, group=None):
        if buf.numel() == 2:  # AmaxSync's one-time layout check: the other rank has the same layout
            return
        remote = buf.clone()
        remote[: 12] = other_rank["input"].reshape(-1)  # the input role comes first
        torch.maximum(buf, remote, out=buf)

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
    n = fp8pass.distributed.AmaxSync(model).sync()
    assert n == 3  # input, weight, grad_output of the one expert stack
    assert st.input.amax_history[:, 0].tolist() == [8.0, 2.0, 4.0]
    assert torch.equal(st.input.scale, 448.0 / torch.tensor([8.0, 2.0, 4.0]))


def test_ranks_with_different_states_get_a_clear_error_not_a_mix(monkeypatch):
    import torch.distributed as dist

    from fp8pass.runtime.state import state_for

    model = torch.nn.Linear(32, 32)
    state_for(model.weight, fp8pass.DelayedScaling())
    calls = []

    def fake_all_reduce(buf, op=None, group=None):
        calls.append(buf.numel())
        if buf.numel() == 2:  # the layout check: another rank holds 16 values more
            buf[0] += 16

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
    with pytest.raises(RuntimeError, match="ranks hold different sets of delayed-scaling state"):
        fp8pass.distributed.AmaxSync(model).sync()
    assert calls == [2]  # the data collective never ran
