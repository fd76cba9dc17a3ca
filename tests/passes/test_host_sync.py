"""No host synchronisation in the compiled FP8 step (issue 15): graphs and the Python hot path.

On CPU a host read costs nothing, so a sync cannot be seen by timing; these tests look for the
operations that would sync on an accelerator: ``aten._local_scalar_dense`` / ``item`` in the traced
forward and backward graphs, and ``Tensor.item`` / ``__bool__`` / ``tolist`` / ``__int__`` /
``__float__`` called from Python while a compiled fp8 forward+backward and an ``fp8pass.optim.AdamW``
step run. The only reads allowed are the CPU-only fast paths listed in ``CPU_ONLY`` (each behind an
explicit ``device.type == "cpu"`` test or in the CPU kernel family), which never run on a GPU; the GPU
side is checked with ``torch.cuda.set_sync_debug_mode("error")`` in tests/gpu/test_host_sync_gpu.py.
"""

import collections
import traceback

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import fp8pass
from fp8pass.compile_backend import Backend

# (file under fp8pass/, function): host reads that only run on CPU tensors
CPU_ONLY = {
    ("runtime/casting.py", "needs_current_amax"),   # `steps.device.type != "cpu" or int(steps) ...`
    ("runtime/casting.py", "state_scale"),          # `if state[2].device.type == "cpu": ...`
    ("kernels/cpu.py", "gemm_tensor_scaled"),  # the CPU kernel family (never used on CUDA)
    ("optim/adam.py", "step"),                      # float(step) of the step count kept on the host
}
READS = ("item", "__bool__", "tolist", "__int__", "__float__")
SYNC_TARGETS = {"aten._local_scalar_dense.default", "aten.item.default"}


class _Reads:
    """Count host reads of tensors, by the fp8pass function that made them."""

    def __init__(self):
        self.calls = collections.Counter()

    def __enter__(self):
        self.orig = {n: getattr(torch.Tensor, n) for n in READS}
        for n in READS:
            setattr(torch.Tensor, n, self._wrap(n, self.orig[n]))
        return self

    def __exit__(self, *exc):
        for n, f in self.orig.items():
            setattr(torch.Tensor, n, f)

    def _wrap(self, name, f):
        def counted(t, *a, **k):
            frame = traceback.extract_stack(limit=2)[0]
            where = frame.filename.replace("\\", "/").split("/fp8pass/")[-1] if "/fp8pass/" in frame.filename else (
                frame.filename)
            self.calls[(name, where, frame.name)] += 1
            return f(t, *a, **k)
        return counted

    def outside(self, allowed) -> dict:
        return {k: v for k, v in self.calls.items() if (k[1], k[2]) not in allowed}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.SiLU(), torch.nn.Linear(128, 64))


def test_the_counter_sees_a_planted_read():
    with _Reads() as r:
        x = torch.ones(3)
        float(x.sum()), bool(x.any()), x.tolist(), x.sum().item()
    assert sum(r.calls.values()) == 4 and r.outside(CPU_ONLY)


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_compiled_fp8_step_has_no_sync_in_its_graphs_and_no_host_read(monkeypatch, recipe):
    graphs = []

    def capture(gm, inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    monkeypatch.setattr(Backend, "_compile", lambda self, gm, inputs, mode, options: aot_autograd(
        fw_compiler=capture, bw_compiler=capture)(gm, inputs))
    torch._dynamo.reset()
    model = _model()
    scaling = fp8pass.DelayedScaling() if recipe == "delayed" else fp8pass.CurrentScaling()
    cfg = fp8pass.Config(recipe=scaling, grad_stochastic_rounding=True)
    cm = torch.compile(model, backend=fp8pass.backend(cfg))
    opt = fp8pass.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(32, 64)

    def step():
        opt.zero_grad()
        cm(x).square().mean().backward()
        opt.step()

    step()  # compile; optimizer state
    assert len(graphs) == 2  # forward and backward
    targets = [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert not SYNC_TARGETS & set(targets)
    assert sum("fp8_linear" in t for t in targets) >= 4  # the FP8 ops are there: 2 forward, 2 backward
    if recipe == "delayed":  # one batched record for the forward; the backward's records are inlined aten ops
        fwd = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
        recs = [n for n in graphs[0].graph.nodes if "auto_functionalized" in str(n.target)]
        assert len(recs) == 1 and "delayed_record_many_" in str(recs[0].kwargs.get("_mutable_op", recs[0].args[0]))
        assert not any("delayed_record" in t for t in targets if "auto_functionalized" not in t), fwd
    before = [p.detach().clone() for p in model.parameters()]
    with _Reads() as reads:
        step()
        step()
    assert not reads.outside(CPU_ONLY), reads.outside(CPU_ONLY)
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))  # the steps ran


def test_stochastic_gradient_cast_on_the_cuda_kernels_is_the_fused_triton_cast(monkeypatch):
    """The CUDA module (run here under the Triton interpreter) casts a stochastically rounded operand
    with the Triton cast kernel in one read, never the torch integer emulation: each code is one of
    the two FP8 neighbours of ``x * scale``, the mean over draws is unbiased, the amax is exact."""
    from fp8pass import kernels
    from fp8pass.kernels import torch_family
    from fp8pass.runtime import casting

    monkeypatch.setenv("FP8PASS_KERNELS", "triton")
    assert kernels.for_device("cpu").__name__.endswith(".cuda")

    def emulation(*a, **k):
        raise AssertionError("the torch integer emulation ran")

    monkeypatch.setattr(torch_family, "cast_scaled", emulation)
    fmt = fp8pass.E5M2
    torch.manual_seed(0)
    x = torch.randn(64, 48) * 3
    x[0, 0] = 7.0
    scale = torch.tensor(8.0)
    draws = []
    for _ in range(200):
        op = casting._cast_tensor(kernels.for_device("cpu"), x, scale, fmt, "stochastic", None)
        assert float(op.amax) == float(x.abs().max())
        draws.append(op.data.float())
    d = torch.stack(draws)
    v = x * scale
    # every draw is a neighbour: |code - v| below one spacing of the format at v
    nearest = v.to(fmt.torch_dtype).float()
    spacing = torch.where(nearest.abs() > 0, nearest.abs() * 2.0 ** -fmt.mbits, torch.tensor(2.0 ** -16))
    assert ((d - v).abs() <= 2 * spacing + 1e-6).all()
    assert not torch.equal(d[0], d[1])  # random: two draws differ
    err = (d.mean(0) - v) / spacing  # unbiased: the mean error is noise (sd ~ 0.5 / sqrt(200) spacings)
    assert float(err.mean().abs()) < 0.02 and float(err.abs().max()) < 0.5
