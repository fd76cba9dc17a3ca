"""Per-module precision rules (``Config.rules``, ``fp8pass.Rule``, ``fp8pass.load_rules``) and the
backward override (``Rule(backward="high")``): issue 30 items 1 and 2.

Rules: the first matching rule decides each linear, keep_high_precision / keep_last_layers still keep
theirs, files load to the same rules, bad rules fail naming the rule, explain names the deciding rule
per linear. Backward override: with the identity format in the forward the gradients are bit for bit
those of the high-precision backward; with an FP8 forward the dgrad and wgrad GEMMs are not FP8 GEMMs
(the CUDA code path on CPU, ``FP8PASS_KERNELS=triton``, records every ``torch._scaled_mm``).
"""

import json
import re
import warnings

import pytest
import torch

import fp8pass
from benchmarks import gpu_launches as gl
from fp8pass import Config, CurrentScaling, DelayedScaling, Rule
from fp8pass.testing.models import tiny_titan_llama

TOKENS = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))

# "NVFP4 everywhere but ..." in the FP8 flavours this tiny model takes: first match wins
RULES = [
    Rule("layers.0.attention.wo", "high"),
    Rule("layers.0.*", "blockwise"),
    Rule("*.wo", "mxfp8"),
    Rule("*", "delayed", backward="high"),
]


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setenv("FP8PASS_CPU_FUSED", "0")  # the runtime's eager casts: same bits, no compile
    torch._dynamo.reset()


def _explain(rules, **kw):
    return fp8pass.explain(tiny_titan_llama(), TOKENS, config=Config(compiler="aot_eager", rules=rules, **kw))


def _kwargs_of(graph_code: str, op: str) -> list[str]:
    """The granularity and backward knobs of every call of ``op`` in a rewritten graph's code."""
    calls = re.findall(rf"torch\.ops\.fp8pass\.{op}\.default\(([^\n]*)\)", graph_code)
    knob = {name: re.compile(rf"{name} = '(\w+)'") for name in ("granularity", "backward")}
    return ["/".join(knob[n].search(c).group(1) for n in ("granularity", "backward")) for c in calls]


def test_first_matching_rule_decides_each_linear():
    rep = _explain(RULES)
    by = {f.rsplit(".weight", 1)[0]: d for f, d in rep.decided_by.items()}
    rule = {k: re.search(r"\((rules\[\d\])", v).group(1) for k, v in by.items()}
    assert rule == {
        # layers.0.* before "*.wo" and "*": blockwise, GLU included (one recipe for its three projections)
        **{f"layers.0.{m}": "rules[1]" for m in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1",
                                                 "feed_forward.w2", "feed_forward.w3")},
        "layers.1.attention.wo": "rules[2]",
        **{f"layers.1.{m}": "rules[3]" for m in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1",
                                                 "feed_forward.w2", "feed_forward.w3")},
    }
    assert by["layers.0.attention.wq"].startswith("FP8 current per block e4m3/e4m3 (")
    assert by["layers.0.feed_forward.w2"].startswith("FP8 current per block e4m3/e4m3, Smooth-SwiGLU off (")
    assert by["layers.1.attention.wo"].startswith("FP8 current per mx e4m3/e4m3 (")
    assert by["layers.1.attention.wq"].startswith("FP8 delayed e4m3/e5m2, backward high (")
    # the "high" rule keeps the first block's wo; keep_high_precision keeps the LM head whatever the rules say
    skipped = dict(rep.skipped)
    assert skipped["layers.0.attention.wo.weight"] == "kept in high precision by rules[0] 'layers.0.attention.wo' -> high"
    assert skipped["output.weight"] == "kept in high precision by keep_high_precision pattern 'output'"
    # the rewritten graph runs what explain says: the ops' knobs per site
    code = rep.graph_after
    linears = sorted(_kwargs_of(code, "fp8_linear") + _kwargs_of(code, "fp8_linear_precast"))
    assert linears == sorted(["block/fp8"] * 5 + ["mx/fp8"] + ["tensor/high"] * 5)  # GLU gates/ups and q/k/v
    assert sorted(_kwargs_of(code, "swiglu_down")) == ["block/fp8", "tensor/high"]
    # each rule's own recipe: the delayed sites record with the named recipe's history (one batched record)
    assert code.count("fp8pass.delayed_record_many_.default") == 1


def test_keep_rules_still_apply_before_rules():
    rep = _explain([Rule("*", "paper")], keep_last_layers=1)
    skipped = dict(rep.skipped)
    assert skipped["layers.1.attention.wq.weight"] == "kept in high precision: block 2 of 2, keep_last_layers=1"
    assert "keep_high_precision" in skipped["output.weight"]
    assert sorted(rep.decided_by) == sorted(f"layers.0.{m}.weight" for m in (
        "attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1", "feed_forward.w2",
        "feed_forward.w3"))
    # without rules, explain keeps its plain list (no column)
    plain = str(_explain([]))
    assert "by rule" not in plain and "FP8 linears (weight FQN):" in plain


def test_explain_prints_the_deciding_rule_per_linear():
    text = str(_explain(RULES))
    assert "FP8 / NVFP4 linears, by rule (Config.rules, first match wins):" in text
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("layers.1.attention.wo.weight"))
    assert line.split(None, 1)[1] == "FP8 current per mx e4m3/e4m3 (rules[2] '*.wo' -> mxfp8)"


def test_rules_with_nvfp4_and_fp8_in_one_graph_run():
    """NVFP4 for the MLPs, FP8 for attention, in one compiled graph: both ops, each its state."""
    model = tiny_titan_llama()
    cfg = Config(compiler="aot_eager", grad_stochastic_rounding=False,
                 rules=[Rule("*.feed_forward.*", fp8pass.NVFP4Scaling(keep_last_blocks=0, protect_post_qk=False)),
                        Rule("*", CurrentScaling())])
    be = fp8pass.backend(cfg)
    torch.compile(model, backend=be)(TOKENS).float().pow(2).sum().backward()
    code = be.records[0].report.graph_after
    assert code.count("fp8pass.nvfp4_linear.default") == 6
    assert len(_kwargs_of(code, "fp8_linear") + _kwargs_of(code, "fp8_linear_precast")) == 8
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


TOML = """
# first match wins
[[rules]]
pattern = "layers.0.attention.wo"
recipe = "high"

[[rules]]
pattern = "layers.0.*"
recipe = "blockwise"

[[rules]]
pattern = "*.wo"
recipe = { name = "paper", smooth_swiglu = "none", fwd_format = "e4m3_gaudi" }

[[rules]]
pattern = "*"
recipe = "delayed"
backward = "high"
"""


def _file_rules():
    return [RULES[0], RULES[1], Rule("*.wo", Config.from_recipe("paper", smooth_swiglu=None, fwd_format="e4m3_gaudi")),
            RULES[3]]


def test_rules_load_from_toml_and_json(tmp_path):
    toml = tmp_path / "precision.toml"
    toml.write_text(TOML)
    data = {"rules": [{"pattern": "layers.0.attention.wo", "recipe": "high"},
                      {"pattern": "layers.0.*", "recipe": "blockwise"},
                      {"pattern": "*.wo", "recipe": {"name": "paper", "smooth_swiglu": None, "fwd_format": "e4m3_gaudi"}},
                      {"pattern": "*", "recipe": "delayed", "backward": "high"}]}
    js = tmp_path / "precision.json"
    js.write_text(json.dumps(data, indent=2))
    assert fp8pass.load_rules(toml) == _file_rules()
    assert fp8pass.load_rules(js) == _file_rules()
    # the rule's recipe object carries its formats and Smooth-SwiGLU mode into its linears
    site = fp8pass.load_rules(toml)[2].site_config(Config())
    assert (site.fwd_format, site.smooth_swiglu, site.grad_stochastic_rounding) == ("e4m3_gaudi", None, True)


@pytest.mark.parametrize("text,suffix,message", [
    ('[[rules]]\npattern = "*"\nrecipe = "fp9"\n', ".toml",
     r"rules\[0\] \(line 1\): Rule\('\*'\): unknown recipe 'fp9'; valid: 'high' or a named recipe"),
    ('[[rules]]\npattern = "a"\nrecipe = "high"\n\n[[rules]]\npattern = "*"\nrecipe = "paper"\nbackwards = "high"\n',
     ".toml", r"rules\[1\] \(line 5\): unknown field\(s\) backwards"),
    ('[[rules]]\npattern = "*"\nrecipe = { name = "paper", fwd_formt = "e4m3" }\n', ".toml",
     r"rules\[0\] \(line 1\): recipe table: unknown field\(s\) fwd_formt"),
    ('[[rules]]\npattern = "*"\nrecipe = "nvfp4"\nbackward = "high"\n', ".toml", r"backward='high' is for FP8 recipes"),
    ('[[rules]]\npattern = "*"\n', ".toml", r"rules\[0\] \(line 1\): missing field 'recipe'"),
    ('[[rules]\npattern = "*"\n', ".toml", r"not valid TOML: .*line 1"),
    ('{"rules": [{"pattern": "*", "recipe": "high"},]}', ".json", r"not valid JSON: .*line 1"),
    ('{"rule": []}', ".json", r"the file holds 'rules' \(a list of rule tables\) and/or 'switch'"),
    ('{"rules": [{"pattern": "*", "recipe": "high", "backward": "bf16"}]}', ".json",
     r"rules\[0\]: unknown Rule\('\*'\)\.backward 'bf16'; valid: fp8, high"),
    ('rules: []', ".yaml", r"unknown file type '\.yaml'; use \.toml or \.json"),
])
def test_bad_rule_files_name_the_rule_and_field(tmp_path, text, suffix, message):
    path = tmp_path / f"bad{suffix}"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        fp8pass.load_rules(path)


def test_bad_rules_fail_when_made():
    with pytest.raises(ValueError, match=r"unknown recipe 'fp4'; valid: 'high' or a named recipe \(paper, "):
        Rule("*", "fp4")
    with pytest.raises(TypeError, match=r"Config.rules\[1\] must be an fp8pass.Rule"):
        Config(rules=[Rule("*", "high"), ("*.wo", "paper")])
    with pytest.raises(TypeError, match="recipe must be 'high', a named recipe name"):
        Rule("*", 8)


def test_a_rule_matching_nothing_warns_naming_it():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rep = _explain([Rule("*.o_proj", "high"), Rule("layers.*", "paper")])
    msgs = [str(w.message) for w in caught if "Config.rules" in str(w.message)]
    assert msgs == ["fp8pass: Config.rules pattern '*.o_proj' matches no module or parameter of TitanLlama (its "
                    "FQNs look like 'layers.0.attention.wq'); the rule decides nothing"]
    assert len(rep.decided_by) == 14  # the matching rule still decides every block linear


# --- backward override ------------------------------------------------------------------------------------


def _grads(cfg):
    torch._dynamo.reset()
    model = tiny_titan_llama()
    be = fp8pass.backend(cfg)
    torch.compile(model, backend=be)(TOKENS).float().pow(2).sum().backward()
    return [p.grad.clone() for p in model.parameters()], be.report()  # before a reset clears the records


def test_backward_high_is_the_high_precision_backward_bit_for_bit():
    """Identity forward: ``backward="high"`` with an E5M2 gradient format gives exactly the gradients of
    the high-precision backward (the same ops with the identity gradient format), GLUs included."""
    base = dict(compiler="aot_eager", fwd_format="identity", grad_stochastic_rounding=False,
                recipe=CurrentScaling())
    ref, _ = _grads(Config(bwd_format="identity", **base))
    high, rep = _grads(Config(bwd_format="e5m2", rules=[Rule("*", CurrentScaling(), backward="high")], **base))
    fp8, _ = _grads(Config(bwd_format="e5m2", **base))
    assert len(rep.decided_by) == 14 and all("backward high" in d for d in rep.decided_by.values())
    assert all(torch.equal(a, b) for a, b in zip(high, ref))
    assert not all(torch.equal(a, b) for a, b in zip(fp8, ref))  # E5M2 gradients do differ
    # and the high-precision backward is eager's within the identity tests' bound
    model = tiny_titan_llama()
    model(TOKENS).float().pow(2).sum().backward()
    for a, p in zip(high, model.parameters()):
        assert (a - p.grad).abs().max() <= 1e-5 * max(1.0, p.grad.abs().max())


@pytest.mark.parametrize("recipe", [CurrentScaling(), DelayedScaling()], ids=["current", "delayed"])
def test_backward_high_runs_no_fp8_gradient_gemm(monkeypatch, recipe):
    """FP8 forward, CUDA code path: the forward GEMMs are ``_scaled_mm``; the dgrad and wgrad GEMMs of
    the ``backward="high"`` linear are not (those of the other linear are)."""
    monkeypatch.setenv("FP8PASS_KERNELS", "triton")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
    x = torch.randn(16, 32)

    def gemms(rules):
        torch._dynamo.reset()
        cfg = Config(recipe=recipe, compiler="aot_eager", grad_stochastic_rounding=False, rules=rules)
        cm = torch.compile(model, backend=fp8pass.backend(cfg))
        with gl.pretend_cuda_gemms() as calls:
            y = cm(x)
            forward = len(calls)
            y.sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        return forward, len(calls) - forward, grads

    f_fp8, b_fp8, g_fp8 = gemms([])
    f_high, b_high, g_high = gemms([Rule("2", recipe, backward="high")])
    assert (f_fp8, b_fp8) == (2, 4)
    assert (f_high, b_high) == (2, 2)  # dgrad and wgrad of layer 0 only
    assert not torch.equal(g_fp8[2], g_high[2])  # layer 2's wgrad: not the E5M2 one


def test_backward_high_op_is_the_dequantized_gradient():
    """``ops.fp8_linear(backward="high")``: dx = dy W_q and dW = dy^T x_q with x_q, W_q the forward's
    dequantized operands, dy as it is (current scaling, per tensor, fp32)."""
    torch.manual_seed(0)
    x = torch.randn(8, 32, requires_grad=True)
    w = torch.randn(16, 32, requires_grad=True)
    dy = torch.randn(8, 16)
    fp8pass.ops.fp8_linear(x, w, backward="high").backward(dy)
    q = fp8pass.quantize
    xq, wq = q(x.detach(), fp8pass.E4M3).dequantize(), q(w.detach(), fp8pass.E4M3).dequantize()
    torch.testing.assert_close(x.grad, dy @ wq, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w.grad, dy.t() @ xq, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="unknown backward 'bf16'; valid: fp8, high"):
        fp8pass.ops.fp8_linear(x, w, backward="bf16")


def test_each_rule_keeps_its_own_scaling_state():
    """A ``"delayed"`` rule (Transformer Engine's 1024-entry histories) beside ``DelayedScaling()`` (16) in
    one graph: each weight's state is made with its site's recipe, and both record every step."""
    model = tiny_titan_llama()
    cfg = Config(compiler="aot_eager", rules=[Rule("layers.0.*", "delayed")])
    cm = torch.compile(model, backend=fp8pass.backend(cfg))
    for _ in range(2):
        cm(TOKENS).float().pow(2).sum().backward()
    sd = fp8pass.scaling_state_dict(model)
    hist = {k.split(".input.")[0]: v for k, v in sd.items() if k.endswith(".input.amax_history")}
    assert {k: tuple(v.shape) for k, v in hist.items() if k.endswith("attention.wq.weight")} == {
        "layers.0.attention.wq.weight": (1024,), "layers.1.attention.wq.weight": (16,)}
    for name, h in hist.items():  # two forward records each, newest first
        assert int((h != 0).sum()) == 2, name


def test_train_precision_config_flag(tmp_path, capsys):
    import argparse

    from fp8pass.cli import main
    from fp8pass.train.cli import _config_from_args, add_train_parser
    from fp8pass.train.loop import TrainConfig
    from fp8pass.train.recipes import fp8_config, get_recipe

    path = tmp_path / "precision.toml"
    path.write_text(TOML)
    parser = argparse.ArgumentParser()
    add_train_parser(parser.add_subparsers())
    args = parser.parse_args(["train", "--recipe", "paper", "--precision-config", str(path)])
    cfg = _config_from_args(args, "paper", tmp_path / "run")
    assert fp8_config(get_recipe("paper"), rules=cfg.fp8_rules()).rules == tuple(_file_rules())
    # the run's saved config carries the rules themselves: a resume needs no file
    path.unlink()
    assert TrainConfig.from_dict(cfg.to_dict()).fp8_rules() == tuple(_file_rules())
    bad = tmp_path / "bad.json"
    bad.write_text('{"rules": [{"pattern": "*", "recipe": "fp9"}]}')
    assert main(["train", "--recipe", "paper", "--precision-config", str(bad), "--out", str(tmp_path)]) == 2
    assert f"error: {bad}: rules[0]: Rule('*'): unknown recipe 'fp9'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="precision rules apply to the fp8 recipes; recipe 'bf16'"):
        TrainConfig(recipe="bf16", precision_rules=[{"pattern": "*", "recipe": "paper"}])


def test_rule_state_round_trips_through_state_dict():
    """``fp8pass.checkpoint.attach(model, cfg)`` with rules makes each module's state with its rule's recipe,
    so a state dict holding 1024- and 16-entry histories loads into a fresh model (a resume)."""
    from fp8pass.checkpoint import attach

    cfg = Config(compiler="aot_eager", rules=[Rule("layers.0.*", "delayed")])
    model = tiny_titan_llama()
    torch.compile(model, backend=fp8pass.backend(cfg))(TOKENS).float().pow(2).sum().backward()
    saved = model.state_dict()
    fresh = attach(tiny_titan_llama(), cfg)
    fresh.load_state_dict(saved)
    a, b = fp8pass.scaling_state_dict(model), fp8pass.scaling_state_dict(fresh)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert tuple(b["layers.0.attention.wq.weight.input.amax_history"].shape) == (1024,)
