"""``python -m fp8pass train``: argument parsing and the multi-recipe demo driver."""

from __future__ import annotations

import argparse
import errno
import signal
import sys
from dataclasses import fields
from pathlib import Path

import torch

from ..checkpoint import CheckpointError, DiskFullError
from ..optim import MOMENT_FORMATS
from ..precision_file import read_rules_data, read_schedule_data
from .checkpoint import load_checkpoint
from .data import load_text_data
from .loop import TrainConfig, train
from .model import ModelConfig
from .plots import plot_runs
from .recipes import DEFAULT_MOMENTS, MOMENT_ROUNDINGS, PRECISIONS, RECIPES, describe_precision
from .run_lock import RunInUseError

DEFAULT_RECIPES = "bf16,fp8-smooth-fp8adam"
# the demo's last word on speed: a newcomer read the CPU's FP8 tokens/s as fp8pass's (issue 34)
CPU_FP8_NOTE = ("note: FP8 on a CPU is emulated (software casts, GEMMs in bf16/fp32): the fp8 recipes run slower "
                "than bf16 here, and their wall s includes compiling the FP8 graphs. The speed-up needs an FP8 GPU "
                "(H100/H200, B200, MI300); on a CPU the demo shows FP8's numerics: the loss gap.")
# Exit codes of `fp8pass train` (docs/train.md, Exit codes); an unexpected error exits 1 (Python's own),
# a run stopped by signal N exits 128 + N (130 for SIGINT, 143 for SIGTERM), as a shell reports it.
EXIT_USAGE = 2        # bad arguments, data, or --resume folder without checkpoint
EXIT_DIVERGED = 3     # the loss became NaN/Inf
EXIT_CHECKPOINT = 4   # a checkpoint failed verification/validation, or could not be written or verified
EXIT_DISK_FULL = 5    # a write failed for lack of space (the previous checkpoint is intact)
EXIT_IN_USE = 6       # another trainer holds --out's lock
# Flags that map 1:1 onto TrainConfig / ModelConfig fields (flag name = field name with dashes).
_MODEL_FIELDS = ("d_model", "n_layers", "n_heads", "ffn")
_TYPES = {"steps": int, "seed": int, "batch_size": int, "seq_len": int, "lr": float, "min_lr_ratio": float,
          "warmup": int, "weight_decay": float, "grad_clip": float, "eval_every": int,
          "eval_batches": int, "ckpt_every": int, "monitor_every": int, "max_data_bytes": int,
          "d_model": int, "n_layers": int, "n_heads": int, "ffn": int, "grad_accum": int, "loss_scale": str, "fp8_start_step": int,
          "drift_check": int, "drift_max_loss_diff": float, "drift_min_grad_cosine": float,
          "drift_max_local_error": float, "drift_act_at_once": float}
_CHOICES = {"schedule": ("cosine", "linear", "constant"), "scaling": ("delayed", "current"),
            "smooth": ("channel", "token"), "compiler": ("inductor", "aot_eager", "eager"), "precision": PRECISIONS,
            "on_drift": ("warn", "fallback")}


# What each of those flags does, for --help (argparse prints "(default X)" after it).
_HELP = {
    "steps": "optimizer steps per recipe",
    "seed": "seed of the model's initialisation and of the batch order",
    "batch_size": "sequences per micro-batch (per optimizer step without --grad-accum)",
    "seq_len": "sequence length in bytes (at most the model's max_seq_len)",
    "lr": "peak learning rate, reached after --warmup steps",
    "min_lr_ratio": "final learning rate as a fraction of --lr",
    "warmup": "steps of linear learning-rate warm-up",
    "weight_decay": "AdamW weight decay of the matrices (norm gains are not decayed)",
    "grad_clip": "clip the global gradient norm to this (0: no clipping)",
    "eval_every": "steps between validation evaluations",
    "eval_batches": "validation batches per evaluation (the same batches every time)",
    "ckpt_every": "steps between checkpoints (one is always written at the end)",
    "monitor_every": "steps between SwiGLU diagnostics in metrics.jsonl (0: off)",
    "max_data_bytes": "use at most this many bytes of each split (train, validation)",
    "d_model": "model width",
    "n_layers": "decoder blocks",
    "n_heads": "attention heads (must divide --d-model)",
    "ffn": "SwiGLU inner size",
    "grad_accum": "micro-batches per optimizer step (gradient accumulation)",
    "loss_scale": "loss scaling, for --precision fp16: 'dynamic' or a number",
    "fp8_start_step": "train the first N steps in high precision, then in FP8",
    "drift_check": "every N steps replay the step's micro-batch in high precision and compare it with the FP8 step "
                   "(drift records in metrics.jsonl; docs/precision.md, Drift check; 0: off; fp8 recipes only)",
    "on_drift": "what a confirmed drift does: warn (name the worst layers) or fallback (switch them: a GLU without "
                "Smooth-SwiGLU to the per-channel form, others to high precision)",
    "drift_max_loss_diff": "drift threshold on the relative loss difference FP8 vs high precision",
    "drift_min_grad_cosine": "drift threshold on each FP8 layer's gradient cosine FP8 vs high precision",
    "drift_max_local_error": "drift threshold on each FP8 layer's local error (what its FP8 input cast changes in "
                             "its output)",
    "drift_act_at_once": "act on a drift without waiting for the next step's confirmation when a layer's local "
                         "error exceeds this many times --drift-max-local-error (0: always confirm)",
    "schedule": "learning-rate decay after the warm-up",
    "scaling": "FP8 scaling of the fp8* recipes: from an amax history (delayed) or from each tensor (current)",
    "smooth": "Smooth-SwiGLU of the -smooth recipes: one scale per channel (the paper) or per token",
    "compiler": "what compiles the FP8 graphs: inductor (fast steps), aot_eager or eager (quick start, slow steps)",
    "precision": "dtype of the high-precision parts: auto picks bf16 where this CPU multiplies bf16 natively, "
                 "else fp32",
}


def _flag_help(name: str, default) -> str:
    text = _HELP.get(name, "")
    return f"{text} (default {default})" if default is not None else text


def _moment_block_size(text: str):
    """--moment-block-size: a positive int, or "tensor" (one scale per tensor, TrainConfig's None)."""
    if text == "tensor":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'tensor', got {text!r}") from None


# The FP8 optimizer's knobs (recipes ending in -fp8adam): flag name = TrainConfig field with dashes.
_OPTIM = {
    "m_format": dict(choices=MOMENT_FORMATS, help="first-moment storage"),
    "v_format": dict(choices=MOMENT_FORMATS, help="second-moment storage"),
    "v_sqrt": dict(action=argparse.BooleanOptionalAction, help="store sqrt(v) (--v-sqrt) or v itself "
                   "(--no-v-sqrt, the paper's form) when v is FP8"),
    "moment_block_size": dict(type=_moment_block_size, metavar="N|tensor",
                              help="elements per fp32 moment scale, or 'tensor' for one scale per tensor "
                                   "(the paper's granularity)"),
    "moment_rounding": dict(choices=MOMENT_ROUNDINGS, help="rounding of the FP8 moments"),
    "moment_stochastic_flush": dict(action=argparse.BooleanOptionalAction,
                                    help="round values below the smallest subnormal stochastically to 0 or it"),
}


def add_train_parser(sub) -> None:
    d = TrainConfig()
    p = sub.add_parser("train", help="train the tiny Llama with one or more recipes",
                       description="Train fp8pass's tiny Llama on byte-level text (default: this Python's "
                                   "standard library sources). With several recipes, each trains into "
                                   "OUT/<recipe> and the plots compare them.")
    p.add_argument("--recipe", default=None, help=f"comma-separated recipes from {', '.join(RECIPES)} "
                   f"(default {DEFAULT_RECIPES})")
    p.add_argument("--out", default=None, help="output folder (default runs/demo)")
    p.add_argument("--data", default=None, help="text file or folder (default: the Python stdlib's sources)")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="continue the run in DIR (a folder with checkpoint.pt) exactly; only --steps may change. "
                        "The checkpoint is verified against its SHA-256 manifest (exit code 4 on a mismatch); "
                        "one without manifest (older fp8pass) loads only with FP8PASS_ALLOW_UNVERIFIED_CHECKPOINT=1")
    for name, typ in _TYPES.items():
        default = getattr(d.model, name) if name in _MODEL_FIELDS else getattr(d, name)
        p.add_argument("--" + name.replace("_", "-"), type=typ, default=None, help=_flag_help(name, default))
    for name, choices in _CHOICES.items():
        p.add_argument("--" + name.replace("_", "-"), choices=choices, default=None,
                       help=_flag_help(name, getattr(d, name)))
    opt = p.add_argument_group("FP8 optimizer (recipes ending in -fp8adam, paper, reference; docs/optim.md)")
    for name, kw in _OPTIM.items():
        default = DEFAULT_MOMENTS[name]
        opt.add_argument("--" + name.replace("_", "-"), default=None,
                         **{**kw, "help": f"{kw['help']} (default: the recipe's; "
                                         f"{'tensor' if default is None else default} for the -fp8adam recipes)"})
    p.add_argument("--precision-config", default=None, metavar="FILE",
                   help="per-module precision rules, a .toml or .json file (fp8pass.load_rules; docs/precision.md): "
                        "the first rule whose glob matches a linear picks its recipe; its [[switch]] tables switch "
                        "precision at given steps (at_step / at_fraction); fp8 recipes only")
    p.add_argument("--eval-recipe", default=None, metavar="RECIPE",
                   help="also validate in this recipe, the same weights: 'high' or a named recipe without state "
                        "(blockwise, mxfp8, nvfp4); logs val_loss and val_loss_eval_recipe; fp8 recipes only")
    p.add_argument("--recompute-glu-output", action="store_true", default=None,
                   help="fp8 recipes: each GLU's output recomputed in backward from its FP8 gate/up instead of kept "
                        "(less memory; fp8pass.Config.recompute_glu_output, docs/runtime.md)")
    p.add_argument("--save-norm-input-fp8", action="store_true", default=None,
                   help="fp8 recipes: each RMSNorm that feeds FP8 linears keeps E4M3 codes of its normalized input "
                        "for backward instead of its fp32 input (less memory; fp8pass.Config.save_norm_input_fp8, "
                        "docs/runtime.md)")
    p.add_argument("--bf16-stochastic-round", action="store_true", default=None,
                   help="-fp8adam recipes: bf16 parameters and gradients, no fp32 master; the FP8 AdamW rounds "
                        "each updated weight stochastically (fp8pass.optim.AdamW(bf16_stochastic_round=True), "
                        "docs/optim.md)")
    p.add_argument("--drift-reset-moments", action="store_true", default=None,
                   help="with --on-drift fallback: the optimizer state of the layers it switches restarts "
                        "(fp8pass.DriftCheck.reset_moments, docs/precision.md)")
    p.add_argument("--fused-gate-up", action="store_true", help="one gate_up_proj linear in the MLP")
    p.add_argument("--compile-bf16", action="store_true", help="compile the bf16 recipe with Inductor too")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: on a shared CPU, 2+ threads spin-wait and ran "
                        "10-40x slower in our measurements; raise it on a machine of your own)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.set_defaults(func=run_train)


def _config_from_args(args, recipe: str, out: Path):
    kw = {f.name: getattr(args, f.name) for f in fields(TrainConfig)
          if getattr(args, f.name, None) is not None
          and f.name not in ("recipe", "out", "model", "compile_bf16", "progress")}
    if kw.get("moment_block_size") == "tensor":
        kw["moment_block_size"] = None
    if RECIPES[recipe].named and (args.scaling is not None or args.smooth is not None):
        raise ValueError(f"--scaling/--smooth do not apply to the named recipe {recipe!r}, which fixes them "
                         "(docs/train.md, Named recipes)")
    mk = {n: getattr(args, n) for n in _MODEL_FIELDS if getattr(args, n) is not None}
    model = ModelConfig(fused_gate_up=args.fused_gate_up, **mk)
    if args.data is not None:
        kw["data"] = args.data
    if args.precision_config is not None:  # kept as data in the run's config: a resume runs the same rules
        kw["precision_rules"] = read_rules_data(args.precision_config)
        kw["precision_schedule"] = read_schedule_data(args.precision_config)
    return TrainConfig(recipe=recipe, out=str(out), model=model, compile_bf16=args.compile_bf16,
                       progress=not args.no_progress, **kw)


def run_train(args) -> int:
    if args.threads < 1:
        print(f"error: --threads must be >= 1, got {args.threads}", file=sys.stderr)
        return EXIT_USAGE
    torch.set_num_threads(args.threads)
    if args.resume is not None:
        changed = [n for n in list(_TYPES) + list(_CHOICES) + list(_OPTIM)
                   + ["recipe", "out", "data", "precision_config", "eval_recipe"]
                   if n != "steps" and getattr(args, n) is not None]
        if changed:
            print(f"error: --resume continues the saved configuration; only --steps may change "
                  f"(got {', '.join('--' + c.replace('_', '-') for c in changed)})", file=sys.stderr)
            return EXIT_USAGE
        run_dir = Path(args.resume)
        try:
            cfg = TrainConfig.from_dict(load_checkpoint(run_dir)["config"])
        except CheckpointError as e:
            print(f"error: {e}", file=sys.stderr)
            return EXIT_CHECKPOINT
        except (FileNotFoundError, ValueError, TypeError) as e:
            print(f"error: {e}", file=sys.stderr)
            return EXIT_USAGE
        cfg.out, cfg.progress = str(run_dir), not args.no_progress
        if args.steps is not None:
            cfg.steps = args.steps
        jobs, root = [(cfg, True)], run_dir.parent
    else:
        recipes = [r.strip() for r in (args.recipe or DEFAULT_RECIPES).split(",") if r.strip()]
        bad = [r for r in recipes if r not in RECIPES]
        if bad or not recipes:
            print(f"error: unknown recipe {', '.join(bad) or '(none)'}; valid: {', '.join(RECIPES)}", file=sys.stderr)
            return EXIT_USAGE
        root = Path(args.out or "runs/demo")
        try:
            jobs = [(_config_from_args(args, r, root / r), False) for r in recipes]
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return EXIT_USAGE

    try:
        data = load_text_data(jobs[0][0].data, jobs[0][0].max_data_bytes)
        for cfg, _ in jobs:  # a text too short for the windows: one line now, not a traceback at step 1
            data.check_fits(cfg.seq_len)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(f"data: {data.source} ({data.n_files} files, train {data.train.numel() / 1e6:.2f} MB, "
          f"val {data.val.numel() / 1e6:.2f} MB, fingerprint {data.fingerprint})")
    results = []
    for cfg, resume in jobs:
        print(f"== {cfg.recipe}: {cfg.steps} steps of {cfg.batch_size}x{cfg.seq_len} bytes -> {cfg.out}; "
              f"{describe_precision(cfg.precision)}")
        try:
            results.append(train(cfg, resume=resume, data=data))
        except (CheckpointError, RunInUseError, OSError) as e:  # each with its exit code, one line, no traceback
            if isinstance(e, OSError) and e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            print(f"error: {e}", file=sys.stderr)
            return (EXIT_IN_USE if isinstance(e, RunInUseError) else EXIT_CHECKPOINT
                    if isinstance(e, CheckpointError) and not isinstance(e, DiskFullError) else EXIT_DISK_FULL)
        if results[-1].status == "interrupted":
            print(f"interrupted by {results[-1].signal} at step {results[-1].steps}; resume with --resume {cfg.out}",
                  file=sys.stderr)
            return 128 + signal.Signals[results[-1].signal].value
    # tokens/s: the median step's (steady state); wall s: the whole run, first-step compilation included
    print("\nrecipe                 status     steps  train loss  val loss  tokens/s  wall s")
    for r, (cfg, _) in zip(results, jobs):
        print(f"{cfg.recipe:22s} {r.status:9s} {r.steps:6d} {r.final_loss:11.4f} {r.final_val_loss:9.4f} "
              f"{r.step_tokens_per_s:9.0f} {r.wall_s:7.1f}")
    for r, (cfg, _) in zip(results, jobs):
        if cfg.eval_recipe is not None:
            print(f"{cfg.recipe}: val loss in eval recipe {cfg.eval_recipe!r} {r.final_val_loss_eval_recipe:.4f} "
                  f"(training recipe {r.final_val_loss:.4f})")
    if len(results) > 1:
        base = results[0].final_val_loss
        for r, (cfg, _) in list(zip(results, jobs))[1:]:
            print(f"val loss gap {cfg.recipe} vs {jobs[0][0].recipe}: {100 * (r.final_val_loss - base) / base:+.2f}%")
    if any(RECIPES[c.recipe].fp8 for c, _ in jobs):  # the trainer runs on the CPU
        print(CPU_FP8_NOTE)
    print(f"metrics: {', '.join(str(Path(c.out) / 'metrics.jsonl') for c, _ in jobs)}")
    if not args.no_plots:
        written = plot_runs(root)
        if written:
            print(f"plots: {', '.join(map(str, written))}")
    return 0 if all(r.status == "finished" for r in results) else EXIT_DIVERGED
