"""The runtime ops inside torch.compile: eager, aot_eager and inductor give identical results,
delayed-scaling state is updated the same way, and torch.library.opcheck passes."""

import pytest
import torch

import fp8pass
from fp8pass import ops
from fp8pass.op_schema import GLUKnobs, LinearKnobs
from fp8pass.runtime import LinearScalingState

BACKENDS = ["aot_eager", "inductor"]


def _inputs(seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 16, 32, generator=g).to(dtype)
    w = (torch.randn(24, 32, generator=g) / 6).to(dtype)
    b = torch.randn(24, generator=g).to(dtype)
    dy = torch.randn(3, 16, 24, generator=g).to(dtype)
    return x, w, b, dy


def _run_linear(fn, x, w, b, dy):
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    b = b.clone().requires_grad_()
    y = fn(x, w, b)
    y.backward(dy)
    return y.detach(), x.grad, w.grad, b.grad


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("recipe", [None, fp8pass.CurrentScaling("row")], ids=["tensor", "row"])
def test_linear_compiled_matches_eager(backend, recipe):
    x, w, b, dy = _inputs()
    f = lambda a, c, d: ops.fp8_linear(a, c, d, recipe=recipe)  # noqa: E731
    eager = _run_linear(f, x, w, b, dy)
    compiled = _run_linear(torch.compile(f, backend=backend, fullgraph=True), x, w, b, dy)
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c)


@pytest.mark.parametrize("backend", BACKENDS)
def test_delayed_state_updates_identically_when_compiled(backend):
    """Forward amaxes recorded by the caller's delayed_record_ op, grad_output amax by the backward:
    after three steps (eager vs compiled) the states and the results are bit-identical."""
    recipe = fp8pass.DelayedScaling(history_len=4)
    results = []
    for compiled in (False, True):
        st = LinearScalingState(recipe)

        def step(a, c, d):
            return ops.fp8_linear(a, c, d, recipe=recipe, state=st)

        fn = torch.compile(step, backend=backend, fullgraph=True) if compiled else step
        outs = []
        for i in range(3):
            x, w, b, dy = _inputs(seed=i)
            outs.append(_run_linear(fn, x * (i + 1), w, b, dy))
        results.append((outs, st.state_dict()))
    (eo, es), (co, cs) = results
    for a, b in zip(eo, co):
        for e, c in zip(a, b):
            assert torch.equal(e, c)
    assert es.keys() == cs.keys()
    for k in es:
        assert torch.equal(es[k], cs[k]), k
    assert int(cs["grad_output.steps"]) == 3 and int(cs["input.steps"]) == 3
    # the newest input amax is that of the third step's input
    x, *_ = _inputs(seed=2)
    assert cs["input.amax_history"][0] == (x * 3).float().abs().max()


@pytest.mark.parametrize("backend,smooth", [("inductor", "channel"), ("inductor", "token"),
                                            ("inductor", None), ("aot_eager", "channel")])
def test_swiglu_compiled_matches_eager(backend, smooth):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(20, 16, generator=g, dtype=torch.bfloat16)
    ws = [(torch.randn(*s, generator=g) / 4).to(torch.bfloat16) for s in ((40, 16), (40, 16), (16, 40))]
    dy = torch.randn(20, 16, generator=g, dtype=torch.bfloat16)

    def run(fn):
        ps = [w.clone().requires_grad_() for w in ws]
        xx = x.clone().requires_grad_()
        y = fn(xx, *ps)
        y.backward(dy)
        return [y.detach(), xx.grad] + [p.grad for p in ps]

    f = lambda a, wg, wu, wd: ops.swiglu_mlp(a, wg, wu, wd, smooth=smooth)  # noqa: E731
    for e, c in zip(run(f), run(torch.compile(f, backend=backend, fullgraph=True))):
        assert torch.equal(e, c)


def _knobs(granularity="tensor", fmts=("e4m3", "e5m2"), out_dtype=None):
    return LinearKnobs(*fmts, granularity, 128, False, "nearest", 0.0, 1, "max", out_dtype, True)


def _op_args(x, w, b, states=([], [], []), granularity="tensor", fmts=("e4m3", "e5m2"), out_dtype=None):
    return (x, w, b, *states, None, *_knobs(granularity, fmts, out_dtype).args())


@pytest.mark.parametrize("granularity,fmts", [("tensor", ("e4m3", "e5m2")), ("block", ("e4m3", "e5m2")),
                                              ("row", ("identity", "identity"))])
def test_opcheck_fp8_linear(granularity, fmts):
    x, w, b, _ = _inputs(dtype=torch.float32)
    torch.library.opcheck(torch.ops.fp8pass.fp8_linear.default,
                          _op_args(x.requires_grad_(), w.requires_grad_(), b, granularity=granularity, fmts=fmts))


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_opcheck_swiglu_down_and_record(activation):
    g = torch.Generator().manual_seed(2)
    gate, up = torch.randn(2, 8, 24, generator=g), torch.randn(2, 8, 24, generator=g)
    wd = torch.randn(16, 24, generator=g)
    torch.library.opcheck(torch.ops.fp8pass.swiglu_down.default,
                          (gate.requires_grad_(), up.requires_grad_(), wd.requires_grad_(), [], [], [], None,
                           *GLUKnobs(*_knobs().args(), activation, "channel").args()))
    st = LinearScalingState(fp8pass.DelayedScaling(history_len=3))
    torch.library.opcheck(torch.ops.fp8pass.delayed_record_.default,
                          (*st.op_args()[0], torch.tensor(2.0), "e4m3", 0.0, 1, "max", False))


def test_opcheck_backward_ops():
    x, w, _, dy = _inputs(dtype=torch.float32)
    out = torch.ops.fp8pass.fp8_linear(x, w, None, *_op_args(x, w, None)[3:])
    torch.library.opcheck(torch.ops.fp8pass.fp8_linear_backward.default,
                          (dy, out[3], out[4], out[5], out[6], [], None, torch.float32, torch.float32, True,
                           *_knobs().args()))
    g = torch.Generator().manual_seed(3)
    gate, up = torch.randn(8, 24, generator=g), torch.randn(8, 24, generator=g)
    wd = torch.randn(16, 24, generator=g)
    knobs = GLUKnobs(*_knobs().args(), "gelu", "token").args()
    o = torch.ops.fp8pass.swiglu_down(gate, up, wd, [], [], [], None, *knobs)
    torch.library.opcheck(torch.ops.fp8pass.swiglu_down_backward.default,
                          (torch.randn(8, 16, generator=g), *o[3:], [], None, torch.float32, torch.float32, *knobs))
    # recompute_output: A's codes not saved (None), rebuilt from gate/up; the forward op with the knob too
    knobs = GLUKnobs(*_knobs().args(), "silu", "channel", False, True).args()  # W_down's codes kept
    torch.library.opcheck(torch.ops.fp8pass.swiglu_down.default,
                          (gate.clone().requires_grad_(), up.clone().requires_grad_(), wd.clone().requires_grad_(),
                           [], [], [], None, *knobs))
    o = torch.ops.fp8pass.swiglu_down(gate, up, wd, [], [], [], None, *knobs)
    torch.library.opcheck(torch.ops.fp8pass.swiglu_down_backward.default,
                          (torch.randn(8, 16, generator=g), None, *o[4:], [], None, torch.float32, torch.float32,
                           *knobs))


def test_inductor_skips_the_autograd_cache_for_rewritten_graphs(monkeypatch):
    """AOTAutograd's disk cache keys on the graph, not on the ops' autograd formulas: a cached entry
    replayed a stale backward after our ops changed. Graphs with fp8pass ops compile with it off;
    graphs the backend leaves alone keep it."""
    from torch._functorch import config as functorch_config
    from torch._inductor import compile_fx as compile_fx_module

    seen = []
    real = compile_fx_module.compile_fx

    def spy(gm, inputs, **kw):
        seen.append(functorch_config.enable_autograd_cache)
        return real(gm, inputs, **kw)

    monkeypatch.setattr(compile_fx_module, "compile_fx", spy)
    torch._dynamo.reset()
    # (config.patch, not monkeypatch: monkeypatch's undo deletes the config entry)
    with functorch_config.patch(enable_autograd_cache=True):
        lin = torch.nn.Linear(32, 32)
        torch.compile(lin, backend=fp8pass.backend(fp8pass.Config()))(torch.randn(4, 32)).sum().backward()
        torch.compile(lambda t: (t * 2).sin(), backend=fp8pass.backend(fp8pass.Config()))(torch.randn(4))
    assert seen == [False, True]
    assert functorch_config.enable_autograd_cache  # the setting is back after the compile
    torch._dynamo.reset()
