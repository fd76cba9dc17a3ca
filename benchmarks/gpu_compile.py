"""Compile every fp8pass Triton kernel for an NVIDIA GPU, without one: frontend, TTIR, TTGIR, PTX, cubin.

    python -m benchmarks.gpu_compile [--arch 90] [--json FILE]

Triton compiles ahead of time for a target (``GPUTarget("cuda", arch, 32)``, ptxas ships in the
triton wheel), so the kernels' GPU builds are checked on a CPU-only machine: type errors, constexpr
branches, int64 index math, ``tl.trans`` layouts, register pressure that ptxas rejects. It runs in its
own process with TRITON_INTERPRET unset (the interpreter skips compilation entirely). Every config of
every autotuned kernel is compiled, for each format and flag combination the code can take.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":
    raise SystemExit("gpu_compile.py compiles kernels: run it with TRITON_INTERPRET unset")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9 warns when it is unset

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from fp8pass.kernels import triton_adam as ts  # noqa: E402
from fp8pass.kernels import triton_adam_split as tsplit  # noqa: E402
from fp8pass.kernels import triton_family as tf  # noqa: E402
from fp8pass.kernels import triton_helpers
from fp8pass.kernels import triton_operand_casts as tk  # noqa: E402
from fp8pass.numerics import E2M1, E4M3, E5M2  # noqa: E402
from fp8pass.numerics.scaling import MAX_SCALE  # noqa: E402
from fp8pass.optim.moments import MomentSpec  # noqa: E402


def _jit(kernel):
    """The JITFunction under an autotuner (or the kernel itself)."""
    while not isinstance(kernel, triton.runtime.jit.JITFunction):
        kernel = kernel.fn
    return kernel


def _configs(kernel) -> list:
    return list(getattr(kernel, "configs", [None]))


_MOMENT_PTR = {"e4m3": "*u8", "e5m2": "*u8", "bf16": "*bf16", "fp32": "*fp32"}


def _adam_signature(ms: MomentSpec, vs: MomentSpec, split: bool, bf16_sr: bool = False) -> dict:
    """Runtime-argument types of the fused Adam kernel, or (``split``) of the split-block one; ``bf16_sr``:
    a bf16 parameter stored by stochastic rounding (``bf16_stochastic_round``), else an fp32 one."""
    m, v = _MOMENT_PTR[ms.fmt], _MOMENT_PTR[vs.fmt]
    sig = {"p_ptr": "*bf16" if bf16_sr else "*fp32", "g_ptr": "*bf16", "m_ptr": m, "ms_ptr": "*fp32" if ms.fp8 else m,
           "v_ptr": v, "vs_ptr": "*fp32" if vs.fp8 else v, "hp_ptr": "*fp32", "seed_ptr": "*i64",
           "wseed_ptr": "*i32" if bf16_sr else "*fp32", "table_ptr": "*i64"}
    hp = {name: "fp32" for name in ts._HP_ARGS}  # the hyper-parameters as fp32 arguments (host step count)
    if split:
        return {**sig, "scratch_ptr": "*fp32", "n_tensors": "i32", **hp}
    return {**sig, "n_tensors": "i32", "rows_class": "i32", **hp}


def _adam_meta(ms: MomentSpec, vs: MomentSpec, stochastic: bool, bf16_sr: bool = False) -> dict:
    """The update's compile-time arguments, as the launchers build them (``triton_adam._step_meta``) for
    an sm_89+ GPU (FP8 moments decoded and, rounding to nearest, encoded by the hardware conversions)."""
    return dict(ts._step_meta(ms, vs, dict(maximize=False, coupled_wd=False,
                                           rounding="stochastic" if stochastic else "nearest",
                                           stochastic_flush=False)), HP_TABLE=False, M_HW=int(ms.fp8),
                V_HW=int(vs.fp8), BF16_SR=bf16_sr)


def _hw(fmt) -> int:
    """The cast kernels' HW constexpr as the launchers set it on an sm_89+ GPU (triton_family.hardware_cast)."""
    return int(not fmt.packed and (fmt.mbits, fmt.bias, float(fmt.max)) in triton_helpers.HW_FORMATS)


def cases():
    """(name, kernel, runtime-arg types, constexprs) for every kernel variant worth compiling."""
    out = []
    for fmt in (E4M3, E5M2, E2M1):
        for stochastic in (False, True):
            for cfg in tf._prune_flat_configs(_configs(tf._cast_tensor_kernel), {}, STOCHASTIC=stochastic,
                                              PACKED=fmt.packed):
                sig = {"x_ptr": "*bf16", "out_ptr": "*u8", "scale_ptr": "*fp32", "partial_ptr": "*fp32",
                       "seed_ptr": "*i64", "n": "i64", "n_class": "i32"}
                c = dict(STOCHASTIC=stochastic, PACKED=fmt.packed, WANT_AMAX=True, **tf._fmt_args(fmt), **cfg.kwargs,
                         HW=_hw(fmt))
                out.append((f"cast {fmt.name} sr={stochastic} {cfg.kwargs}", tf._cast_tensor_kernel, sig, c, cfg))
    for cfg in _configs(tf._amax_kernel):
        out.append((f"amax {cfg.kwargs}", tf._amax_kernel,
                    {"x_ptr": "*fp32", "partial_ptr": "*fp32", "n": "i64", "n_class": "i32"}, dict(cfg.kwargs), cfg))
    for fmt, tile in ((E4M3, (1, 128)), (E4M3, (128, 128)), (E2M1, (1, 16)), (E5M2, (3, 7))):
        for mode in (0, 1, 2):
            trp, tcp, gr, gc = tf._tiles_per_program(tile, fmt.packed)
            cr = tf._row_chunk(tile, fmt.packed)
            gr, gc = (1, 1) if cr else (gr, gc)
            sig = {"x_ptr": "*fp32", "out_ptr": "*u8", "scales_ptr": "*fp32", "amax_ptr": "*fp32",
                   "seed_ptr": "*i64", "rows": "i32", "cols": "i32", "n_row_tiles": "i32", "n_col_tiles": "i32"}
            c = dict(TR=tile[0], TC=tile[1], TRP=trp, TCP=tcp, GR=gr, GC=gc, STOCHASTIC=mode == 0,
                     PACKED=fmt.packed, FMAX=fmt.max, MAX_SCALE_C=MAX_SCALE, POW2=False,
                     NAN_SCALE=fmt.nan_code is None, MODE=mode, **tf._fmt_args(fmt), HW=0 if mode == 2 else _hw(fmt),
                     SR4=mode == 0 and tile[1] % 4 == 0, CR=cr)
            out.append((f"tiles {fmt.name} {tile} mode={mode}", tf._quantize_tiles_kernel, sig, c,
                        triton.Config({}, num_warps=tf._tile_warps(tile, fmt.packed))))
    for transpose, stochastic, conditional, delayed, divide in (
            (False, False, False, False, None), (True, False, False, False, None), (True, True, False, False, None),
            (True, False, True, False, None), (False, True, True, False, None), (True, False, False, True, None),
            (True, True, False, True, None), (False, False, False, False, "bf16"),
            (False, False, False, False, "fp32")):
        for cfg in tk._prune_tile_configs(_configs(tk._transpose_cast_kernel), {}, STOCHASTIC=stochastic):
            sig = {"x_ptr": f"*{divide or 'bf16'}", "scale_ptr": "*fp32", "out_ptr": "*u8", "out_t_ptr": "*u8",
                   "amax_ptr": "*fp32", "seed_ptr": "*i64", "flag_ptr": "*i32", "div_ptr": "*fp32", "R": "i32",
                   "C": "i32", "r_class": "i32", "c_class": "i32", "counter_ptr": "*i32",
                   **{k: v for k, v in _EPILOGUE_SIG.items() if k != "held_ptr"}}
            c = dict(TRANSPOSE=transpose, STOCHASTIC=stochastic, CONDITIONAL=conditional, **tk._fmt_kw(E4M3),
                     **cfg.kwargs, HW=_hw(E4M3), SR4=stochastic)
            # the last program's scale epilogue (cuda.cast_delayed), or its off defaults (named: triton 3.9's
            # ahead-of-time compile does not fill in defaulted constexprs)
            c.update(DELAYED=delayed, N_INVERT=2 if delayed else 0, TARGET=448.0, FMT_MAX=448.0,
                     MAX_SCALE_C=MAX_SCALE, HUGE=2.0**64, POW2=False, NAN_SCALE=False, RBLOCK=1024,
                     DIVIDE=divide is not None, ROW_MAJOR=True)
            out.append((f"transpose_cast T={transpose} sr={stochastic} if={conditional}"
                        + (" delayed" if delayed else "") + (f" divide {divide}" if divide else "")
                        + f" {cfg.kwargs}", tk._transpose_cast_kernel, sig, c, cfg))
            if transpose and not (stochastic or conditional or delayed or divide):
                # the transposed codes alone (the precast backward's weight recast)
                out.append((f"transpose_cast T={transpose} sr={stochastic} if={conditional} T-only {cfg.kwargs}",
                            tk._transpose_cast_kernel, sig, dict(c, ROW_MAJOR=False), cfg))
    for mode, inputs, transpose in ((0, False, False), (1, False, False), (2, False, False), (1, True, False),
                                    (1, True, True)):
        sig = {"g_ptr": "*bf16", "u_ptr": "*bf16", "c_ptr": "*fp32", "r_ptr": "*fp32", "scale_ptr": "*fp32",
               "out_ptr": "*u8", "amax_ptr": "*fp32", "g_scale_ptr": "*fp32", "u_scale_ptr": "*fp32",
               "g_out_ptr": "*u8", "u_out_ptr": "*u8", "out_t_ptr": "*u8", "T": "i32", "F": "i32"}
        out.append((f"swiglu_cast mode={mode}" + (" inputs" if inputs else "") + (" T" if transpose else ""),
                    tk._swiglu_cast_kernel, sig, dict(MODE=mode, STORE=True, BT=32, BF=64, **tk._fmt_kw(E4M3), HW=1,
                                                      INPUTS=inputs, TRANSPOSE=transpose), None))
    for input_max in (False, True):
        out.append(("swiglu_colamax" + (" input_max" if input_max else ""), tk._swiglu_colamax_kernel,
                    {"g_ptr": "*bf16", "u_ptr": "*bf16", "out_ptr": "*fp32", "gu_ptr": "*fp32", "T": "i32",
                     "F": "i32"}, dict(BT=32, BF=64, INPUT_MAX=input_max), None))
    out.extend(_scaling_cases())
    out.extend(_grouped_cases())
    out.extend(_norm_cases())
    for mf, vf, block in (("e4m3", "e5m2", 128), ("e5m2", "e4m3", 128), ("bf16", "fp32", 128),
                          ("e4m3", "e5m2", 8192)):
        ms, vs = MomentSpec("exp_avg", mf, block), MomentSpec("exp_avg_sq", vf, block, sqrt=True)
        for stochastic in (False, True):
            span = ts._span(block)
            for cfg in ts._prune_adam_configs(_configs(ts._adam_kernel), {}, SPAN=span, BLOCK=block):
                c = dict(**_adam_meta(ms, vs, stochastic), BLOCK=block, SPAN=span, SEARCH_STEPS=4, ALIGNED=True,
                         W=ts._W, **cfg.kwargs)
                out.append((f"adam {mf}/{vf} block={block} sr={stochastic} {cfg.kwargs}", ts._adam_kernel,
                            _adam_signature(ms, vs, split=False), c, cfg))
    # bf16_stochastic_round: bf16 weights stored by stochastic rounding (the moments rounded to nearest,
    # the option's default), at the default blocks and the widest fused one
    for block in (128, 8192):
        ms, vs = MomentSpec("exp_avg", "e4m3", block), MomentSpec("exp_avg_sq", "e5m2", block, sqrt=True)
        span = ts._span(block)
        for cfg in ts._prune_adam_configs(_configs(ts._adam_kernel), {}, SPAN=span, BLOCK=block):
            c = dict(**_adam_meta(ms, vs, False, bf16_sr=True), BLOCK=block, SPAN=span, SEARCH_STEPS=4, ALIGNED=True,
                     W=ts._W, **cfg.kwargs)
            out.append((f"adam bf16-SR e4m3/e5m2 block={block} sr=False {cfg.kwargs}", ts._adam_kernel,
                        _adam_signature(ms, vs, split=False, bf16_sr=True), c, cfg))
    # split-block kernel (one scale per tensor): both phases; its launch configuration is fixed
    for mf, vf, bf16_sr in (("e4m3", "e5m2", False), ("e5m2", "e4m3", False), ("bf16", "fp32", False),
                            ("e4m3", "e5m2", True)):
        ms, vs = MomentSpec("exp_avg", mf, 1 << 20), MomentSpec("exp_avg_sq", vf, 1 << 20, sqrt=True)
        for stochastic in (False, True):
            for write in (False, True):
                if bf16_sr and (stochastic or not write):  # phase 1 writes no weight: the same as without
                    continue
                c = dict(**_adam_meta(ms, vs, stochastic, bf16_sr), WRITE=write, SPAN=ts.MAX_SPAN, SEARCH_STEPS=4,
                         ALIGNED=True, RAND4=True, W=len(tsplit._SPLIT_COLS), SLOT=tsplit._SLOT)
                prefix = "adam bf16-SR split" if bf16_sr else "adam split"
                out.append((f"{prefix} {mf}/{vf} sr={stochastic} write={write}", tsplit._split_kernel,
                            _adam_signature(ms, vs, split=True, bf16_sr=bf16_sr), c,
                            triton.Config({}, num_warps=tsplit._num_warps(bf16_sr))))
    return out


def _norm_cases():
    """The RMSNorm kernels (kernels/triton_norm.py) at the row widths of Llama models (2048 to 16384),
    with their launch configurations (``triton_norm._block``), for an fp32 residual stream (TinyLlama's
    form, fp32 y) and a bf16 one (HF's, bf16 hat and y), E4M3."""
    import triton.language as tl

    from fp8pass.kernels import triton_norm as tn

    out = []
    fmt_c = dict(TARGET=448.0, FMT_MAX=448.0, MAX_SCALE_C=MAX_SCALE, HUGE=2.0**64, POW2=False, NAN_SCALE=False)
    for d in (2048, 4096, 8192, 16384):
        rows, chunk, wide, warps = tn._block(1 << 14, d)
        cfg = triton.Config({}, num_warps=warps)
        shape = dict(ROWS=rows, CHUNK=chunk)
        for x, hat in (("fp32", None), ("bf16", "bf16")):
            y = hat or "fp32"
            tl_of = {"fp32": tl.float32, "bf16": tl.bfloat16}
            fwd = {"x_ptr": f"*{x}", "w_ptr": f"*{y}", "y_ptr": f"*{y}", "rstd_ptr": "*fp32", "partial_ptr": "*fp32",
                   "counter_ptr": "*i32", **_EPILOGUE_SIG, "rows": "i32", "D": "i32", "eps": "fp32"}
            out.append((f"norm forward x={x} d={d}", tn._rmsnorm_forward_kernel, fwd,
                        dict(HAT=tl_of[hat or "fp32"], PROD=tl_of[y], OUT=tl_of[y], N_INVERT=0, DELAYED=False,
                             **fmt_c, **shape, WIDE=wide, RBLOCK=1024), cfg))
            cast = {"x_ptr": f"*{x}", "rstd_ptr": "*fp32", "scale_ptr": "*fp32", "out_ptr": "*u8", "rows": "i32",
                    "D": "i32"}
            out.append((f"norm cast x={x} d={d}", tn._rmsnorm_cast_kernel, cast,
                        dict(**tk._fmt_kw(E4M3), HW=_hw(E4M3), **shape), cfg))
            bwd = {"dy_ptr": f"*{y}", "codes_ptr": "*u8", "scale_ptr": "*fp32", "rstd_ptr": "*fp32", "w_ptr": f"*{y}",
                   "dx_ptr": f"*{x}", "part_ptr": "*fp32", "rows": "i32", "D": "i32"}
            b_rows, b_chunk, _, b_warps = tn._block(1 << 14, d, backward=True)
            out.append((f"norm backward x={x} d={d}", tn._rmsnorm_backward_kernel, bwd,
                        dict(MBITS=3, BIAS=7, IEEE_SPECIALS=False, HW=_hw(E4M3), ROWS=b_rows, CHUNK=b_chunk, WIDE=wide),
                        triton.Config({}, num_warps=b_warps)))
    for w in ("fp32", "bf16"):
        out.append((f"norm column_sum w={w}", tn._column_sum_kernel,
                    {"part_ptr": "*fp32", "n_part": "i32", "D": "i32", "out_ptr": f"*{w}"}, dict(BP=8, BC=256), None))
    return out


def _grouped_glu_cases():
    """The grouped GLU tail's activation kernels (kernels/triton_grouped_glu.py): the channel maxima, the
    operand A (channel / none), the backward (channel / none), for silu and relu, 8 and 128 experts."""
    from fp8pass.kernels import triton_grouped_glu as tgg

    out = []
    br, bc = tgg._TILE
    fwd = {"g_ptr": "*bf16", "u_ptr": "*bf16", "ld": "i32", "c_ptr": "*fp32", "amax_ptr": "*i32", "a_ptr": "*fp32",
           "R": "i32", "F": "i32", "offs_ptr": "*i32", "E": "i32"}
    bwd = {"da_ptr": "*bf16", "g_ptr": "*bf16", "u_ptr": "*bf16", "ld": "i32", "c_ptr": "*fp32", "dg_ptr": "*bf16",
           "du_ptr": "*bf16", "out_ld": "i32", "R": "i32", "F": "i32", "offs_ptr": "*i32", "E": "i32"}
    for act in tgg.ACTIVATIONS:
        for experts in (8, 128):
            kw = dict(ACT=tgg.ACTIVATIONS[act], EP=experts, BR=br, BC=bc)
            out.append((f"grouped_glu amax act={act} experts={experts}", tgg._grouped_glu_kernel, fwd,
                        dict(AMAX=True, SMOOTH=False, **kw), None))
            for smooth in (True, False):
                mode = "channel" if smooth else "none"
                out.append((f"grouped_glu operand {mode} act={act} experts={experts}", tgg._grouped_glu_kernel, fwd,
                            dict(AMAX=False, SMOOTH=smooth, **kw), None))
                out.append((f"grouped_glu backward {mode} act={act} experts={experts}",
                            tgg._grouped_glu_backward_kernel, bwd, dict(SMOOTH=smooth, **kw), None))
    return out


def _grouped_cases():
    """The MoE operand casts (kernels/triton_grouped_casts.py): rows grouped by ``offs`` or uniform groups
    (stacked weights), current or delayed scales, each format."""
    from fp8pass.kernels import triton_grouped_casts as tgc

    out = []
    fmt_c = dict(TARGET=448.0, FMT_MAX=448.0, MAX_SCALE_C=MAX_SCALE, HUGE=2.0**64, POW2=False, NAN_SCALE=False)
    # DIVIDE (uniform groups): Smooth-SwiGLU's W_down / c per column (1) or row (2) of each expert
    for uniform, delayed, divide in ((False, False, 0), (False, True, 0), (True, False, 0), (True, True, 0),
                                     (True, False, 1), (True, False, 2)):
        sig = {"x_ptr": "*bf16", "R": "i32", "C": "i32", "offs_ptr": "*i32", "E": "i32", "group_rows": "i32",
               "row_max_ptr": "*fp32", "counter_ptr": "*i32",
               **{k: _EPILOGUE_SIG[k] for k in ("held_ptr", "steps_ptr", "skipped_ptr", "guard_ptr", "amax_out",
                                                "scale_out", "inv_out", "recast_out")}, "div_ptr": "*fp32",
               "blocks_per_group": "i32"}
        c = dict(UNIFORM=uniform, DELAYED=delayed, **fmt_c, BR=tgc._AMAX_TILE[0], BC=tgc._AMAX_TILE[1],
                 RBLOCK=tgc._RBLOCK, DIVIDE=divide)
        out.append((f"grouped_amax_scale uniform={uniform} delayed={delayed}" + (f" divide={divide}" if divide else ""),
                    tgc._grouped_amax_scale_kernel, sig, c, None))
    for fmt in (E4M3, E5M2):
        for uniform, experts, transpose, divide in ((False, 8, False, 0), (False, 128, False, 0), (True, 8, False, 0),
                                                    (True, 8, True, 0), (True, 8, True, 1), (True, 8, True, 2)):
            sig = {"x_ptr": "*bf16", "out_ptr": "*u8", "out_t_ptr": "*u8", "R": "i32", "C": "i32",
                   "offs_ptr": "*i32", "E": "i32", "group_rows": "i32", "blocks_per_group": "i32",
                   "scale_ptr": "*fp32", "inv_ptr": "*fp32", "row_inv_ptr": "*fp32", "pad_ptr": "*u8",
                   "div_ptr": "*fp32"}
            c = dict(UNIFORM=uniform, EP=experts, ROW_INV=True, TRANSPOSE=transpose, **tk._fmt_kw(fmt), HW=_hw(fmt),
                     BR=tgc._CAST_TILE[0], BC=tgc._CAST_TILE[1], DIVIDE=divide)
            out.append((f"grouped_cast {fmt.name} uniform={uniform} experts={experts}"
                        + (" transpose" if transpose else "") + (f" divide={divide}" if divide else ""),
                        tgc._grouped_cast_kernel, sig, c, None))
    out.extend(_grouped_glu_cases())
    for experts, divide in ((8, False), (128, False), (8, True)):  # DIVIDE: the smoothed wgrad's dW = dB / c
        sig = {"codes_ptr": "*u8", "out_ptr": "*u8", "S": "i32", "C": "i32", "W": "i32", "offs_ptr": "*i32",
               "E": "i32", "scale_ptr": "*fp32", "ends_out": "*i32", "empty_out": "*u8", "rep_inv_out": "*fp32",
               "div_ptr": "*fp32", "BPP": "i32"}
        out.append((f"grouped_aligned_transpose experts={experts}" + (" divide" if divide else ""),
                    tgc._aligned_transpose_kernel, sig,
                    dict(EP=experts, BT=tgc._TRANSPOSE_TILE[0], BC=tgc._TRANSPOSE_TILE[1], DIVIDE=divide),
                    triton.Config({}, num_warps=tgc._TRANSPOSE_WARPS, num_stages=tgc._TRANSPOSE_STAGES)))
    return out


# the arguments of triton_scaling.scale_epilogue (triton_scaling.epilogue_args)
_EPILOGUE_SIG = {"held_ptr": "*fp32", "steps_ptr": "*i64", "skipped_ptr": "*i64", "guard_ptr": "*i1",
                 "inv0_in": "*fp32", "inv1_in": "*fp32", "amax_out": "*fp32", "scale_out": "*fp32", "inv_out": "*fp32",
                 "recast_out": "*i32", "inv0_out": "*fp32", "inv1_out": "*fp32"}


def _scaling_cases():
    """The one-program scalar kernels (kernels/triton_scaling.py) and the SwiGLU backward."""
    from fp8pass.kernels import triton_glu as tg
    from fp8pass.kernels import triton_scaling as tsc
    from fp8pass.numerics.scaling import HUGE_AMAX, NO_PENDING, OVERFLOW_FACTOR

    fmt = dict(TARGET=448.0, FMT_MAX=448.0, MAX_SCALE_C=MAX_SCALE, HUGE=HUGE_AMAX, POW2=False, NAN_SCALE=False)
    out = []
    f32 = "*fp32"
    epilogue = _EPILOGUE_SIG
    for delayed, n_invert in ((False, 0), (True, 2)):
        sig = {"partial_ptr": f32, "n_partial": "i32", **epilogue}
        out.append((f"operand_scale delayed={delayed} invert={n_invert}", tsc._operand_scale_kernel, sig,
                    dict(N_INVERT=n_invert, DELAYED=delayed, BLOCK=tsc._PARTIALS_BLOCK, **fmt), None))
    for n_invert in (0, 2):
        sig = {"x_ptr": "*bf16", "n": "i64", "partial_ptr": f32, "counter_ptr": "*i32", **epilogue}
        out.append((f"amax_scale invert={n_invert}", tsc._amax_scale_kernel, sig,
                    dict(N_INVERT=n_invert, DELAYED=False, BLOCK=4096, RBLOCK=1024, **fmt), None))
    for n_direct, algo_max in ((0, True), (2, False)):
        sig = {"amax_ptr": f32, "a1_ptr": f32, "a2_ptr": f32, "a3_ptr": f32, "table_ptr": "*i64", "hist0": f32,
               "scale0": f32, "steps0": "*i64", "skipped0": "*i64", "over0": "*i64", "pend0": f32, "acc0": "*u8",
               "H": "i32", "interval": "i32"}
        out.append((f"record direct={n_direct} max={algo_max}", tsc._record_kernel, sig,
                    dict(N_DIRECT=n_direct, ALGO_MAX=algo_max, OVERFLOW=OVERFLOW_FACTOR, NO_PENDING_C=NO_PENDING,
                         BH=16, **{k: v for k, v in fmt.items() if k != "FMT_MAX"}, FMT_MAX=448.0), None))
    for scales, with_b, delayed in ((False, False, False), (True, False, False), (True, True, False),
                                    (True, True, True)):
        sig = {"part_ptr": f32, "rows": "i32", "F": "i32", "c_ptr": f32, "gu_ptr": f32, "n_gu": "i32",
               "w_ptr": "*bf16", "N": "i32", "prog_max_ptr": f32, "counter_ptr": "*i32",
               **{k: epilogue[k] for k in ("held_ptr", "steps_ptr", "skipped_ptr", "guard_ptr", "amax_out",
                                           "scale_out", "inv_out", "recast_out")},
               "b_amax_out": f32, "b_scale_out": f32, "b_inv_out": f32, "g_scale_out": f32, "u_scale_out": f32}
        c = dict(C_MIN=2.0**-64, C_MAX=2.0**64, BR=16, BF=128, SCALES=scales, WITH_B=with_b, DELAYED=delayed,
                 G_TARGET=448.0, GBLOCK=tsc._PARTIALS_BLOCK, RBLOCK=1024, WBR=32,
                 **{k: v for k, v in fmt.items() if k != "FMT_MAX"}, FMT_MAX=448.0)
        out.append((f"channel_scales scales={scales} w={with_b} delayed={delayed}", tsc._channel_scales_kernel,
                    sig, c, triton.Config({}, num_warps=8 if scales else 4)))  # as smooth_scales launches it
    for smooth, unsmooth_w in ((0, False), (1, False), (2, False), (1, True)):
        sig = {"da_ptr": "*bf16", "g_ptr": "*u8", "u_ptr": "*u8", "lut_ptr": f32, "g_scale_ptr": f32,
               "u_scale_ptr": f32, "s_ptr": f32, "dg_ptr": "*bf16", "du_ptr": "*bf16", "db_ptr": "*bf16",
               "dw_ptr": "*bf16", "T": "i32", "F": "i32", "N": "i32"}
        out.append((f"swiglu_backward smooth={smooth}" + (" unsmooth_w" if unsmooth_w else ""),
                    tg._swiglu_backward_kernel, sig, dict(SMOOTH=smooth, BT=32, BF=64, UNSMOOTH_W=unsmooth_w), None))
    return out


def compile_case(kernel, sig: dict, consts: dict, cfg, arch: int = 90, attrs: dict | None = None):
    """One case of :func:`cases` compiled for sm_``arch`` (a triton CompiledKernel: ``.asm`` has the PTX
    and the cubin). ``attrs``: Triton's argument specialisations, e.g. ``{(0,): [["tt.divisibility", 16]]}``."""
    fn = _jit(kernel)
    full = dict(sig, **{k: "constexpr" for k in consts})
    opts = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages} if cfg is not None else {}
    if kernel in (ts._adam_kernel, tsplit._split_kernel) or fn.__name__.startswith("_grouped_glu"):
        opts["enable_fp_fusion"] = False
    return triton.compile(ASTSource(fn=fn, signature=full, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", arch, 32), options=opts)


def compile_all(arch: int = 90, only: str | None = None) -> list[dict]:
    rows = []
    for name, kernel, sig, consts, cfg in cases():
        if only and not any(part in name for part in only.split(",")):
            continue
        t = time.perf_counter()
        try:
            k = compile_case(kernel, sig, consts, cfg, arch)
            rows.append({"kernel": name, "ok": True, "s": round(time.perf_counter() - t, 2), "ptx_lines":
                         k.asm["ptx"].count("\n") if "ptx" in k.asm else None})
        except Exception as e:  # noqa: BLE001 - report every failing kernel, not only the first
            rows.append({"kernel": name, "ok": False, "error": f"{type(e).__name__}: {str(e)[:400]}"})
        r = rows[-1]
        print(("ok  " if r["ok"] else "FAIL") + f" {name}" + ("" if r["ok"] else f"\n     {r['error']}"), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: H100/H200)")
    ap.add_argument("--only", default=None, help="compile only kernels whose name contains one of these "
                                                 "comma-separated parts")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    rows = compile_all(a.arch, a.only)
    bad = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(bad)}/{len(rows)} kernel variants compiled for sm_{a.arch} (triton {triton.__version__})")
    if a.json:
        Path(a.json).write_text(json.dumps({"arch": a.arch, "triton": triton.__version__, "rows": rows}, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
