"""Launches and host syncs of one ``fp8_linear`` forward + backward with stochastic gradient rounding on the
CUDA code path (counted on CPU under Triton's interpreter, ``benchmarks/gpu_launches.py``'s counter): the
seed drawn from torch's generator (``sr_stream=None``) vs from a stochastic-rounding stream
(``fp8pass.runtime.sr``). Results: docs/results/sr_streams.md.

    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/sr_stream_launches.py
"""

import os
import sys

os.environ["FP8PASS_KERNELS"] = "triton"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import fp8pass  # noqa: E402
from benchmarks import gpu_launches  # noqa: E402
from fp8pass.runtime.op_schema import LinearKnobs  # noqa: E402
from fp8pass.runtime.state import LinearScalingState  # noqa: E402


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(96, 64, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(64, 96, dtype=torch.bfloat16)
    knobs = LinearKnobs("e4m3", "e5m2", "tensor", 128, False, "stochastic", 0.0, 1, "max", None, True)
    for recipe in ("current", "delayed"):
        state = LinearScalingState(fp8pass.DelayedScaling()) if recipe == "delayed" else None
        lists = state.op_args() if state is not None else ([], [], [])
        for source, stream in (("torch's generator", None), ("the weight's stream", torch.tensor([5, 0]))):
            def step():
                x.grad = w.grad = None
                out = torch.ops.fp8pass.fp8_linear(x, w, None, *lists, stream, *knobs.args())
                if state is not None:
                    state.record_forward(out[1], out[2])
                out[0].backward(dy)

            step()
            step()  # steady state: a delayed history that is no longer empty
            with gpu_launches.LaunchCounter() as counted:
                step()
            seed_launches = {name: n for name, n in [*counted.aten.items(), *counted.triton.items()]
                             if "rand" in name or "seed" in name}
            print(f"{recipe:8s} seed from {source:20s} launches {counted.total:3d}  host syncs {dict(counted.syncs)}  "
                  f"seed launches {seed_launches}")


if __name__ == "__main__":
    main()
