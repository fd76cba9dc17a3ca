"""What issue 33's safeguards cost and what they bound (docs/results/robustness.md).

    python -m tools.robustness [--repeats 7]

Measures, on this machine, one thread:
* the trainer's checkpoint write with its read-back validation (``save_checkpoint``) against the
  same write without it (``save_file``), on the default demo checkpoint (fp8-smooth-fp8adam);
* a crafted checkpoint whose ``exp_avg_scale`` is a 1-element view claiming 2**34 elements (64 GiB as
  fp32): time to refuse it and the peak-RSS growth;
* ``quantize(block=(1, 2**20))`` of a 64x64 tensor (clamped tile): time and peak-RSS growth.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(times), 1)


def main(argv=None) -> dict:
    from fp8pass import quantize
    from fp8pass.checkpoint import save_file
    from fp8pass.train import TrainConfig, train
    from fp8pass.train.checkpoint import CHECKPOINT_NAME, load_checkpoint, save_checkpoint

    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    out = {}
    # first, while this process's peak RSS is still low (ru_maxrss only ever grows)
    x = torch.randn(64, 64)
    before = _peak_mb()
    out["quantize_block_1x2**20_ms"] = _median_ms(
        lambda: quantize(x, "e4m3", granularity="block", block=(1, 2**20)), args.repeats)
    out["quantize_peak_rss_growth_mb"] = round(_peak_mb() - before, 1)
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        train(TrainConfig(recipe="fp8-smooth-fp8adam", steps=1, ckpt_every=1, out=str(run), compiler="aot_eager",
                          eval_batches=1, monitor_every=0, progress=False, max_data_bytes=200_000))
        ck = load_checkpoint(run)
        kw = dict(step=ck["step"], config=ck["config"], model_state=ck["model"], optimizer_state=ck["optimizer"],
                  scaling_state=ck["scaling"], data_fingerprint=ck["data"]["fingerprint"])
        out["checkpoint_bytes"] = (run / CHECKPOINT_NAME).stat().st_size
        out["save_checkpoint_verified_ms"] = _median_ms(lambda: save_checkpoint(run, **kw), args.repeats)
        out["save_file_unverified_ms"] = _median_ms(lambda: save_file(run / "plain.pt", ck), args.repeats)

        crafted = dict(ck)
        opt_state = crafted["optimizer"]["state"]
        key = sorted(opt_state)[1]
        opt_state[key] = dict(opt_state[key], exp_avg_scale=torch.ones(1).expand(2**34))
        save_file(run / CHECKPOINT_NAME, crafted)
        # in a fresh process, so that its peak RSS shows what the refusal costs
        probe = ("import json, resource, time; from fp8pass.train.checkpoint import load_checkpoint\n"
                 "peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024\n"
                 "b, t = peak(), time.perf_counter()\n"
                 "try:\n    load_checkpoint(%r); msg = 'loaded (not refused)'\n"
                 "except Exception as e:\n    msg = str(e).split(': ', 1)[1][:120]\n"
                 "print(json.dumps([msg, round((time.perf_counter() - t) * 1e3, 1), round(peak() - b, 1)]))" % str(run))
        res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
        msg, ms, growth = json.loads(res.stdout.strip().splitlines()[-1])
        out.update(crafted_checkpoint=msg, crafted_refused_ms=ms, crafted_peak_rss_growth_mb=growth)
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
