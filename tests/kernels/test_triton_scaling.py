"""The scalar kernels around a cast (kernels/triton_scaling.py) against their torch references,
bit for bit, in Triton's interpreter: scales from amaxes (current and delayed), decode scales, and the
multi-state delayed-scaling record."""

import itertools

import pytest
import torch

from fp8pass.config import DelayedScaling
from fp8pass.kernels import torch_family
from fp8pass.kernels import triton_scaling as ts
from fp8pass.numerics import E4M3, E5M2, DelayedScalingState, scale_from_amax
from fp8pass.numerics.scaling import record_update, scale_to_cast

SPECIAL = [0.0, 1e-30, 1e-3, 0.5, 1.0, 448.0, 3.0e4, 2.0**64, 2.0**63 * 1.5, float("inf"), float("nan")]


def _bits(t):
    return t.float().view(torch.int32)


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("margin,p2", [(0.0, False), (1.0, False), (0.0, True), (2.0, True)])
def test_current_scale_matches_scale_from_amax(fmt, margin, p2):
    gen = torch.Generator().manual_seed(0)
    cases = [torch.tensor([a]) for a in SPECIAL] + [torch.rand(n, generator=gen) * 10 ** torch.randint(-6, 6, (1,),
                                                                                                      generator=gen)
                                                    for n in (1, 7, 1500, 3000)]
    cases.append(torch.tensor([1.0, float("nan"), 3.0]))
    cases.append(torch.zeros(0))
    for partials in cases:
        partials = partials.float()
        out = ts.operand_scale(partials, fmt, margin, p2)
        amax = torch_family.tensor_amax(partials)
        ref = scale_from_amax(amax, fmt, margin, p2)
        assert torch.equal(_bits(out.amax), _bits(amax)), partials
        assert torch.equal(_bits(out.scale), _bits(ref)), (partials, out.scale, ref)
        assert torch.equal(_bits(out.inv_scale), _bits(torch.reciprocal(ref)))
        assert out.recast is None and out.inverted == ()


def _state(steps, skipped, guard, scale):
    s = DelayedScalingState(DelayedScaling(on_overflow="current" if guard else "saturate"), E4M3, "cpu")
    s.steps.fill_(steps)
    s.skipped.fill_(skipped)
    s.scale.fill_(scale)
    return s.op_tensors()


@pytest.mark.parametrize("steps,skipped,guard", [(0, 0, False), (3, 0, False), (3, 3, False), (5, 1, True),
                                                 (2, 0, True)])
def test_delayed_scale_matches_scale_to_cast(steps, skipped, guard):
    for held, a in itertools.product((1.0, 2.0, 100.0), SPECIAL):
        state = _state(steps, skipped, guard, held)
        partials = torch.tensor([a, a / 2], dtype=torch.float32)
        x_s, w_s = torch.tensor(3.0), torch.tensor(0.1)
        out = ts.operand_scale(partials, E4M3, 0.0, False, state=state, invert=(x_s, w_s))
        amax = torch_family.tensor_amax(partials)
        ref = scale_to_cast(state, amax, E4M3)
        assert torch.equal(_bits(out.scale), _bits(ref)), (held, a, out.scale, ref)
        assert out.recast.dtype == torch.int32
        assert int(out.recast) == int(not torch.equal(_bits(ref), _bits(state[1]))), (held, a)
        assert torch.equal(_bits(torch.stack(out.inverted)), _bits(torch.reciprocal(torch.stack([x_s, w_s]))))


def test_operand_scale_rejects_three_inversions():
    with pytest.raises(ValueError, match="at most 2"):
        ts.operand_scale(torch.ones(1), E4M3, invert=(torch.ones(()),) * 3)


def _random_states(n, recipe, fmt, gen):
    states = []
    for i in range(n):
        s = DelayedScalingState(recipe, fmt, "cpu")
        k = int(torch.randint(0, recipe.history_len + 2, (1,), generator=gen))
        s.amax_history[:k] = torch.rand(min(k, recipe.history_len), generator=gen) * 100
        s.steps.fill_(int(torch.randint(0, 5, (1,), generator=gen)))
        s.skipped.fill_(int(torch.randint(0, 2, (1,), generator=gen)) * int(s.steps))
        s.scale.fill_(float(torch.rand(1, generator=gen) * 50 + 0.01))
        s.accumulate.fill_(bool(i % 3 == 2))
        if i % 4 == 1:
            s.pending.fill_(float(torch.rand(1, generator=gen) * 200))
        states.append(s)
    return states


@pytest.mark.parametrize("algo,interval,margin,p2,fmt", [("max", 1, 0.0, False, E4M3), ("most_recent", 1, 0.0, False, E5M2),
                                                         ("max", 3, 1.0, True, E4M3), ("most_recent", 2, 0.0, True, E5M2)])
def test_record_states_matches_record_update(algo, interval, margin, p2, fmt):
    gen = torch.Generator().manual_seed(1)
    recipe = DelayedScaling(history_len=5, interval=interval, margin=margin, algo=algo, power_of_two=p2)
    for trial in range(6):
        states = _random_states(7, recipe, fmt, gen)
        amax = torch.rand(7, generator=gen) * 300
        amax[trial % 7] = [float("nan"), float("inf"), 2.0**65, 0.0, 1e-40, 5.0][trial]
        refs = []
        for s, a in zip(states, amax):
            t = s.op_tensors()
            refs.append(record_update(a, t[0], t[1], t[2], t[3], t[4], t[6], t[7], recipe, fmt))
        ts.record_states([s.op_tensors() for s in states], amax, fmt, margin, interval, algo, p2)
        for s, ref in zip(states, refs):
            got = s.op_tensors()
            for name, g, r in zip(("history", "scale", "steps", "skipped", "overflows", "pending"),
                                  (got[0], got[1], got[2], got[3], got[4], got[6]), ref):
                assert torch.equal(g.view(-1).float().view(torch.int32) if g.is_floating_point() else g,
                                   r.view(-1).float().view(torch.int32) if r.is_floating_point() else r), (trial, name)


def test_record_states_checks_its_arguments():
    s = DelayedScalingState(DelayedScaling(), E4M3, "cpu").op_tensors()
    with pytest.raises(ValueError, match="2 amaxes"):
        ts.record_states([s], torch.ones(2), E4M3, 0.0, 1, "max", False)
    with pytest.raises(ValueError, match="algo"):
        ts.record_states([s], torch.ones(1), E4M3, 0.0, 1, "mean", False)
    stack = DelayedScalingState(DelayedScaling(), E4M3, "cpu", experts=3).op_tensors()
    with pytest.raises(ValueError, match="single states"):
        ts.record_states([stack], torch.ones(3), E4M3, 0.0, 1, "max", False)


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("margin,p2", [(0.0, False), (1.0, True)])
def test_amax_and_scale_in_one_launch_matches_the_torch_reference(fmt, margin, p2):
    """One launch: the programs' partial maxima, the last program's reduction and scale, bit for bit
    (many programs: a tensor larger than the interpreter's block), and the arrival counter left at 0."""
    gen = torch.Generator().manual_seed(2)
    big = torch.randn(3 * ts._AMAX_BLOCK + 5, generator=gen).to(torch.bfloat16)
    cases = [big, torch.zeros(0), torch.zeros(7), torch.tensor([1.0, float("nan")]), torch.tensor([-float("inf"), 1.0]),
             torch.tensor([2.0**70, 1.0]), torch.randn(5, 9, generator=gen) * 1e-30]
    with_nan = big.clone()
    with_nan[-1] = float("nan")
    cases.append(with_nan)
    for x in cases:
        out = ts.amax_and_scale(x, fmt, margin, p2, invert=(torch.tensor(3.0),))
        amax = torch_family.tensor_amax(x)
        assert torch.equal(_bits(out.amax), _bits(amax)), x
        assert torch.equal(_bits(out.scale), _bits(scale_from_amax(amax, fmt, margin, p2))), x
        assert torch.equal(_bits(out.inv_scale), _bits(torch.reciprocal(out.scale)))
        assert float(out.inverted[0]) == float(torch.reciprocal(torch.tensor(3.0)))
        assert int(ts.counter(x.device)) == 0


def test_channel_scales_kernel_matches_the_reference_and_is_exact_below_a_power_of_two():
    from fp8pass.runtime.swiglu import _C_MAX, _C_MIN, channel_scales

    below = torch.tensor(4.0).nextafter(torch.tensor(0.0))  # 4 * (1 - 2**-24): its binade is [2, 4)
    special = torch.tensor([0.0, float("inf"), float("nan"), 3.0, 0.25, 1e-30, 1e-40, 2.0**70, below.item(), 4.0])
    assert channel_scales(special[8:]).tolist() == [0.5, 0.25]  # 2**-floor(log2 a), exactly
    gen = torch.Generator().manual_seed(3)
    for part in (special.reshape(1, -1), torch.rand(37, 300, generator=gen) * 100,
                 torch.cat([special.reshape(1, -1), torch.rand(20, 10, generator=gen)])):
        got = ts.channel_scales(part.float(), _C_MIN, _C_MAX)
        want = channel_scales(torch_family.tensor_amax(part[:, :1]).reshape(1)) if part.shape[1] == 1 else \
            channel_scales(torch.stack([torch_family.tensor_amax(part[:, j]) for j in range(part.shape[1])]))
        assert torch.equal(_bits(got), _bits(want))


def test_record_states_with_amaxes_passed_one_by_one_equals_the_stacked_form():
    gen = torch.Generator().manual_seed(4)
    recipe = DelayedScaling(history_len=4)
    amax = [torch.rand((), generator=gen) * 10 for _ in range(3)]
    amax[1] = torch.tensor(float("nan"))
    results = []
    for direct in (True, False):
        states = _random_states(3, recipe, E4M3, torch.Generator().manual_seed(5))
        ts.record_states([s.op_tensors() for s in states], amax if direct else torch.stack(amax), E4M3, 0.0, 1,
                         "max", False)
        results.append([torch.cat([t.reshape(-1).float() for t in s.op_tensors()]) for s in states])
    for a, b in zip(*results):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    with pytest.raises(ValueError, match="at most 4"):
        ts.record_states([s.op_tensors() for s in _random_states(5, recipe, E4M3, gen)], [torch.ones(())] * 5, E4M3,
                         0.0, 1, "max", False)
