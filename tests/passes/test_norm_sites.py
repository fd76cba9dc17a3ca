"""Config.save_norm_input_fp8: which RMSNorms become ``fp8pass::rmsnorm`` (exact counts on fp8pass's
TinyLlama, a Hugging Face Llama, the torchtitan-style Llama, and the same with torch's ``nn.RMSNorm``), the final norm before the
high-precision LM head kept with its reason, the knob off leaving graphs alone, and the rewritten
model's forward equal to the original's bit for bit."""

import pytest
import torch

import fp8pass
from fp8pass.config import DEFAULT_KEEP_HIGH_PRECISION
from fp8pass.passes import plan_graph
from fp8pass.testing import hf_zoo
from fp8pass.testing import models as test_models
from fp8pass.testing.models import capture_with_inputs, tiny_titan_llama
from fp8pass.train import ModelConfig, TinyLlama

LAYERS = 2


def _tinyllama():
    torch.manual_seed(0)
    model = TinyLlama(ModelConfig(vocab_size=64, d_model=64, n_layers=LAYERS, n_heads=2, ffn=96, max_seq_len=32))
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    return model, (tokens[:, :-1], tokens[:, 1:]), "norm.weight"


HEADS = {"tinyllama": "lm_head.weight", "hf-llama": "lm_head.weight", "titan": "output.weight"}


def _hf_llama():
    return hf_zoo.build("Llama", layers=LAYERS), (hf_zoo.ids(),), "model.norm.weight"


def _titan():
    torch.manual_seed(0)
    return tiny_titan_llama(LAYERS), (torch.randint(0, 128, (2, 8)),), "norm.weight"


def _titan_nn_rmsnorm():
    """The torchtitan-style Llama with torch's ``nn.RMSNorm`` (``F.rms_norm``; torchtitan's own choice):
    layer 0's norms with ``eps=None`` (torch's default: fp32's epsilon), the others 1e-6."""
    model, inputs, final = _titan()
    for name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, test_models.RMSNorm):
                eps = None if name.startswith("layers.0") else child.eps
                norm = torch.nn.RMSNorm(child.weight.shape[0], eps=eps)
                with torch.no_grad():
                    norm.weight.copy_(torch.linspace(0.5, 1.5, child.weight.shape[0]))
                setattr(parent, child_name, norm)
    return model, inputs, final


HEADS = {**HEADS, "titan-nn-rmsnorm": "output.weight"}
MODELS = {"tinyllama": _tinyllama, "hf-llama": _hf_llama, "titan": _titan, "titan-nn-rmsnorm": _titan_nn_rmsnorm}


def _graph(make):
    model, inputs, final = make()
    ((gm, example),) = capture_with_inputs(model, *inputs, fullgraph=True)
    return model, inputs, final, gm, example


def _cfg(on: bool, **kw):
    return fp8pass.Config(recipe=fp8pass.CurrentScaling(), save_norm_input_fp8=on, **kw)


def _calls(gm, name):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and str(n.target) == f"fp8pass.{name}.default")


def _rsqrts(gm):
    """The norms written out (one rsqrt each) and torch's own (``torch.rms_norm``) in the graph."""
    return sum(1 for n in gm.graph.nodes if n.target in (torch.rsqrt, "rsqrt", torch.rms_norm))


@pytest.mark.parametrize("name", MODELS)
def test_two_norms_per_layer_become_fp8pass_rmsnorm_and_the_final_one_stays(name):
    """Each layer's attention and MLP norms feed only FP8 linears (q/k/v, gate/up): 2 per layer become
    ``fp8pass::rmsnorm``; the final norm feeds the LM head, kept in high precision by policy: skipped
    with that reason. The rewrite removes exactly the replaced norms' nodes (one rsqrt or rms_norm each)."""
    _, _, final, gm, example = _graph(MODELS[name])
    plan = plan_graph(gm.graph, _cfg(True))
    assert [s.fqn for s in plan.norms] == [f for f in _norm_weights(gm) if f != final]
    assert len(plan.norms) == 2 * LAYERS
    kept = [(where, why) for where, why in plan.skipped if where.startswith("RMSNorm")]
    assert len(kept) == 1 and kept[0][0] == f"RMSNorm {final}"
    assert f"{HEADS[name]} (a linear kept in high precision), which is not an FP8 linear" in kept[0][1]
    new_gm, record = fp8pass.backend(_cfg(True)).transform(gm, list(example))
    assert _calls(new_gm, "rmsnorm") == 2 * LAYERS
    assert _rsqrts(new_gm) == _rsqrts(gm) - 2 * LAYERS == 1


def _norm_weights(gm):
    """The norms' weight FQNs of a captured graph, in graph order (from the plan with the knob on,
    converted or not)."""
    plan = plan_graph(gm.graph, _cfg(True))
    kept = [where.removeprefix("RMSNorm ") for where, _ in plan.skipped if where.startswith("RMSNorm")]
    return [s.fqn for s in plan.norms] + kept


@pytest.mark.parametrize("name", ["tinyllama", "hf-llama"])
def test_knob_off_leaves_the_graph_and_plan_as_they_were(name):
    _, _, _, gm, example = _graph(MODELS[name])
    off = plan_graph(gm.graph, _cfg(False))
    on = plan_graph(gm.graph, _cfg(True))
    assert not off.norms and not any(w.startswith("RMSNorm") for w, _ in off.skipped)
    assert [s for s in on.sites if s.kind != "rmsnorm"] != [] and len(off.sites) == len(on.sites) - 2 * LAYERS
    new_gm, _ = fp8pass.backend(_cfg(False)).transform(gm, list(example))
    assert _calls(new_gm, "rmsnorm") == 0 and _rsqrts(new_gm) == _rsqrts(gm)


def test_a_norm_read_by_a_high_precision_linear_is_kept_with_the_reason():
    """keep_high_precision on one q projection: its layer's attention norm now has a reader that is
    not an FP8 linear and stays as it was; the other norms are converted."""
    _, _, _, gm, _ = _graph(_tinyllama)
    plan = plan_graph(gm.graph, _cfg(True, keep_high_precision=(*DEFAULT_KEEP_HIGH_PRECISION, "layers.0.self_attn.q_proj")))
    assert len(plan.norms) == 2 * LAYERS - 1
    kept = dict((w, why) for w, why in plan.skipped if w.startswith("RMSNorm"))
    assert "layers.0.self_attn.q_proj.weight (a linear kept in high precision)" in kept[
        "RMSNorm layers.0.input_layernorm.weight"]


@pytest.mark.parametrize("name", ["tinyllama", "hf-llama", "titan-nn-rmsnorm"])
def test_rewritten_forward_equals_the_original_bit_for_bit(name):
    """aot_eager runs the original norm's aten ops as the op does: the loss (the titan model: the
    logits) with the knob on equals that with it off exactly (the FP8 linears read the same values);
    for ``nn.RMSNorm``, torch's own kernel is the original."""
    losses = []
    for on in (False, True):
        model, inputs, _ = MODELS[name]()
        torch._dynamo.reset()
        fwd = torch.compile(model, backend=fp8pass.backend(_cfg(on, compiler="aot_eager")))
        out = fwd(*inputs)
        losses.append(out if isinstance(out, torch.Tensor) else hf_zoo.loss_fn(fwd, *inputs))  # loss or logits
    assert torch.equal(losses[0], losses[1])
