"""The runtime precision audit (issue 30 item 5): ``fp8pass.monitor.precision_audit(model)``, one record
per GEMM; ``Config(on_fallback=...)``; the FSDP2 all-gather records.

The CUDA code path runs on CPU (``FP8PASS_KERNELS=triton``) with ``benchmarks/gpu_launches.pretend_cuda_gemms``,
which routes the GEMMs to ``torch._scaled_mm`` as on a GPU and lists the calls: the audit is checked against
the GEMMs that really ran there.
"""

import warnings

import pytest
import torch

import fp8pass
from benchmarks import gpu_launches as gl
from fp8pass import Config, CurrentScaling, DelayedScaling, Rule
from fp8pass.kernels import cuda
from fp8pass.monitor import audit_summary, audit_version, collective_audit, precision_audit
from fp8pass.testing.models import tiny_titan_llama

TOKENS = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
CPU_FP8 = "cpu emulation: float32 GEMM of FP8 codes"  # fp32 model: fp32 GEMMs of the codes


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setenv("FP8PASS_CPU_FUSED", "0")  # the runtime's eager casts: same bits, no compile
    torch._dynamo.reset()


def _by_weight(records):
    out = {}
    for r in records:
        out.setdefault(r.weight, {})[r.gemm] = (r.precision, r.operands, r.kernel, r.fallback)
    return out


def test_audit_of_a_tiny_model_names_every_gemm_of_every_matmul_weight():
    model = tiny_titan_llama()
    rules = [Rule("layers.0.attention.wo", "high"), Rule("layers.0.*", "blockwise"), Rule("*.wo", "mxfp8"),
             Rule("*", "delayed", backward="high")]
    cm = torch.compile(model, backend=fp8pass.backend(Config(compiler="aot_eager", rules=rules)))
    assert precision_audit(cm) == [] and audit_version(cm) == 0
    cm(TOKENS).float().pow(2).sum().backward()
    got = _by_weight(precision_audit(cm))
    matmul_weights = [n for n, p in model.named_parameters() if p.dim() == 2 and n != "tok_embeddings.weight"]
    assert sorted(got) == sorted(matmul_weights) and len(precision_audit(cm)) == 3 * 15
    kept = ("high", "", "as the model computes it (not rewritten)", None)
    block = "fp32 matmul of dequantized operands (per-block scales)"
    e4 = "e4m3 x e4m3"  # blockwise and MXFP8: E4M3 for all tensors
    mx = ("mxfp8", e4, "float32 matmul of dequantized MX operands", None)
    expected = {"output.weight": (kept, kept, kept), "layers.0.attention.wo.weight": (kept, kept, kept),
                "layers.1.attention.wo.weight": (mx, mx, mx)}
    for w in ("wq", "wk", "wv"):
        expected[f"layers.0.attention.{w}.weight"] = (("fp8", e4, block, None),) * 3
        expected[f"layers.1.attention.{w}.weight"] = (("fp8", e4, CPU_FP8, None),
                                                      ("high", "float32", "float32 matmul", None),
                                                      ("high", "float32", "float32 matmul", None))
    for w in ("w1", "w2", "w3"):
        expected[f"layers.0.feed_forward.{w}.weight"] = expected["layers.0.attention.wq.weight"]
        expected[f"layers.1.feed_forward.{w}.weight"] = expected["layers.1.attention.wq.weight"]
    assert {w: tuple(got[w][g] for g in ("forward", "dgrad", "wgrad")) for w in got} == expected
    records = {(r.weight, r.gemm): r for r in precision_audit(cm)}
    assert records["output.weight", "forward"].decided_by.startswith("kept in high precision by keep_high_precision")
    assert records["layers.0.attention.wo.weight", "dgrad"].decided_by.startswith("kept in high precision by rules[0]")
    assert records["layers.1.feed_forward.w2.weight", "wgrad"].op == "swiglu_down"
    assert "backward high (rules[3]" in records["layers.1.attention.wq.weight", "forward"].decided_by
    # the same records for the module itself, and one version after the (single) compile
    assert precision_audit(model) == precision_audit(cm) and audit_version(model) == 1
    assert audit_summary(precision_audit(cm))[f"forward fp8 {CPU_FP8}"] == 6


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))


def _step_on_the_cuda_path(model, cfg):
    """One compiled step on the CUDA code path; returns the ``torch._scaled_mm`` calls made in it."""
    cm = torch.compile(model, backend=fp8pass.backend(cfg))
    with gl.pretend_cuda_gemms() as calls:
        cm(torch.randn(16, 32)).sum().backward()
    return cm, [name for name, _ in calls]


@pytest.mark.parametrize("recipe", [CurrentScaling(), DelayedScaling()], ids=["current", "delayed"])
def test_backward_high_gradient_gemms_run_in_high_precision_per_the_audit(monkeypatch, recipe):
    """FP8 forward with ``backward="high"``: the audit says the dgrad and wgrad GEMMs are high precision
    and the forward ``torch._scaled_mm``, and that is what ran (the calls on the CUDA code path)."""
    monkeypatch.setenv("FP8PASS_KERNELS", "triton")
    model = _mlp()
    cfg = Config(recipe=recipe, compiler="aot_eager", grad_stochastic_rounding=False,
                 rules=[Rule("2", recipe, backward="high")])
    cm, calls = _step_on_the_cuda_path(model, cfg)
    got = _by_weight(precision_audit(cm))
    assert got["2.weight"] == {"forward": ("fp8", "e4m3 x e4m3", "torch._scaled_mm", None),
                               "dgrad": ("high", "float32", "fp32 matmul", None),
                               "wgrad": ("high", "float32", "fp32 matmul", None)}
    assert got["0.weight"] == {"forward": ("fp8", "e4m3 x e4m3", "torch._scaled_mm", None),
                               "dgrad": ("fp8", "e5m2 x e4m3", "torch._scaled_mm", None),
                               "wgrad": ("fp8", "e5m2 x e4m3", "torch._scaled_mm", None)}
    audited = sum(r.kernel == "torch._scaled_mm" for r in precision_audit(cm))
    assert audited == len(calls) == 4  # 2 forward, dgrad and wgrad of layer 0


def test_on_fallback_error_names_the_weight_on_a_gpu_without_fp8_gemms(monkeypatch):
    monkeypatch.setenv("FP8PASS_KERNELS", "triton")
    monkeypatch.setattr(cuda, "device_capability", lambda device: (8, 0))  # an A100
    cfg = Config(recipe=CurrentScaling(), compiler="aot_eager", on_fallback="error")
    with pytest.raises(Exception, match=r"0\.weight \(forward: cuda has compute capability 8\.0: no FP8 GEMMs") as e:
        _step_on_the_cuda_path(_mlp(), cfg)
    message = str(e.value)  # Dynamo wraps what a backend raises
    assert "PrecisionFallbackError: fp8pass: 6 FP8 GEMM(s) of 2 weight(s)" in message
    assert "; 2.weight (forward: " in message and "Config(on_fallback='error') is set" in message


def test_on_fallback_warn_warns_once_per_gemm_and_the_audit_matches_what_ran(monkeypatch):
    """Two E5M2 operands (an all-E5M2 rule's GEMMs) cannot take ``torch._scaled_mm``: one warning names the
    weight, a second compile of the same model does not warn again, and the GEMMs that ran outside
    ``_scaled_mm`` are exactly the audit's fallbacks."""
    monkeypatch.setenv("FP8PASS_KERNELS", "triton")
    model = _mlp()
    e5m2 = Config(recipe=CurrentScaling(), fwd_format="e5m2", bwd_format="e5m2")
    backend = fp8pass.backend(Config(recipe=CurrentScaling(), compiler="aot_eager", rules=[Rule("2", e5m2)]))
    with pytest.warns(RuntimeWarning, match=r"3 FP8 GEMM\(s\) of 1 weight\(s\)") as caught:
        with gl.pretend_cuda_gemms() as calls:
            torch.compile(model, backend=backend)(torch.randn(16, 32)).sum().backward()
    assert sum("FP8 GEMM(s)" in str(w.message) for w in caught) == 1
    message = next(str(w.message) for w in caught if "FP8 GEMM(s)" in str(w.message))
    assert "2.weight (forward: both operands E5M2: cuBLASLt has no E5M2 x E5M2 FP8 GEMM, dgrad: " in message
    fallbacks = [(r.weight, r.gemm) for r in precision_audit(model) if r.fallback]
    assert fallbacks == [("2.weight", "forward"), ("2.weight", "dgrad"), ("2.weight", "wgrad")]
    assert len(calls) == 6 - len(fallbacks) == 3  # layer 0's three GEMMs took _scaled_mm, layer 2's none
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with gl.pretend_cuda_gemms():
            torch.compile(model, backend=backend)(torch.randn(16, 32))


def test_the_cpu_emulation_and_the_default_warn_are_no_fallback():
    """On CPU every FP8 GEMM is an emulation of FP8 numerics: recorded as such, never a fallback."""
    model = _mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        warnings.filterwarnings("ignore", message=".*threads on")  # the shared-CPU hint, not ours
        torch.compile(model, backend=fp8pass.backend(Config(compiler="aot_eager")))(torch.randn(16, 32))
    records = precision_audit(model)
    assert len(records) == 6 and {r.kernel for r in records} == {CPU_FP8} and not any(r.fallback for r in records)


def test_scaled_mm_refusal_says_why():
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    refusal = cuda.scaled_mm_refusal
    assert refusal(16, 32, 48, e4, e4, torch.bfloat16, "cuda") is None
    assert refusal(16, 32, 48, e5, e5, torch.bfloat16, "cuda") == "both operands E5M2: cuBLASLt has no E5M2 x E5M2 FP8 GEMM"
    assert refusal(16, 32, 48, e4, e4, torch.bfloat16, "cpu") == "cpu tensors: torch._scaled_mm runs on CUDA devices only"
    assert refusal(0, 32, 48, e4, e4, torch.bfloat16, "cuda") == "an empty dimension: nothing to multiply"
    assert cuda.grouped_mm_operands_refusal((16, 40), (4, 40, 64), e4, e4, torch.bfloat16).startswith("dims (16, 40)")
    assert cuda.grouped_mm_operands_refusal((16, 48), (4, 48, 64), e4, e4, torch.bfloat16) is None


def test_config_checks_on_fallback():
    with pytest.raises(ValueError, match="unknown on_fallback 'raise'; valid: warn, error"):
        Config(on_fallback="raise")


def test_collective_audit_names_fp8_and_high_precision_all_gathers(monkeypatch):
    """Read from the FSDP2 parameters (faked here: the 2-rank FSDP2 run is a slow test): a wrapped shard
    gathers E4M3 codes, another weight its param dtype, with a note when its forward GEMM is FP8."""
    from types import SimpleNamespace

    from fp8pass.distributed import fp8_all_gather as ag

    model = _mlp()
    torch.compile(model, backend=fp8pass.backend(Config(compiler="aot_eager")))(torch.randn(16, 32))
    wrapped = ag.FP8ShardWeight(model[0].weight.detach(), ag._Ctx("0.weight", Config()))
    params = [("0.weight", SimpleNamespace(_sharded_local_tensor=wrapped, sharded_param=model[0].weight)),
              ("2.weight", SimpleNamespace(_sharded_local_tensor=model[2].weight.detach(), param_dtype=torch.bfloat16,
                                           sharded_param=model[2].weight)),
              ("2.bias", SimpleNamespace(_sharded_local_tensor=model[2].bias.detach(), param_dtype=None,
                                         sharded_param=model[2].bias))]
    monkeypatch.setattr(ag, "fsdp_params", lambda m: iter(params))  # as fp8_all_gather imported it
    monkeypatch.setattr(model[0], "_get_fsdp_state", lambda: None, raising=False)
    got = [(r.weight, r.precision, r.dtype, r.bytes_per_element, r.note is not None) for r in collective_audit(model)]
    assert got == [("0.weight", "fp8", "e4m3", 1, False), ("2.weight", "high", "bfloat16", 2, True),
                   ("2.bias", "high", "float32", 4, False)]
    assert collective_audit(_mlp()) == []  # no FSDP2


def test_the_trainer_logs_the_audit_once_per_change(tmp_path):
    from fp8pass.train import ModelConfig, TrainConfig, train
    from fp8pass.train.logging import read_metrics

    (tmp_path / "c.txt").write_text("".join(f"x{i} = {i} * y + {i % 5}\n" for i in range(300)))
    cfg = TrainConfig(recipe="fp8-smooth", steps=2, out=str(tmp_path / "run"), data=str(tmp_path / "c.txt"),
                      batch_size=2, seq_len=32, model=ModelConfig(d_model=32, n_layers=1, n_heads=2, ffn=64,
                                                                   max_seq_len=32),
                      eval_every=2, eval_batches=1, ckpt_every=2, monitor_every=0, warmup=1, progress=False,
                      compiler="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(cfg)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl", "precision")
    assert len(records) == 1 and records[0]["step"] == 1 and records[0]["fallbacks"] == 0
    gemms = records[0]["gemms"]
    # one block: q, k, v, o, gate, up, down in FP8 (3 GEMMs each), the LM head kept
    assert len(gemms) == 3 * 8 and records[0]["collectives"] == []
    assert {g["weight"] for g in gemms if g["precision"] == "high"} == {"lm_head.weight"}
    assert sum(n for k, n in records[0]["summary"].items() if k.startswith("forward fp8")) == 7


class _Experts(torch.nn.Module):
    """Fixed-capacity MoE experts (``bmm`` over [E, C, D]): fused gate/up [E, D, 2F], down [E, D, F]."""

    def __init__(self, ffn, experts=4, d=32):
        super().__init__()
        g = torch.Generator().manual_seed(17)
        self.gate_up = torch.nn.Parameter(torch.randn(experts, d, 2 * ffn, generator=g) / d ** 0.5)
        self.down = torch.nn.Parameter(torch.randn(experts, d, ffn, generator=g) / ffn ** 0.5)

    def forward(self, x):
        gate, up = torch.bmm(x, self.gate_up).chunk(2, dim=-1)
        return torch.bmm(torch.nn.functional.silu(gate) * up, self.down.transpose(1, 2))


def test_grouped_expert_gemms_on_cpu_and_a_shape_the_grouped_fp8_gemm_cannot_take(monkeypatch):
    """MoE expert stacks: the CPU's per-expert emulation; on the CUDA code path the grouped GEMMs of a stack
    whose FFN width (40) is no multiple of 16 fall back (the plan allowed it: ``dim_multiple=8``; fp32
    outputs would too: the grouped FP8 GEMM writes bf16 only), the
    warning names that weight, and the grouped GEMMs that ran are the audit's ``_scaled_grouped_mm`` ones."""
    x = torch.randn(4, 24, 32, generator=torch.Generator().manual_seed(18))
    cfg = Config(recipe=CurrentScaling(), compiler="aot_eager", dim_multiple=8)
    model = _Experts(ffn=48)
    torch.compile(model, backend=fp8pass.backend(cfg))(x).sum().backward()
    got = _by_weight(precision_audit(model))
    cpu = "cpu emulation: float32 GEMM of FP8 codes per expert"
    for w in ("gate_up", "down"):
        assert got[w] == {"forward": ("fp8", "e4m3 x e4m3", cpu, None), "dgrad": ("fp8", "e5m2 x e4m3", cpu, None),
                          "wgrad": ("fp8", "e5m2 x e4m3", cpu, None)}
    torch._dynamo.reset()
    monkeypatch.setenv("FP8PASS_KERNELS", "triton")
    model = _Experts(ffn=40)
    with pytest.warns(RuntimeWarning, match=r"3 FP8 GEMM\(s\) of 1 weight\(s\).*: down \(forward: dims"):
        with gl.pretend_cuda_gemms() as calls, torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 out only
            torch.compile(model, backend=fp8pass.backend(cfg))(x).float().sum().backward()
    records = precision_audit(model)
    assert {(r.weight, r.gemm) for r in records if r.fallback} == {("down", g) for g in ("forward", "dgrad", "wgrad")}
    assert {(r.weight, r.operands) for r in records if r.kernel == "torch._scaled_grouped_mm"} == {
        ("gate_up", "e4m3 x e4m3")}  # the gradient is cast to E4M3 for the grouped FP8 GEMM
    assert len(calls) == sum(r.kernel == "torch._scaled_grouped_mm" for r in records) == 3


def test_nvfp4_gemms_are_recorded_as_nvfp4():
    model = _mlp()
    cfg = Config(recipe=fp8pass.NVFP4Scaling(keep_last_blocks=0, protect_post_qk=False), compiler="aot_eager")
    torch.compile(model, backend=fp8pass.backend(cfg))(torch.randn(16, 32)).sum().backward()
    records = precision_audit(model)
    assert [(r.weight, r.gemm, r.precision, r.op) for r in records] == [
        (w, g, "nvfp4", "nvfp4_linear") for w in ("0.weight", "2.weight") for g in ("forward", "dgrad", "wgrad")]
    assert not any(r.fallback for r in records)


def test_the_audit_reads_activation_checkpointed_bodies():
    """A checkpointed block is rewritten inside the higher-order op's body: its GEMMs are recorded too."""
    from torch.utils.checkpoint import checkpoint

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)

        def forward(self, x):
            return checkpoint(lambda t: self.b(torch.relu(self.a(t))), x, use_reentrant=False)

    model = Block()
    torch.compile(model, backend=fp8pass.backend(Config(compiler="aot_eager")))(torch.randn(16, 32)).sum().backward()
    records = precision_audit(model)
    assert [(r.weight, r.gemm, r.precision) for r in records] == [
        (w, g, "fp8") for w in ("a.weight", "b.weight") for g in ("forward", "dgrad", "wgrad")]


def test_precision_audit_takes_a_model():
    with pytest.raises(TypeError, match="precision_audit takes the model .* got str"):
        precision_audit("model")
    assert precision_audit(_mlp()) == []  # never compiled: no records


def test_a_per_expert_loop_is_one_weight_with_three_gemms():
    """``F.linear(x, W[e])`` for every expert: one op per expert, one record per (weight, GEMM)."""
    from test_expert_loop import LoopLinears

    model = LoopLinears()
    x = torch.randn(8, model.w.shape[-1])
    torch.compile(model, backend=fp8pass.backend(Config(compiler="aot_eager")))(x).sum().backward()
    got = _by_weight(precision_audit(model))
    assert got["w"] == {"forward": ("fp8", "e4m3 x e4m3", CPU_FP8, None), "dgrad": ("fp8", "e5m2 x e4m3", CPU_FP8, None),
                        "wgrad": ("fp8", "e5m2 x e4m3", CPU_FP8, None)}
    assert sorted(got) == ["router.weight", "w"]  # the router (4 outputs) kept: below min_dim
