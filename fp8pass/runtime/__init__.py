"""Runtime ops: FP8 linear and Smooth-SwiGLU as ``torch.library`` custom ops with autograd.

These are the ops the compile backend rewrites graphs into; ``fp8pass.ops`` wraps them for direct use.
Every op runs in eager mode and inside ``torch.compile`` (aot_eager, inductor) with identical results,
has a fake (meta) implementation, and passes ``torch.library.opcheck``. Arguments are tensors, lists of
tensors and plain scalars/strings only; no argument has a default (the dispatcher drops arguments
equal to their defaults, which would change the backward's input structure), so pass all of them.

Op-level API (``torch.ops.fp8pass.*``)
-------------------------------------
``fp8_linear(x, weight, bias, x_state, w_state, g_state, sr_stream, *LinearKnobs) -> (y, x_amax, w_amax,
x_data, x_scale, w_data, w_scale)``
    ``y = x W^T + b``; FP8 forward (``fwd_format``, "e4m3"), backward with ``dy`` in ``bwd_format``
    ("e5m2") rounded by ``grad_rounding`` ("nearest" | "stochastic"). ``x`` [..., in], ``weight``
    [out, in], ``bias`` [out] or None. ``y`` has ``out_dtype`` (None: ``x``'s dtype); the GEMMs round
    to it, the gradients come back in each input's own dtype. ``x_amax``/``w_amax``: fp32 scalars
    ``max|x|``, ``max|W|`` of this call (what delayed scaling records). The last four outputs are the
    saved operands for backward (codes as uint8, 1 byte/element, and their fp32 scales): ignore them.
    ``sr_stream``: the weight's stochastic-rounding stream (int64 ``[key, draws]``, :mod:`fp8pass.runtime.sr`),
    from which the stochastic gradient casts of every granularity draw their seeds (``sr_draw_``, mutating
    it: one draw per backward, two under MX); None: torch's generator. ``fp8_linear_precast`` and
    ``swiglu_down`` take it at the same place.
``fp8_cast_input(x, x_state, *LinearKnobs) -> (x_data, x_scale, x_amax, x_alt)`` and
``fp8_linear_precast(x, x_data, x_scale, x_alt, weight, bias, w_state, g_state, sr_stream, *LinearKnobs) ->
(y, w_amax, w_scale)``
    ``fp8_linear`` split in two (:mod:`fp8pass.runtime.precast`): one forward-only cast of ``x`` shared by
    every linear that reads it (its codes saved once for backward), then each linear from the cast
    (``x`` passed too, for its gradient; not read). The backward recasts ``W`` with ``w_scale`` instead of
    keeping its codes. What the compile backend emits (not under MX granularity). Same results as
    ``fp8_linear`` under current scaling, bit for bit.
``swiglu_down(gate, up, w_down, a_state, b_state, g_state, sr_stream, *GLUKnobs) -> (y, a_amax, b_amax, a_data,
a_scale, b_data, b_scale, smooth_scales, gate_data, gate_scale, up_data, up_scale)``
    ``y = (act(gate) * up) W_down^T`` with ``activation`` = "silu" (SwiGLU) | "gelu" | "gelu_tanh"
    (GeGLU) | "relu" (ReGLU) and Smooth-SwiGLU ``smooth`` = "channel" | "token" | "none"
    (see :mod:`fp8pass.runtime.swiglu`; silu has the fused CPU/Triton kernels, the others run as
    eager torch math with exact derivatives); ``gate``/``up`` [..., ffn] come from ``fp8_linear`` calls
    (one fused gate/up linear + ``chunk(2, -1)`` is fine). ``a`` is the operand built from ``h``,
    ``b`` the (column-scaled) ``W_down``; outputs 4-12 are for backward (codes and scales only:
    ``gate``/``up`` are kept as E4M3 codes, the GLU derivative uses their dequantized values; with the
    ``recast_weight`` knob, which the backend and ``ops.swiglu_mlp`` set on one rank, ``b``'s codes are
    not kept: backward casts ``W_down`` again with ``b_scale``).
``rmsnorm(x, weight, eps, hat_dtype, out_dtype, fwd_format) -> (y, x_hat_data, x_hat_scale, rstd)``
    An RMSNorm (the model's own form, bit for bit: :class:`~fp8pass.op_schema.NormKnobs`) that keeps
    for backward its normalized input as E4M3 codes and ``rstd`` instead of its high-precision input
    (:mod:`fp8pass.runtime.rmsnorm`; ``Config.save_norm_input_fp8``).
``fp8_grouped_linear(x, weight, offs, w_transposed, x_state, w_state, g_state, sr_stream, *GroupedLinearKnobs)
-> (y, x_amax, w_amax, x_data, x_scale, w_data, w_scale)``
    MoE experts (:mod:`fp8pass.runtime.grouped_linear`; knobs: ``fwd_format, bwd_format, power_of_two,
    grad_rounding, margin, interval, algo, out_dtype``): ``x`` [S, K] rows sorted by expert, ``offs`` int32
    [E] cumulative group ends as ``torch._grouped_mm`` takes them (rows past ``offs[-1]``: zero output
    and gradient), ``weight`` [E, N, K] (``y_g = x_g W_e^T``) or, ``w_transposed``, [E, K, N]
    (``y_g = x_g W_e``); ``y`` [S, N] in ``out_dtype`` (the replaced node's dtype, as ``fp8_linear``;
    None: ``x``'s). Per-expert scales: ``x_amax``/``w_amax`` are
    fp32 [E] (amax of each expert's rows / weight; 0 for an empty group), and delayed states are
    stacks of E (history [E, H], scale/steps/skipped [E]; :func:`grouped_state_for`). Always
    per-tensor-per-expert (no granularity/block arguments). Outputs 4-7: saved codes and [E] scales.
    ``sr_stream``: the expert stack's stochastic-rounding stream (one for all its experts; as ``fp8_linear``'s).
``fp8_grouped_swiglu_down(gate, up, w_down, offs, w_transposed, a_state, b_state, g_state, sr_stream,
*GroupedGLUKnobs) -> (y, a_amax, b_amax, a_data, a_scale, b_data, b_scale, smooth_scales)``
    ``swiglu_down`` for grouped rows (:mod:`fp8pass.runtime.grouped_swiglu`; knobs: the grouped linear's,
    then ``activation, smooth``): ``gate``/``up`` [S, F] (or ``up`` None and ``gate`` the fused [S, 2F],
    gate first), ``w_down`` [E, D, F] (or [E, F, D]
    with ``w_transposed``), ``y`` [S, D]. Smooth-SwiGLU per expert: ``channel`` scales are
    ``smooth_scales`` [E, F] from each expert's own rows, folded into that expert's ``W_down``
    columns (current-scaled); ``token`` gives [S, 1], ``none`` [].
``delayed_record_(history, scale, steps, skipped, overflows, guard, pending, accumulate, amax, fmt, margin,
interval, algo, power_of_two) -> None``
    Records one amax into one delayed-scaling state in place (no autograd; composite, so Inductor
    fuses it into the backward graph). It broadcasts over leading dims: history [E, H] with
    scale/steps/skipped/amax [E] records E per-expert states in one call. Inside
    ``fp8pass.accumulate_scaling`` it only raises ``pending``.
``delayed_record_many_(lists of the state fields, amaxes, fmts, margin, interval, algo, power_of_two) -> None``
    Every forward record of a compiled graph in one op at the graph's end (states stacked per shape,
    updated together, written back with ``_foreach_copy_``). These two (and ``sr_draw_(stream) -> seed``,
    the backward's draw from a stochastic-rounding stream) are the only ops that mutate state.
``state_snapshot(Tensor[] state) -> Tensor[]``
    Copies of state tensors (no autograd, opaque to Inductor): an activation-checkpointed region reads
    its input and weight states through them, so its recomputation in backward casts with the scales
    the forward used (passes/rewrite_hop.py).
``fp8_linear_backward`` / ``fp8_linear_precast_backward`` / ``swiglu_down_backward`` / ``fp8_grouped_linear_backward`` /
``fp8_grouped_swiglu_down_backward``: the ops the backward formulas call; internal.
``nvfp4_linear(x, weight, bias, hcp_state, sr_stream, weight_2d, rht, rht_seed, grad_sr, hcp_second_order,
hcp_mode, hcp_backward) -> (y, chan_err, hot)``
    The NVFP4 recipe (:mod:`fp8pass.runtime.nvfp4`, docs/nvfp4.md): E2M1 operands with E4M3 16-element
    block scales, RNE forward, SR gradients, RHT on the wgrad operands, 16x16 weight blocks.
    ``hcp_state`` = ``[err, hot, step]`` (:class:`HCPState`) or []; read only; ``chan_err`` is the
    per-input-channel GEMM error (both operands) to record with ``hcp_update_(err, hot, step,
    chan_err, decay, interval)`` (mutating, no autograd; :mod:`fp8pass.runtime.hcp`); ``hot`` the
    channels patched in this call (and, with ``hcp_backward``, in its gradient GEMMs). ``sr_stream``: as
    ``fp8_linear``'s (two draws per backward: dgrad's and wgrad's stochastic casts of ``dy``), or None.

Knobs (the scalar arguments)
    Declared once per op in :mod:`fp8pass.op_schema` (``LinearKnobs``; ``GLUKnobs`` adds
    ``activation`` and ``smooth``) and flattened into the schema as the op's last arguments, in
    field order: ``fwd_format, bwd_format, granularity, block, power_of_two, grad_rounding, margin,
    interval, algo, out_dtype`` (then ``activation, smooth``). Pass them positionally
    (``*knobs.args()``) or by name. ``out_dtype``: the dtype the op outputs and its GEMMs round to;
    the compile backend passes the replaced node's dtype (under autocast, the autocast dtype, so the
    rewritten graph computes in the original's dtypes); ``fp8pass.ops`` passes the autocast dtype
    when autocast is on, else None (the input's dtype). ``fwd_format``/``bwd_format``: "e4m3" |
    "e4m3_gaudi" | "e5m2", or "identity" (testing hook: no quantization, the ops compute the
    unquantized math in ``out_dtype``, as the replaced node did; not a numerics Format). ``granularity``:
    "tensor" | "row" | "block" with ``block`` the tile edge (1 x B tiles for x/dy/h, B x B for
    weights) | "mx" (OCP MXFP8: 32-element E8M0-scaled blocks along each GEMM's reduction dim,
    ``block`` ignored; docs/numerics.md); current scaling only, delayed scaling is per tensor.
    ``power_of_two``: round scales down to powers of two. ``margin``, ``interval``, ``algo``: the
    DelayedScaling recipe's fields.

Delayed-scaling state (how it enters and how it is updated)
    A state is the op list of a :class:`fp8pass.numerics.DelayedScalingState`,
    ``state.op_tensors()`` = ``[amax_history, scale, steps, skipped, overflows, guard, pending, accumulate]``; an empty list
    means current scaling for that role. The ops only *read* ``x_state``/``w_state`` (cast with
    ``scale``; with the current amax's scale while the history is empty, or when the overflow guard
    is on and the tensor outgrew ``scale``) and return the amaxes; the eager caller records them with
    ``delayed_record_`` right after the op, the compile backend with one ``delayed_record_many_`` at
    the end of the graph. ``g_state`` is read in backward, and the backward formula
    itself calls ``delayed_record_`` on it with ``dy``'s amax (AOT autograd supports mutating a forward
    input in the backward graph; the op with ``register_autograd`` cannot declare ``mutates_args``,
    see docs/background.md, torch.compile facts; so recording is a separate op). In a compiled graph,
    the state tensors are graph inputs (not buffers of Dynamo's GraphModule); functionalization turns ``delayed_record_`` into
    copies onto those inputs; the op is never dead-code-eliminated because it mutates its inputs.
    :class:`LinearScalingState` holds the input/weight/grad_output states of one linear
    (``op_args()`` gives the three lists, ``record_forward(x_amax, w_amax)`` records, and
    ``state_dict()`` flattens to plain tensors); :func:`state_for` keeps one per weight tensor.
    ``swiglu_down`` uses the same object for (h operand, W_down, grad_output). In ``channel`` mode
    ``W_down / c`` changes every call, so it is always current-scaled (``b_state`` is not read).

no_grad / inference_mode
    No backward state is saved and no grad_output amax is recorded; ``fp8pass.ops`` also passes no
    ``g_state`` when grad mode is off. Forward amaxes are still returned (and ``fp8pass.ops`` records
    them: they are the scales in use).

Kernels
    Per device in :mod:`fp8pass.kernels`: CPU = Inductor-compiled casts + bf16 GEMMs of upcast
    codes (never ``_scaled_mm``); CUDA = Triton casts/fused SwiGLU cast + ``torch._scaled_mm``.
    ``FP8PASS_KERNELS=triton`` (with ``TRITON_INTERPRET=1``) runs the CUDA path on CPU for testing.
"""

from .casting import IDENTITY
from .grouped_linear import fp8_grouped_linear_op
from .grouped_swiglu import fp8_grouped_swiglu_down_op
from .hcp import HCPState, hcp_state_for
from .linear import fp8_linear_op
from .nvfp4 import nvfp4_linear_op, nvfp4_values
from .precast import fp8_cast_input_op, fp8_linear_precast_op
from .rmsnorm import rmsnorm_op
from .state import ROLES, LinearScalingState, delayed_record_, grouped_state_for, record, state_for
from .swiglu import ACTIVATIONS, SMOOTH_MODES, channel_scales, fold_channel_scales, swiglu_down_op, token_scales

__all__ = ["IDENTITY", "fp8_linear_op", "swiglu_down_op", "delayed_record_", "record", "ROLES",
           "LinearScalingState", "state_for", "SMOOTH_MODES", "ACTIVATIONS", "channel_scales", "token_scales",
           "fold_channel_scales", "nvfp4_linear_op", "nvfp4_values", "HCPState", "hcp_state_for",
           "fp8_grouped_linear_op", "fp8_grouped_swiglu_down_op", "grouped_state_for", "fp8_cast_input_op",
           "fp8_linear_precast_op", "rmsnorm_op"]
