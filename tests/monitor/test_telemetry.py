"""Non-finite and huge values, delayed-scaling lag: counted on device, warned once, guarded on request.

Also the state's device following its weight, and the automatic cross-rank amax reduction's
hook/callback mechanics (the 2-rank runs are in tests/distributed/test_distributed.py).
"""

import warnings

import pytest
import torch

import fp8pass
from fp8pass import E4M3, E5M2, DelayedScaling, DelayedScalingState
from fp8pass.monitor import scaling_telemetry
from fp8pass.numerics.scaling import HUGE_AMAX, scale_from_amax
from fp8pass.runtime import state as runtime_state

pytestmark = pytest.mark.filterwarnings("ignore:fp8pass:RuntimeWarning")


def _two_linears(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))


def _compiled(model, **recipe):
    torch._dynamo.reset()
    cfg = fp8pass.Config(recipe=DelayedScaling(**recipe), grad_stochastic_rounding=False, compiler="aot_eager")
    return torch.compile(model, backend=fp8pass.backend(cfg))


def _step(cm, x, g):
    x = x.clone().requires_grad_()
    y = cm(x)
    y.backward(g)
    return y.detach(), x.grad


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def test_huge_amax_is_treated_like_a_non_finite_one():
    amax = torch.tensor([HUGE_AMAX, HUGE_AMAX / 2, 1e30, float("inf"), float("nan")])
    assert scale_from_amax(amax, E4M3).tolist()[::2] == [1.0, 1.0, 1.0]
    assert scale_from_amax(amax, E4M3)[1] == 448.0 / (HUGE_AMAX / 2)
    st = DelayedScalingState(DelayedScaling(history_len=2), E4M3)
    st.record(torch.tensor(2.0))
    st.record(torch.tensor(1e30))
    assert st.amax_history.tolist() == [2.0, 0.0] and float(st.scale) == 224.0
    assert int(st.skipped) == 1 and int(st.steps) == 2


def test_planted_nan_is_counted_exactly_on_device():
    model = _two_linears()
    cm = _compiled(model)
    x, g = torch.randn(32, 64), torch.randn(32, 64)
    for _ in range(3):
        _step(cm, x, g)
    assert scaling_telemetry(model).total_skipped == 0
    bad = x.clone()
    bad[3, 5] = float("nan")
    _step(cm, bad, g)
    t = scaling_telemetry(model)
    # the NaN row reaches both inputs; both weights stay finite; the last layer's grad_output is the
    # caller's g, and ReLU's backward masks the NaN row (NaN > 0 is False), so both gradients are finite
    assert t.skipped == {"0.weight.input": 1, "0.weight.weight": 0, "0.weight.grad_output": 0,
                         "2.weight.input": 1, "2.weight.weight": 0, "2.weight.grad_output": 0}
    assert t.total_overflows == 0
    y, _ = _step(cm, x, g)  # the histories were not poisoned
    assert torch.isfinite(y).all()


def test_jump_is_counted_and_the_guard_restores_the_output_from_the_first_call():
    x, g = torch.randn(32, 64), torch.randn(32, 64)
    errors = {}
    for mode in ("saturate", "current"):
        model = _two_linears()
        ref = _two_linears()
        cm = _compiled(model, on_overflow=mode)
        for _ in range(4):
            _step(cm, x, g)
        xj, gj = x * 1e4, g * 1e4
        y, dx = _step(cm, xj, gj)
        xr = xj.clone().requires_grad_()
        yr = ref(xr)
        yr.backward(gj)
        errors[mode] = (_rel(y, yr.detach()), _rel(dx, xr.grad))
        t = scaling_telemetry(model)
        assert t.overflows["0.weight.input"] == 1 and t.overflows["0.weight.weight"] == 0
        assert t.overflows["2.weight.grad_output"] == 1
    assert errors["saturate"][0] > 0.9 and errors["saturate"][1] > 0.9  # saturated: ~100% wrong
    assert errors["current"][0] < 0.15 and errors["current"][1] < 0.3  # E4M3 / E5M2 rounding only
    # before the jump the two modes cast identically (the guard only acts past the range)


def test_guard_is_bit_identical_when_nothing_outgrows():
    x, g = torch.randn(32, 64), torch.randn(32, 64)
    outs = []
    for mode in ("saturate", "current"):
        cm = _compiled(_two_linears(), on_overflow=mode, margin=2)  # 4x headroom: never past the range
        outs.append([_step(cm, x * (1 + 0.1 * i), g) for i in range(4)])
    for (ya, da), (yb, db) in zip(*outs):
        assert torch.equal(ya, yb) and torch.equal(da, db)


def test_1e30_activations_do_not_crash_and_do_not_poison_the_history():
    x, g = torch.randn(32, 64), torch.randn(32, 64)
    for recipe in (DelayedScaling(), fp8pass.CurrentScaling()):
        for dtype in (torch.float32, torch.bfloat16):
            torch._dynamo.reset()
            model = _two_linears().to(dtype)
            cfg = fp8pass.Config(recipe=recipe, grad_stochastic_rounding=True, compiler="aot_eager")
            cm = torch.compile(model, backend=fp8pass.backend(cfg))
            xs, gs = x.to(dtype), g.to(dtype)
            y0, _ = _step(cm, xs, gs)
            _step(cm, xs * 1e30, gs)  # used to raise "value cannot be converted to type float"
            _step(cm, xs, gs * 1e30)
            y1, dx1 = _step(cm, xs, gs)
            assert torch.isfinite(y1).all() and torch.isfinite(dx1).all()
            assert _rel(y1.float(), y0.float()) < 0.1, (recipe, dtype)  # scales back to normal at once


def test_op_path_never_warns_and_check_scaling_warns_once_per_kind(monkeypatch):
    from fp8pass.monitor import telemetry

    monkeypatch.setattr(telemetry, "_SEEN", set())
    model = _two_linears()
    cm = _compiled(model)
    x, g = torch.randn(32, 64), torch.randn(32, 64)
    bad = x.clone()
    bad[0, 0] = float("inf")
    texts = []
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        _step(cm, x, g)
        _step(cm, bad, g)
        _step(cm, bad, g)
        _step(cm, x * 1e4, g)
        _step(cm, x * 1e8, g)
    # the records count on device and read nothing back: no warning from the hot path
    assert not [w for w in got if "fp8pass" in str(w.message)]
    for _ in range(2):
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            t = telemetry.check_scaling(model)
        texts += [str(w.message) for w in got if "fp8pass" in str(w.message)]
    assert t.skipped["0.weight.input"] == 2 and t.overflows["0.weight.input"] >= 1
    assert len(texts) == 1 and "non-finite" in texts[0] and "past their delayed scale" in texts[0]


def test_state_follows_the_weight_device(monkeypatch):
    # CPU -> CUDA is what module.to("cuda") does to a parameter (``p.data = p.data.to(...)``, same
    # object); without a GPU here, the state is made on meta and must be moved to the weight's device.
    # The move itself (``t.data = t.data.to(dev)``, same tensor objects) runs in tests/gpu.
    w = torch.nn.Parameter(torch.randn(32, 32))
    st = runtime_state.LinearScalingState(DelayedScaling(), "meta")
    runtime_state._REGISTRY[w] = st
    moved = []
    monkeypatch.setattr(runtime_state.LinearScalingState, "to_device", lambda self, d: moved.append((self, d)))
    assert runtime_state.state_for(w, DelayedScaling()) is st
    assert moved == [(st, w.device)]
    runtime_state._REGISTRY[w] = runtime_state.LinearScalingState(DelayedScaling(), "cpu")
    runtime_state.state_for(w, DelayedScaling())
    assert len(moved) == 1  # same device: nothing to do


def test_state_to_device_keeps_the_tensor_objects():
    st = DelayedScalingState(DelayedScaling(), E4M3)
    before = st.op_tensors()
    st.to_device("cpu")
    assert all(a is b for a, b in zip(before, st.op_tensors()))


def test_guard_flag_is_in_the_op_state():
    st = DelayedScalingState(DelayedScaling(on_overflow="current"), E5M2, experts=3)
    assert st.OP_FIELDS[5] == "guard" and bool(st.op_tensors()[5])
    assert st.overflows.shape == (3,) and "overflows" not in st.state_dict()
    with pytest.raises(ValueError, match="on_overflow"):
        DelayedScaling(on_overflow="clip")


class _CountingSync:
    def __init__(self):
        self.calls = 0

    def sync(self):
        self.calls += 1
        return 1


def test_automatic_reduction_runs_once_per_backward_and_after_a_no_grad_forward(monkeypatch):
    from fp8pass.distributed.auto_reduce import AmaxReducer

    torch._dynamo.reset()
    backend = fp8pass.backend(fp8pass.Config(grad_stochastic_rounding=False, compiler="aot_eager"))
    model = _two_linears()
    cm = torch.compile(model, backend=backend)
    x = torch.randn(8, 64)
    cm(x)  # compile; states resolved
    reducer = backend._reducer
    states = [r for st in (runtime_state._REGISTRY[model[0].weight], runtime_state._REGISTRY[model[2].weight])
              for r in st.roles().values()]
    assert isinstance(reducer, AmaxReducer) and all(id(s) in reducer._states for s in states)
    other = fp8pass.backend(fp8pass.Config(grad_stochastic_rounding=False, compiler="aot_eager"))
    cm2 = torch.compile(_two_linears(), backend=other)
    cm2(x)
    assert other._reducer is reducer  # one reducer (one collective per backward) for every backend
    counting = _CountingSync()
    monkeypatch.setattr(reducer, "_sync", counting)
    monkeypatch.setattr(AmaxReducer, "active", lambda self: True)  # as if 2 ranks
    y = cm(x)
    assert counting.calls == 0
    (y.sum() + y.mean()).backward()
    assert counting.calls == 1  # once, after the whole backward
    with torch.no_grad():
        cm(x)
    assert counting.calls == 1
    cm(x).sum().backward()
    assert counting.calls == 3  # the no-grad forward's records before this forward, then the backward
    (cm(x).sum() + cm2(x).sum()).backward()
    assert counting.calls == 4  # two compiled models in one backward: still one reduction
    off = fp8pass.backend(fp8pass.Config(amax_reduction="off"))
    assert off._reducer is None


def test_trainer_logs_the_counts_and_warns_the_first_time(tmp_path):
    from fp8pass.train import ModelConfig, TrainConfig, train
    from fp8pass.train.logging import read_metrics

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(400)))

    def poison(step, model, log, final=False):
        if step == 2:
            with torch.no_grad():
                model.layers[0].self_attn.q_proj.weight[0, 0] = float("nan")

    torch._dynamo.reset()
    cfg = TrainConfig(recipe="fp8", steps=4, out=str(tmp_path / "run"), data=str(corpus), batch_size=2, seq_len=32,
                      model=ModelConfig(d_model=32, n_layers=2, n_heads=2, ffn=64, max_seq_len=32), eval_every=10,
                      eval_batches=1, ckpt_every=10, monitor_every=0, warmup=1, progress=False, compiler="aot_eager")
    with pytest.warns(RuntimeWarning, match=r"fp8pass: \d+ non-finite .* amaxes skipped, most in layers\."):
        r = train(cfg, callbacks=[poison])
    assert r.status == "diverged"
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl", "train")
    assert [row["fp8_skipped"] for row in rows[:2]] == [0, 0] and rows[2]["fp8_skipped"] >= 1
    assert all(row["fp8_overflows"] >= 0 for row in rows)


def test_the_overflow_warning_says_what_a_few_mean():
    """Issue 34: the demo's "2 casts past their delayed scale's range" came with no explanation."""
    from fp8pass.monitor import telemetry

    text = telemetry.ScalingTelemetry(skipped={"a.weight.input": 0}, overflows={"a.weight.input": 2}).warning()
    assert text.startswith("fp8pass: 2 casts past their delayed scale's range (saturated, or recast with "
                           "on_overflow='current'), most in a.weight.input (2).")
    assert "A few, early in training or after a jump in magnitude, are delayed scaling's lag" in text
    assert "a steady stream means the amax history or margin is too short" in text
    only_skipped = telemetry.ScalingTelemetry(skipped={"a.weight.input": 1}, overflows={"a.weight.input": 0})
    assert "lag" not in only_skipped.warning()
