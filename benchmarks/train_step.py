"""One training step of the tiny Llama: fp8pass vs bf16 (eager and Inductor), time and memory.

For each variant, in the same process: median step time (forward + backward + optimizer step), the
bytes autograd saved for backward during one forward (counted with ``saved_tensors_hooks``, so it is
exact and device independent), and the optimizer's state bytes per parameter. On CUDA the peak
allocated memory of a step is reported too.

    python benchmarks/train_step.py [--d-model 256] [--layers 4] [--batch 8] [--seq 256] [--steps 5] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fp8pass  # noqa: E402
from benchmarks.common import baseline_dtype, dtype_name, machine, time_fn  # noqa: E402
from fp8pass.train import ModelConfig, TinyLlama  # noqa: E402
from fp8pass.train.recipes import build_optimizer, get_recipe, prepare_model  # noqa: E402

VARIANTS = (
    ("bf16 eager", "bf16", False),
    ("bf16 inductor", "bf16", True),
    ("fp8-smooth", "fp8-smooth", False),
    ("fp8-smooth-fp8adam", "fp8-smooth-fp8adam", False),
)


def saved_bytes(fn) -> int:
    """Bytes of the tensors autograd saves for backward while ``fn()`` runs (storage counted once)."""
    seen: dict[int, int] = {}

    def pack(t):
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def state_bytes(opt: torch.optim.Optimizer) -> int:
    total = 0
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                total += v.numel() * v.element_size()
    return total


def run(d_model=256, layers=4, batch=8, seq=256, steps=5, device="cpu") -> dict:
    cfg = ModelConfig(d_model=d_model, n_layers=layers, n_heads=max(1, d_model // 64), ffn=int(d_model * 8 / 3) // 16 * 16,
                      max_seq_len=seq)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g).to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    rows = []
    # The "bf16" recipes' high precision: the machine's fast dtype (fp32 on CPUs without native bf16).
    dtype = baseline_dtype(device)
    for name, recipe_name, compile_bf16 in VARIANTS:
        torch.manual_seed(0)
        model = TinyLlama(cfg).to(device)
        recipe = get_recipe(recipe_name)
        fwd = prepare_model(model, recipe, compile_bf16=compile_bf16)
        opt = build_optimizer(model, recipe, lr=1e-3, weight_decay=0.1)

        def loss_fn():
            with torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32):
                return fwd(x, y)

        def step():
            opt.zero_grad(set_to_none=True)
            loss_fn().backward()
            opt.step()

        step()  # compile + optimizer state
        nbytes, loss = saved_bytes(loss_fn)
        loss.backward()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t = time_fn(step, warmup=1, repeat=steps)
        row = {"name": name, "step_ms": t["median"] * 1e3, "spread_ms": (t["max"] - t["min"]) * 1e3,
               "saved_activation_mib": nbytes / 2**20,
               "optimizer_state_bytes_per_param": state_bytes(opt) / model.num_params(),
               "params": model.num_params()}
        if device == "cuda":
            row["peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
        rows.append(row)
    base = {r["name"]: r for r in rows}
    for r in rows:
        r["ratio_step_vs_bf16_eager"] = r["step_ms"] / base["bf16 eager"]["step_ms"]
        r["ratio_step_vs_bf16_inductor"] = r["step_ms"] / base["bf16 inductor"]["step_ms"]
        r["ratio_saved_activations_vs_bf16"] = r["saved_activation_mib"] / base["bf16 eager"]["saved_activation_mib"]
    return {"config": cfg.to_dict(), "batch": batch, "seq": seq, "precision": dtype_name(dtype), "rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json")
    a = p.parse_args(argv)
    res = run(a.d_model, a.layers, a.batch, a.seq, a.steps, a.device)
    res["machine"] = machine()
    print(f"high precision (the bf16 recipes and what fp8 leaves unquantized): {res['precision']}")
    print(f"{'variant':>20} {'step ms':>9} {'/bf16':>6} {'/ind.':>6} {'saved MiB':>10} {'opt B/param':>11}")
    for r in res["rows"]:
        print(f"{r['name']:>20} {r['step_ms']:9.1f} {r['ratio_step_vs_bf16_eager']:6.2f} "
              f"{r['ratio_step_vs_bf16_inductor']:6.2f} {r['saved_activation_mib']:10.2f} "
              f"{r['optimizer_state_bytes_per_param']:11.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
