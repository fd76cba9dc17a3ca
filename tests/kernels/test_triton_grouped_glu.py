"""The grouped GLU tail's activation kernels (kernels/triton_grouped_glu.py) against the torch path of
``runtime.grouped_swiglu`` (``_grouped_operand``, ``swiglu._glu_backward_math`` with per-expert channel
scales), in Triton's interpreter: relu bit for bit, silu within the bounds its ``exp`` allows."""

import pytest
import torch

from fp8pass.kernels import triton_grouped_glu as tgg
from fp8pass.runtime.grouped_casting import group_ids
from fp8pass.runtime.grouped_swiglu import _grouped_operand, _row_scales
from fp8pass.runtime.swiglu import _C_MAX, _C_MIN, _glu_backward_math

S, F = 70, 96  # F: a partial tile of channels
OFFS = torch.tensor([10, 10, 45, 60], dtype=torch.int32)  # expert 1 has no rows; rows 60..69 are padding
E = OFFS.numel()


def _inputs(fused: bool, seed: int = 0):
    """(gate, up) bf16 [S, F] (the halves of one [S, 2F] when ``fused``), with -0, NaN, Inf and large
    values placed in different experts' rows."""
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(S, 2 * F, generator=g) * 3).to(torch.bfloat16)
    gate_up[0, :3] = torch.tensor([0.0, -0.0, 60.0])
    gate_up[0, F:F + 3] = torch.tensor([-0.0, 2.0, 1e30])
    gate_up[20, 5] = float("nan")  # expert 2's channel 5: a NaN maximum (scale 1)
    gate_up[50, F + 7] = float("inf")  # expert 3's channel 7: an Inf maximum (scale 1)
    gate_up[65, 9] = float("nan")  # a padding row: no expert's maximum
    if fused:
        return gate_up[:, :F], gate_up[:, F:]
    return gate_up[:, :F].contiguous(), gate_up[:, F:].contiguous()


def _same(a, b):
    """Bit-identical, NaNs equal whatever their payload."""
    return a.shape == b.shape and a.dtype == b.dtype and bool(((a == b) & (a.signbit() == b.signbit())
                                                               | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize("smooth", ["channel", "none"])
@pytest.mark.parametrize("fused", [False, True], ids=["gate, up", "gate_up halves"])
def test_relu_operand_and_backward_are_the_torch_path_bit_for_bit(smooth, fused):
    gate, up = _inputs(fused)
    ids = group_ids(OFFS, S)
    want_a, want_s = _grouped_operand(gate, up, ids, E, smooth, "relu")
    got_a, got_s = tgg.grouped_glu_operand(gate, up, OFFS, "relu", smooth, (_C_MIN, _C_MAX))
    assert _same(got_a, want_a) and _same(got_s, want_s)
    if smooth == "channel":
        assert got_s[1].eq(1).all() and got_s[2, 5] == 1 and got_s[3, 7] == 1  # no rows, NaN, Inf: scale 1
        assert (got_s != 1).any()
    da = (torch.randn(S, F, generator=torch.Generator().manual_seed(1)) * 1e-2).to(torch.bfloat16)
    row_s = _row_scales(want_s, ids) if smooth == "channel" else want_s
    want_g, want_u = _glu_backward_math(da, gate, up, row_s, smooth, "relu")
    got_g, got_u = tgg.grouped_glu_backward(da, gate, up, OFFS, "relu", want_s if smooth == "channel" else None,
                                            joined=fused)
    if fused:
        assert got_u.numel() == 0 and got_g.shape == (S, 2 * F)
        got_g, got_u = got_g[:, :F], got_g[:, F:]
    assert _same(got_g, want_g.to(torch.bfloat16)) and _same(got_u, want_u.to(torch.bfloat16))


@pytest.mark.parametrize("fused", [False, True], ids=["gate, up", "gate_up halves"])
def test_silu_is_the_torch_path_within_its_exp(fused):
    """silu's ``exp`` differs between implementations in its last fp32 bits: ``A`` within a few fp32 ulp
    of the torch path's, the channel scales equal (powers of two of maxima that are that close, away
    from a binade edge), the gradients within one bf16 step; bit for bit where exp is exact (g = 0)."""
    gate, up = _inputs(fused)
    ids = group_ids(OFFS, S)
    want_a, want_s = _grouped_operand(gate, up, ids, E, "channel", "silu")
    got_a, got_s = tgg.grouped_glu_operand(gate, up, OFFS, "silu", "channel", (_C_MIN, _C_MAX))
    assert torch.equal(got_s, want_s)
    finite = want_a.isfinite()
    assert torch.equal(finite, got_a.isfinite()) and torch.equal(want_a.isnan(), got_a.isnan())
    assert ((got_a - want_a)[finite].abs() <= 8 * torch.finfo(torch.float32).eps * want_a[finite].abs()).all()
    assert _same(got_a[0, :2], want_a[0, :2])
    da = (torch.randn(S, F, generator=torch.Generator().manual_seed(1)) * 1e-2).to(torch.bfloat16)
    want_g, want_u = (t.to(torch.bfloat16) for t in _glu_backward_math(da, gate, up, _row_scales(want_s, ids),
                                                                          "channel", "silu"))
    got_g, got_u = tgg.grouped_glu_backward(da, gate, up, OFFS, "silu", want_s, joined=fused)
    if fused:
        got_g, got_u = got_g[:, :F], got_g[:, F:]
    for got, want in ((got_g, want_g), (got_u, want_u)):
        ok = want.isfinite()
        assert torch.equal(ok, got.isfinite())
        step = torch.finfo(torch.bfloat16).eps * want.float().abs()
        assert ((got.float() - want.float())[ok].abs() <= step[ok]).all()
    assert _same(got_g[0, :2], want_g[0, :2]) and _same(got_u[0, :2], want_u[0, :2])


def test_grouped_glu_kernels_reject_bad_arguments():
    gate, up = _inputs(False)
    with pytest.raises(ValueError, match="activation 'gelu'"):
        tgg.grouped_glu_operand(gate, up, OFFS, "gelu", "channel", (_C_MIN, _C_MAX))
    with pytest.raises(ValueError, match="smooth must be one of"):
        tgg.grouped_glu_operand(gate, up, OFFS, "silu", "token", (_C_MIN, _C_MAX))
    with pytest.raises(ValueError, match="int32 offs"):
        tgg.grouped_glu_operand(gate, up, OFFS.long(), "silu", "none", (_C_MIN, _C_MAX))
    with pytest.raises(ValueError, match=r"dA must be \[S, F\]"):
        tgg.grouped_glu_backward(gate[:, :5], gate, up, OFFS, "silu", None, joined=False)
    with pytest.raises(ValueError, match="c \\[E, F\\]"):
        tgg.grouped_glu_backward(gate, gate, up, OFFS, "silu", torch.ones(E, 3), joined=False)


_STATIC = r"""
import json, sys
from benchmarks import gpu_compile as gc, gpu_static as gs
rows = [gs.measure(name, kernel, sig, consts, cfg, aligned=aligned) for name, kernel, sig, consts, cfg in gc.cases()
        if name in sys.argv[1].split(";") for aligned in (True, False)]
print(json.dumps([{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]))
"""


def test_sm90_builds_spill_nothing():
    """The silu kernels with channel smoothing (maxima, operand, backward; 128 experts: the widest expert
    lookup), built for sm_90 by benchmarks/gpu_static.py with the installed Triton, aligned and not: no
    register spills (docs/results/gpu.md has every variant with both Triton versions)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # a compiled build
    names = ";".join(f"grouped_glu {kind} act=silu experts=128" for kind in ("amax", "operand channel",
                                                                              "backward channel"))
    proc = subprocess.run([sys.executable, "-c", _STATIC, names],
                          cwd=Path(__file__).resolve().parents[2], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(rows) == 6, [r["variant"] for r in rows]  # 3 variants x 2 builds
    assert all(r["spill_bytes"] == 0 for r in rows), rows
