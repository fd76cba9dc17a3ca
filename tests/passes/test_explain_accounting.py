"""explain accounts for every matmul weight (issue 29, problem 4): FP8 + kept + ran outside any graph
adds up to the model's matmul weights, on the HF zoo and on a graph-broken expert loop.

The reference is the autograd graph of an eager forward (tests/_accounting.py), not explain's own
recording. The litgpt-style MoE below loops over its experts with ``torch.where(mask)`` (a
data-dependent shape): Dynamo falls back to eager for the loop's frame, so its router runs between
graphs (listed, "ran eagerly"), while each expert's own ``forward`` is a frame Dynamo compiles: a
dense SwiGLU in FP8, one scaling state per expert.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _accounting import assert_accounts_for_matmul_weights, reference_matmul_weights

import fp8pass
from fp8pass.config import Config
from fp8pass.report.report import IN_NO_GRAPH_MATMUL, OUTSIDE_GRAPHS, RAN_EAGERLY, matmul_weights
from fp8pass.runtime.state import state_for
from fp8pass.testing import hf_zoo as Z

D, H, E, V = 32, 64, 4, 64


class LLaMAMLP(nn.Module):
    """litgpt's LLaMAMLP: fc_1 (gate), fc_2 (up), proj (down)."""

    def __init__(self):
        super().__init__()
        self.fc_1, self.fc_2 = nn.Linear(D, H, bias=False), nn.Linear(D, H, bias=False)
        self.proj = nn.Linear(H, D, bias=False)

    def forward(self, x):
        return self.proj(F.silu(self.fc_1(x)) * self.fc_2(x))


class LLaMAMoE(nn.Module):
    """litgpt's LLaMAMoE: router ``gate``, top-2, a Python loop over the experts with ``torch.where``."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList(LLaMAMLP() for _ in range(E))

    def forward(self, x):
        B, T, C = x.size()
        x = x.view(-1, C)
        probs, indices = torch.topk(self.gate(x), 2)
        probs = probs.softmax(dim=1, dtype=torch.float).to(dtype=x.dtype)
        masks = (indices.unsqueeze(-1) == torch.arange(E, device=x.device)).permute(2, 0, 1)
        y = torch.zeros_like(x)
        for mask, expert in zip(masks, self.experts):
            token_idx, expert_idx = torch.where(mask)
            y[token_idx] += probs[token_idx, expert_idx, None] * expert(x[token_idx])
        return y.view(B, T, C)


class MoENet(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(V, D)
        self.attn = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)
        self.moe = LLaMAMoE()
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, ids):
        h = self.wte(ids)
        h = h + self.attn(h)
        h = h + self.moe(self.norm(h))
        return self.head(h)


IDS = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(0))
EXPERT_WEIGHTS = [f"moe.experts.{e}.{p}.weight" for e in range(E) for p in ("fc_1", "fc_2", "proj")]


def _moe():
    torch.manual_seed(0)
    return MoENet()


def test_expert_loop_frames_are_dense_swiglus_and_the_router_ran_eagerly():
    rep = assert_accounts_for_matmul_weights(_moe(), IDS).report
    assert [(s.gate, s.up, s.down, s.variant) for s in rep.swiglus] == [
        (f"moe.experts.{e}.fc_1.weight", f"moe.experts.{e}.fc_2.weight", f"moe.experts.{e}.proj.weight", "swiglu")
        for e in range(E)]
    assert sorted(rep.linears) == sorted(["attn.weight", "head.weight"] + EXPERT_WEIGHTS)
    assert rep.skipped == [("moe.gate.weight", RAN_EAGERLY)] and rep.outside_graphs == ["moe.gate.weight"]
    assert any("torch.where" in b or "Dynamic shape operator" in b for b in rep.graph_breaks), rep.graph_breaks
    assert rep.accounting() == (15, 14, 0, 1)
    assert "matmul weights: 15 = 14 FP8 + 0 kept in high precision + 1 ran eagerly between graphs" in str(rep)
    assert "moe.gate.weight" in str(rep) and "ran eagerly between graphs" in str(rep)


def _loss_and_grads(model, run):
    model.zero_grad()
    out = run(IDS)
    (out.float() * torch.linspace(-1, 1, V)).square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    torch._dynamo.reset()
    return out.detach(), grads


def test_compiled_expert_loop_runs_each_expert_in_fp8_with_its_own_state():
    """The compile (not only explain): each expert's frame is its own FP8 SwiGLU with its own scaling state;
    identity format equal to eager, FP8 gradients close to it."""
    model = _moe()
    torch._dynamo.reset()
    y0, g0 = _loss_and_grads(model, model)
    ident = Config(fwd_format="identity", bwd_format="identity", compiler="aot_eager", grad_stochastic_rounding=False)
    y1, g1 = _loss_and_grads(model, torch.compile(model, backend=fp8pass.backend(ident)))
    assert torch.allclose(y1, y0, rtol=1e-5, atol=1e-6) and g1.keys() == g0.keys()
    for n in g0:
        assert torch.allclose(g1[n], g0[n], rtol=1e-4, atol=1e-6 * g0[n].abs().max().item()), n
    cfg = Config(compiler="aot_eager", grad_stochastic_rounding=False)
    be = fp8pass.backend(cfg)
    cm = torch.compile(model, backend=be)
    model.zero_grad()
    out = cm(IDS)
    (out.float() * torch.linspace(-1, 1, V)).square().sum().backward()
    g8 = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    rep = be.report()
    torch._dynamo.reset()
    assert sorted({s.down for s in rep.swiglus}) == [f"moe.experts.{e}.proj.weight" for e in range(E)]
    assert sum(g.count("fp8pass.swiglu_down.default(") for g in rep.graph_after.split("# graph ")) >= E
    for n in g0:
        cos = F.cosine_similarity(g0[n].flatten().double(), g8[n].flatten().double(), dim=0).item()
        assert cos >= 0.98, (n, cos)
    assert not torch.equal(g0["moe.experts.0.fc_1.weight"], g8["moe.experts.0.fc_1.weight"])  # FP8 really ran
    # one delayed-scaling state per expert weight, each recording its own weight's amax
    states = [state_for(model.moe.experts[e].fc_1.weight, cfg.recipe) for e in range(E)]
    assert len({id(s) for s in states}) == E
    for e, s in enumerate(states):
        assert s.weight.amax_history[0] == model.moe.experts[e].fc_1.weight.detach().abs().amax(), e
        assert s.grad_output.amax_history[0] > 0, e   # the backward recorded


def test_a_weight_taken_by_a_graph_whose_matmul_ran_eagerly_is_listed():
    """A tied embedding/LM head: the lookup is in a graph, the LM head's matmul in a disabled function."""

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(V, D)
            self.mid = nn.Linear(D, D)

        @torch.compiler.disable
        def head(self, h):
            return F.linear(h, self.emb.weight)

        def forward(self, ids):
            return self.head(self.mid(self.emb(ids)))

    torch.manual_seed(0)
    acc = assert_accounts_for_matmul_weights(Tied(), IDS)
    assert acc.report.skipped == [("emb.weight", IN_NO_GRAPH_MATMUL)]
    assert acc.report.linears == ["mid.weight"] and acc.outside == set()
    assert acc.report.accounting() == (2, 1, 1, 0)


def test_transformers_eager_experts_add_up():
    acc = assert_accounts_for_matmul_weights(Z.build("Mixtral", layers=1, experts_impl="eager"), Z.ids(1, 8))
    assert acc.outside == {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"}
    assert all(r == OUTSIDE_GRAPHS for w, r in acc.report.skipped if w in acc.outside)


def test_activation_checkpointing_adds_up():
    """Whatever the passes do inside a checkpointed region, each of its weights is in a list."""
    model = Z.build("Llama")
    model.gradient_checkpointing_enable()
    # transformers 5.25's attention routing is a side effect Dynamo refuses in a checkpointed layer without
    # this flag (tests/passes/test_activation_checkpointing.py); with it, every layer is in a graph
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
        acc = assert_accounts_for_matmul_weights(model, Z.ids(1, 8))
    assert len(acc.expected) == 15 and acc.outside == set()


# ----------------------------------------------------------------------------------------------
# the definition, form by form (fp8pass.report.report.matmul_weights)

class Forms(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)                       # a lookup only: no matmul weight
        self.lin = nn.Linear(D, D)                          # F.linear: weight yes, bias (1-D) no
        self.raw_t = nn.Parameter(torch.randn(D, D))        # x @ W.t()
        self.cast = nn.Parameter(torch.randn(D, D))         # x @ W.bfloat16().float().t().contiguous()
        self.conv1d = nn.Parameter(torch.randn(D, D))       # addmm(b, x, W) (GPT-2's Conv1D)
        self.bias = nn.Parameter(torch.zeros(D))
        self.ein = nn.Parameter(torch.randn(D, D))          # einsum
        self.gathered = nn.Parameter(torch.randn(E, D, D))  # bmm over W[idx] (a gather: a copy)
        self.scale = nn.Parameter(torch.ones(D, D))         # elementwise only: no matmul weight
        self.unused = nn.Linear(D, D)                       # never called: not in this forward
        self.frozen = nn.Linear(D, D, bias=False).requires_grad_(False)   # frozen weights count too
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("last", torch.zeros(D))

    def forward(self, ids):
        x = self.emb(ids).flatten(0, 1)
        x = self.lin(x) * self.scale[0]
        x = x @ self.raw_t.t() + x @ self.cast.bfloat16().float().t().contiguous()
        x = torch.addmm(self.bias, x, self.conv1d)
        x = torch.einsum("td,fd->tf", x, self.ein)
        x = torch.bmm(x.unsqueeze(1), self.gathered[torch.tensor([1])].expand(x.shape[0], D, D)).squeeze(1)
        self.calls += 1
        self.last = x.detach()[0]   # a forward that assigns a new tensor to a buffer
        return F.dropout(self.frozen(x), 0.5)


def test_matmul_weights_form_by_form_and_no_trace_left():
    torch.manual_seed(0)
    model = Forms()
    rng, last = torch.get_rng_state(), model.last
    found = matmul_weights(model, (IDS,))
    assert torch.equal(torch.get_rng_state(), rng) and model.calls.item() == 0   # RNG and buffers restored
    assert model.last is last and not last.any()
    assert list(found) == ["lin.weight", "raw_t", "cast", "conv1d", "ein", "gathered", "frozen.weight"]
    assert all(found[n] is p for n, p in model.named_parameters() if n in found)
    assert set(found) == reference_matmul_weights(model, IDS)
    assert not model.frozen.weight.requires_grad


def test_tied_embedding_is_a_matmul_weight_only_as_a_head():
    class Tied(nn.Module):
        def __init__(self, tied):
            super().__init__()
            self.emb, self.tied = nn.Embedding(V, D), tied

        def forward(self, ids):
            h = self.emb(ids)
            return F.linear(h, self.emb.weight) if self.tied else h.sum()

    assert list(matmul_weights(Tied(True), (IDS,))) == ["emb.weight"]
    assert list(matmul_weights(Tied(False), (IDS,))) == []
    assert matmul_weights(lambda ids: ids, (IDS,)) == {}   # a function has no parameters to name


# ----------------------------------------------------------------------------------------------
# the HF zoo: every weight in a list, none outside a graph (the zoo compiles without a break)

def _zoo_case(name):
    acc = assert_accounts_for_matmul_weights(Z.build(name), Z.ids(1, 8))
    if name not in NOT_WHOLE_GRAPH:
        assert acc.outside == set() and not any(r == IN_NO_GRAPH_MATMUL for _, r in acc.report.skipped), acc.report
    return acc


# architectures whose own code breaks the graph (tests/integrations/test_hf_zoo.py: NOT_A_GLU)
NOT_WHOLE_GRAPH = {"JetMoe"}


@pytest.mark.parametrize("name", Z.FAST)
def test_zoo_fast_subset_adds_up(name):
    acc = _zoo_case(name)
    assert acc.fp8 and acc.expected == acc.fp8 | acc.kept | acc.outside, acc.report


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in Z.zoo() if n not in Z.FAST])
def test_zoo_whole_adds_up(name):
    acc = _zoo_case(name)
    assert acc.fp8 and acc.expected == acc.fp8 | acc.kept | acc.outside, acc.report


def test_a_forward_that_fails_eagerly_leaves_a_note_not_a_crash():
    class OnlyTraced(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, D)

        def forward(self, x):
            if torch._C._is_torch_function_mode_enabled():   # the recording run, not Dynamo's
                raise RuntimeError("no modes here")
            return self.lin(x)

    rep = fp8pass.explain(OnlyTraced(), torch.randn(4, D))
    assert rep.linears == ["lin.weight"] and rep.matmul_weights == [] and rep.accounting() is None
    assert rep.notes == ["the eager run that finds the model's matmul weights failed (RuntimeError: no modes here); "
                         "weights whose matmul ran outside every graph are not listed"]
