"""The FP8 AdamW step on the CUDA code path, run on CPU: no host sync, no tensor built from host data, and
as many device launches for 12 parameters as for 3.

``FP8PASS_KERNELS=triton`` makes the optimizer take the path it takes on a GPU (the fused multi-tensor
Triton kernel, interpreted here: conftest.py sets ``TRITON_INTERPRET=1``). Every aten op of a steady-state
step is seen by a ``TorchDispatchMode`` that fails on what would synchronise with, or copy from, the host
on a GPU, and counts the rest. What ``torch.tensor(...)`` shows to such a mode in torch 2.13 was checked:
``torch.tensor([0.9, 0.1], device=d)`` and ``torch.tensor(0.9, device=d)`` each dispatch one
``aten.lift_fresh`` (the host-to-device copy happens below the mode); ``torch.scalar_tensor`` dispatches
``aten.scalar_tensor``; ``.item()`` / ``float()`` / ``bool()`` dispatch ``aten._local_scalar_dense`` (or
``aten.is_nonzero``).

With ``capturable=False`` the step counts live in CPU tensors (on a GPU as well, as torch keeps them);
torch's Adam reads them every step, this optimizer only when it did not write the count itself (a
new, loaded or edited counter), so a steady-state step reads nothing at all.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton")

import fp8pass.optim as fo  # noqa: E402

aten = torch.ops.aten
SYNCS = {aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default, aten.equal.default}
HOST_DATA = {aten.lift_fresh.default, aten.lift_fresh_copy.default, aten.scalar_tensor.default,
             aten._pin_memory.default}
COPIES = {aten._to_copy.default, aten.copy_.default}
NO_KERNEL = {aten.empty.memory_format, aten.empty_strided.default, aten.detach.default}  # allocations, views


class StepOps(TorchDispatchMode):
    """Record host syncs, tensors built from host data and copies of them (``violations``); count the
    device kernels (aten ops and Triton launches)."""

    def __init__(self):
        super().__init__()
        self.aten: dict = {}
        self.triton: dict = {}
        self.violations: list = []
        self.in_kernel = 0  # the interpreter's own tensor copies while a kernel runs are not the step's
        self.built: set = set()  # storages of tensors built from host data in the step

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.in_kernel or func.namespace == "profiler":  # optimizer.step's record_function markers
            return func(*args, **kwargs)
        if func in SYNCS:
            self.violations.append(f"host sync: {func}")
        if func in COPIES:
            src = args[1] if func is aten.copy_.default else args[0]
            if src.data_ptr() in self.built:
                self.violations.append(f"copy of a tensor built from host data: {func}")
        out = func(*args, **kwargs)
        if func in HOST_DATA:
            self.violations.append(f"tensor built from host data: {func}")
            self.built.add(out.data_ptr())
        if func not in NO_KERNEL and not func.is_view:
            self.aten[str(func)] = self.aten.get(str(func), 0) + 1
        return out

    def __enter__(self):
        import triton

        self._run = triton.runtime.interpreter.InterpretedFunction.run
        mode = self

        def run(fn, *a, **k):  # every Triton launch (an autotuned kernel's too) comes through here once
            mode.triton[fn.fn.__name__] = mode.triton.get(fn.fn.__name__, 0) + 1
            mode.in_kernel += 1
            try:
                return mode._run(fn, *a, **k)
            finally:
                mode.in_kernel -= 1

        triton.runtime.interpreter.InterpretedFunction.run = run
        return super().__enter__()

    def __exit__(self, *exc):
        import triton

        triton.runtime.interpreter.InterpretedFunction.run = self._run
        return super().__exit__(*exc)


SHAPES = [(3, 100), (7,), (64, 40), (300,), (2, 3, 40), (129,)]  # partial blocks, one below a block


def _steady_step(n: int, **kw) -> tuple[StepOps, list]:
    """The ops of the third step of AdamW over ``n`` parameters (the first creates the state and the
    launch table; gradients are written in place, as a training loop's backward does)."""
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(SHAPES[i % len(SHAPES)], generator=g)) for i in range(n)]
    opt = fo.AdamW(params, **{"lr": 1e-2, **kw})
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-2
    opt.step()
    ops = None
    for _ in range(2):
        for p in params:
            p.grad.copy_(torch.randn(p.shape, generator=g) * 1e-2)
        before = [p.detach().clone() for p in params]
        ops = StepOps()
        with ops:
            opt.step()
        assert not ops.violations
        assert all(not torch.equal(b, p) for b, p in zip(before, params))  # the step updated every tensor
    return ops, params


OPTIONS = {
    "host step": dict(),
    "capturable": dict(capturable=True),
    "capturable, lr a tensor": dict(capturable=True, lr=torch.tensor(1e-2)),
    "capturable, stochastic": dict(capturable=True, rounding="stochastic", stochastic_flush=True,
                                   generator=torch.Generator().manual_seed(1)),
}


@pytest.fixture
def cuda_path(monkeypatch):
    monkeypatch.setenv("FP8PASS_KERNELS", "triton")


@pytest.mark.parametrize("case", list(OPTIONS))
def test_step_has_no_host_sync_and_builds_nothing_from_host_data(case, cuda_path):
    kw = dict(OPTIONS[case])
    ops, params = _steady_step(12, **kw)
    assert ops.triton == {"_adam_kernel": 1}  # all 12 tensors in one launch


def test_step_counts_kept_on_the_host_follow_edits_and_loads(cuda_path, monkeypatch):
    """The count the optimizer wrote is not read back; an edited or loaded counter is read once."""
    from fp8pass.optim import adam

    used = []
    real = adam.host_hyper_params
    monkeypatch.setattr(adam, "host_hyper_params", lambda *a: (used.append(a[5]), real(*a))[1])
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    opt = fo.AdamW(params, lr=1e-2)
    for p in params:
        p.grad = torch.randn(p.shape)
    for _ in range(3):
        opt.step()
    opt.state[params[0]]["step"].fill_(40.0)  # an edit: that counter differs from the others now
    opt.step()
    opt.load_state_dict(opt.state_dict())  # new step tensors
    opt.step()
    assert used == [1.0, 2.0, 3.0, 41.0, 4.0, 42.0, 5.0]


# Device kernels of one steady-state step, the same for 3 and for 12 parameters. Host step: the step
# counters' multi-tensor add (on the CPU, where they live) and the kernel. Capturable: the counters' add,
# the hyper-parameters of every tensor computed together on the device (device_hyper_params: a stack,
# 6 fills of the constant columns, the fill of lr, 2 pow, 3 x (neg_, add_) for the three 1 - x, div,
# rsqrt, mul), and the kernel; stochastic rounding adds the draw of the launch's seed.
EXPECTED = {
    "host step": {"aten._foreach_add_.Scalar": 1},
    "capturable": {"aten._foreach_add_.Scalar": 1, "aten.stack.default": 1, "aten.fill_.Scalar": 6,
                    "aten.full.default": 1, "aten.pow.Tensor_Tensor_out": 2, "aten.neg_.default": 3,
                    "aten.add_.Tensor": 3, "aten.div.out": 1, "aten.rsqrt.out": 1, "aten.mul.out": 1},
}
EXPECTED["capturable, lr a tensor"] = {k: v for k, v in EXPECTED["capturable"].items() if k != "aten.full.default"}
EXPECTED["capturable, stochastic"] = {**EXPECTED["capturable"], "aten.randint.low_generator": 1}  # the launch's seed


@pytest.mark.parametrize("case", list(OPTIONS))
def test_launches_per_step_do_not_grow_with_the_number_of_parameters(case, cuda_path):
    kw = dict(OPTIONS[case])
    few, _ = _steady_step(3, **kw)
    many, _ = _steady_step(12, **kw)
    assert few.triton == many.triton == {"_adam_kernel": 1}
    assert few.aten == many.aten == EXPECTED[case]


@pytest.mark.parametrize("case", ["host step", "capturable"])
def test_offloaded_step_has_no_host_sync_and_launches_once_per_tensor(case, cuda_path):
    """offload_state=True (optim/offload.py): the state copies (plain copies on the CPU, the side-stream
    path's shape) read nothing back and build nothing from host data; each parameter is updated alone,
    its state on the device: one launch per tensor, and one step-count add per tensor (per-parameter
    groups; with capturable=True its hyper-parameters are computed per tensor too)."""
    ops, _ = _steady_step(12, offload_state=True, **OPTIONS[case])
    assert ops.triton == {"_adam_kernel": 12}
    # each tensor's codes and scales (4 tensors) to the device (a clone here) and back (a copy_)
    assert ops.aten["aten.clone.default"] == ops.aten["aten.copy_.default"] == 12 * 4
    assert ops.aten["aten._foreach_add_.Scalar"] == 12
