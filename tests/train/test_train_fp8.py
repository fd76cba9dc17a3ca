"""fp8 recipes through the trainer: they run, differ from bf16, and resume exactly (scaling state, SR RNG)."""

import warnings

import pytest
import torch

from fp8pass.train import ModelConfig, TrainConfig, train

SMALL = ModelConfig(d_model=32, n_layers=1, n_heads=2, ffn=64, max_seq_len=32)


@pytest.fixture
def corpus(tmp_path):
    (tmp_path / "c.txt").write_text("".join(f"x{i} = {i} * y + {i % 5}\n" for i in range(300)))
    return str(tmp_path / "c.txt")


def cfg(tmp_path, corpus, name, **kw):
    base = dict(recipe="fp8-smooth", steps=4, out=str(tmp_path / name), data=corpus, batch_size=2, seq_len=32,
                model=SMALL, eval_every=2, eval_batches=1, ckpt_every=2, monitor_every=0, warmup=1,
                progress=False, compiler="aot_eager")
    base.update(kw)
    return TrainConfig(**base)



def test_a_resume_is_bit_identical_when_the_full_run_did_not_evaluate_at_the_checkpoint(tmp_path, corpus):
    """A run evaluates at its last step; the uninterrupted run here does not evaluate at step 2. The
    evaluation's forward (training mode) records amaxes, so it must leave the delayed-scaling state as it was:
    it did not, and step 3 after the resume trained on other scales (~1e-5 off in the loss)."""
    warnings.simplefilter("ignore")
    kw = dict(recipe="fp8", precision="fp32", eval_every=4, schedule="constant")
    full = train(cfg(tmp_path, corpus, "full", **kw))
    torch._dynamo.reset()
    part = train(cfg(tmp_path, corpus, "part", steps=2, **kw))  # evaluates at step 2, its last
    torch._dynamo.reset()
    resumed = train(cfg(tmp_path, corpus, "part", **kw), resume=True)
    assert part.losses + resumed.losses == full.losses
    a, b = (torch.load(tmp_path / n / "checkpoint.pt", weights_only=True) for n in ("full", "part"))
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])  # weights and FP8 scaling state

@pytest.mark.slow
def test_fp8_smooth_resumes_exactly(tmp_path, corpus):
    warnings.simplefilter("ignore")
    full = train(cfg(tmp_path, corpus, "full"))
    torch._dynamo.reset()
    part = train(cfg(tmp_path, corpus, "part", steps=2))
    torch._dynamo.reset()
    torch.manual_seed(99)
    resumed = train(cfg(tmp_path, corpus, "part"), resume=True)
    assert part.losses + resumed.losses == full.losses
    ck = torch.load(tmp_path / "part" / "checkpoint.pt", weights_only=True)
    assert any(k.endswith("weight.amax_history") for k in ck["scaling"])
    bf = train(cfg(tmp_path, corpus, "bf16", recipe="bf16"))
    assert bf.losses[0] != full.losses[0]           # the fp8 path really quantizes
    assert abs(bf.losses[-1] - full.losses[-1]) < 0.05 * bf.losses[-1]


def test_recompile_limit_raises_instead_of_training_without_fp8(tmp_path, corpus, monkeypatch):
    """Past Dynamo's recompile limit the model would silently run eagerly (bf16): the trainer raises."""
    warnings.simplefilter("ignore")
    torch._dynamo.reset()
    monkeypatch.setenv("FP8PASS_CPU_FUSED", "0")  # keep the runtime's compiled casts out of the low limit
    # config.patch restores the setting on exit; monkeypatch.setattr's undo deletes it on pytest >= 9.2
    with torch._dynamo.config.patch(recompile_limit=2):
        train(cfg(tmp_path, corpus, "first", steps=1, eval_every=5, ckpt_every=5))  # train + eval: both entries
        with pytest.raises(RuntimeError, match="recompile limit.*fresh process"):
            train(cfg(tmp_path, corpus, "second", steps=1, eval_every=5, ckpt_every=5))
    torch._dynamo.reset()


def test_compiled_identity_pipeline_tracks_eager_across_optimizer_steps(tmp_path, corpus):
    """With quantization off, the backend's model must compute eager fp32's loss and gradients at
    every step while the optimizer moves the weights: no stale weight copy, cached cast or
    smoothing scale from an earlier step."""
    import fp8pass
    from fp8pass.checkpoint import without_scaling_state
    from fp8pass.train import TinyLlama, load_text_data
    from fp8pass.train.recipes import param_groups

    warnings.simplefilter("ignore")
    torch._dynamo.reset()
    data = load_text_data(corpus)
    torch.manual_seed(0)
    model, ref = TinyLlama(SMALL), TinyLlama(SMALL)
    fwd = torch.compile(model, backend=fp8pass.backend(fp8pass.Config(
        fwd_format="identity", bwd_format="identity", compiler="aot_eager", min_dim=1, dim_multiple=1)))
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2)
    for step in range(6):
        ref.load_state_dict(without_scaling_state(model.state_dict()))  # the eager reference keeps no scaling state
        x, y = data.batch("train", 2, 32, 0, step)
        loss = fwd(x, y)
        loss.backward()
        ref_loss = ref(x, y)
        ref_loss.backward()
        assert abs(loss.item() - ref_loss.item()) <= 1e-5 * ref_loss.item()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            err = (p.grad - q.grad).norm() / q.grad.norm().clamp_min(1e-12)
            assert err < 1e-4, (step, name, err.item())
        opt.step()
        opt.zero_grad()
        ref.zero_grad()
    report = fp8pass.scaling_state_dict(model)
    assert report  # the backend really rewrote the linears (state exists for them)
    torch._dynamo.reset()


# -- the FP8 optimizer's options through TrainConfig, build_optimizer, the CLI and the checkpoint --

def test_every_moment_option_reaches_the_fp8_optimizer(tmp_path, corpus):
    from fp8pass.train import TinyLlama
    from fp8pass.train.recipes import build_optimizer, get_recipe

    c = cfg(tmp_path, corpus, "x", recipe="bf16-fp8adam", m_format="e5m2", v_format="e4m3", v_sqrt=False,
            moment_block_size=None, moment_rounding="stochastic", moment_stochastic_flush=True)
    opt = build_optimizer(TinyLlama(SMALL), get_recipe(c.recipe), lr=c.lr, weight_decay=c.weight_decay,
                          m_format=c.m_format, v_format=c.v_format, block_size=c.moment_block_size,
                          v_sqrt=c.v_sqrt, rounding=c.moment_rounding, stochastic_flush=c.moment_stochastic_flush)
    for g in opt.param_groups:
        assert (g["m_format"], g["v_format"], g["v_sqrt"], g["block_size"], g["rounding"], g["stochastic_flush"]) == \
            ("e5m2", "e4m3", False, None, "stochastic", True)
    # the defaults are the optimizer's own
    import fp8pass.optim as fo
    d, o = TrainConfig(), fo.AdamW([torch.nn.Parameter(torch.zeros(1))]).defaults
    assert (d.m_format, d.v_format, d.v_sqrt, d.moment_block_size, d.moment_rounding, d.moment_stochastic_flush) == \
        (o["m_format"], o["v_format"], o["v_sqrt"], o["block_size"], o["rounding"], o["stochastic_flush"])


def test_moment_option_errors_and_configs_saved_before_the_fields_existed():
    for kw, msg in ((dict(m_format="int8"), "unknown m_format 'int8'; valid: e4m3, e5m2, bf16, fp32"),
                    (dict(v_format="e3m4"), "unknown v_format"),
                    (dict(moment_block_size=0), "moment_block_size must be a positive int .* or None"),
                    (dict(moment_block_size="tensor"), "moment_block_size must be"),
                    (dict(v_sqrt="no"), "v_sqrt must be True or False"),
                    (dict(moment_stochastic_flush=1), "moment_stochastic_flush must be True or False"),
                    (dict(moment_rounding="up"), "unknown moment_rounding 'up'")):
        with pytest.raises(ValueError, match=msg):
            TrainConfig(**kw)
    # a config saved before the field was named moment_block_size resumes with its block size
    old = {k: v for k, v in TrainConfig().to_dict().items() if k != "moment_block_size"}
    old.pop("v_sqrt")
    legacy = TrainConfig.from_dict({**old, "block_size": 64})
    assert (legacy.moment_block_size, legacy.v_sqrt) == (64, True)  # sqrt(v): the optimizer's default then


def test_paper_form_moments_round_trip_through_the_checkpoint(tmp_path, corpus):
    """m E5M2 / v E5M2 stored directly with one scale per tensor, stochastic rounding and flush: the
    resumed run continues exactly (codes, per-tensor scales and the rounding RNG)."""
    kw = dict(recipe="bf16-fp8adam", m_format="e5m2", v_format="e5m2", v_sqrt=False, moment_block_size=None,
              moment_rounding="stochastic", moment_stochastic_flush=True)
    full = train(cfg(tmp_path, corpus, "full", **kw))
    part = train(cfg(tmp_path, corpus, "part", steps=2, **kw))
    torch.manual_seed(99)
    resumed = train(cfg(tmp_path, corpus, "part", **kw), resume=True)
    assert part.losses + resumed.losses == full.losses
    ck = torch.load(tmp_path / "part" / "checkpoint.pt", weights_only=True)
    assert ck["config"]["moment_block_size"] is None and ck["config"]["v_sqrt"] is False
    for g in ck["optimizer"]["param_groups"]:
        assert g["block_size"] is None and g["v_sqrt"] is False and g["stochastic_flush"] is True
    for st in ck["optimizer"]["state"].values():
        assert st["exp_avg_codes"].dtype == st["exp_avg_sq_codes"].dtype == torch.float8_e5m2
        assert st["exp_avg_scale"].shape == st["exp_avg_sq_scale"].shape == (1,)
    other = train(cfg(tmp_path, corpus, "block", **{**kw, "moment_block_size": 128}))
    assert other.losses[-1] != full.losses[-1]  # per tensor is not the block-128 optimizer


def test_optimizer_flags_of_the_cli(tmp_path, corpus, capsys):
    from fp8pass.cli import main

    n = torch.get_num_threads()
    out = tmp_path / "cli"
    base = ["train", "--recipe", "bf16-fp8adam", "--steps", "2", "--out", str(out), "--data", corpus,
            "--batch-size", "2", "--seq-len", "32", "--d-model", "32", "--n-layers", "1", "--n-heads", "2",
            "--ffn", "64", "--eval-every", "2", "--monitor-every", "0", "--no-progress", "--no-plots"]
    try:
        assert main(base + ["--m-format", "e5m2", "--v-format", "e4m3", "--no-v-sqrt", "--moment-block-size",
                            "tensor", "--moment-rounding", "stochastic", "--moment-stochastic-flush"]) == 0
        import json
        saved = json.loads((out / "bf16-fp8adam" / "config.json").read_text())
        assert {k: saved[k] for k in ("m_format", "v_format", "v_sqrt", "moment_block_size", "moment_rounding",
                                      "moment_stochastic_flush")} == {
            "m_format": "e5m2", "v_format": "e4m3", "v_sqrt": False, "moment_block_size": None,
            "moment_rounding": "stochastic", "moment_stochastic_flush": True}
        assert main(["train", "--resume", str(out / "bf16-fp8adam"), "--v-sqrt"]) == 2
        assert "only --steps may change (got --v-sqrt)" in capsys.readouterr().err
        assert main(base + ["--moment-block-size", "0"]) == 2
        assert "moment_block_size must be a positive int" in capsys.readouterr().err
        with pytest.raises(SystemExit):
            main(base + ["--moment-block-size", "per-tensor"])
        assert "expected a positive integer or 'tensor', got 'per-tensor'" in capsys.readouterr().err
    finally:
        torch.set_num_threads(n)
