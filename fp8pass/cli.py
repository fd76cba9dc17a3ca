"""Command line: ``python -m fp8pass {selfcheck, train, ...}``.

Subcommands are added by the parts that own them (train, inspect, bench); ``selfcheck`` verifies the
numerics core on this machine in seconds.
"""

from __future__ import annotations

import argparse
import sys
import time

# what `python -m fp8pass --help` says (the module docstring above is for developers)
DESCRIPTION = """FP8 training of PyTorch models as a one-line change: torch.compile(model, backend="fp8").

Start with "python -m fp8pass selfcheck" (seconds), then "python -m fp8pass train" (the demo: a tiny
Llama trained in bf16 and in FP8, a few minutes on a CPU)."""
EPILOG = """"python -m fp8pass COMMAND --help" lists a command's options. On a CPU, FP8 is emulated: it
shows the numerics, not the speed, which needs an FP8 GPU. Documentation: README.md and docs/."""


def _selfcheck(args) -> int:
    import numpy as np
    import torch

    from . import E2M1, E4M3, E5M2, quantize
    from .kernels import family_name
    from .numerics import decode, saturating_cast

    torch.manual_seed(0)
    print(f"fp8pass selfcheck: torch {torch.__version__}, kernels={family_name('cpu')}")
    # Every finite fp16 bit pattern through each format, against the integer reference cast.
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    x = x[torch.isfinite(x)]
    failures = 0
    try:
        import ml_dtypes
    except ImportError:
        ml_dtypes = None
    for fmt, name in ((E4M3, "float8_e4m3fn"), (E5M2, "float8_e5m2"), (E2M1, "float4_e2m1fn")):
        got = decode(saturating_cast(x, fmt), fmt).numpy()
        if ml_dtypes is not None:
            ref = np.clip(x.numpy(), -fmt.max, fmt.max).astype(getattr(ml_dtypes, name)).astype(np.float32)
            bad = int((got != ref).sum())
            failures += bad
            print(f"  {fmt.name:5s} all {x.numel()} finite fp16 values vs ml_dtypes: {bad} mismatches")
        else:
            print(f"  {fmt.name:5s} cast ok (install ml_dtypes for the independent check)")
    big = torch.randn(4096, 4096)
    for gran in ("tensor", "row", "block"):
        t0 = time.perf_counter()
        q = quantize(big, E4M3, granularity=gran)
        dt = time.perf_counter() - t0
        err = ((q.dequantize() - big).norm() / big.norm()).item()
        print(f"  quantize e4m3 {gran:6s} 16M values: {dt * 1e3:7.1f} ms, relative error {err:.4f}")
        failures += not (err < 0.05)
    print("selfcheck", "passed" if failures == 0 else f"FAILED ({failures})")
    return 0 if failures == 0 else 1


def _inspect(args) -> int:
    import importlib

    import torch

    from . import explain
    from .report.draw import draw_graph

    mod_name, _, factory_name = args.target.partition(":")
    if not mod_name or not factory_name:
        return _fail(f"expected MODULE:FACTORY, e.g. mypkg.models:tiny_llama, got {args.target!r}")
    try:
        factory = getattr(importlib.import_module(mod_name), factory_name)
    except ImportError as e:
        return _fail(f"cannot import {mod_name!r}: {e}")
    except AttributeError:
        return _fail(f"module {mod_name!r} has no {factory_name!r}")
    try:
        built = factory()
    except Exception as e:  # the user's code: one line here; run it directly for the traceback
        return _fail(f"{args.target}() raised {type(e).__name__}: {e}")
    # a factory returns a model, or (model, example_inputs)
    if isinstance(built, tuple):
        model, inputs = built[0], tuple(built[1]) if isinstance(built[1], (tuple, list)) else (built[1],)
    else:
        model, inputs = built, None
    if not isinstance(model, torch.nn.Module):
        return _fail(f"{args.target}() returned {type(model).__name__}, not a torch.nn.Module or (module, inputs)")
    if inputs is None:
        inputs = example_inputs_for(model)
        if inputs is None:
            return _fail(f"{args.target}() returned a bare model whose inputs cannot be guessed (no embedding, "
                         f"no linear layer); return (model, example_inputs)")
    report = explain(model, *inputs)
    print(report)
    if args.draw:
        draw_graph(report, args.draw)
        print(f"drew the rewritten graph to {args.draw}")
    return 0


def _fail(message: str) -> int:
    print(f"inspect: {message}", file=sys.stderr)
    return 2


def example_inputs_for(model):
    """Made-up inputs for a bare model: tokens for a language model, else activations of its first linear.

    Tokens [1, 16] below ``config.vocab_size`` or the first embedding's size; otherwise float
    [2, 8, in_features] of the first ``nn.Linear``; None when neither exists.
    """
    import torch

    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    for m in model.modules():
        if vocab is None and isinstance(m, torch.nn.Embedding):
            vocab = m.num_embeddings
        if vocab is not None:
            return (torch.randint(0, vocab, (1, 16)),)
        if isinstance(m, torch.nn.Linear):
            param = m.weight
            return (torch.randn(2, 8, m.in_features, dtype=param.dtype, device=param.device),)
    return None


def _bench(args) -> int:
    from pathlib import Path

    suite = Path(__file__).resolve().parents[1] / "benchmarks" / "suite.py"
    if not suite.exists():
        print("fp8pass bench runs the scripts in benchmarks/ of a source checkout; install fp8pass with "
              "`pip install -e .` from the repository to use it", file=sys.stderr)
        return 2
    import subprocess

    # the checkout's root is where `benchmarks` imports as a package (python -m benchmarks.suite)
    return subprocess.run([sys.executable, "-m", "benchmarks.suite", *args.rest], cwd=suite.parents[1]).returncode


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # the suite parses its own options (and its own --help)
        return _bench(argparse.Namespace(rest=argv[1:]))
    parser = argparse.ArgumentParser(prog="fp8pass", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("selfcheck", help="check the numerics core on this machine")
    p.set_defaults(func=_selfcheck)
    p = sub.add_parser("inspect", help="print what the fp8 backend does to a model (MODULE:FACTORY)")
    p.add_argument("target", help="MODULE:FACTORY; FACTORY() returns (model, example_inputs) or a bare model "
                   "(inputs made up: tokens for a model with an embedding, else activations of its first linear)")
    p.add_argument("--draw", metavar="FILE.png|FILE.svg",
                   help="draw one box per layer pattern (repeated blocks folded), FP8 and GLU matches colored")
    p.set_defaults(func=_inspect)
    p = sub.add_parser("bench", help="run the benchmark suite (from a source checkout); --help lists options",
                       add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=_bench)
    from .train.cli import add_train_parser
    add_train_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
