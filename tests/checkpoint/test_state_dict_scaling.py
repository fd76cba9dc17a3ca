"""The scaling state travels in model.state_dict(): keys, strict loading, exact resume, DCP, a fresh process."""

import io
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch._dynamo.utils import counters

import fp8pass
from fp8pass import checkpoint
from fp8pass.checkpoint import checkpoint_state
from fp8pass.testing.models import tiny_titan_llama

CFG = fp8pass.Config(compiler="aot_eager")
TOKENS = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # every test compiles the same forward again; past the recompile limit Dynamo would run it eagerly
    torch._dynamo.reset()


def _step(model, opt) -> float:
    logits = model(TOKENS[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), TOKENS[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _trained(steps: int, config=CFG):
    model = tiny_titan_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.compile(backend=fp8pass.backend(config))
    torch.manual_seed(123)
    losses = [_step(model, opt) for _ in range(steps)]
    return model, opt, losses


def _scaling_keys(sd):
    return sorted(k for k in sd if f".{checkpoint.SCALING_KEY}." in k or f".{checkpoint.HCP_KEY}." in k)


def test_state_dict_holds_the_scaling_state_as_plain_tensors():
    plain_keys = set(tiny_titan_llama().state_dict())
    model, opt, _ = _trained(2)
    sd = model.state_dict()
    graphs = counters["stats"]["unique_graphs"]
    _step(model, opt)
    assert counters["stats"]["unique_graphs"] == graphs  # taking a state dict costs no recompile
    keys = _scaling_keys(sd)
    streams = sorted(k for k in sd if k.endswith(".fp8_sr.stream"))  # stochastic rounding (runtime/sr.py)
    assert set(sd) - set(keys) - set(streams) == plain_keys
    # 7 FP8 linears per block (q, k, v, o, gate, up, down), 3 roles x 4 fields each, and one stream each
    assert len(keys) == 2 * 7 * 12 and len(streams) == 2 * 7
    assert "layers.0.feed_forward.w2.weight.fp8_scaling.grad_output.scale" in keys
    assert all(type(sd[k]) is torch.Tensor for k in keys)
    # scaling_state_dict is a view of the same state under parameter FQNs
    view = fp8pass.scaling_state_dict(model)
    for k in keys:
        assert torch.equal(view[k.replace(".fp8_scaling.", ".")], sd[k])
    assert int(sd["layers.0.feed_forward.w2.weight.fp8_scaling.input.steps"]) == 3  # live tensors


def test_fresh_model_loads_strictly_and_continues_bit_identically():
    _, _, uninterrupted = _trained(3)

    model, opt, _ = _trained(2)
    buf = io.BytesIO()
    torch.save(checkpoint_state(model, opt), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)

    fresh = tiny_titan_llama()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    checkpoint.attach(fresh, CFG)
    fresh.load_state_dict(state["model"], strict=True)  # before compile
    fresh_opt.load_state_dict(state["optimizer"])
    checkpoint.set_torch_rng_state(state["rng"])
    fresh.compile(backend=fp8pass.backend(CFG))
    assert _step(fresh, fresh_opt) == uninterrupted[2]
    fresh.load_state_dict(state["model"], strict=True)  # after compile: into the live state


def test_plain_checkpoint_loads_strictly_into_an_fp8_model():
    model, _, _ = _trained(1)
    plain = tiny_titan_llama().state_dict()
    before = fp8pass.scaling_state_dict(model)
    model.load_state_dict(plain, strict=True)
    after = fp8pass.scaling_state_dict(model)
    assert all(torch.equal(before[k], after[k]) for k in before)  # no keys: the state is kept


def test_model_without_hooks_rejects_the_state_and_takes_the_weights_alone():
    model, _, _ = _trained(1)
    plain = tiny_titan_llama()  # e.g. a bf16 reference copy
    with pytest.raises(RuntimeError, match=r"Unexpected key.*weight\.fp8_scaling\.input\.amax_history"):
        plain.load_state_dict(model.state_dict(), strict=True)
    plain.load_state_dict(checkpoint.without_scaling_state(model.state_dict()), strict=True)
    assert fp8pass.scaling_state_dict(plain) == {}
    assert torch.equal(plain.output.weight, model.output.weight)


def test_state_loaded_without_a_config_takes_the_compile_configs_recipe():
    model, _, _ = _trained(1)
    sd = model.state_dict()
    other = fp8pass.Config(recipe=fp8pass.DelayedScaling(margin=1), compiler="aot_eager")
    fresh = checkpoint.attach(tiny_titan_llama())  # default Config
    fresh.load_state_dict(sd)
    fresh.compile(backend=fp8pass.backend(other))
    fresh(TOKENS)
    st = fp8pass.runtime.state_for(fresh.layers["0"].feed_forward.w2.weight, other.recipe)
    assert int(st.input.steps) == 2  # the loaded step plus this one

    short = fp8pass.Config(recipe=fp8pass.DelayedScaling(history_len=4), compiler="aot_eager")
    fresh = checkpoint.attach(tiny_titan_llama())
    fresh.load_state_dict(sd)
    fresh.compile(backend=fp8pass.backend(short))
    with pytest.raises(Exception, match="history_len=16.*4"):
        fresh(TOKENS)


def test_dcp_model_state_dict_resolves_the_scaling_keys():
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model, _, _ = _trained(1)
    sd = get_model_state_dict(model)
    assert _scaling_keys(sd) == _scaling_keys(model.state_dict())


RESUME_SCRIPT = textwrap.dedent("""
    import sys, torch, fp8pass
    from fp8pass.testing.models import tiny_titan_llama
    from test_state_dict_scaling import CFG, _step
    mode, path = sys.argv[1], sys.argv[2]
    model = tiny_titan_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if mode == "resume":
        fp8pass.load_checkpoint_state(model, opt, torch.load(path, weights_only=True), config=CFG)
    else:
        torch.manual_seed(123)
    model.compile(backend=fp8pass.backend(CFG))
    losses = []
    for i in range(4 if mode == "full" else 2):
        losses.append(_step(model, opt))
        if mode == "first" and i == 1:
            torch.save(fp8pass.checkpoint_state(model, opt), path)
    print(" ".join(v.hex() for v in losses))
""")


def test_resume_in_a_fresh_process_is_bit_identical_with_stochastic_rounding(tmp_path):
    assert CFG.grad_stochastic_rounding
    script = tmp_path / "run.py"
    script.write_text(RESUME_SCRIPT)
    ckpt = str(tmp_path / "ck.pt")

    def run(mode):
        out = subprocess.run([sys.executable, str(script), mode, ckpt], capture_output=True, text=True,
                             timeout=300, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout.split()

    full = run("full")
    first = run("first")
    resumed = run("resume")
    assert first == full[:2]
    assert resumed == full[2:]


def test_nvfp4_hot_channel_state_travels_in_the_state_dict():
    from fp8pass.runtime.hcp import hcp_state_for

    hcp = fp8pass.HotChannelPatching(fraction=0.25)
    cfg = fp8pass.Config(recipe=fp8pass.NVFP4Scaling(hcp=hcp, keep_last_blocks=0), compiler="aot_eager")
    model = tiny_titan_llama()
    model.compile(backend=fp8pass.backend(cfg))
    model(TOKENS)
    sd = model.state_dict()
    assert sum(f".{checkpoint.HCP_KEY}." in k for k in sd) == 3 * 10  # err, hot, step of 10 NVFP4 linears
    fresh = checkpoint.attach(tiny_titan_llama(), cfg)
    fresh.load_state_dict(sd, strict=True)
    st = hcp_state_for(fresh.layers["0"].attention.wq.weight, hcp)
    assert torch.equal(st.hot, sd["layers.0.attention.wq.weight.fp8_hcp.hot"]) and int(st.step) == 1
