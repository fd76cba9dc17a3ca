"""Which Triton the tests run, chosen explicitly (never from whether CUDA is present).

* The CPU suite (``python -m pytest``, any run that is not only ``tests/gpu``) runs every Triton kernel
  on CPU tensors in Triton's interpreter: ``TRITON_INTERPRET=1`` is set here, before any kernel module
  is imported, on CPU-only and CUDA hosts alike. Its tests compare each kernel with its torch
  reference. ``tests/gpu`` is skipped in such a run (it needs compiled kernels; see below).
* The GPU tests run alone: ``python -m pytest tests/gpu`` (every path argument under ``tests/gpu``)
  leaves ``TRITON_INTERPRET`` as it is, so the kernels are compiled for the GPU; without CUDA they skip.

TRITON_INTERPRET is read when a kernel is decorated, once per process, so the two cannot share one.
"""

import os
from pathlib import Path

import pytest
import torch

GPU_DIR = (Path(__file__).parent / "gpu").resolve()


def _under_gpu_dir(arg: str) -> bool:
    path = Path(arg.split("::")[0]).resolve()
    return path == GPU_DIR or GPU_DIR in path.parents


def gpu_session(args) -> bool:
    """Whether this pytest run is the GPU tests' own: every path argument is under tests/gpu."""
    paths = [a for a in args if not a.startswith("-")]
    return bool(paths) and all(_under_gpu_dir(a) for a in paths)


def pytest_configure(config):
    config.fp8pass_gpu_session = gpu_session(config.args)
    config.addinivalue_line("markers", "needs_fused_fma: bit-exactness that needs tl.fma to round once (skipped "
                                       "on an interpreter that does not: triton 3.6's)")
    config.fp8pass_fused_fma = True
    if not config.fp8pass_gpu_session:
        os.environ["TRITON_INTERPRET"] = "1"  # the CPU suite interprets Triton (see the module doc)
        _check_interpreter(config)


def _check_interpreter(config):
    """Stop with a clear message where this Triton's interpreter cannot run the suite; note where its
    ``tl.fma`` is not fused (those bit-exactness tests are skipped, with the reason)."""
    try:
        import _interpreter_probe as probe
    except ImportError:  # no triton (the Triton tests skip themselves)
        return
    problem = probe.runtime_loop_problem()
    if problem is not None:
        import numpy
        import triton

        pytest.exit(f"this Triton's interpreter (triton {triton.__version__}, numpy {numpy.__version__}) cannot run "
                    f"a kernel loop with a runtime bound ({problem}). triton 3.6's interpreter needs numpy<2.4 "
                    f"(pip install 'numpy<2.4'), or use triton >= 3.9.", returncode=4)
    config.fp8pass_fused_fma = probe.fma_is_fused()


# The two tiers. `python -m pytest -q` runs the fast loop: the modules listed here (casts, kernels under the
# interpreter, single ops, the public surface; <= 3 minutes on 2 cores, measured in
# docs/results/test_tiers.md). Every other module is the `full` tier (torch.compile of models, trainings,
# zoos, subprocesses, sweeps): .ci/run runs both (-m "not slow"). A new module starts in the full tier;
# list it here when it is quick and guards something a change breaks often.
FAST_TIER = {
    "numerics": "test_quantize.py test_stochastic.py test_argument_validation.py",
    "kernels": "test_cast_one_pass.py test_kernel_selection.py test_triton_scaling.py test_triton_grouped_casts.py "
               "test_triton_glu.py",
    "runtime": "test_nvfp4.py test_hcp.py test_knob_parsing.py",
    "optim": "test_optim.py",
    "monitor": "test_outliers.py",
    "project": "test_public_api.py test_cli_help.py test_torch_private_apis.py",
}


def in_fast_tier(path: Path) -> bool:
    return path.name in FAST_TIER.get(path.parent.name, "").split()


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    full = pytest.mark.full
    for item in items:
        if not in_fast_tier(Path(str(item.fspath))) and not _under_gpu_dir(str(item.fspath)):
            item.add_marker(full)
    if not getattr(config, "fp8pass_fused_fma", True):
        fma = pytest.mark.skip(reason="this Triton interpreter's tl.fma rounds twice (triton 3.6); the Adam "
                                      "kernels' bit-exactness needs the fused one (GPUs, triton >= 3.9's interpreter)")
        for item in items:
            if item.get_closest_marker("needs_fused_fma"):
                item.add_marker(fma)
    if config.fp8pass_gpu_session:
        reason = None if torch.cuda.is_available() else "needs CUDA"
    else:
        reason = "GPU tests run compiled Triton kernels in their own process: python -m pytest tests/gpu"
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if _under_gpu_dir(str(item.fspath)):
            item.add_marker(skip)


@pytest.fixture(params=["torch", "triton"])
def kernels(request, monkeypatch):
    """Run a test once per kernel family (FP8PASS_KERNELS); Triton runs in the interpreter here."""
    monkeypatch.setenv("FP8PASS_KERNELS", request.param)
    return request.param


@pytest.fixture
def strict_interpreter(monkeypatch):
    """Triton's interpreter with every masked-in load and store checked: it must lie inside the storage
    of one of the launch's tensor arguments (an out-of-bounds access fails the test instead of reading
    or corrupting host memory).

    Yields a dict ``shift`` ({tensor: elements}) and a one-item list ``pid_shift``: program ids along
    axis 0 are raised by ``pid_shift[0]`` and each listed tensor's pointer is moved back by its
    elements, so a kernel computes the addresses of far-away programs (indices past 2**31) while
    touching only the small tensors it was given.
    """
    import numpy as np
    from triton.runtime import interpreter as ti

    ranges: list[tuple[int, int]] = []
    shift: dict = {}
    pid_shift = [0]
    builder = ti.interpreter_builder

    init_args = ti.GridExecutor._init_args_hst

    def record(self, args_dev, kwargs):
        ranges.clear()
        for a in (*args_dev, *kwargs.values()):
            if isinstance(a, torch.Tensor):
                st = a.untyped_storage()
                ranges.append((st.data_ptr(), st.data_ptr() + st.nbytes()))
        return init_args(self, args_dev, kwargs)

    def check(ptrs, mask, what):
        nbytes = max(1, ptrs.get_element_ty().primitive_bitwidth // 8)
        m = np.broadcast_to(mask.data, ptrs.data.shape)
        addr = ptrs.data[m].astype(np.uint64)
        ok = np.zeros(addr.shape, dtype=bool)
        for lo, hi in ranges:
            ok |= (addr >= np.uint64(lo)) & (addr + np.uint64(nbytes) <= np.uint64(hi))
        if not ok.all():
            raise AssertionError(f"out-of-bounds {what} of {int((~ok).sum())} element(s)")

    load, store = builder.create_masked_load, builder.create_masked_store

    def masked_load(ptrs, mask, *rest):
        check(ptrs, mask, "load")
        return load(ptrs, mask, *rest)

    def masked_store(ptrs, value, mask, *rest):
        check(ptrs, mask, "store")
        return store(ptrs, value, mask, *rest)

    program_id = builder.create_get_program_id

    def shifted_program_id(axis):
        h = program_id(axis)
        return ti.TensorHandle(h.data + np.int32(pid_shift[0] if axis == 0 else 0), h.dtype)

    cvt = ti._implicit_cvt

    def shifted_cvt(arg):
        out = cvt(arg)
        for t, elems in shift.items():
            if isinstance(arg, torch.Tensor) and arg.data_ptr() == t.data_ptr() and arg.dtype == t.dtype:
                out.handle.data = out.handle.data - np.uint64(elems * t.element_size())
        return out

    monkeypatch.setattr(ti.GridExecutor, "_init_args_hst", record)
    monkeypatch.setattr(builder, "create_masked_load", masked_load)
    monkeypatch.setattr(builder, "create_masked_store", masked_store)
    monkeypatch.setattr(builder, "create_get_program_id", shifted_program_id)
    monkeypatch.setattr(ti, "_implicit_cvt", shifted_cvt)
    yield shift, pid_shift
