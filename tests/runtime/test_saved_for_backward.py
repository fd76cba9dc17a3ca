"""What autograd keeps for backward: FP8 codes and scales only, exact byte counts.

The eager op ``fp8_linear`` keeps ``x``'s and ``W``'s codes (1 byte/element) and their two fp32
scalar scales. A compiled graph's linears share one cast per input (``fp8_cast_input`` +
``fp8_linear_precast``): the codes of each distinct input once however many linears read it (q/k/v,
gate/up), its scale, and per linear the weight's scale; the weight itself is the parameter (held
anyway; backward recasts it). The GLU tail (``swiglu_down``) keeps the codes of its GEMM operands
``A`` and ``B``, of ``gate`` and ``up`` (no high-precision copy of them) and the smoothing scales.
Counted with ``saved_tensors_hooks``, eager and compiled (AOT autograd's partitioner may not add
anything else).
"""


import pytest
import torch

import fp8pass
from fp8pass import ops
from fp8pass.testing.models import D, H, SiluMul

T = 64  # tokens of the inputs below (4 x 16)


def _saved(fn, params=(), shared=0):
    """(list of saved tensors, fn's result); fails if one storage is saved twice, except ``shared``
    storages that exactly two eager ops keep a reference to (the one copy of a shared input cast),
    which are listed once. Tensors sharing the storage of one of ``params`` (held anyway) are left out,
    each at most once too."""
    got = []

    def pack(t):
        got.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    storages = [t.untyped_storage().data_ptr() for t in got if t.numel()]
    twice = {p for p in storages if storages.count(p) == 2}
    assert len(twice) == shared and all(storages.count(p) <= 2 for p in storages), "a tensor was saved twice"
    seen = set()
    got = [t for t in got if not (t.numel() and t.untyped_storage().data_ptr() in seen
                                  or seen.add(t.untyped_storage().data_ptr()))]
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    return [t for t in got if t.untyped_storage().data_ptr() not in param_ptrs], out


def _precast_bytes(rows, *ks, linears) -> int:
    """Codes of each distinct input (of ``ks`` features) once, their scales, one scale per linear."""
    return sum(rows * k + 4 for k in ks) + 4 * linears


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _linear_bytes(rows, k, n) -> int:
    return rows * k + n * k + 2 * 4  # x codes, W codes, two fp32 scalar scales


def _glu_tail_bytes(rows, f, d, weight_codes=False) -> int:
    # A codes, gate codes, up codes, four fp32 scalar scales, channel scales [f] fp32; B = W_down / c's
    # codes only where backward does not recast W_down (recast_weight off: the eager ops' default)
    return rows * f + (d * f if weight_codes else 0) + 2 * rows * f + 4 * 4 + f * 4


def _only_codes_and_scales(tensors, max_scale_elems=1):
    for t in tensors:
        assert t.dtype == torch.uint8 or (t.dtype == torch.float32 and t.numel() <= max_scale_elems), \
            (tuple(t.shape), t.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_linear_saves_codes_and_scales(dtype):
    x = torch.randn(4, 16, 32, dtype=dtype, requires_grad=True)
    w = torch.randn(24, 32, dtype=dtype, requires_grad=True)
    saved, y = _saved(lambda: ops.fp8_linear(x, w))
    _only_codes_and_scales(saved)
    assert _nbytes(saved) == _linear_bytes(T, 32, 24)
    y.float().sum().backward()
    assert x.grad.dtype == w.grad.dtype == dtype


def test_eager_glu_saves_no_high_precision_gate_or_up():
    x = torch.randn(4, 16, D, requires_grad=True)
    wg, wu = (torch.randn(H, D, requires_grad=True) for _ in range(2))
    wd = torch.randn(D, H, requires_grad=True)
    # x's codes and scale: one copy, referenced by both projections' backward nodes
    saved, y = _saved(lambda: ops.swiglu_mlp(x, wg, wu, wd, smooth="channel"), (wg, wu, wd), shared=2)
    _only_codes_and_scales(saved, max_scale_elems=H)
    # one cast of x shared by gate and up, the weights (W_down included) recast in backward
    assert _nbytes(saved) == _precast_bytes(T, D, linears=2) + _glu_tail_bytes(T, H, D)
    y.sum().backward()


def _compiled(model, compiler):
    cfg = fp8pass.Config(recipe=fp8pass.CurrentScaling(), compiler=compiler, grad_stochastic_rounding=False)
    return torch.compile(model, backend=fp8pass.backend(cfg), fullgraph=True)


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast_bf16"])
def test_compiled_linears_save_codes_and_scales_only(compiler, autocast):
    """Two chained linears (the second's input is the first's output): the partitioner keeps
    exactly the four codes and four scales, no fp32/bf16 input, view or amax."""
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(32, 48, bias=False), torch.nn.Linear(48, 64, bias=True))
    f = _compiled(model, compiler)
    x = torch.randn(4, 16, 32, requires_grad=True)

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return f(x)

    for _ in range(2):  # the second call runs the compiled graph as it is reused
        saved, y = _saved(run, model.parameters())
        _only_codes_and_scales(saved)
        assert _nbytes(saved) == _precast_bytes(T, 32, 48, linears=2)
        assert y.dtype == (torch.bfloat16 if autocast else torch.float32)
        y.float().sum().backward()


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_compiled_glu_saves_codes_and_scales_only(compiler):
    """The rewritten SwiGLU MLP under autocast: gate/up projections keep x's codes once (one shared
    cast), the GLU tail keeps codes of A, gate and up (W_down is recast in backward)."""
    torch._dynamo.reset()
    model = SiluMul()
    f = _compiled(model, compiler)
    x = torch.randn(4, 16, D, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        saved, y = _saved(lambda: f(x), model.parameters())
    _only_codes_and_scales(saved, max_scale_elems=H)
    assert _nbytes(saved) == _precast_bytes(T, D, linears=2) + _glu_tail_bytes(T, H, D)
    y.float().sum().backward()


class QKVBlock(torch.nn.Module):
    """q/k/v projections of one input, an output projection, a residual and a SwiGLU MLP of the
    residual stream (gate and up share their input). The other ops (adds) save nothing, so what is
    saved is the rewritten matmuls' alone."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(D, D, bias=i == 1) for i in range(4))
        self.mlp = SiluMul()

    def forward(self, x):
        h = x + self.o(self.q(x) + self.k(x) + self.v(x))
        return h + self.mlp(h)


# x codes (q/k/v), o's input codes, h codes (gate/up): 3 inputs, 6 linears; then the GLU tail
QKV_BLOCK_BYTES = _precast_bytes(T, D, D, D, linears=6) + _glu_tail_bytes(T, H, D)


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast_bf16"])
def test_block_saves_each_input_codes_once(compiler, autocast):
    """Exact count of a block: the codes of each distinct matmul input once (x for q/k/v, h for
    gate/up; A, gate and up in the GLU), no weight codes (the weights, W_down included, are the
    parameters, recast in backward), scales."""
    torch._dynamo.reset()
    model = QKVBlock()
    f = _compiled(model, compiler)
    x = torch.randn(4, 16, D, requires_grad=True)
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            saved, y = _saved(lambda: f(x), model.parameters())
        _only_codes_and_scales(saved, max_scale_elems=H)
        assert _nbytes(saved) == QKV_BLOCK_BYTES == 3 * T * D + T * H * 3 + 13 * 4 + H * 4
        y.float().sum().backward()


def _train(model_cls, share: bool, recipe, compiler: str, autocast: bool, monkeypatch, steps=3):
    """Outputs and gradients of ``steps`` compiled steps, with the shared input casts or without
    (one ``fp8_linear`` per linear); the model's delayed-scaling states after them."""
    from fp8pass.passes.rewrite_fp8 import FP8Rewriter

    monkeypatch.setattr(FP8Rewriter, "share_input_casts", share)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = model_cls()
    cfg = fp8pass.Config(recipe=recipe, compiler=compiler, grad_stochastic_rounding=False)
    f = torch.compile(model, backend=fp8pass.backend(cfg), fullgraph=True)
    g = torch.Generator().manual_seed(1)
    got = []
    for _ in range(steps):
        x = torch.randn(4, 16, D, generator=g, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = f(x)
        (y.float() ** 2).sum().backward()
        got.append([y.detach(), x.grad] + [p.grad for p in model.parameters()])
        model.zero_grad(set_to_none=True)
    states = {}
    if isinstance(recipe, fp8pass.DelayedScaling):  # the input states of q, k, v
        states = {n: [t.clone() for t in fp8pass.runtime.state_for(p, recipe, "e4m3", "e5m2").op_args()[0]]
                  for n, p in model.named_parameters() if n in ("q.weight", "k.weight", "v.weight")}
    return got, states


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
@pytest.mark.parametrize("recipe,autocast", [
    (fp8pass.CurrentScaling(), True), (fp8pass.CurrentScaling(granularity="row"), False),
    (fp8pass.DelayedScaling(), True)], ids=["current_bf16", "current_row_fp32", "delayed_bf16"])
def test_shared_cast_bit_identical_to_per_linear(compiler, recipe, autocast, monkeypatch):
    """The shared casts change what is saved, never a bit of the outputs or gradients (current
    scaling: the same casts and GEMMs; delayed: every consumer records the same amax, so the
    q/k/v input states stay identical to each other and to the per-linear path's)."""
    shared, st_shared = _train(QKVBlock, True, recipe, compiler, autocast, monkeypatch)
    alone, st_alone = _train(QKVBlock, False, recipe, compiler, autocast, monkeypatch)
    for a, b in zip(shared, alone):
        for u, v in zip(a, b):
            assert u.dtype == v.dtype and torch.equal(u, v)
    for name in st_alone:
        for u, v in zip(st_shared[name], st_alone[name]):
            assert torch.equal(u, v), name
    if isinstance(recipe, fp8pass.DelayedScaling):
        assert int(st_shared["q.weight"][2]) == 3  # three steps recorded
        for name in ("k.weight", "v.weight"):
            for u, v in zip(st_shared[name], st_shared["q.weight"]):
                assert torch.equal(u, v), name


class WrittenBetween(torch.nn.Module):
    """``h`` is read by two linears and written in place between them: each needs its own cast."""

    def __init__(self):
        super().__init__()
        self.p, self.q = torch.nn.Linear(D, D), torch.nn.Linear(D, D)

    def forward(self, x):
        h = x * 2
        a = self.p(h)
        h.mul_(3.0)
        return a + self.q(h)


class LinearBeforeGLU(torch.nn.Module):
    """A linear and a GLU read ``x``; the GLU is rewritten first, the linear comes first in the
    graph: the shared cast moves up to it."""

    def __init__(self):
        super().__init__()
        self.p = torch.nn.Linear(D, D)
        self.mlp = SiluMul()

    def forward(self, x):
        y = self.p(x)
        return self.mlp(x) + y


@pytest.mark.parametrize("model_cls,casts", [(WrittenBetween, 2), (LinearBeforeGLU, 1)])
def test_shared_cast_placement(model_cls, casts, monkeypatch):
    """Where the cast goes and who shares it: results bit-identical to the per-linear path."""
    torch._dynamo.reset()
    rep = fp8pass.explain(model_cls(), torch.randn(2, 8, D))
    assert rep.graph_after.count("fp8pass.fp8_cast_input.default(") == casts, rep.graph_after
    shared, _ = _train(model_cls, True, fp8pass.CurrentScaling(), "aot_eager", False, monkeypatch, steps=1)
    alone, _ = _train(model_cls, False, fp8pass.CurrentScaling(), "aot_eager", False, monkeypatch, steps=1)
    for u, v in zip(shared[0], alone[0]):
        assert torch.equal(u, v)


def test_shared_cast_ops_opcheck():
    """The two forward ops and the backward op: fake kernels, schemas and autograd as torch checks them."""
    from fp8pass.op_schema import LinearKnobs

    x = torch.randn(4, 16, D, requires_grad=True)
    w = torch.randn(24, D, requires_grad=True)
    b = torch.randn(24, requires_grad=True)
    for gran in ("tensor", "block"):
        k = LinearKnobs("e4m3", "e5m2", gran, 16, False, "nearest", 0.0, 1, "max", torch.bfloat16, True)
        cast_args = (x.detach(), [], *k.args())
        torch.library.opcheck(torch.ops.fp8pass.fp8_cast_input.default, cast_args)
        data, scale, _, up = torch.ops.fp8pass.fp8_cast_input(*cast_args)
        assert data.dtype == torch.uint8 and data.shape == (T, D)
        args = (x, data, scale, up, w, b, [], [], None, *k.args())
        torch.library.opcheck(torch.ops.fp8pass.fp8_linear_precast.default, args)
        y = torch.ops.fp8pass.fp8_linear_precast(*args)[0]
        ref = torch.ops.fp8pass.fp8_linear(x, w, b, [], [], [], None, *k.args())[0]
        assert torch.equal(y, ref)


def test_shared_cast_ops_clear_errors():
    from fp8pass.op_schema import LinearKnobs

    k = LinearKnobs("e4m3", "e5m2", "tensor", 128, False, "nearest", 0.0, 1, "max", None, True)
    x = torch.randn(4, 16, D)
    data, scale, _, up = torch.ops.fp8pass.fp8_cast_input(x, [], *k.args())
    with pytest.raises(ValueError, match="is not the cast of x"):
        torch.ops.fp8pass.fp8_linear_precast(x[:2], data, scale, up, torch.randn(8, D), None, [], [], None, *k.args())
    with pytest.raises(ValueError, match="MX granularity"):
        torch.ops.fp8pass.fp8_cast_input(x, [], *k.replace(granularity="mx").args())


def test_regathered_weights_keep_the_weight_codes_of_the_per_linear_op(monkeypatch):
    """For weights FSDP2 manages (it rebuilds them between forward and backward, on any number of
    ranks), the rewrite emits ``fp8_linear`` (weight codes saved), never the precast pair that
    recasts the weight in backward, and ``swiglu_down`` keeps W_down's codes; other weights keep the
    shared cast and the recasts."""
    model_cls = LinearBeforeGLU
    torch._dynamo.reset()
    single = fp8pass.explain(model_cls(), torch.randn(2, 8, D)).graph_after
    assert "fp8pass.fp8_cast_input.default(" in single and "fp8pass.fp8_linear.default(" not in single
    assert "recast_weight = True" in single  # swiglu_down recasts W_down in backward on one rank
    from fp8pass.passes import annotate

    assert not annotate.weight_may_be_regathered(model_cls().p.weight)  # no FSDP2 here
    # (the FSDP2 runs of tests/distributed/test_distributed.py and tests/distributed/test_tensor_parallel.py take this path for real)
    monkeypatch.setattr(annotate, "weight_may_be_regathered", lambda w: isinstance(w, torch.nn.Parameter))
    torch._dynamo.reset()
    ranks = fp8pass.explain(model_cls(), torch.randn(2, 8, D)).graph_after
    assert "fp8_cast_input" not in ranks and "fp8_linear_precast" not in ranks, ranks
    assert ranks.count("fp8pass.fp8_linear.default(") == 3, ranks  # p, gate, up
    assert "recast_weight = False" in ranks and "recast_weight = True" not in ranks  # W_down's codes kept
