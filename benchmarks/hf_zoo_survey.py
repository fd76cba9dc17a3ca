"""Survey of the Hugging Face decoder zoo (fp8pass/testing/hf_zoo.py) under the fp8 backend.

For each model, in a fresh subprocess (Dynamo state isolated, with a timeout): eager fp32
forward+backward, then ``torch.compile(model, backend=fp8pass.backend(cfg))`` (fullgraph=False,
compiler="aot_eager") with the FP8 config and with the identity-format config, each forward+backward
on the same ids. Recorded: crash (one line), graphs and graph breaks, loss rel. error vs eager (fp8 and
identity), min per-parameter gradient cosine vs eager, params with an eager gradient but no compiled
one, the explain counts (GLUs / FP8 linears / kept) next to the module counts, and the matmul-like
ops Dynamo's graphs hold (read from the graphs before the rewrite).

    python -m benchmarks.hf_zoo_survey [--names A,B] [--out docs/results/hf_zoo.md] [-j 2]
    python -m benchmarks.hf_zoo_survey --forms --names Mixtral --experts-impl eager   # FX forms of the matmuls
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Another checkout's fp8pass (a clean `git archive HEAD` while this tree is mid-edit): run the survey from there.


def _matmul_kind(node) -> str | None:
    import operator

    import torch
    import torch.nn.functional as F
    targets = {F.linear: "linear", torch.mm: "mm", torch.addmm: "addmm", torch.bmm: "bmm",
               torch.matmul: "matmul", operator.matmul: "matmul", torch.einsum: "einsum",
               torch.baddbmm: "baddbmm"}
    if hasattr(torch, "_grouped_mm"):
        targets[torch._grouped_mm] = "_grouped_mm"
    if hasattr(F, "grouped_mm"):
        targets[F.grouped_mm] = "grouped_mm"
    if node.op == "call_function":
        if node.target in targets:
            return targets[node.target]
        name = str(node.target)
        if "grouped_mm" in name:  # torch.ops.transformers.grouped_mm_fallback
            return name.replace("transformers.", "")
        return None
    if node.op == "call_method" and node.target in ("matmul", "mm", "bmm", "addmm", "baddbmm", "__matmul__"):
        return node.target
    return None


def _fmt_arg(a) -> str:
    import torch.fx as fx
    if isinstance(a, fx.Node):
        v = a.meta.get("example_value")
        shape = tuple(v.shape) if hasattr(v, "shape") else ""
        return f"{a.name}{list(shape) if shape != '' else ''}"
    if isinstance(a, (list, tuple)):
        return "(" + ", ".join(_fmt_arg(x) for x in a) + ")"
    return repr(a)


def _fmt_node(n) -> str:
    tgt = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
    if n.op == "call_method":
        tgt = "." + tgt
    args = ", ".join([_fmt_arg(a) for a in n.args] + [f"{k}={_fmt_arg(v)}" for k, v in n.kwargs.items()])
    return f"{n.name} = {tgt}({args})"


def one(name: str, experts_impl: str | None, forms: bool, dtype: str = "float32") -> dict:
    """Runs in the child: the survey of one model."""
    import warnings
    warnings.filterwarnings("ignore")
    import torch
    torch.set_num_threads(int(os.environ.get("SURVEY_THREADS", "1")))
    import fp8pass
    from fp8pass.testing import hf_zoo as Z

    os.environ.setdefault("FP8PASS_CPU_FUSED", "0")
    row: dict = {"name": name, "moe": Z.is_moe(name)}
    model = Z.build(name, experts_impl=experts_impl, dtype=getattr(torch, dtype))
    row["experts_impl"] = Z.experts_implementation(model)
    row["expected"] = {k: v for k, v in vars(Z.expected_counts(model)).items() if not k.endswith("_names")}
    ids = Z.ids()
    loss0 = Z.loss_fn(model, ids)
    loss0.backward()
    g0 = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    row["loss_eager"] = loss0.item()

    variants = {"fp8": fp8pass.Config(compiler="aot_eager", grad_stochastic_rounding=False),
                "identity": fp8pass.Config(fwd_format="identity", bwd_format="identity", compiler="aot_eager")}
    if forms:
        variants = {"fp8": variants["fp8"]}
    for tag, cfg in variants.items():
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        be = fp8pass.backend(cfg)
        graphs = []

        def recording(gm, example_inputs, **kw):
            graphs.append(gm)
            return be(gm, example_inputs, **kw)

        res: dict = {}
        try:
            cm = torch.compile(model, backend=recording, fullgraph=False)
            loss = Z.loss_fn(cm, ids)
            loss.backward()
            res["loss_rel"] = abs(loss.item() - loss0.item()) / abs(loss0.item())
            cos, missing = 1.0, []
            for n, p in model.named_parameters():
                if n not in g0:
                    continue
                if p.grad is None:
                    missing.append(n)
                    continue
                a, b = g0[n].flatten().double(), p.grad.flatten().double()
                if a.norm() > 0 and b.norm() > 0:
                    cos = min(cos, torch.nn.functional.cosine_similarity(a, b, dim=0).item())
                elif a.norm() > 0:
                    cos = min(cos, 0.0)
            res["min_cos"] = cos
            res["missing_grads"] = missing
        except Exception as e:  # noqa: BLE001  the survey records crashes
            msg = [l.strip() for l in str(e).strip().splitlines() if l.strip()]
            first = " ".join(msg[:2]) if msg and msg[0].endswith("raised:") else (msg[0] if msg else "")
            res["crash"] = f"{type(e).__name__}: {first[:200]}".replace("|", "/")
        model.zero_grad(set_to_none=True)
        res["graphs"] = len(graphs)
        res["breaks"] = sum(torch._dynamo.utils.counters["graph_break"].values())
        res["break_reasons"] = sorted({str(k).splitlines()[0][:120] for k in torch._dynamo.utils.counters["graph_break"]})[:5]
        rep = be.report()
        res["explain"] = {"swiglus": len(rep.swiglus), "linears": len(rep.linears), "skipped": len(rep.skipped)}
        mm = Counter()
        form_lines = []
        for gi, gm in enumerate(graphs):
            for node in gm.graph.nodes:
                k = _matmul_kind(node)
                if k:
                    mm[k] += 1
                    if forms:
                        form_lines.append(f"g{gi}: {_fmt_node(node)}")
        res["matmuls"] = dict(mm)
        if forms:
            res["forms"] = form_lines
            res["graph_code"] = [gm.code for gm in graphs]
        row[tag] = res
    return row


def _child(name, experts_impl, forms, timeout, dtype="float32"):
    cmd = [sys.executable, "-m", "benchmarks.hf_zoo_survey", "--child", name, "--dtype", dtype]
    if experts_impl:
        cmd += ["--experts-impl", experts_impl]
    if forms:
        cmd += ["--forms"]
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"name": name, "error": f"timeout after {timeout}s", "wall": time.time() - t0}
    for line in p.stdout.splitlines():
        if line.startswith("@@ROW@@"):
            row = json.loads(line[7:])
            row["wall"] = time.time() - t0
            return row
    err = [l for l in p.stderr.strip().splitlines() if l.strip()]
    return {"name": name, "error": (err[-1][:200] if err else f"rc={p.returncode}"), "wall": time.time() - t0}


def _mm_str(d: dict) -> str:
    return " ".join(f"{k}:{v}" for k, v in sorted(d.items())) or "-"


def _row_md(r: dict) -> str:
    if "error" in r:
        return f"| {r['name']} | {'MoE' if r.get('moe') else ''} | CHILD FAILED: {r['error']} |" + " |" * 9
    e = r["expected"]
    exp = f"glu {e['glus']}{'(f%d)' % e['fused_glus'] if e['fused_glus'] else ''}, exp {e['expert_stacks']}, lin {e['linears']}{'(c%d)' % e['conv1d'] if e['conv1d'] else ''}, head {e['lm_head']}{'t' if e['tied'] else ''}"
    f, i = r["fp8"], r["identity"]

    def num(x, k, fmt):
        return "crash" if "crash" in x else fmt.format(x[k])
    crash = "; ".join(f"{t}: {x['crash']}" for t, x in (("fp8", f), ("id", i)) if "crash" in x) or ""
    ex = f["explain"]
    miss = len(f.get("missing_grads", []))
    impl = r.get("experts_impl") or ""
    return (f"| {r['name']} | {'MoE ' + impl if r['moe'] else ''} | {f['graphs']}/{f['breaks']} | "
            f"{num(f, 'loss_rel', '{:.2e}')} | {num(i, 'loss_rel', '{:.2e}')} | {num(f, 'min_cos', '{:.3f}')} | "
            f"{num(i, 'min_cos', '{:.4f}')} | {miss if 'crash' not in f else '-'} | "
            f"{ex['swiglus']}/{ex['linears']}/{ex['skipped']} | {exp} | {_mm_str(f['matmuls'])} | {crash} |")


HEADER = ("| model | MoE (experts impl) | graphs/breaks | loss rel fp8 | loss rel id | min cos fp8 | min cos id | "
          "no grad (fp8) | explain glu/fp8 lin/kept | expected (modules) | Dynamo matmul ops | crash |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--names", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--experts-impl", default=None, help="eager / grouped_mm / batched_mm (MoE); default: transformers'")
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--dtype", default="float32", help="model dtype (bfloat16: transformers picks F.grouped_mm under Dynamo)")
    ap.add_argument("-j", "--jobs", type=int, default=1)
    ap.add_argument("--forms", action="store_true", help="print the matmul nodes of the Dynamo graphs (fp8 run only)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child:
        row = one(args.child, args.experts_impl, args.forms, args.dtype)
        print("@@ROW@@" + json.dumps(row), flush=True)
        return

    from fp8pass.testing import hf_zoo as Z
    names = args.names.split(",") if args.names else Z.zoo()
    t0 = time.time()
    from concurrent.futures import ThreadPoolExecutor
    rows = {}
    if not args.forms:
        print(HEADER, flush=True)
    with ThreadPoolExecutor(args.jobs) as ex:
        futs = {n: ex.submit(_child, n, args.experts_impl, args.forms, args.timeout, args.dtype) for n in names}
        for n in names:
            r = rows[n] = futs[n].result()
            if args.forms:
                print(f"== {n} (experts impl {r.get('experts_impl')}) ==")
                if "error" in r:
                    print("  CHILD FAILED:", r["error"])
                    continue
                if "crash" in r["fp8"]:
                    print("  crash:", r["fp8"]["crash"])
                print(f"  graphs {r['fp8']['graphs']}, breaks {r['fp8']['breaks']}: {r['fp8']['break_reasons']}")
                for line in r["fp8"]["forms"]:
                    print("  " + line)
            else:
                print(_row_md(r), flush=True)
    wall = time.time() - t0
    if args.out and not args.forms:
        import torch
        import transformers
        cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")),
                   platform.processor())
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=ROOT).stdout.strip()
            dirty = subprocess.run(["git", "status", "--porcelain", "--", "fp8pass"], capture_output=True,
                                   text=True, cwd=ROOT).stdout.strip()
        except OSError:
            commit, dirty = "?", ""
        cmd = "python -m benchmarks.hf_zoo_survey " + " ".join(sys.argv[1:])
        body = [f"## {time.strftime('%Y-%m-%d %H:%M')}: commit {commit}{' (fp8pass/ with uncommitted changes)' if dirty else ''}",
                "", f"- command: `{cmd}`",
                f"- machine: {cpu}, {os.cpu_count()} cores (shared), torch {torch.__version__} "
                f"(`get_cpu_capability()` = {torch.backends.cpu.get_cpu_capability()}), transformers {transformers.__version__}",
                f"- wall time: {wall:.0f} s for {len(names)} models ({args.jobs} at a time, 1 thread each)",
                "- columns: graphs/breaks = Dynamo graphs / graph breaks of the fp8 run; loss rel = |loss - eager| / eager;"
                " min cos = min over parameters of the gradient cosine vs eager fp32; no grad = parameters with an eager"
                " gradient and none compiled; explain = be.report(): GLUs fused / FP8 linear weights / ops kept high"
                " precision; expected = module counts (fp8pass/testing/hf_zoo.py expected_counts: glu (f=fused gate_up),"
                " exp = expert stacks, lin = other linears (c = Conv1D), head (t = tied)); matmul ops counted in Dynamo's"
                " graphs before the rewrite.", "", HEADER] + [_row_md(rows[n]) for n in names] + [""]
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        prev = open(args.out).read() if os.path.exists(args.out) else "# HF decoder zoo under the fp8 backend\n\n"
        with open(args.out, "w") as f:
            f.write(prev.rstrip("\n") + "\n\n" + "\n".join(body))
        json_path = os.path.splitext(args.out)[0] + ".json"
        with open(json_path, "w") as f:
            json.dump({"wall_s": wall, "rows": rows}, f, indent=1)
    print(f"wall {wall:.0f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
