"""The NVFP4 recipe in the compile backend: rewrite, policy, explain, training, HCP state."""

import pytest
import torch

import fp8pass
from fp8pass import Config, HotChannelPatching, NVFP4Scaling
from fp8pass.passes.nvfp4_policy import block_of, protected_linears
from fp8pass.runtime import hcp_state_for
from fp8pass.testing.models import tiny_titan_llama


def _cfg(**kw):
    hcp = kw.pop("hcp", None)
    compiler = kw.pop("compiler", "aot_eager")
    return Config(recipe=NVFP4Scaling(hcp=hcp, **kw), compiler=compiler)


def _tokens(seed=0, b=2, s=16):
    return torch.randint(0, 128, (b, s), generator=torch.Generator().manual_seed(seed))


def test_policy_blocks_and_fraction():
    assert block_of("layers.7.attention.wq.weight") == ("layers.7", 7)
    assert block_of("model.layers.12.mlp.up_proj.weight") == ("model.layers.12", 12)
    assert block_of("output.weight") is None
    fq = [f"layers.{i}.{n}.weight" for i in range(8) for n in ("q", "k", "up", "down")]
    kept = protected_linears(fq, NVFP4Scaling(protect_post_qk=False))
    assert sorted({block_of(f)[1] for f in kept}) == [4, 5, 6, 7]  # the seed document's last 4 layers
    kept = protected_linears(fq, NVFP4Scaling(keep_last_blocks=None, protect_post_qk=False))
    assert sorted({block_of(f)[1] for f in kept}) == [7]  # 1/8 = 12.5% is closest to 15%
    kept = protected_linears(fq, NVFP4Scaling(keep_last_blocks=3, protect_post_qk=False))
    assert sorted({block_of(f)[1] for f in kept}) == [5, 6, 7]
    assert protected_linears(fq, NVFP4Scaling(keep_last_blocks=0, protect_post_qk=False)) == {}


def test_default_keeps_the_last_four_blocks_and_warns_when_that_is_all():
    rep = fp8pass.explain(tiny_titan_llama(n_layers=6), _tokens(), config=_cfg(protect_post_qk=False))
    assert sorted({block_of(f)[1] for f in rep.linears}) == [0, 1]
    assert "last 4 of 6 blocks" in dict(rep.skipped)["layers.2.feed_forward.w2.weight"]
    with pytest.warns(UserWarning, match="keeps all 4 blocks"):
        rep = fp8pass.explain(tiny_titan_llama(n_layers=4), _tokens(), config=_cfg())
    assert rep.linears == []


def test_explain_reports_nvfp4_and_protected_linears():
    model = tiny_titan_llama(n_layers=4)
    rep = fp8pass.explain(model, _tokens(), config=_cfg(keep_last_blocks=None))
    kept = dict(rep.skipped)
    assert len(rep.linears) == 15 and all(f.endswith((".wq.weight", ".wk.weight", ".w1.weight", ".w2.weight",
                                                      ".w3.weight")) for f in rep.linears)
    assert not any(f.startswith("layers.3.") for f in rep.linears)
    assert "post-QK" in kept["layers.0.attention.wv.weight"] and "post-QK" in kept["layers.2.attention.wo.weight"]
    assert "last 1 of 4 blocks" in kept["layers.3.feed_forward.w2.weight"]
    assert "keep_high_precision" in kept["output.weight"]
    text = str(rep)
    assert "NVFP4 linears" in text and "15 NVFP4 linear weight(s)" in text
    rep = fp8pass.explain(model, _tokens(), config=_cfg(keep_last_blocks=0, protect_post_qk=False))
    assert len(rep.linears) == 28


def test_graph_ops_and_fp8_protection():
    model = tiny_titan_llama(n_layers=2)
    be = fp8pass.backend(_cfg(protected_precision="fp8", keep_last_blocks=1, hcp=HotChannelPatching(),
                              compiler="eager"))
    torch._dynamo.reset()
    torch.compile(model, backend=be)(_tokens())
    code = be.records[0].report.graph_after
    assert code.count("fp8pass.nvfp4_linear") == 5 and code.count("fp8pass.hcp_update_") == 5
    assert code.count("fp8pass.fp8_linear") == 9  # 2 post-QK of block 0 + 7 of the last block


def test_tiny_llama_trains_and_tracks_close_to_bf16():
    losses = {}
    hcp = HotChannelPatching(fraction=0.1, update_interval=2)
    for name, cfg in (("hp", None), ("nvfp4", _cfg(hcp=hcp, keep_last_blocks=0, compiler="eager"))):
        torch.manual_seed(0)
        model = tiny_titan_llama(n_layers=2)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        torch._dynamo.reset()
        step = torch.compile(model, backend=fp8pass.backend(cfg)) if cfg else model
        data = torch.randint(0, 128, (4, 17), generator=torch.Generator().manual_seed(1))
        out = []
        for _ in range(12):
            logits = step(data[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 128), data[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            out.append(loss.item())
        losses[name] = out
        if cfg is not None:
            st = hcp_state_for(model.layers["0"].feed_forward.w1.weight, cfg.recipe.hcp)
            assert int(st.step) == 12 and st.hot.numel() == 3 and st.err.abs().sum() > 0
            assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    hp, q = losses["hp"], losses["nvfp4"]
    assert q[-1] < q[0] - 0.5  # it learns (memorises the batch)
    assert abs(q[-1] - hp[-1]) < 0.25 * hp[0]


def test_hcp_state_saved_with_the_model_state():
    model = tiny_titan_llama(n_layers=2)
    hcp = HotChannelPatching(fraction=0.25)
    torch._dynamo.reset()
    torch.compile(model, backend=fp8pass.backend(_cfg(hcp=hcp, keep_last_blocks=0)))(_tokens())
    sd = fp8pass.scaling_state_dict(model)
    # 10 NVFP4 weights: HCP state (3 tensors) and a stochastic-rounding stream (stochastic gradients) each
    assert len(sd) == 4 * 10 and "layers.0.attention.wq.weight.hcp.hot" in sd and sd["layers.0.attention.wq.weight.hcp.step"] == 1
    assert sum(k.endswith(".sr.stream") for k in sd) == 10
    fresh = tiny_titan_llama(n_layers=2)
    fp8pass.load_scaling_state_dict(fresh, sd, config=_cfg(hcp=hcp, keep_last_blocks=0))
    st = hcp_state_for(fresh.layers["0"].attention.wq.weight, hcp)
    assert torch.equal(st.hot, sd["layers.0.attention.wq.weight.hcp.hot"]) and int(st.step) == 1


def test_bad_recipe_values():
    with pytest.raises(ValueError, match="keep_last_blocks"):
        NVFP4Scaling(keep_last_blocks=-1)
    with pytest.raises(ValueError, match="protected_precision"):
        NVFP4Scaling(protected_precision="fp4")
    with pytest.raises(TypeError, match="HotChannelPatching"):
        NVFP4Scaling(hcp=0.09)


@pytest.mark.slow
def test_inductor_compiles_the_nvfp4_graph():
    model = tiny_titan_llama(n_layers=2)
    torch._dynamo.reset()
    cfg = _cfg(compiler="inductor", hcp=HotChannelPatching(), keep_last_blocks=0)
    out = torch.compile(model, backend=fp8pass.backend(cfg))(_tokens())
    out.float().sum().backward()
    assert torch.isfinite(model.layers["0"].feed_forward.w1.weight.grad).all()
