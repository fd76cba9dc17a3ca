"""The patterns fp8pass recognises in Dynamo's torch-level graph: GLU MLPs and linear ops.

Each form real model code uses is one alternative below; adding a form is a few lines. The
replacements (what a match becomes) are in :mod:`fp8pass.passes.rewrite`, next to the policy checks.

Forms covered (all verified on real Dynamo graphs in tests/passes/test_patterns.py):

* activation: ``F.silu(g)`` (also ``nn.SiLU`` and HF ``ACT2FN["silu"]``, which Dynamo inlines to
  it), ``g * torch.sigmoid(g)`` / ``g * g.sigmoid()`` in either operand order, ``F.gelu(g)`` and
  ``F.gelu(g, approximate="tanh")`` (GeGLU, Gemma), ``F.relu(g)`` (ReGLU);
* gate x up product in either order;
* projections: ``F.linear(x, W[, b])`` (``nn.Linear``), ``x @ W.T`` / ``x @ W.t()`` /
  ``torch.matmul(x, W.T)`` / ``torch.mm(x, W.t())`` with optional ``+ b``, ``torch.addmm(b, x, W.t())``;
  and weights stored ``[in, out]``: ``torch.addmm(b, x, W)`` (GPT-2's ``Conv1D``), ``x @ W``, ``torch.mm(x, W)``;
* MoE expert projections over a 3-D expert weight with group offsets: ``torch._grouped_mm`` /
  ``F.grouped_mm`` / transformers' ``grouped_mm_fallback`` of ``(x, W.transpose(-2, -1), offs)``
  (``W`` [E, out, in]) or ``(x, W, offs)`` (``W`` [E, in, out]); or with a fixed capacity, ``x``
  [E, C, in]: ``torch.bmm`` / ``matmul`` with ``W`` or its transpose, ``torch.einsum("ecd,edf->ecf")``;
* one expert's matrix of a 3-D expert weight picked with a constant index, as a per-expert Python
  loop writes it (``for e in range(E): F.linear(x_e, W[e])``): ``W[e]`` / ``W.select(0, e)`` /
  ``torch.select(W, 0, e)`` stands for a 2-D weight in every projection form above (``W[e].t()``,
  ``x @ W[e].T``, ...) and binds ``p_w_stack`` (the 3-D parameter) and ``p_w_index`` (``e``, 0 <= e < E);
  a bias may likewise be one row ``b[e]`` of a stacked [E, out] bias;
* the weight operand of every projection above (dense, one expert's, grouped) through dtype casts and
  contiguity calls before and/or after its transpose: ``.to(dtype)``, ``.to(x.dtype)``, ``.type_as(x)``,
  ``.float()``, ``.bfloat16()``, ``.half()``, ``.contiguous()`` (torchtitan's
  ``w.bfloat16().transpose(-2, -1)``, GPT-OSS's ``w.transpose(-2, -1).bfloat16()``); the match binds the
  parameter itself, and ``p_w_operand`` the value the matmul read (its dtype is what the policy judges);
* a bias that is a computed 1-D tensor (``F.linear(x, W, b / tp_degree)``, torchtitan's
  ``ScaledBiasRowwiseLinear``), not only a parameter;
* a fused gate+up projection followed by ``chunk``, ``split``, last-dim slicing or
  ``view(..., 2, n).unbind(-2)`` (blocked) / ``view(..., n, 2).unbind(-1)`` (interleaved);
* the down projection of the GLU output (any projection form above);
* RMSNorm (:data:`RMS_NORM`; rewritten only under ``Config.save_norm_input_fp8``): fp8pass's TinyLlama
  ``(xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w).to(x.dtype)`` with ``xf = x.float()``,
  and Hugging Face's ``LlamaRMSNorm`` ``w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)``
  with ``xf = x.to(torch.float32)``; ``w`` a 1-D parameter, either operand order, the casts optional;
  and torch's ``F.rms_norm`` / ``nn.RMSNorm`` over the last dimension with a weight (``torch.rms_norm``
  in Dynamo's graph; ``eps=None`` is fp32's machine epsilon, as torch computes it);
* tensor parallel (separate gate/up projections): each projection's DTensor output made local by
  ``.redistribute(...).to_local()`` or ``.to_local()`` (ColwiseParallel's output hook), the product
  declared a DTensor by ``DTensor.from_local(h, mesh, placements)`` (RowwiseParallel's input hook), and
  gate and up reading twin ``from_local`` calls of one input; each conversion as the call itself (torch
  2.13) or as Dynamo's per-call wrapper ``prim from_local(h)`` / ``prim_redistribute`` / ``prim_to_local``
  (torch 2.11; ``annotate.dtensor_call``).
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import fx

from .matcher import (
    ANY,
    FROM_LOCAL,
    MUL,
    REDISTRIBUTE,
    TO_LOCAL,
    Bind,
    Const,
    Match,
    OneOf,
    Op,
    Pattern,
    Tag,
    Where,
    example_value,
    is_call,
    is_cast,
    is_param_placeholder,
)

__all__ = ["LINEAR", "GLU_MLP", "GLU_CORE", "ACTIVATION", "GROUPED_LINEAR", "EXPERT_GLU", "MATMUL_LIKE",
           "expert_slice", "expert_slices", "weight_rows", "find_glu_mlps", "find_expert_glus", "grouped_mm_targets",
           "RMS_NORM", "find_rms_norms"]

MATMUL = (operator.matmul, torch.matmul, "matmul")
MM = (torch.mm, "mm")
BMM = (torch.bmm, "bmm", torch.matmul, operator.matmul, "matmul")
ADDMM = (torch.addmm, "addmm")
ADD = (operator.add, torch.add, "add")
SIGMOID = (torch.sigmoid, F.sigmoid, "sigmoid")


def grouped_mm_targets() -> tuple:
    """The grouped-GEMM callables this torch (and transformers, when imported) provides."""
    out = [f for f in (getattr(torch, "_grouped_mm", None), getattr(F, "grouped_mm", None)) if f is not None]
    ns = getattr(torch.ops, "transformers", None)
    fallback = getattr(ns, "grouped_mm_fallback", None) if ns is not None and hasattr(ns, "grouped_mm_fallback") else None
    if fallback is not None:
        out += [fallback, fallback.default]
    return tuple(out)


# every matmul-like call: explain lists each one the plan leaves in high precision
MATMUL_LIKE = (F.linear, torch.mm, torch.addmm, torch.bmm, torch.baddbmm, torch.matmul, operator.matmul,
               torch.einsum, F.scaled_dot_product_attention, "mm", "addmm", "bmm", "baddbmm", "matmul")


def _weight(name: str) -> Pattern:
    """A 2-D weight: a parameter, or one expert's matrix of a 3-D expert stack (:func:`expert_slice`)."""
    return OneOf(Bind(name, Where(lambda n: is_param_placeholder(n) and _ndim(n) == 2)), expert_slice(name))


class _ExpertIndex(Pattern):
    """A literal expert index (a Python int, not a bool); binds ``name`` to it, made non-negative
    with the number of experts of the stack bound as ``stack``."""

    def __init__(self, name: str, stack: str):
        self.name, self.stack = name, stack

    def match(self, value, m):
        if isinstance(value, bool) or not isinstance(value, int):
            return
        ev = example_value(m.get(self.stack))
        if not isinstance(ev, torch.Tensor) or not isinstance(ev.shape[0], int):
            return
        experts = int(ev.shape[0])
        if -experts <= value < experts:
            yield m.extend(self.name, value % experts)


def expert_slice(name: str) -> Pattern:
    """``W[e]`` / ``W.select(0, e)`` / ``torch.select(W, 0, e)``: expert ``e``'s matrix of a 3-D expert
    weight ``W``, ``e`` a constant (a per-expert Python loop over ``range(E)``).

    Binds ``name`` (the slice node), ``name_stack`` (the 3-D parameter) and ``name_index`` (``e``).
    A tensor index (the expert ids of a data-dependent loop) is not a constant: no match.
    """
    stack = _expert_weight(f"{name}_stack")
    index = _ExpertIndex(f"{name}_index", f"{name}_stack")
    return Bind(name, OneOf(Op(operator.getitem, stack, index),
                            Op(("select", torch.select), stack, Const((0,)), index)))


def _expert_weight(name: str) -> Pattern:
    return Bind(name, Where(lambda n: is_param_placeholder(n) and _ndim(n) == 3))


def _bias(name: str) -> Pattern:
    """A 1-D bias: a parameter, one expert's row ``b[e]`` (``e`` a constant) of a stacked [E, out] bias,
    or a computed 1-D tensor (``b / tp_degree``): the FP8 op adds it in high precision after its GEMM,
    and autograd carries its gradient back through the computation."""
    return Bind(name, Where(lambda n: _ndim(n) == 1 or _expert_bias_row(n)))


def _linear_bias(name: str) -> Pattern:
    """``F.linear``'s bias: any tensor (the policy keeps one that is not one value per output feature,
    with its reason, rather than the pattern passing the call by)."""
    return Bind(name, Where(lambda n: _ndim(n) is not None))


def _expert_bias_row(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target is not operator.getitem or len(node.args) != 2:
        return False
    stack, index = node.args
    return (is_param_placeholder(stack) and _ndim(stack) == 2 and isinstance(index, int)
            and not isinstance(index, bool))


def _ndim(node) -> int | None:
    ev = example_value(node)
    return ev.dim() if isinstance(ev, torch.Tensor) else None


def _transposed(w: Pattern) -> Pattern:
    return OneOf(
        Op(getattr, w, Const(("T", "mT"))),
        Op(("t", torch.t), w),
        Op(("transpose", torch.transpose), w, Const((0, -2)), Const((1, -1))),
        Op(("transpose", torch.transpose), w, Const((1, -1)), Const((0, -2))),
    )


class _Casts(Pattern):
    """``pattern`` under any number (none included) of dtype casts and contiguity calls
    (:func:`~.matcher.is_cast`); the casts join the match's nodes (erased once the rewrite leaves
    them unused, kept while anything else reads them)."""

    def __init__(self, pattern: Pattern):
        self.pattern = pattern

    def match(self, value, m):
        yield from self.pattern.match(value, m)
        if is_cast(value):
            yield from self.match(value.args[0], m.extend(node=value))


def weight_operand(p: str, w: Pattern, transpose) -> tuple[Pattern, Pattern]:
    """The weight operand ``w`` of projection ``p`` as real code writes it: ``(transposed, as stored)``,
    each through casts before and after the transpose; binds ``p_w_operand`` to what the matmul reads."""
    stored = _Casts(w)
    return (Bind(f"{p}_w_operand", _Casts(transpose(stored))), Bind(f"{p}_w_operand", stored))


def linear(p: str, x: Pattern | None = None) -> Pattern:
    """A projection ``y = x W^T (+ b)`` with W (and b) parameters.

    Binds ``p`` (the call), ``p_x``, ``p_w``, ``p_b``, and ``p_layout``: "out_in" for a weight
    stored ``[out, in]`` (nn.Linear), "in_out" for one stored ``[in, out]`` (GPT-2's Conv1D).
    """
    x = x if x is not None else Bind(f"{p}_x")
    w_t, w = weight_operand(p, _weight(f"{p}_w"), _transposed)
    b = _bias(f"{p}_b")
    out_in = Tag(f"{p}_layout", "out_in", w_t)
    in_out = Tag(f"{p}_layout", "in_out", w)
    matmul = OneOf(Op(MATMUL, x, out_in), Op(MM, x, out_in), Op(MATMUL, x, in_out), Op(MM, x, in_out))
    return Bind(p, OneOf(
        Tag("form_" + p, "F.linear", Tag(f"{p}_layout", "out_in", Op(F.linear, x, w, bias=(2, None, OneOf(Const((None,)), _linear_bias(f"{p}_b")))))),
        Tag("form_" + p, "x @ W", matmul),
        Tag("form_" + p, "x @ W + b", Op(ADD, matmul, b, commutative=True)),
        Tag("form_" + p, "addmm(b, x, W)", Op(ADDMM, b, x, OneOf(out_in, in_out))),
    ))


def grouped_linear(p: str, x: Pattern | None = None, offs: Pattern | None = None) -> Pattern:
    """An expert projection ``y[g] = x[g] W[e]^T`` over a 3-D expert weight with group offsets.

    Binds ``p``, ``p_x``, ``p_w`` (the 3-D parameter), ``p_layout`` ("out_in": ``W`` [E, out, in],
    "in_out": ``W`` [E, in, out]), ``form_p`` and, for grouped GEMMs, ``offs`` (the cumulative group
    ends); the "bmm" form (fixed capacity, ``x`` [E, C, in]) has no offsets: every expert has C rows.
    """
    x = x if x is not None else Bind(f"{p}_x")
    offs = offs if offs is not None else Bind("offs")
    w = _expert_weight(f"{p}_w")
    w_t, w_stored = weight_operand(p, w, lambda w: OneOf(
        Op(getattr, w, Const(("mT",))),
        Op(("transpose", torch.transpose), w, Const((-2, 1)), Const((-1, 2))),
        Op(("transpose", torch.transpose), w, Const((-1, 2)), Const((-2, 1)))))
    operand = OneOf(Tag(f"{p}_layout", "out_in", w_t), Tag(f"{p}_layout", "in_out", w_stored))
    return Bind(p, OneOf(
        Tag("form_" + p, "grouped_mm", _GroupedMM(
            x, operand, offs=(2, None, offs), bias=(None, None, Const((None,))), out_dtype=(None, None, Const((None,))))),
        # stacked experts with a fixed capacity, x [E, C, in] (Llama4): every expert's C rows
        # (the plan checks x is [E, C, in]; a 2-D x would broadcast every row to every expert)
        Tag("form_" + p, "bmm", Op(BMM, x, operand)),
        Tag("form_" + p, "bmm", _StackedEinsum(p, x, w)),
    ))


def einsum_layout(equation) -> str | None:
    """"in_out" / "out_in" when ``equation`` is a per-expert GEMM ``ecK,e{K,N}->ecN``, else None.

    ``ecd,edf->ecf`` (W [E, in, out]) is "in_out", ``ecd,efd->ecf`` (W [E, out, in]) is "out_in"; any
    letters, spaces allowed.
    """
    if not isinstance(equation, str) or "->" not in equation or "." in equation:
        return None
    lhs, out = equation.replace(" ", "").split("->")
    ops = lhs.split(",")
    if len(ops) != 2 or not all(len(t) == 3 for t in (*ops, out)) or len(set(ops[0])) != 3:
        return None
    (a, b), c = ops, out
    e, cap, k = a
    if b[0] != e or c[0] != e or c[1] != cap or k in c or len({*b}) != 3:
        return None
    n = c[2]
    if b[1:] == k + n:
        return "in_out"
    if b[1:] == n + k:
        return "out_in"
    return None


class _StackedEinsum(Pattern):
    """``torch.einsum("ecd,edf->ecf", x, W)`` (or ``efd``): a fixed-capacity expert GEMM; binds ``p_layout``."""

    def __init__(self, p: str, x: Pattern, w: Pattern):
        self.p, self.x, self.w = p, x, w

    def match(self, value, m):
        if not isinstance(value, fx.Node) or not is_call(value, (torch.einsum,)) or len(value.args) != 3:
            return
        layout = einsum_layout(value.args[0])
        if layout is None:
            return
        for m2 in self.x.match(value.args[1], m.extend(node=value)):
            for m3 in self.w.match(value.args[2], m2):
                yield m3.extend(f"{self.p}_layout", layout)


class _NoopCast(Pattern):
    """``pattern`` on a cast node whose output dtype equals its input's."""

    def __init__(self, pattern: Pattern):
        self.pattern = pattern

    def match(self, value, m):
        if isinstance(value, fx.Node) and _same_dtype_as_input(value):
            yield from self.pattern.match(value, m)


class _GroupedMM(Op):
    """A grouped GEMM call; the targets are looked up per match, since transformers registers its
    ``grouped_mm_fallback`` op only when it is imported (possibly after fp8pass)."""

    def __init__(self, *args, **kwargs):
        super().__init__(grouped_mm_targets(), *args, **kwargs)

    def match(self, value, m):
        self.targets = grouped_mm_targets()
        yield from super().match(value, m)


# ---- fused gate+up: which weight rows a slice of the projection output selects -------------------

def _last_dim(node: fx.Node, dim) -> bool:
    nd = _ndim(node)
    return isinstance(dim, int) and nd is not None and dim in (-1, nd - 1)


def weight_rows(part: fx.Node, fused: fx.Node) -> slice | None:
    """Rows of the fused weight that ``part`` (a piece of the fused projection's output) selects.

    Returns None when ``part`` is not a last-dim piece of ``fused``'s output that we understand.
    """
    ev = example_value(fused)
    if not isinstance(ev, torch.Tensor) or not isinstance(ev.shape[-1], int):
        return None
    n = int(ev.shape[-1])
    if part.op != "call_function" or part.target is not operator.getitem:
        return None
    src, idx = part.args
    if src is fused:  # y[..., a:b] / y[:, a:b] / y[:, :, a:b]
        if not isinstance(idx, tuple) or not idx or not isinstance(idx[-1], slice):
            return None
        lead = idx[:-1]
        if not (lead == (Ellipsis,) or (len(lead) == _ndim(fused) - 1 and all(s == slice(None) for s in lead))):
            return None
        start, stop, step = idx[-1].indices(n)
        return slice(start, stop, step)
    if not isinstance(idx, int) or not isinstance(src, fx.Node):
        return None
    op = src.target
    if op in ("chunk", torch.chunk) and src.args[0] is fused:
        chunks = src.args[1] if len(src.args) > 1 else src.kwargs.get("chunks")
        dim = src.args[2] if len(src.args) > 2 else src.kwargs.get("dim", 0)
        if not isinstance(chunks, int) or not _last_dim(fused, dim):
            return None
        c = -(-n // chunks)
        return slice(idx * c, min((idx + 1) * c, n), 1)
    if op in ("split", torch.split) and src.args[0] is fused:
        size = src.args[1] if len(src.args) > 1 else src.kwargs.get("split_size_or_sections",
                                                                     src.kwargs.get("split_size"))
        dim = src.args[2] if len(src.args) > 2 else src.kwargs.get("dim", 0)
        if not _last_dim(fused, dim):
            return None
        if isinstance(size, int):
            return slice(idx * size, min((idx + 1) * size, n), 1)
        if isinstance(size, (list, tuple)) and all(isinstance(s, int) for s in size):
            start = sum(size[:idx])
            return slice(start, start + size[idx], 1)
        return None
    if op in ("unbind", torch.unbind) and isinstance(src.args[0], fx.Node):
        view = src.args[0]
        dim = src.args[1] if len(src.args) > 1 else src.kwargs.get("dim", 0)
        if view.target not in ("view", "reshape", torch.reshape) or view.args[0] is not fused:
            return None
        shape = view.args[1] if len(view.args) == 2 and isinstance(view.args[1], (tuple, list)) else view.args[1:]
        if len(shape) < 2 or not all(isinstance(s, int) for s in shape[-2:]):
            return None
        k, m = shape[-2], shape[-1]
        k = n // m if k == -1 else k
        m = n // k if m == -1 else m
        if k * m != n:
            return None
        nd = len(shape)
        if dim in (-2, nd - 2):  # (..., k, m): piece idx = rows idx*m .. (idx+1)*m
            return slice(idx * m, (idx + 1) * m, 1)
        if dim in (-1, nd - 1):  # (..., k, m) unbind last: interleaved rows idx, idx+m, ...
            return slice(idx, n, m)
    return None


class FusedPart(Pattern):
    """A last-dim piece of a fused projection; binds ``p`` (the piece), ``gate_up`` and ``p_rows``."""

    def __init__(self, p: str, fused: Pattern):
        self.p, self.fused = p, fused

    def match(self, value, m):
        if not isinstance(value, fx.Node) or value.target is not operator.getitem:
            return
        src = value.args[0]
        cands = [src]
        if isinstance(src, fx.Node) and src.op in ("call_method", "call_function") and src.args:
            cands.append(src.args[0])
            if isinstance(src.args[0], fx.Node) and src.args[0].args:
                cands.append(src.args[0].args[0])  # unbind(view(fused))
        for fused in cands:
            if not isinstance(fused, fx.Node):
                continue
            rows = weight_rows(value, fused)
            if rows is None:
                continue
            between = [n for n in (src, getattr(src, "args", [None])[0]) if isinstance(n, fx.Node)
                       and n is not fused and n is not value]
            for m2 in self.fused.match(fused, m):
                m3 = m2.extend(self.p, value, node=value).extend(f"{self.p}_rows", rows)
                for n in between:
                    if n not in m3.nodes and n not in m3.bindings.values():
                        m3 = m3.extend(node=n)
                yield m3
            return


# ---- tensor parallel: what the TP plan's module hooks put around a GLU ---------------------------

def made_local(p: str, proj: Pattern) -> Pattern:
    """``proj``, or its DTensor output made a local tensor by a colwise TP plan's output hook:
    ``proj.redistribute(...).to_local()`` or ``proj.to_local()``; binds ``p_local`` (the ``to_local``
    call). Any layouts match here: the plan checks they make the fused op equal (``plan._tp_layout_problem``)."""
    local = Op(TO_LOCAL, OneOf(Op(REDISTRIBUTE, proj, varargs=True), proj))
    return OneOf(proj, Bind(f"{p}_local", local))


def from_local(h: Pattern) -> Pattern:
    """``h``, or it declared a DTensor by a rowwise TP plan's input hook
    (``DTensor.from_local(h, mesh, placements)``); binds ``h_dt`` (the ``from_local`` call)."""
    return OneOf(h, Bind("h_dt", Op(FROM_LOCAL, h, varargs=True)))


# ---- activations and the GLU -------------------------------------------------------------------

def activation(g: Pattern) -> Pattern:
    """``act(g)`` for the GLU activations; binds ``act`` to "silu", "gelu", "gelu_tanh" or "relu"."""
    sig = Op(SIGMOID, g)
    return OneOf(
        Tag("act", "silu", Op(F.silu, g)),
        Tag("act", "silu", Op(MUL, g, sig, commutative=True)),
        Tag("act", "gelu", Op(F.gelu, g, approximate=(1, "none", Const(("none",))))),
        Tag("act", "gelu_tanh", Op(F.gelu, g, approximate=(1, "none", Const(("tanh",))))),
        Tag("act", "relu", Op((F.relu, torch.relu, "relu"), g)),
    )


ACTIVATION = activation(Bind("gate"))

_SEPARATE = (made_local("gate", linear("gate", x=Bind("x"))), made_local("up", linear("up", x=Bind("x"))))
_FUSED = tuple(FusedPart(p, linear("gate_up", x=Bind("x"))) for p in ("gate", "up"))

# the GLU output h = act(gate) * up, the projections separate or fused
GLU_CORE = Bind("h", OneOf(
    Tag("proj", "separate", Op(MUL, activation(_SEPARATE[0]), _SEPARATE[1], commutative=True)),
    Tag("proj", "fused", Op(MUL, activation(_FUSED[0]), _FUSED[1], commutative=True)),
))

# the whole MLP: down(act(gate(x)) * up(x)), also under a colwise gate/up, rowwise down TP plan
GLU_MLP = linear("down", x=from_local(GLU_CORE))

# a plain linear op (attention projections, GELU MLPs, the LM head, ...)
LINEAR = linear("lin")

# MoE experts: the GLU of every expert at once, ``down(act(gate) * up)`` over grouped projections
# sharing one offsets tensor (transformers' grouped_mm experts: fused gate_up, then ``chunk(2, -1)``)
_GROUPED_FUSED = tuple(FusedPart(p, grouped_linear("gate_up", x=Bind("x"))) for p in ("gate", "up"))
_GROUPED_SEPARATE = (grouped_linear("gate", x=Bind("x")), grouped_linear("up", x=Bind("x")))
_EXPERT_PRODUCT = Bind("h", OneOf(
    Tag("proj", "separate", Op(MUL, activation(_GROUPED_SEPARATE[0]), _GROUPED_SEPARATE[1], commutative=True)),
    Tag("proj", "fused", Op(MUL, activation(_GROUPED_FUSED[0]), _GROUPED_FUSED[1], commutative=True)),
))


def _same_dtype_as_input(node: fx.Node) -> bool:
    out, inp = example_value(node), example_value(node.args[0]) if node.args else None
    return isinstance(out, torch.Tensor) and isinstance(inp, torch.Tensor) and out.dtype == inp.dtype


# transformers casts the grouped GEMM's input to the weight dtype (``x.to(W.dtype)``): a no-op cast
# between the product and the down projection is part of the match; a real cast is not
_NOOP_CAST = Op(("to", "type"), _EXPERT_PRODUCT, varargs=True, dtype=(None, None, ANY), copy=(None, False, Const((False,))),
                non_blocking=(None, False, ANY))
EXPERT_GLU = grouped_linear("down", x=OneOf(_EXPERT_PRODUCT, Bind("h_cast", _NoopCast(_NOOP_CAST))))

# one expert projection on its own (non-GLU experts, or a gate the patterns do not know)
GROUPED_LINEAR = grouped_linear("lin")

# a GLU product whose projections are not all in this graph (a graph break split it)
_ANY_NODE = Where(lambda n: True)
GLU_PRODUCT_LOOSE = Bind("h", Op(MUL, activation(Bind("gate", _ANY_NODE)), Bind("up", _ANY_NODE), commutative=True))


def variant_name(m: Match) -> str:
    """Human-readable variant: "swiglu" / "geglu" / "geglu-tanh" / "reglu", plus projection form."""
    act = {"silu": "swiglu", "gelu": "geglu", "gelu_tanh": "geglu-tanh", "relu": "reglu"}[m["act"]]
    if m.get("proj") == "fused":
        return f"{act} (fused gate_up)"
    return act


def expert_slices(m: Match) -> dict[fx.Node, tuple[fx.Node, int]]:
    """The expert-slice weights of a match: slice node -> (3-D parameter, expert index)."""
    out = {}
    for name, value in m.bindings.items():
        if name.endswith("_w_stack") and isinstance(value, fx.Node):
            base = name[: -len("_stack")]
            out[m[base]] = (value, m[f"{base}_index"])
    return out


_OPERAND_VIEWS = ("t", "transpose", torch.t, torch.transpose, getattr, operator.getitem, "select", torch.select)


def _operand_forms(m: Match) -> set[fx.Node]:
    """The match's nodes that only reshape or cast a value from outside it (a weight's cast and
    transpose, an input's cast): the rewrite reads their source instead, and leaves them to whoever
    else uses them."""
    inside = set(m.nodes)
    forms: set[fx.Node] = set()
    for n in reversed(list(dict.fromkeys(m.nodes))):  # sources were matched after their users
        src = n.args[0] if n.args else None
        if (is_cast(n) or is_call(n, _OPERAND_VIEWS)) and isinstance(src, fx.Node) and (
                src not in inside or src in forms):
            forms.add(n)
    return forms


def _internal_ok(m: Match) -> bool:
    """Every matched node except the root and operand forms (:func:`_operand_forms`) is used only
    inside the match (safe to replace)."""
    root = m.nodes[0]
    inside = set(m.nodes)
    for n in inside - _operand_forms(m):
        if n is root:
            continue
        if any(u not in inside for u in n.users):
            return False
    return True


def find_glu_mlps(graph: fx.Graph, pattern: Pattern = GLU_MLP) -> tuple[list[Match], list[tuple[Match, str]]]:
    """All non-overlapping GLU MLP matches; and GLU-shaped matches rejected, with the reason."""
    found: list[Match] = []
    rejected: list[tuple[Match, str]] = []
    taken: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        first_rejected = None
        for m in pattern(node):
            m.nodes = list(dict.fromkeys(m.nodes))
            if taken & set(m.nodes):
                continue
            if not _internal_ok(m):
                first_rejected = first_rejected or m
                continue
            taken |= set(m.nodes)
            found.append(m)
            first_rejected = None
            break
        if first_rejected is not None:
            rejected.append((first_rejected, "an intermediate value of the GLU is also used outside it"))
    return found, rejected


def find_expert_glus(graph: fx.Graph) -> tuple[list[Match], list[tuple[Match, str]]]:
    """All MoE expert GLUs (grouped projections, one offsets tensor), as :func:`find_glu_mlps`."""
    return find_glu_mlps(graph, EXPERT_GLU)


# ---- RMSNorm -------------------------------------------------------------------------------------

class _Literal(Pattern):
    """A Python float literal (not a node); binds ``name`` to it (an RMSNorm's ``eps``). ``none``: None
    matches too, bound as None (``torch.rms_norm``'s default eps)."""

    def __init__(self, name: str, none: bool = False):
        self.name = name
        self.none = none

    def match(self, value, m):
        if isinstance(value, (float, int)) and not isinstance(value, bool):
            yield m.extend(self.name, float(value))
        elif value is None and self.none:
            yield m.extend(self.name, None)


class _LastDimOnly(Pattern):
    """A ``normalized_shape`` literal of one int: the norm is over the last dimension alone."""

    def match(self, value, m):
        if isinstance(value, (tuple, list, torch.Size)) and len(value) == 1 and isinstance(value[0], int):
            yield m


class _OneCast(Pattern):
    """One dtype cast (:func:`~.matcher.is_cast`, no contiguity call) of ``pattern``'s value."""

    def __init__(self, pattern: Pattern):
        self.pattern = pattern

    def match(self, value, m):
        if is_cast(value) and value.target in ("to", "type", "float", "bfloat16", "half", "double", "type_as"):
            yield from self.pattern.match(value.args[0], m.extend(node=value))


_NORM_X = Bind("norm_xf", OneOf(_OneCast(Bind("norm_x")), Bind("norm_x")))
_MEAN_SQUARE = Op(("mean", torch.mean), Op(("pow", torch.pow), _NORM_X, Const((2, 2.0))),
                  dim=(1, None, Const((-1, (-1,), [-1]))), keepdim=(2, False, Const((True,))))
_RSTD = Op((torch.rsqrt, "rsqrt"), Op(ADD, _MEAN_SQUARE, _Literal("norm_eps"), commutative=True))
_X_HAT = Bind("norm_hat", Op(MUL, _NORM_X, _RSTD, commutative=True))
_NORM_W = Bind("norm_w", Where(lambda n: is_param_placeholder(n) and _ndim(n) == 1))
_NORM_Y = Bind("norm_y", Op(MUL, OneOf(Bind("norm_hat_cast", _OneCast(_X_HAT)), _X_HAT), _NORM_W, commutative=True))

# torch's own: F.rms_norm / nn.RMSNorm, which Dynamo records as torch.rms_norm(x, (d,), w, eps). It
# computes ((x.float() * rsqrt(...)) * w).type_as(x): TinyLlama's form (x_hat * w in fp32, one cast)
_TORCH_RMS_NORM = Tag("norm_form", "torch", Op((torch.rms_norm, F.rms_norm), Bind("norm_xf", Bind("norm_x")),
                                               _LastDimOnly(), weight=(2, None, _NORM_W),
                                               eps=(3, None, _Literal("norm_eps", none=True))))

# y = cast(x_hat) * w, then optionally cast: TinyLlama's and Hugging Face's LlamaRMSNorm forms; torch's
RMS_NORM = Bind("norm", OneOf(Bind("norm_out_cast", _OneCast(_NORM_Y)), _NORM_Y, _TORCH_RMS_NORM))


def find_rms_norms(graph: fx.Graph) -> tuple[list[Match], list[tuple[Match, str]]]:
    """All RMSNorm matches (the widest: with the output cast), last first; and norms whose
    intermediate values are read outside them, with the reason."""
    found: list[Match] = []
    rejected: list[tuple[Match, str]] = []
    taken: set[fx.Node] = set()
    for node in reversed(list(graph.nodes)):
        if node.op not in ("call_function", "call_method") or node in taken:
            continue
        for m in RMS_NORM(node):
            m.nodes = list(dict.fromkeys(m.nodes))
            inside = set(m.nodes)
            if any(u not in inside for n in m.nodes[1:] for u in n.users):
                rejected.append((m, "an intermediate value of the norm is also used outside it"))
            else:
                found.append(m)
            taken |= inside
            break
    return found[::-1], rejected[::-1]
