"""fp8pass.offload_saved_activations: saved tensors go to host memory and come back bit for bit.

On the CPU the host copy is a plain copy (the path the CUDA side stream takes, without streams), so
these tests check the hooks' logic: what is moved and what stays (exact counts and bytes), the
prefetch along the chain of packs, that a tensor something else still holds comes back itself (state
the compiled backward updates in place), and that training with it on is bit-identical to without,
eager and through torch.compile(backend=fp8pass.backend(...)).
"""

import pytest
import torch
from torch import nn

import fp8pass
from fp8pass.memory import OffloadStats, SavedActivationOffload


def _tiny():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32, bias=False), nn.Tanh(), nn.Linear(32, 8, bias=False))


def _backward_once(model, x, ctx):
    with ctx:
        loss = model(x).square().sum()
    loss.backward()
    return loss


def test_exact_counts_for_a_known_model():
    """Linear(16, 32) -> Tanh -> Linear(32, 8), then square, on x [4, 16] (x needs no grad): the first mm
    saves x (256 B), tanh its output h (512 B), the second mm h again (512 B, packed separately) and
    w2.t() (a view of a parameter: stays), square its input y (128 B). x is still held by the test at
    backward: it comes back itself; the other three come back from their host copies."""
    model, x = _tiny(), torch.randn(4, 16)
    ctx = fp8pass.offload_saved_activations(min_bytes=0)
    _backward_once(model, x, ctx)
    assert ctx.stats == OffloadStats(offloaded_tensors=4, offloaded_bytes=256 + 512 + 512 + 128,
                                     kept_tensors=0, kept_bytes=0, parameters=1, restored_tensors=3,
                                     originals_alive=1, originals_alive_bytes=256, prefetched_tensors=2)
    ctx.reset()
    _backward_once(model, x, fp8pass.offload_saved_activations(min_bytes=257))  # a new context: new stats
    assert ctx.stats == OffloadStats()
    small = fp8pass.offload_saved_activations(min_bytes=257)
    _backward_once(model, x, small)
    assert (small.stats.offloaded_tensors, small.stats.offloaded_bytes) == (2, 1024)
    assert (small.stats.kept_tensors, small.stats.kept_bytes) == (2, 256 + 128)  # x and y are under it


@pytest.mark.parametrize("prefetch, expected", [(0, 0), (1, 2), (2, 2)])
def test_prefetch_follows_the_packs_backwards(prefetch, expected):
    """Backward unpacks y (square), h (2nd mm), h (tanh), then x: the reverse of the packs; with
    prefetch >= 1 each unpack starts the copy back of the ones packed before it, except x: it is still
    alive, so it will come back itself."""
    model, x = _tiny(), torch.randn(4, 16)
    ctx = fp8pass.offload_saved_activations(min_bytes=0, prefetch=prefetch)
    _backward_once(model, x, ctx)
    assert ctx.stats.prefetched_tensors == expected
    assert ctx.stats.restored_tensors == 3


def test_a_saved_tensor_used_twice_comes_back_twice():
    model, x = _tiny(), torch.randn(4, 16)
    ctx = fp8pass.offload_saved_activations(min_bytes=0)
    with ctx:
        loss = model(x).square().sum()
    first = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
    second = torch.autograd.grad(loss, list(model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert ctx.stats.restored_tensors == 6


def test_views_that_are_not_dense_stay():
    a = torch.randn(4, 1, requires_grad=True)
    b = torch.randn(4, 8, requires_grad=True)
    ctx = fp8pass.offload_saved_activations(min_bytes=0)
    with ctx:
        out = (a.expand(4, 8) * b).sum()  # mul saves the expanded view (one column, stride 0) and b
    out.backward()
    assert (ctx.stats.kept_tensors, ctx.stats.kept_bytes) == (1, 4 * 8 * 4)
    assert ctx.stats.offloaded_tensors == 1
    assert torch.equal(a.grad, b.sum(1, keepdim=True).detach())


def _train(model, fwd, steps, ctx):
    opt = fp8pass.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    record = []
    for _ in range(steps):
        x = torch.randn(8, 64, generator=g)
        opt.zero_grad(set_to_none=True)
        if ctx is None:
            loss = fwd(x).square().mean()
        else:
            with ctx:
                loss = fwd(x).square().mean()
        loss.backward()
        record.append((loss.detach().clone(), [p.grad.clone() for p in model.parameters()]))
        opt.step()
    return record, [p.detach().clone() for p in model.parameters()]


def _glu():
    from fp8pass.testing.models import SiluMul

    torch.manual_seed(0)
    return SiluMul(64, 128)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "fp8-compiled"])
def test_training_is_bit_identical_with_offload(compiled):
    """Losses, gradients and parameters after 3 AdamW steps, offload on (every saved tensor moved,
    min_bytes=0) vs off. Compiled, the fp8 graphs also save their scaling and stochastic-rounding
    state, which the backward updates in place: those come back themselves (originals_alive)."""
    runs = []
    for offload in (False, True):
        model = _glu()
        fwd = torch.compile(model, backend=fp8pass.backend(fp8pass.Config(sr_seed=7))) if compiled else model
        ctx = fp8pass.offload_saved_activations(min_bytes=0) if offload else None
        runs.append((*_train(model, fwd, 3, ctx), ctx))
    (rec_off, params_off, _), (rec_on, params_on, ctx) = runs
    for (l0, g0), (l1, g1) in zip(rec_off, rec_on):
        assert torch.equal(l0, l1)
        assert all(torch.equal(a, b) for a, b in zip(g0, g1))
    assert all(torch.equal(a, b) for a, b in zip(params_off, params_on))
    s = ctx.stats
    assert s.restored_tensors > 0 and s.offloaded_tensors == s.restored_tensors + s.originals_alive
    if compiled:  # each step the graph saves the three weights, and state tensors that stay alive
        assert s.parameters == 3 * 3 and s.originals_alive > 0
    else:  # an eager linear saves w.t() when its input needs grad (down_proj's only); gate and up save
        assert s.parameters == 3 and s.originals_alive == 2 * 3  # x, which the loop still holds


def test_compiled_graphs_saved_tensors_all_go_through_the_hooks():
    """What a plain recording hook sees in a compiled fp8 forward is what the context moves (min_bytes
    applied the same way): count and bytes."""
    model = _glu()
    fwd = torch.compile(model, backend=fp8pass.backend(fp8pass.Config(sr_seed=7)))
    x = torch.randn(8, 64)
    fwd(x).sum().backward()  # compile outside the hooks
    seen = []

    def record(t):
        if not isinstance(t, nn.Parameter):
            seen.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(record, lambda t: t):
        fwd(x).sum().backward()
    ctx = fp8pass.offload_saved_activations(min_bytes=64)
    with ctx:
        fwd(x).sum().backward()
    moved = [b for b in seen if b >= 64]
    assert moved and len(moved) < len(seen)
    assert (ctx.stats.offloaded_tensors, ctx.stats.offloaded_bytes) == (len(moved), sum(moved))
    assert (ctx.stats.kept_tensors, ctx.stats.kept_bytes) == (len(seen) - len(moved), sum(seen) - sum(moved))


@pytest.mark.parametrize("kw", [dict(min_bytes=-1), dict(min_bytes=True), dict(min_bytes=1.5),
                                dict(prefetch=-2), dict(prefetch="2")])
def test_bad_knobs_are_refused(kw):
    with pytest.raises(ValueError, match="must be an int >= 0"):
        fp8pass.offload_saved_activations(**kw)


def test_one_context_is_entered_once_at_a_time():
    ctx = SavedActivationOffload()
    with ctx, pytest.raises(RuntimeError, match="already active"):
        with ctx:
            pass
    with ctx:  # reusable after exit
        pass
