"""What autograd keeps for backward: FP8 codes and scales only, exact byte counts.

Every rewritten linear keeps ``x``'s and ``W``'s codes (1 byte/element) and their two fp32 scalar
scales; the GLU tail (``swiglu_down``) keeps the codes of its GEMM operands ``A`` and ``B``, of
``gate`` and ``up`` (no high-precision copy of them) and the smoothing scales. Counted with
``saved_tensors_hooks``, eager and compiled (AOT autograd's partitioner may not add anything else).
"""

import sys
from pathlib import Path

import pytest
import torch

import fp8pass
from fp8pass import ops

sys.path.insert(0, str(Path(__file__).parent))
from _models import D, H, SiluMul  # noqa: E402

T = 64  # tokens of the inputs below (4 x 16)


def _saved(fn):
    """(list of saved tensors, fn's result); fails if one storage is saved twice."""
    got = []

    def pack(t):
        got.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    storages = [t.untyped_storage().data_ptr() for t in got if t.numel()]
    assert len(storages) == len(set(storages)), "a tensor was saved twice"
    return got, out


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _linear_bytes(rows, k, n) -> int:
    return rows * k + n * k + 2 * 4  # x codes, W codes, two fp32 scalar scales


def _glu_tail_bytes(rows, f, d) -> int:
    # A codes, B codes, gate codes, up codes, four fp32 scalar scales, channel scales [f] fp32
    return rows * f + d * f + 2 * rows * f + 4 * 4 + f * 4


def _only_codes_and_scales(tensors, max_scale_elems=1):
    for t in tensors:
        assert t.dtype == torch.uint8 or (t.dtype == torch.float32 and t.numel() <= max_scale_elems), \
            (tuple(t.shape), t.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_linear_saves_codes_and_scales(dtype):
    x = torch.randn(4, 16, 32, dtype=dtype, requires_grad=True)
    w = torch.randn(24, 32, dtype=dtype, requires_grad=True)
    saved, y = _saved(lambda: ops.fp8_linear(x, w))
    _only_codes_and_scales(saved)
    assert _nbytes(saved) == _linear_bytes(T, 32, 24)
    y.float().sum().backward()
    assert x.grad.dtype == w.grad.dtype == dtype


def test_eager_glu_saves_no_high_precision_gate_or_up():
    x = torch.randn(4, 16, D, requires_grad=True)
    wg, wu = (torch.randn(H, D, requires_grad=True) for _ in range(2))
    wd = torch.randn(D, H, requires_grad=True)
    saved, y = _saved(lambda: ops.swiglu_mlp(x, wg, wu, wd, smooth="channel"))
    _only_codes_and_scales(saved, max_scale_elems=H)
    assert _nbytes(saved) == 2 * _linear_bytes(T, D, H) + _glu_tail_bytes(T, H, D)
    y.sum().backward()


def _compiled(model, compiler):
    cfg = fp8pass.Config(recipe=fp8pass.CurrentScaling(), compiler=compiler, grad_stochastic_rounding=False)
    return torch.compile(model, backend=fp8pass.backend(cfg), fullgraph=True)


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast_bf16"])
def test_compiled_linears_save_codes_and_scales_only(compiler, autocast):
    """Two chained linears (the second's input is the first's output): the partitioner keeps
    exactly the four codes and four scales, no fp32/bf16 input, view or amax."""
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(32, 48, bias=False), torch.nn.Linear(48, 64, bias=True))
    f = _compiled(model, compiler)
    x = torch.randn(4, 16, 32, requires_grad=True)

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return f(x)

    for _ in range(2):  # the second call runs the compiled graph as it is reused
        saved, y = _saved(run)
        _only_codes_and_scales(saved)
        assert _nbytes(saved) == _linear_bytes(T, 32, 48) + _linear_bytes(T, 48, 64)
        assert y.dtype == (torch.bfloat16 if autocast else torch.float32)
        y.float().sum().backward()


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_compiled_glu_saves_codes_and_scales_only(compiler):
    """The rewritten SwiGLU MLP under autocast: gate/up projections keep codes (of x, each its own
    cast: separate per-projection scales), the GLU tail keeps codes of A, B, gate and up."""
    torch._dynamo.reset()
    f = _compiled(SiluMul(), compiler)
    x = torch.randn(4, 16, D, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        saved, y = _saved(lambda: f(x))
    _only_codes_and_scales(saved, max_scale_elems=H)
    assert _nbytes(saved) == 2 * _linear_bytes(T, D, H) + _glu_tail_bytes(T, H, D)
    y.float().sum().backward()
