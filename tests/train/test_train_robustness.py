"""The trainer under bad luck and bad neighbours (issue 33): an Inf gradient, a non-finite checkpoint,
a crash, planted links, a full disk, SIGTERM / SIGINT, two trainers on one folder."""

import errno
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fp8pass.checkpoint import CheckpointError, DiskFullError
from fp8pass.cli import main
from fp8pass.train import ModelConfig, TrainConfig, train
from fp8pass.train.checkpoint import CHECKPOINT_NAME, load_checkpoint
from fp8pass.train.cli import EXIT_DISK_FULL, EXIT_IN_USE
from fp8pass.train.logging import read_metrics

SMALL = ModelConfig(d_model=32, n_layers=1, n_heads=2, ffn=64, max_seq_len=32)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def corpus(tmp_path):
    (tmp_path / "corpus.txt").write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(400)))
    return str(tmp_path / "corpus.txt")


def cfg(tmp_path, corpus, **kw):
    base = dict(recipe="bf16-fp8adam", steps=4, out=str(tmp_path / "run"), data=corpus, batch_size=2, seq_len=16,
                model=SMALL, eval_every=100, eval_batches=1, ckpt_every=2, monitor_every=0, warmup=1, progress=False)
    base.update(kw)
    return TrainConfig(**base)


def test_an_inf_gradient_at_a_checkpoint_step_is_skipped_not_saved(tmp_path, corpus):
    """Issue 33.1: one +Inf gradient element at a checkpoint step with a finite loss became NaN through
    clipping, the step ran, and the checkpoint held a NaN weight and NaN FP8 moment codes."""
    def poison(step, model):
        if step == 2:
            model.lm_head.weight.grad[0, 0] = float("inf")

    r = train(cfg(tmp_path, corpus), grad_callbacks=[poison])
    assert r.status == "finished" and r.grad_skips == 1
    train_records = read_metrics(tmp_path / "run" / "metrics.jsonl", "train")
    assert [m.get("grad_skipped", 0) for m in train_records] == [0, 1, 0, 0]
    assert train_records[1]["grad_skips_total"] == 1 and not math.isfinite(train_records[1]["grad_norm"])
    ck = load_checkpoint(tmp_path / "run")  # validated: finite weights and moments
    assert ck["grad_skips"] == 1 and all(bool(torch.isfinite(v).all()) for v in ck["model"].values())
    assert read_metrics(tmp_path / "run" / "metrics.jsonl", "end")[-1]["grad_skips"] == 1


def test_a_checkpoint_with_a_nan_weight_is_not_written_and_the_previous_one_stays(tmp_path, corpus):
    def nan_after_step_4(step, model, log, final=False):
        if step == 4:
            with torch.no_grad():
                model.norm.weight[0] = float("nan")  # after the step's loss: the run has not diverged yet

    with pytest.raises(CheckpointError, match=r"checkpoint of step 4 is not written \(model\.norm\.weight: weights "
                                              r"must be finite, got nan.*the previous checkpoint is intact"):
        train(cfg(tmp_path, corpus), callbacks=[nan_after_step_4])
    assert load_checkpoint(tmp_path / "run")["step"] == 2
    assert read_metrics(tmp_path / "run" / "metrics.jsonl", "end")[-1]["status"] == "error: CheckpointError"
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.endswith(".tmp")) == []


def test_a_crash_is_logged_as_an_error_not_finished(tmp_path, corpus):
    def boom(step, model, log, final=False):
        if step == 1:
            raise ZeroDivisionError("boom")

    with pytest.raises(ZeroDivisionError):
        train(cfg(tmp_path, corpus), callbacks=[boom])
    assert read_metrics(tmp_path / "run" / "metrics.jsonl", "end")[-1]["status"] == "error: ZeroDivisionError"


def test_planted_links_in_the_run_folder_are_never_written_through(tmp_path, corpus):
    run = tmp_path / "run"
    run.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("precious")
    names = ["config.json", CHECKPOINT_NAME, CHECKPOINT_NAME + ".tmp", CHECKPOINT_NAME + ".manifest.json",
             CHECKPOINT_NAME + ".manifest.json.tmp", "metrics.jsonl.tmp", "config.json.tmp"]
    for name in names:
        (run / name).symlink_to(victim)
    assert train(cfg(tmp_path, corpus, steps=2)).status == "finished"
    assert victim.read_text() == "precious"
    assert load_checkpoint(run)["step"] == 2 and not (run / "config.json").is_symlink()
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").symlink_to(victim)  # an append through it would add the run's records to victim
    with pytest.raises(CheckpointError, match=r"metrics\.jsonl: is a symbolic link; fp8pass does not write through"):
        train(cfg(tmp_path, corpus, steps=2))
    assert victim.read_text() == "precious"


def test_a_full_disk_exits_with_its_own_code_and_one_line(tmp_path, corpus, monkeypatch, capsys):
    import fp8pass.checkpoint.files as files

    def full(fd, *a, **k):
        os.close(fd)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files.os, "fdopen", full)
    rc = main(["train", "--recipe", "bf16", "--steps", "2", "--out", str(tmp_path / "runs"), "--data", corpus,
               "--batch-size", "2", "--seq-len", "16", "--d-model", "32", "--n-layers", "1", "--n-heads", "2",
               "--ffn", "64", "--monitor-every", "0", "--no-progress", "--no-plots"])
    err = capsys.readouterr().err
    assert rc == EXIT_DISK_FULL, err
    assert err.startswith(f"error: {tmp_path / 'runs' / 'bf16'}") and "no space left on device" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    with pytest.raises(DiskFullError):
        files.atomic_write(tmp_path / "x", lambda f: f.write(b"x"))
    assert not list(tmp_path.glob("**/*.tmp"))


# ---- processes: signals and the lock ---------------------------------------------------------------

def _cli(out: Path, corpus: str, steps: int) -> list[str]:
    return [sys.executable, "-m", "fp8pass", "train", "--recipe", "bf16", "--steps", str(steps), "--out", str(out),
            "--data", corpus, "--batch-size", "2", "--seq-len", "16", "--d-model", "32", "--n-layers", "1",
            "--n-heads", "2", "--ffn", "64", "--ckpt-every", "100000", "--eval-every", "100000",
            "--eval-batches", "1", "--monitor-every", "0", "--no-progress", "--no-plots"]


def _start(out: Path, corpus: str, steps: int = 100000) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(_cli(out, corpus, steps), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=ROOT)


def _wait_for_steps(proc: subprocess.Popen, metrics: Path, n: int) -> None:
    """Until ``metrics`` holds ``n`` train records (a readiness wait, not a timing assertion)."""
    deadline = time.monotonic() + 300
    while len(read_metrics(metrics, "train")) < n:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the trainer made no progress"
        time.sleep(0.2)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_finishes_the_step_writes_a_checkpoint_and_exits_128_plus_n(tmp_path, corpus, sig):
    out = tmp_path / "runs"
    proc = _start(out, corpus)
    _wait_for_steps(proc, out / "bf16" / "metrics.jsonl", 2)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + sig, err
    steps = len(read_metrics(out / "bf16" / "metrics.jsonl", "train"))
    assert f"interrupted by {sig.name} at step {steps}; resume with --resume {out / 'bf16'}" in err
    assert "Traceback" not in err
    assert load_checkpoint(out / "bf16")["step"] == steps  # no step lost (ckpt_every is 100000)
    end = read_metrics(out / "bf16" / "metrics.jsonl", "end")[-1]
    assert end["status"] == "interrupted" and end["signal"] == sig.name and end["step"] == steps


def test_a_second_trainer_on_the_same_folder_is_refused_naming_the_first(tmp_path, corpus):
    out = tmp_path / "runs"
    first = _start(out, corpus)
    _wait_for_steps(first, out / "bf16" / "metrics.jsonl", 1)
    second = subprocess.run(_cli(out, corpus, 2), capture_output=True, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert second.returncode == EXIT_IN_USE, second.stderr
    assert f"is in use by another fp8pass train run (pid {first.pid})" in second.stderr
    assert len(second.stderr.strip().splitlines()) == 1
    first.send_signal(signal.SIGTERM)
    first.communicate(timeout=300)
    assert first.returncode == 128 + signal.SIGTERM
    records = read_metrics(out / "bf16" / "metrics.jsonl", "train")
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))  # the first run's records, all kept
    assert load_checkpoint(out / "bf16")["step"] == len(records)


# ---- a real full disk (root only: mounts a small tmpfs) ----------------------------------------------

@pytest.fixture
def small_tmpfs(tmp_path):
    """A 256 KiB tmpfs under ``tmp_path`` (skipped where this process may not mount)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    folder = tmp_path / "tmpfs"
    folder.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(folder)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    yield folder
    subprocess.run(["umount", str(folder)], check=True)


@pytest.mark.slow
def test_a_really_full_disk(small_tmpfs, corpus):
    from fp8pass.checkpoint import load_file, save_file

    path = small_tmpfs / "x.pt"
    save_file(path, {"w": torch.arange(1000)})
    with pytest.raises(DiskFullError, match=rf"{path}: no space left on device .* is intact"):
        save_file(path, {"w": torch.zeros(200_000)})  # 800 KB on a 256 KiB filesystem
    assert sorted(p.name for p in small_tmpfs.iterdir()) == ["x.pt", "x.pt.manifest.json"]
    assert torch.equal(load_file(path)["w"], torch.arange(1000))
    path.unlink()
    (small_tmpfs / "x.pt.manifest.json").unlink()
    out = small_tmpfs / "runs"  # the trainer's checkpoint (~0.3 MB of weights and moments) does not fit
    r = subprocess.run(_cli(out, corpus, 2), capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert r.returncode == EXIT_DISK_FULL, r.stderr
    assert f"{out / 'bf16' / CHECKPOINT_NAME}: no space left on device" in r.stderr and "Traceback" not in r.stderr
    assert not [p.name for p in (out / "bf16").iterdir() if p.name.endswith(".tmp")]
    assert read_metrics(out / "bf16" / "metrics.jsonl", "end")[-1]["status"] == "error: DiskFullError"
