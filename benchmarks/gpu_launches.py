"""Device kernels and host syncs per op and per training step on CUDA, counted on a CPU.

    TRITON_INTERPRET=1 python -m benchmarks.gpu_launches [--json FILE] [--cases a,b] [--by-op]

The CUDA code path runs on CPU tensors (``FP8PASS_KERNELS=triton``: the CUDA kernel module, its Triton
kernels in the interpreter) under :class:`LaunchCounter`, which counts what would be a device kernel
launch on a GPU:

* every aten op that computes, seen by a ``TorchDispatchMode`` (views, ``empty*`` allocations and
  ``detach`` launch nothing and are not counted; ``fp8pass::`` custom ops are entered, so the aten
  ops they run inside are counted, and the custom op itself is not);
* every Triton kernel launch (a grid call of a ``JITFunction``/interpreted function, autotuner included
  once);
* ``torch._scaled_mm`` / ``torch._scaled_grouped_mm`` as one launch each: :func:`pretend_cuda_gemms`
  makes the CUDA module take the path it takes on a GPU (CPU tensors would take the dequantize
  fallback) and computes the result on the host without counting its math (``_scaled_grouped_mm``:
  the CUDA module's own emulation, after torch's meta function has checked the arguments).

Host syncs are counted beside: ``aten._local_scalar_dense`` / ``aten.item`` (``.item()``, ``bool()``,
``int()``, ``float()``, ``.tolist()`` of a device tensor), ``aten.is_nonzero``, and tensors built from
host data (``aten.lift_fresh``: ``torch.tensor(...)`` on a device is a pageable H2D copy). On a GPU the
same run is checked by ``torch.cuda.set_sync_debug_mode("error")`` (tests/gpu).

Counts are exact (no timing), so tests assert them: tests/kernels/test_launch_budget.py. The numbers and the
goals of issue 28 are recorded in docs/results/gpu.md. Compiled graphs are not counted here: Dynamo does
not run a compiled frame under a dispatch mode (it falls back to eager), so a compiled step's host reads
are checked by tests/passes/test_host_sync.py instead, and its launches on a GPU by the device run.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") != "1":
    # the Triton kernels must run in the interpreter on CPU tensors; set before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

# aten ops that launch no kernel: allocations without a fill, and metadata-only ops
_NO_KERNEL = {
    "aten.empty.memory_format", "aten.empty_strided.default", "aten.empty_like.default", "aten.new_empty.default",
    "aten.new_empty_strided.default", "aten.detach.default", "aten.detach_.default", "aten.alias.default",
    "aten.lift_fresh.default", "aten.resize_.default", "aten.set_.source_Storage_storage_offset",
    "aten.sym_size.int", "aten.sym_stride.int", "aten.sym_numel.default", "aten.sym_storage_offset.default",
    "aten.is_same_size.default", "aten.record_stream.default",
    "aten.promote_types.default",  # a dtype computed on the host
}
# host syncs on a GPU (a read of device memory by the host, or a synchronising H2D copy)
SYNC_OPS = {"aten._local_scalar_dense.default", "aten.item.default", "aten.is_nonzero.default",
            "aten.lift_fresh.default", "aten.equal.default"}


_BELOW_PYTHON = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)  # CPU tensors: their kernels


class LaunchCounter(TorchDispatchMode):
    """Count device kernel launches and host syncs of the code run under it (see the module doc).

    Attributes:
        aten: Counter of the counted aten ops by name.
        triton: Counter of Triton kernel launches by kernel name.
        syncs: Counter of host syncs by op name.
    """

    def __init__(self, where: bool = False):
        super().__init__()
        self.where = collections.Counter() if where else None  # (fp8pass file:function, op) -> launches
        self.aten = collections.Counter()
        self.triton = collections.Counter()
        self.syncs = collections.Counter()
        self._patches = contextlib.ExitStack()
        self._depth = 0
        self.in_kernel = 0  # > 0 while a Triton kernel runs: the interpreter's own tensor copies are not launches

    @property
    def total(self) -> int:
        return sum(self.aten.values()) + sum(self.triton.values())

    def summary(self) -> dict:
        return {"total": self.total, "aten": sum(self.aten.values()), "triton": sum(self.triton.values()),
                "syncs": sum(self.syncs.values())}

    def __enter__(self):
        if self._depth == 0:
            self._patches.enter_context(_count_triton_launches(self))
            self._patches.enter_context(_count_tolist(self))
        self._depth += 1
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._patches.close()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if self.in_kernel or func.namespace == "profiler":
            return func(*args, **kwargs)
        if name in SYNC_OPS:
            self.syncs[name] += 1
        if func.namespace == "fp8pass":  # enter the custom op: count the kernels its implementation runs
            with self:
                return func.redispatch(_BELOW_PYTHON, *args, **kwargs)
        if func.is_view:  # a view launches nothing, unless the op copied: inside a custom op (redispatched
            # below the composite ops) ``contiguous`` / ``reshape`` / ``to`` arrive whole, aliasing in their
            # schema, and copy when they cannot alias
            out = func(*args, **kwargs)
            if _copied(out, args):
                self._count(f"{name} (copy)")
            return out
        if name not in _NO_KERNEL and name not in SYNC_OPS:
            self._count(name)
        return func(*args, **kwargs)

    def _count(self, name: str) -> None:
        self.aten[name] += 1
        if self.where is not None:
            self.where[(_caller(), name)] += 1


def _copied(out, args) -> bool:
    """Whether a view op's tensor result does not share the storage of its input (it made a copy)."""
    src = next((a for a in args if isinstance(a, torch.Tensor)), None)
    outs = out if isinstance(out, (list, tuple)) else [out]
    return src is not None and any(isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr()
                                   != src.untyped_storage().data_ptr() for o in outs)


@contextlib.contextmanager
def _count_tolist(counter: LaunchCounter):
    """``Tensor.tolist`` reads a CPU tensor's memory without dispatching an op (on a GPU tensor it is a
    device-to-host copy and a sync): counted as ``tolist`` in ``counter.syncs``."""
    orig = torch.Tensor.tolist

    def tolist(t, *a, **k):
        if not counter.in_kernel:
            counter.syncs["tolist"] += 1
            if counter.where is not None:
                counter.where[(_caller(), "sync: tolist")] += 1
        return orig(t, *a, **k)

    torch.Tensor.tolist = tolist
    try:
        yield
    finally:
        torch.Tensor.tolist = orig


def _caller() -> str:
    """The innermost fp8pass frame outside the kernel modules that issued a launch ("file:function")."""
    import traceback

    for frame in reversed(traceback.extract_stack()):
        path = frame.filename.replace("\\", "/")
        if "/fp8pass/" in path and "/kernels/" not in path:
            return f"{path.split('/fp8pass/')[-1]}:{frame.name}"
    return "?"


@contextlib.contextmanager
def _count_triton_launches(counter: LaunchCounter):
    """Count grid launches of every Triton kernel (compiled or interpreted) into ``counter.triton``."""
    import triton

    patched = []
    for cls_name in ("JITFunction", "InterpretedFunction"):
        cls = getattr(triton.runtime.jit, cls_name, None)
        if cls is None:
            from triton.runtime import interpreter

            cls = getattr(interpreter, cls_name, None)
        if cls is None or any(cls is c for c, _ in patched):
            continue
        orig = cls.run

        def run(self, *a, _orig=orig, **k):
            if not counter.in_kernel:
                name = getattr(self, "__name__", None) or self.fn.__name__
                counter.triton[name] += 1
                if counter.where is not None:
                    counter.where[(_caller(), name)] += 1
            counter.in_kernel += 1
            try:
                return _orig(self, *a, **k)
            finally:
                counter.in_kernel -= 1

        cls.run = run
        patched.append((cls, orig))
    try:
        yield
    finally:
        for cls, orig in patched:
            cls.run = orig


@contextlib.contextmanager
def pretend_cuda_gemms():
    """Make the CUDA kernel module call ``torch._scaled_mm`` / ``_scaled_grouped_mm`` on CPU tensors as it
    would on a GPU; each call is one launch, its result computed in fp32 outside the counter's view.

    Yields the list of GEMM calls made inside, in order: ``(op name, use_fast_accum)``."""
    from fp8pass.kernels import cuda

    orig_plan, orig_refusal = cuda.scaled_mm_plan, cuda.grouped_mm_refusal
    orig_mm, orig_gmm = torch._scaled_mm, getattr(torch, "_scaled_grouped_mm", None)

    def plan(m, k, n, a_dtype, b_dtype, out_dtype, device_type):
        return orig_plan(m, k, n, a_dtype, b_dtype, out_dtype, "cuda")

    calls: list[tuple[str, bool]] = []

    def scaled_mm(a, b, scale_a, scale_b, bias=None, out_dtype=None, **kw):
        calls.append(("_scaled_mm", bool(kw.get("use_fast_accum", False))))
        with _uncounted():
            out = (a.float() * scale_a) @ (b.float() * scale_b)
            if bias is not None:
                out = out + bias.float()
            out = out.to(out_dtype)
        return _one_launch("aten._scaled_mm.default", out)

    def grouped_refusal(a_shape, b_shape, a_dtype, b_dtype, out_dtype, device):  # the operands' checks alone
        return orig_refusal(a_shape, b_shape, a_dtype, b_dtype, out_dtype, "cuda")

    def scaled_grouped_mm(a, b, scale_a, scale_b, offs=None, out_dtype=None, **kw):
        calls.append(("_scaled_grouped_mm", bool(kw.get("use_fast_accum", False))))
        with _uncounted():
            # the arguments must pass torch's own checks (its meta function: layouts, strides, scale shapes)
            torch.ops.aten._scaled_grouped_mm(*(_on_meta(t) for t in (a, b, scale_a, scale_b)), offs=_on_meta(offs),
                                              out_dtype=out_dtype)
            if a.dim() == b.dim() == 2 and bool((offs % cuda.GROUP_ALIGN).any()):  # TMA: 16-byte group starts
                raise RuntimeError(f"_scaled_grouped_mm 2d x 2d: group ends {offs.tolist()} not multiples of "
                                   f"{cuda.GROUP_ALIGN}")
            out = cuda.grouped_mm_emulated(a, b, scale_a, scale_b, offs, out_dtype)
        return _one_launch("aten._scaled_grouped_mm.default", out)

    cuda.scaled_mm_plan, cuda.grouped_mm_refusal = plan, grouped_refusal
    torch._scaled_mm, torch._scaled_grouped_mm = scaled_mm, scaled_grouped_mm
    try:
        yield calls
    finally:
        cuda.scaled_mm_plan, cuda.grouped_mm_refusal = orig_plan, orig_refusal
        torch._scaled_mm = orig_mm
        if orig_gmm is not None:
            torch._scaled_grouped_mm = orig_gmm


def _on_meta(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor with ``t``'s shape, strides and dtype."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _active_counter() -> LaunchCounter | None:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    modes = [m for m in _get_current_dispatch_mode_stack() if isinstance(m, LaunchCounter)]
    return modes[-1] if modes else None


@contextlib.contextmanager
def _uncounted():
    """Run the emulation of a GPU kernel without its aten ops (or host reads) being counted."""
    from torch.utils._python_dispatch import _disable_current_modes

    counter = _active_counter()
    if counter is not None:
        counter.in_kernel += 1
    try:
        with _disable_current_modes():
            yield
    finally:
        if counter is not None:
            counter.in_kernel -= 1


def _one_launch(name: str, out: torch.Tensor) -> torch.Tensor:
    counter = _active_counter()
    if counter is not None:
        counter.aten[name] += 1
        if counter.where is not None:
            counter.where[(_caller(), name)] += 1
    return out


# ---- cases: the public ops and the optimizer step on the CUDA code path ----------------------------

def _linear_case(recipe_name: str, tokens: int = 64, d_in: int = 64, d_out: int = 96):
    import fp8pass

    torch.manual_seed(0)
    x = torch.randn(tokens, d_in, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(d_out, d_in, dtype=torch.bfloat16, requires_grad=True)
    recipe = fp8pass.DelayedScaling() if recipe_name == "delayed" else None

    dy = torch.randn(tokens, d_out, dtype=torch.bfloat16)

    def step():
        x.grad = w.grad = None  # a fresh gradient: no accumulation kernel counted
        fp8pass.ops.fp8_linear(x, w, recipe=recipe).backward(dy)

    return step


def _rmsnorm_case(tokens: int = 64, d: int = 64):
    """``fp8pass::rmsnorm`` in TinyLlama's form (fp32 residual stream, fp32 weight): forward, then
    backward from the saved E4M3 x_hat codes and rstd (Config.save_norm_input_fp8)."""
    from fp8pass.op_schema import NormKnobs

    torch.manual_seed(0)
    x = torch.randn(tokens, d, requires_grad=True)
    w = torch.randn(d, requires_grad=True)
    dy = torch.randn(tokens, d)
    knobs = NormKnobs(1e-5, None, torch.float32, "e4m3").args()

    def step():
        x.grad = w.grad = None
        torch.ops.fp8pass.rmsnorm(x, w, *knobs)[0].backward(dy)

    return step


def _swiglu_case(smooth: str, tokens: int = 64, d: int = 64, ffn: int = 128):
    import fp8pass

    torch.manual_seed(0)
    x = torch.randn(tokens, d, dtype=torch.bfloat16, requires_grad=True)
    wg, wu = (torch.randn(ffn, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    wd = torch.randn(d, ffn, dtype=torch.bfloat16, requires_grad=True)

    dy = torch.randn(tokens, d, dtype=torch.bfloat16)

    def step():
        x.grad = wg.grad = wu.grad = wd.grad = None
        fp8pass.ops.swiglu_mlp(x, wg, wu, wd, smooth=smooth).backward(dy)

    return step


def _adamw_case(n_tensors: int = 4, numel: int = 4096, bf16_sr: bool = False):
    """The AdamW step over ``n_tensors`` parameters; ``bf16_sr``: bf16 parameters updated by stochastic
    rounding (``bf16_stochastic_round=True``), whose seeds are one draw per step."""
    import fp8pass

    torch.manual_seed(0)
    dtype = torch.bfloat16 if bf16_sr else torch.float32
    params = [torch.nn.Parameter(torch.randn(numel // 64, 64).to(dtype)) for _ in range(n_tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = fp8pass.optim.AdamW(params, lr=1e-3, bf16_stochastic_round=bf16_sr)

    def step():
        opt.step()

    return step


def _grouped_offs(tokens: int, experts: int) -> torch.Tensor:
    """Group ends of ``tokens`` rows spread over ``experts`` (uneven sizes, not multiples of 16)."""
    return torch.tensor([tokens * (e + 1) // experts for e in range(experts)], dtype=torch.int32)


def _grouped_case(tokens: int = 64, experts: int = 4, d_in: int = 64, d_out: int = 96):
    """One MoE expert projection (``fp8pass::fp8_grouped_linear``, current scaling, tokens sorted by
    expert) fwd+bwd: three grouped GEMMs, whatever the number of experts."""
    from fp8pass.op_schema import GroupedLinearKnobs

    torch.manual_seed(0)
    x = torch.randn(tokens, d_in, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(experts, d_out, d_in, dtype=torch.bfloat16, requires_grad=True)
    offs = _grouped_offs(tokens, experts)
    knobs = GroupedLinearKnobs("e4m3", "e5m2", False, "nearest", 0.0, 1, "max", None, True)
    dy = torch.randn(tokens, d_out, dtype=torch.bfloat16)

    def step():
        x.grad = w.grad = None
        out = torch.ops.fp8pass.fp8_grouped_linear(x, w, offs, False, [], [], [], None, *knobs.args())
        out[0].backward(dy)

    return step


def _grouped_swiglu_case(smooth: str, tokens: int = 64, experts: int = 4, d: int = 64, ffn: int = 32):
    """The GLU tail of an expert MLP (``fp8pass::fp8_grouped_swiglu_down``, fused gate_up input) fwd+bwd."""
    from fp8pass.op_schema import GroupedGLUKnobs

    torch.manual_seed(0)
    gate_up = torch.randn(tokens, 2 * ffn, dtype=torch.bfloat16, requires_grad=True)
    wd = torch.randn(experts, d, ffn, dtype=torch.bfloat16, requires_grad=True)
    offs = _grouped_offs(tokens, experts)
    knobs = GroupedGLUKnobs("e4m3", "e5m2", False, "nearest", 0.0, 1, "max", None, True, "silu", smooth)
    dy = torch.randn(tokens, d, dtype=torch.bfloat16)

    def step():
        gate_up.grad = wd.grad = None
        out = torch.ops.fp8pass.fp8_grouped_swiglu_down(gate_up, None, wd, offs, False, [], [], [], None, *knobs.args())
        out[0].backward(dy)

    return step


CASES = {
    "fp8_linear delayed": lambda: _linear_case("delayed"),
    "fp8_linear current": lambda: _linear_case("current"),
    "swiglu_mlp channel": lambda: _swiglu_case("channel"),
    "adamw step 4 tensors": lambda: _adamw_case(4),
    "adamw step 16 tensors": lambda: _adamw_case(16),
    "adamw bf16 SR step 4 tensors": lambda: _adamw_case(4, bf16_sr=True),
    "adamw bf16 SR step 16 tensors": lambda: _adamw_case(16, bf16_sr=True),
    "grouped_linear current": lambda: _grouped_case(),
    "grouped_linear current 2 experts": lambda: _grouped_case(experts=2),
    "grouped_linear current 8 experts": lambda: _grouped_case(experts=8),
    "grouped_swiglu channel": lambda: _grouped_swiglu_case("channel"),
    "rmsnorm fp32": lambda: _rmsnorm_case(),
}
# issue 28's goals (fwd+bwd, GEMMs included; the AdamW step O(1) in the number of tensors)
GOALS = {"fp8_linear delayed": 12, "fp8_linear current": 16, "swiglu_mlp channel": 30}


def count(case: str, warmup: int = 1, where: bool = False) -> LaunchCounter:
    """Launches of one call of ``case`` on the CUDA code path, after ``warmup`` calls (steady state:
    a delayed-scaling history is no longer empty)."""
    step = CASES[case]()
    with _cuda_code_path(), pretend_cuda_gemms():
        for _ in range(warmup):
            step()
        with LaunchCounter(where) as counter:
            step()
    return counter


@contextlib.contextmanager
def _cuda_code_path():
    old = os.environ.get("FP8PASS_KERNELS")
    os.environ["FP8PASS_KERNELS"] = "triton"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("FP8PASS_KERNELS", None)
        else:
            os.environ["FP8PASS_KERNELS"] = old


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated case names")
    ap.add_argument("--json", default=None, help="write {cases: {name: {total, aten, triton, syncs}}} here")
    ap.add_argument("--by-op", action="store_true", help="print the count of every op")
    ap.add_argument("--where", action="store_true", help="print the launches by the fp8pass function issuing them")
    a = ap.parse_args(argv)
    out = {}
    print(f"{'case':28s} {'total':>6s} {'aten':>6s} {'triton':>6s} {'syncs':>6s} {'goal':>6s}")
    for case in [c.strip() for c in a.cases.split(",") if c.strip()]:
        if case not in CASES:
            raise SystemExit(f"unknown case {case!r}; cases: {', '.join(CASES)}")
        c = count(case, where=a.where)
        out[case] = c.summary()
        s = out[case]
        goal = GOALS.get(case)
        print(f"{case:28s} {s['total']:6d} {s['aten']:6d} {s['triton']:6d} {s['syncs']:6d} "
              f"{'' if goal is None else goal:>6}")
        if a.by_op:
            for name, n in sorted({**c.aten, **c.triton}.items(), key=lambda kv: -kv[1]):
                print(f"    {n:5d}  {name}")
            for name, n in c.syncs.items():
                print(f"    sync {n:5d}  {name}")
        if a.where:
            for (fn, name), n in sorted(c.where.items()):
                print(f"    {n:5d}  {fn:50s} {name}")
    if a.json:
        Path(a.json).write_text(json.dumps({"torch": torch.__version__, "cases": out}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
