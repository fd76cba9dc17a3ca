"""Which precision and kernel each GEMM of a compiled model runs: one record per (weight, GEMM).

The compile backend calls :func:`graph_gemms` on every rewritten graph, once, when it compiles it (or
a variant of it for another module's weights): the ``torch.ops.fp8pass`` calls in the graph are what
runs, their knobs (formats, granularity, ``backward``) are literals in it, their weights are graph
placeholders named by the backend's annotation. For each op the three GEMMs (forward, dgrad, wgrad)
are named from the same functions the device modules choose their GEMM with
(:func:`fp8pass.kernels.cuda.scaled_mm_refusal`, :func:`~fp8pass.kernels.cuda.grouped_mm_refusal`,
:func:`fp8pass.kernels.cpu.gemm_dtype`), given the weight's shape, dtypes and device. So the audit costs
nothing per step (no host read, no launch, no per-call bookkeeping) and reports what the ops will do.
The token count decides no choice (``_scaled_mm`` takes any M; K and N are padded), except that an
empty batch has nothing to multiply: such a call is not a record.

A **fallback** is a GEMM whose recipe asks for an FP8 GEMM kernel that the device does not run for it
(two E5M2 operands, a GPU without FP8 GEMMs, grouped dims ``torch._scaled_grouped_mm`` cannot take):
it runs as dequantize + fp32 matmul instead, with the same FP8-rounded operands, only slower.
``Config(on_fallback="warn" | "error")`` (:func:`check_fallbacks`) decides what happens then. What
the plan decided is never a fallback: linears kept in high precision (their reason is in
``decided_by``), ``backward="high"``, per-row/per-tile scales (dequantized fp32 GEMMs by design),
NVFP4 (no FP4 GEMM is used anywhere: exact dequantized values), and the CPU, whose FP8 GEMMs emulate
FP8 numerics (``cpu emulation: bf16 GEMM of FP8 codes``).

The records of a model are kept here, per model (:func:`records_of`; ``fp8pass.monitor.precision_audit``
reads them); a recompile replaces a weight's records, and :func:`version` counts the changes.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass

import torch
from torch import fx

from . import kernels
from .kernels import cpu as cpu_kernels
from .op_schema import GLUKnobs, GroupedGLUKnobs, GroupedLinearKnobs, LinearKnobs
from .passes.annotate import facts
from .runtime.casting import resolve_format
from .runtime.grouped_casting import grad_format
from .runtime.linear import _mx_mm_dtype

__all__ = ["GemmRecord", "CollectiveRecord", "GEMMS", "PrecisionFallbackError", "graph_gemms", "kept_gemms", "check_fallbacks",
           "register", "records_of", "version", "ON_FALLBACK"]

GEMMS = ("forward", "dgrad", "wgrad")
ON_FALLBACK = ("warn", "error")
_TOKENS = 16  # stands for the token count, which changes no kernel choice (module doc)


class PrecisionFallbackError(RuntimeError):
    """A GEMM fell back from its FP8 kernel and ``Config(on_fallback="error")`` was set."""


@dataclass(frozen=True)
class GemmRecord:
    """One GEMM of one weight.

    Attributes:
        weight: the weight's FQN (as ``fp8pass.explain`` names it).
        gemm: ``"forward"`` (``y = x W^T``), ``"dgrad"`` (``dx = dy W``) or ``"wgrad"`` (``dW = dy^T x``).
        precision: what the operands are: ``"fp8"`` (per-tensor, per-row or per-tile scaled FP8 codes),
            ``"mxfp8"``, ``"nvfp4"`` or ``"high"`` (not quantized: the model's dtype).
        operands: the operands' formats (``"e5m2 x e4m3"``) or, for ``"high"``, the dtype (``"bfloat16"``;
            ``""`` for a matmul the plan kept, which runs as the model wrote it).
        kernel: what multiplies them: ``"torch._scaled_mm"``, ``"torch._scaled_grouped_mm"``,
            ``"cpu emulation: bf16 GEMM of FP8 codes"``, ``"fp32 matmul of dequantized operands"``, ...
        fallback: why the GEMM does not run the FP8 kernel its recipe asks for (module doc), else None.
        decided_by: the plan's decision: the recipe and the rule that chose it, or why it was kept high.
        op: the ``fp8pass`` op that runs the GEMM (``""`` for a kept matmul).
    """

    weight: str
    gemm: str
    precision: str
    operands: str
    kernel: str
    fallback: str | None = None
    decided_by: str = ""
    op: str = ""

    def as_dict(self) -> dict:
        """The record as plain JSON values (metrics.jsonl)."""
        return {"weight": self.weight, "gemm": self.gemm, "precision": self.precision, "operands": self.operands,
                "kernel": self.kernel, "fallback": self.fallback, "decided_by": self.decided_by, "op": self.op}


# op name -> (position of its weight argument, its knob class); nvfp4_linear has no knob class
_OPS = {
    "fp8_linear": (1, LinearKnobs),
    "fp8_linear_precast": (4, LinearKnobs),
    "swiglu_down": (2, GLUKnobs),
    "fp8_grouped_linear": (1, GroupedLinearKnobs),
    "fp8_grouped_swiglu_down": (2, GroupedGLUKnobs),
    "nvfp4_linear": (1, None),
}


def _op_name(node: fx.Node) -> str | None:
    if node.op != "call_function":
        return None
    name = str(node.target)  # "fp8pass.fp8_linear.default"
    parts = name.split(".")
    if len(parts) >= 2 and parts[0] == "fp8pass" and parts[1] in _OPS:
        return parts[1]
    return None


def _knobs(node: fx.Node, cls):
    """The op's knobs as the graph passes them (keywords, as the rewriters emit them, or positional)."""
    names = {f.name for f in dataclasses.fields(cls)}
    given = {k: v for k, v in node.kwargs.items() if k in names}
    return cls(**given) if given else cls.take(node.args)


def _weight_node(node: fx.Node, hops: int = 8) -> fx.Node | None:
    """The parameter placeholder a weight argument comes from (through views, slices, ``W[e]``)."""
    while isinstance(node, fx.Node) and hops > 0:
        if node.op == "placeholder":
            return node if facts(node).weight_fqn else None
        if not node.args or not isinstance(node.args[0], fx.Node):
            return None
        node, hops = node.args[0], hops - 1
    return None


def _value(node) -> torch.Tensor | None:
    v = facts(node).value if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _fmt_name(fmt) -> str:
    return fmt.name


def graph_gemms(gm: fx.GraphModule, decided_by: dict[str, str] | None = None) -> list[GemmRecord]:
    """The GEMM records of one rewritten graph and its higher-order op bodies (three per FP8 op).

    Args:
        gm: the graph as the backend rewrote it (annotated: its parameter placeholders carry FQNs).
        decided_by: weight FQN -> the plan's attribution (``Report.decided_by``).
    """
    decided_by = decided_by or {}
    out: list[GemmRecord] = []
    for node in gm.graph.nodes:
        if node.op == "get_attr" and isinstance(node.target, str):
            sub = getattr(gm, node.target, None)
            if isinstance(sub, fx.GraphModule):
                out += graph_gemms(sub, decided_by)
            continue
        name = _op_name(node)
        if name is None:
            continue
        pos, knob_cls = _OPS[name]
        wnode = _weight_node(node.args[pos]) if len(node.args) > pos else None
        weight = _value(wnode) if wnode is not None else None
        if wnode is None or weight is None:  # the rewriters take parameters only; said, not skipped, if not
            out += [GemmRecord(f"<{node.name}>", g, "unknown", "", "not audited: the op's weight is no named "
                               "parameter with a known shape", None, "", name) for g in GEMMS]
            continue
        fqn = facts(wnode).weight_fqn
        x = _value(node.args[0])
        x_dtype = x.dtype if x is not None else weight.dtype
        why = decided_by.get(fqn, "")
        if knob_cls is None:
            out += _nvfp4(fqn, why)
        elif knob_cls in (GroupedLinearKnobs, GroupedGLUKnobs):
            out += _grouped(fqn, name, _knobs(node, knob_cls), weight, x_dtype, why)
        else:
            out += _dense(fqn, name, _knobs(node, knob_cls), weight, x_dtype, why)
    # a per-expert loop calls one op per expert of the same weight: one record per (weight, GEMM)
    return list({(r.weight, r.gemm): r for r in out}.values())


def kept_gemms(skipped: list[tuple[str, str]]) -> list[GemmRecord]:
    """Records of the matmuls a plan kept in high precision: ``(where, reason)`` entries of its report
    (``where`` a weight FQN for a weight's matmul; :func:`records_of` keeps those that name a parameter)."""
    return [GemmRecord(where, g, "high", "", "as the model computes it (not rewritten)", None, reason)
            for where, reason in skipped for g in GEMMS]


def _dense(fqn, op, k, weight, x_dtype, why) -> list[GemmRecord]:
    """The GEMMs of ``fp8_linear``/``fp8_linear_precast``/``swiglu_down`` (the linear's math: forward
    ``x W^T``, dgrad ``dy W``, wgrad ``dy^T x``; the GLU's ``A B^T`` with ``A`` its smoothed operand)."""
    fwd, bwd = resolve_format(k.fwd_format), resolve_format(k.bwd_format)
    dt = k.out_dtype or x_dtype
    n_out, n_in = weight.shape[-2], weight.shape[-1]  # W[e] of a per-expert loop: the expert's matrix
    shapes = {"forward": (_TOKENS, n_in, n_out), "dgrad": (_TOKENS, n_out, n_in), "wgrad": (n_out, _TOKENS, n_in)}
    out = []
    for g in GEMMS:
        a = fwd if g == "forward" else bwd
        high = fwd is None or a is None or (g != "forward" and k.backward == "high")
        if high:
            kernel = _high_kernel(weight.device, dt)
            out.append(GemmRecord(fqn, g, "high", _dtype_name(dt), kernel, None, why, op))
            continue
        operands = f"{_fmt_name(a)} x {_fmt_name(fwd)}"
        if k.granularity == "mx":
            kernel = f"{_dtype_name(_mx_mm_dtype(weight.device, dt))} matmul of dequantized MX operands"
            out.append(GemmRecord(fqn, g, "mxfp8", operands, kernel, None, why, op))
            continue
        if k.granularity != "tensor":
            kernel = f"fp32 matmul of dequantized operands (per-{k.granularity} scales)"
            out.append(GemmRecord(fqn, g, "fp8", operands, kernel, None, why, op))
            continue
        kernel, fallback = _tensor_scaled_kernel(shapes[g], a.torch_dtype, fwd.torch_dtype, dt, weight.device)
        out.append(GemmRecord(fqn, g, "fp8", operands, kernel, fallback, why, op))
    return out


def _tensor_scaled_kernel(mkn, a_dtype, b_dtype, out_dtype, device) -> tuple[str, str | None]:
    """(kernel, fallback) of a per-tensor scaled FP8 GEMM on ``device``: what ``gemm_tensor_scaled`` of
    the device module runs."""
    kern = kernels.for_device(device)
    if kern is cpu_kernels:
        return f"cpu emulation: {_dtype_name(cpu_kernels.gemm_dtype(out_dtype))} GEMM of FP8 codes", None
    cuda = kern
    if cuda.scaled_mm_plan(*mkn, a_dtype, b_dtype, out_dtype, device) is not None:
        return "torch._scaled_mm", None
    # the CUDA code path on CPU tensors (Triton's interpreter) emulates; what it would do on a GPU decides
    reason = cuda.scaled_mm_refusal(*mkn, a_dtype, b_dtype, out_dtype, _as_gpu(device))
    if reason is None:
        return "cpu emulation (CUDA code path): fp32 matmul of dequantized FP8 codes", None
    return "fp32 matmul of dequantized operands", reason


def _as_gpu(device) -> torch.device:
    """``device``, or for CPU tensors on the CUDA code path the GPU they stand for (``"cuda"``)."""
    device = torch.device(device)
    return torch.device("cuda") if device.type == "cpu" else device


def _high_kernel(device, dt) -> str:
    """The GEMM of high-precision operands (``backward="high"``, the identity format) on ``device``."""
    kern = kernels.for_device(device)
    if kern is cpu_kernels:
        operand = torch.empty(0, dtype=dt, device="meta")
        return f"{_dtype_name(cpu_kernels.gemm_dtype(dt, operand, operand))} matmul"
    return "fp32 matmul"


def _grouped(fqn, op, k, weight, x_dtype, why) -> list[GemmRecord]:
    """The GEMMs of the grouped (MoE) ops: per expert ``x W_e^T``, ``dy W_e``, ``dy^T x`` over a stacked
    ``[E, out, in]`` weight (or its transpose: the dims are read as the forward multiplies them)."""
    fwd = resolve_format(k.fwd_format)
    dt = k.out_dtype or x_dtype
    device = weight.device
    kern = kernels.for_device(device)
    n_a, n_b = weight.shape[-2], weight.shape[-1]
    out = []
    for g in GEMMS:
        if fwd is None:
            out.append(GemmRecord(fqn, g, "high", _dtype_name(dt), _high_kernel(device, dt), None, why, op))
            continue
        a_name = k.fwd_format if g == "forward" else grad_format(k.bwd_format, device)
        a = resolve_format(a_name)
        operands = f"{_fmt_name(a)} x {_fmt_name(fwd)}"
        if kern is cpu_kernels:
            kernel = f"cpu emulation: {_dtype_name(cpu_kernels.gemm_dtype(dt))} GEMM of FP8 codes per expert"
            out.append(GemmRecord(fqn, g, "fp8", operands, kernel, None, why, op))
            continue
        # every grouped GEMM contracts and writes the weight's two dims (tokens are aligned to 16)
        dims = ((_TOKENS, n_b), (1, n_b, n_a), a.torch_dtype, fwd.torch_dtype, dt)
        reason = kern.grouped_mm_refusal(*dims, device)
        if reason is None:
            out.append(GemmRecord(fqn, g, "fp8", operands, "torch._scaled_grouped_mm", None, why, op))
        elif kern.grouped_mm_refusal(*dims, _as_gpu(device)) is None:  # CPU tensors on the CUDA code path
            out.append(GemmRecord(fqn, g, "fp8", operands, "cpu emulation (CUDA code path): grouped_mm_emulated",
                                  None, why, op))
        else:
            out.append(GemmRecord(fqn, g, "fp8", operands, "grouped_mm_emulated (fp32, every expert over all rows)",
                                  reason, why, op))
    return out


def _nvfp4(fqn, why) -> list[GemmRecord]:
    kernel = "fp32 matmul of dequantized NVFP4 operands (exact values; no FP4 GEMM)"
    return [GemmRecord(fqn, g, "nvfp4", "e2m1 x e2m1", kernel, None, why, "nvfp4_linear") for g in GEMMS]


def fallback_message(fallbacks: list[GemmRecord]) -> str:
    """One paragraph naming every weight whose GEMMs fell back, and why."""
    by_weight: dict[str, list[str]] = {}
    for r in fallbacks:
        by_weight.setdefault(r.weight, []).append(f"{r.gemm}: {r.fallback}")
    shown = "; ".join(f"{w} ({', '.join(v)})" for w, v in list(by_weight.items())[:5])
    more = f" (+{len(by_weight) - 5} more weights)" if len(by_weight) > 5 else ""
    return (f"fp8pass: {len(fallbacks)} FP8 GEMM(s) of {len(by_weight)} weight(s) run as dequantize + fp32 matmul "
            f"instead of their FP8 kernel, which the plan did not decide: {shown}{more}. The numerics are the "
            f"recipe's; only the speed is lost. fp8pass.monitor.precision_audit(model) lists every GEMM; "
            f"Config(on_fallback='error') makes this an error.")


def check_fallbacks(records: list[GemmRecord], on_fallback: str, warned: set) -> None:
    """Apply ``Config.on_fallback`` to a graph's records: raise naming the weights ("error"), or warn once
    per (weight, GEMM, reason) (``warned`` keeps track) ("warn")."""
    import warnings

    fallbacks = [r for r in records if r.fallback]
    if not fallbacks:
        return
    if on_fallback == "error":
        raise PrecisionFallbackError(fallback_message(fallbacks).replace(
            " Config(on_fallback='error') makes this an error.",
            " Config(on_fallback='error') is set; change the recipe, the shapes or the device, or set "
            "on_fallback='warn'."))
    new = [r for r in fallbacks if (r.weight, r.gemm, r.fallback) not in warned]
    if new:
        warned.update((r.weight, r.gemm, r.fallback) for r in new)
        warnings.warn(fallback_message(new), RuntimeWarning, stacklevel=3)


# --- per model ---------------------------------------------------------------------------------------

class _ModelAudit:
    def __init__(self):
        self.records: dict[tuple[str, str], GemmRecord] = {}
        self.version = 0


_AUDITS: "weakref.WeakKeyDictionary[torch.nn.Module, _ModelAudit]" = weakref.WeakKeyDictionary()
_UNOWNED = _ModelAudit()  # compiled functions (no module)


def register(model: torch.nn.Module | None, records: list[GemmRecord]) -> None:
    """Keep a graph's records for ``model`` (None: a compiled function): a weight's records replace its
    earlier ones (a recompile, a precision switch: the graph compiled last is what runs)."""
    audit = _UNOWNED if model is None else _AUDITS.setdefault(model, _ModelAudit())
    changed = False
    for r in records:
        key = (r.weight, r.gemm)
        if audit.records.get(key) == r:
            continue
        audit.records[key] = r
        changed = True
    audit.version += changed


def records_of(model: torch.nn.Module | None) -> list[GemmRecord]:
    """The records kept for ``model`` (None: compiled functions), in the order first seen."""
    audit = _UNOWNED if model is None else _AUDITS.get(model)
    return list(audit.records.values()) if audit is not None else []


def version(model: torch.nn.Module | None) -> int:
    """How many times ``model``'s records changed (0: never compiled); cheap, for the trainer's check."""
    audit = _UNOWNED if model is None else _AUDITS.get(model)
    return audit.version if audit is not None else 0


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective of one weight (FSDP2's all-gather of its shards).

    Attributes:
        weight: the weight's FQN.
        collective: ``"all-gather"``.
        precision: ``"fp8"`` (FP8 codes on the wire: ``fp8pass.distributed.enable_fp8_all_gather``) or
            ``"high"``.
        dtype: what is gathered: the FP8 format (``"e4m3"``) or the dtype (``"bfloat16"``).
        bytes_per_element: on the wire.
        note: for a high-precision gather of a weight whose forward GEMM runs per-tensor FP8 (so an FP8
            all-gather could take it), that it could; else None.
    """

    weight: str
    collective: str
    precision: str
    dtype: str
    bytes_per_element: int
    note: str | None = None

    def as_dict(self) -> dict:
        return {"weight": self.weight, "collective": self.collective, "precision": self.precision,
                "dtype": self.dtype, "bytes_per_element": self.bytes_per_element, "note": self.note}
