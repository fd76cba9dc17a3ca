"""The GPU benchmarks of benchmarks/gpu_check.sh, one stage per call, ratios measured in one process.

    python benchmarks/gpu_bench.py STAGE --json OUT.json [--smoke]
    python benchmarks/gpu_bench.py merge DIR            # DIR/*.json -> DIR/gpu_check.json + gpu_check.md

Stages (each its own process and timeout in gpu_check.sh, so one hang cannot eat the budget):
    gemm    FP8 linear forward (casts included: current and delayed scaling) / BF16 GEMM, 4096^3 and 8192^3;
            the cast kernels' bandwidth (amax + cast, transpose-cast) / a copy's, same tensor
    mlp     Smooth-SwiGLU MLP fwd+bwd, fp8 (current, delayed) / bf16, 8192 tokens x 4096 -> 11008 -> 4096
    train   the ``block`` training step (d_model 2048, ffn 5632, 16 heads, 2 layers, 1 x 2048 tokens):
            fp8-smooth-fp8adam / bf16 Inductor (torch fused AdamW) / torchao float8 tensorwise, peak memory
    adam    FP8 AdamW step / torch fused AdamW step at 1B parameters (8 tensors of 125M), bytes of state

``--smoke`` runs every stage on tiny shapes on the CPU: it checks the script, not the speed (CI and a
developer without a GPU run it so that the GPU's first run cannot fail on a typo).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fp8pass  # noqa: E402
from benchmarks.common import machine, sync, time_rounds  # noqa: E402
from fp8pass import ops  # noqa: E402

GOALS = {  # measure -> (op, target, what)
    "gemm_8192_delayed_speedup": (">=", 1.7, "BF16 GEMM time / FP8 linear incl. casts, 8192^3, delayed scaling"),
    "cast_amax_bw_fraction": (">=", 0.8, "amax + cast bandwidth / copy bandwidth"),
    "transpose_cast_bw_fraction": (">=", 0.8, "transpose-cast bandwidth / copy bandwidth"),
    "adam_1b_ratio": ("<=", 1.0, "FP8 AdamW step / torch fused AdamW step, 1B params"),
    "train_block_fp8_over_bf16_inductor": ("<=", 0.77, "block step fp8 / bf16 Inductor"),
    "train_block_fp8_over_torchao": ("<=", 1.0, "block step fp8 / torchao float8 tensorwise"),
}


def _median_s(cases: dict, device, repeat: int) -> dict:
    return {k: statistics.median(v) for k, v in time_rounds(cases, device, repeat, warmup=2).items()}


# -- stages -------------------------------------------------------------------------------------------


def stage_gemm(device, smoke: bool) -> dict:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    sizes = (64,) if smoke else (4096, 8192)
    rows, out = [], {}
    for n in sizes:
        x = torch.randn(n, n, device=device, dtype=dtype)
        w = torch.randn(n, n, device=device, dtype=dtype) / n**0.5
        delayed = fp8pass.DelayedScaling()
        with torch.no_grad():
            cases = {"bf16": lambda: F.linear(x, w), "fp8_current": lambda: ops.fp8_linear(x, w),
                     "fp8_delayed": lambda: ops.fp8_linear(x, w, recipe=delayed)}
            t = _median_s(cases, device, 3 if smoke else 20)
        flops = 2 * n**3
        row = {"n": n, **{f"{k}_ms": v * 1e3 for k, v in t.items()},
               "bf16_tflops": flops / t["bf16"] / 1e12,
               "speedup_current": t["bf16"] / t["fp8_current"], "speedup_delayed": t["bf16"] / t["fp8_delayed"]}
        rows.append(row)
        out[f"gemm_{n}_current_speedup"] = row["speedup_current"]
        out[f"gemm_{n}_delayed_speedup"] = row["speedup_delayed"]
    out.update(_cast_bandwidth(device, smoke))
    return {"rows": rows, **out}


def _cast_bandwidth(device, smoke: bool) -> dict:
    """Bytes moved per second by the cast kernels / by a copy of the same tensor (read + write)."""
    from fp8pass.numerics import E4M3
    from fp8pass.numerics.kernels import triton_family
    from fp8pass.runtime.kernels import triton_kernels  # --smoke: in the interpreter (TRITON_INTERPRET=1)

    rows, cols = (256, 256) if smoke else (8192, 8192)
    x = torch.randn(rows, cols, device=device, dtype=torch.bfloat16)
    s = torch.tensor(8.0, device=device)
    cases = {"copy": lambda: x.clone(), "amax_cast": lambda: triton_family.cast_scaled(x, s, E4M3, want_amax=True),
             "transpose_cast": lambda: triton_kernels.transpose_cast(x, s, E4M3)}
    t = _median_s(cases, device, 3 if smoke else 20)
    n = x.numel()
    bw = {"copy": 4 * n / t["copy"], "amax_cast": 3 * n / t["amax_cast"], "transpose_cast": 4 * n / t["transpose_cast"]}
    return {"copy_gbs": bw["copy"] / 1e9, "cast_amax_gbs": bw["amax_cast"] / 1e9,
            "transpose_cast_gbs": bw["transpose_cast"] / 1e9,
            "cast_amax_bw_fraction": bw["amax_cast"] / bw["copy"],
            "transpose_cast_bw_fraction": bw["transpose_cast"] / bw["copy"]}


def stage_mlp(device, smoke: bool) -> dict:
    from benchmarks.linear import mlp_cases

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    t, d, f = (64, 64, 160) if smoke else (8192, 4096, 11008)
    cases, _ = mlp_cases(t, d, f, torch.device(device), dtype)
    times = _median_s(cases, device, 3 if smoke else 10)
    return {"tokens": t, "d": d, "ffn": f, **{f"{k}_ms": v * 1e3 for k, v in times.items()},
            "mlp_fp8_current_over_bf16": times["fp8_current"] / times["baseline"],
            "mlp_fp8_delayed_over_bf16": times["fp8_delayed"] / times["baseline"]}


def _torchao_float8(model):
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        return None
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"),
                               module_filter_fn=lambda mod, name: "lm_head" not in name and "embed" not in name)
    return model


def stage_train(device, smoke: bool) -> dict:
    from fp8pass.train import ModelConfig, TinyLlama
    from fp8pass.train.recipes import build_optimizer, get_recipe, prepare_model

    if smoke:
        cfg, batch, seq = ModelConfig(d_model=64, n_layers=1, n_heads=2, ffn=160, max_seq_len=32), 1, 32
    else:
        cfg, batch, seq = ModelConfig(d_model=2048, n_layers=2, n_heads=16, ffn=5632, max_seq_len=2048), 1, 2048
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0)).to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rows, notes = [], []
    for name in ("bf16 inductor", "fp8-smooth-fp8adam", "torchao float8 tensorwise"):
        torch.manual_seed(0)
        model = TinyLlama(cfg).to(device)
        if name == "fp8-smooth-fp8adam":
            recipe = get_recipe(name)
            fwd = prepare_model(model, recipe)
            opt = build_optimizer(model, recipe, lr=1e-4, weight_decay=0.1)
        else:
            if name.startswith("torchao"):
                if device != "cuda":
                    notes.append("torchao skipped: its float8 path needs CUDA (_scaled_mm)")
                    continue
                if _torchao_float8(model) is None:
                    notes.append("torchao skipped: not installed in this image (its wheel carries compiled CUDA "
                                 "extensions, so it is not committed; carry one in .whl/ to compare)")
                    continue
            fwd = torch.compile(model)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=device == "cuda")

        def step():
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32):
                loss = fwd(x, y)
            loss.backward()
            opt.step()

        for _ in range(2):
            step()  # compile, optimizer state, autotuning
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t = statistics.median(time_rounds({name: step}, device, 3 if smoke else 10, warmup=1)[name])
        row = {"name": name, "step_ms": t * 1e3}
        if device == "cuda":
            row["peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
        rows.append(row)
        del model, opt, fwd
        if device == "cuda":
            torch.cuda.empty_cache()
    by = {r["name"]: r for r in rows}
    out = {"config": cfg.to_dict(), "batch": batch, "seq": seq, "rows": rows, "notes": notes}
    fp8 = by.get("fp8-smooth-fp8adam")
    if fp8 and "bf16 inductor" in by:
        out["train_block_fp8_over_bf16_inductor"] = fp8["step_ms"] / by["bf16 inductor"]["step_ms"]
    if fp8 and "torchao float8 tensorwise" in by:
        out["train_block_fp8_over_torchao"] = fp8["step_ms"] / by["torchao float8 tensorwise"]["step_ms"]
    return out


def stage_adam(device, smoke: bool) -> dict:
    import fp8pass.optim as fo

    per, count = (25_000, 4) if smoke else (125_000_000, 8)
    g = torch.Generator(device).manual_seed(0)
    out = {"params": per * count}
    times = {}
    for name in ("torch fused AdamW", "fp8pass AdamW"):
        params = [torch.nn.Parameter(torch.randn(per, device=device, generator=g)) for _ in range(count)]
        for p in params:
            p.grad = torch.randn(per, device=device, generator=g) * 1e-3
        if name.startswith("torch"):
            opt = torch.optim.AdamW(params, lr=1e-4, fused=device == "cuda", foreach=None if device == "cuda" else True)
        else:
            opt = fo.AdamW(params, lr=1e-4)
        opt.step()  # state, autotuning
        times[name] = statistics.median(time_rounds({name: opt.step}, device, 3 if smoke else 10, warmup=1)[name])
        state = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0)
        out[f"{name} ms"] = times[name] * 1e3
        out[f"{name} state bytes/param"] = state / (per * count)
        del params, opt
        if device == "cuda":
            torch.cuda.empty_cache()
    out["adam_1b_ratio"] = times["fp8pass AdamW"] / times["torch fused AdamW"]
    return out


STAGES = {"gemm": stage_gemm, "mlp": stage_mlp, "train": stage_train, "adam": stage_adam}


# -- merge ----------------------------------------------------------------------------------------------


def merge(folder: Path) -> dict:
    """All stage JSONs of ``folder`` in one JSON and one markdown table (with the goals)."""
    stages = {}
    for f in sorted(folder.glob("stage_*.json")):
        stages[f.stem.removeprefix("stage_")] = json.loads(f.read_text())
    flat = {k: v for s in stages.values() for k, v in s.get("result", {}).items() if isinstance(v, (int, float))}
    smoke = any(s.get("smoke") for s in stages.values())
    lines = (["**--smoke: tiny shapes on the CPU, a check of the script; these numbers mean nothing.**", ""]
             if smoke else [])
    lines += ["| measure | value | goal | met |", "|---|---|---|---|"]
    for key, (op, target, what) in GOALS.items():
        v = flat.get(key)
        met = "" if v is None else ("yes" if (v >= target if op == ">=" else v <= target) else "NO")
        lines.append(f"| {what} | {'not measured' if v is None else f'{v:.3f}'} | {op} {target} | {met} |")
    lines += ["", "| stage | status | seconds |", "|---|---|---|"]
    for name, s in stages.items():
        lines.append(f"| {name} | {s.get('status', '?')} | {s.get('seconds', 0):.0f} |")
    for name, s in stages.items():
        for note in s.get("result", {}).get("notes", []):
            lines.append(f"\n{name}: {note}")
    merged = {"machine": next((s.get("machine") for s in stages.values() if s.get("machine")), None),
              "stages": stages, "goals": {k: flat.get(k) for k in GOALS}}
    (folder / "gpu_check.json").write_text(json.dumps(merged, indent=1))
    (folder / "gpu_check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return merged


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=[*STAGES, "merge"])
    ap.add_argument("folder", nargs="?", help="merge: the folder of stage JSONs")
    ap.add_argument("--json", help="where the stage writes its result")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script only")
    a = ap.parse_args(argv)
    if a.stage == "merge":
        merge(Path(a.folder))
        return 0
    device = "cpu" if a.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_bench.py needs CUDA (or --smoke for the CPU check of the script)")
    t0 = time.perf_counter()
    result = STAGES[a.stage](device, a.smoke)
    sync(device)
    res = {"status": "ok", "seconds": time.perf_counter() - t0, "smoke": a.smoke, "machine": machine(), "result": result}
    print(json.dumps(result, indent=1, default=str))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
