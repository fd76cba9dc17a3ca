"""``fp8pass::swiglu_down``: the GLU MLP tail ``y = (act(gate) * up) W_down^T`` with Smooth-SwiGLU.

``gate = x W_gate^T`` and ``up = x W_up^T`` come from two ``fp8_linear`` calls (or one fused
gate/up linear); this op computes ``h = act(gate) * up``, the smoothing, the E4M3 cast of the GEMM
operand ``A`` and the FP8 down GEMM. ``activation`` picks the GLU (Smooth-SwiGLU's argument holds for
any GLU: the outlier comes from the product ``act(gate) * up``, not from the activation):

==============  ===================================================================================
``silu``        SwiGLU (Llama): ``g * sigmoid(g)``. Fast paths: Inductor-compiled CPU elementwise
                kernels and, on CUDA, the fused Triton amax/cast kernels.
``gelu``        GeGLU, exact erf form ``g * Phi(g)``; derivative ``Phi(g) + g * phi(g)``.
``gelu_tanh``   GeGLU, tanh form (Gemma): ``0.5 g (1 + t)``, ``t = tanh(k (g + 0.044715 g^3))``,
                ``k = sqrt(2/pi)``; derivative ``0.5 (1 + t) + 0.5 g (1 - t^2) k (1 + 3 * 0.044715 g^2)``.
``relu``        ReGLU: ``max(g, 0)``; derivative ``1[g > 0]`` (0 at 0, as autograd's).
==============  ===================================================================================

The non-silu activations run as eager fp32 torch math on every device (no compiled CPU loop nest, no
fused Triton kernel; the FP8 casts and GEMMs are the same kernels as for silu).

Smoothing modes (scales are constants for autograd, which is exact because they cancel in exact
arithmetic; docs/background.md, Smooth-SwiGLU; ``silu`` below stands for the activation):

===========  =======================================================================================
``channel``  the paper's form: ``c_i = 2**-floor(log2 max_t |h_ti|)`` per channel (power of two, so
             multiplying by it is exact); ``A = h * c`` and ``B = W_down / c`` (column i divided by
             ``c_i`` before ``B`` is cast). ``A B^T = h W_down^T``.
``token``    the reference code's form: ``r_t = max_i |up_ti|`` per token; ``A = silu(gate) * up / r``,
             ``B = W_down``, and each output row is multiplied by ``r_t`` after the GEMM.
``none``     plain FP8 SwiGLU: ``A = h``, ``B = W_down`` (reproduces the instability).
===========  =======================================================================================

``A`` and ``B`` are cast to ``fwd_format`` with the linear's scaling options; in ``channel`` mode ``B``
depends on this call's ``c`` and is therefore always current-scaled (its delayed state, if given, is
not used). Backward: ``dy`` (times ``r`` in token mode) cast to ``bwd_format``; dgrad and wgrad are FP8
GEMMs from the saved codes of ``A`` and ``B``; the GLU derivative runs in fp32 from ``gate`` and ``up``
as saved in FP8 (``fwd_format``, current per-tensor scales: :func:`saved_glu_input`). Backward keeps
codes and scales only, no high-precision copy of ``gate``, ``up`` or ``h``.
"""

from __future__ import annotations

import torch

from ..kernels import cpu as cpu_kernels
from ..kernels import run_fused, torch_family, uses_triton
from ..numerics import scale_from_amax
from ..numerics.scaling import power_of_two_floor
from ..op_schema import SR_SEED, SR_STREAM, GLUKnobs, knob_op
from .casting import (
    Operand,
    as_bytes,
    cast_operand,
    cast_with_scale,
    column_major,
    column_major_like,
    dequantized,
    from_bytes,
    gemm,
    resolve_format,
    tile_for,
    unaliased,
)
from .linear import _scale_shape, _up, check_knobs, compute_dtype, keep_output_grad_only, output_grad, record_grad_amax
from .sr import draw_seed

__all__ = ["SMOOTH_MODES", "ACTIVATIONS", "glu_activation", "glu_activation_grad",
           "swiglu_down_op", "channel_scales", "token_scales", "swiglu_operand",
           "fold_channel_scales"]

SMOOTH_MODES = ("channel", "token", "none")  # the ops' smooth knob; users spell "none" None (op_schema.smooth_knob)
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu")
_SQRT_2_OVER_PI = 0.7978845608028654
_INV_SQRT_2PI = 0.3989422804014327


def glu_activation(g: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(g)`` (fp32 in, fp32 out) for one of :data:`ACTIVATIONS`."""
    F = torch.nn.functional
    if activation == "silu":
        return F.silu(g)
    if activation == "gelu":
        return F.gelu(g)
    if activation == "gelu_tanh":
        return F.gelu(g, approximate="tanh")
    return F.relu(g)


def glu_activation_backward(grad: torch.Tensor, g: torch.Tensor, activation: str) -> torch.Tensor:
    """``grad * act'(g)`` by the kernels autograd itself uses for ``act`` (identical rounding)."""
    aten = torch.ops.aten
    if activation == "silu":
        return aten.silu_backward(grad, g)
    if activation in ("gelu", "gelu_tanh"):
        return aten.gelu_backward(grad, g, approximate="tanh" if activation == "gelu_tanh" else "none")
    return aten.threshold_backward(grad, torch.relu(g), 0)


def glu_activation_grad(g: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(act(g), act'(g))`` in fp32, the exact derivative (see the module doc)."""
    if activation == "silu":
        sig = torch.sigmoid(g)
        return g * sig, sig * (1 + g * (1 - sig))
    if activation == "gelu":
        cdf = 0.5 * (1 + torch.erf(g * 0.7071067811865476))
        return g * cdf, cdf + g * (_INV_SQRT_2PI * torch.exp(-0.5 * g * g))
    if activation == "gelu_tanh":
        t = torch.tanh(_SQRT_2_OVER_PI * (g + 0.044715 * g * g * g))
        act = 0.5 * g * (1 + t)
        dt = (1 - t * t) * _SQRT_2_OVER_PI * (1 + 3 * 0.044715 * g * g)
        return act, 0.5 * (1 + t) + 0.5 * g * dt
    return torch.relu(g), (g > 0).to(g.dtype)
# Channel scales are clamped so that W_down / c stays representable (no overflow or underflow).
_C_MIN, _C_MAX = 2.0**-64, 2.0**64


def channel_scales(channel_amax: torch.Tensor) -> torch.Tensor:
    """Power-of-two per-channel smoothing scales ``2**-floor(log2 amax)`` (1 for zero / non-finite),
    clamped to ``[2**-64, 2**64]``.

    ``2**floor(log2 amax)`` is ``amax`` with its mantissa bits cleared (:func:`power_of_two_floor`),
    exact: a rounded ``log2`` would give the next binade for an amax just below a power of two. The
    GPU kernel (``triton_scaling.channel_scales``) computes the same bits.
    """
    amax = channel_amax.to(torch.float32)
    c = torch.reciprocal(power_of_two_floor(amax)).clamp(_C_MIN, _C_MAX)
    ok = (amax > 0) & torch.isfinite(amax)
    return torch.where(ok, c, torch.ones_like(c))


def token_scales(up2d: torch.Tensor) -> torch.Tensor:
    """Per-token ``r_t = max_i |up_ti|`` as fp32 [T, 1] (1 for zero / non-finite rows)."""
    if up2d.shape[1] == 0:
        return torch.ones(up2d.shape[0], 1, dtype=torch.float32, device=up2d.device)
    r = up2d.abs().amax(dim=1, keepdim=True).to(torch.float32)
    return torch.where((r > 0) & torch.isfinite(r), r, torch.ones_like(r))


def swiglu_operand(gate2d: torch.Tensor, up2d: torch.Tensor, smooth: str, activation: str = "silu"):
    """The down GEMM's left operand ``A`` (fp32) and the smoothing scales (``c`` [F], ``r`` [T, 1] or [])."""
    if activation == "silu":
        return run_fused(_swiglu_operand, (gate2d, up2d), (smooth,))
    return _glu_operand(gate2d, up2d, smooth, activation)  # eager torch math (module doc)


def _swiglu_operand(gate2d, up2d, smooth: str):
    return _glu_operand(gate2d, up2d, smooth, "silu")


def operand_and_input_amax(gate2d: torch.Tensor, up2d: torch.Tensor, smooth: str, activation: str):
    """:func:`swiglu_operand` plus ``max |gate|`` and ``max |up|`` (fp32), which the saved copies'
    current scales need: on CPU (silu) from the same compiled loop nest that reads gate and up for
    ``A``, instead of two more passes over them."""
    if activation == "silu" and gate2d.numel() > 0:  # (amax() of an empty tensor raises)
        return run_fused(_swiglu_operand_and_input_amax, (gate2d, up2d), (smooth,))
    a, s = swiglu_operand(gate2d, up2d, smooth, activation)
    return a, s, torch_family.tensor_amax(gate2d), torch_family.tensor_amax(up2d)


def _swiglu_operand_and_input_amax(gate2d, up2d, smooth: str):
    a, s = _glu_operand(gate2d, up2d, smooth, "silu")
    return a, s, gate2d.float().abs().amax(), up2d.float().abs().amax()


def _glu_operand(gate2d, up2d, smooth: str, activation: str):
    g = gate2d.float()
    u = up2d.float()
    silu = glu_activation(g, activation)
    if smooth == "token":
        r = token_scales(up2d)
        return silu * (u / r), r
    h = silu * u
    if smooth == "channel":
        amax = h.abs().amax(dim=0) if h.shape[0] else torch.zeros(h.shape[1], device=h.device)
        c = channel_scales(amax)
        return h * c, c
    return h, torch.ones((), dtype=torch.float32, device=h.device)


def _fused_operand(g2, u2, smooth, fmt, a_state, margin, power_of_two):
    """GPU, token and no smoothing (and channel on empty inputs; otherwise :func:`_fused_channel_operands`):
    smoothing scales (channel: one pass for the column maxima, one launch for the scales), one Triton
    pass for A's amax, one launch for A's scale (current or delayed), one fused silu*up*scale+cast."""
    from ..kernels import triton_operand_casts as tk
    from ..kernels import triton_scaling

    g2, u2 = g2.contiguous(), u2.contiguous()
    if smooth == "channel":
        s = triton_scaling.channel_scales(tk.swiglu_colamax(g2, u2, partials=True), _C_MIN, _C_MAX)
    elif smooth == "token":
        s = token_scales(u2)
    else:
        s = torch.ones((), dtype=torch.float32, device=g2.device)
    ss = None if smooth == "none" else s
    sc = triton_scaling.operand_scale(tk.swiglu_amax(g2, u2, smooth, ss, partials=True), fmt, margin, power_of_two,
                                      state=a_state or None)
    # the cast's A is the amax pass's A (the same kernel math): its amax is sc.amax, not reduced again
    codes, _, scale = tk.swiglu_cast(g2, u2, smooth, fmt, sc.scale, ss, want_amax=False)
    return Operand(codes, scale, sc.amax, inv_scale=sc.inv_scale), s


# weight dtypes whose ``W_down / c`` the Triton kernels divide in-kernel as torch does (c is exact in them)
_DIVIDED_IN_KERNEL = (torch.float32, torch.bfloat16)


def _fused_channel_operands(g2, u2, w_down, fmt, a_state, margin, power_of_two):
    """GPU, channel smoothing: every forward cast of the op in three launches and two reads of gate/up.

    One pass over gate and up for the channel maxima of ``|h|`` and the per-tile maxima of ``|gate|``
    and ``|up|``; one launch for ``c`` and every scale (A's, current or delayed, with its amax taken as
    ``max_f fl(amax_f c_f)``; B's, ``B = W_down / c`` read from W_down; the saved copies'); one pass
    writing the codes of A, gate and up (:func:`saved_glu_input`'s copies). With W_down in fp32 or bf16,
    B is cast with the division in the cast (one launch, no ``W_down / c`` written), else B is None.
    The same codes, scales and amaxes as :func:`_fused_operand`, ``W_down / c`` cast by
    :func:`cast_operand` and :func:`saved_glu_input` (tests/runtime/test_runtime_swiglu.py). The cast pass
    writes A's codes in both layouts (``data_t``: what the op saves, :func:`~.casting.column_major`).

    Returns:
        (A's Operand, c, B's Operand or None, the gate copy, the up copy).
    """
    from ..kernels import triton_operand_casts as tk
    from ..kernels import triton_scaling

    g2, u2 = g2.contiguous(), u2.contiguous()
    part, maxima = tk.swiglu_colamax(g2, u2, partials=True, input_maxima=True)
    w = w_down if w_down.dtype in _DIVIDED_IN_KERNEL else None
    sc = triton_scaling.smooth_scales(part, maxima, w, fmt, margin, power_of_two, a_state or None, _C_MIN, _C_MAX)
    # A^T from the same launch: the op saves A column-major, the wgrad GEMM's operand as it is read (no copy)
    a, g_codes, u_codes, a_t = tk.swiglu_cast_with_inputs(g2, u2, "channel", fmt, sc.a.scale, sc.c, sc.gate_scale,
                                                          sc.up_scale, transpose=True)
    bo = None
    if w is not None:
        b, _, _ = tk.transpose_cast(w, sc.b.scale, fmt, transpose=False, partials=True, divisor=sc.c)
        bo = Operand(b, sc.b.scale, sc.b.amax, inv_scale=sc.b.inv_scale)
    return (Operand(a, sc.a.scale, sc.a.amax, data_t=a_t, inv_scale=sc.a.inv_scale), sc.c, bo,
            Operand(g_codes, sc.gate_scale, None), Operand(u_codes, sc.up_scale, None))


def _smoothed_weight(w_down, c):
    return w_down / c.to(w_down.dtype)


def _smoothed_weight_amax(w_down, c):
    return _smoothed_weight(w_down, c).abs().amax().float()


def _smoothed_weight_cast(w_down, c, scale, fmax: float, dtype):
    b = _smoothed_weight(w_down, c).float()
    return (b * scale).clamp(-fmax, fmax).to(dtype)


def _smoothed_weight_cast_up(w_down, c, scale, fmax: float, split: float, step: float, tiny: float, dtype, up):
    codes, values, _ = cpu_kernels.codes_values_amax_math(_smoothed_weight(w_down, c), scale, fmax, split, step, tiny,
                                                          dtype, up)
    return codes, values


def _smoothed_weight_values(w_down, c, scale, fmax: float, split: float, step: float, tiny: float, up):
    return cpu_kernels.rne_values_math(_smoothed_weight(w_down, c), scale, fmax, split, step, tiny, up)


def _smoothed_weight_operand(w_down, c, fmt, margin, power_of_two, up) -> Operand:
    """CPU, per-tensor current scaling: ``B = W_down / c`` cast without writing ``B`` out: its amax in
    one compiled loop, its codes (and, with ``up``, their GEMM values) in another (the same values and
    bits as :func:`cast_operand` of ``W_down / c``; the division is recomputed instead of stored and
    read back twice)."""
    amax = cpu_kernels.run_fused(_smoothed_weight_amax, (w_down, c))
    return _smoothed_weight_cast_with(w_down, c, scale_from_amax(amax, fmt, margin, power_of_two), amax, fmt, up)


def _smoothed_weight_cast_with(w_down, c, scale, amax, fmt, up, keep_codes: bool = True) -> Operand:
    """``W_down / c`` cast with a given ``scale`` in one compiled loop (CPU): codes, and with ``up``
    their GEMM values; forward's cast and backward's recast (:func:`_recast_weight`) alike. With ``up``
    and ``keep_codes`` False only the values (the operand's ``data`` too): backward's recast, whose
    codes nobody reads, skips their write."""
    if up is not None and not keep_codes:
        values = cpu_kernels.run_fused(_smoothed_weight_values, (w_down, c, scale),
                                       (fmt.max, *cpu_kernels.rne_constants(fmt), up))
        return Operand(values, scale, amax, values)
    if up is None:
        codes = cpu_kernels.run_fused(_smoothed_weight_cast, (w_down, c, scale), (fmt.max, fmt.torch_dtype))
        return Operand(codes, scale, amax)
    codes, values = cpu_kernels.run_fused(_smoothed_weight_cast_up, (w_down, c, scale),
                                          (fmt.max, *cpu_kernels.rne_constants(fmt), fmt.torch_dtype, up))
    return Operand(codes, scale, amax, values)


def _check(gate, up, w_down, k: GLUKnobs):
    if k.activation not in ACTIVATIONS:
        raise ValueError(f"unknown GLU activation {k.activation!r}; valid: {', '.join(map(repr, ACTIVATIONS))}")
    if k.smooth not in SMOOTH_MODES:
        raise ValueError(f"unknown smooth mode {k.smooth!r}; valid: {', '.join(map(repr, SMOOTH_MODES))} "
                         f"(the op's spelling; fp8pass.ops.swiglu_mlp and Config spell 'none' None)")
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"swiglu: gate and up must have the same shape and dtype, got {tuple(gate.shape)} "
                         f"{gate.dtype} and {tuple(up.shape)} {up.dtype}")
    if w_down.dim() != 2 or w_down.shape[1] != gate.shape[-1]:
        raise ValueError(f"swiglu: w_down must be [out, {gate.shape[-1]}], got {tuple(w_down.shape)}")
    check_knobs(k)


@knob_op("fp8pass::swiglu_down",
         f"Tensor gate, Tensor up, Tensor w_down, Tensor[] a_state, Tensor[] b_state, Tensor[] g_state, {SR_STREAM}",
         GLUKnobs, "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
def swiglu_down_op(gate, up, w_down, a_state, b_state, g_state, sr_stream, *knobs):
    """Returns ``(y, a_amax, b_amax, a_data, a_scale, b_data, b_scale, smooth_scales, gate_data, gate_scale,
    up_data, up_scale)``; outputs 3-11 are what backward keeps (see :func:`saved_glu_input`)."""
    k = GLUKnobs(*knobs)
    _check(gate, up, w_down, k)
    fmt = resolve_format(k.fwd_format)
    dt = compute_dtype(k, gate.dtype)
    g2 = gate.reshape(-1, gate.shape[-1])
    u2 = up.reshape(-1, up.shape[-1])
    up_dtype = _up(gate.device, dt)
    at = tile_for(k.granularity, k.block, g2.shape, weight=False)
    g_amax = u_amax = bo = go = uo = None
    fused_channel = _runs_fused_channel(gate, fmt, k)
    if fused_channel:
        ao, s, bo, go, uo = _fused_channel_operands(g2, u2, w_down, fmt, a_state, k.margin, k.power_of_two)
    elif _runs_fused(gate, fmt, k):
        ao, s = _fused_operand(g2, u2, k.smooth, fmt, a_state, k.margin, k.power_of_two)
    else:
        a, s, g_amax, u_amax = operand_and_input_amax(g2, u2, k.smooth, k.activation)
        ao = cast_operand(a, fmt, k.granularity, at, a_state, k.margin, k.power_of_two, up=up_dtype)
    bt = tile_for(k.granularity, k.block, w_down.shape, weight=True)
    if bo is not None:  # cast by _fused_channel_operands
        pass
    elif k.smooth == "channel" and fmt is not None and k.granularity == "tensor" and w_down.device.type == "cpu" \
            and not uses_triton(w_down.device):
        bo = _smoothed_weight_operand(w_down, s, fmt, k.margin, k.power_of_two, up_dtype)
    else:
        b = w_down / s.to(w_down.dtype) if k.smooth == "channel" else w_down
        bo = cast_operand(b, fmt, k.granularity, bt, [] if k.smooth == "channel" else b_state, k.margin,
                          k.power_of_two, up=up_dtype)
    if k.smooth == "token":
        y = (gemm(ao, at, bo, bt, dt, fast_accum=k.fast_accum).float() * s).to(dt)
    else:
        y = gemm(ao, at, bo, bt, dt, fast_accum=k.fast_accum)
    if go is None:
        go, uo = saved_glu_input(g2, fmt, g_amax), saved_glu_input(u2, fmt, u_amax)
    states = (a_state, b_state)
    a_saved = column_major(ao) if fused_channel else ao.data  # fused: the layout the wgrad GEMM reads
    return (y.reshape(*gate.shape[:-1], w_down.shape[0]), ao.amax, bo.amax, as_bytes(a_saved),
            unaliased(ao.scale, states), as_bytes(bo.data), unaliased(bo.scale, states), unaliased(s, states),
            as_bytes(go.data), go.scale, as_bytes(uo.data), uo.scale)


def _runs_fused(gate, fmt, k: GLUKnobs) -> bool:
    """Whether the op casts A with the Triton SwiGLU kernels (GPU, per-tensor FP8, silu)."""
    return uses_triton(gate.device) and fmt is not None and k.granularity == "tensor" and k.activation == "silu"


def _runs_fused_channel(gate, fmt, k: GLUKnobs) -> bool:
    """Whether the op takes :func:`_fused_channel_operands` (and saves A column-major): the op and its
    fake function ask the same question."""
    return _runs_fused(gate, fmt, k) and k.smooth == "channel" and gate.numel() > 0


def saved_glu_input(t2d: torch.Tensor, fmt, amax: torch.Tensor | None = None) -> Operand:
    """``gate`` or ``up`` as backward keeps it: FP8 codes (``fwd_format``, current per-tensor scale), the
    only copy of it kept for backward; the identity format keeps the values (a copy, bit-exact math).
    ``amax``: ``max |t2d|`` when already known (:func:`operand_and_input_amax`), saving a pass.

    The GLU derivative then runs on the dequantized values: one more E4M3 rounding (relative 2**-4)
    of gate and up in the gradient, for 1 byte per element instead of 2-4 (bf16/fp32 GLU autograd
    saves both in high precision)."""
    if fmt is None:
        return Operand(t2d.clone(), torch.ones((), dtype=torch.float32, device=t2d.device), None)
    if amax is not None:  # what cast_operand's current scaling computes, without reading t2d for it
        return cast_with_scale(t2d, scale_from_amax(amax, fmt, 0.0, False), fmt)
    return cast_operand(t2d, fmt)


@swiglu_down_op.register_fake
def _(gate, up, w_down, a_state, b_state, g_state, sr_stream, *knobs):
    k = GLUKnobs(*knobs)
    _check(gate, up, w_down, k)
    fmt = resolve_format(k.fwd_format)
    rows = 1
    for d in gate.shape[:-1]:
        rows = rows * d
    f, n = gate.shape[-1], w_down.shape[0]
    f32 = dict(dtype=torch.float32, device=gate.device)
    s_shape = {"channel": (f,), "token": (rows, 1), "none": ()}[k.smooth]
    granularity = k.granularity if fmt else "tensor"
    if _runs_fused_channel(gate, fmt, k):
        a_saved = column_major_like(rows, f, torch.uint8, gate.device)
    else:
        a_saved = gate.new_empty(rows, f, dtype=torch.float32 if fmt is None else torch.uint8)
    return (
        gate.new_empty(*gate.shape[:-1], n, dtype=compute_dtype(k, gate.dtype)),
        torch.empty((), **f32),
        torch.empty((), **f32),
        a_saved,
        torch.empty(_scale_shape(granularity, k.block, rows, f, False), **f32),
        w_down.new_empty(n, f, dtype=w_down.dtype if fmt is None else torch.uint8),
        torch.empty(_scale_shape(granularity, k.block, n, f, True), **f32),
        torch.empty(s_shape, **f32),
        gate.new_empty(rows, f, dtype=gate.dtype if fmt is None else torch.uint8),
        torch.empty((), **f32),
        up.new_empty(rows, f, dtype=up.dtype if fmt is None else torch.uint8),
        torch.empty((), **f32),
    )


@knob_op("fp8pass::swiglu_down_backward",
         "Tensor dy, Tensor? a_data, Tensor a_scale, Tensor b_data, Tensor b_scale, Tensor smooth_scales, "
         f"Tensor gate_data, Tensor gate_scale, Tensor up_data, Tensor up_scale, Tensor[] g_state, {SR_SEED}, "
         "ScalarType gate_dtype, ScalarType w_dtype", GLUKnobs, "(Tensor, Tensor, Tensor, Tensor)")
def swiglu_down_backward_op(dy, a_data, a_scale, b_data, b_scale, smooth_scales, gate_data, gate_scale, up_data,
                            up_scale, g_state, sr_seed, gate_dtype, w_dtype, *knobs):
    """``(dgate, dup, dW_down, dy_amax)`` (no state mutation). With :func:`recasts_weight`, ``b_data``
    is ``W_down`` itself, cast again here with ``b_scale``; with :func:`recomputes_operand`, ``a_data``
    is None and ``A`` is recomputed from ``gate_data`` and ``up_data`` (:func:`_recomputed_operand`)."""
    k = GLUKnobs(*knobs)
    fmt = resolve_format(k.bwd_format)
    if a_data is None and not recomputes_operand(k):
        raise ValueError("swiglu_down_backward: a_data is None but the knobs do not recompute A "
                         "(recompute_output with per-tensor FP8); pass forward's saved A codes")
    a_data = None if a_data is None else from_bytes(a_data, resolve_format(k.fwd_format))
    b_data = from_bytes(b_data, resolve_format(k.fwd_format))
    dt = compute_dtype(k, gate_dtype)
    dy2 = dy.reshape(-1, dy.shape[-1])
    s = smooth_scales
    if k.smooth == "token":
        dy2 = dy2.float() * s
    up_dtype = _up(dy.device, dt)
    high = k.backward == "high"  # GEMMs on the dequantized operands and dy as it is (LinearKnobs.backward)
    if high:
        fmt = None
    gt = None if high else tile_for(k.granularity, k.block, dy2.shape, weight=False)
    saved_scales = (a_scale, b_scale) if a_scale.dim() == 0 and b_scale.dim() == 0 and not high else ()
    # never kept: on CPU the GEMM values only; on CUDA also dy's transposed codes from the same read (the
    # wgrad GEMM's row-major G^T: no copy)
    go = cast_operand(dy2, fmt, k.granularity, gt, g_state, k.margin, k.power_of_two, k.grad_rounding, up=up_dtype,
                      keep_codes=False, invert=saved_scales, transpose=True, seed=sr_seed)
    at = tile_for(k.granularity, k.block, gate_data.shape, weight=False)
    bt = tile_for(k.granularity, k.block, b_data.shape, weight=True)
    a_inv, b_inv = go.inverted if go.inverted else (None, None)  # the decode scales, from dy's scale launch
    if a_data is None:
        ao = _recomputed_operand(gate_data, gate_scale, up_data, up_scale, s, a_scale, k, up_dtype)
    else:
        ao = Operand(a_data, a_scale, a_scale)
    ao.inv_scale = a_inv
    bo = _recast_weight(b_data, s, b_scale, k, up_dtype) if recasts_weight(k) else Operand(b_data, b_scale, b_scale)
    bo.inv_scale = b_inv
    if high:
        ao, bo, at, bt = dequantized(ao.data, ao.scale, at, dt), dequantized(bo.data, bo.scale, bt, dt), None, None
    da = gemm(go, gt, bo, bt, gate_dtype, b_t=True, compute_dtype=dt)           # dA = G @ B      [T, F]
    fwd_fmt = resolve_format(k.fwd_format)
    triton_glu_kernel = k.activation == "silu" and fwd_fmt is not None and uses_triton(dy.device)
    # B = W / c  =>  dW = dB / c (exact: powers of two): in the SwiGLU backward's launch where it runs
    unsmooth_in_kernel = k.smooth == "channel" and triton_glu_kernel and w_dtype in _DIVIDED_IN_KERNEL
    if k.smooth == "channel":
        db = gemm(go, gt, ao, at, dt, a_t=True, b_t=True, compute_dtype=dt)     # dB = G^T @ A    [O, F]
        if not unsmooth_in_kernel:
            db = run_fused(_unsmooth_weight_grad, (db, s), (w_dtype,))
    else:
        db = gemm(go, gt, ao, at, w_dtype, a_t=True, b_t=True, compute_dtype=dt)
    saved = (from_bytes(gate_data, fwd_fmt), gate_scale, from_bytes(up_data, fwd_fmt), up_scale)
    if triton_glu_kernel:  # one Triton launch
        from ..kernels import triton_glu

        if unsmooth_in_kernel:
            dgate, dup, db = triton_glu.swiglu_backward(da, *saved, s, k.smooth, gate_dtype,
                                                        weight_grad=(db, w_dtype))
        else:
            dgate, dup = triton_glu.swiglu_backward(da, *saved, s, k.smooth, gate_dtype)
    elif k.activation == "silu":
        dgate, dup = run_fused(_swiglu_backward_from_saved, (da, *saved, s), (k.smooth, gate_dtype))
    else:  # eager torch math (module doc)
        dgate, dup = _glu_backward_from_saved(da, *saved, s, k.smooth, k.activation, gate_dtype)
    return dgate, dup, db, go.amax


def _unsmooth_weight_grad(db, s, w_dtype):
    """``dW = dB / c`` in ``w_dtype`` from the GEMM's ``dB`` (in its compute dtype)."""
    db = db.to(w_dtype)
    return db / s.to(db.dtype)


def _swiglu_backward_from_saved(da, g_data, g_scale, u_data, u_scale, s, smooth: str, out_dtype):
    return _glu_backward_from_saved(da, g_data, g_scale, u_data, u_scale, s, smooth, "silu", out_dtype)


def _glu_backward_from_saved(da, g_data, g_scale, u_data, u_scale, s, smooth: str, activation: str, out_dtype):
    """dgate, dup in ``out_dtype`` from dA and gate/up as :func:`saved_glu_input` kept them.

    The dequantization (fp32 ``codes / scale``, as :func:`fp8pass.runtime.casting.dequantize`; the
    identity format's values divided by 1) and the final rounding to ``out_dtype`` are part of the
    same loop nest on CPU: eager, the float8 -> fp32 conversion alone cost more than the GLU math.
    """
    g = g_data.float() / g_scale
    u = u_data.float() / u_scale
    dgate, dup = _glu_backward_math(da, g, u, s, smooth, activation)
    return dgate.to(out_dtype), dup.to(out_dtype)


def _swiglu_backward_math(da, gate2d, up2d, s, smooth: str):
    return _glu_backward_math(da, gate2d, up2d, s, smooth, "silu")


def _glu_backward_math(da, gate2d, up2d, s, smooth: str, activation: str):
    """dgate, dup (fp32) from dA, following the mode's definition of A (see the module doc)."""
    da = da.float()
    g = gate2d.float()
    u = up2d.float()
    # dh = dL/d(act(g) * u); token mode's A = act(g) * u / r, channel mode's A = act(g) * u * c
    dh = da / s if smooth == "token" else da * s if smooth == "channel" else da
    # the same ops, in the same order, as autograd's backward of ``act(g) * u``: with the identity
    # format the rewritten GLU's gradients equal the original graph's bit for bit
    return glu_activation_backward(dh * u, g, activation), dh * glu_activation(g, activation)


@swiglu_down_backward_op.register_fake
def _(dy, a_data, a_scale, b_data, b_scale, smooth_scales, gate_data, gate_scale, up_data, up_scale, g_state,
      sr_seed, gate_dtype, w_dtype, *knobs):
    rows, f = gate_data.shape
    return (dy.new_empty(rows, f, dtype=gate_dtype), dy.new_empty(rows, f, dtype=gate_dtype),
            dy.new_empty(b_data.shape, dtype=w_dtype),
            dy.new_empty((), dtype=torch.float32))


def recasts_weight(k: GLUKnobs) -> bool:
    """Whether backward recasts ``W_down`` instead of reading forward's codes (``k.recast_weight``,
    per-tensor FP8 scaling: the recast needs only the saved scalar scale)."""
    return k.recast_weight and k.granularity == "tensor" and resolve_format(k.fwd_format) is not None


def recomputes_operand(k: GLUKnobs) -> bool:
    """Whether backward recomputes ``A`` from the saved FP8 gate/up instead of keeping its codes
    (``k.recompute_output``, per-tensor FP8 scaling: the recast needs only A's saved scalar scale)."""
    return k.recompute_output and k.granularity == "tensor" and resolve_format(k.fwd_format) is not None


def _recomputed_operand(gate_data, gate_scale, up_data, up_scale, s, a_scale, k: GLUKnobs, up_dtype) -> Operand:
    """``A`` (the GLU output with the smoothing ``s`` forward used) recomputed from gate and up as
    :func:`saved_glu_input` kept them, cast with forward's scale ``a_scale``: the DeepSeek-V3 way (the
    GLU's input cached in FP8, its output recomputed), 1 byte per GLU element less kept for backward.

    Not forward's ``A`` bit for bit: gate and up carry their E4M3 rounding (relative 2**-4) into it
    (the same rounding :func:`_glu_backward_from_saved` sees), then ``A`` is rounded again; its
    values can exceed forward's amax by that rounding and saturate at the format's max. On CPU the
    dequantization, the GLU, the smoothing and the cast are one compiled loop that writes the GEMM
    values only."""
    fmt = resolve_format(k.fwd_format)
    g_data, u_data = from_bytes(gate_data, fmt), from_bytes(up_data, fmt)
    if up_dtype is not None and k.activation == "silu" and not uses_triton(g_data.device):
        values = run_fused(_recomputed_values, (g_data, gate_scale, u_data, up_scale, s, a_scale),
                           (k.smooth, fmt.max, *cpu_kernels.rne_constants(fmt), up_dtype))
        return Operand(values, a_scale, None, values)
    a = _operand_with_scales(g_data.float() / gate_scale, u_data.float() / up_scale, s, k.smooth, k.activation)
    return cast_with_scale(a, a_scale, fmt, up_dtype, keep_codes=False, transpose=True)


def _operand_with_scales(g, u, s, smooth: str, activation: str):
    """``A`` from fp32 ``g``, ``u`` and given smoothing scales, in :func:`_glu_operand`'s op order."""
    act = glu_activation(g, activation)
    if smooth == "token":
        return act * (u / s)
    h = act * u
    return h * s if smooth == "channel" else h


def _recomputed_values(g_data, g_scale, u_data, u_scale, s, a_scale, smooth: str, fmax: float, split: float,
                       step: float, tiny: float, up):
    a = _operand_with_scales(g_data.float() / g_scale, u_data.float() / u_scale, s, smooth, "silu")
    return cpu_kernels.rne_values_math(a, a_scale, fmax, split, step, tiny, up)


def _recast_weight(w_down, s, b_scale, k: GLUKnobs, up_dtype) -> Operand:
    """``B`` (``W_down / c`` in channel mode, else ``W_down``) cast again with forward's scale: the
    codes (GPU) or GEMM values (CPU) forward's ``B`` had, bit for bit, from the parameter itself."""
    fmt = resolve_format(k.fwd_format)
    if k.smooth == "channel" and w_down.device.type == "cpu" and not uses_triton(w_down.device):
        return _smoothed_weight_cast_with(w_down, s, b_scale, b_scale, fmt, up_dtype, keep_codes=False)
    if k.smooth == "channel" and uses_triton(w_down.device) and w_down.dtype in _DIVIDED_IN_KERNEL:
        from ..kernels import triton_operand_casts as tk  # the division inside the cast: one launch

        # both layouts: the dgrad GEMM reads B^T row-major (no copy)
        codes, codes_t, _ = tk.transpose_cast(w_down, b_scale, fmt, transpose=True, partials=True, divisor=s)
        return Operand(codes, b_scale, None, data_t=codes_t)
    b = w_down / s.to(w_down.dtype) if k.smooth == "channel" else w_down
    return cast_with_scale(b, b_scale, fmt, up_dtype, keep_codes=False)


def _setup_context(ctx, inputs, output):
    gate, up, w_down, a_state, b_state, g_state = inputs[:6]
    ctx.knobs = GLUKnobs.take(inputs)
    saved = list(output[3:])  # FP8 codes and scales only (gate and up too: saved_glu_input)
    if recasts_weight(ctx.knobs):
        saved[2] = w_down  # a parameter (held anyway), recast in backward: its codes are not kept
    if recomputes_operand(ctx.knobs):
        saved[0] = None  # A is recomputed in backward from the saved gate and up
    ctx.save_for_backward(*saved)
    keep_output_grad_only(ctx, output[0])
    ctx.g_state = list(g_state)
    ctx.sr_stream = inputs[6]
    ctx.n_states = (len(a_state), len(b_state), len(g_state))
    ctx.shape, ctx.gate_dtype, ctx.w_dtype = gate.shape, gate.dtype, w_down.dtype


def _backward(ctx, dy, *unused):
    k = ctx.knobs
    dgate, dup, dw, g_amax = torch.ops.fp8pass.swiglu_down_backward(
        output_grad(ctx, dy), *ctx.saved_tensors, ctx.g_state, draw_seed(ctx.sr_stream, k.grad_rounding, k.bwd_format),
        ctx.gate_dtype, ctx.w_dtype, *k.args())
    record_grad_amax(ctx.g_state, g_amax, k)
    na, nb, ng = ctx.n_states
    return (dgate.reshape(ctx.shape), dup.reshape(ctx.shape), dw, [None] * na, [None] * nb, [None] * ng, None) + \
        GLUKnobs.no_grads()


swiglu_down_op.register_autograd(_backward, setup_context=_setup_context)


def fold_channel_scales(w_up: torch.Tensor, w_down: torch.Tensor, scales: torch.Tensor):
    """Inference: fold fixed per-channel scales into a plain SwiGLU MLP, once.

    Row i of ``W_up`` is multiplied by ``scales[i]`` and column i of ``W_down`` divided by it, so
    ``h_i`` arrives pre-scaled and the MLP's function is unchanged (exactly, for powers of two such
    as :func:`channel_scales` gives). Returns new ``(w_up, w_down)``; the model stays a plain model.
    """
    if scales.dim() != 1 or scales.numel() != w_up.shape[0] or w_down.shape[1] != w_up.shape[0]:
        raise ValueError(f"fold_channel_scales: need scales [{w_up.shape[0]}] for w_up {tuple(w_up.shape)} "
                         f"and w_down {tuple(w_down.shape)}; got {tuple(scales.shape)}")
    s = scales.to(torch.float32)
    new_up = (w_up.float() * s[:, None]).to(w_up.dtype)
    new_down = (w_down.float() / s[None, :]).to(w_down.dtype)
    return new_up, new_down
