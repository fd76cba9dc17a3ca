"""Diagnostics: exact alignment/saturation/kurtosis values, planted outliers, HF models, fused layout."""


import pytest
import torch
from torch import nn

from fp8pass.monitor import ActivationAccumulator, diagnose, find_swiglus, swiglu_alignment, weight_alignment
from fp8pass.train.model import ModelConfig, SwiGLUMLP, TinyLlama


def test_weight_alignment_values():
    torch.manual_seed(0)
    w2 = torch.randn(4, 16)
    w1 = torch.stack([3 * w2[0], -0.5 * w2[1], torch.zeros(16), w2[3] + 5.0])
    a = weight_alignment(w1, w2)
    assert a["corr"][0].item() == pytest.approx(1.0, abs=1e-6) and a["corr"][1].item() == pytest.approx(-1.0, abs=1e-6)
    assert a["cos"][2].item() == 0.0 and a["corr"][2].item() == 0.0           # zero row: no direction
    assert a["corr"][3].item() == pytest.approx(1.0, abs=1e-6) and a["cos"][3].item() < 0.9   # corr ignores the offset
    torch.testing.assert_close(a["norm_w1"][0], 3 * w2[0].norm())
    with pytest.raises(ValueError, match="one shape"):
        weight_alignment(w1, w2[:, :8])


def test_accumulator_matches_numpy():
    torch.manual_seed(0)
    acc = ActivationAccumulator(3, threshold=1.0)
    z = torch.tensor([[0.5, -2.0, 1.0], [1.5, 0.1, -1.01], [-3.0, 0.0, 0.2]])
    h = torch.randn(3, 3) ** 3
    acc.update(z[:2], h[:2])
    acc.update(z[2:], h[2:])
    assert acc.saturation.tolist() == pytest.approx([2 / 3, 1 / 3, 1 / 3])    # |z| > 1, strictly
    assert torch.equal(acc.max_abs_h, h.abs().amax(0))
    x = h.double().numpy().ravel()
    ref = ((x - x.mean()) ** 4).mean() / x.var() ** 2
    assert acc.kurtosis == pytest.approx(ref, rel=1e-9)


def test_planted_aligned_channel_is_top_outlier():
    torch.manual_seed(0)
    mlp = SwiGLUMLP(16, 32)
    v = torch.randn(16)
    v /= v.norm()
    with torch.no_grad():
        mlp.gate_proj.weight[7] = 4 * v
        mlp.up_proj.weight[7] = -4 * v                        # aligned, negative sign
    x = torch.randn(64, 16)
    x[:8] += 6 * v                                            # tokens along v excite channel 7
    d = diagnose(mlp, x)
    top = d.top_outliers(1)[0]
    assert top["channel"] == 7 and top["corr"] == pytest.approx(-1.0, abs=1e-6)
    layer = d.layers[0]
    z = x @ mlp.gate_proj.weight.t()
    h = nn.functional.silu(z) * (x @ mlp.up_proj.weight.t())
    assert torch.allclose(layer.max_abs_h, h.abs().amax(0).detach())
    assert layer.saturation[7].item() == pytest.approx((z[:, 7].abs() > 1).float().mean().item())
    assert "top outlier channels" in str(d) and "[7]" in str(d)


def test_tiny_llama_and_hf_llama_agree():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    ours = TinyLlama(ModelConfig(d_model=32, n_layers=2, n_heads=2, ffn=48, max_seq_len=16))
    hc = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
                                  rms_norm_eps=1e-5, tie_word_embeddings=False)
    hf = transformers.LlamaForCausalLM(hc)
    hf.load_state_dict({k if k == "lm_head.weight" else "model." + k: v for k, v in ours.state_dict().items()})
    x = torch.randint(0, 256, (2, 16))
    a, b = diagnose(ours, x), diagnose(hf, {"input_ids": x})
    assert [l.name for l in b.layers] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    for la, lb in zip(a.layers, b.layers):
        assert torch.equal(la.corr, lb.corr)
        torch.testing.assert_close(la.max_abs_h, lb.max_abs_h)
        assert la.kurtosis == pytest.approx(lb.kurtosis, rel=1e-5)


def test_fused_and_meta_layouts():
    torch.manual_seed(0)
    sep = SwiGLUMLP(8, 12)
    fused = SwiGLUMLP(8, 12, fused_gate_up=True)
    with torch.no_grad():
        fused.gate_up_proj.weight.copy_(torch.cat([sep.gate_proj.weight, sep.up_proj.weight]))
        fused.down_proj.weight.copy_(sep.down_proj.weight)

    class Meta(nn.Module):        # Meta's reference naming: w1 gate, w3 up, w2 down
        def __init__(self):
            super().__init__()
            self.w1, self.w3, self.w2 = sep.gate_proj, sep.up_proj, sep.down_proj

        def forward(self, x):
            return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))

    x = torch.randn(10, 8)
    ref = diagnose(sep, x).layers[0]
    for m, layout in ((fused, "fused"), (Meta(), "meta")):
        assert find_swiglus(m)[0].layout == layout
        got = diagnose(m, x).layers[0]
        assert torch.equal(got.corr, ref.corr) and torch.allclose(got.max_abs_h, ref.max_abs_h)


def test_no_swiglu_is_a_clear_error():
    with pytest.raises(ValueError, match="no SwiGLU/GLU MLP found"):
        swiglu_alignment(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="no SwiGLU/GLU MLP found"):
        diagnose(nn.Linear(4, 4), torch.randn(2, 4))
