"""The backend never changes what a graph computes beyond the intended casts.

With the identity format every rewritten op computes the unquantized math, so a rewritten graph must
equal the original bit for bit, forward and backward. Checked on the minimal cases that the old
dead-code sweep broke (in-place fills of ``new_empty`` buffers, ``scatter_`` masks, ``add_`` into a
linear's output, vmap) and on generated models that mix linears, GLUs, views, in-place ops and random
draws. The originals run through the same Dynamo graphs with a pass-through backend, so the only
difference between the two runs is the rewrite.
"""

import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fp8pass
from fp8pass.config import Config

D = 64


@pytest.fixture(autouse=True)
def _eager_casts(monkeypatch):
    monkeypatch.setenv("FP8PASS_CPU_FUSED", "0")
    torch._dynamo.reset()


def _identity(compiler="eager", smooth="channel"):
    # Smooth-SwiGLU's channel scales are powers of two: scaling h and W_down by them is exact
    return fp8pass.backend(Config(fwd_format="identity", bwd_format="identity", compiler=compiler,
                                  grad_stochastic_rounding=False, min_dim=16, smooth_swiglu=smooth))


def _passthrough(gm, example_inputs):
    return gm.forward


def _run(model, x, backend, seed=0):
    torch._dynamo.reset()
    model.zero_grad()
    xi = x.clone().requires_grad_(True)
    torch.manual_seed(seed)
    y = torch.compile(model, backend=backend)(xi)
    y = y if isinstance(y, torch.Tensor) else y[0]
    torch.manual_seed(seed + 1)
    (y.float() * torch.randn_like(y.float())).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return y.detach(), xi.grad.clone(), grads


def _fp32_close(a, b) -> bool:
    """Equal up to the order of an fp32 GEMM's sums: a few units in the last place of the largest value."""
    return a.shape == b.shape and bool((a - b).abs().max() <= 8 * torch.finfo(a.dtype).eps * b.abs().max())


def _assert_same(model, x, backend=None, min_rewritten=1, exact=True):
    """The rewritten model's output and gradients equal the original's bit for bit. ``exact=False``
    where the rewrite changes which GEMM call computes a product (``bmm``/``einsum`` over stacked
    experts -> one GEMM per expert): BLAS may sum in another order there (on a CPU without AMX, 3.6e-7
    on values ~1), so those are equal to fp32 rounding (:func:`_fp32_close`), still far below any cast."""
    y0, dx0, g0 = _run(model, x, _passthrough)
    be = backend or _identity()
    y1, dx1, g1 = _run(model, x, be)
    rep = be.report()
    assert len(rep.linears) >= min_rewritten, str(rep)
    same = torch.equal if exact else _fp32_close
    assert same(y0, y1), (y0 - y1).abs().max()
    assert same(dx0, dx1), (dx0 - dx1).abs().max()
    assert g0.keys() == g1.keys()
    for n in g0:
        assert same(g0[n], g1[n]), (n, (g0[n] - g1[n]).abs().max())
    return rep


class NewEmptyCopyScatter(nn.Module):
    """The issue's minimal case: a ``new_empty`` buffer filled by ``copy_``, a ``scatter_`` mask."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, D)
        self.out = nn.Linear(2 * D, D)

    def forward(self, x):
        y = self.proj(x)
        buf = y.new_empty(*y.shape[:-1], 2 * D)
        buf[..., :D].copy_(y)
        buf[..., D:].copy_(x)
        mask = torch.zeros(*x.shape[:-1], D, dtype=torch.bool)
        mask.scatter_(-1, torch.topk(x, 4, dim=-1).indices, True)
        return self.out(buf).masked_fill(mask, 0.0)


class AddInto(nn.Module):
    """Llama4's ``out.add_(routed)`` / GPT-OSS's ``out.add_(bias)``: in-place into a linear's output."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D, D)
        self.b = nn.Linear(D, D)
        self.bias = nn.Parameter(torch.randn(D))

    def forward(self, x):
        out = self.a(x)
        out.add_(self.b(x))
        out.add_(self.bias)
        return out


class VmapInside(nn.Module):
    """vmap changes functorch state (``_vmap_increment_nesting``) with unused results (Jamba's scan)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, D)

    def forward(self, x):
        y = self.proj(x)
        return torch.vmap(lambda r: r * r.sum())(y.reshape(-1, D)).reshape(y.shape)


@pytest.mark.parametrize("cls", [NewEmptyCopyScatter, AddInto, VmapInside])
def test_minimal_inplace_and_vmap_cases_are_unchanged(cls):
    torch.manual_seed(0)
    _assert_same(cls(), torch.randn(2, 5, D))


def test_inplace_case_under_aot_autograd():
    """The same through AOT autograd (functionalization of the in-place ops), the real compile path."""
    torch.manual_seed(0)
    m = NewEmptyCopyScatter()
    x = torch.randn(2, 5, D)
    y0, dx0, g0 = _run(m, x, _passthrough)
    y1, dx1, g1 = _run(m, x, _identity("aot_eager"))
    assert torch.allclose(y0, y1, rtol=0, atol=1e-6) and torch.allclose(dx0, dx1, rtol=0, atol=1e-6)
    for n in g0:
        assert torch.allclose(g0[n], g1[n], rtol=0, atol=1e-5), n


# ---- generated models: linears, GLUs, views, in-place ops and random draws, in random order ----

BLOCKS = ("linear", "glu", "fused_glu", "view", "copy_into_new_empty", "add_", "setitem", "masked_fill_",
          "index_put_", "scatter_mask", "dropout", "unused_random", "matmul_wt", "conv1d")


class Generated(nn.Module):
    def __init__(self, seed: int, n_blocks: int = 5):
        super().__init__()
        rng = random.Random(seed)
        self.kinds = [rng.choice(BLOCKS) for _ in range(n_blocks)]
        self.layers = nn.ModuleList()
        for kind in self.kinds:
            block = nn.Module()
            if kind in ("glu",):
                block.gate, block.up, block.down = nn.Linear(D, 2 * D, bias=False), nn.Linear(D, 2 * D, bias=False), \
                    nn.Linear(2 * D, D, bias=False)
            elif kind == "fused_glu":
                block.gate_up, block.down = nn.Linear(D, 4 * D, bias=False), nn.Linear(2 * D, D, bias=False)
            elif kind == "matmul_wt":
                block.w = nn.Parameter(torch.randn(D, D) / D ** 0.5)
            elif kind == "conv1d":
                block.w = nn.Parameter(torch.randn(D, D) / D ** 0.5)  # stored [in, out] as GPT-2's Conv1D
                block.b = nn.Parameter(torch.randn(D) * 0.1)
            else:
                block.lin = nn.Linear(D, D)
            self.layers.append(block)

    def forward(self, x):
        for kind, blk in zip(self.kinds, self.layers):
            if kind == "linear":
                x = blk.lin(x)
            elif kind == "glu":
                x = blk.down(F.silu(blk.gate(x)) * blk.up(x))
            elif kind == "fused_glu":
                g, u = blk.gate_up(x).chunk(2, dim=-1)
                x = blk.down(F.silu(g) * u)
            elif kind == "matmul_wt":
                x = x @ blk.w.t()
            elif kind == "conv1d":
                x = torch.addmm(blk.b, x.reshape(-1, D), blk.w).reshape(x.shape)
            elif kind == "view":
                x = blk.lin(x).view(*x.shape[:-1], 2, D // 2).transpose(-1, -2).reshape(x.shape)
            elif kind == "copy_into_new_empty":
                y = blk.lin(x)
                buf = y.new_empty(y.shape)
                buf[..., : D // 2].copy_(y[..., : D // 2])
                buf[..., D // 2:].copy_(x[..., D // 2:])
                x = buf
            elif kind == "add_":
                y = blk.lin(x)
                y.add_(x)
                x = y
            elif kind == "setitem":
                y = blk.lin(x)
                y[..., 0] = 0.0
                x = y
            elif kind == "masked_fill_":
                y = blk.lin(x)
                y.masked_fill_(x > 1.0, 0.5)
                x = y
            elif kind == "index_put_":
                y = blk.lin(x)
                idx = torch.arange(0, D, 7)
                y.index_put_((idx,), torch.ones(idx.numel(), *y.shape[1:]), accumulate=True) if y.dim() == 2 \
                    else y[:, :, idx].add_(1.0)
                x = y
            elif kind == "scatter_mask":
                y = blk.lin(x)
                mask = torch.zeros_like(y, dtype=torch.bool)
                mask.scatter_(-1, torch.topk(y, 3, dim=-1).indices, True)
                x = y.masked_fill(mask, 0.0)
            elif kind == "dropout":
                x = F.dropout(blk.lin(x), p=0.25, training=True)
            elif kind == "unused_random":
                torch.rand(3)  # a draw whose result is unused: later draws depend on it
                x = blk.lin(x) + 0.01 * torch.randn_like(x)
        return x


@pytest.mark.parametrize("seed", range(24))
def test_generated_graphs_unchanged_under_identity_format(seed):
    torch.manual_seed(seed)
    model = Generated(seed)
    _assert_same(model, torch.randn(2, 3, D), _identity(smooth=(None, "channel")[seed % 2]))


def test_token_smoothing_within_rounding_of_the_original():
    """The token form divides by per-token scales that are not powers of two: equal up to rounding."""
    torch.manual_seed(0)
    model = Generated(2)  # conv1d, conv1d, linear, glu, glu
    x = torch.randn(2, 3, D)
    y0, dx0, g0 = _run(model, x, _passthrough)
    y1, dx1, g1 = _run(model, x, _identity(smooth="token"))
    assert not torch.equal(y0, y1)  # the check below is about rounding, not an exact match
    for a, b in [(y0, y1), (dx0, dx1)] + [(g0[n], g1[n]) for n in g0]:
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()


def test_generated_models_cover_every_block_kind():
    """The seeds above exercise each block kind at least once (the generator's coverage)."""
    seen = {k for s in range(24) for k in Generated(s).kinds}
    assert seen == set(BLOCKS)


# ---- names: absolute across graph breaks --------------------------------------------------------

class BreakingLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(D, D)
        self.o_proj = nn.Linear(D, D)

    def forward(self, x):
        x = self.q_proj(x)
        torch._dynamo.graph_break()  # each layer's halves become frames of their own
        return self.o_proj(x)


class Stack(nn.Module):
    def __init__(self, n=4):
        super().__init__()
        self.layers = nn.ModuleList(BreakingLayer() for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_weight_names_are_absolute_across_graph_breaks():
    """Every layer compiles as its own frames; names stay model paths, so no two layers collide and
    keep_high_precision globs with layer paths match."""
    torch.manual_seed(0)
    model = Stack()
    x = torch.randn(2, 3, D)
    rep = fp8pass.explain(model, x, config=Config(min_dim=16))
    expected = [f"layers.{i}.{p}.weight" for i in range(4) for p in ("q_proj", "o_proj")]
    assert sorted(rep.linears) == sorted(expected)
    rep = fp8pass.explain(model, x, config=Config(min_dim=16, keep_high_precision=("layers.2.*",)))
    assert sorted(rep.linears) == sorted(w for w in expected if not w.startswith("layers.2."))
    assert sorted(w for w, r in rep.skipped if "keep_high_precision" in r) == ["layers.2.o_proj.weight",
                                                                              "layers.2.q_proj.weight"]


def test_policy_applies_per_layer_when_dynamo_reuses_a_frame():
    """Dynamo compiles the layer frames once and reuses them for every layer; the layer a glob keeps
    high precision must run without FP8 (no scaling state, output equal to the eager layer)."""
    torch.manual_seed(0)
    model = Stack()
    x = torch.randn(2, 3, D)
    be = fp8pass.backend(Config(min_dim=16, compiler="eager", keep_high_precision=("layers.2.*",),
                                grad_stochastic_rounding=False))
    torch.compile(model, backend=be)(x).sum().backward()
    sd = fp8pass.scaling_state_dict(model)
    layers_with_state = sorted({k.split(".")[1] for k in sd})
    assert layers_with_state == ["0", "1", "3"]
    rep = be.report()
    assert sorted(w for w, r in rep.skipped if "keep_high_precision" in r) == ["layers.2.o_proj.weight",
                                                                              "layers.2.q_proj.weight"]


# ---- models the backend leaves alone, and says so ----------------------------------------------

def test_meta_device_model_compiles_without_fp8_and_says_so():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(D, D), nn.Linear(D, D))
    be = fp8pass.backend(Config(min_dim=16))
    with pytest.warns(RuntimeWarning, match="meta device"):
        y = torch.compile(model, backend=be)(torch.randn(2, D, device="meta"))
    assert y.device.type == "meta" and y.shape == (2, D)
    assert be.records == []  # nothing planned or rewritten


def test_float64_model_warns_once_at_compile():
    model = nn.Sequential(nn.Linear(D, D), nn.Linear(D, D)).double()
    be = fp8pass.backend(Config(min_dim=16, compiler="eager"))
    with pytest.warns(RuntimeWarning, match="float64") as got:
        cm = torch.compile(model, backend=be)
        cm(torch.randn(2, D, dtype=torch.float64))
        cm(torch.randn(3, D, dtype=torch.float64))  # a recompile: no second warning
    assert sum("float64" in str(w.message) for w in got) == 1
    assert be.report().linears == []


# ---- MoE expert stacks in the fixed-capacity forms ---------------------------------------------

class StackedExperts(nn.Module):
    """Experts as one 3-D weight each, every expert with the same number of rows (capacity)."""

    def __init__(self, form: str, experts: int = 4, ffn: int = 32):
        super().__init__()
        self.form = form
        self.gate_up = nn.Parameter(torch.randn(experts, D, 2 * ffn) / D ** 0.5)   # [E, in, out]
        self.down = nn.Parameter(torch.randn(experts, D, ffn) / ffn ** 0.5)         # [E, out, in]

    def forward(self, x):  # x [E, C, D]
        if self.form == "bmm":
            gate, up = torch.bmm(x, self.gate_up).chunk(2, dim=-1)
            return torch.bmm(up * F.silu(gate), self.down.transpose(1, 2))
        gate, up = torch.einsum("ecd,edf->ecf", x, self.gate_up).chunk(2, dim=-1)
        return torch.einsum("ecf,edf->ecd", F.silu(gate) * up, self.down)


@pytest.mark.parametrize("form", ["bmm", "einsum"])
def test_stacked_expert_forms_become_one_fp8_expert_glu(form):
    torch.manual_seed(0)
    model = StackedExperts(form)
    rep = _assert_same(model, torch.randn(4, 6, D), _identity(smooth="channel"), min_rewritten=2, exact=False)
    assert len(rep.experts) == 1 and rep.experts[0].variant.startswith("swiglu (fused gate_up)")
    assert "fp8pass.fp8_grouped_swiglu_down.default(" in rep.graph_after
    assert "torch.bmm(" not in rep.graph_after and "einsum(" not in rep.graph_after


def test_einsum_layouts():
    from fp8pass.passes.patterns import einsum_layout

    assert einsum_layout("ecd,edf->ecf") == "in_out"
    assert einsum_layout("e c d, e f d -> e c f") == "out_in"
    assert einsum_layout("ecd,edf->ecd") is None       # not a GEMM over d
    assert einsum_layout("bcd,edf->bcf") is None       # no shared expert index
    assert einsum_layout("...d,edf->...f") is None


def test_names_are_the_models_own_inside_a_ddp_style_wrapper():
    """A model compiled in place and called through a wrapper that holds it as ``module`` (DDP,
    DataParallel) keeps its own names: the default ``lm_head`` glob still keeps the head."""

    class DistributedDataParallel(nn.Module):  # the wrapper's shape, without a process group
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, x):
            return self.module(x)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(D, D)
            self.lm_head = nn.Linear(D, D)

        def forward(self, x):
            return self.lm_head(self.proj(x))

    torch.manual_seed(0)
    model = Model()
    be = fp8pass.backend(Config(min_dim=16, compiler="eager"))
    model.compile(backend=be)
    wrapped = DistributedDataParallel(model)
    wrapped(torch.randn(2, D))
    rep = be.report()
    assert rep.linears == ["proj.weight"]
    assert [w for w, _ in rep.skipped] == ["lm_head.weight"]


def test_names_when_the_wrapper_itself_is_compiled():
    """torch.compile(DDP(model)): the frame root is the wrapper; names are still the model's own."""

    class DistributedDataParallel(nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, x):
            return self.module(x)

    model = nn.Module()
    model.proj, model.lm_head = nn.Linear(D, D), nn.Linear(D, D)
    model.forward = lambda x: model.lm_head(model.proj(x))
    be = fp8pass.backend(Config(min_dim=16, compiler="eager"))
    torch.compile(DistributedDataParallel(model), backend=be)(torch.randn(2, D))
    rep = be.report()
    assert rep.linears == ["proj.weight"] and [w for w, _ in rep.skipped] == ["lm_head.weight"]
