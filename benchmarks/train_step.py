"""One training step of a Llama-style model: fp8pass vs bf16 (eager and Inductor), time and memory.

Two shapes (``--shape``): ``tiny`` (d_model 256, ffn 672, 4 heads, 4 layers, batch 8 x 256 tokens)
and ``block`` (d_model 2048, ffn 5632, 16 heads, 2 layers, batch 1 x 2048 tokens: the matmuls of a
7B layer). Both use a 256-token vocabulary, so the embedding and the LM head (2 x 256 x d_model
weights, 1% of ``block``'s matmul FLOPs) do not dominate.

For each variant, in the same process, the variants' steps interleaved round by round (so that load
from other processes hits all of them alike): median step time (forward + backward + optimizer
step), and the memory a step holds:

* saved for backward: the activations the compiled (AOT-partitioned) forward hands to backward,
  read from the partitioned backward graph: its inputs that are neither gradients (tangents) nor
  the graph's own inputs (parameters and tokens exist anyway), each counted at its size. The
  ``saved_tensors_hooks`` count of the same forward (storages counted once, parameters' storages
  left out) is reported beside it as a check; for the eager variant it is the only count.
* params + grads + optimizer state (all storage of the optimizer's state tensors) + saved.

The ratios against bf16-Inductor + torch AdamW (what the ``bf16`` recipe builds: fp32 moments,
``foreach`` left to torch, which on CPU means the per-tensor loop) are printed with the goals of
issue 15. ``--profile DIR`` writes torch.profiler tables of one step of each variant;
``--saved-breakdown`` lists every saved tensor (dtype, shape, MiB) by the forward op that produced it.

    python -m benchmarks.train_step [--shape tiny|block|all] [--variants ...] [--steps 3]
                                    [--threads 1] [--quick] [--profile DIR] [--saved-breakdown] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import operator
import os
import statistics
from pathlib import Path

import torch

import fp8pass
from benchmarks.common import baseline_dtype, dtype_name, machine, time_rounds
from fp8pass.train import ModelConfig, TinyLlama
from fp8pass.train.recipes import build_optimizer, get_recipe, prepare_model

SHAPES = {
    "tiny": dict(d_model=256, ffn=672, n_heads=4, n_layers=4, batch=8, seq=256),
    "block": dict(d_model=2048, ffn=5632, n_heads=16, n_layers=2, batch=1, seq=2048),
}
VOCAB = 256
VARIANTS = {  # name -> (recipe, compile the bf16 recipe with Inductor)
    "bf16 eager": ("bf16", False),
    "bf16 inductor": ("bf16", True),
    "fp8-smooth": ("fp8-smooth", False),
    "fp8-smooth-fp8adam": ("fp8-smooth-fp8adam", False),
}
BASE, FP8 = "bf16 inductor", "fp8-smooth-fp8adam"
DEFAULT_VARIANTS = {"tiny": tuple(VARIANTS), "block": (BASE, FP8)}
GOALS = {  # (shape, measure) -> goal of issue 15 (<=)
    ("block", "step"): 1.15, ("tiny", "step"): 1.6, ("block", "saved"): 0.6, ("block", "total"): 0.65,
}


def saved_bytes(fn, exclude=()) -> tuple[int, object]:
    """Bytes of the tensors autograd saves for backward while ``fn()`` runs (storage counted once;
    storages whose data_ptr is in ``exclude``, e.g. the parameters', left out)."""
    seen: dict[int, int] = {}
    skip = set(exclude)

    def pack(t):
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            if s.data_ptr() not in skip:
                seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


@contextlib.contextmanager
def record_partitions(records: list):
    """While active, every Inductor compile (plain or through fp8pass's backend) appends
    ``{"saved_bytes", "saved_inputs", "saved"}`` of its partitioned backward graph to ``records``.
    Caches are off so that the partitioner really runs."""
    import torch._functorch.config as fconfig
    import torch._inductor.compile_fx as cfx
    import torch._inductor.config as iconfig

    real = cfx.min_cut_rematerialization_partition

    def partition(joint, *args, **kwargs):
        fw, bw = real(joint, *args, **kwargs)
        records.append(backward_inputs(bw, fw))
        return fw, bw

    cfx.min_cut_rematerialization_partition = partition
    try:
        with iconfig.patch(fx_graph_cache=False), fconfig.patch(enable_autograd_cache=False):
            yield records
    finally:
        cfx.min_cut_rematerialization_partition = real


def backward_inputs(bw: torch.fx.GraphModule, fw: torch.fx.GraphModule | None = None) -> dict:
    """What a partitioned backward graph takes from its forward: placeholders that are not tangents.
    Those that are the forward's own inputs (``primals_*``: parameters, tokens), or views of them in
    ``fw`` (a transposed weight), hold no extra memory and are counted apart, as ``input_bytes``."""
    views_of_inputs = set()
    if fw is not None:
        for node in fw.graph.nodes:
            src = node
            while src.op == "call_function" and getattr(src.target, "is_view", False) and src.args:
                src = src.args[0]
            if src is not node and src.op == "placeholder":
                views_of_inputs.add(node.name)
    producers = {} if fw is None else {node.name: node for node in fw.graph.nodes}
    saved, inputs, names, table = 0, 0, [], []
    for node in bw.graph.find_nodes(op="placeholder"):
        if node.name.startswith("tangents"):
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue  # symbolic sizes, RNG seeds as ints
        nbytes = _hint(val.numel()) * val.element_size()
        if node.name.startswith("primals") or node.name in views_of_inputs:
            inputs += nbytes
        else:
            saved += nbytes
            names.append(f"{node.name}:{str(val.dtype).removeprefix('torch.')}{list(val.shape)}")
            table.append({"name": node.name, "dtype": str(val.dtype).removeprefix("torch."),
                          "shape": [_hint(d) for d in val.shape], "bytes": nbytes,
                          "producer": producer_of(producers.get(node.name))})
    return {"saved_bytes": saved, "input_bytes": inputs, "saved": names, "table": table}


def producer_of(node: torch.fx.Node | None) -> str:
    """The forward op that made a saved value: ``op`` or ``op[i]`` for an output of a multi-output op
    (``fp8_linear[3]`` = its x codes); views and dtype conversions name what they read too."""
    if node is None:
        return "?"
    if node.op != "call_function":
        return node.op
    if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
        return f"{_op_name(node.args[0].target)}[{node.args[1]}]"
    name = _op_name(node.target)
    src = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
    if src is not None and (getattr(node.target, "is_view", False)
                            or name in ("_to_copy", "convert_element_type", "clone")):
        return f"{name}({producer_of(src)})"
    return name


def _op_name(target) -> str:
    name = getattr(target, "__name__", str(target))
    overload = getattr(target, "_overloadpacket", None)
    if overload is not None:
        name = getattr(overload, "__name__", name)
    return name.split(".")[-1] if "." in name and not name.startswith("fp8pass") else name


def _hint(n) -> int:
    """An int of a size that may be symbolic (a graph compiled with dynamic shapes): its value here."""
    return int(n.node.hint) if isinstance(n, torch.SymInt) else int(n)


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Storage of every tensor in the optimizer's state (moments, codes, scales, steps)."""
    total = 0
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                total += v.numel() * v.element_size()
    return total


def build(shape: str, name: str, device: str, dtype: torch.dtype, spec: tuple | None = None):
    """``(cfg, model, opt, loss_fn, step)`` of variant ``name`` at ``shape``. ``spec``: ``(recipe,
    compile_bf16[, Config overrides[, trainer options]])`` instead of ``VARIANTS[name]``
    (benchmarks/memory.py's variants override fields of the recipe's backend Config; the trainer option
    ``{"bf16_stochastic_round": True}`` makes the model bf16 with no fp32 master, as ``TrainConfig``'s;
    ``{"offload_state": True}`` keeps the optimizer state in host memory; ``{"offload_activations":
    {"min_bytes": n}}`` runs each step's forward and backward in ``fp8pass.offload_saved_activations``,
    which is ``step.offload`` then, for its counts)."""
    s = SHAPES[shape]
    cfg = ModelConfig(vocab_size=VOCAB, d_model=s["d_model"], n_layers=s["n_layers"], n_heads=s["n_heads"],
                      ffn=s["ffn"], max_seq_len=s["seq"])
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (s["batch"], s["seq"] + 1), generator=g).to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    recipe_name, compile_bf16, *overrides = spec or VARIANTS[name]
    options = overrides[1] if len(overrides) > 1 else {}
    bf16_sr = bool(options.get("bf16_stochastic_round"))
    torch.manual_seed(0)
    model = TinyLlama(cfg).to(device)
    if bf16_sr:
        model.to(torch.bfloat16)
    recipe = get_recipe(recipe_name)
    fwd = prepare_model(model, recipe, compile_bf16=compile_bf16, backend_options=overrides[0] if overrides else None)
    opt = build_optimizer(model, recipe, lr=1e-3, weight_decay=0.1, bf16_stochastic_round=bf16_sr,
                          offload_state=bool(options.get("offload_state")))
    offload = None
    if "offload_activations" in options:
        offload = fp8pass.offload_saved_activations(**options["offload_activations"])

    def loss_fn():
        with torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32):
            return fwd(x, y)

    def step():
        opt.zero_grad(set_to_none=True)
        with offload or contextlib.nullcontext():
            loss_fn().backward()
        opt.step()

    step.offload = offload
    return cfg, model, opt, loss_fn, step


def run(shape: str = "tiny", variants=None, steps: int = 3, device: str = "cpu", profile: str | None = None) -> dict:
    variants = tuple(variants or DEFAULT_VARIANTS[shape])
    dtype = baseline_dtype(device)
    rows, steps_fn = {}, {}
    for name in variants:
        records: list = []
        with record_partitions(records):
            cfg, model, opt, loss_fn, step = build(shape, name, device, dtype)
            step()  # compile + optimizer state
        params = list(model.parameters())
        hook_bytes, loss = saved_bytes(loss_fn, exclude={p.untyped_storage().data_ptr() for p in params})
        loss.backward()
        grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
        opt.zero_grad(set_to_none=True)
        graph_saved = sum(r["saved_bytes"] for r in records) if records else None
        saved = graph_saved if graph_saved is not None else hook_bytes
        param_bytes = sum(p.numel() * p.element_size() for p in params)
        opt_bytes = state_bytes(opt)
        rows[name] = {
            "name": name, "params": model.num_params(), "graphs": len(records),
            "saved_mib": saved / 2**20, "saved_hooks_mib": hook_bytes / 2**20,
            "saved_graph_mib": None if graph_saved is None else graph_saved / 2**20,
            "param_mib": param_bytes / 2**20, "grad_mib": grad_bytes / 2**20, "optimizer_mib": opt_bytes / 2**20,
            "optimizer_bytes_per_param": opt_bytes / model.num_params(),
            "total_mib": (param_bytes + grad_bytes + opt_bytes + saved) / 2**20,
        }
        rows[name]["saved_breakdown"] = breakdown(records)
        steps_fn[name] = step
    times = time_rounds(steps_fn, device, repeat=steps, warmup=1)
    for name, t in times.items():
        rows[name].update(step_ms=statistics.median(t) * 1e3, spread_ms=(max(t) - min(t)) * 1e3,
                          all_step_ms=[x * 1e3 for x in t])
    if profile:
        for name, step in steps_fn.items():
            rows[name]["profile"] = profile_step(step, Path(profile) / f"{shape}_{name.replace(' ', '_')}.txt")
    out = {"shape": shape, "config": cfg.to_dict(), "batch": SHAPES[shape]["batch"], "seq": SHAPES[shape]["seq"],
           "precision": dtype_name(dtype), "threads": torch.get_num_threads(), "rows": list(rows.values())}
    if BASE in rows:
        b = rows[BASE]
        for r in rows.values():
            r["step/bf16_inductor"] = r["step_ms"] / b["step_ms"]
            r["saved/bf16_inductor"] = r["saved_mib"] / b["saved_mib"]
            r["total/bf16_inductor_adamw"] = r["total_mib"] / b["total_mib"]
        if FP8 in rows:
            f = rows[FP8]
            out["ratios"] = {"shape": shape, "step fp8/bf16-inductor": f["step/bf16_inductor"],
                             "saved fp8/bf16-inductor": f["saved/bf16_inductor"],
                             "total fp8/bf16-inductor+adamw": f["total/bf16_inductor_adamw"]}
    return out


def breakdown(records: list) -> list[dict]:
    """The saved tensors of all of a variant's backward graphs grouped by (producer, dtype, shape),
    largest total first: ``{"producer", "dtype", "shape", "count", "mib"}``."""
    groups: dict[tuple, dict] = {}
    for r in records:
        for t in r["table"]:
            key = (t["producer"], t["dtype"], tuple(t["shape"]))
            g = groups.setdefault(key, {"producer": t["producer"], "dtype": t["dtype"], "shape": list(t["shape"]),
                                        "count": 0, "mib": 0.0})
            g["count"] += 1
            g["mib"] += t["bytes"] / 2**20
    return sorted(groups.values(), key=lambda g: -g["mib"])


# -- profile -----------------------------------------------------------------------------------

GROUPS = (  # first match wins; names are aten ops, fp8pass custom ops and profiler scopes
    ("optimizer", ("Optimizer.", "adam")),
    ("state records", ("record", "amax_history", "delayed")),
    ("attention", ("scaled_dot_product", "flash_attention", "_efficient_attention", "softmax")),
    ("GEMMs", ("mm", "matmul", "linear", "gemm", "_scaled_mm", "mkldnn", "onednn")),
    ("casts", ("cast", "quant", "_to_copy", "to_fp8", "float8", "clamp", "copy_")),
)


def group_of(name: str) -> str:
    low = name.lower()
    for group, keys in GROUPS:
        if any(k.lower() in low for k in keys):
            return group
    return "other"


def profile_step(step, path: Path) -> dict:
    """One step under torch.profiler. The optimizer step is one group (everything under
    ``Optimizer.step``); every other op's self time goes to the group its name falls in. Writes the
    op table (self time) to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    groups: dict[str, float] = {}
    ops: dict[str, list] = {}
    total = 0.0
    for e in prof.events():
        anc, in_opt = e, False
        while anc is not None:
            if anc.name.startswith("Optimizer.step"):
                in_opt = True
                break
            anc = anc.cpu_parent
        us = e.self_cpu_time_total
        total += us
        group = "optimizer" if in_opt else group_of(e.name)
        groups[group] = groups.get(group, 0.0) + us / 1e3
        if not in_opt:
            o = ops.setdefault(e.name, [0, 0.0])
            o[0] += 1
            o[1] += us / 1e3
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
    callers = profile_callers(step)
    path.with_name(path.stem + "_callers.txt").write_text(
        "self ms | calls | op [input shapes] | fp8pass/optimizer callers, innermost first\n" +
        "\n".join(f"{ms:9.1f} | {c:5d} | {op} {shapes} | {who}" for (op, shapes, who), (c, ms) in callers))
    top = sorted(ops.items(), key=lambda kv: -kv[1][1])[:15]
    return {"profiled_ms": total / 1e3, "groups_ms": dict(sorted(groups.items(), key=lambda kv: -kv[1])),
            "top": [{"op": k, "calls": c, "self_ms": ms, "group": group_of(k)} for k, (c, ms) in top]}


CALLER_OPS = ("aten::copy_", "aten::div", "aten::mul", "aten::add", "aten::addmm", "aten::mm", "aten::aminmax",
              "<built-in function kernel>")  # the last: an Inductor-generated kernel (its graph's caller below)


def profile_callers(step, depth: int = 3, top: int = 40) -> list:
    """One more step, profiled with Python stacks: the self time of copies, divisions, GEMMs and
    Inductor kernels by input shapes and by the innermost ``depth`` fp8pass / optimizer / Inductor
    frames that called them (what issued each copy or compiled-loop call). Sorted, the ``top`` rows."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True) as prof:
        step()
    rows: dict = {}
    for e in prof.events():
        if not e.name.startswith(CALLER_OPS):
            continue
        who, anc = [], e.cpu_parent
        while anc is not None and len(who) < depth:
            if any(k in anc.name for k in ("fp8pass/", "torch/optim/", "output_code.py")) and anc.name not in who:
                who.append(anc.name.rsplit("site-packages/", 1)[-1].rsplit("/main/", 1)[-1])
            anc = anc.cpu_parent
        key = (e.name, str(e.input_shapes) if e.input_shapes else "", " <- ".join(who))
        r = rows.setdefault(key, [0, 0.0])
        r[0] += 1
        r[1] += e.self_cpu_time_total / 1e3
    return sorted(rows.items(), key=lambda kv: -kv[1][1])[:top]


# -- report ------------------------------------------------------------------------------------

def print_table(res: dict) -> None:
    print(f"\n## {res['shape']}: d_model {res['config']['d_model']}, ffn {res['config']['ffn']}, "
          f"{res['config']['n_layers']} layers, batch {res['batch']} x {res['seq']}, vocab {VOCAB}, "
          f"high precision {res['precision']}, {res['threads']} threads")
    print("| variant | step ms | /ind. | saved MiB (graph) | saved MiB (hooks) | params+grads+opt+saved MiB | "
          "opt B/param |")
    print("|---|---|---|---|---|---|---|")
    for r in res["rows"]:
        graph = "-" if r["saved_graph_mib"] is None else f"{r['saved_graph_mib']:.2f}"
        print(f"| {r['name']} | {r['step_ms']:.1f} | {r.get('step/bf16_inductor', float('nan')):.2f} | {graph} | "
              f"{r['saved_hooks_mib']:.2f} | {r['total_mib']:.1f} | {r['optimizer_bytes_per_param']:.2f} |")
    ratios = res.get("ratios")
    if ratios:
        for measure, key in (("step", "step fp8/bf16-inductor"), ("saved", "saved fp8/bf16-inductor"),
                             ("total", "total fp8/bf16-inductor+adamw")):
            goal = GOALS.get((res["shape"], measure))
            val = ratios[key]
            verdict = "" if goal is None else f"  goal <= {goal}: {'met' if val <= goal else 'NOT met'}"
            print(f"{res['shape']:>6} {key:32s} {val:6.3f}{verdict}")


def print_breakdown(res: dict) -> None:
    """Every variant's saved-for-backward tensors by the forward op that produced them."""
    for r in res["rows"]:
        if not r.get("saved_breakdown"):
            continue
        print(f"\n### saved for backward, {res['shape']}, {r['name']}: {r['saved_mib']:.2f} MiB")
        print("| produced by (forward op[output]) | dtype | shape | count | MiB |")
        print("|---|---|---|---|---|")
        for g in r["saved_breakdown"]:
            print(f"| {g['producer']} | {g['dtype']} | {g['shape']} | {g['count']} | {g['mib']:.2f} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="all", choices=[*SHAPES, "all"])
    p.add_argument("--variants", default=None, help=f"comma-separated, of: {', '.join(VARIANTS)}")
    p.add_argument("--steps", type=int, default=3, help="timed rounds (median kept)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on a shared CPU, OpenMP threads waiting for each other made "
                        "a tiny step 10x slower and the ratios meaningless; 0: torch's default)")
    p.add_argument("--quick", action="store_true", help=f"tiny only, {BASE} and {FP8}, 2 rounds (the suite)")
    p.add_argument("--profile", default=None, help="directory for torch.profiler tables of one step each")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--saved-breakdown", action="store_true",
                   help="also print every saved-for-backward tensor by the forward op that produced it")
    p.add_argument("--json")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    shapes = list(SHAPES) if a.shape == "all" else [a.shape]
    variants = a.variants.split(",") if a.variants else None
    if a.quick:
        shapes, variants, a.steps = ["tiny"], [BASE, FP8], 2
    for v in variants or ():
        if v not in VARIANTS:
            p.error(f"unknown variant {v!r}; valid: {', '.join(VARIANTS)}")
    res = {"machine": machine(), "load_before": os.getloadavg(), "results": []}
    for shape in shapes:
        r = run(shape, variants, a.steps, a.device, a.profile)
        print_table(r)
        if a.saved_breakdown:
            print_breakdown(r)
        res["results"].append(r)
        if a.json:  # after each shape: a long run keeps what it measured
            Path(a.json).write_text(json.dumps(res, indent=1))
    res["load_after"] = os.getloadavg()
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
