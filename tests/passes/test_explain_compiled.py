"""explain / inspect on compiled models (issue 34) and the warning for a compile that made nothing FP8."""

import sys
import warnings

import pytest
import torch

import fp8pass
from fp8pass.train import ModelConfig, TinyLlama

CFG_KEEP_FIRST = fp8pass.Config(keep_high_precision=("lm_head", "*embed*", "layers.0.*"), compiler="eager")


def _tiny():
    torch.manual_seed(0)
    return TinyLlama(ModelConfig(d_model=32, n_layers=2, n_heads=2, ffn=64, max_seq_len=16))


IDS = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))


def _summary(report):
    return len(report.linears), len(report.swiglus), len(report.skipped), report.num_graphs


def test_explain_sees_the_same_plan_through_every_compile_form():
    """The plan of the model as built, of torch.compile's wrapper, of model.compile() in place and of
    per-block compiles (the FSDP recipe) is the same; the model's own compile is untouched afterwards."""
    plain = _summary(fp8pass.explain(_tiny(), IDS))
    assert plain[0] > 0 and plain[3] >= 1
    wrapped = torch.compile(_tiny(), backend="fp8")
    assert _summary(fp8pass.explain(wrapped, IDS)) == plain
    inplace = _tiny()
    inplace.compile(backend="fp8")
    impl = inplace._compiled_call_impl
    assert _summary(fp8pass.explain(inplace, IDS)) == plain
    assert inplace._compiled_call_impl is impl  # restored: the model still runs compiled
    per_block = _tiny()
    for block in per_block.layers:
        block.compile(backend="fp8")
    assert _summary(fp8pass.explain(per_block, IDS)) == plain
    assert all(b._compiled_call_impl is not None for b in per_block.layers)


def test_explain_plans_with_the_config_the_model_was_compiled_with():
    """Without config=, a model compiled with fp8pass.backend(cfg) is planned with cfg (its block 0 kept)."""
    for form in ("wrapper", "inplace"):
        model = _tiny()
        if form == "wrapper":
            model = torch.compile(model, backend=fp8pass.backend(CFG_KEEP_FIRST))
        else:
            model.compile(backend=fp8pass.backend(CFG_KEEP_FIRST))
        rep = fp8pass.explain(model, IDS)
        assert rep.config == CFG_KEEP_FIRST
        assert rep.linears and not any(w.startswith("layers.0.") for w in rep.linears)
        assert any(w.startswith("layers.0.") and "layers.0.*" in r for w, r in rep.skipped)


def test_explain_of_a_model_compiled_with_another_backend_says_so():
    rep = fp8pass.explain(torch.compile(_tiny()), IDS)
    assert rep.linears
    assert any("compiled with backend 'inductor', not fp8pass's" in n for n in rep.notes)
    assert "note: the model is compiled with backend 'inductor'" in str(rep)


def test_explain_says_what_to_pass_when_no_graph_was_captured():
    class Disabled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(32, 32)

        @torch.compiler.disable
        def forward(self, x):
            return self.lin(x)

    rep = fp8pass.explain(Disabled(), torch.randn(2, 32))
    assert rep.num_graphs == 0
    assert rep.notes == ["Dynamo captured no graph from Disabled: its code ran outside torch.compile (a "
                         "torch.compiler.disable'd forward, or a wrapper explain does not see through); pass the "
                         "model as you built it: fp8pass.explain(model, *example_inputs)"]


def test_explain_rejects_what_is_not_a_model():
    with pytest.raises(TypeError, match=r"takes the model \(an nn.Module, compiled or not\) or a function, got int"):
        fp8pass.explain(3, IDS)


def test_inspect_on_a_factory_that_returns_a_model_compiled_in_place(monkeypatch, capsys):
    from fp8pass.cli import main

    module = type(sys)("compiled_factory_for_test")

    def factory():
        model = _tiny()
        model.compile(backend="fp8")
        return model, (IDS,)

    module.make = factory
    monkeypatch.setitem(sys.modules, module.__name__, module)
    assert main(["inspect", f"{module.__name__}:make"]) == 0
    out = capsys.readouterr().out
    n = len(fp8pass.explain(_tiny(), IDS).linears)
    assert f"{n} FP8 linear weight(s)" in out and "0 graph(s)" not in out


def test_explain_under_the_integrations_recipes(tmp_path):
    """docs/integrations.md: the Trainer recipe (attach + model.compile in place, then Trainer) and the
    Accelerate recipe (then accelerator.prepare): explain on the prepared model has the plan of the
    model before compiling, and a tiny Mixtral's grouped experts are seen (no grouped_mm advice)."""
    transformers = pytest.importorskip("transformers")
    accelerate = pytest.importorskip("accelerate")
    from fp8pass.checkpoint import attach
    from fp8pass.report.report import OUTSIDE_GRAPHS

    def llama():
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2))

    ids = torch.randint(0, 64, (1, 8))
    before = _summary(fp8pass.explain(llama(), ids))
    cfg = fp8pass.Config()
    model = llama()
    attach(model, cfg)
    model.compile(backend=fp8pass.backend(cfg))
    trainer = transformers.Trainer(model=model, args=transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1))
    assert _summary(fp8pass.explain(trainer.model, ids)) == before
    prepared = accelerate.Accelerator(cpu=True).prepare(model)
    assert _summary(fp8pass.explain(prepared, ids)) == before

    from fp8pass.testing import hf_zoo as Z

    moe = Z.build("Mixtral", layers=1, experts_impl="grouped_mm")
    moe.compile(backend="fp8")
    rep = fp8pass.explain(moe, Z.ids(1, 8))
    assert len(rep.experts) == 1 and not any(r == OUTSIDE_GRAPHS for _, r in rep.skipped)


class _TooSmall(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class _NoLinear(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x) * 2


class _BreakBeforeLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(32, 32)

    def forward(self, x):
        x = torch.relu(x)
        torch._dynamo.graph_break()  # the first graph has no linear; the second one is FP8
        return self.lin(x)


def _warnings_of_three_calls(model, x):
    compiled = torch.compile(model, backend=fp8pass.backend(fp8pass.Config(compiler="eager")))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            compiled(x)
    return [str(w.message) for w in caught if "none of its graphs holds an FP8 op" in str(w.message)]


def test_a_compile_that_makes_nothing_fp8_warns_once_with_the_plans_reasons():
    torch._dynamo.reset()
    assert _warnings_of_three_calls(_TooSmall(), torch.randn(4, 8)) == [
        "fp8pass: _TooSmall was compiled with the fp8 backend, but none of its graphs holds an FP8 op, so it runs "
        "in high precision. The plan kept all 2 linear op(s): a.weight: weight (8, 8) has a dim below min_dim=16; "
        "b.weight: weight (8, 8) has a dim below min_dim=16. fp8pass.explain(model, *inputs) prints the whole plan."]
    (msg,) = _warnings_of_three_calls(_NoLinear(), torch.randn(4, 8))
    assert msg.startswith("fp8pass: _NoLinear was compiled") and "hold no linear op the backend converts" in msg


def test_no_warning_when_another_graph_of_the_model_is_fp8():
    torch._dynamo.reset()
    assert _warnings_of_three_calls(_BreakBeforeLinear(), torch.randn(4, 32)) == []


def test_oversubscription_hint_only_where_other_jobs_load_the_cores():
    from fp8pass.compile_backend import oversubscription_hint

    assert oversubscription_hint(2, 2, 4.3) == (
        "fp8pass: torch runs 2 threads on 2 CPU core(s) that other jobs already load (load average 4.3); its "
        "threads then wait on each other, and FP8 steps ran 10-20x slower than with one thread on such a machine. "
        "Call torch.set_num_threads(1) (or at most the number of idle cores) before training (docs/backend.md, "
        "Threads on a shared CPU).")
    assert oversubscription_hint(1, 2, 8.0) is None     # one thread: nothing to wait on
    assert oversubscription_hint(2, 2, 1.0) is None     # the load is the compile itself
    assert oversubscription_hint(4, 16, 3.0) is None    # cores to spare


def test_the_first_cpu_compile_hints_once(monkeypatch):
    import fp8pass.compile_backend as cb

    monkeypatch.setattr(cb, "_THREADS_CHECKED", False)
    monkeypatch.setattr(cb, "_cpu_threads_cores_load", lambda: (2, 2, 6.0))
    torch._dynamo.reset()
    compiled = torch.compile(torch.nn.Linear(32, 32), backend=fp8pass.backend(fp8pass.Config(compiler="eager")))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(torch.randn(4, 32))
        other = torch.compile(torch.nn.Linear(64, 64), backend=fp8pass.backend(fp8pass.Config(compiler="eager")))
        other(torch.randn(4, 64))  # a second compile in the process: checked once only
    hints = [str(w.message) for w in caught if "torch runs 2 threads" in str(w.message)]
    assert len(hints) == 1 and "load average 6.0" in hints[0]
