"""Launches and host syncs of one ``fp8_linear`` (per tensor, row, block, MX), one ``nvfp4_linear`` and one MoE
``fp8_grouped_linear`` / ``fp8_grouped_swiglu_down`` forward + backward with stochastic gradient rounding on the
CUDA code path (counted on CPU under Triton's interpreter, ``benchmarks/gpu_launches.py``'s counter): the
seed drawn from torch's generator (``sr_stream=None``) vs from a stochastic-rounding stream
(``fp8pass.runtime.sr``). Results: docs/results/sr_streams.md.

    TRITON_INTERPRET=1 PYTHONPATH=$PWD python -m tools.sr_stream_launches
"""

import os

os.environ["FP8PASS_KERNELS"] = "triton"
import torch  # noqa: E402

import fp8pass  # noqa: E402
from benchmarks import gpu_launches  # noqa: E402
from fp8pass.op_schema import GroupedGLUKnobs, GroupedLinearKnobs, LinearKnobs  # noqa: E402
from fp8pass.runtime.state import LinearScalingState  # noqa: E402


def report(name: str, source: str, step) -> None:
    """Print the launches and host syncs of ``step`` (run twice first: a steady state)."""
    step()
    step()  # steady state: a delayed history that is no longer empty
    with gpu_launches.LaunchCounter() as counted:
        step()
    seed_launches = {op: n for op, n in [*counted.aten.items(), *counted.triton.items()]
                     if "rand" in op or "seed" in op}
    print(f"{name:8s} seed from {source:20s} launches {counted.total:3d}  host syncs {dict(counted.syncs)}  "
          f"seed launches {seed_launches}")


SOURCES = (("torch's generator", lambda: None), ("the weight's stream", lambda: torch.tensor([5, 0])))


def grouped_cases() -> None:
    """The MoE ops (4 experts, 64 rows, current scaling): one stream per expert stack."""
    torch.manual_seed(0)
    offs = torch.tensor([16, 29, 48, 64], dtype=torch.int32)
    x = torch.randn(64, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4, 96, 64, dtype=torch.bfloat16, requires_grad=True)
    gate_up = torch.randn(64, 64, dtype=torch.bfloat16, requires_grad=True)
    wd = torch.randn(4, 64, 32, dtype=torch.bfloat16, requires_grad=True)
    lin = GroupedLinearKnobs("e4m3", "e5m2", False, "stochastic", 0.0, 1, "max", None, True)
    glu = GroupedGLUKnobs(*lin.args(), "silu", "channel")
    for source, make in SOURCES:
        stream = make()

        def lin_step():
            x.grad = w.grad = None
            torch.ops.fp8pass.fp8_grouped_linear(x, w, offs, False, [], [], [], stream, *lin.args())[0].backward(
                torch.ones(64, 96, dtype=torch.bfloat16))

        def glu_step():
            gate_up.grad = wd.grad = None
            torch.ops.fp8pass.fp8_grouped_swiglu_down(gate_up, None, wd, offs, False, [], [], [], stream,
                                                      *glu.args())[0].backward(torch.ones(64, 64, dtype=torch.bfloat16))

        report("grouped", source, lin_step)
        report("g-glu", source, glu_step)


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(96, 64, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(64, 96, dtype=torch.bfloat16)
    for recipe in ("current", "delayed", "row", "block", "mx"):
        gran = recipe if recipe in ("row", "block", "mx") else "tensor"
        knobs = LinearKnobs("e4m3", "e5m2", gran, 32, False, "stochastic", 0.0, 1, "max", None, True)
        state = LinearScalingState(fp8pass.DelayedScaling()) if recipe == "delayed" else None
        lists = state.op_args() if state is not None else ([], [], [])
        for source, make in SOURCES:
            stream = make()

            def step():
                x.grad = w.grad = None
                out = torch.ops.fp8pass.fp8_linear(x, w, None, *lists, stream, *knobs.args())
                if state is not None:
                    state.record_forward(out[1], out[2])
                out[0].backward(dy)

            report(recipe, source, step)
    for source, make in SOURCES:  # NVFP4 (RHT, 2-D weight blocks): dgrad's and wgrad's dy casts
        stream = make()

        def nvfp4_step():
            x.grad = w.grad = None
            torch.ops.fp8pass.nvfp4_linear(x, w, None, [], stream, True, True, 0, True, True, "split",
                                           False)[0].backward(dy)

        report("nvfp4", source, nvfp4_step)
    grouped_cases()

if __name__ == "__main__":
    main()
