"""Outlier analytics (fp8pass.monitor.outliers): statistics against direct formulas, hooks, persistence."""

import pytest
import torch

from fp8pass.monitor.outliers import OutlierMonitor, hot_set, outlier_stats, overlap


def test_stats_against_direct_formulas():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 48, generator=g)
    x[:, 7] *= 50.0
    x[3, 20] = 200.0  # one local spike in block 1 of row 3
    st = outlier_stats(x, top_k=2, hot_fraction=1 / 48)
    flat = x.double().reshape(-1)
    c = flat - flat.mean()
    assert st.kurtosis == pytest.approx(float((c ** 4).mean() / (c ** 2).mean() ** 2), rel=1e-9)
    assert st.top_channels == [20, 7] and st.top_values[0] == pytest.approx(200.0)
    assert st.hot == [7]  # by RMS the persistent channel wins over the single spike
    blocks = x.abs().reshape(64, 3, 16).amax(-1).reshape(-1).double()
    assert st.block_spike == pytest.approx(float(blocks.max() / blocks.median()))
    assert st.spiky_blocks == pytest.approx(float((blocks > 8 * blocks.median()).double().mean()))


def test_gaussian_kurtosis_and_ragged_blocks():
    x = torch.randn(4000, 20, generator=torch.Generator().manual_seed(1))
    st = outlier_stats(x)
    assert st.kurtosis == pytest.approx(3.0, abs=0.15)
    assert st.spiky_blocks == 0.0
    with pytest.raises(TypeError, match="float tensor"):
        outlier_stats(torch.arange(4))


def test_overlap_and_hot_set():
    assert overlap([1, 2, 3], [2, 3, 4]) == pytest.approx(2 / 3)
    assert overlap([], []) == 1.0
    assert hot_set(torch.zeros(3, 10), 0.0) == []


def test_monitor_hooks_roles_and_persistence():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    with OutlierMonitor(model, hot_fraction=2 / 32) as mon:
        for step in range(3):
            x = torch.randn(8, 32)
            x[:, 5] *= 30.0  # a persistent hot input channel of layer "0"
            if step == 1:
                x[:, 9] *= 60.0  # a transient one
            model(x).sum().backward()
            mon.record(step)
        assert set(mon.history) == {(n, r) for n in ("0", "2") for r in ("input", "weight", "grad_output")}
        per = mon.persistence("0", "input")
        assert [p[0] for p in per] == [0, 1, 2] and per[0][1] == 1.0
        assert all(5 in st.hot for _, st in mon.history[("0", "input")])
        assert "kurtosis" in mon.summary() and "grad_output" in mon.summary()
    assert not mon._handles
    with pytest.raises(ValueError, match="roles"):
        OutlierMonitor(model, roles=("activation",))
