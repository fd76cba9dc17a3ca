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
