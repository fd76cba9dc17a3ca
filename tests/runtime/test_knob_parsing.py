"""The ops' knobs are built and validated once per distinct tuple (op_schema.Knobs.of), and a bad
tuple still raises on every call."""

import pytest
import torch

import fp8pass  # noqa: F401  (registers the ops)
from fp8pass import op_schema
from fp8pass.op_schema import GLUKnobs, LinearKnobs
from fp8pass.runtime.linear import knobs_of

GOOD = ("e4m3", "e5m2", "tensor", 128, False, "nearest", 0.0, 1, "max", torch.bfloat16, True, "fp8")


def test_of_builds_once_per_tuple():
    k = knobs_of(GOOD)
    assert k == LinearKnobs(*GOOD)
    assert knobs_of(tuple(GOOD)) is k  # an equal tuple: the same instance, no rebuild
    assert LinearKnobs.take((torch.zeros(1), None, *GOOD)) is k
    assert k.args() == GOOD
    other = knobs_of(GOOD[:-3] + (torch.float32, True, "fp8"))
    assert other is not k and other.out_dtype == torch.float32
    # another Knobs class with a prefix of equal values is never confused with a LinearKnobs
    glu = GLUKnobs.of(GOOD + ("silu", "channel", True))
    assert type(glu) is GLUKnobs and glu.args() == GOOD + ("silu", "channel", True, False)
    assert LinearKnobs.count() == 12 and GLUKnobs.count() == 16
    assert GLUKnobs.no_grads() == (None,) * 16
    assert GLUKnobs(*GOOD, "silu", "channel").recast_weight is False  # the default: W_down's codes kept
    assert GLUKnobs(*GOOD, "silu", "channel").recompute_output is False  # the default: A's codes kept


@pytest.mark.parametrize("field, value, error", [(2, "bogus", ValueError), (3, 0, ValueError),
                                                 (5, "sometimes", ValueError), (8, "median", ValueError),
                                                 (0, "e9m9", ValueError), (11, "bf16", ValueError)])
def test_bad_knobs_raise_on_every_call(field, value, error):
    bad = GOOD[:field] + (value,) + GOOD[field + 1:]
    before = len(op_schema._MADE)
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    for _ in range(2):  # not cached after the first failure
        with pytest.raises(error):
            knobs_of(bad)
        with pytest.raises(error):
            torch.ops.fp8pass.fp8_cast_input(x, [], *bad)
    assert len(op_schema._MADE) == before


def test_fast_accum_must_be_a_bool():
    bad = GOOD[:10] + ("yes",)
    with pytest.raises(TypeError, match="fast_accum must be True or False, got 'yes'"):
        knobs_of(bad)
    with pytest.raises(RuntimeError, match="Expected a value of type 'bool' for argument 'fast_accum'"):
        torch.ops.fp8pass.fp8_cast_input(torch.randn(4, 8), [], *bad)  # the schema refuses it first
