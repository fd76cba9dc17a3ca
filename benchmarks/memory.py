"""Training memory per variant (issue 31): model state per parameter, saved for backward, peak of a step.

The model, shapes and steps are ``benchmarks/train_step.py``'s (``tiny``; ``block`` = d_model 2048,
ffn 5632, 2 layers, 1 x 2048 tokens: the matmuls of a 7B layer). For each variant, in one process:

* model state: parameters + gradients + every optimizer state tensor, in MiB and in bytes per
  parameter (torch AdamW over fp32 parameters: 4 + 4 + 8 = 16);
* saved for backward: what the AOT-partitioned backward graphs take from their forward, counted by
  ``train_step.record_partitions`` (the partitioner hook; not tangents, not parameters or tokens or
  views of them); the ``saved_tensors_hooks`` count of the same forward beside it as a check;
* their sum;
* peak of a whole step (zero_grad, forward, backward, optimizer step). CUDA: ``max_memory_allocated``
  over the step. CPU: the allocations and frees the profiler records (``profile_memory=True``; every
  tensor of ATen and of Inductor's generated code comes from the CPU allocator it reports) over two
  steps, the first starting with no gradients; peak = the bytes resident when profiling began
  (parameters, buffers, optimizer state: what the model holds between steps) + the highest running
  sum of the records during the second step. The profiler does not see frees of blocks allocated
  before it started, so a free of one of those (none expected: those are the resident tensors) would
  make the CPU figure an upper bound. Memory outside the allocator (oneDNN scratch, code) is not in it.
  On CPU the ops around the peak's allocation are printed too (where in the step the peak is);
* on the device between steps, by the offload's own accounting (``fp8pass.optim.offload.device_state_nbytes``;
  ``offload_saved_activations``' counts over one step): optimizer state, and saved for backward (the
  hooks' bytes, or what the offload kept there); on the CPU "host" is the same memory, so there these
  are bookkeeping, and the CPU peak includes the host copies;
* median step time, interleaved round by round with the other variants, and its ratio to the
  baseline and to ``fp8-smooth-fp8adam`` (the median of the per-round ratios, and their range): what
  each memory choice costs in time, in the same run. ``--precision bf16`` runs every variant under
  bf16 autocast, so that on an AVX2-only CPU (where ``auto`` is fp32) the bf16-weight variants are
  compared at the activation dtype they run in; the FP8 GEMMs keep their own dtype.

Ratios are against ``bf16 inductor`` (the ``bf16`` recipe compiled by Inductor + torch AdamW), with
issue 31's goals at ``block``: saved <= 0.35, model state + saved <= 0.45, peak <= 0.55.

    python -m benchmarks.memory [--shape tiny|block|all] [--variants ...] [--steps 3] [--threads 1]
                                [--precision auto|bf16|fp32] [--json FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
from pathlib import Path

import torch

from benchmarks.common import baseline_dtype, dtype_name, listed, machine, time_rounds
from benchmarks.train_step import SHAPES, build, record_partitions, saved_bytes, state_bytes
from fp8pass.optim.offload import device_state_nbytes

VARIANTS = {  # name -> (recipe, compile the bf16 recipe with Inductor, backend Config overrides[, trainer options])
    "bf16 inductor": ("bf16", True, {}),
    "fp8-smooth-fp8adam": ("fp8-smooth-fp8adam", False, {}),
    "fp8 + recompute_glu_output": ("fp8-smooth-fp8adam", False, {"recompute_glu_output": True}),
    "fp8 + save_norm_input_fp8": ("fp8-smooth-fp8adam", False, {"save_norm_input_fp8": True}),
    "fp8 + recompute_glu + norm_fp8": ("fp8-smooth-fp8adam", False, {"recompute_glu_output": True,
                                                                   "save_norm_input_fp8": True}),
    "fp8 + bf16 SR weights": ("fp8-smooth-fp8adam", False, {}, {"bf16_stochastic_round": True}),
    "fp8 + all memory knobs": ("fp8-smooth-fp8adam", False, {"recompute_glu_output": True, "save_norm_input_fp8": True},
                               {"bf16_stochastic_round": True}),  # bf16 SR weights + both saved-activation knobs
    "fp8 + offload activations": ("fp8-smooth-fp8adam", False, {}, {"offload_activations": {"min_bytes": 1 << 16}}),
    "fp8 + offload optimizer": ("fp8-smooth-fp8adam", False, {}, {"offload_state": True}),
}
BASE, FP8 = "bf16 inductor", "fp8-smooth-fp8adam"
DEFAULT_VARIANTS = tuple(VARIANTS)
GOALS = {"saved": 0.35, "state+saved": 0.45, "peak": 0.55}  # at block, / bf16 inductor (issue 31)
MEASURES = {"saved": "saved_mib", "state+saved": "state_saved_mib", "peak": "peak_mib"}


def _tensor_bytes(tensors) -> int:
    """Bytes of distinct storages among ``tensors``."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def resident_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """What the model holds between steps (gradients set to None): parameters, buffers, optimizer state."""
    state = [v for st in opt.state.values() for v in st.values()]
    return _tensor_bytes([*model.parameters(), *model.buffers(), *state])


def step_peak_bytes(step, model, opt, device: str) -> tuple[int, str]:
    """Peak bytes allocated during one whole ``step()`` (see the module doc for how, per device) and,
    on CPU, the ops the step was in when it was reached (:func:`profiled_peak_at`)."""
    opt.zero_grad(set_to_none=True)
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(), "-"
    peak, where = profiled_peak_at(step)
    return resident_bytes(model, opt) + peak, where


def _profiled_peak(step) -> int:
    """Highest running sum of the profiler's allocation records during the second of two steps."""
    return profiled_peak_at(step)[0]


def profiled_peak_at(step) -> tuple[int, str]:
    """:func:`_profiled_peak` and where the step was when it was reached: the outermost and the
    innermost op the profiler recorded around that allocation (``outer > inner``)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile, record_function

    marker = "memory.py: measured step"
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
        with record_function(marker):
            step()
    allocs, window, measured = [], None, None
    todo = list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        node = todo.pop()
        if node.tag == _EventType.Allocation:
            allocs.append((node.start_time_ns, node.extra_fields.alloc_size, node))
        elif node.name == marker:
            window, measured = (node.start_time_ns, node.end_time_ns), node
        todo.extend(node.children)
    if window is None:
        raise RuntimeError("memory.py: the profiler recorded no measured step; cannot take the CPU peak")
    allocs.sort(key=lambda a: a[0])
    running, peak, at = 0, None, None
    for t, nbytes, node in allocs:
        running += nbytes
        if window[0] <= t <= window[1] and (peak is None or running > peak):
            peak, at = running, node
    if peak is None:
        return max(running, 0), "-"
    chain, node = [], at.parent
    while node is not None and node is not measured:
        if node.tag == _EventType.TorchOp:
            chain.append(node.name)
        node = node.parent
    where = "-" if not chain else chain[-1] if len(chain) == 1 else f"{chain[-1]} > {chain[0]}"
    return max(peak, 0), where


def measure(shape: str, name: str, spec: tuple, device: str, dtype: torch.dtype) -> tuple[dict, object]:
    """One variant's memory row and its step function."""
    records: list = []
    with record_partitions(records):
        cfg, model, opt, loss_fn, step = build(shape, name, device, dtype, spec)
        step()  # compile + optimizer state
    params = list(model.parameters())
    hook_bytes, loss = saved_bytes(loss_fn, exclude={p.untyped_storage().data_ptr() for p in params})
    loss.backward()
    grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    del loss
    opt.zero_grad(set_to_none=True)
    n = model.num_params()
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    opt_bytes = state_bytes(opt)
    saved = sum(r["saved_bytes"] for r in records) if records else hook_bytes
    state = param_bytes + grad_bytes + opt_bytes
    peak, peak_at = step_peak_bytes(step, model, opt, device)
    device_saved, offloaded = hook_bytes, None
    if step.offload is not None:  # one more step, counted alone
        step.offload.reset()
        step()
        offloaded = step.offload.stats  # tensors still referenced elsewhere came back themselves: resident
        device_saved = offloaded.kept_bytes + offloaded.originals_alive_bytes
    mib = 2**20
    row = {"name": name, "recipe": spec[0], "overrides": spec[2] if len(spec) > 2 else {},
           "trainer_options": spec[3] if len(spec) > 3 else {}, "params": n,
           "graphs": len(records), "param_mib": param_bytes / mib, "grad_mib": grad_bytes / mib,
           "optimizer_mib": opt_bytes / mib, "state_bytes_per_param": state / n,
           "param_bytes_per_param": param_bytes / n, "grad_bytes_per_param": grad_bytes / n,
           "optimizer_bytes_per_param": opt_bytes / n, "saved_mib": saved / mib,
           "saved_hooks_mib": hook_bytes / mib, "state_saved_mib": (state + saved) / mib, "peak_mib": peak / mib, "peak_at": peak_at,
           "resident_mib": resident_bytes(model, opt) / mib, "device_optimizer_mib": device_state_nbytes(opt) / mib,
           "device_saved_mib": device_saved / mib,
           "offloaded_saved": None if offloaded is None else [
               offloaded.offloaded_tensors, offloaded.offloaded_bytes / mib, offloaded.restored_tensors,
               offloaded.originals_alive]}
    return row, step


PRECISIONS = {"auto": None, "bf16": torch.bfloat16, "fp32": torch.float32}


def run(shape: str, variants, steps: int, device: str, precision: str = "auto") -> dict:
    dtype = PRECISIONS[precision] or baseline_dtype(device)
    rows, steps_fn = {}, {}
    for name in variants:
        rows[name], steps_fn[name] = measure(shape, name, VARIANTS[name], device, dtype)
    times = time_rounds(steps_fn, device, repeat=steps, warmup=1) if steps else {}
    for name, t in times.items():
        rows[name].update(step_ms=statistics.median(t) * 1e3, all_step_ms=[x * 1e3 for x in t])
    for base, key in ((BASE, "/base"), (FP8, "/fp8")):
        if base in rows:
            for r in rows.values():
                if steps:  # the median of the per-round ratios: each round's steps ran back to back
                    ratios = [t / b for t, b in zip(r["all_step_ms"], rows[base]["all_step_ms"])]
                    r["step" + key] = statistics.median(ratios)
                    r["step" + key + " range"] = [min(ratios), max(ratios)]
                if key == "/base":
                    for measure_name, field in MEASURES.items():
                        r[measure_name + key] = r[field] / rows[base][field]
    s = SHAPES[shape]
    return {"shape": shape, "shape_config": s, "precision": dtype_name(dtype), "threads": torch.get_num_threads(),
            "device": device, "rows": list(rows.values())}


def _range(lo_hi) -> str:
    return "" if not lo_hi else f" ({lo_hi[0]:.2f}-{lo_hi[1]:.2f})"


def print_table(res: dict) -> None:
    s = res["shape_config"]
    print(f"\n## {res['shape']}: d_model {s['d_model']}, ffn {s['ffn']}, {s['n_layers']} layers, "
          f"{s['batch']} x {s['seq']} tokens, high precision {res['precision']}, {res['threads']} threads, "
          f"{res['device']}")
    print("| variant | state B/param (p + g + opt) | saved MiB (graph / hooks) | state + saved MiB | peak MiB | "
          f"step ms | step / {BASE} | step / {FP8} (per-round range) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in res["rows"]:
        print(f"| {r['name']} | {r['state_bytes_per_param']:.2f} ({r['param_bytes_per_param']:.2f} + "
              f"{r['grad_bytes_per_param']:.2f} + {r['optimizer_bytes_per_param']:.2f}) | "
              f"{r['saved_mib']:.2f} / {r['saved_hooks_mib']:.2f} | {r['state_saved_mib']:.1f} | {r['peak_mib']:.1f} | "
              f"{r.get('step_ms', float('nan')):.1f} | {r.get('step/base', float('nan')):.3f} | "
              f"{r.get('step/fp8', float('nan')):.3f}{_range(r.get('step/fp8 range'))} |")
    for r in res["rows"]:
        if r["name"] == BASE or "saved/base" not in r:
            continue
        for measure_name in MEASURES:
            val = r[measure_name + "/base"]
            goal = GOALS[measure_name] if res["shape"] == "block" else None
            verdict = "" if goal is None else f"  goal <= {goal}: {'met' if val <= goal else 'NOT met'}"
            print(f"{res['shape']:>6} {r['name']:40s} {measure_name + ' / ' + BASE:28s} {val:6.3f}{verdict}")
    for r in res["rows"]:
        print(f"{res['shape']:>6} {r['name']:40s} peak reached in {r['peak_at']} "
              f"(resident between steps {r['resident_mib']:.1f} MiB)")
    for r in res["rows"]:
        moved = ""
        if r["offloaded_saved"] is not None:
            n, mib_moved, back, alive = r["offloaded_saved"]
            moved = (f" (offloaded {mib_moved:.2f} MiB in {n} tensors; backward took {back} back from host, "
                     f"{alive} still referenced on the device)")
        print(f"{res['shape']:>6} {r['name']:40s} on the device: optimizer state {r['device_optimizer_mib']:.2f} MiB "
              f"of {r['optimizer_mib']:.2f}, saved for backward {r['device_saved_mib']:.2f} MiB{moved}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="all", choices=[*SHAPES, "all"])
    p.add_argument("--variants", default=None, help=f"comma-separated, of: {', '.join(VARIANTS)}")
    p.add_argument("--steps", type=int, default=3, help="timed rounds (median kept); 0: memory only, no timing")
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default; see train_step.py)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--precision", default="auto", choices=list(PRECISIONS),
                   help="the high precision (autocast dtype; fp32: none) of every variant; auto: "
                        "benchmarks.common.baseline_dtype (fp32 on AVX2-only CPUs). bf16 there compares a bf16-weight "
                        "variant with the others at the same activation dtype (the FP8 GEMMs keep their own dtype)")
    p.add_argument("--json")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    variants = listed(p, a.variants, VARIANTS, "variant") if a.variants else list(DEFAULT_VARIANTS)
    shapes = list(SHAPES) if a.shape == "all" else [a.shape]
    res = {"machine": machine(), "load_before": os.getloadavg(), "results": []}
    for shape in shapes:
        r = run(shape, variants, a.steps, a.device, a.precision)
        print_table(r)
        res["results"].append(r)
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=1))
    res["load_after"] = os.getloadavg()
    print(f"\nload (1-min) before {res['load_before'][0]:.2f}, after {res['load_after'][0]:.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
