"""Two facts about the Triton interpreter the CPU suite runs on, probed with tiny kernels (imported by
conftest.py after it set TRITON_INTERPRET=1, so these kernels are interpreted)."""

import torch
import triton
import triton.language as tl


@triton.jit
def _loop_kernel(x_ptr, n, BLOCK: tl.constexpr):
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n, BLOCK):  # a loop bound that is a runtime argument
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(x_ptr, tl.sum(acc))


@triton.jit
def _fma_kernel(out_ptr, x, y):
    tl.store(out_ptr, tl.fma(x, y, -(x * y)))


def runtime_loop_problem() -> str | None:
    """None, or why this interpreter cannot run a loop whose bound is a kernel argument (triton 3.6's
    interpreter converts it with ``int()`` of a 1-element array, which numpy >= 2.4 refuses)."""
    x = torch.ones(8)
    try:
        _loop_kernel[(1,)](x, 8, BLOCK=4)
    except Exception as e:  # noqa: BLE001 - any failure here is the answer
        return f"{type(e).__name__}: {e}"
    return None


def fma_is_fused() -> bool:
    """Whether ``tl.fma`` rounds once here (triton 3.6's interpreter computes ``x * y + z``, two roundings;
    the GPU and later interpreters fuse)."""
    out = torch.zeros(1)
    _fma_kernel[(1,)](out, 1.4142135, 1.7320508)
    return float(out) != 0.0
