"""Triton kernels compiled for a real GPU: bit-identical to the torch family on CPU."""

import pytest
import torch

import fp8pass
from fp8pass.kernels import torch_family as T
from fp8pass.kernels import triton_family as R
from fp8pass.numerics import E2M1, E4M3, E4M3_GAUDI, E5M2

pytestmark = pytest.mark.gpu
FORMATS = [E4M3, E4M3_GAUDI, E5M2, E2M1]


def sweep():
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    x = x[torch.isfinite(x)]
    g = torch.Generator().manual_seed(0)
    return torch.cat([x, torch.randn(1 << 20, generator=g) * 30, torch.randn(1 << 20, generator=g) * 1e-3])


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_gpu_cast_bit_exact(fmt):
    x = sweep()
    s = torch.tensor(1.0)
    a, am = T.cast_scaled(x, s, fmt, want_amax=True)
    b, bm = R.cast_scaled(x.cuda(), s.cuda(), fmt, want_amax=True)
    assert torch.equal(a.view(torch.uint8), b.cpu().view(torch.uint8))
    assert torch.equal(am, bm.cpu())


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("tile", [(1, 4096), (1, 128), (1, 16), (128, 128), (16, 16)], ids=str)
def test_gpu_tiles_bit_exact(fmt, tile):
    torch.manual_seed(1)
    x = torch.randn(512, 4096) * torch.logspace(-4, 4, 4096)
    x[3, 5] = float("nan")
    a, sa = T.quantize_groups(x, tile, fmt, power_of_two=False)
    b, sb = R.quantize_groups(x.cuda(), tile, fmt, power_of_two=False)
    assert torch.equal(sa.nan_to_num(-1), sb.cpu().nan_to_num(-1))
    assert torch.equal(a.view(torch.uint8), b.cpu().view(torch.uint8))


def test_gpu_stochastic_unbiased():
    x = torch.full((1 << 22,), 1.0 + 1.0 / 32, device="cuda")
    q = fp8pass.quantize(x, E4M3, scale=1.0, rounding="stochastic", generator=torch.Generator("cuda").manual_seed(0))
    vals = q.dequantize(torch.float64)
    assert set(vals.unique().tolist()) == {1.0, 1.125}
    assert abs(vals.mean().item() - x[0].item()) < 5 * 0.0625 / (1 << 11)
