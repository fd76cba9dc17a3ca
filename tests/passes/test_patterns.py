"""Pattern matching on real Dynamo graphs: exact counts per SwiGLU form, HF models, policy, breaks."""

import pytest
import torch
import torch.nn as nn

from fp8pass.config import Config
from fp8pass.passes.plan import plan_graph
from fp8pass.testing.models import (
    D,
    Fused,
    GeGLU,
    GeluMLP,
    MatmulWT,
    MulSilu,
    ReGLU,
    SigmoidFn,
    SigmoidMethod,
    SiluMul,
    capture,
    tiny_titan_llama,
)

VARIANTS = [
    (SiluMul, {}), (SiluMul, {"bias": True}), (MulSilu, {}), (SigmoidFn, {}), (SigmoidMethod, {}),
    (MatmulWT, {}), (MatmulWT, {"bias": True}),
    (GeGLU, {"approximate": "tanh"}), (GeGLU, {"approximate": "none"}), (ReGLU, {}),
] + [(Fused, {"how": h}) for h in ("chunk", "split", "split_list", "slice", "unbind", "unbind_interleaved")]


def _plans(model, *inputs, cfg=None, **kw):
    split, plans = {}, []
    for gm in capture(model, *inputs, **kw):
        p = plan_graph(gm.graph, cfg or Config(), split)
        split.update(p.split_modules)
        plans.append(p)
    return plans


@pytest.mark.parametrize("cls,kw", VARIANTS, ids=lambda v: getattr(v, "__name__", str(v)))
@pytest.mark.parametrize("ndim", [2, 3])
def test_each_glu_form_matches_once(cls, kw, ndim):
    torch.manual_seed(0)
    m = cls(**kw)
    x = torch.randn(6, D) if ndim == 2 else torch.randn(2, 3, D)
    (p,) = _plans(m, x, fullgraph=True)
    assert len(p.glus) == 1
    assert p.glus[0].variant == m.variant
    assert p.linears == [] and p.graph_breaks == []
    if cls is Fused:
        rows = {"unbind_interleaved": (slice(0, 128, 2), slice(1, 128, 2))}.get(
            kw["how"], (slice(0, 64, 1), slice(64, 128, 1)))
        assert (p.glus[0].gate_rows, p.glus[0].up_rows) == rows


def test_gelu_mlp_gets_linears_only():
    (p,) = _plans(GeluMLP(), torch.randn(4, D), fullgraph=True)
    assert p.glus == [] and [s.fqn for s in p.linears] == ["fc1.weight", "fc2.weight"]


def test_intermediate_used_elsewhere_is_not_fused():
    class Leaky(SiluMul):
        def forward(self, x):
            g = self.gate_proj(x)
            return self.down_proj(torch.nn.functional.silu(g) * self.up_proj(x)) + g.sum()

    (p,) = _plans(Leaky(), torch.randn(4, D), fullgraph=True)
    assert p.glus == [] and len(p.linears) == 3
    assert any("also used outside" in r for _, r in p.skipped)


def test_titan_llama_counts():
    m = tiny_titan_llama(n_layers=3)
    (p,) = _plans(m, torch.randint(0, 128, (2, 8)), fullgraph=True)
    assert len(p.glus) == 3
    assert len(p.linears) == 3 * 4  # wq wk wv wo
    assert p.skipped == [("output.weight", "kept in high precision by keep_high_precision pattern 'output'")] + [
        (f"layers.{i}.attention", "attention, kept (1 op: scores and weighted values are products of activations)")
        for i in range(3)]
    assert p.glus[1].gate == "layers.1.feed_forward.w1.weight"
    assert p.glus[1].down == "layers.1.feed_forward.w2.weight"


def _hf(name, layers=2):
    transformers = pytest.importorskip("transformers")
    kw = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg = getattr(transformers, name + "Config")(**kw)
    if name == "Gemma":
        cfg.head_dim = 8
    torch.manual_seed(0)
    return getattr(transformers, name + "ForCausalLM")(cfg)


HF = [("Llama", "swiglu", 4), ("Qwen2", "swiglu", 4), ("Mistral", "swiglu", 4),
      ("Phi3", "swiglu (fused gate_up)", 2), ("Gemma", "geglu-tanh", 4)]


@pytest.mark.parametrize("name,variant,attn_linears", HF, ids=[h[0] for h in HF])
def test_hf_models_match_one_glu_per_layer(name, variant, attn_linears):
    m = _hf(name, layers=3)
    ids = torch.randint(0, 128, (2, 8))
    (p,) = _plans(m, ids, fullgraph=True)
    assert len(p.glus) == 3
    assert {g.variant for g in p.glus} == {variant}
    assert len(p.linears) == 3 * attn_linears  # q,k,v,o (Phi3: fused qkv + o)
    where = [w for w, _ in p.skipped]
    # the LM head stays high precision (Gemma ties it to the embedding); attention is one line a layer
    assert len(where) == 4 and ("lm_head" in where[0] or "embed_tokens" in where[0])
    assert where[1:] == [f"model.layers.{i}.self_attn" for i in range(3)]
    assert all(r.startswith("attention, kept") for _, r in p.skipped[1:])


def test_keep_high_precision_globs_and_dims():
    m = tiny_titan_llama(n_layers=2)
    cfg = Config(keep_high_precision=("output", "layers.1.*"))
    (p,) = _plans(m, torch.randint(0, 128, (2, 8)), cfg=cfg, fullgraph=True)
    assert len(p.glus) == 1 and len(p.linears) == 4
    cfg = Config(min_dim=64)
    (p,) = _plans(m, torch.randint(0, 128, (2, 8)), cfg=cfg, fullgraph=True)
    assert p.glus == [] and p.linears == []  # dim 32 < 64 everywhere


def test_float64_model_is_skipped_with_reason():
    m = SiluMul().double()
    (p,) = _plans(m, torch.randn(4, D, dtype=torch.float64), fullgraph=True)
    assert p.glus == [] and p.linears == []
    assert all("float64" in r for _, r in p.skipped) and len(p.skipped) == 4


def test_model_without_linears_plans_nothing():
    m = nn.Sequential(nn.LayerNorm(D), nn.GELU())
    (p,) = _plans(m, torch.randn(4, D), fullgraph=True)
    assert p.glus == [] and p.linears == [] and p.skipped == []


class Broken(SiluMul):
    def __init__(self, where):
        super().__init__()
        self.where = where

    def forward(self, x):
        g = self.act(self.gate_proj(x))
        if self.where == "act":
            torch._dynamo.graph_break()
        h = g * self.up_proj(x)
        if self.where == "down":
            torch._dynamo.graph_break()
        return self.down_proj(h)


@pytest.mark.parametrize("where", ["act", "down"])
def test_graph_break_inside_glu_is_detected_and_down_kept(where):
    plans = _plans(Broken(where), torch.randn(4, D))
    assert len(plans) == 2
    assert plans[0].graph_breaks and plans[1].graph_breaks == []
    assert all(p.glus == [] for p in plans)
    fp8 = [s.fqn for p in plans for s in p.linears]
    assert sorted(fp8) == ["gate_proj.weight", "up_proj.weight"]
    assert plans[1].skipped[0][0] == "down_proj.weight" and "graph break" in plans[1].skipped[0][1]
