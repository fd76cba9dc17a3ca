"""Saved-for-backward memory knobs (issue 31): bytes counted by the benchmarks' partitioner hook
(``benchmarks.train_step.record_partitions``) against the exact expected count, and gradients against
the high-precision model's."""

from pathlib import Path

import pytest
import torch

import fp8pass
from benchmarks.train_step import record_partitions
from fp8pass.train import ModelConfig, TinyLlama

LAYERS, BATCH, SEQ, FFN = 2, 2, 32, 96


def _model():
    torch.manual_seed(0)
    return TinyLlama(ModelConfig(vocab_size=64, d_model=64, n_layers=LAYERS, n_heads=2, ffn=FFN, max_seq_len=SEQ))


def _grads(model, fwd, tokens):
    model.zero_grad(set_to_none=True)
    fwd(tokens[:, :-1], tokens[:, 1:]).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _compiled_step(tokens, **options):
    """A fresh model compiled with the fp8 backend (current scaling and ``options``): the partitioned graphs
    it recorded, its gradients, and the loss of a first forward."""
    # Dynamo forgets earlier compiles of TinyLlama.forward: at other shapes (another test in this worker)
    # they make its sizes symbolic, and the saved tensors' shapes no longer read [BATCH, SEQ, d]
    torch._dynamo.reset()
    model = _model()
    cfg = fp8pass.Config(recipe=fp8pass.CurrentScaling(), sr_seed=0, **options)
    records: list = []
    with record_partitions(records):
        fwd = torch.compile(model, backend=fp8pass.backend(cfg))
        loss = fwd(tokens[:, :-1], tokens[:, 1:]).detach()
        grads = _grads(model, fwd, tokens)
    return records, grads, loss


@pytest.fixture
def one_thread():
    """One torch thread: with two, the embedding's compiled scatter-add may sum in another order from
    run to run, and bit-identical gradients could not be asserted."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_recompute_glu_output_saves_its_codes_and_keeps_the_other_gradients(one_thread):
    """Config.recompute_glu_output: the compiled step saves exactly LAYERS x tokens x ffn bytes less
    (each GLU's A codes, 1 byte per element), every gradient but W_down's is bit-identical (forward and
    dgate/dup do not read A), and W_down's stays within the FP8 bound of the fp32 model's (< 0.25
    relative Frobenius error, as the op tests require)."""
    tokens = torch.randint(0, 64, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    ref_model = _model()
    ref = _grads(ref_model, ref_model, tokens)
    saved, grads = {}, {}
    for recompute in (False, True):
        records, grads[recompute], _ = _compiled_step(tokens, recompute_glu_output=recompute)
        assert records, "no partitioned graph recorded"
        saved[recompute] = sum(r["saved_bytes"] for r in records)
    assert saved[False] - saved[True] == LAYERS * BATCH * SEQ * FFN
    for name, g in grads[True].items():
        if "down_proj" in name:
            assert not torch.equal(g, grads[False][name])
            for got in (g, grads[False][name]):
                err = float((got - ref[name]).norm() / ref[name].norm())
                assert 1e-3 < err < 0.25, (name, err)
        else:
            assert torch.equal(g, grads[False][name]), name


def test_recompute_glu_output_is_checked_where_it_is_set():
    """Config, TrainConfig, prepare_model and the train CLI take the knob; a bad value or a recipe
    without FP8 GLUs is a clear error, not silently ignored."""
    import argparse

    from fp8pass.train import TrainConfig, cli
    from fp8pass.train.recipes import get_recipe, prepare_model

    with pytest.raises(ValueError, match="Config.recompute_glu_output must be True or False"):
        fp8pass.Config(recompute_glu_output=1)
    with pytest.raises(ValueError, match="recompute_glu_output applies to the fp8 recipes"):
        TrainConfig(recipe="bf16", recompute_glu_output=True)
    with pytest.raises(ValueError, match="recompute_glu_output must be True or False"):
        TrainConfig(recipe="fp8-smooth-fp8adam", recompute_glu_output="yes")
    with pytest.raises(ValueError, match="apply to the fp8 recipes"):
        prepare_model(_model(), get_recipe("bf16"), backend_options={"recompute_glu_output": True})
    p = argparse.ArgumentParser()
    cli.add_train_parser(p.add_subparsers())
    for flags, expected in (([], False), (["--recompute-glu-output"], True)):
        args = p.parse_args(["train", "--recipe", "fp8-smooth-fp8adam", *flags])
        assert cli._config_from_args(args, "fp8-smooth-fp8adam", Path("/tmp/unused")).recompute_glu_output is expected


def test_save_norm_input_fp8_keeps_codes_and_rstd_instead_of_the_residual_stream(one_thread):
    """Config.save_norm_input_fp8: each of the 2 x LAYERS norms in front of FP8 linears keeps
    x_hat's E4M3 codes (1 byte per element), its scale (4 bytes) and rstd (fp32 per row) instead of
    its fp32 input and Inductor's saved rstd: 3 x tokens x d - 4 bytes less each, counted by the
    partitioner hook; the fp32 [batch, seq, d] inputs saved drop from 2 x LAYERS + 1 to 1 (the final
    norm, in front of the high-precision LM head). Loss as the knob off (the forward is the same math);
    every gradient within the FP8 bound of the fp32 model's (< 0.25 relative Frobenius error)."""
    tokens = torch.randint(0, 64, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    ref_model = _model()
    ref = _grads(ref_model, ref_model, tokens)
    saved, residuals, losses, grads = {}, {}, {}, {}
    d = 64
    for on in (False, True):
        records, grads[on], losses[on] = _compiled_step(tokens, save_norm_input_fp8=on)
        assert len(records) == 1, "one partitioned graph expected"
        saved[on] = records[0]["saved_bytes"]
        residuals[on] = sum(1 for t in records[0]["saved"] if t.endswith(f":float32[{BATCH}, {SEQ}, {d}]"))
    assert saved[False] - saved[True] == 2 * LAYERS * (3 * BATCH * SEQ * d - 4)
    assert residuals == {False: 2 * LAYERS + 1, True: 1}
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-6, atol=0)
    for name, g in grads[True].items():
        err = float((g - ref[name]).norm() / ref[name].norm())
        assert err < 0.25, (name, err)


def test_save_norm_input_fp8_is_checked_where_it_is_set():
    """Config, TrainConfig and the train CLI take the knob; a bad value or a recipe without FP8
    linears is a clear error."""
    import argparse

    from fp8pass.train import TrainConfig, cli

    with pytest.raises(ValueError, match="Config.save_norm_input_fp8 must be True or False"):
        fp8pass.Config(save_norm_input_fp8="on")
    with pytest.raises(ValueError, match="save_norm_input_fp8 applies to the fp8 recipes"):
        TrainConfig(recipe="bf16", save_norm_input_fp8=True)
    with pytest.raises(ValueError, match="save_norm_input_fp8 must be True or False"):
        TrainConfig(recipe="fp8-smooth-fp8adam", save_norm_input_fp8=1)
    assert TrainConfig(recipe="fp8-smooth-fp8adam", save_norm_input_fp8=True).fp8_config().save_norm_input_fp8
    p = argparse.ArgumentParser()
    cli.add_train_parser(p.add_subparsers())
    for flags, expected in (([], False), (["--save-norm-input-fp8"], True)):
        args = p.parse_args(["train", "--recipe", "fp8-smooth-fp8adam", *flags])
        assert cli._config_from_args(args, "fp8-smooth-fp8adam", Path("/tmp/unused")).save_norm_input_fp8 is expected
