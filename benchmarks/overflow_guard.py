"""Delayed scaling after a jump, and the cost of the overflow guard (``DelayedScaling(on_overflow=...)``).

Two measurements, both in one process:

1. **Error after a ×1e4 jump.** Two FP8 linears (64 -> 64 -> 64, ReLU between), four calls at unit
   scale, then the input and the output gradient ×1e4: relative error of the output and of the input
   gradient against fp32 on each call after the jump, with ``on_overflow="saturate"`` (Transformer
   Engine's behaviour) and ``"current"`` (the guard), and the telemetry counts.
2. **Cost on the ``block`` step** (the matmuls of a 7B layer: d_model 2048, ffn 5632, 16 heads,
   2 layers, 1 x 2048 tokens; fp8-smooth, fwd + bwd + AdamW): median step time of each mode, steps
   interleaved A/B so a load change hits both alike; ``--tiny`` uses d_model 256, 4 layers, 8 x 256.

3. ``--overshoot N``: how far past their range a healthy run's delayed-scaled casts go (the
   distribution ``OVERFLOW_FACTOR`` is chosen against): the trainer's fp8-smooth-fp8adam recipe for
   N steps, every record's ``amax * scale / fmt.max`` (observed by wrapping the record's update).

    python -m benchmarks.overflow_guard [--repeat 5] [--tiny] [--overshoot 60] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import fp8pass
from benchmarks.common import baseline_dtype, machine
from fp8pass.monitor import scaling_telemetry
from fp8pass.train import ModelConfig, TinyLlama

MODES = ("saturate", "current")


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def jump_errors(calls_after: int = 4) -> dict:
    """Per mode: [(output error, input-gradient error)] for the calls from the jump on, and the counts."""
    torch.manual_seed(0)
    x, g = torch.randn(32, 64), torch.randn(32, 64)
    out = {}
    for mode in MODES:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
        ref = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
        ref.load_state_dict(model.state_dict())
        cfg = fp8pass.Config(recipe=fp8pass.DelayedScaling(on_overflow=mode), grad_stochastic_rounding=False)
        cm = torch.compile(model, backend=fp8pass.backend(cfg))
        errs = []
        for i in range(4 + calls_after):
            s = 1e4 if i >= 4 else 1.0
            xa, xb = (x * s).requires_grad_(), (x * s).requires_grad_()
            ya, yb = cm(xa), ref(xb)
            ya.backward(g * s)
            yb.backward(g * s)
            if i >= 4:
                errs.append((round(_rel(ya.detach(), yb.detach()), 4), round(_rel(xa.grad, xb.grad), 4)))
        t = scaling_telemetry(model)
        out[mode] = {"errors_from_jump": errs, "overflows": t.nonzero()["overflows"], "skipped": t.total_skipped}
    return out


def guard_cost(tiny: bool, repeat: int) -> dict:
    if tiny:
        cfg, batch, seq = ModelConfig(d_model=256, n_layers=4, n_heads=4, ffn=688, max_seq_len=256), 8, 256
    else:
        cfg, batch, seq = ModelConfig(d_model=2048, n_layers=2, n_heads=16, ffn=5632, max_seq_len=2048), 1, 2048
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    dtype = baseline_dtype("cpu")
    steps = {}
    for mode in MODES:
        torch.manual_seed(0)
        model = TinyLlama(cfg)
        backend = fp8pass.backend(fp8pass.Config(recipe=fp8pass.DelayedScaling(on_overflow=mode)))
        fwd = torch.compile(model, backend=backend)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(fwd=fwd, opt=opt):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                loss = fwd(x, y)
            loss.backward()
            opt.step()

        step()
        step()  # compiled, state bootstrapped: the history is not empty from here on
        steps[mode] = step
    times = {m: [] for m in MODES}
    for _ in range(repeat):
        for mode in MODES:  # interleaved
            t0 = time.perf_counter()
            steps[mode]()
            times[mode].append(time.perf_counter() - t0)
    med = {m: statistics.median(v) for m, v in times.items()}
    return {"shape": "tiny" if tiny else "block", "model": cfg.to_dict(), "batch": batch, "seq": seq,
            "precision": str(dtype).replace("torch.", ""), "repeat": repeat,
            "step_s": {m: [round(t, 4) for t in v] for m, v in times.items()},
            "median_s": {m: round(v, 4) for m, v in med.items()},
            "ratio_current_vs_saturate": round(med["current"] / med["saturate"], 4)}


def overshoot(steps: int) -> dict:
    """Counts of records past 1x/2x/4x/8x/16x of their scale's range, by format, in a healthy run."""
    import fp8pass.runtime.state as runtime_state
    from fp8pass.numerics import get_format
    from fp8pass.train.loop import TrainConfig, train

    seen = []
    update = runtime_state.delayed_scaling_update

    def observed(amax, history, scale, steps_, skipped, overflows, recipe, fmt):
        held = steps_ > skipped
        ratio = amax.float().reshape(scale.shape) * scale.float() / get_format(fmt).max
        seen.extend((fmt, float(r)) for r in ratio[held].reshape(-1))
        return update(amax, history, scale, steps_, skipped, overflows, recipe, fmt)

    runtime_state.delayed_scaling_update = observed
    try:
        train(TrainConfig(recipe="fp8-smooth-fp8adam", steps=steps, out="/tmp/fp8pass_overshoot", progress=False,
                          eval_every=10**6))
    finally:
        runtime_state.delayed_scaling_update = update
    out = {}
    for fmt in sorted({f for f, _ in seen}):
        r = [x for f, x in seen if f == fmt]
        out[fmt] = {"records": len(r), "max": round(max(r), 3),
                    **{f">{k}x": sum(x > k for x in r) for k in (1, 2, 4, 8, 16)}}
    return {"steps": steps, "by_format": out}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--tiny", action="store_true", help="the tiny shape instead of block (quick)")
    p.add_argument("--overshoot", type=int, default=0, metavar="STEPS",
                   help="also measure a healthy run's overshoot distribution over STEPS trainer steps")
    p.add_argument("--json")
    a = p.parse_args(argv)
    res = {"machine": machine(), "jump": jump_errors(), "cost": guard_cost(a.tiny, a.repeat)}
    if a.overshoot:
        res["overshoot"] = overshoot(a.overshoot)
        for fmt, r in res["overshoot"]["by_format"].items():
            print(f"overshoot, {fmt}: {r}")
    for mode, r in res["jump"].items():
        print(f"{mode:>9}: (output, dx) error per call from the x1e4 jump: {r['errors_from_jump']}; "
              f"overflows {r['overflows']}")
    c = res["cost"]
    print(f"{c['shape']} step ({c['precision']}), median of {c['repeat']}: saturate {c['median_s']['saturate']:.3f} s, "
          f"current {c['median_s']['current']:.3f} s, ratio {c['ratio_current_vs_saturate']:.3f}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
