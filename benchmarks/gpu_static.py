"""Static cost of every fp8pass Triton kernel on Hopper (sm_90), measured without a GPU.

    python -m benchmarks.gpu_static [--only PARTS] [--json docs/results/gpu_static.json]

Every variant of :func:`gpu_compile.cases` (each format, flag and autotuning config) is compiled for
sm_90 with the Triton of the running interpreter, specialised as the runtime specialises an ordinary
launch (every pointer 16-byte aligned, the size arguments ``n``, ``R``, ``C``, ``rows``, ``cols``,
``T``, ``F`` multiples of 16: Triton's ``tt.divisibility`` attribute, which is what lets it issue
vector loads and stores), and once more without that specialisation (variant suffix
``[unaligned]``: what a launch with an odd size or an offset view gets; held to the no-spill goal,
no instruction goal). Run it once per Triton version (e.g. ``/work/venv-triton36/bin/python`` for
triton 3.6.0, the device's); ``--json`` merges each version's rows into one file::

    {"versions": {"<triton version>": [{"kernel", "variant", "sass_per_elem", "registers",
                                        "spill_bytes", "bw_fraction"}, ...]}}

What is measured, per variant:

* ``sass_per_elem``: SASS instructions per element a thread handles. ``cuobjdump -sass`` of the cubin
  lists the machine code; every instruction is counted once (``NOP`` padding and the ``BRA`` to itself
  after the final ``EXIT`` excluded). A backward ``BRA`` (target below its own address) closes a loop:
  the instructions from its target to it are the loop body. Then

      sass_per_elem = (straight-line instructions) / (elements per thread per program)
                      + sum over loops of (loop body) / (elements per thread per iteration)

  where elements per thread = elements of the program (or of one loop iteration) / (32 * num_warps).
  Both sides of every branch and any slow-path subroutine (``div_rn``'s) count, so this is an upper
  bound on what a thread issues; masking costs count too (a partial tile of the tile kernel pads to
  powers of two, and the padding is charged to the real elements).
* ``registers``: per thread (``cuobjdump -res-usage``, REG); ``spill_bytes``: ptxas's spill stores plus
  spill loads for the kernel (its ``-v`` report, which Triton prints under ``TRITON_DUMP_PTXAS_LOG=1``).
* ``bw_fraction``: the fraction of the H200's copy bandwidth the kernel can reach if issue is its only
  other limit (a roofline: time = max(memory time, issue time)):

      memory time per element = bytes moved per element / 4.3 TB/s     (measured H200 copy bandwidth)
      issue time per element  = sass_per_elem / (132 SMs * 4 schedulers * 32 lanes * 1.98 GHz)
      bw_fraction             = min(1, memory time / issue time)

  (one warp instruction per scheduler per cycle at the 1.98 GHz boost clock: 3.35e13 thread
  instructions per second, so a kernel moving 3 bytes per element, bf16 in and an FP8 code out,
  reaches the roofline at <= 23.3 instructions per element). Bytes per element are each kernel's
  compulsory DRAM traffic: one read of its inputs, one write of its outputs (per-program partial
  maxima and scales are negligible and left out).

Goals (issue 28): RNE cast (E4M3/E5M2) <= 25 instructions per element, stochastic cast <= 45,
transpose-cast <= 40 (stochastic transpose-cast: 45 + 15 = 60, the stochastic budget plus the
transpose's allowance: our reading, the issue names no number), Adam <= 150, and no kernel spills.
Variants without a goal (E2M1, tiles, SwiGLU, amax) are reported, and held to the no-spill goal.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":
    raise SystemExit("gpu_static.py compiles kernels: run it with TRITON_INTERPRET unset")
os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"  # triton prints ptxas -v (registers, spills) to stdout
os.environ["TRITON_ALWAYS_COMPILE"] = "1"  # a cached build prints no ptxas log: its spills would read as 0
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton  # noqa: E402

from benchmarks import gpu_compile  # noqa: E402

# H200 SXM (docs/results/gpu.md, /work/.library/device/H200.md): measured copy bandwidth; issue rate.
COPY_BW = 4.3e12  # bytes / s
SMS, SCHEDULERS, LANES, CLOCK = 132, 4, 32, 1.98e9
ISSUE_RATE = SMS * SCHEDULERS * LANES * CLOCK  # thread instructions / s

UNALIGNED = " [unaligned]"  # the variant-name suffix of a build without the alignment specialisation
# multiples of 16 in the shapes models use (ld, out_ld: row strides, F or 2F)
_SIZE_ARGS = {"n", "R", "C", "rows", "cols", "T", "F", "ld", "out_ld", "D"}
_BYTES = {"*bf16": 2, "*fp16": 2, "*fp32": 4, "*u8": 1, "*i64": 8, "*i32": 4}
_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def _aligned_attrs(sig: dict) -> dict:
    """Triton's specialisation of a launch on aligned tensors and sizes that are multiples of 16."""
    return {(i,): [["tt.divisibility", 16]] for i, (name, ty) in enumerate(sig.items())
            if ty.startswith("*") or name in _SIZE_ARGS}


def parse_sass(sass: str) -> tuple[list[tuple[int, str]], list[tuple[int, int]]]:
    """(instructions as (address, opcode text), outermost loops as (first, last) address) of a SASS listing."""
    instrs = []
    for line in sass.splitlines():
        m = _INSTR.match(line)
        if m:
            instrs.append((int(m.group(1), 16), m.group(2)))
    body = []
    for i, (addr, text) in enumerate(instrs):
        op = text.split()[1] if text.startswith("@") else text.split()[0]
        if op == "NOP":
            continue
        tgt = re.search(r"\bBRA(?:\.\S+)?\s+(?:`\()?(0x[0-9a-f]+)", text)
        if tgt and int(tgt.group(1), 16) == addr:
            continue  # the trap loop after EXIT
        body.append((addr, text))
    loops = []
    for addr, text in body:
        tgt = re.search(r"\bBRA(?:\.\S+)?\s+(?:`\()?(0x[0-9a-f]+)", text)
        if tgt and int(tgt.group(1), 16) < addr:
            loops.append((int(tgt.group(1), 16), addr))
    outer = [lp for lp in loops if not any(o != lp and o[0] <= lp[0] and lp[1] <= o[1] for o in loops)]
    return body, sorted(set(outer))


def _elements(name: str, consts: dict) -> tuple[int, int] | None:
    """(elements per program, elements per loop iteration) of a kernel variant; None for kernels that
    are not elementwise (skipped)."""
    c = consts
    if name == "_cast_tensor_kernel":
        e = c["BLOCK"] * (2 if c["PACKED"] else 1)
    elif name == "_amax_kernel":
        e = c["BLOCK"]
    elif name == "_quantize_tiles_kernel":
        if c.get("CR"):  # one tile a program, CR rows a loop step
            return c["TR"] * c["TC"], c["CR"] * c["TCP"]
        e = c["GR"] * c["GC"] * c["TR"] * c["TC"]
    elif name == "_transpose_cast_kernel":
        e = c["BR"] * c["BC"]
    elif name in ("_swiglu_cast_kernel", "_swiglu_colamax_kernel"):
        e = c["BT"] * c["BF"]
    elif name == "_adam_kernel":
        return c["NB"] * c["BLOCK"], c["NB"] * min(c["BLOCK"], c["SPAN"])
    elif name == "_split_kernel":
        e = c.get("NB", 1) * c["SPAN"]  # the split kernel: one span per program
    elif name == "_swiglu_backward_kernel":
        e = c["BT"] * c["BF"]
    elif name in ("_grouped_amax_scale_kernel", "_grouped_cast_kernel"):
        e = c["BR"] * c["BC"]  # the amax kernel: per column block of its loop
    elif name == "_aligned_transpose_kernel":
        # a program loops over its code columns: all 4096 of a 4096-wide operand (the benchmarks' MoE)
        # once the destination blocks alone fill the GPU (_TRANSPOSE_PROGRAMS), its group lookup once
        return c["BT"] * 4096, c["BT"] * c["BC"]
    elif name == "_rmsnorm_cast_kernel":
        e = c["ROWS"] * c["CHUNK"]
    elif name in ("_rmsnorm_forward_kernel", "_rmsnorm_backward_kernel"):
        # a tile per loop step; a program takes every num_programs-th block of rows, so its set-up (and the
        # forward's last-program epilogue, charged to every program) spreads over its blocks: at 16384
        # tokens, the benchmarks' MLP shape
        e = c["ROWS"] * c["CHUNK"]
        return e * _norm_blocks_per_program(name, c["ROWS"]), e
    elif name in ("_grouped_glu_kernel", "_grouped_glu_backward_kernel"):
        e = c["BR"] * c["BC"]  # AMAX: each iteration of its loop over the tile's experts takes the whole tile
    else:
        return None  # a one-program scalar kernel (scales, records): no per-element cost
    return e, e


def _norm_blocks_per_program(name: str, rows_per_block: int, tokens: int = 16384) -> int:
    from fp8pass.kernels import triton_norm

    blocks = -(-tokens // rows_per_block)
    cap = triton_norm._FORWARD_PROGRAMS if name == "_rmsnorm_forward_kernel" else triton_norm._BACKWARD_PROGRAMS
    return -(-blocks // min(blocks, cap))


def bytes_per_element(name: str, sig: dict, consts: dict) -> float:
    """Compulsory DRAM bytes per element: one read of the inputs, one write of the outputs."""
    c = consts
    size = {k: _BYTES.get(v, 0) for k, v in sig.items()}
    code = 0.5 if c.get("PACKED") else 1.0
    if name == "_cast_tensor_kernel":
        return size["x_ptr"] + code
    if name == "_amax_kernel":
        return size["x_ptr"]
    if name == "_quantize_tiles_kernel":
        return size["x_ptr"] + (0 if c["MODE"] == 2 else code)
    if name == "_transpose_cast_kernel":
        return size["x_ptr"] + code * ((1 if c.get("ROW_MAJOR", True) else 0) + (1 if c["TRANSPOSE"] else 0))
    if name == "_swiglu_cast_kernel":  # INPUTS: the codes of gate and up written too; TRANSPOSE: A^T too
        writes = 1 + (2 if c.get("INPUTS") else 0) + (1 if c.get("TRANSPOSE") else 0)
        return size["g_ptr"] + size["u_ptr"] + (code * writes if c["STORE"] else 0)
    if name == "_swiglu_colamax_kernel":
        return size["g_ptr"] + size["u_ptr"]
    if name == "_swiglu_backward_kernel":  # dA, FP8 gate and up in; dgate, dup out
        return size["da_ptr"] + size["g_ptr"] + size["u_ptr"] + size["dg_ptr"] + size["du_ptr"]
    if name == "_grouped_amax_scale_kernel":
        return size["x_ptr"]
    if name == "_grouped_cast_kernel":  # TRANSPOSE: the transposed codes written too
        return size["x_ptr"] + code * (2 if c.get("TRANSPOSE") else 1)
    if name == "_aligned_transpose_kernel":  # codes in, codes out
        return 2.0
    if name == "_grouped_glu_kernel":  # gate and up in; A (fp32) out, or only the [E, F] maxima
        return size["g_ptr"] + size["u_ptr"] + (0 if c["AMAX"] else size["a_ptr"])
    if name == "_grouped_glu_backward_kernel":  # dA, gate, up in; dgate, dup out
        return sum(size[k] for k in ("da_ptr", "g_ptr", "u_ptr", "dg_ptr", "du_ptr"))
    if name == "_rmsnorm_forward_kernel":  # x in, y out
        return size["x_ptr"] + size["y_ptr"]
    if name == "_rmsnorm_cast_kernel":  # x in (its second read), codes out
        return size["x_ptr"] + code
    if name == "_rmsnorm_backward_kernel":  # dy and codes in, dx out
        return size["dy_ptr"] + code + size["dx_ptr"]
    if name in ("_adam_kernel", "_split_kernel"):
        state = size["p_ptr"] + size["m_ptr"] + size["v_ptr"]  # p, m, v read (and written back)
        writes = c.get("WRITE", True)
        return state * (2 if writes else 1) + size["g_ptr"]
    raise KeyError(f"gpu_static.py: no byte count for {name}: add it to bytes_per_element")


def goal(name: str, variant: str, consts: dict) -> float | None:
    """The issue's instructions-per-element goal of a variant (None: reported, no goal)."""
    sr = bool(consts.get("STOCHASTIC", False)) or "sr=True" in variant
    if name == "_cast_tensor_kernel":
        return None if consts["PACKED"] else (45 if sr else 25)
    if name == "_transpose_cast_kernel":
        # DELAYED: the scale epilogue that the last program alone runs is counted here as if every thread
        # ran it for its elements (a static count cannot tell): reported, held to no goal
        return None if consts.get("DELAYED") else (60 if sr else 40)
    if name in ("_adam_kernel", "_split_kernel"):
        return 150
    if name == "_grouped_cast_kernel":
        return 25  # an RNE cast, its expert lookup and row decode scales included
    return None


def _tool(name: str, *args: str) -> str:
    return subprocess.run([str(_BIN / name), *args], check=True, capture_output=True, text=True).stdout


def measure(name: str, kernel, sig: dict, consts: dict, cfg, arch: int = 90, aligned: bool = True) -> dict | None:
    """Compile one variant and read its static cost (see the module doc); None for a kernel that is not
    elementwise."""
    if _elements(gpu_compile._jit(kernel).__name__, consts) is None:
        return None
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        k = gpu_compile.compile_case(kernel, sig, consts, cfg, arch, attrs=_aligned_attrs(sig) if aligned else None)
    fn_name = gpu_compile._jit(kernel).__name__
    with tempfile.TemporaryDirectory() as d:
        cubin = Path(d) / "k.cubin"
        cubin.write_bytes(k.asm["cubin"])
        sass = _tool("cuobjdump", "-sass", str(cubin))
        res = _tool("cuobjdump", "-res-usage", str(cubin))
    spills = sum(int(b) for b in re.findall(r"(\d+) bytes spill (?:stores|loads)", log.getvalue()))
    regs = int(re.search(r"REG:(\d+)", res).group(1))
    body, loops = parse_sass(sass)
    in_loop = [sum(1 for a, _ in body if lo <= a <= hi) for lo, hi in loops]
    threads = 32 * (cfg.num_warps if cfg is not None else 4)
    per_prog, per_iter = _elements(fn_name, consts)
    per_elem = (len(body) - sum(in_loop)) / (per_prog / threads) + sum(n / (per_iter / threads) for n in in_loop)
    t_mem = bytes_per_element(fn_name, sig, consts) / COPY_BW
    t_issue = per_elem / ISSUE_RATE
    variant = name + (f" num_warps={cfg.num_warps}" if cfg is not None else "") + ("" if aligned else UNALIGNED)
    return {"kernel": fn_name, "variant": variant, "sass_per_elem": round(per_elem, 2), "registers": regs,
            "spill_bytes": spills, "bw_fraction": round(min(1.0, t_mem / t_issue), 3),
            "_goal": goal(fn_name, name, consts) if aligned else None, "_ptx": k.asm["ptx"]}


def _verdict(r: dict) -> str:
    ok_spill = r["spill_bytes"] == 0
    if r["_goal"] is None:
        return "ok" if ok_spill else "MISSED (spills)"
    ok = r["sass_per_elem"] <= r["_goal"]
    return "met" if ok and ok_spill else "MISSED" + ("" if ok else f" (> {r['_goal']})") + (
        "" if ok_spill else " (spills)")


def markdown(data: dict, only: str | None = None) -> str:
    """A markdown table of a gpu_static.json: one row per variant with its autotuning configs folded
    (ranges over the configs), one column group per Triton version; ``only``: comma-separated parts of
    the variant names to keep."""
    versions = sorted(data["versions"], key=lambda v: tuple(int(p) for p in re.findall(r"\d+", v)), reverse=True)
    groups: dict[str, dict[str, list[dict]]] = {}
    for version in versions:
        for r in data["versions"][version]:
            name = re.sub(r" num_warps=\d+", "", re.sub(r"\s*\{[^}]*\}", "", r["variant"]))
            if not only or any(part in name for part in only.split(",")):
                groups.setdefault(name, {}).setdefault(version, []).append(r)

    def span(rs, key, fmt):
        if not rs:
            return "-"
        lo, hi = min(r[key] for r in rs), max(r[key] for r in rs)
        return format(lo, fmt) if lo == hi else f"{format(lo, fmt)}-{format(hi, fmt)}"
    cols = [("SASS/elem", "sass_per_elem", ".1f"), ("registers", "registers", "d"), ("spill B", "spill_bytes", "d"),
            ("bw fraction", "bw_fraction", ".2f")]
    head = " | ".join(f"{c} {v}" for c, _, _ in cols for v in versions)
    out = [f"| variant | configs | {head} |", "|---|---:|" + "---:|" * (len(cols) * len(versions))]
    for name, by in groups.items():
        cells = " | ".join(span(by.get(v, []), key, fmt) for _, key, fmt in cols for v in versions)
        out.append(f"| {name} | {max(len(rs) for rs in by.values())} | {cells} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--only", default=None, help="variants whose name contains one of these comma-separated parts")
    ap.add_argument("--json", default=None, help="merge this Triton version's rows into this file")
    ap.add_argument("--aligned-only", action="store_true", help="skip the builds without alignment specialisation")
    ap.add_argument("--markdown", default=None, metavar="JSON",
                    help="print a gpu_static.json as a markdown table (--only filters it), compile nothing")
    a = ap.parse_args(argv)
    if a.markdown:
        print(markdown(json.loads(Path(a.markdown).read_text()), a.only))
        return 0
    rows = []
    print(f"triton {triton.__version__}, sm_{a.arch}; H200: {SMS} SMs x {SCHEDULERS} schedulers x {LANES} lanes "
          f"at {CLOCK / 1e9:.2f} GHz = {ISSUE_RATE:.3g} instr/s, copy {COPY_BW / 1e12:.1f} TB/s")
    print(f"{'kernel':24} {'sass/el':>8} {'regs':>5} {'spill':>6} {'bw':>6}  {'goal':12} variant")
    for name, kernel, sig, consts, cfg in gpu_compile.cases():
        if a.only and not any(part in name for part in a.only.split(",")):
            continue
        for aligned in (True,) if a.aligned_only else (True, False):
            r = measure(name, kernel, sig, consts, cfg, a.arch, aligned)
            if r is None:
                print(f"{'':24} skipped: {name} is not elementwise (no per-element cost)")
                break
            rows.append(r)
            print(f"{r['kernel']:24} {r['sass_per_elem']:8.2f} {r['registers']:5d} {r['spill_bytes']:6d} "
                  f"{r['bw_fraction']:6.3f}  {_verdict(r):12} {r['variant']}", flush=True)
    missed = [r for r in rows if _verdict(r).startswith("MISSED")]
    print(f"{len(rows) - len(missed)}/{len(rows)} variants meet their goals (triton {triton.__version__})")
    if a.json:
        path = Path(a.json)
        data = json.loads(path.read_text()) if path.exists() else {"versions": {}}
        # with --only, the rows of the other variants stay as they were
        kept = [r for r in data.setdefault("versions", {}).get(triton.__version__, [])
                if a.only and not any(part in r["variant"] for part in a.only.split(","))]
        data["versions"][triton.__version__] = kept + [
            {k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
        path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
