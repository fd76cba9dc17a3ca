"""The plan's typed sites (``fp8pass.passes.plan``) and the one recipe-to-knobs builder per op family.

The rewriters read sites by field: a misspelt field is an AttributeError, never a silent None; the
NVFP4 recipe's protected linears are decided in the plan and listed in ``Plan.skipped``; the knob
builders give exactly the knobs the rewriters and ``fp8pass.ops`` passed before they were one.
"""

import dataclasses

import pytest
import torch

import fp8pass
from fp8pass import Config, CurrentScaling, DelayedScaling, HotChannelPatching, NVFP4Scaling
from fp8pass.op_schema import (
    GLUKnobs,
    GroupedGLUKnobs,
    GroupedLinearKnobs,
    LinearKnobs,
    NVFP4Knobs,
    smooth_knob,
)
from fp8pass.passes.plan import GLUSite, Plan, Projection, plan_graph
from fp8pass.testing.models import SiluMul, capture, tiny_titan_llama


def _plan(model, *inputs, cfg=None) -> Plan:
    (gm,) = capture(model, *inputs, fullgraph=True)
    return plan_graph(gm.graph, cfg or Config())


def test_sites_are_typed_records_and_a_misspelt_field_raises():
    assert [f.name for f in dataclasses.fields(Projection)] == [
        "call", "x", "w", "b", "fqn", "layout", "rows", "expert", "protection"]
    p = _plan(SiluMul(128, 256), torch.randn(2, 8, 128))
    (glu,) = p.sites
    assert isinstance(glu, GLUSite) and p.glus == [glu] and p.linears == []
    assert (glu.gate, glu.up, glu.down) == ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
    assert [q.call for q in glu.projections()] == [glu.gate_proj.call, glu.up_proj.call, glu.down_proj.call]
    assert glu.down_proj.layout == "out_in" and glu.gate_proj.rows is None and not glu.fused
    with pytest.raises(AttributeError):
        glu.down_proj.layot  # noqa: B018 - a typo of ``layout``
    with pytest.raises(AttributeError):
        glu.down_proj.layot = "in_out"  # slots: no new attribute is made up either
    with pytest.raises(AttributeError):
        glu.gate_w  # noqa: B018 - the old match key is no field


def _nvfp4_plan(**recipe) -> Plan:
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    return _plan(tiny_titan_llama(n_layers=2), tokens, cfg=Config(recipe=NVFP4Scaling(keep_last_blocks=1, **recipe)))


def test_plan_skipped_lists_the_nvfp4_protected_linears_with_their_reason():
    plan = _nvfp4_plan()
    block1 = [f"layers.1.{m}.weight" for m in ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                                               "feed_forward.w1", "feed_forward.w3", "feed_forward.w2")]
    post_qk = ["layers.0.attention.wv.weight", "layers.0.attention.wo.weight",
               "layers.1.attention.wv.weight", "layers.1.attention.wo.weight"]
    kept = {w: why for w, why in plan.skipped if "NVFP4Scaling" in why}
    assert sorted(kept) == sorted(set(block1) | set(post_qk))
    for w in post_qk:
        assert kept[w].startswith("post-QK protection (pattern ") and kept[w].endswith(": kept in high precision")
    for w in set(block1) - set(post_qk):
        assert kept[w] == ("last 1 of 2 blocks kept (NVFP4Scaling.keep_last_blocks/keep_last_fraction): "
                           "kept in high precision")
    # the projections carry the decision the NVFP4 rewriter follows
    projections = [q for s in plan.glus for q in s.projections()] + [s.proj for s in plan.linears]
    protected = {q.fqn for q in projections if q.protection is not None}
    assert protected == set(kept)
    assert all(q.protection.recipe is None for q in projections if q.protection is not None)


def test_protected_as_fp8_gets_a_current_scaling_recipe_in_the_plan():
    plan = _nvfp4_plan(protected_precision="fp8", hcp=HotChannelPatching())
    kept = [w for w, why in plan.skipped if why.endswith(": FP8 linear (current scaling)")]
    assert len(kept) == 9  # 2 post-QK of block 0 + 7 of the last block
    for s in plan.linears:
        if s.proj.protection is not None:
            assert s.proj.protection.recipe.cfg.recipe == CurrentScaling()


def test_protection_is_the_compiled_graph_and_explain_entries():
    """The report lists exactly the plan's protection entries, and the rewritten graph follows them."""
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    cfg = Config(recipe=NVFP4Scaling(keep_last_blocks=1, protected_precision="fp8"), compiler="aot_eager")
    rep = fp8pass.explain(tiny_titan_llama(n_layers=2), tokens, config=cfg)
    plan = _nvfp4_plan(protected_precision="fp8")
    planned = [e for e in plan.skipped if "NVFP4Scaling" in e[1]]
    assert [e for e in rep.skipped if "NVFP4Scaling" in e[1]] == planned
    assert rep.graph_after.count("fp8pass.fp8_linear") == len(planned)


# The knobs each recipe gave before the builders were one (rewrite_base.recipe_kwargs, ops._recipe_args,
# the grouped rewriter's subset, the NVFP4 arguments written out twice), spelled out.
@pytest.mark.parametrize("cfg,backward,expected", [
    (Config(), "fp8",
     LinearKnobs("e4m3", "e5m2", "tensor", 128, False, "stochastic", 0.0, 1, "max", None, True, "fp8")),
    (Config(recipe=DelayedScaling(margin=1, interval=4, algo="most_recent", power_of_two=True),
            grad_stochastic_rounding=False, fast_accum=False, fwd_format="e4m3_gaudi"), "high",
     LinearKnobs("e4m3_gaudi", "e5m2", "tensor", 128, True, "nearest", 1.0, 4, "most_recent", None, False, "high")),
    (Config(recipe=CurrentScaling(granularity="mx", block=32)), "fp8",
     LinearKnobs("e4m3", "e5m2", "mx", 32, False, "stochastic", 0.0, 1, "max", None, True, "fp8")),
    (Config(recipe=CurrentScaling(granularity="block", power_of_two=True)), "fp8",
     LinearKnobs("e4m3", "e5m2", "block", 128, True, "stochastic", 0.0, 1, "max", None, True, "fp8")),
])
def test_linear_knobs_from_config_are_the_knobs_of_before(cfg, backward, expected):
    assert LinearKnobs.from_config(cfg, backward) == expected
    assert LinearKnobs.from_config(cfg, backward, torch.bfloat16) == expected.replace(out_dtype=torch.bfloat16)
    # the eager API's path: recipe and formats given one by one
    rounding = "stochastic" if cfg.grad_stochastic_rounding else "nearest"
    assert LinearKnobs.from_recipe(cfg.recipe, cfg.fwd_format, cfg.bwd_format, rounding, cfg.fast_accum,
                                   backward) == expected


def test_grouped_glu_and_nvfp4_knobs_are_the_knobs_of_before():
    cfg = Config(recipe=DelayedScaling(margin=2, interval=3), smooth_swiglu=None, grad_stochastic_rounding=False)
    assert GroupedLinearKnobs.from_config(cfg, torch.float16) == GroupedLinearKnobs(
        "e4m3", "e5m2", False, "nearest", 2.0, 3, "max", torch.float16, True)
    assert GroupedGLUKnobs.from_config(cfg, None, "gelu") == GroupedGLUKnobs(
        "e4m3", "e5m2", False, "nearest", 2.0, 3, "max", None, True, "gelu", "none")
    assert GroupedGLUKnobs.from_config(Config(), None).smooth == "channel"
    lin = LinearKnobs.from_config(Config(smooth_swiglu="token"))
    assert GLUKnobs.from_linear(lin, "relu", "token", True, True) == GLUKnobs(
        *lin.args(), activation="relu", smooth="token", recast_weight=True, recompute_output=True)
    assert NVFP4Knobs.from_recipe(NVFP4Scaling()).args() == (True, True, 0, True, True, "split", False)
    hcp = HotChannelPatching(second_order=False, mode="concat", backward=True)
    assert NVFP4Knobs.from_recipe(NVFP4Scaling(rht=False, rht_seed=7, grad_stochastic_rounding=False,
                                               weight_2d=False, hcp=hcp)).args() == (
        False, False, 7, False, False, "concat", True)


def test_no_smoothing_is_none_for_users_and_none_string_only_in_the_op():
    assert smooth_knob(None) == "none" and smooth_knob("channel") == "channel" and smooth_knob("token") == "token"
    for bad in ("none", "row", ""):
        with pytest.raises(ValueError, match="None \\(no smoothing\\)"):
            smooth_knob(bad)
    x, w = torch.randn(4, 64), torch.randn(128, 64)
    with pytest.raises(ValueError, match="unknown smooth mode 'none'"):
        fp8pass.ops.swiglu_mlp(x, w, w, torch.randn(64, 128), smooth="none")
