"""A cost model of every ``gpu_bench`` case on an H200: predicted time and ratio beside every GPU goal.

    python -m benchmarks.gpu_cost [--smoke] [--json FILE]     # the table of predictions, no GPU needed

``gpu_check.sh`` records each case's prediction next to its measurement (``gpu_check.json`` and the md
table), so the first GPU run tests the model as well as the code.

The model (all rates are the H200's, measured on this workplace's machines, see KINDS.md):

* ``copy_bw`` = 4.3e12 B/s: a device-to-device copy, bytes read + written.
* ``bf16_flops`` = 788e12 FLOP/s: an 8192^3 bf16 matmul on random data; ``fp8_flops`` = 2 x that
  (Hopper's FP8 tensor cores, the same shapes).
* ``issue_rate`` = 132 SMs x 4 schedulers x 32 lanes x 1.98e9 Hz = 3.345e13 thread-instructions/s: each
  scheduler issues one warp instruction per cycle.
* ``launch_s`` = 5e-6 s of host time per kernel launch (eager / Inductor without CUDA graphs).

Each case is a list of kernels and a launch count:

* a GEMM of ``F`` FLOPs moving ``B`` bytes takes ``max(F / rate, B / copy_bw)``; rate = ``fp8_flops`` when
  both operands are FP8, else ``bf16_flops``;
* a streaming kernel (cast, amax, elementwise, optimizer) over ``n`` elements moving ``B`` bytes takes
  ``max(B / copy_bw, n * sass_per_elem / issue_rate)``; when ``gpu_static.json`` gives the kernel's
  predicted ``bw_fraction`` of the copy bandwidth, ``B / (copy_bw * bw_fraction)`` instead;
* device time = the sum over kernels (one stream, no overlap between kernels);
  host time = launches x ``launch_s``;
* predicted time = ``max(device, host)`` (the host queues launches while the device runs: whichever is
  slower bounds the step); under a CUDA-graph replay the host term vanishes: ``predicted_graph_ms`` = device.
* a ratio's prediction is the same ratio of predicted times (goals are ratios of cases).

Inputs other tools measure, read when present (each output line says which were defaults):

* ``docs/results/gpu_launches.json`` (``benchmarks/gpu_launches.py``): ``{"cases": {name: {"total": n}}}``,
  kernels per fwd+bwd (per step for the optimizer), counted on the CUDA code path; the AdamW step's
  count at the case's tensor count comes from the line through its "adamw step N tensors" counts
  (``Inputs.adamw_launches``). Missing names use
  ``DEFAULT_LAUNCHES``: the counts issue 28 measured at commit 5091ad3 where it gave them, else the
  estimate written beside the entry.
* ``docs/results/gpu_static.json`` (``benchmarks/gpu_static.py``): per kernel variant ``sass_per_elem``
  and ``bw_fraction`` for each Triton version; the device's version (3.6.0) is used when present, else
  the newest listed. Rows are matched to a role by kernel and variant name (``ROLES``, aligned builds);
  several matching rows (autotuner configs) give their median. Missing roles use ``DEFAULT_SASS``
  (issue 28's counts at 5091ad3, triton 3.9.0).

Bytes are counted as the fewest each kernel must move (inputs read once, outputs written once), the
counts stated in each case function below; bf16 activations, fp32 master weights and optimizer state.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAUNCHES_JSON = ROOT / "docs" / "results" / "gpu_launches.json"
STATIC_JSON = ROOT / "docs" / "results" / "gpu_static.json"
DEVICE_TRITON = "3.6.0"  # the H200 image's Triton


@dataclass(frozen=True)
class Machine:
    """The rates of the model (H200, see the module docstring)."""

    copy_bw: float = 4.3e12
    bf16_flops: float = 788e12
    fp8_flops: float = 2 * 788e12
    issue_rate: float = 132 * 4 * 32 * 1.98e9
    launch_s: float = 5e-6


H200 = Machine()

# Kernels per fwd+bwd (per step for optimizers) when gpu_launches.json lacks the name.
DEFAULT_LAUNCHES = {
    "bf16 linear": 3,                      # estimate: three GEMMs
    "fp8_linear current": 83,              # issue 28, counted at 5091ad3
    "fp8_linear delayed": 239,             # issue 28, counted at 5091ad3
    "torchao linear": 12,                  # estimate: three GEMMs + compiled amax/cast kernels
    "bf16 swiglu_mlp": 12,                 # estimate: nine GEMMs + three fused elementwise kernels
    "swiglu_mlp channel": 319,             # issue 28, counted at 5091ad3 (current scaling)
    "swiglu_mlp channel delayed": 319 + 3 * (239 - 83),  # estimate: each linear's delayed-state extra
                                                         # (DERIVED_LAUNCHES, from counted values if any)
    "torchao swiglu_mlp": 30,              # estimate: nine GEMMs + compiled (fused) casts
    "adamw step": 40,                      # estimate, any tensor count: 8 tensors x ~4 kernels + copies
    "torch fused adamw step": 2,           # estimate: one multi-tensor launch (+ the step counter)
    "bf16 grouped moe": 12,                # estimate: six grouped GEMMs + elementwise
    "bf16 per-expert moe": 8 * 12,         # estimate: the same per expert (8 experts)
    "fp8 grouped moe current": 8 * 60,     # estimate: per-expert wgrad / E5M2 dgrad loop (issue 28)
    "fp8 grouped moe delayed": 8 * 80,     # estimate: as current plus per-expert state records
    "bf16 block layer": 40,                # estimate: Inductor kernels per decoder layer, fwd+bwd
    "torchao block layer": 70,             # estimate: bf16's plus compiled casts of seven linears
}

# name -> (the counted names it follows from, how): counts the counter does not take, from those it does
DERIVED_LAUNCHES = {
    "swiglu_mlp channel delayed": (("swiglu_mlp channel", "fp8_linear delayed", "fp8_linear current"),
                                   lambda mlp, delayed, current: mlp + 3 * (delayed - current)),
    # the MoE block: one grouped linear (gate_up) and one grouped SwiGLU down, as benchmarks/moe.py runs them
    "fp8 grouped moe current": (("grouped_linear current", "grouped_swiglu channel"), lambda lin, glu: lin + glu),
    "fp8 grouped moe delayed": (("grouped_linear current", "grouped_swiglu channel", "fp8_linear delayed",
                                 "fp8_linear current"),
                                lambda lin, glu, delayed, current: lin + glu + 2 * (delayed - current)),
}

# role -> (kernel, what its variant must contain): the variant gpu_bench's cases run (aligned tensors,
# round-to-nearest, E4M3 codes; Adam with fp8pass's default moments, E4M3 m / E5M2 v, block 128)
ROLES = {
    "cast": ("_cast_tensor_kernel", ("cast e4m3 ", "sr=False")),
    "transpose_cast": ("_transpose_cast_kernel", ("T=True", "sr=False")),
    "adam": ("_adam_kernel", ("e4m3/e5m2", "block=128", "sr=False")),
}
# variants a role never takes: the Adam step of bf16 parameters (the cases step fp32 ones)
ROLE_EXCLUDES = {"adam": ("bf16-SR",)}
# SASS instructions per element when gpu_static.json lacks the role (issue 28, triton 3.9, 5091ad3)
DEFAULT_SASS = {"cast": 59.0, "transpose_cast": 116.0, "adam": 440.0}


@dataclass
class Inputs:
    """What the model reads from the other tools' JSON files (or their defaults)."""

    launches: dict = field(default_factory=dict)   # name -> launches
    static: dict = field(default_factory=dict)     # role -> {"sass_per_elem", "bw_fraction"}
    static_version: str | None = None

    def launch_count(self, name: str, used: list) -> int:
        if name in self.launches:
            return int(self.launches[name])
        derive = DERIVED_LAUNCHES.get(name)
        if derive and all(k in self.launches for k in derive[0]):
            n = derive[1](*(int(self.launches[k]) for k in derive[0]))
            used.append(f"launches[{name}]={n} derived from {', '.join(derive[0])}")
            return n
        used.append(f"launches[{name}]={DEFAULT_LAUNCHES[name]} default")
        return DEFAULT_LAUNCHES[name]

    def adamw_launches(self, tensors: int, used: list) -> int:
        """Launches of one fp8pass AdamW step over ``tensors`` tensors: the counter's
        "adamw step N tensors" at this N, else the line through its two nearest counts (one count: that
        count), else its "adamw step", else the default."""
        counted = {}
        for name, n in self.launches.items():
            m = re.fullmatch(r"adamw step (\d+) tensors?", name)
            if m:
                counted[int(m.group(1))] = int(n)
        if tensors in counted:
            return counted[tensors]
        if len(counted) >= 2:
            (a, na), (b, nb) = sorted(counted.items(), key=lambda kv: abs(kv[0] - tensors))[:2]
            return max(1, round(na + (nb - na) * (tensors - a) / (b - a)))
        if counted:
            return next(iter(counted.values()))
        return self.launch_count("adamw step", used)

    def kernel(self, role: str, used: list) -> dict:
        if role in self.static:
            return self.static[role]
        used.append(f"sass[{role}]={DEFAULT_SASS[role]:g} default")
        return {"sass_per_elem": DEFAULT_SASS[role], "bw_fraction": None}


def load_inputs(launches_json: Path = LAUNCHES_JSON, static_json: Path = STATIC_JSON,
                triton_version: str = DEVICE_TRITON) -> Inputs:
    """Read the launch counts and static kernel counts, where their files exist.

    Args:
        launches_json: gpu_launches.py's output (``{"cases": {name: {"total": int, ...}}}``).
        static_json: gpu_static.py's output (``{"versions": {version: [row, ...]}}``).
        triton_version: whose static counts to use when the file has several versions.

    Raises:
        ValueError: a file exists but does not have the documented layout.
    """
    inp = Inputs()
    if launches_json.exists():
        cases = json.loads(launches_json.read_text()).get("cases")
        if not isinstance(cases, dict):
            raise ValueError(f"{launches_json}: expected {{'cases': {{name: {{'total': int}}}}}}")
        inp.launches = {k: v["total"] for k, v in cases.items() if isinstance(v, dict) and "total" in v}
    if static_json.exists():
        versions = json.loads(static_json.read_text()).get("versions")
        if not isinstance(versions, dict) or not versions:
            raise ValueError(f"{static_json}: expected {{'versions': {{version: [rows]}}}}")
        ver = triton_version if triton_version in versions else max(versions, key=_version_key)
        inp.static_version = ver
        for role, (kernel, parts) in ROLES.items():
            rows = [r for r in versions[ver] if r.get("kernel") == kernel and "[unaligned]" not in r.get("variant", "")
                    and all(p in r.get("variant", "") for p in parts)
                    and not any(p in r.get("variant", "") for p in ROLE_EXCLUDES.get(role, ()))]
            if rows:
                fracs = [r["bw_fraction"] for r in rows if r.get("bw_fraction")]
                inp.static[role] = {"sass_per_elem": statistics.median(r["sass_per_elem"] for r in rows),
                                    "bw_fraction": statistics.median(fracs) if fracs else None}
    return inp


def _version_key(v: str) -> tuple:
    return tuple(int(p) if p.isdigit() else 0 for p in v.split("."))


class Cost:
    """Kernels and launches of one case; ``ms()`` applies the model of the module docstring."""

    def __init__(self, inputs: Inputs, machine: Machine = H200):
        self.inp, self.m = inputs, machine
        self.device_s = 0.0
        self.launches = 0
        self.terms = {"gemm_ms": 0.0, "stream_ms": 0.0}
        self.defaults: list[str] = []

    def gemm(self, m: int, k: int, n: int, fp8: bool, count: int = 1) -> None:
        """``count`` GEMMs [m, k] x [k, n]; operands 1 B (FP8) or 2 B, output 2 B."""
        flops = 2 * m * k * n
        nbytes = (m * k + k * n) * (1 if fp8 else 2) + 2 * m * n
        t = max(flops / (self.m.fp8_flops if fp8 else self.m.bf16_flops), nbytes / self.m.copy_bw) * count
        self.device_s += t
        self.terms["gemm_ms"] += t * 1e3

    def flops(self, flops: float) -> None:
        """Matrix work at the bf16 rate that moves few bytes (fused attention)."""
        self.device_s += flops / self.m.bf16_flops
        self.terms["gemm_ms"] += flops / self.m.bf16_flops * 1e3

    def stream(self, nbytes: float, elems: float = 0.0, role: str | None = None) -> None:
        """A streaming kernel: ``nbytes`` moved; with a ``role``, bounded by its SASS issue rate too."""
        t = nbytes / self.m.copy_bw
        if role is not None:
            k = self.inp.kernel(role, self.defaults)
            if k.get("bw_fraction"):
                t = nbytes / (self.m.copy_bw * min(1.0, k["bw_fraction"]))
            else:
                t = max(t, elems * k["sass_per_elem"] / self.m.issue_rate)
        self.device_s += t
        self.terms["stream_ms"] += t * 1e3

    def cast(self, elems: float, delayed: bool, transposed: bool = True) -> None:
        """A bf16 tensor cast to FP8: current scaling reads it once more for the amax (2 B/elem); the
        cast reads 2 B and writes 1 B of codes (+1 B of transposed codes)."""
        if not delayed:
            self.stream(2 * elems)
        self.stream((4 if transposed else 3) * elems, elems, "transpose_cast" if transposed else "cast")

    def launch(self, name: str, times: int = 1) -> None:
        self.launches += self.inp.launch_count(name, self.defaults) * times

    def result(self) -> dict:
        host = self.launches * self.m.launch_s
        return {"predicted_ms": max(self.device_s, host) * 1e3, "predicted_graph_ms": self.device_s * 1e3,
                "terms": {**self.terms, "launches": self.launches, "host_ms": host * 1e3},
                "defaults": sorted(set(self.defaults))}


# -- the cases of gpu_bench ---------------------------------------------------------------------------


def linear_case(c: Cost, variant: str, M: int, K: int, N: int) -> None:
    """One linear layer fwd+bwd (y = x W^T, dgrad, wgrad): x [M, K], W [N, K]; variant "bf16",
    "fp8_current", "fp8_delayed" or "torchao" (tensorwise current scaling)."""
    fp8 = variant != "bf16"
    c.gemm(M, K, N, fp8, count=3)  # the three GEMMs have the same FLOPs
    if fp8:
        delayed = variant == "fp8_delayed"
        for elems in (M * K, N * K, M * N):  # x, W, dy: codes and transposed codes
            c.cast(elems, delayed)
        c.launch({"fp8_delayed": "fp8_linear delayed", "fp8_current": "fp8_linear current",
                  "torchao": "torchao linear"}[variant])
    else:
        c.launch("bf16 linear")


def cast_case(c: Cost, variant: str, rows: int, cols: int) -> None:
    """One pass over a bf16 [rows, cols] tensor: copy (2+2 B/elem), amax + cast (2+1 B), transpose-cast (2+1+1 B)."""
    n = rows * cols
    if variant == "copy":
        c.stream(4 * n)
    elif variant == "amax_cast":
        c.stream(3 * n, n, "cast")
    else:
        c.stream(4 * n, n, "transpose_cast")
    c.launches += 1


def adam_case(c: Cost, variant: str, params: int, tensors: int) -> None:
    """One AdamW step over fp32 params and fp32 grads: torch keeps fp32 m, v (read p g m v, write p m v:
    28 B/param); fp8pass keeps E4M3 m and E5M2 v with an fp32 scale per 128 (8 + 4 + 2 + 2 + 1/16 B)."""
    if variant.startswith("torch"):
        c.stream(28 * params)
        c.launch("torch fused adamw step")
    else:
        c.stream((8 + 4 + 2 + 2 + 16 / 128) * params, params, "adam")
        c.launches += c.inp.adamw_launches(tensors, c.defaults)


def _swiglu(c: Cost, variant: str, rows: int, d: int, f: int, weights: int = 1) -> None:
    """A SwiGLU MLP fwd+bwd on ``rows`` tokens: nine GEMMs; elementwise silu(gate) * up, fwd (read 4,
    write 2 B) and bwd (read 6, write 4 B) per [rows, f] element. FP8 casts: x, dy [rows, d]; h, gate,
    up grads [rows, f] x 3; the three weights (``weights`` experts each); Smooth-SwiGLU's channel
    scaling reads h once more (2 B)."""
    fp8 = variant.startswith("fp8") or variant.startswith("torchao")
    for kk, nn in ((d, f), (d, f), (f, d)):
        c.gemm(rows, kk, nn, fp8, count=3)
    c.stream(16 * rows * f)
    if fp8:
        delayed = variant == "fp8_delayed"
        for elems in (rows * d, rows * d, rows * f, rows * f, rows * f, 3 * weights * d * f):
            c.cast(elems, delayed)
        if not variant.startswith("torchao"):
            c.stream(2 * rows * f)


def mlp_case(c: Cost, variant: str, tokens: int, d: int, ffn: int) -> None:
    _swiglu(c, variant, tokens, d, ffn)
    c.launch({"bf16": "bf16 swiglu_mlp", "fp8_current": "swiglu_mlp channel",
              "fp8_delayed": "swiglu_mlp channel delayed", "torchao": "torchao swiglu_mlp"}[variant])


def moe_case(c: Cost, variant: str, tokens: int, experts: int, topk: int, d: int, ffn: int) -> None:
    """The routed expert block fwd+bwd: tokens x topk rows, as a SwiGLU MLP with ``experts`` weights."""
    _swiglu(c, variant, tokens * topk, d, ffn, weights=experts)
    c.launch({"bf16_grouped_mm": "bf16 grouped moe", "bf16_per_expert": "bf16 per-expert moe",
              "fp8_current": "fp8 grouped moe current", "fp8_delayed": "fp8 grouped moe delayed"}[variant])


def block_case(c: Cost, variant: str, d_model: int, n_layers: int, n_heads: int, ffn: int, batch: int,
               seq: int, vocab_size: int = 256) -> None:
    """The TinyLlama training step (fwd, bwd, AdamW) at ``batch`` x ``seq`` tokens, per layer: q, k, v, o
    [d, d] and the SwiGLU MLP; causal attention (fwd 2 x 2 T seq d / 2 FLOPs, bwd 2.5 x fwd) at the bf16
    rate; norms, RoPE and residuals ~20 bf16 passes over [T, d] (40 B/elem, an estimate); the LM head in
    bf16; the optimizer over all parameters."""
    T = batch * seq
    fp8 = variant != "bf16 inductor"
    delayed = variant == "fp8-smooth-fp8adam"  # the recipe's default scaling; torchao: tensorwise current
    for _ in range(n_layers):
        c.gemm(T, d_model, d_model, fp8, count=4 * 3)
        for elems in (T * d_model,) * 4 * 2 + (d_model * d_model,) * 4:  # x, dy of q/k/v/o; weights
            if fp8:
                c.cast(elems, delayed)
        _swiglu(c, "fp8_delayed" if delayed else ("torchao" if fp8 else "bf16"), T, d_model, ffn)
        c.flops(2 * 2 * T * seq * d_model / 2 * 3.5)  # causal attention, fwd + bwd
        c.stream(40 * T * d_model)
    c.gemm(T, d_model, vocab_size, False, count=3)
    params = n_layers * (4 * d_model**2 + 3 * d_model * ffn) + 2 * vocab_size * d_model
    tensors = n_layers * 9 + 3  # 7 linears and 2 norms a layer; embedding, final norm, LM head
    adam_case(c, "fp8pass AdamW" if delayed else "torch fused AdamW", params, tensors)
    if delayed:
        c.launch("fp8_linear delayed", 4 * n_layers)
        c.launch("swiglu_mlp channel delayed", n_layers)
        c.launch("bf16 block layer", n_layers)
    else:
        c.launch("torchao block layer" if fp8 else "bf16 block layer", n_layers)


CASES = {"gemm": linear_case, "cast": cast_case, "adam": adam_case, "mlp": mlp_case, "moe": moe_case,
         "train": block_case}


def predict(kind: str, variant: str, shape: dict, inputs: Inputs | None = None) -> dict:
    """Predicted H200 time of one case.

    Args:
        kind: "gemm" (a linear fwd+bwd), "cast", "adam", "mlp", "moe" or "train".
        variant: the case's variant as gpu_bench names it (e.g. "bf16", "fp8_delayed").
        shape: the case function's keyword arguments (e.g. ``{"M": 15872, "K": 4096, "N": 4096}``).
        inputs: launch and static counts (default: :func:`load_inputs`).

    Returns:
        ``{"predicted_ms", "predicted_graph_ms", "terms", "defaults"}``.
    """
    if kind not in CASES:
        raise ValueError(f"unknown case kind {kind!r}; valid: {', '.join(CASES)}")
    c = Cost(inputs if inputs is not None else load_inputs())
    CASES[kind](c, variant, **shape)
    return c.result()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="the --smoke shapes instead of the GPU's")
    ap.add_argument("--json", type=Path, help="write the predictions here too")
    a = ap.parse_args(argv)
    from benchmarks import gpu_bench  # its case list (torch-free at import)

    inputs = load_inputs()
    out = {"inputs": {"launches": str(LAUNCHES_JSON.relative_to(ROOT)) if LAUNCHES_JSON.exists() else "default",
                      "static": f"{STATIC_JSON.relative_to(ROOT)} (triton {inputs.static_version})"
                      if inputs.static_version else "default"}, "cases": {}, "goals": {}}
    print(f"inputs: launches {out['inputs']['launches']}, static counts {out['inputs']['static']}")
    for stage in gpu_bench.BENCH_STAGES:
        for name, (kind, variant, shape) in gpu_bench.stage_cases(stage, "smoke" if a.smoke else "gpu").items():
            p = predict(kind, variant, shape, inputs)
            out["cases"].setdefault(stage, {})[name] = p
            print(f"{stage:>5} {name:<34} {p['predicted_ms']:9.3f} ms (graph {p['predicted_graph_ms']:8.3f})"
                  f"  launches {p['terms']['launches']:5d}{'  ' + ', '.join(p['defaults']) if p['defaults'] else ''}")
    print()
    for key, goal in gpu_bench.GOALS.items():
        v = goal.value({s: {k: {"ms": p["predicted_ms"]} for k, p in cs.items()} for s, cs in out["cases"].items()})
        out["goals"][key] = v
        target = f"goal {goal.op} {goal.target}" if goal.op else "(reported)"
        print(f"{goal.what:<70} predicted {v:7.3f}  {target}" if v is not None else f"{goal.what:<70} not predicted")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
