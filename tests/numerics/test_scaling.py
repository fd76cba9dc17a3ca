"""Scales from amaxes, and delayed scaling against hand-computed sequences."""

import pytest
import torch

import fp8pass
from fp8pass import E2M1, E4M3, DelayedScaling, DelayedScalingState
from fp8pass.numerics import scale_from_amax


def test_scale_from_amax_edge_cases():
    amax = torch.tensor([2.0, 0.0, float("inf"), float("nan"), 1e-45, 3.0])
    s = scale_from_amax(amax, E4M3)
    assert s[0] == 224.0 and s[1] == 1.0 and s[2] == 1.0 and s[3] == 1.0
    assert s[4] == 2.0**126  # capped: x * scale can never overflow to Inf
    assert s[5] == torch.tensor(448.0) / torch.tensor(3.0)  # correctly rounded division
    assert torch.isnan(scale_from_amax(torch.tensor(float("nan")), E2M1))  # no NaN code: poison the group
    p2 = scale_from_amax(torch.tensor([3.0, 448.0, 500.0]), E4M3, power_of_two=True)
    assert p2.tolist() == [128.0, 1.0, 0.5]  # 2**floor(log2(448 / amax))
    assert scale_from_amax(torch.tensor(2.0), E4M3, margin=2) == 56.0


def run(recipe, amaxes, fmt=E4M3):
    st = DelayedScalingState(recipe, fmt)
    used = []
    for a in amaxes:
        used.append(float(st.scale_for(torch.tensor(a, dtype=torch.float32))))
        st.record(torch.tensor(a, dtype=torch.float32))
    return used, st


def test_delayed_max_history_margin():
    r = DelayedScaling(history_len=2, margin=1, interval=1, algo="max")
    used, st = run(r, [4.0, 2.0, 8.0, 1.0, 1.0])
    # step 1: empty history -> own amax 4 (margin applies): 448/2/4 = 56
    # after 1: hist [4] -> 56; after 2: [2,4] -> 56; after 3: [8,2] -> 28; after 4: [1,8] -> 28
    assert used == [56.0, 56.0, 56.0, 28.0, 28.0]
    assert st.amax_history.tolist() == [1.0, 1.0] and float(st.scale) == 224.0  # after 5: [1,1] -> 224


def test_delayed_most_recent_and_interval():
    r = DelayedScaling(history_len=4, interval=2, algo="most_recent")
    used, st = run(r, [7.0, 14.0, 28.0, 56.0, 112.0])
    # scale updates after recorded steps 1 (first valid), 2, 4 from the newest entry
    # step1: own 7 -> 64; after1: 64; step2 64; after2: newest 14 -> 32; step3 32; after3 no update;
    # step4 32; after4: newest 56 -> 8; step5 8
    assert used == [64.0, 64.0, 32.0, 32.0, 8.0]
    assert st.amax_history.tolist() == [112.0, 56.0, 28.0, 14.0]
    assert int(st.steps) == 5


def test_nonfinite_amax_is_skipped_counted_and_warned_once():
    r = DelayedScaling(history_len=3)
    st = DelayedScalingState(r, E4M3)
    st.record(torch.tensor(4.0))
    with pytest.warns(RuntimeWarning, match="non-finite amax"):
        st.record(torch.tensor(float("nan")))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        st.record(torch.tensor(float("inf")))  # second skip: no second warning
    assert torch.isfinite(st.amax_history).all() and float(st.scale) == 112.0
    assert int(st.skipped) == 2 and int(st.steps) == 3


def test_state_dict_round_trip_and_errors(tmp_path):
    r = DelayedScaling(history_len=4)
    _, st = run(r, [1.0, 3.0, 2.0])
    sd = st.state_dict()
    torch.save(sd, tmp_path / "s.pt")
    loaded = torch.load(tmp_path / "s.pt", weights_only=True)
    st2 = DelayedScalingState(r, E4M3)
    st2.load_state_dict(loaded)
    for k in sd:
        assert torch.equal(getattr(st2, k), getattr(st, k))
    with pytest.raises(ValueError, match="history_len"):
        DelayedScalingState(DelayedScaling(history_len=2), E4M3).load_state_dict(sd)
    with pytest.raises(KeyError, match="missing"):
        st2.load_state_dict({"scale": sd["scale"]})


def test_recipe_validation():
    with pytest.raises(ValueError, match="max, most_recent"):
        DelayedScaling(algo="mean")
    with pytest.raises(ValueError, match="history_len"):
        DelayedScaling(history_len=0)
    with pytest.raises(ValueError, match="interval"):
        DelayedScaling(interval=0)
    with pytest.raises(ValueError, match="tensor, row, block"):
        fp8pass.CurrentScaling(granularity="col")


def test_delayed_scale_used_in_quantize():
    # A cast with the delayed scale saturates a sudden spike: the behaviour Smooth-SwiGLU targets.
    r = DelayedScaling(history_len=4)
    st = DelayedScalingState(r, E4M3)
    for _ in range(4):
        st.record(torch.tensor(1.0))
    spike = torch.tensor([100.0, 0.5])
    q = fp8pass.quantize(spike, E4M3, scale=st.scale_for())
    assert q.dequantize()[0] == 1.0  # 100 * 448 clamps to 448 -> 448 / 448
    assert q.dequantize()[1] == 0.5


def test_quantize_delayed_records_amax_and_uses_previous_scale(kernels):
    st = DelayedScalingState(DelayedScaling(history_len=4), E4M3)
    x1 = torch.randn(64, 64)
    q1 = fp8pass.quantize_delayed(x1, st)  # empty history: scales from its own amax
    assert torch.equal(q1.scale, scale_from_amax(x1.abs().max(), E4M3))
    assert st.amax_history[0] == x1.abs().max()
    x2 = torch.randn(64, 64) * 10
    q2 = fp8pass.quantize_delayed(x2, st)  # uses the scale from x1's amax, records x2's
    assert torch.equal(q2.scale, scale_from_amax(x1.abs().max(), E4M3))
    assert torch.equal(q2.data.view(torch.uint8), fp8pass.quantize(x2, E4M3, scale=q2.scale).data.view(torch.uint8))
    assert st.amax_history[:2].tolist() == [x2.abs().max().item(), x1.abs().max().item()]
    assert float(st.scale) == float(scale_from_amax(x2.abs().max(), E4M3))


# ---- batched records, gradient accumulation, state identity -----------------------------------

from fp8pass.numerics.scaling import NO_PENDING  # noqa: E402
from fp8pass.runtime import state as runtime_state  # noqa: E402


def _state_with_history(recipe, fmt, experts, seed):
    st = DelayedScalingState(recipe, fmt, experts=experts)
    g = torch.Generator().manual_seed(seed)
    for _ in range(seed % 3):
        st.record(torch.rand(st.scale.shape, generator=g) * 10)
    return st


@pytest.mark.parametrize("with_experts", [True, False])  # concatenated rows / stacked single states
def test_batched_record_is_bit_identical_to_one_record_per_state(with_experts):
    recipe = DelayedScaling(history_len=4, margin=1, interval=2)
    fmts = [E4M3, fp8pass.E5M2, E4M3, E4M3, fp8pass.E5M2]
    experts = [None, None, 3, None, 2] if with_experts else [None] * 5
    amaxes = [torch.tensor(3.0), torch.tensor(float("nan")), torch.tensor([1.0, 5e30, 0.0]), torch.tensor(0.25),
              torch.tensor([2.0, float("inf")])]
    if not with_experts:
        amaxes[2], amaxes[4] = torch.tensor([5e30]), torch.tensor(float("inf"))
    one = [_state_with_history(recipe, f, e, i) for i, (f, e) in enumerate(zip(fmts, experts))]
    many = [_state_with_history(recipe, f, e, i) for i, (f, e) in enumerate(zip(fmts, experts))]
    many[3].accumulate.fill_(True)
    one[3].accumulate.fill_(True)
    for st, a in zip(one, amaxes):
        runtime_state.record(st.op_tensors(), a, st.fmt, recipe)
    ptrs = [[t.data_ptr() for t in st.op_tensors()] for st in many]
    fields = ("amax_history", "scale", "steps", "skipped", "overflows", "pending", "accumulate")
    torch.ops.fp8pass.delayed_record_many_(*([getattr(st, f) for st in many] for f in fields), amaxes,
                                           [st.fmt.name for st in many], 1.0, 2, "max", False)
    for a, b, p in zip(one, many, ptrs):
        for f in fields:
            assert torch.equal(getattr(a, f), getattr(b, f)), f
        assert [t.data_ptr() for t in b.op_tensors()] == p
    assert int(many[1].skipped) == 1 and float(many[3].pending) == 0.25 and int(many[3].steps) == 0


def _one_linear(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(32, 16, bias=False)


def _compiled(model, compiler="aot_eager"):
    torch._dynamo.reset()
    cfg = fp8pass.Config(recipe=DelayedScaling(history_len=4), grad_stochastic_rounding=False, compiler=compiler)
    return torch.compile(model, backend=fp8pass.backend(cfg))


def test_accumulate_scaling_records_the_max_over_micro_batches_once_per_step():
    model = _one_linear()
    cm = _compiled(model)
    xs = [torch.randn(8, 32) * s for s in (1.0, 3.0, 0.5)]
    gs = [torch.randn(8, 16) * s for s in (0.25, 0.125, 2.0)]
    w_amax = float(model.weight.detach().abs().max())
    history = {"input": [], "weight": [], "grad_output": []}
    for step in range(2):
        scale_before = None
        with fp8pass.accumulate_scaling(model):
            for k, (x, g) in enumerate(zip(xs, gs)):
                cm(x * (step + 1)).backward(g * (step + 1))
                st = runtime_state._REGISTRY[model.weight]
                if scale_before is None:
                    scale_before = {r: s.scale.clone() for r, s in st.roles().items()}
                for r, s in st.roles().items():  # nothing committed inside the context
                    assert int(s.steps) == step and torch.equal(s.scale, scale_before[r])
        history["input"].insert(0, max(float(x.abs().max()) for x in xs) * (step + 1))
        history["weight"].insert(0, w_amax)
        history["grad_output"].insert(0, max(float(g.abs().max()) for g in gs) * (step + 1))
        for role, s in st.roles().items():
            assert int(s.steps) == step + 1 and float(s.pending) == NO_PENDING and not bool(s.accumulate)
            assert s.amax_history.tolist() == history[role] + [0.0] * (3 - step), role
            assert float(s.scale) == float(scale_from_amax(torch.tensor(max(history[role])), s.fmt))
    # without the context every micro-batch records
    for x, g in zip(xs, gs):
        cm(x).backward(g)
    assert int(st.input.steps) == 5


def test_accumulated_nan_micro_batch_skips_the_step():
    model = _one_linear()
    cm = _compiled(model)
    cm(torch.randn(8, 32)).backward(torch.randn(8, 16))
    st = runtime_state._REGISTRY[model.weight]
    before = st.input.amax_history.clone()
    bad = torch.randn(8, 32)
    bad[0, 0] = float("nan")
    with fp8pass.accumulate_scaling(model):
        cm(torch.randn(8, 32)).backward(torch.randn(8, 16))
        cm(bad).backward(torch.randn(8, 16))
    assert int(st.input.skipped) == 1 and int(st.input.steps) == 2 and torch.equal(st.input.amax_history, before)
    assert int(st.weight.skipped) == 0 and int(st.weight.steps) == 2


def test_state_tensors_keep_their_storage_across_compiled_steps():
    model = _one_linear()
    cm = _compiled(model, compiler="inductor")
    opt = fp8pass.optim.AdamW(model.parameters(), lr=1e-3)
    x, g = torch.randn(8, 32), torch.randn(8, 16)
    cm(x).backward(g)
    st = runtime_state._REGISTRY[model.weight]
    ptrs = [(t, t.data_ptr()) for s in st.roles().values() for t in s.op_tensors()]
    for _ in range(3):
        opt.zero_grad()
        cm(x).backward(g)
        opt.step()
    assert all(t.data_ptr() == p for t, p in ptrs)
    assert all(t is u for (t, _), u in zip(ptrs, [t for s in st.roles().values() for t in s.op_tensors()]))
    assert int(st.input.steps) == 4 and int(st.grad_output.steps) == 4


def test_trainer_grad_accum_updates_scales_once_per_optimizer_step(tmp_path):
    from fp8pass.train import ModelConfig, TrainConfig, train

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(200)))
    torch._dynamo.reset()
    cfg = TrainConfig(recipe="fp8", steps=2, grad_accum=3, out=str(tmp_path / "run"), data=str(corpus),
                      batch_size=2, seq_len=16, model=ModelConfig(d_model=32, n_layers=1, n_heads=2, ffn=64,
                                                                  max_seq_len=16),
                      eval_every=10, eval_batches=1, ckpt_every=10, monitor_every=0, warmup=1, progress=False,
                      compiler="aot_eager")
    seen = {}  # the state after each optimizer step (before the final evaluation's forward records)
    r = train(cfg, callbacks=[lambda step, model, log, final=False: seen.update({step: fp8pass.scaling_state_dict(
        model)})])
    assert r.status == "finished"
    assert {int(v) for k, v in seen[1].items() if k.endswith(".steps")} == {1}
    sd = seen[2]
    steps = {k: int(v) for k, v in sd.items() if k.endswith(".steps")}
    assert steps and set(steps.values()) == {2}, steps  # 2 optimizer steps of 3 micro-batches each


@pytest.mark.distributed  # 2 gloo processes, ~15 s
def test_accumulated_amaxes_agree_across_data_parallel_ranks(tmp_path):
    """2 ranks (gloo), DDP, 3 micro-batches per step on per-rank rows: after every optimizer step
    both ranks hold the same scales and histories (the pending maxima are reduced with the
    histories), one history entry per optimizer step."""
    import _dist
    import _dist_accum

    outs = _dist.spawn(_dist_accum.accumulate_worker, 2, tmp_path, 2, 3)
    for step in range(2):
        a, b = outs[0]["states"][step], outs[1]["states"][step]
        assert a and a.keys() == b.keys()
        differ = [k for k in a if not torch.equal(a[k], b[k])]
        assert not differ, differ
        # steps: one per optimizer step (Smooth-SwiGLU casts W_down / c with current scaling: no records)
        assert all(float(v[-1]) == (0 if k.endswith("down_proj.weight.weight") else step + 1) for k, v in a.items())
