"""Stochastic rounding: unbiased, only the two neighbouring grid points, reproducible."""

import pytest
import torch

import fp8pass
from fp8pass.numerics import E2M1, E4M3, E5M2, decode


def sr_values(x, fmt, generator):
    q = fp8pass.quantize(x, fmt, scale=1.0, rounding="stochastic", generator=generator)
    return q.dequantize(torch.float64)


@pytest.mark.parametrize("fmt", [E4M3, E5M2, E2M1], ids=lambda f: f.name)
def test_unbiased_and_two_neighbours(fmt, kernels):
    g = torch.Generator().manual_seed(1)
    # Values inside grid intervals across the range, subnormals included (fp32-exact).
    base = torch.tensor([0.3, 1.1, 1.3, 2.6, 5.1, 0.7]) if fmt is E2M1 else torch.tensor(
        [0.3, 1.1, 1.3, 2.6, 5.1, 100.3, 0.0037, fmt.max * 0.97])
    base = torch.cat([base, -base]).double().float()
    n = 20000
    x = base.repeat(n, 1)
    vals = sr_values(x, fmt, g)
    # Neighbours: the RNE cast of the value rounded toward zero / away from zero.
    grid = torch.tensor(sorted({abs(v) for v in _grid(fmt)}), dtype=torch.float64)
    idx = torch.searchsorted(grid, base.abs().double(), right=True)
    lower = grid[idx - 1] * base.sign().double()
    upper = grid[idx.clamp(max=grid.numel() - 1)] * base.sign().double()
    is_neighbour = (vals == lower) | (vals == upper)
    assert bool(is_neighbour.all()), "stochastic rounding produced a value that is not a neighbour"
    mean_err = (vals.mean(0) - base.double()).abs()
    spacing = (upper - lower).abs()
    # Std of the mean of n Bernoulli draws scaled by the spacing is <= spacing / (2 sqrt(n)).
    assert bool((mean_err <= 5 * spacing / (2 * n**0.5)).all()), (mean_err, spacing)


def _grid(fmt):
    if fmt.packed:
        return decode(torch.arange(256, dtype=torch.int32).to(torch.uint8), fmt).tolist()
    v = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt.torch_dtype).float()
    return v[torch.isfinite(v) & (v.abs() <= fmt.max)].tolist()


def test_error_shrinks_like_one_over_sqrt_n(kernels):
    x = torch.full((1,), 1.0 + 1.0 / 32)  # a quarter of the way between 1.0 and 1.125 in E4M3
    g = torch.Generator().manual_seed(2)
    errs = []
    for n in (1000, 16000, 256000):
        vals = sr_values(x.expand(n).contiguous(), E4M3, g)
        errs.append(abs(vals.mean().item() - x.item()))
    bound = [0.125 * 0.5 / n**0.5 * 5 for n in (1000, 16000, 256000)]
    assert all(e <= b for e, b in zip(errs, bound)), (errs, bound)
    assert errs[2] < 0.125 * 0.5 / 1000**0.5  # well below the n=1000 noise level


def test_reproducible_with_generator(kernels):
    x = torch.randn(4096)
    a = fp8pass.quantize(x, E5M2, rounding="stochastic", generator=torch.Generator().manual_seed(7))
    b = fp8pass.quantize(x, E5M2, rounding="stochastic", generator=torch.Generator().manual_seed(7))
    c = fp8pass.quantize(x, E5M2, rounding="stochastic", generator=torch.Generator().manual_seed(8))
    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
    assert not torch.equal(a.data.view(torch.uint8), c.data.view(torch.uint8))


def test_on_grid_values_never_move(kernels):
    grid = torch.tensor(_grid(E4M3))
    x = grid.repeat(50)
    vals = sr_values(x, E4M3, torch.Generator().manual_seed(3))
    assert torch.equal(vals.float(), x)


def test_sr_row_and_block_granularity_unbiased(kernels):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(8, 64)
    n = 400  # n stacked copies: each 1x16 tile sees exactly the values of x's tile
    q = fp8pass.quantize(x.repeat(n, 1), E4M3, granularity="block", block=(1, 16), rounding="stochastic",
                         generator=g)
    mean = q.dequantize(torch.float64).view(n, *x.shape).mean(0)
    rel = ((mean - x.double()).abs() / x.abs().double().clamp(min=1e-3)).mean()
    nearest = fp8pass.quantize(x, E4M3, granularity="block", block=(1, 16)).dequantize(torch.float64)
    rel_nearest = ((nearest - x.double()).abs() / x.abs().double().clamp(min=1e-3)).mean()
    assert rel < rel_nearest / 3
