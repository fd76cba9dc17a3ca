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
    from fp8pass.train import TinyLlama, load_text_data
    from fp8pass.scaling_state import without_scaling_state
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
