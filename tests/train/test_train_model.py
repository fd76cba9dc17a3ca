"""TinyLlama: equal to HF Llama with the same weights, fused gate/up equivalent, causal."""

import pytest
import torch

from fp8pass.train.model import ModelConfig, TinyLlama

CFG = ModelConfig(d_model=64, n_layers=2, n_heads=4, ffn=96, max_seq_len=32)


def test_matches_hf_llama_bit_exactly():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    ours = TinyLlama(CFG).eval()
    hc = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32,
                                  rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    hf = transformers.LlamaForCausalLM(hc).eval()
    sd = {k if k == "lm_head.weight" else "model." + k: v for k, v in ours.state_dict().items()}
    hf.load_state_dict(sd, strict=True)
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        assert torch.equal(ours(x), hf(x).logits)


def test_fused_gate_up_equals_separate():
    torch.manual_seed(0)
    sep = TinyLlama(CFG)
    fused = TinyLlama(ModelConfig(**{**CFG.to_dict(), "fused_gate_up": True}))
    sd = sep.state_dict()
    for i in range(CFG.n_layers):
        p = f"layers.{i}.mlp."
        sd[p + "gate_up_proj.weight"] = torch.cat([sd.pop(p + "gate_proj.weight"), sd.pop(p + "up_proj.weight")])
    fused.load_state_dict(sd, strict=True)
    x = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(fused(x), sep(x), rtol=0, atol=1e-6)


def test_causal_and_loss():
    torch.manual_seed(0)
    m = TinyLlama(CFG)
    x = torch.randint(0, 256, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % 256
    a, b = m(x), m(y)
    assert torch.equal(a[0, :10], b[0, :10]) and not torch.equal(a[0, 10:], b[0, 10:])
    loss = m(x[:, :-1], x[:, 1:])
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.1   # near-uniform at init


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="heads of even size"):
        ModelConfig(d_model=60, n_heads=8)
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        TinyLlama(CFG)(torch.zeros(1, 33, dtype=torch.long))
