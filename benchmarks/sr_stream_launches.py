"""Launches and host syncs of one fp8_linear fwd+bwd with stochastic gradient rounding on the CUDA code path
(counted on CPU, Triton's interpreter): the seed drawn from torch's generator vs from a stochastic-rounding
stream (``fp8pass.runtime.sr``). Usage: ``TRITON_INTERPRET=1 python benchmarks/sr_stream_launches.py``."""
import os, sys, torch
os.environ["FP8PASS_KERNELS"] = "triton"
sys.path.insert(0, os.getcwd())
import fp8pass
from benchmarks import gpu_launches as gl
from fp8pass.runtime.op_schema import LinearKnobs
from fp8pass.runtime.state import LinearScalingState
torch.manual_seed(0)
x = torch.randn(64, 64, dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(96, 64, dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn(64, 96, dtype=torch.bfloat16)
for recipe in ("current", "delayed"):
    st = LinearScalingState(fp8pass.DelayedScaling()) if recipe == "delayed" else None
    states = st.op_args() if st else ([], [], [])
    k = LinearKnobs("e4m3", "e5m2", "tensor", 128, False, "stochastic", 0.0, 1, "max", None, True)
    for label, stream in (("torch generator", None), ("stream", torch.tensor([5, 0]))):
        def step():
            x.grad = w.grad = None
            out = torch.ops.fp8pass.fp8_linear(x, w, None, *states, stream, *k.args())
            if st: st.record_forward(out[1], out[2])
            out[0].backward(dy)
        step(); step()
        with gl.LaunchCounter() as c:
            step()
        seeds = {k2: v for k2, v in list(c.aten.items()) + list(c.triton.items()) if "rand" in k2 or "seed" in k2}
        print(f"{recipe:8s} {label:16s} total {c.total} syncs {dict(c.syncs)} seed launches {seeds}")
