"""The per-expert loop (``for e in range(E): F.linear(x, W[e])`` over a 3-D expert weight) in FP8.

Exact plan counts per indexing form; identity format bit-exact against eager (forward and gradients);
FP8 gradients against fp32; one delayed-scaling state per (expert weight, expert), distinct and
evolving; explain counts one expert stack; per-expert nn.Linear modules are plain FP8 GLUs; a tensor
index is listed as kept with its reason.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fp8pass
from fp8pass.config import Config, CurrentScaling, NVFP4Scaling
from fp8pass.passes.plan import plan_graph
from fp8pass.runtime.state import grouped_state_for
from fp8pass.testing.models import capture

E, D, H = 4, 32, 64
IDENTITY = Config(fwd_format="identity", bwd_format="identity", compiler="aot_eager", grad_stochastic_rounding=False)


class LoopLinears(nn.Module):
    """Dense routing: every token through every expert's one projection, weighted by its probability."""

    def __init__(self, how: str = "getitem"):
        super().__init__()
        self.how = how
        self.router = nn.Linear(D, E, bias=False)
        # experts of different sizes: each gets its own scales
        self.w = nn.Parameter(torch.randn(E, H, D) * torch.tensor([1.0, 4.0, 0.25, 16.0]).view(E, 1, 1) * D ** -0.5)
        if how == "bias":
            self.b = nn.Parameter(torch.randn(E, H))

    def expert(self, x, e):
        w = self.w
        if self.how == "bias":
            return F.linear(x, w[e], self.b[e])
        if self.how == "getitem":
            return F.linear(x, w[e])
        if self.how == "negative":
            return F.linear(x, w[e - E])
        if self.how == "select":
            return F.linear(x, w.select(0, e))
        if self.how == "torch.select":
            return F.linear(x, torch.select(w, 0, e))
        if self.how == "matmul_t":
            return x @ w[e].t()
        if self.how == "matmul_T":
            return torch.matmul(x, w[e].T)
        raise ValueError(self.how)

    def forward(self, x):
        probs = self.router(x).softmax(-1)
        out = 0
        for e in range(E):
            out = out + probs[..., e:e + 1] * self.expert(x, e)
        return out


class LoopGLU(nn.Module):
    """Masked routing over SwiGLU experts (fused gate_up [E, 2H, D] or gate, up [E, H, D]; down [E, D, H])."""

    def __init__(self, fused: bool = True):
        super().__init__()
        self.fused = fused
        self.router = nn.Linear(D, E, bias=False)
        if fused:
            self.gate_up = nn.Parameter(torch.randn(E, 2 * H, D) * D ** -0.5)
        else:
            self.gate = nn.Parameter(torch.randn(E, H, D) * D ** -0.5)
            self.up = nn.Parameter(torch.randn(E, H, D) * D ** -0.5)
        self.down = nn.Parameter(torch.randn(E, D, H) * H ** -0.5)

    def forward(self, x):
        logits = self.router(x)
        top = logits.topk(2, dim=-1)
        weights = torch.zeros_like(logits).scatter(-1, top.indices, top.values.softmax(-1))
        out = torch.zeros_like(x)
        for e in range(E):
            if self.fused:
                g, u = F.linear(x, self.gate_up[e]).chunk(2, dim=-1)
            else:
                g, u = F.linear(x, self.gate.select(0, e)), x @ self.up[e].t()
            y = F.linear(F.silu(g) * u, self.down[e])
            out = out + weights[..., e:e + 1] * y
        return out


class ModuleListExperts(nn.Module):
    """Per-expert ``nn.Linear`` GLUs in a ModuleList: plain dense GLUs."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList(nn.ModuleDict(dict(gate_proj=nn.Linear(D, H, bias=False),
                                                        up_proj=nn.Linear(D, H, bias=False),
                                                        down_proj=nn.Linear(H, D, bias=False)))
                                     for _ in range(E))

    def forward(self, x):
        probs = self.router(x).softmax(-1)
        out = 0
        for e, ex in enumerate(self.experts):
            out = out + probs[..., e:e + 1] * ex["down_proj"](F.silu(ex["gate_proj"](x)) * ex["up_proj"](x))
        return out


def _plan(model, x, cfg=None):
    (gm,) = capture(model, x, fullgraph=True)
    return plan_graph(gm.graph, cfg or Config())


@pytest.mark.parametrize("how", ["getitem", "negative", "select", "torch.select", "matmul_t", "matmul_T", "bias"])
def test_every_constant_index_form_is_one_fp8_linear_per_expert(how):
    torch.manual_seed(0)
    p = _plan(LoopLinears(how), torch.randn(6, D))
    assert [(s.fqn, s.proj.expert[1]) for s in p.loop_linears] == [("w", e) for e in range(E)]
    assert all((s.proj.b is not None) == (how == "bias") for s in p.loop_linears)   # b[e] is the expert's bias
    assert p.linears == [] and p.glus == [] and p.loop_glus == []
    assert p.skipped == [("router.weight", "weight (4, 32) has a dim below min_dim=16")]


@pytest.mark.parametrize("fused", [True, False])
def test_expert_glu_in_a_loop_is_one_smooth_swiglu_per_expert(fused):
    torch.manual_seed(0)
    p = _plan(LoopGLU(fused), torch.randn(6, D))
    assert len(p.loop_glus) == E and p.glus == [] and p.linears == [] and p.loop_linears == []
    assert {(s.gate, s.up, s.down) for s in p.loop_glus} == {("gate_up", "gate_up", "down") if fused else
                                                             ("gate", "up", "down")}
    assert all(s.variant == ("swiglu (fused gate_up)" if fused else "swiglu") for s in p.loop_glus)


def _run(model, x, cfg=None):
    model.zero_grad()
    m = model if cfg is None else torch.compile(model, backend=fp8pass.backend(cfg))
    y = m(x)
    (y.float() * torch.linspace(-1, 1, y.shape[-1])).square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    torch._dynamo.reset()
    return y.detach(), grads


@pytest.mark.parametrize("model", [lambda: LoopLinears("getitem"), lambda: LoopLinears("matmul_t"),
                                   lambda: LoopLinears("bias"), lambda: LoopGLU(True), lambda: LoopGLU(False)],
                         ids=["linears", "linears_matmul", "linears_bias", "glu_fused", "glu_separate"])
def test_identity_format_equals_eager_bit_for_bit(model):
    torch.manual_seed(0)
    m, x = model(), torch.randn(2, 8, D)
    y0, g0 = _run(m, x)
    y1, g1 = _run(m, x, IDENTITY)
    assert torch.equal(y0, y1)
    assert g0.keys() == g1.keys()
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n


@pytest.mark.parametrize("model", [lambda: LoopLinears("select"), lambda: LoopGLU(True)], ids=["linears", "glu"])
def test_fp8_gradients_follow_fp32(model):
    torch.manual_seed(0)
    m, x = model(), torch.randn(4, 32, D)
    y0, g0 = _run(m, x)
    y8, g8 = _run(m, x, Config(compiler="aot_eager", grad_stochastic_rounding=False))
    assert F.cosine_similarity(y0.flatten(), y8.flatten(), dim=0) >= 0.99
    for n in g0:
        cos = F.cosine_similarity(g0[n].flatten().double(), g8[n].flatten().double(), dim=0).item()
        assert cos >= 0.98, (n, cos)
        assert not torch.equal(g0[n], g8[n])  # FP8 really ran


@pytest.mark.parametrize("compiler", ["aot_eager", "eager"])
def test_per_expert_states_are_distinct_and_evolve(compiler):
    torch.manual_seed(0)
    m = LoopLinears("getitem")
    cfg = Config(compiler=compiler, grad_stochastic_rounding=False)
    cm = torch.compile(m, backend=fp8pass.backend(cfg))
    st = grouped_state_for(m.w, cfg.recipe)
    scales = []
    for step in range(3):
        x = torch.randn(2, 8, D) * (1 + step)
        cm(x).square().sum().backward()
        # the weight role recorded exactly each expert's own amax this step
        assert torch.equal(st.weight.amax_history[:, 0], m.w.detach().abs().amax(dim=(1, 2))), step
        scales.append((st.input.scale.clone(), st.weight.scale.clone(), st.grad_output.scale.clone()))
        with torch.no_grad():
            m.w.mul_(torch.tensor([1.0, 2.0, 0.5, 1.0]).view(E, 1, 1))
    for role in (st.input, st.weight, st.grad_output):
        assert role.scale.shape == (E,) and (role.steps == 3).all()
    assert len(set(st.weight.scale.tolist())) == E             # one scale per expert
    assert len(set(st.grad_output.scale.tolist())) == E         # gradients: the router weights them differently
    assert not torch.equal(scales[0][0], scales[-1][0])         # the input grew
    assert not torch.equal(scales[0][1], scales[-1][1])         # the weights changed
    assert m.w.grad is not None and (m.w.grad.flatten(1).norm(dim=1) > 0).all()
    # the same per-expert state as a grouped expert weight's: checkpoints carry it under the weight's FQN
    sd = fp8pass.scaling_state_dict(m)
    assert torch.equal(sd["w.grad_output.amax_history"], st.grad_output.amax_history)
    assert sd["w.input.scale"].shape == (E,)


def test_explain_counts_one_expert_stack():
    torch.manual_seed(0)
    rep = fp8pass.explain(LoopGLU(True), torch.randn(2, 8, D), config=Config())
    assert [(e.module, e.weights, e.variant) for e in rep.experts] == [
        ("<root>", ("gate_up", "down"), "swiglu (fused gate_up) experts (per-expert loop)")]
    assert rep.swiglus == [] and rep.linears == ["gate_up", "down"]
    assert "fp8pass.swiglu_down.default(" in rep.graph_after
    assert rep.graph_after.count("fp8pass.fp8_linear.default(") == E
    assert rep.graph_after.count("fp8pass.swiglu_down.default(") == E
    rep = fp8pass.explain(LoopLinears("select"), torch.randn(2, 8, D), config=Config())
    assert [(e.module, e.weights, e.variant) for e in rep.experts] == [("<root>", ("w",), "linears (per-expert loop)")]


def test_module_list_experts_are_plain_fp8_glus():
    torch.manual_seed(0)
    rep = fp8pass.explain(ModuleListExperts(), torch.randn(2, 8, D), config=Config())
    assert [s.gate for s in rep.swiglus] == [f"experts.{e}.gate_proj.weight" for e in range(E)]
    assert len(rep.linears) == 3 * E and rep.experts == []


def test_tensor_index_is_kept_with_reason():
    class TensorIndex(LoopLinears):
        def __init__(self):
            super().__init__()
            self.register_buffer("order", torch.arange(E))

        def expert(self, x, e):
            i = self.order[e].item()
            torch._check(i >= 0)
            torch._check(i < E)
            return F.linear(x, self.w[i])

    torch.manual_seed(0)
    # with the scalar captured, the index is a symbolic int in the graph (else Dynamo cannot trace it)
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        p = _plan(TensorIndex(), torch.randn(6, D))
    assert p.loop_linears == [] and p.linears == []
    kept = [r for w, r in p.skipped if w == "w"]
    assert len(kept) == E and all("tensor index" in r and "grouped_mm" in r for r in kept)


def test_nvfp4_keeps_the_loop_and_says_so():
    torch.manual_seed(0)
    p = _plan(LoopGLU(True), torch.randn(6, D), Config(recipe=NVFP4Scaling()))
    assert p.loop_glus == [] and p.loop_linears == [] and p.glus == [] and p.linears == []
    kept = [w for w, r in p.skipped if "NVFP4 recipe has no per-expert state" in r]
    assert kept == ["GLU down"] * E + [f"{w}[{e}]" for e in range(E) for w in ("gate_up", "down")]  # GLU, then each linear


def test_current_scaling_and_keep_glob():
    torch.manual_seed(0)
    m, x = LoopGLU(True), torch.randn(2, 8, D)
    y0, _ = _run(m, x)
    y8, g8 = _run(m, x, Config(recipe=CurrentScaling(), compiler="aot_eager"))
    assert F.cosine_similarity(y0.flatten(), y8.flatten(), dim=0) >= 0.99 and not torch.equal(y0, y8)
    p = _plan(m, x, Config(keep_high_precision=("down",)))
    assert p.loop_glus == [] and len(p.loop_linears) == E     # gate_up per expert still FP8
    assert sum("keep_high_precision pattern 'down'" in r for _, r in p.skipped) >= E


class TokenGather(nn.Module):
    """Token-gathering routing (the older Mixtral loop): each expert gets the rows routed to it
    (``torch.where`` -> unbacked row counts), its outputs added back with ``index_add``."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.gate_up = nn.Parameter(torch.randn(E, 2 * H, D) * D ** -0.5)
        self.down = nn.Parameter(torch.randn(E, D, H) * H ** -0.5)

    def forward(self, x):
        x = x.reshape(-1, D)
        w, top = self.router(x).softmax(-1).topk(2, dim=-1)
        out = torch.zeros_like(x)
        for e in range(E):
            tok, slot = torch.where(top == e)
            g, u = F.linear(x[tok], self.gate_up[e]).chunk(2, dim=-1)
            out = out.index_add(0, tok, F.linear(F.silu(g) * u, self.down[e]) * w[tok, slot, None])
        return out


def test_token_gathering_loop_with_dynamic_output_shapes():
    """With ``capture_dynamic_output_shape_ops`` the data-dependent gather stays in the graph and the
    experts (unbacked row counts) are FP8; without it ``torch.where`` breaks the graph per expert."""
    torch.manual_seed(0)
    m, x = TokenGather(), torch.randn(2, 8, D)
    y0, g0 = _run(m, x)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        rep = fp8pass.explain(m, x, config=Config())
        assert [(e.weights, e.variant) for e in rep.experts] == [
            (("gate_up", "down"), "swiglu (fused gate_up) experts (per-expert loop)")]
        assert rep.num_graphs == 1 and rep.graph_breaks == []
        y1, g1 = _run(m, x, IDENTITY)
        y8, g8 = _run(m, x, Config(compiler="aot_eager", grad_stochastic_rounding=False))
    assert torch.equal(y0, y1) and all(torch.equal(g0[n], g1[n]) for n in g0)
    for n in ("gate_up", "down"):
        assert F.cosine_similarity(g0[n].flatten(), g8[n].flatten(), dim=0) >= 0.98 and not torch.equal(g0[n], g8[n])


def test_transformers_eager_experts_are_listed_as_outside_every_graph():
    """transformers' eager experts loop over data-dependent expert ids: their GEMMs are in no graph
    (docs/backend.md); explain lists each expert weight with the reason and what to do."""
    pytest.importorskip("transformers")
    from fp8pass.report.report import OUTSIDE_GRAPHS
    from fp8pass.testing import hf_zoo as Z

    ids = Z.ids(1, 8)
    rep = fp8pass.explain(Z.build("Mixtral", layers=1, experts_impl="eager"), ids)
    assert rep.experts == []
    assert [w for w, r in rep.skipped if r == OUTSIDE_GRAPHS] == [
        "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"]
    assert "grouped_mm" in OUTSIDE_GRAPHS
    rep = fp8pass.explain(Z.build("Mixtral", layers=1), ids)   # grouped_mm: in the graph, FP8
    assert len(rep.experts) == 1 and not any(r == OUTSIDE_GRAPHS for _, r in rep.skipped)
