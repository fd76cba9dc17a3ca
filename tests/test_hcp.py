"""Hot-channel patching: exactness at k=100%, identity at k=0, both modes, state updates."""

import pytest
import torch

import fp8pass
from fp8pass import HotChannelPatching, NVFP4Scaling
from fp8pass.runtime import HCPState

OP = torch.ops.fp8pass.nvfp4_linear


def _data(t=32, k=64, n=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g)
    x[:, 5] *= 30.0
    x[:, 40] *= 10.0
    return x, torch.randn(n, k, generator=g) * 0.1


def _run(x, w, fraction, second_order=True, mode="split"):
    st = HCPState(HotChannelPatching(fraction=fraction, second_order=second_order, mode=mode), w.shape[1])
    y, err = OP(x, w, None, st.op_args(), True, True, 0, True, second_order, mode)
    return y, err, st


def _residuals(x, w):
    xq = fp8pass.quantize(x, fp8pass.E2M1, granularity="block", block=(1, 16)).dequantize(torch.float64)
    wq = fp8pass.quantize(w, fp8pass.E2M1, granularity="block", block=(16, 16)).dequantize(torch.float64)
    return x.double() - xq, w.double() - wq


@pytest.mark.parametrize("mode", ["split", "concat"])
def test_all_channels_second_order_is_the_high_precision_gemm(mode):
    x, w = _data()
    y, _, _ = _run(x, w, 1.0, True, mode)
    ref = x.double() @ w.double().T
    plain, _ = OP(x, w, None, [], True, True, 0, True, True, "split")
    assert (y.double() - ref).abs().max() < 1e-5 * ref.abs().max()
    assert (plain.double() - ref).abs().max() > 1e-2 * ref.abs().max()  # NVFP4 alone is far off


@pytest.mark.parametrize("mode", ["split", "concat"])
def test_all_channels_first_order_misses_exactly_the_second_order_term(mode):
    x, w = _data()
    y, _, _ = _run(x, w, 1.0, False, mode)
    dx, dw = _residuals(x, w)
    ref = x.double() @ w.double().T - dx @ dw.T
    assert (y.double() - ref).abs().max() < 1e-5 * ref.abs().max()


def test_zero_fraction_is_plain_nvfp4_bit_for_bit():
    x, w = _data()
    plain, _ = OP(x, w, None, [], True, True, 0, True, True, "split")
    for mode in ("split", "concat"):
        y, err, st = _run(x, w, 0.0, True, mode)
        assert st.hot.numel() == 0 and torch.equal(y, plain)
        assert err.shape == (64,)


def test_modes_agree_and_hot_channels_reduce_error():
    x, w = _data()
    ys = {m: _run(x, w, 0.09, True, m)[0] for m in ("split", "concat")}
    torch.testing.assert_close(ys["split"], ys["concat"], rtol=1e-5, atol=1e-5)
    ref = x @ w.T
    plain, _ = OP(x, w, None, [], True, True, 0, True, True, "split")
    assert (ys["split"] - ref).norm() < 0.8 * (plain - ref).norm()


def test_per_channel_error_and_first_selection():
    x, w = _data()
    _, err, st = _run(x, w, 2 / 64)
    dx, _ = _residuals(x, w)
    torch.testing.assert_close(err.double(), (dx * dx).sum(0), rtol=1e-5, atol=1e-6)
    st.update(err)
    assert st.hot.tolist() == sorted(torch.topk(err, 2).indices.tolist())
    assert 5 in st.hot.tolist()  # the 30x channel has the largest error


def test_update_ema_and_refresh_interval():
    st = HCPState(HotChannelPatching(fraction=0.25, update_interval=3, decay=0.5), 8)
    e0 = torch.tensor([9.0, 1, 1, 1, 1, 1, 1, 8])
    st.update(e0)
    assert st.hot.tolist() == [0, 7] and torch.equal(st.err, e0) and int(st.step) == 1
    e1 = torch.tensor([0.0, 50, 40, 0, 0, 0, 0, 0])
    st.update(e1)  # step 1: EMA only, no refresh
    torch.testing.assert_close(st.err, 0.5 * e0 + 0.5 * e1)
    assert st.hot.tolist() == [0, 7]
    st.update(e1)  # step 2: no refresh
    assert st.hot.tolist() == [0, 7]
    st.update(e1)  # step 3: refresh from the EMA
    assert st.hot.tolist() == [1, 2] and int(st.step) == 4


def test_state_round_trips_as_plain_tensors():
    cfg = HotChannelPatching(fraction=0.25)
    a = HCPState(cfg, 8)
    a.update(torch.arange(8.0))
    sd = a.state_dict()
    assert set(sd) == {"hcp.err", "hcp.hot", "hcp.step"} and all(type(v) is torch.Tensor for v in sd.values())
    b = HCPState(cfg, 8)
    b.load_state_dict(sd)
    assert all(torch.equal(getattr(a, k), getattr(b, k)) for k in ("err", "hot", "step"))
    with pytest.raises(ValueError, match="shape"):
        HCPState(HotChannelPatching(fraction=0.5), 8).load_state_dict(sd)


def test_hcp_leaves_backward_the_nvfp4_recipe():
    x, w = _data()
    dy = torch.randn(32, 48)
    grads = []
    for frac in (None, 0.5):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        hcp = None if frac is None else HotChannelPatching(fraction=frac)
        fp8pass.ops.nvfp4_linear(xr, wr, recipe=NVFP4Scaling(hcp=hcp, grad_stochastic_rounding=False),
                                 hcp_state=None if hcp is None else HCPState(hcp, 64)).backward(dy)
        grads.append((xr.grad, wr.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_bad_config_and_state():
    with pytest.raises(ValueError, match="fraction"):
        HotChannelPatching(fraction=1.5)
    with pytest.raises(ValueError, match="mode"):
        HotChannelPatching(mode="fused")
    with pytest.raises(ValueError, match="update_interval"):
        HotChannelPatching(update_interval=0)
    x, w = _data()
    with pytest.raises(ValueError, match="channels"):
        OP(x, w, None, HCPState(HotChannelPatching(), 32).op_args(), True, True, 0, True, True, "split")
    with pytest.raises(ValueError, match="hcp_state"):
        fp8pass.ops.nvfp4_linear(x, w, hcp_state=HCPState(HotChannelPatching(), 64))
