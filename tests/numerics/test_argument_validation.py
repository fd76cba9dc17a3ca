"""Public arguments that were accepted silently or failed obscurely (issue 33, item 7): each error names
the argument, the value and what is allowed; oversized block tiles are clamped (same result, bounded
memory); empty tensors have a documented result."""

import math

import pytest
import torch

import fp8pass
from fp8pass import Config, CurrentScaling, DelayedScaling, HotChannelPatching, NVFP4Scaling, quantize


@pytest.mark.parametrize("make,message", [
    (lambda: DelayedScaling(margin=float("nan")), r"DelayedScaling\.margin must be a number in \[0, 64\].*got nan"),
    (lambda: DelayedScaling(margin=1000), r"DelayedScaling\.margin must be a number in \[0, 64\].*got 1000"),
    (lambda: DelayedScaling(margin=-1), r"DelayedScaling\.margin .*got -1"),
    (lambda: DelayedScaling(history_len=16.0), r"DelayedScaling\.history_len must be an int >= 1, got 16\.0"),
    (lambda: DelayedScaling(history_len=True), r"DelayedScaling\.history_len must be an int >= 1, got True"),
    (lambda: DelayedScaling(history_len=None), r"DelayedScaling\.history_len must be an int >= 1, got None"),
    (lambda: DelayedScaling(interval=0), r"DelayedScaling\.interval must be an int >= 1, got 0"),
    (lambda: DelayedScaling(power_of_two="no"), r"DelayedScaling\.power_of_two must be True or False, got 'no'"),
    (lambda: CurrentScaling(power_of_two="no"), r"CurrentScaling\.power_of_two must be True or False, got 'no'"),
    (lambda: CurrentScaling(block="128"), r"CurrentScaling\.block must be an int >= 1 \(the tile edge\), got '128'"),
    (lambda: CurrentScaling(block=0), r"CurrentScaling\.block must be an int >= 1"),
    (lambda: Config(grad_stochastic_rounding="no"), r"Config\.grad_stochastic_rounding must be True or False, got 'no'"),
    (lambda: Config(amax_reduction=3), r"Config\.amax_reduction must be 'auto', 'off' or a torch\.distributed\."
                                       r"ProcessGroup, got 3"),
    (lambda: Config(min_dim="abc"), r"Config\.min_dim must be an int >= 1, got 'abc'"),
    (lambda: Config(min_dim=None), r"Config\.min_dim must be an int >= 1, got None"),
    (lambda: Config(dim_multiple=16.5), r"Config\.dim_multiple must be an int >= 1, got 16\.5"),
    (lambda: Config(keep_high_precision=None), r"Config\.keep_high_precision must be FQN glob strings .*got None"),
    (lambda: HotChannelPatching(decay=1.0), r"HotChannelPatching\.decay must be a number in \[0, 1\), got 1\.0"),
    (lambda: HotChannelPatching(fraction=float("nan")), r"HotChannelPatching\.fraction must be a number in \[0, 1\]"),
    (lambda: HotChannelPatching(backward="yes"), r"HotChannelPatching\.backward must be True or False"),
    (lambda: NVFP4Scaling(rht="no"), r"NVFP4Scaling\.rht must be True or False, got 'no'"),
    (lambda: NVFP4Scaling(keep_last_blocks=2.5), r"NVFP4Scaling\.keep_last_blocks must be an int >= 0 or None"),
])
def test_bad_recipe_and_config_arguments_are_named(make, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make()


def test_valid_arguments_still_construct():
    """The control of the cases above: the same fields with allowed values."""
    assert DelayedScaling(margin=1, history_len=4, interval=2, power_of_two=True).margin == 1
    assert CurrentScaling(block=64, power_of_two=True).block == 64
    assert Config(grad_stochastic_rounding=False, amax_reduction="off", min_dim=1, keep_high_precision=()).min_dim == 1
    assert NVFP4Scaling(keep_last_blocks=None, hcp=HotChannelPatching(decay=0.5)).hcp.decay == 0.5


@pytest.mark.parametrize("scale", [0.0, float("nan"), float("inf"), -1.0, torch.tensor(0.0)])
def test_a_given_scale_must_be_finite_and_positive(scale):
    with pytest.raises(ValueError, match=r"quantize: scale must be finite and > 0 \(codes = x \* scale\), got "):
        quantize(torch.randn(4, 8), "e4m3", scale=scale)


def test_one_bad_entry_of_a_row_scale_is_reported():
    with pytest.raises(ValueError, match=r"got nan in a scale of shape \(4,\)"):
        quantize(torch.randn(4, 8), "e4m3", scale=torch.tensor([1.0, 2.0, float("nan"), 1.0]), granularity="row")


@pytest.mark.parametrize("block", [(1, 2**20), 10**9, (2**20, 2**20)])
def test_a_block_larger_than_the_tensor_is_clamped_with_the_same_result(block):
    """Unclamped, (1, 2**20) on 64x64 padded to +519 MB and 10**9 tried 256 GB."""
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    whole = (64, 64) if isinstance(block, tuple) and block[0] > 1 else (1, 64)
    want = quantize(x, "e4m3", granularity="block", block=whole)
    got = quantize(x, "e4m3", granularity="block", block=block)
    assert got.block == whole and got.scale.shape == want.scale.shape
    assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8)) and torch.equal(got.scale, want.scale)
    assert torch.equal(got.dequantize(), want.dequantize())


@pytest.mark.parametrize("shape", [(0,), (4, 0), (2, 3, 0)])
def test_row_granularity_of_empty_rows_gives_empty_codes_and_unit_scales(shape):
    q = quantize(torch.zeros(shape), "e4m3", granularity="row")
    assert q.data.shape == shape and q.dequantize().shape == shape
    assert q.scale.shape == (*shape[:-1], 1) and bool((q.scale == 1).all())
    assert math.prod(shape) == 0


def test_config_with_a_real_process_group_type_is_accepted(monkeypatch):
    import sys
    import types

    class FakeGroup:
        pass

    monkeypatch.setitem(sys.modules, "torch.distributed", types.SimpleNamespace(ProcessGroup=FakeGroup))
    assert isinstance(Config(amax_reduction=FakeGroup()).amax_reduction, FakeGroup)
    assert fp8pass.Config().amax_reduction == "auto"
