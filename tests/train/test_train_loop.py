"""Trainer: exact resume, lr schedule, metrics, CLI, plots, errors."""

import json

import pytest
import torch

from fp8pass.cli import main
from fp8pass.train import ModelConfig, TrainConfig, lr_at, train
from fp8pass.train.logging import read_metrics

SMALL = ModelConfig(d_model=32, n_layers=2, n_heads=2, ffn=64, max_seq_len=32)


@pytest.fixture
def corpus(tmp_path):
    torch.manual_seed(0)
    text = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(400))
    (tmp_path / "corpus.txt").write_text(text)
    return str(tmp_path / "corpus.txt")


def cfg(tmp_path, corpus, **kw):
    base = dict(recipe="bf16", steps=6, out=str(tmp_path / "run"), data=corpus, batch_size=4, seq_len=32,
                model=SMALL, eval_every=3, eval_batches=2, ckpt_every=3, monitor_every=3, warmup=2,
                progress=False)
    base.update(kw)
    return TrainConfig(**base)


def test_resume_continues_exactly(tmp_path, corpus):
    full = train(cfg(tmp_path, corpus, out=str(tmp_path / "full")))
    part = train(cfg(tmp_path, corpus, out=str(tmp_path / "part"), steps=3))
    # Disturb the global RNG: resume must restore it, not rely on it.
    torch.manual_seed(1234)
    resumed = train(cfg(tmp_path, corpus, out=str(tmp_path / "part"), steps=6), resume=True)
    assert part.losses + resumed.losses == full.losses
    assert resumed.final_val_loss == full.final_val_loss
    a = torch.load(tmp_path / "full" / "checkpoint.pt", weights_only=True)
    b = torch.load(tmp_path / "part" / "checkpoint.pt", weights_only=True)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    steps = [r["step"] for r in read_metrics(tmp_path / "part" / "metrics.jsonl", "train")]
    assert steps == [1, 2, 3, 4, 5, 6]                  # each step logged once after the resume


def test_metrics_and_monitor_records(tmp_path, corpus):
    train(cfg(tmp_path, corpus))
    path = tmp_path / "run" / "metrics.jsonl"
    lines = [json.loads(l) for l in path.read_text().splitlines()]
    kinds = {l["kind"] for l in lines}
    assert kinds == {"meta", "train", "eval", "monitor", "outlier", "end"}
    mon = [l for l in lines if l["kind"] == "monitor"]
    assert sorted({m["step"] for m in mon}) == [0, 3, 6] and {m["layer"] for m in mon} == {"layers.0.mlp", "layers.1.mlp"}
    assert [l["step"] for l in lines if l["kind"] == "eval"] == [3, 6]


def test_lr_schedule():
    c = TrainConfig(steps=110, warmup=10, lr=1.0, min_lr_ratio=0.1)
    assert lr_at(0, c) == pytest.approx(0.1) and lr_at(9, c) == pytest.approx(1.0)
    assert lr_at(10, c) == pytest.approx(1.0) and lr_at(60, c) == pytest.approx(0.55)
    assert lr_at(110, c) == pytest.approx(0.1)
    lin = TrainConfig(steps=110, warmup=10, lr=1.0, min_lr_ratio=0.0, schedule="linear")
    assert lr_at(60, lin) == pytest.approx(0.5)


def test_divergence_stops_the_run(tmp_path, corpus):
    def poison(step, model, log, final=False):
        if step == 2:
            with torch.no_grad():
                model.lm_head.weight.fill_(float("nan"))
    r = train(cfg(tmp_path, corpus, monitor_every=0), callbacks=[poison])
    assert r.status == "diverged" and r.steps == 3
    end = read_metrics(tmp_path / "run" / "metrics.jsonl", "end")
    assert end[-1]["status"] == "diverged"


def test_result_throughput_is_the_median_step_and_wall_time_is_separate(tmp_path, corpus):
    """The summary's tokens/s is the median of the steps' own rates (a first step that compiles does
    not drag it down), wall_s the whole run, and tokens_per_s all tokens over that wall time."""
    import statistics

    r = train(cfg(tmp_path, corpus, monitor_every=0))
    rates = [m["tokens_per_s"] for m in read_metrics(tmp_path / "run" / "metrics.jsonl", "train")]
    assert len(rates) == 6 and r.step_tokens_per_s == statistics.median(rates)
    wall = read_metrics(tmp_path / "run" / "metrics.jsonl", "end")[-1]["wall_s"]
    assert r.wall_s == wall > 0
    assert r.tokens_per_s == pytest.approx(6 * 4 * 32 / wall)


def test_config_errors():
    with pytest.raises(ValueError, match="unknown recipe 'fp16'"):
        TrainConfig(recipe="fp16")
    with pytest.raises(ValueError, match="unknown schedule"):
        TrainConfig(schedule="step")
    with pytest.raises(ValueError, match="exceeds the model's max_seq_len"):
        TrainConfig(seq_len=512)


@pytest.fixture
def restore_num_threads():
    """`train` sets torch's thread count (--threads) for the whole process: put it back."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_cli_trains_plots_and_resumes(tmp_path, corpus, capsys, restore_num_threads):
    out = tmp_path / "demo"
    args = ["train", "--recipe", "bf16", "--steps", "4", "--out", str(out), "--data", corpus, "--batch-size", "2",
            "--seq-len", "32", "--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--ffn", "64",
            "--eval-every", "2", "--monitor-every", "2", "--ckpt-every", "2", "--no-progress"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "metrics:" in text and "bf16" in text
    pytest.importorskip("matplotlib")
    assert {p.name for p in out.glob("*.png")} == {"loss.png", "max_activation.png", "alignment.png"}
    assert main(["train", "--resume", str(out / "bf16"), "--steps", "6", "--no-progress", "--no-plots"]) == 0
    assert [r["step"] for r in read_metrics(out / "bf16" / "metrics.jsonl", "train")] == [1, 2, 3, 4, 5, 6]
    assert main(["train", "--resume", str(out / "bf16"), "--lr", "1"]) == 2
    assert "only --steps may change" in capsys.readouterr().err
    assert main(["train", "--resume", str(tmp_path / "nothing")]) == 2
    assert "no checkpoint.pt" in capsys.readouterr().err
    assert main(["train", "--recipe", "fp16"]) == 2
    assert "unknown recipe fp16" in capsys.readouterr().err


def test_plots_without_matplotlib(tmp_path, corpus, monkeypatch, capsys):
    import fp8pass.train.plots as plots
    train(cfg(tmp_path, corpus, steps=2, monitor_every=0))
    monkeypatch.setattr(plots, "have_matplotlib", lambda: False)
    import sys
    assert plots.plot_runs(tmp_path, stream=sys.stdout) == []
    assert "matplotlib is not installed" in capsys.readouterr().out


def test_grad_callbacks_run_before_the_step(tmp_path, corpus):
    def zero(step, model):
        for p in model.parameters():
            p.grad.zero_()
    train(cfg(tmp_path, corpus, steps=3, weight_decay=0.0, monitor_every=0), grad_callbacks=[zero])
    torch.manual_seed(0)
    from fp8pass.train import TinyLlama
    init = TinyLlama(SMALL).state_dict()
    final = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["model"]
    assert all(torch.equal(init[k], final[k]) for k in init)       # zero gradients: AdamW leaves weights alone


def test_fp8_moments_resume_exactly(tmp_path, corpus):
    """bf16-fp8adam: FP8 optimizer state (codes + scales) round-trips through the checkpoint."""
    kw = dict(recipe="bf16-fp8adam", monitor_every=0, steps=4, ckpt_every=2)
    full = train(cfg(tmp_path, corpus, out=str(tmp_path / "full"), **kw))
    part = train(cfg(tmp_path, corpus, out=str(tmp_path / "part"), **{**kw, "steps": 2}))
    resumed = train(cfg(tmp_path, corpus, out=str(tmp_path / "part"), **kw), resume=True)
    assert part.losses + resumed.losses == full.losses
    ck = torch.load(tmp_path / "part" / "checkpoint.pt", weights_only=True)
    states = ck["optimizer"]["state"].values()
    assert any(t.dtype in (torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2)
               for s in states for t in s.values() if isinstance(t, torch.Tensor))
    ref = train(cfg(tmp_path, corpus, out=str(tmp_path / "ref"), **{**kw, "recipe": "bf16"}))
    assert ref.losses[:1] == full.losses[:1] and ref.losses[-1] != full.losses[-1]


@pytest.mark.parametrize("native_bf16,expected", [(False, "fp32"), (True, "bf16")])
def test_precision_follows_the_cpu_and_is_recorded(tmp_path, corpus, monkeypatch, native_bf16, expected):
    """The high-precision baseline runs in this CPU's fast dtype (fp32 on AVX2-only CPUs, where bf16
    matmuls are ~100x slower) and the run says which; the resolved value is saved for resume."""
    from fp8pass.kernels import cpu
    from fp8pass.train import TinyLlama, load_text_data

    monkeypatch.delenv("FP8PASS_CPU_GEMM_DTYPE", raising=False)
    monkeypatch.setattr(cpu, "native_bf16", lambda: native_bf16)
    r = train(cfg(tmp_path, corpus, steps=1, monitor_every=0, eval_every=1, ckpt_every=1))
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    meta = read_metrics(tmp_path / "run" / "metrics.jsonl", "meta")[0]
    assert saved["precision"] == meta["precision"] == expected
    assert meta["native_bf16"] is native_bf16 and meta["fast_matmul_dtype"] == {"fp32": "float32", "bf16": "bfloat16"}[expected]
    # The first loss is the model's loss computed in that dtype.
    torch.manual_seed(0)
    model = TinyLlama(SMALL)
    x, y = load_text_data(corpus).batch("train", 4, 32, 0, 0)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=expected == "bf16"):
        assert model(x, y).item() == r.losses[0]
    with pytest.raises(ValueError, match="unknown precision 'fp8'; valid: auto, bf16, fp32, fp16"):
        TrainConfig(precision="fp8")


def test_precision_line_says_why(monkeypatch):
    from fp8pass.kernels import cpu
    from fp8pass.train.recipes import describe_precision

    monkeypatch.setattr(cpu, "native_bf16", lambda: False)
    monkeypatch.delenv("FP8PASS_CPU_GEMM_DTYPE", raising=False)
    line = describe_precision("auto")
    assert line.startswith("high precision fp32 (chosen for this CPU;") and "no native bf16 matmuls" in line
    assert describe_precision("bf16").startswith("high precision bf16 (as asked;")
    monkeypatch.setattr(cpu, "native_bf16", lambda: True)
    monkeypatch.setenv("FP8PASS_CPU_GEMM_DTYPE", "fp32")
    assert describe_precision("auto").startswith("high precision fp32 (forced by FP8PASS_CPU_GEMM_DTYPE=fp32;")


def _weights(path):
    return torch.load(path / "checkpoint.pt", weights_only=True)["model"]


def test_grad_accum_equals_the_full_batch_bf16_recipe(tmp_path, corpus):
    """N=2 micro-batches of 2 = one batch of 4: the same sequences, loss and update up to float order."""
    kw = dict(monitor_every=0, steps=3, precision="fp32", eval_every=3, ckpt_every=3)
    full = train(cfg(tmp_path, corpus, out=str(tmp_path / "full"), batch_size=4, **kw))
    acc = train(cfg(tmp_path, corpus, out=str(tmp_path / "acc"), batch_size=2, grad_accum=2, **kw))
    assert acc.losses == pytest.approx(full.losses, rel=1e-5, abs=0)
    assert acc.losses != train(cfg(tmp_path, corpus, out=str(tmp_path / "half"), batch_size=2, **kw)).losses
    a, b = _weights(tmp_path / "full"), _weights(tmp_path / "acc")
    assert all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6) for k in a)
    rec = read_metrics(tmp_path / "acc" / "metrics.jsonl", "train")
    assert len(rec) == 3                                   # one record per optimizer step
    with pytest.raises(ValueError, match="grad_accum must be an int >= 1"):
        TrainConfig(grad_accum=1.5)
    with pytest.raises(ValueError, match="grad_accum must be >= 1"):
        TrainConfig(grad_accum=0)


def test_grad_accum_fp8_delayed_records_once_per_optimizer_step(tmp_path, corpus):
    """fp8-smooth (delayed scaling): N=2 of half the batch matches N=1 within FP8 noise, and the
    scales are updated once per optimizer step (the max over the micro-batches: as many records per
    role as the full-batch run; exact amaxes in tests/numerics/test_scaling.py)."""
    torch._dynamo.reset()
    kw = dict(recipe="fp8-smooth", monitor_every=0, steps=2, precision="fp32", compiler="aot_eager",
              eval_every=2, ckpt_every=2)
    full = train(cfg(tmp_path, corpus, out=str(tmp_path / "full"), batch_size=4, **kw))
    torch._dynamo.reset()
    acc = train(cfg(tmp_path, corpus, out=str(tmp_path / "acc"), batch_size=2, grad_accum=2, **kw))
    assert acc.losses == pytest.approx(full.losses, rel=2e-2)
    sd = torch.load(tmp_path / "acc" / "checkpoint.pt", weights_only=True)["scaling"]
    steps_full = torch.load(tmp_path / "full" / "checkpoint.pt", weights_only=True)["scaling"]
    # (Smooth-SwiGLU's down-projection weight is cast with its current scale: no records in either run)
    counts = {k: int(v) for k, v in sd.items() if k.endswith(".steps") and int(v)}
    counts_full = {k: int(v) for k, v in steps_full.items() if k.endswith(".steps") and int(v)}
    assert counts and counts == counts_full


def test_loss_scaling_skips_and_recovers_fp16(tmp_path, corpus):
    """fp16 compute, a loss scale far too large: every gradient overflows. Static: every step is
    skipped (counted) and the weights stay as initialised; dynamic: the scale backs off until the
    gradients fit, then the run trains."""
    kw = dict(monitor_every=0, steps=4, precision="fp16", eval_every=4, ckpt_every=4, grad_clip=0.0)
    torch.manual_seed(0)
    from fp8pass.train import TinyLlama
    init = TinyLlama(SMALL).state_dict()
    static = train(cfg(tmp_path, corpus, out=str(tmp_path / "static"), loss_scale=2.0 ** 40, **kw))
    rec = read_metrics(tmp_path / "static" / "metrics.jsonl", "train")
    assert [r["skipped"] for r in rec] == [1, 1, 1, 1] and rec[-1]["skipped_total"] == 4
    assert static.status == "finished"
    w = _weights(tmp_path / "static")
    assert all(torch.equal(init[k], w[k]) for k in init)      # nothing applied, nothing poisoned
    dyn = train(cfg(tmp_path, corpus, out=str(tmp_path / "dyn"), loss_scale="dynamic:1e9", steps=30,
                    **{k: v for k, v in kw.items() if k != "steps"}))
    rec = read_metrics(tmp_path / "dyn" / "metrics.jsonl", "train")
    skipped = [r["skipped"] for r in rec]
    k = skipped.index(0)
    assert k >= 1 and skipped[:k] == [1] * k and rec[-1]["skipped_total"] == sum(skipped)
    assert sum(skipped[k:]) <= (30 - k) // 4           # at the edge of fp16's range, an odd later back-off
    assert rec[k]["loss_scale"] == 1e9 * 0.5 ** k
    assert dyn.status == "finished" and dyn.losses[-1] < dyn.losses[0]
    w = _weights(tmp_path / "dyn")
    assert any(not torch.equal(init[n], w[n]) for n in init)


def test_loss_scale_errors(tmp_path, corpus):
    from fp8pass.train.loss_scale import LossScaler
    for bad in ("sometimes", -1.0, 0, float("inf"), True, "dynamic:0", "dynamic:x"):
        with pytest.raises(ValueError, match="loss_scale must be"):
            TrainConfig(loss_scale=bad)
    assert TrainConfig(loss_scale="1024").loss_scale == 1024.0
    assert LossScaler("dynamic:8").scale_value == 8.0 and LossScaler("dynamic").scale_value == 2.0 ** 16
    with pytest.raises(ValueError, match="needs 'dynamic' or a static scale"):
        LossScaler(None)
    scaler = LossScaler("dynamic", growth_interval=4)
    for bad, match in (({"scale": 0.0, "clean_steps": 0, "skipped": 0}, "scale must be"),
                       ({"scale": 2.0, "clean_steps": -1, "skipped": 0}, "clean_steps must be"),
                       ({"scale": 2.0, "clean_steps": 4, "skipped": 0}, "would already have grown"),
                       ({"scale": 2.0, "skipped": 0}, "expected the keys")):
        with pytest.raises(ValueError, match=match):
            scaler.load_state_dict(bad)
    with pytest.raises(ValueError, match="differs from this run's"):
        LossScaler(8.0).load_state_dict({"scale": 4.0, "clean_steps": 0, "skipped": 0})


def test_dynamic_loss_scaling_resumes_exactly(tmp_path, corpus):
    """The scaler's state (scale, clean steps, skips) travels in the checkpoint: 3 + 3 resumed steps
    log the same losses and loss scales as 6 steps in one go; a checkpoint without it is refused."""
    kw = dict(monitor_every=0, precision="fp16", eval_every=3, ckpt_every=3, grad_clip=0.0,
              loss_scale="dynamic:1e9")
    full = train(cfg(tmp_path, corpus, out=str(tmp_path / "full"), **kw))
    train(cfg(tmp_path, corpus, out=str(tmp_path / "part"), steps=3, **kw))
    torch.manual_seed(1234)
    resumed = train(cfg(tmp_path, corpus, out=str(tmp_path / "part"), **kw), resume=True)
    a = read_metrics(tmp_path / "full" / "metrics.jsonl", "train")
    b = read_metrics(tmp_path / "part" / "metrics.jsonl", "train")
    assert [(r["loss_scale"], r["skipped_total"]) for r in a] == [(r["loss_scale"], r["skipped_total"]) for r in b]
    assert a[0]["skipped"] == 1 and a[-1]["loss_scale"] < 1e9   # the run did back off before the checkpoint
    assert full.losses[3:] == resumed.losses
    # a checkpoint written without the scaler's state (older runs) cannot resume a dynamic scale exactly
    from fp8pass.checkpoint import save_file
    ck = torch.load(tmp_path / "part" / "checkpoint.pt", weights_only=True)
    del ck["loss_scaler"]
    save_file(tmp_path / "part" / "checkpoint.pt", ck)
    with pytest.raises(ValueError, match="dynamic loss scaling cannot be resumed"):
        train(cfg(tmp_path, corpus, out=str(tmp_path / "part"), steps=9, **kw), resume=True)


def test_fp8_ramp_up_starts_fp8_at_the_given_step_and_resumes(tmp_path, corpus):
    """fp8_start_step=2: steps 1-2 are the bf16 recipe's exactly; FP8 casts record from step 3 on; a
    run stopped before the switch resumes into the same losses."""
    kw = dict(monitor_every=0, precision="fp32", compiler="aot_eager", eval_every=10, ckpt_every=1)
    ref = train(cfg(tmp_path, corpus, out=str(tmp_path / "ref"), steps=2, **kw))
    torch._dynamo.reset()
    ramp = dict(recipe="fp8-smooth", fp8_start_step=2, **kw)
    full = train(cfg(tmp_path, corpus, out=str(tmp_path / "full"), steps=3, **ramp))
    assert full.losses[:2] == ref.losses and full.losses[2] != ref.losses[-1]
    assert [r["step"] for r in read_metrics(tmp_path / "full" / "metrics.jsonl", "fp8_start")] == [2]
    sd = torch.load(tmp_path / "full" / "checkpoint.pt", weights_only=True)["scaling"]
    grad_steps = [int(v) for k, v in sd.items() if k.endswith("grad_output.steps")]
    assert grad_steps and set(grad_steps) == {1}                 # one FP8 backward: step 3
    torch._dynamo.reset()
    train(cfg(tmp_path, corpus, out=str(tmp_path / "part"), steps=1, **ramp))
    torch._dynamo.reset()
    resumed = train(cfg(tmp_path, corpus, out=str(tmp_path / "part"), steps=3, **ramp), resume=True)
    assert full.losses[1:] == resumed.losses
    with pytest.raises(ValueError, match="fp8_start_step applies to the fp8 recipes"):
        TrainConfig(fp8_start_step=3)
    with pytest.raises(ValueError, match="fp8_start_step must be an int >= 0"):
        TrainConfig(recipe="fp8", fp8_start_step=-1)


def test_eta_leaves_out_the_steps_that_compiled(monkeypatch):
    """Issue 34: after a 170 s first FP8 step the ETA read 20000 s; it now extrapolates the later steps."""
    import io

    from fp8pass.train import logging as train_logging

    clock = iter([0.0, 170.0, 171.0, 172.0])  # start, step 1 (compiled), steps 2-3: 1 s each
    monkeypatch.setattr(train_logging.time, "perf_counter", lambda: next(clock))
    stream = io.StringIO()
    bar = train_logging.ProgressBar(10, "fp8", stream=stream)
    bar.restart_eta(1)   # step 1 compiled: the loop restarts the rate before showing it
    bar.update(1)
    bar.update(3)        # 2 steps in 2 s since: 7 steps left, 7 s
    lines = stream.getvalue().splitlines()
    assert lines[0].endswith("1/10  eta    ?") and lines[1].endswith("3/10  eta    7s")


def test_the_demo_says_it_compiles_and_that_cpu_fp8_is_emulated(tmp_path, corpus, capsys, restore_num_threads):
    from fp8pass.train.cli import CPU_FP8_NOTE
    from fp8pass.train.loop import COMPILE_NOTE

    torch._dynamo.reset()
    args = ["train", "--recipe", "fp8", "--steps", "2", "--out", str(tmp_path / "demo"), "--data", corpus,
            "--batch-size", "2", "--seq-len", "32", "--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--ffn",
            "64", "--eval-every", "2", "--monitor-every", "0", "--compiler", "aot_eager", "--no-plots"]
    assert main(args) == 0
    captured = capsys.readouterr()
    err = captured.err.splitlines()
    assert COMPILE_NOTE == "compiling the FP8 graphs: first step, ~1-3 min on a CPU (the ETA leaves it out)"
    first_bar = next(i for i, line in enumerate(err) if "1/2" in line)
    assert COMPILE_NOTE in err[:first_bar] and err[first_bar].endswith("eta    ?")
    assert CPU_FP8_NOTE in captured.out and "FP8 on a CPU is emulated" in CPU_FP8_NOTE
