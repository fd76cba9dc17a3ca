"""The GPU benchmarks of benchmarks/gpu_check.sh and the one results file they share, gpu_check.json.

    python -m benchmarks.gpu_bench run STAGE OUT [--mode gpu|smoke|quick]  # one stage, cases into OUT/gpu_check.json
    python -m benchmarks.gpu_bench start|record|finish OUT ...          # the script's bookkeeping (no torch)

Stages (each its own process and timeout in gpu_check.sh, so one hang cannot eat the budget), in the
order they run, every case written to gpu_check.json as soon as it is measured:
    train   the TinyLlama ``block`` training step (d_model 2048, ffn 5632, 16 heads, 2 layers, 16 x 2048
            tokens): fp8-smooth-fp8adam (the fp8 backend, fp8pass AdamW) / bf16 Inductor (torch fused
            AdamW) / torchao float8 tensorwise (compiled, when a carried wheel provides it), peak memory
    gemm    one linear layer fwd+bwd, compiled: BF16 / FP8 incl. casts (current, delayed scaling) at
            Transformer Engine's 5B shapes (M 15872; K x N 4096x4096, 4096x16384, 16384x4096), the cast
            kernels' bandwidth (amax + cast, transpose-cast) / a copy's, 8192^3, the CUDA graphs, then
            torchao Float8Linear tensorwise at the 5B shapes
    adam    FP8 AdamW step / torch fused AdamW step at 1B parameters (8 tensors of 125M), state bytes
    mlp     Smooth-SwiGLU MLP fwd+bwd, compiled, fp8 (current, delayed) / bf16 / torchao, 16384 tokens x
            4096 -> 14336 -> 4096 (Llama-3-8B's MLP)
    moe     MoE expert block fwd+bwd (benchmarks/moe.py), compiled: FP8 grouped ops (current, delayed) /
            bf16 ``torch._grouped_mm`` / bf16 per-expert loop, 8192 tokens, top-2 of 8 experts, 4096 -> 14336

Timing: medians of interleaved rounds (CUDA events on the GPU). gemm, mlp and moe time ``torch.compile``
(Inductor) forward functions; each of their cases is then captured in a CUDA graph and its replay timed
too (``graph_ms``), or the reason it cannot be captured is recorded. The train step is timed compiled,
without a graph (its steps are >= 20 ms; capturing them needs capturable optimizers, tested in tests/gpu).
Every case carries the cost model's prediction (benchmarks/gpu_cost.py) beside its measurement.

Modes: ``gpu`` (the H200's shapes), ``smoke`` (tiny shapes on the CPU, compiled, Triton interpreted: the
full CPU check of the script) and ``quick`` (tiny shapes on the CPU, eager, the fewest rounds: the
harness check tests/project/test_gpu_check.py runs in CI). CPU numbers mean nothing.

``FP8PASS_GPU_CHECK_FAIL=STAGE`` makes that stage raise right after its first case is recorded (a test
hook: the failure must land in gpu_check.json with its traceback while the other stages still run).

This module imports torch only inside the stages: the bookkeeping commands run between stages in a
fraction of a second.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JSON_NAME, MD_NAME, LOG_NAME, JUNIT_NAME = "gpu_check.json", "gpu_check.md", "gpu_check.log", "gpu_tests.xml"
MAX_OUT_FILES = 8  # the device returns at most 8 files from $OUT
LOG_TAIL_LINES = 60
BENCH_STAGES = ("train", "gemm", "adam", "mlp", "moe")  # the goal stages, in the order they run
MODES = ("gpu", "smoke", "quick")
FAIL_ENV = "FP8PASS_GPU_CHECK_FAIL"

# Transformer Engine's 5B-model GEMM shapes: M tokens, (K, N) per linear of a layer
TE_5B_M = 15872
TE_5B_KN = ((4096, 4096), (4096, 16384), (16384, 4096))


def stage_cases(stage: str, mode: str) -> dict:
    """The cases of a benchmark stage, in the order they are measured: ``{name: (kind, variant, shape)}``
    (``kind``/``variant``/``shape`` as :func:`benchmarks.gpu_cost.predict` takes them).

    Args:
        stage: one of ``BENCH_STAGES``.
        mode: "gpu" (the H200's shapes) or "smoke"/"quick" (tiny CPU shapes, same names).
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; valid: {', '.join(MODES)}")
    tiny = mode != "gpu"
    if stage == "train":
        shape = (dict(d_model=64, n_layers=1, n_heads=2, ffn=160, batch=1, seq=32) if tiny else
                 dict(d_model=2048, n_layers=2, n_heads=16, ffn=5632, batch=16, seq=2048))
        return {v: ("train", v, shape) for v in ("bf16 inductor", "fp8-smooth-fp8adam", "torchao float8 tensorwise")}
    if stage == "gemm":
        shapes = [(f"5b {k}x{n}", TE_5B_M, k, n) for k, n in TE_5B_KN] + [("8192^3", 8192, 8192, 8192)]
        if tiny:
            shapes = [(label, 64, k // 128, n // 128) for label, _, k, n in shapes]
        out = {f"{label} {v}": ("gemm", v, {"M": m, "K": k, "N": n})
               for label, m, k, n in shapes for v in ("bf16", "fp8_current", "fp8_delayed")}
        rc = (256, 256) if tiny else (16384, 8192)
        out.update({f"cast {v}": ("cast", v, {"rows": rc[0], "cols": rc[1]})
                    for v in ("copy", "amax_cast", "transpose_cast")})
        out.update({f"{label} torchao": ("gemm", "torchao", {"M": m, "K": k, "N": n})
                    for label, m, k, n in shapes if label.startswith("5b")})  # measured last, CUDA only
        return out
    if stage == "adam":
        per, count = (4096, 2) if mode == "quick" else (25_000, 4) if tiny else (125_000_000, 8)
        return {v: ("adam", v, {"params": per * count, "tensors": count}) for v in ("torch fused AdamW", "fp8pass AdamW")}
    if stage == "mlp":
        shape = dict(tokens=64, d=64, ffn=160) if tiny else dict(tokens=16384, d=4096, ffn=14336)
        return {v: ("mlp", v, shape) for v in ("bf16", "fp8_current", "fp8_delayed", "torchao")}
    if stage == "moe":
        shape = (dict(tokens=64, experts=4, topk=2, d=64, ffn=128) if tiny else
                 dict(tokens=8192, experts=8, topk=2, d=4096, ffn=14336))
        return {v: ("moe", v, shape) for v in ("bf16_grouped_mm", "bf16_per_expert", "fp8_current", "fp8_delayed")}
    raise ValueError(f"unknown stage {stage!r}; valid: {', '.join(BENCH_STAGES)}")


@dataclass(frozen=True)
class Goal:
    """``factor * sum(times of num) / sum(times of den)`` over one stage's cases, against a target."""

    what: str
    stage: str
    num: tuple
    den: tuple
    op: str | None = None     # ">=" / "<=", None: reported only
    target: float | None = None
    factor: float = 1.0

    def value(self, cases_by_stage: dict, key: str = "ms") -> float | None:
        """The ratio from ``cases_by_stage[stage][case][key]``; None while any of its cases is missing."""
        cases = cases_by_stage.get(self.stage) or {}
        try:
            n = sum(cases[c][key] for c in self.num)
            d = sum(cases[c][key] for c in self.den)
        except (KeyError, TypeError):
            return None
        return self.factor * n / d if d else None

    def met(self, v: float | None) -> str:
        if v is None or self.op is None:
            return ""
        return "yes" if (v >= self.target if self.op == ">=" else v <= self.target) else "NO"


_5B = [f"5b {k}x{n}" for k, n in TE_5B_KN]
GOALS = {  # issue 28's GPU goals; time ratios unless the text says bandwidth
    "train_block_fp8_over_bf16_inductor": Goal("block step time fp8-smooth-fp8adam / bf16 Inductor", "train",
                                               ("fp8-smooth-fp8adam",), ("bf16 inductor",), "<=", 0.77),
    "train_block_fp8_over_torchao": Goal("block step time fp8-smooth-fp8adam / torchao float8 tensorwise", "train",
                                         ("fp8-smooth-fp8adam",), ("torchao float8 tensorwise",), "<=", 1.0),
    "gemm_5b_current_speedup": Goal("5B layer GEMMs fwd+bwd incl. casts: BF16 time / FP8 current", "gemm",
                                    tuple(f"{s} bf16" for s in _5B), tuple(f"{s} fp8_current" for s in _5B),
                                    ">=", 1.55),
    "gemm_5b_delayed_speedup": Goal("5B layer GEMMs fwd+bwd incl. casts: BF16 time / FP8 delayed", "gemm",
                                    tuple(f"{s} bf16" for s in _5B), tuple(f"{s} fp8_delayed" for s in _5B),
                                    ">=", 1.65),
    "gemm_5b_current_over_torchao": Goal("5B layer GEMMs fwd+bwd incl. casts: FP8 current time / torchao tensorwise",
                                         "gemm", tuple(f"{s} fp8_current" for s in _5B),
                                         tuple(f"{s} torchao" for s in _5B)),
    "gemm_8192_delayed_speedup": Goal("8192^3 linear fwd+bwd: BF16 time / FP8 delayed", "gemm",
                                      ("8192^3 bf16",), ("8192^3 fp8_delayed",)),
    "cast_amax_bw_fraction": Goal("amax + cast bandwidth / copy bandwidth", "gemm", ("cast copy",),
                                  ("cast amax_cast",), ">=", 0.85, factor=3 / 4),
    "transpose_cast_bw_fraction": Goal("transpose-cast bandwidth / copy bandwidth", "gemm", ("cast copy",),
                                       ("cast transpose_cast",), ">=", 0.85),
    "adam_1b_ratio": Goal("FP8 AdamW step / torch fused AdamW step, 1B params", "adam", ("fp8pass AdamW",),
                          ("torch fused AdamW",), "<=", 1.0),
    "mlp_fp8_current_over_bf16": Goal("Smooth-SwiGLU MLP fwd+bwd time fp8 current / bf16", "mlp",
                                      ("fp8_current",), ("bf16",)),
    "mlp_fp8_delayed_over_bf16": Goal("Smooth-SwiGLU MLP fwd+bwd time fp8 delayed / bf16", "mlp",
                                      ("fp8_delayed",), ("bf16",)),
    "mlp_fp8_current_over_torchao": Goal("Smooth-SwiGLU MLP fwd+bwd time fp8 current / torchao", "mlp",
                                         ("fp8_current",), ("torchao",)),
    "moe_current_speedup": Goal("MoE expert block fwd+bwd: bf16 grouped_mm time / FP8 current", "moe",
                                ("bf16_grouped_mm",), ("fp8_current",), ">=", 1.3),
    "moe_delayed_speedup": Goal("MoE expert block fwd+bwd: bf16 grouped_mm time / FP8 delayed", "moe",
                                ("bf16_grouped_mm",), ("fp8_delayed",), ">=", 1.3),
}


# -- the results file: every writer goes through Results.update --------------------------------------


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def out_files(folder: Path) -> list[str]:
    """Every file under ``folder`` (what the device would have to return), relative paths."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


class Results:
    """gpu_check.json (and the gpu_check.md rendered from it) in ``folder``, rewritten atomically on every
    update: a temp file in the same folder, then ``os.replace``, so a kill at any moment leaves the last
    complete version. One temp file at a time, so the script's files stay <= 8 (the device's limit)."""

    def __init__(self, folder):
        self.dir = Path(folder)
        self.path = self.dir / JSON_NAME

    def load(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except json.JSONDecodeError as e:  # only a full disk could do this (writes are atomic): start over
            return {"notes": [f"{JSON_NAME} was unreadable ({e}); earlier records are lost"]}

    def update(self, fn) -> dict:
        """Apply ``fn(doc)`` to the stored document and write it (and the md) back."""
        doc = self.load()
        fn(doc)
        files = out_files(self.dir)
        doc["out_files"] = files
        seen = len(set(files) | {JSON_NAME, MD_NAME}) + 1  # the most at once while writing: + one temp file
        doc["max_out_files"] = max(doc.get("max_out_files", 0), seen)
        if seen > MAX_OUT_FILES:
            note = f"{seen} files under OUT, over the device's {MAX_OUT_FILES} (it returns only some): {files}"
            if note not in doc.setdefault("notes", []):
                doc["notes"].append(note)
        doc["updated"] = _now()
        self._write(JSON_NAME, json.dumps(doc, indent=1, default=str))
        self._write(MD_NAME, to_markdown(doc))
        return doc

    def _write(self, name: str, text: str) -> None:
        tmp = self.dir / (name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.dir / name)


def stage_doc(doc: dict, stage: str) -> dict:
    return doc.setdefault("stages", {}).setdefault(stage, {"status": "not run"})


def _fmt(v, nd=3) -> str:
    return "" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))


def to_markdown(doc: dict) -> str:
    """The table of goals (measured beside predicted), then stages, cases and failures."""
    stages = doc.get("stages", {})
    cases = {s: d.get("cases", {}) for s, d in stages.items()}
    lines = []
    if doc.get("mode", "gpu") != "gpu":
        lines += [f"**mode {doc.get('mode')}: tiny shapes on the CPU, a check of the script; these numbers "
                  "mean nothing.**", ""]
    env = doc.get("env", {})
    if env:
        lines += [f"{env.get('gpu') or 'no GPU'}; torch {env.get('torch')}, triton {env.get('triton')}, "
                  f"torchao {env.get('torchao')}, python {env.get('python')}", ""]
    lines += ["| goal | measured | CUDA graph | predicted | target | met |", "|---|---|---|---|---|---|"]
    for g in GOALS.values():
        v = g.value(cases)
        target = f"{g.op} {g.target}" if g.op else "(reported)"
        lines.append(f"| {g.what} | {_fmt(v) or 'not measured'} | {_fmt(g.value(cases, 'graph_ms'))} "
                     f"| {_fmt(g.value(cases, 'predicted_ms'))} | {target} | {g.met(v)} |")
    lines += ["", "| stage | status | seconds | limit s |", "|---|---|---|---|"]
    for name, s in stages.items():
        lines.append(f"| {name} | {s.get('status')} | {_fmt(s.get('seconds'), 0)} | {_fmt(s.get('limit_s'))} |")
    lines += ["", "| stage | case | ms | graph ms | predicted ms | predicted graph ms |", "|---|---|---|---|---|---|"]
    for name, cs in cases.items():
        for case, row in cs.items():
            ms = _fmt(row.get("ms")) or (f"ERROR `{row['error'][:100]}`" if row.get("error") else "")
            lines.append(f"| {name} | {case} | {ms} | {_fmt(row.get('graph_ms')) or row.get('graph', '')} "
                         f"| {_fmt(row.get('predicted_ms'))} | {_fmt(row.get('predicted_graph_ms'))} |")
    for name, s in stages.items():
        for note in s.get("notes", []):
            lines.append(f"\n{name}: {note}")
        if s.get("tests"):
            t = s["tests"]
            lines.append(f"\n{name}: " + ", ".join(f"{k} {v}" for k, v in t.items() if isinstance(v, int)))
            for f in t.get("failed", [])[:40]:
                lines.append(f"- FAILED {f}")
        if s.get("traceback"):
            last = s["traceback"].strip().splitlines()[-1]
            lines.append(f"\n{name} {s.get('status')}" + (f" in case `{s['running_case']}`" if s.get("running_case") else "")
                         + f": `{last}` (traceback and the last log lines in gpu_check.json)")
    for note in doc.get("notes", []):
        lines.append(f"\n{note}")
    return "\n".join(lines) + "\n"


# -- one stage's bookkeeping, inside its process ------------------------------------------------------


class InjectedFailure(RuntimeError):
    """Raised by ``FP8PASS_GPU_CHECK_FAIL`` (a test hook): it ends its stage, unlike a case's own error."""


class StageRun:
    """What a stage reports, each piece written to gpu_check.json at once.

    Args:
        results: the shared results file.
        stage: the stage's name.
        mode: "gpu", "smoke" or "quick".
    """

    def __init__(self, results: Results, stage: str, mode: str):
        from benchmarks import gpu_cost

        self.results, self.stage, self.mode = results, stage, mode
        self.device = "cuda" if mode == "gpu" else "cpu"
        self.plan = stage_cases(stage, mode)
        self.inject = os.environ.get(FAIL_ENV, "") == stage
        self.failed: list = []  # (case, traceback) of the cases that raised
        try:
            from importlib.metadata import version

            triton_version = version("triton")
        except Exception:  # no triton distribution: the model's default version
            triton_version = gpu_cost.DEVICE_TRITON
        self._predict = gpu_cost.predict
        try:
            self.cost_inputs = gpu_cost.load_inputs(triton_version=triton_version)
        except (ValueError, KeyError, TypeError) as e:  # a malformed input file costs the model, not the run
            self.cost_inputs = gpu_cost.Inputs()
            self.note(f"cost model on its defaults: {type(e).__name__}: {e}"[:300])

    def _edit(self, fn) -> None:
        self.results.update(lambda doc: fn(stage_doc(doc, self.stage)))

    def running(self, case: str) -> None:
        """Say which case runs now (a kill leaves it named)."""
        self._edit(lambda s: s.update(running_case=case))

    def case(self, name: str, **row) -> None:
        """Record one measured case with its prediction; ``FP8PASS_GPU_CHECK_FAIL`` raises after the first."""
        if name in self.plan:
            kind, variant, shape = self.plan[name]
            try:
                p = self._predict(kind, variant, shape, self.cost_inputs)
                row.update(predicted_ms=p["predicted_ms"], predicted_graph_ms=p["predicted_graph_ms"],
                           cost_terms=p["terms"], cost_defaults=p["defaults"], shape=shape)
            except Exception as e:  # the measurement is kept whatever the model does
                row.update(predicted_error=f"{type(e).__name__}: {e}"[:300], shape=shape)

        def put(s):
            s.setdefault("cases", {}).setdefault(name, {}).update(row)
            s.pop("running_case", None)
        self._edit(put)
        if self.inject:
            raise InjectedFailure(f"injected failure in stage {self.stage} after case {name!r} ({FAIL_ENV})")

    def guarded(self, name: str, fn) -> bool:
        """Run one case's ``fn``; an error is recorded on the case (with its traceback) and the stage goes
        on with its other cases, then ends failed. An injected failure ends the stage at once."""
        try:
            fn()
            return True
        except InjectedFailure:
            raise
        except Exception as e:
            tb = traceback.format_exc()
            error = f"{type(e).__name__}: {e}"[:500]  # `e` is unbound after the except block
            print(tb, flush=True)
            self.failed.append((name, tb))
            self._edit(lambda s: s.setdefault("cases", {}).setdefault(name, {}).update(error=error, traceback=tb))
            self._edit(lambda s: s.pop("running_case", None))
            return False

    def note(self, text: str) -> None:
        print(f"{self.stage}: {text}")
        self._edit(lambda s: s.setdefault("notes", []).append(text))

    def values(self, **kv) -> None:
        """Numbers of the stage that are not cases (state bytes, peak memory, shapes)."""
        self._edit(lambda s: s.setdefault("values", {}).update(kv))


# -- timing (torch) -----------------------------------------------------------------------------------


def _median_ms(cases: dict, device: str, repeat: int, warmup: int = 2, inner: int = 1) -> dict:
    """Median ms per call of each case over ``repeat`` interleaved rounds of ``inner`` calls each (CUDA
    events on the GPU: the host runs ahead within a round, so short kernels are not timed with a launch)."""
    import torch

    for fn in cases.values():
        for _ in range(warmup):
            fn()
    times = {k: [] for k in cases}
    if device == "cuda":
        events = {k: [] for k in cases}
        for _ in range(repeat):
            for k, fn in cases.items():
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(inner):
                    fn()
                b.record()
                events[k].append((a, b))
        torch.cuda.synchronize()
        times = {k: [a.elapsed_time(b) / inner for a, b in ev] for k, ev in events.items()}
    else:
        for _ in range(repeat):
            for k, fn in cases.items():
                t = time.perf_counter()
                for _ in range(inner):
                    fn()
                times[k].append((time.perf_counter() - t) * 1e3 / inner)
    return {k: statistics.median(v) for k, v in times.items()}


def _graph_ms(step, repeat: int) -> float:
    """Capture ``step`` in a CUDA graph (after warm-up on a side stream, as torch's docs do) and time
    its replays."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    ms = _median_ms({"graph": g.replay}, "cuda", repeat, warmup=1)["graph"]
    del g
    return ms


def _time_steps(run: StageRun, steps: dict, repeat: int, inner: int = 1) -> None:
    """Time each step, recording each case as soon as it is measured."""
    warmup = 1 if run.mode == "quick" else 2
    for name, step in steps.items():
        run.running(name)
        run.guarded(name, lambda: run.case(name, ms=_median_ms({name: step}, run.device, repeat, warmup, inner)[name]))


def _graph_steps(run: StageRun, steps: dict, repeat: int) -> None:
    """On the GPU, each step's CUDA-graph replay, or why it cannot be captured. Runs after every plain
    timing of the stage, so a capture that breaks the CUDA context costs no other number."""
    if run.device != "cuda":
        return
    import torch

    for name, step in steps.items():
        run.running(name + " (CUDA graph)")
        try:
            run.case(name, graph_ms=_graph_ms(step, repeat), graph="ok")
        except Exception as e:  # not capturable: say why, and go on with the next case
            msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
            run.case(name, graph=f"not captured ({type(e).__name__}: {msg})"[:300])
            try:
                torch.cuda.synchronize()
            except Exception as e2:  # the failed capture broke the context: no further graphs
                run.note(f"CUDA graphs stopped after {name}: {type(e2).__name__}: {e2}"[:300])
                return


def _lazy(build):
    """A step built at its first call, so that building it (torchao's conversion) fails as its case."""
    built = []

    def step():
        if not built:
            built.append(build())
        built[0]()
    return step


def _compile(run: StageRun):
    """``torch.compile`` (Inductor, static shapes) on the GPU and in smoke mode; eager in quick mode."""
    import torch

    if run.mode == "quick":
        return lambda fn: fn
    return lambda fn: torch.compile(fn, dynamic=False)


def _torchao_available() -> str | None:
    """None when torchao's float8 training converts modules here, else why not."""
    try:
        from torchao.float8 import convert_to_float8_training  # noqa: F401
    except ImportError:
        return ("not installed in this image (its wheel carries compiled CUDA extensions, so it is not "
                "committed; carry one in .whl/ to compare)")
    return None


# -- stages -------------------------------------------------------------------------------------------


def stage_gemm(run: StageRun) -> None:
    """The 5B shapes first (the goal), then the casts, then 8192^3, then every GEMM case's CUDA graph."""
    import torch

    from benchmarks.linear import linear_cases

    dtype = torch.bfloat16 if run.device == "cuda" else torch.float32
    repeat = {"gpu": 20, "smoke": 3, "quick": 1}[run.mode]
    shapes: dict = {}
    for name, (kind, variant, shape) in run.plan.items():
        if kind == "gemm":
            shapes.setdefault((shape["M"], shape["K"], shape["N"]), {})[variant] = name
    steps, tensors = {}, {}
    for i, ((m, k, n), names) in enumerate(shapes.items()):
        cases, tensors[names["bf16"].rsplit(" ", 1)[0]] = linear_cases(m, k, n, torch.device(run.device), dtype,
                                                                        wrap=_compile(run))
        these = {names[v]: cases["baseline" if v == "bf16" else v] for v in names if v != "torchao"}
        _time_steps(run, these, repeat)
        steps.update(these)
        if i == len(TE_5B_KN) - 1:
            _cast_bandwidth(run, repeat)
    _graph_steps(run, steps, repeat)
    why = "its float8 path needs CUDA (_scaled_mm)" if run.device != "cuda" else _torchao_available()
    if why is not None:
        run.note(f"torchao skipped: {why}")
        return
    from benchmarks.linear import torchao_case  # Float8Linear tensorwise, compiled

    dev = torch.device(run.device)
    _time_steps(run, {name: _lazy(lambda t=tensors[name.rsplit(" ", 1)[0]]: torchao_case("linear", t, dev))
                      for name in run.plan if name.endswith(" torchao")}, repeat)


def _cast_bandwidth(run: StageRun, repeat: int) -> None:
    """The cast kernels on one bf16 tensor, beside a copy of it (bytes: gpu_cost.cast_case)."""
    import torch

    from fp8pass.numerics import E4M3

    try:  # off the GPU: in the interpreter (TRITON_INTERPRET=1)
        from fp8pass.kernels import triton_family, triton_operand_casts
        cast_scaled, transpose_cast = triton_family.cast_scaled, triton_operand_casts.transpose_cast
    except (ImportError, AttributeError) as e:  # the kernels moved: the GEMM numbers still count
        run.note(f"cast kernels not timed: {type(e).__name__}: {e}")
        return

    _, _, shape = run.plan["cast copy"]
    x = torch.randn(shape["rows"], shape["cols"], device=run.device, dtype=torch.bfloat16)
    s = torch.tensor(8.0, device=run.device)
    cases = {"cast copy": lambda: x.clone(),
             "cast amax_cast": lambda: cast_scaled(x, s, E4M3, want_amax=True),
             "cast transpose_cast": lambda: transpose_cast(x, s, E4M3)}
    _time_steps(run, cases, repeat, inner=10 if run.device == "cuda" else 1)


def stage_mlp(run: StageRun) -> None:
    import torch

    from benchmarks.linear import mlp_cases, torchao_case

    dtype = torch.bfloat16 if run.device == "cuda" else torch.float32
    shape = run.plan["bf16"][2]
    dev = torch.device(run.device)
    cases, tensors = mlp_cases(shape["tokens"], shape["d"], shape["ffn"], dev, dtype, wrap=_compile(run))
    steps = {"bf16": cases["baseline"], "fp8_current": cases["fp8_current"], "fp8_delayed": cases["fp8_delayed"]}
    why = "its float8 path needs CUDA (_scaled_mm)" if run.device != "cuda" else _torchao_available()
    if why is None:
        steps["torchao"] = _lazy(lambda: torchao_case("mlp", tensors, dev))
    else:
        run.note(f"torchao skipped: {why}")
    repeat = {"gpu": 10, "smoke": 3, "quick": 1}[run.mode]
    _time_steps(run, steps, repeat)
    _graph_steps(run, steps, repeat)


def stage_moe(run: StageRun) -> None:
    import torch

    from benchmarks import moe

    shape = run.plan["bf16_grouped_mm"][2]
    fns, offs = moe.cases(shape["tokens"], shape["experts"], shape["topk"], shape["d"], shape["ffn"],
                          torch.device(run.device), wrap=_compile(run))
    run.values(rows_per_expert=torch.diff(offs.cpu(), prepend=offs.new_zeros(1).cpu()).tolist())
    steps = {k: fns[k] for k in run.plan}
    repeat = {"gpu": 10, "smoke": 3, "quick": 1}[run.mode]
    _time_steps(run, steps, repeat)
    _graph_steps(run, steps, repeat)


def stage_train(run: StageRun) -> None:
    import torch

    from fp8pass.train import ModelConfig

    shape = dict(run.plan["bf16 inductor"][2])
    batch, seq = shape.pop("batch"), shape.pop("seq")
    cfg = ModelConfig(**shape, max_seq_len=seq)
    device = run.device
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0)).to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    compiler = "aot_eager" if run.mode == "quick" else "inductor"  # quick: no C++/Triton codegen on the CPU
    repeat = {"gpu": 10, "smoke": 3, "quick": 1}[run.mode]
    run.values(config=cfg.to_dict(), batch=batch, seq=seq)
    for name in run.plan:
        if name.startswith("torchao"):
            why = "its float8 path needs CUDA (_scaled_mm)" if device != "cuda" else _torchao_available()
            if why is not None:
                run.note(f"torchao skipped: {why}")
                continue
        run.running(name)
        run.guarded(name, lambda: _train_case(run, name, cfg, x, y, dtype, compiler, repeat))
        if device == "cuda":
            torch.cuda.empty_cache()
    bf16 = (run.results.load().get("stages", {}).get("train", {}).get("cases", {}).get("bf16 inductor") or {})
    if "ms" in bf16:
        run.values(bf16_step_at_least_20ms=bf16["ms"] >= 20.0)


def _train_case(run: StageRun, name: str, cfg, x, y, dtype, compiler: str, repeat: int) -> None:
    """One variant of the block step: build, first step (compile), timed steps, peak memory."""
    import torch

    from fp8pass.train import TinyLlama
    from fp8pass.train.recipes import build_optimizer, get_recipe, prepare_model

    device = run.device
    torch.manual_seed(0)
    model = TinyLlama(cfg).to(device)
    if name == "fp8-smooth-fp8adam":
        recipe = get_recipe(name)
        fwd = prepare_model(model, recipe, compiler=compiler)
        opt = build_optimizer(model, recipe, lr=1e-4, weight_decay=0.1)
    else:
        if name.startswith("torchao"):
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

            convert_to_float8_training(
                model, config=Float8LinearConfig.from_recipe_name("tensorwise"),
                module_filter_fn=lambda mod, fqn: "lm_head" not in fqn and "embed" not in fqn)
        fwd = model if run.mode == "quick" else torch.compile(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=device == "cuda")

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32):
            loss = fwd(x, y)
        loss.backward()
        opt.step()

    t0 = time.perf_counter()
    step()  # compile, optimizer state, autotuning
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    first_s = time.perf_counter() - t0
    row = {"ms": _median_ms({name: step}, device, repeat, warmup=1)[name], "first_step_s": first_s}
    if device == "cuda":
        row["peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    run.case(name, **row)


def stage_adam(run: StageRun) -> None:
    import torch

    shape = run.plan["fp8pass AdamW"][2]
    count = shape["tensors"]
    per = shape["params"] // count
    device = run.device
    g = torch.Generator(device).manual_seed(0)
    for name in run.plan:
        run.running(name)
        run.guarded(name, lambda: _adam_case(run, name, per, count, g))
        if device == "cuda":
            torch.cuda.empty_cache()


def _adam_case(run: StageRun, name: str, per: int, count: int, g) -> None:
    import torch

    import fp8pass.optim as fo

    device = run.device
    params = [torch.nn.Parameter(torch.randn(per, device=device, generator=g)) for _ in range(count)]
    for p in params:
        p.grad = torch.randn(per, device=device, generator=g) * 1e-3
    if name.startswith("torch"):
        opt = torch.optim.AdamW(params, lr=1e-4, fused=device == "cuda", foreach=None if device == "cuda" else True)
    else:
        opt = fo.AdamW(params, lr=1e-4)
    opt.step()  # state, autotuning
    ms = _median_ms({name: opt.step}, device, {"gpu": 10, "smoke": 3, "quick": 1}[run.mode], warmup=1)[name]
    state = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0)
    run.case(name, ms=ms, state_bytes_per_param=state / (per * count))


STAGES = {"train": stage_train, "gemm": stage_gemm, "adam": stage_adam, "mlp": stage_mlp, "moe": stage_moe}


def run_stage(stage: str, folder: Path, mode: str) -> int:
    """Run one benchmark stage; an exception is recorded with its traceback, then re-raised."""
    import faulthandler
    import signal

    # `timeout` sends SIGTERM first: dump every thread's Python stack into the log (where it was stuck)
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    results = Results(folder)
    try:
        if mode == "gpu":
            import torch

            if not torch.cuda.is_available():
                raise RuntimeError("mode gpu needs CUDA (FP8PASS_GPU_CHECK_CPU=1 or quick runs the CPU check)")
        if "env" not in results.load():  # the first stage to run records the environment
            record_env(results)
        run = StageRun(results, stage, mode)
        STAGES[stage](run)
    except BaseException:
        tb = traceback.format_exc()
        results.update(lambda doc: stage_doc(doc, stage).update(status="failed", traceback=tb))
        raise
    if run.failed:  # the stage ran on past its failing cases; the first one's traceback stands for it
        names = [n for n, _ in run.failed]
        results.update(lambda doc: stage_doc(doc, stage).update(
            status="failed", traceback=run.failed[0][1], failed_cases=names))
        print(f"stage {stage}: cases failed: {names}", file=sys.stderr)
        return 1
    return 0


# -- bookkeeping commands of gpu_check.sh (no torch) ------------------------------------------------------


def cmd_start(folder: Path, mode: str, budget: int, plan: str) -> None:
    """A fresh results file: mode, budget and every stage's limit (they must fit the budget)."""
    limits = {k: int(v) for k, v in (p.split("=") for p in plan.split(",") if p)}
    doc = {"mode": mode, "started": _now(), "budget_s": budget, "plan_s": limits,
           "stages": {k: {"status": "not run", "limit_s": v} for k, v in limits.items()}}
    if sum(limits.values()) > budget:
        doc["notes"] = [f"stage limits sum to {sum(limits.values())} s, over the {budget} s budget"]
    folder.mkdir(parents=True, exist_ok=True)
    if (folder / JSON_NAME).exists():
        (folder / JSON_NAME).unlink()
    Results(folder).update(lambda d: d.update(doc))


def record_env(results: Results) -> None:
    """Python, torch, CUDA, Triton, torchao, GPU and CPU facts into the results file."""
    import platform

    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
           "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpus": os.cpu_count(),
           "loadavg": os.getloadavg()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count, gpu_mib=p.total_memory // 2**20)
    for mod in ("triton", "torchao"):
        try:
            env[mod] = __import__(mod).__version__
        except ImportError:
            env[mod] = None
    print("env: " + ", ".join(f"{k} {v}" for k, v in env.items()))
    results.update(lambda d: d.setdefault("env", {}).update(env))


def _log_section(folder: Path, offset: int) -> list[str]:
    try:
        with open(folder / LOG_NAME, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace").splitlines()
    except FileNotFoundError:
        return []


_THREAD = re.compile(r"(Current thread|Thread) 0x[0-9a-f]+")


def find_traceback(lines: list[str]) -> str | None:
    """The last Python traceback in ``lines``: an exception's, or the stack dump faulthandler writes when
    ``timeout`` stops a stage (every thread's stack), whichever comes last."""
    tb = max((i for i, l in enumerate(lines) if l.startswith("Traceback (most recent call last)")), default=-1)
    th = max((i for i, l in enumerate(lines) if _THREAD.match(l)), default=-1)
    if tb < 0 and th < 0:
        return None
    if tb > th:
        j = tb + 1
        while j < len(lines) and lines[j].startswith(" "):
            j += 1
        return "\n".join(lines[tb:j + 1])
    i = th
    while i > 0 and (_THREAD.match(lines[i - 1]) or lines[i - 1].startswith("  File ") or not lines[i - 1].strip()):
        i -= 1  # back over the other threads of the same dump
    while not _THREAD.match(lines[i]):
        i += 1
    j = th + 1
    while j < len(lines) and lines[j].startswith("  File "):
        j += 1
    return "\n".join(lines[i:j])


def _junit(path: Path) -> dict | None:
    import xml.etree.ElementTree as ET

    try:
        root = ET.parse(path).getroot()
    except (FileNotFoundError, ET.ParseError):
        return None
    out = {"passed": 0, "failed": [], "skipped": 0, "from": JUNIT_NAME}
    for tc in root.iter("testcase"):
        name = f"{tc.get('classname')}::{tc.get('name')}"
        bad = tc.find("failure") if tc.find("failure") is not None else tc.find("error")
        if bad is not None:
            out["failed"].append(f"{name}: {(bad.get('message') or '').splitlines()[0][:200] if bad.get('message') else ''}")
        elif tc.find("skipped") is not None:
            out["skipped"] += 1
        else:
            out["passed"] += 1
    out["failed_count"] = len(out["failed"])
    return out


def _pytest_lines(lines: list[str]) -> dict:
    """Test outcomes from ``pytest -v`` lines (what a kill leaves when no junit XML was written)."""
    out = {"passed": 0, "failed": [], "skipped": 0, "from": "log"}
    for l in lines:
        m = re.search(r"(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\s+(tests/\S+)|(tests/\S+::\S+)\s+(PASSED|FAILED|ERROR|SKIPPED)", l)
        if not m:
            continue
        what, name = (m.group(1), m.group(2)) if m.group(1) else (m.group(4), m.group(3))
        if what == "PASSED":
            out["passed"] += 1
        elif what in ("FAILED", "ERROR"):
            out["failed"].append(name)
        elif what == "SKIPPED":
            out["skipped"] += 1
    out["failed_count"] = len(out["failed"])
    return out


def cmd_record(folder: Path, stage: str, limit: int | None, rc: int | None, seconds: float | None,
               log_offset: int | None, skip: str | None, tests: bool) -> None:
    """Start (``limit``), finish (``rc``) or skip a stage in the results file."""
    lines = _log_section(folder, log_offset) if log_offset is not None else []

    def edit(doc):
        s = stage_doc(doc, stage)
        if skip is not None:
            s.update(status=f"skipped: {skip}", seconds=0)
            return
        if rc is None:  # the stage starts
            for k in ("traceback", "log_tail", "running_case", "cases", "notes", "values", "tests"):
                s.pop(k, None)
            s.update(status="running", limit_s=limit, started=_now())
            return
        s["seconds"] = seconds
        if tests:
            s["tests"] = _junit(folder / JUNIT_NAME) if (folder / JUNIT_NAME).exists() else _pytest_lines(lines)
        if rc == 0:
            s["status"] = "ok"
            s.pop("running_case", None)
            return
        timed_out = rc in (124, 137)
        s["status"] = f"timed out after {s.get('limit_s')} s" if timed_out else f"failed (exit {rc})"
        s["log_tail"] = lines[-LOG_TAIL_LINES:]
        found = find_traceback(lines)
        if found and not (s.get("traceback") and not timed_out):
            s["traceback"] = found  # a timeout's stack dump beats the exception the kill raised on the way out
        elif not s.get("traceback"):
            s["traceback"] = "(no Python traceback in the log: see log_tail)"
    Results(folder).update(edit)


def cmd_finish(folder: Path, seconds: float) -> int:
    """Total time; the md table to stdout; exit status 1 when any stage did not end ok."""
    doc = Results(folder).update(lambda d: d.update(seconds=seconds, finished=_now()))
    print((folder / MD_NAME).read_text())
    bad = {k: s.get("status") for k, s in doc.get("stages", {}).items() if s.get("status") != "ok"}
    print(f"gpu_check finished in {seconds:.0f} s; files under OUT: {doc['out_files']} (at most "
          f"{doc['max_out_files']} at once); stages not ok: {bad or 'none'}")
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("run", help="run one benchmark stage")
    p.add_argument("stage", choices=BENCH_STAGES)
    p.add_argument("out", type=Path)
    p.add_argument("--mode", choices=MODES, default="gpu")
    p = sub.add_parser("start", help="a fresh gpu_check.json")
    p.add_argument("out", type=Path)
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--budget", type=int, required=True)
    p.add_argument("--plan", required=True, help="stage=limit_s,... in the order they run")
    p = sub.add_parser("record", help="a stage starts (--limit), ends (--rc) or is skipped (--skip)")
    p.add_argument("out", type=Path)
    p.add_argument("stage")
    p.add_argument("--limit", type=int)
    p.add_argument("--rc", type=int)
    p.add_argument("--seconds", type=float)
    p.add_argument("--log-offset", type=int)
    p.add_argument("--skip")
    p.add_argument("--tests", action="store_true", help="the stage ran pytest: record its outcomes")
    p = sub.add_parser("finish", help="total time, the table to stdout")
    p.add_argument("out", type=Path)
    p.add_argument("--seconds", type=float, required=True)
    a = ap.parse_args(argv)
    if a.cmd == "run":
        return run_stage(a.stage, a.out, a.mode)
    if a.cmd == "start":
        cmd_start(a.out, a.mode, a.budget, a.plan)
    elif a.cmd == "record":
        cmd_record(a.out, a.stage, a.limit, a.rc, a.seconds, a.log_offset, a.skip, a.tests)
    elif a.cmd == "finish":
        return cmd_finish(a.out, a.seconds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
