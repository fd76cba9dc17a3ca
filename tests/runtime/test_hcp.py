"""Hot-channel patching: exactness at k=100% (forward and both gradients), identity at k=0, both modes,
hot channels from both operands' error, state updates."""

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
    y, err, _ = OP(x, w, None, st.op_args(), None, True, True, 0, True, second_order, mode, True)
    return y, err, st


def _plain(x, w):
    return OP(x, w, None, [], None, True, True, 0, True, True, "split", False)[0]


def _residuals(x, w):
    xq = fp8pass.quantize(x, fp8pass.E2M1, granularity="block", block=(1, 16)).dequantize(torch.float64)
    wq = fp8pass.quantize(w, fp8pass.E2M1, granularity="block", block=(16, 16)).dequantize(torch.float64)
    return x.double() - xq, w.double() - wq


@pytest.mark.parametrize("mode", ["split", "concat"])
def test_all_channels_second_order_is_the_high_precision_gemm(mode):
    x, w = _data()
    y, _, _ = _run(x, w, 1.0, True, mode)
    ref = x.double() @ w.double().T
    plain = _plain(x, w)
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
    plain = _plain(x, w)
    for mode in ("split", "concat"):
        y, err, st = _run(x, w, 0.0, True, mode)
        assert st.hot.numel() == 0 and torch.equal(y, plain)
        assert err.shape == (64,)


def test_modes_agree_and_hot_channels_reduce_error():
    x, w = _data()
    ys = {m: _run(x, w, 0.09, True, m)[0] for m in ("split", "concat")}
    torch.testing.assert_close(ys["split"], ys["concat"], rtol=1e-5, atol=1e-5)
    ref = x @ w.T
    plain = _plain(x, w)
    assert (ys["split"] - ref).norm() < 0.8 * (plain - ref).norm()


def test_per_channel_error_is_the_gemm_error_through_each_channel():
    x, w = _data()
    _, err, st = _run(x, w, 2 / 64)
    dx, dw = _residuals(x, w)
    xq, wq = x.double() - dx, w.double() - dw
    # ||X_c W_c^T - Q(X)_c Q(W)_c^T||_F^2 from the outer products themselves
    ref = torch.stack([(torch.outer(x.double()[:, c], w.double()[:, c]) - torch.outer(xq[:, c], wq[:, c])).square().sum()
                       for c in range(64)])
    torch.testing.assert_close(err.double(), ref, rtol=1e-4, atol=1e-6)
    st.update(err)
    assert st.hot.tolist() == sorted(torch.topk(err, 2).indices.tolist())
    assert 5 in st.hot.tolist()  # the 30x channel has the largest error


def test_hot_channels_come_from_both_operands():
    """A weight column with a large quantization error is hot although its input channel is ordinary
    (choosing from the input's error alone, as before, misses it)."""
    x, w = _data()
    w[:, 20] = torch.linspace(-1.0, 1.0, w.shape[0]) * 40.0  # a large, hard-to-quantize weight column
    w[:3, 20] = torch.tensor([400.0, -371.0, 389.0])
    _, err, st = _run(x, w, 2 / 64)
    dx, _ = _residuals(x, w)
    input_only = sorted(torch.topk((dx * dx).sum(0), 2).indices.tolist())
    assert 20 not in input_only
    st.update(err)
    assert 20 in st.hot.tolist() and 5 in st.hot.tolist()


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


def _grads(x, w, dy, hcp, **recipe):
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    fp8pass.ops.nvfp4_linear(xr, wr, recipe=NVFP4Scaling(hcp=hcp, **recipe),
                             hcp_state=None if hcp is None else HCPState(hcp, w.shape[1])).backward(dy)
    return xr.grad.double(), wr.grad.double()


def test_without_backward_hcp_the_gradients_are_the_nvfp4_recipe():
    x, w = _data()
    dy = torch.randn(32, 48)
    plain = _grads(x, w, dy, None, grad_stochastic_rounding=False)
    for hcp in (HotChannelPatching(fraction=0.5, backward=False), HotChannelPatching(fraction=0.0)):
        got = _grads(x, w, dy, hcp, grad_stochastic_rounding=False)
        assert torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1])


@pytest.mark.parametrize("sr,rht", [(True, True), (False, False)])
def test_backward_hcp_all_channels_second_order_gives_the_high_precision_gradients(sr, rht):
    x, w = _data()
    dy = torch.randn(32, 48, generator=torch.Generator().manual_seed(5))
    gx, gw = _grads(x, w, dy, HotChannelPatching(fraction=1.0), grad_stochastic_rounding=sr, rht=rht)
    rx, rw = dy.double() @ w.double(), dy.double().T @ x.double()
    px, pw = _grads(x, w, dy, None, grad_stochastic_rounding=sr, rht=rht)
    assert (gx - rx).abs().max() < 1e-5 * rx.abs().max() and (gw - rw).abs().max() < 1e-5 * rw.abs().max()
    assert (px - rx).abs().max() > 1e-2 * rx.abs().max()  # NVFP4 gradients alone are far off


def test_backward_hcp_first_order_misses_exactly_the_second_order_terms():
    x, w = _data()
    dy = torch.randn(32, 48, generator=torch.Generator().manual_seed(6))
    gx, gw = _grads(x, w, dy, HotChannelPatching(fraction=1.0, second_order=False), grad_stochastic_rounding=False,
                    rht=False)
    q = lambda t, blk: fp8pass.quantize(t, fp8pass.E2M1, granularity="block", block=blk).dequantize(torch.float64)
    d_dy = dy.double() - q(dy, (1, 16))
    _, dw = _residuals(x, w)
    # dgrad (dy, W^T): misses d(dy) dW; wgrad (dy^T, x^T), tokens last: misses d(dy^T) d(x^T)^T
    torch.testing.assert_close(gx, dy.double() @ w.double() - d_dy @ dw, rtol=1e-5, atol=1e-5)
    d_dyt = dy.double().T - q(dy.t().contiguous(), (1, 16))
    d_xt = x.double().T - q(x.t().contiguous(), (1, 16))
    torch.testing.assert_close(gw, dy.double().T @ x.double() - d_dyt @ d_xt.T, rtol=1e-5, atol=1e-4)


def test_backward_hcp_patches_only_the_hot_columns_and_reduces_their_error():
    x, w = _data()
    dy = torch.randn(32, 48, generator=torch.Generator().manual_seed(7))
    hcp = HotChannelPatching(fraction=4 / 64)
    st = HCPState(hcp, 64)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    fp8pass.ops.nvfp4_linear(xr, wr, recipe=NVFP4Scaling(hcp=hcp, grad_stochastic_rounding=False),
                             hcp_state=st).backward(dy)
    hot = st.hot.tolist()  # chosen on the first call, the set this backward patched
    cold = [c for c in range(64) if c not in hot]
    px, pw = _grads(x, w, dy, None, grad_stochastic_rounding=False)
    assert torch.equal(xr.grad.double()[:, cold], px[:, cold]) and torch.equal(wr.grad.double()[:, cold], pw[:, cold])
    rx, rw = dy.double() @ w.double(), dy.double().T @ x.double()
    assert (xr.grad.double() - rx)[:, hot].norm() < 1e-4 * rx[:, hot].norm() < (px - rx)[:, hot].norm()
    assert (wr.grad.double() - rw)[:, hot].norm() < 1e-4 * rw[:, hot].norm() < (pw - rw)[:, hot].norm()


def test_the_seed_expansion_is_exact():
    """The seed document writes Q(W)^T Q(X) = W^T X + W^T dX + dW^T X + dW^T dX with d = Q(.) - (.):
    exact (no term counted twice). Truncated after first order it leaves +dW^T dX; our split around
    the quantized operands leaves -dW^T dX: same size, opposite sign."""
    x, w = _data()
    dx, dw = _residuals(x, w)  # ours: d = (.) - Q(.)
    xq, wq = x.double() - dx, w.double() - dw
    sx, sw = -dx, -dw  # the seed's sign
    exact = x.double() @ w.double().T
    seed = exact + sx @ w.double().T + x.double() @ sw.T + sx @ sw.T
    torch.testing.assert_close(seed, xq @ wq.T, rtol=1e-9, atol=1e-9)
    seed_first = xq @ wq.T - (sx @ w.double().T + x.double() @ sw.T)
    ours_first = xq @ wq.T + dx @ wq.T + xq @ dw.T
    torch.testing.assert_close(seed_first - exact, dx @ dw.T, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(ours_first - exact, -(dx @ dw.T), rtol=1e-9, atol=1e-9)


def test_opcheck_with_hcp_in_backward():
    x, w = _data(t=16, k=64, n=16)
    st = HCPState(HotChannelPatching(fraction=0.25), 64)
    torch.library.opcheck(OP, (x.requires_grad_(), w.requires_grad_(), None, st.op_args(), None, True, True, 0,
                               False, True, "concat", True),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_opcheck_update_declares_its_mutations():
    st = HCPState(HotChannelPatching(fraction=0.25, update_interval=2, decay=0.5), 8)
    chan_err = torch.tensor([0.0, 5, 1, 1, 1, 1, 4, 1])
    schema = str(torch.ops.fp8pass.hcp_update_.default._schema)
    assert schema.count("!)") == 3 and "Tensor chan_err" in schema  # err, hot, step written; chan_err read
    torch.library.opcheck(torch.ops.fp8pass.hcp_update_, (*st.op_args(), chan_err, 0.5, 2),
                          test_utils=("test_schema", "test_faketensor"))


def test_bad_config_and_state():
    with pytest.raises(ValueError, match="fraction"):
        HotChannelPatching(fraction=1.5)
    with pytest.raises(ValueError, match="mode"):
        HotChannelPatching(mode="fused")
    with pytest.raises(ValueError, match="update_interval"):
        HotChannelPatching(update_interval=0)
    x, w = _data()
    with pytest.raises(ValueError, match="channels"):
        OP(x, w, None, HCPState(HotChannelPatching(), 32).op_args(), None, True, True, 0, True, True, "split", True)
    with pytest.raises(ValueError, match="hcp_state"):
        fp8pass.ops.nvfp4_linear(x, w, hcp_state=HCPState(HotChannelPatching(), 64))
