"""FP8 inside higher-order-op bodies: activation checkpointing (``use_reentrant`` True and False, HF
``gradient_checkpointing_enable()``, selective AC with a ``context_fn``) and ``wrap`` bodies are rewritten
like the top-level graph, their delayed-scaling state stepping once per step and the recomputation
casting with the forward's scales; ``cond`` bodies' linears are listed as kept; ``flex_attention`` is
listed as attention (docs/backend.md, Activation checkpointing and higher-order ops)."""

import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import fp8pass
from fp8pass.config import Config
from fp8pass.report.report import RAN_EAGERLY
from fp8pass.testing import hf_zoo as Z


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setenv("FP8PASS_CPU_FUSED", "0")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _save_matmuls(ctx, op, *args, **kwargs):
    """A torchtitan-style selective-AC policy: keep matmul outputs, recompute the rest."""
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _sac_context():
    return create_selective_checkpoint_contexts(_save_matmuls)


class _Block(nn.Module):
    """``b(relu(a(x)))``, checkpointed (``mode``: "reentrant", "non_reentrant", "selective"), wrapped in
    ``wrap`` ("wrap") or plain ("none")."""

    def __init__(self, mode: str):
        super().__init__()
        self.a, self.b, self.mode = nn.Linear(32, 64), nn.Linear(64, 32), mode

    def body(self, x):
        return self.b(torch.relu(self.a(x)))

    def forward(self, x):
        if self.mode == "none":
            return self.body(x)
        if self.mode == "wrap":
            from torch._higher_order_ops.wrap import wrap

            return wrap(self.body, x)
        if self.mode == "selective":
            return checkpoint(self.body, x, use_reentrant=False, context_fn=_sac_context)
        return checkpoint(self.body, x, use_reentrant=self.mode == "reentrant")


def _steps(model) -> dict[str, int]:
    return {k: int(v) for k, v in fp8pass.scaling_state_dict(model).items() if k.endswith(".steps")}


def _train(mode: str, compiler: str, steps: int = 3, **config):
    """(per-step gradients of a.weight / b.weight, model, backend) of ``steps`` compiled steps; the input's
    magnitude grows each step, so a recomputation with the updated (delayed) scale would cast differently.
    ``config``: Config fields (default: gradients rounded to nearest)."""
    torch.manual_seed(0)
    model = _Block(mode)
    be = fp8pass.backend(Config(**{"compiler": compiler, "grad_stochastic_rounding": False, **config}))
    cm = torch.compile(model, backend=be)
    grads = []
    for step in range(steps):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step)) * (1 + step)
        cm(x).square().sum().backward()
        grads.append([p.grad.clone() for p in (model.a.weight, model.b.weight)])
        model.zero_grad()
    return grads, model, be


@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant", "selective", "wrap"])
def test_checkpointed_block_is_fp8_and_records_once(mode):
    rep = fp8pass.explain(_Block(mode), torch.randn(16, 32))
    assert sorted(rep.linears) == ["a.weight", "b.weight"] and rep.skipped == []
    grads, model, be = _train(mode, "aot_eager")
    assert be.report().graph_after.count("fp8pass.fp8_linear_precast.default(") == 2
    # the delayed-scaling state steps once per step (forward roles recorded outside the body, once;
    # grad_output by the backward, once), not twice for the recomputation
    assert set(_steps(model).values()) == {3} and len(_steps(model)) == 6
    # the recomputation casts with the forward's scales: the same gradients as the plain block's,
    # step by step (step 0 casts with the current amax, later steps with the history's scale)
    ref, ref_model, _ = _train("none", "aot_eager")
    for got, want in zip(grads, ref):
        for g, r in zip(got, want):
            torch.testing.assert_close(g, r, rtol=0, atol=0)
    assert fp8pass.scaling_state_dict(model).keys() == fp8pass.scaling_state_dict(ref_model).keys()
    for k, v in fp8pass.scaling_state_dict(ref_model).items():
        torch.testing.assert_close(fp8pass.scaling_state_dict(model)[k], v, rtol=0, atol=0)


def test_checkpointed_stochastic_rounding_draws_the_plain_blocks_bits():
    """Stochastic gradient rounding inside a checkpointed body draws from each weight's own stream
    (Config.sr_seed), threaded into the body like the scaling state: the gradients equal the plain
    block's bit for bit, and each stream advanced once per step."""
    cfg = dict(grad_stochastic_rounding=True, sr_seed=7)
    grads, model, _ = _train("non_reentrant", "aot_eager", **cfg)
    ref, ref_model, _ = _train("none", "aot_eager", **cfg)
    for got, want in zip(grads, ref):
        for g, r in zip(got, want):
            torch.testing.assert_close(g, r, rtol=0, atol=0)
    streams = {k: v for k, v in model.state_dict().items() if k.endswith("fp8_sr.stream")}
    assert sorted(streams) == ["a.weight.fp8_sr.stream", "b.weight.fp8_sr.stream"]
    for k, v in streams.items():
        assert torch.equal(v, ref_model.state_dict()[k]) and int(v[1]) >= 3, (k, v)


def test_a_rules_recipe_inside_a_checkpointed_body_makes_and_records_its_own_state():
    """Config.rules inside a checkpointed body: b's rule ("delayed", 1024-entry histories) makes b's
    state, a keeps the Config's (16 entries); both record once per step, as the plain block's."""
    rules = [fp8pass.Rule("b", "delayed")]
    grads, model, _ = _train("non_reentrant", "aot_eager", rules=rules)
    ref, ref_model, _ = _train("none", "aot_eager", rules=rules)
    sd = fp8pass.scaling_state_dict(model)
    assert tuple(sd["a.weight.input.amax_history"].shape) == (16,)
    assert tuple(sd["b.weight.input.amax_history"].shape) == (1024,)
    assert set(_steps(model).values()) == {3}
    for got, want in zip(grads, ref):
        for g, r in zip(got, want):
            torch.testing.assert_close(g, r, rtol=0, atol=0)
    for k, v in fp8pass.scaling_state_dict(ref_model).items():
        torch.testing.assert_close(sd[k], v, rtol=0, atol=0)


class _Shared(nn.Module):
    """One weight used outside and inside a checkpointed region."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 32)

    def forward(self, x):
        return checkpoint(self.a, torch.relu(self.a(x)), use_reentrant=False)


def test_weight_used_outside_and_inside_a_body_records_once():
    torch.manual_seed(0)
    model = _Shared()
    be = fp8pass.backend(Config(compiler="aot_eager", grad_stochastic_rounding=False))
    cm = torch.compile(model, backend=be)
    for _ in range(2):
        cm(torch.randn(16, 32)).square().sum().backward()
    assert be.report().linears == ["a.weight"]
    # one set of state inputs for a.weight, one forward record per step (the max of both uses' amaxes);
    # grad_output records once per backward use
    assert len(be.records[0].extra_inputs) == 3 * 8
    steps = _steps(model)
    assert steps["a.weight.input.steps"] == 2 and steps["a.weight.weight.steps"] == 2, steps


@pytest.mark.parametrize("mode", ["non_reentrant", "selective"])
def test_checkpointed_block_under_inductor(mode):
    grads, model, _ = _train(mode, "inductor", steps=2)
    assert set(_steps(model).values()) == {2} and len(_steps(model)) == 6
    ref, _, _ = _train("none", "inductor", steps=2)
    for got, want in zip(grads, ref):
        for g, r in zip(got, want):
            torch.testing.assert_close(g, r, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------------
# a side effect in a checkpointed forward: Dynamo runs the region eagerly unless told to skip its replay

_ROUTING: list = []  # module-level state the block's forward sets and undoes, as the `kernels` package does
_FLAG = "torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint"


class _RoutedBlock(nn.Module):
    """``head(checkpoint(b(relu(a(x)))))`` whose checkpointed forward pushes onto ``_ROUTING`` and pops it
    before returning (transformers 5.25's attention routing, in miniature)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(32, 64), nn.Linear(64, 32), nn.Linear(32, 32)

    def body(self, x):
        _ROUTING.append("fast path")
        try:
            return self.b(torch.relu(self.a(x)))
        finally:
            _ROUTING.pop()

    def forward(self, x):
        return self.head(checkpoint(self.body, x, use_reentrant=False))


def test_side_effect_in_checkpointed_forward_is_named():
    """Without the flag the checkpointed region runs eagerly: explain lists the break with Dynamo's reason,
    the flag and the two weights left out; the backend warns once (on_graph_break), raises under "error"."""
    rep = fp8pass.explain(_RoutedBlock(), torch.randn(16, 32))
    assert rep.linears == ["head.weight"]
    assert sorted(w for w, _ in rep.skipped) == ["a.weight", "b.weight"]
    assert all(why == RAN_EAGERLY for _, why in rep.skipped)
    notes = [b for b in rep.graph_breaks if "HOP: Unsafe side effect" in b]
    assert len(notes) == 1 and _FLAG in notes[0] and "high precision" in notes[0], rep.graph_breaks

    x = torch.randn(16, 32)
    be = fp8pass.backend(Config(compiler="aot_eager"))
    cm = torch.compile(_RoutedBlock(), backend=be)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            cm(x).sum().backward()
    said = [str(w.message) for w in caught if _FLAG in str(w.message)]
    assert len(said) == 1 and said[0].startswith("fp8pass: Dynamo graph break: HOP: Unsafe side effect"), said
    assert be.report().linears == ["head.weight"] and _ROUTING == []

    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(_RoutedBlock(), backend=fp8pass.backend(Config(compiler="aot_eager", on_graph_break="ignore")))(x)
    assert not [w for w in caught if _FLAG in str(w.message)]
    torch._dynamo.reset()
    with pytest.raises(Exception, match="HOP: Unsafe side effect"):
        torch.compile(_RoutedBlock(), backend=fp8pass.backend(Config(compiler="aot_eager", on_graph_break="error")))(x)


def test_side_effect_in_checkpointed_forward_with_the_flag_is_fp8():
    """With the flag the region is one higher-order op, rewritten as any checkpointed body: all three
    linears FP8, gradients bit-identical to the same model without checkpointing, the side effect undone."""
    torch.manual_seed(0)
    routed = _RoutedBlock()
    plain = _RoutedBlock()
    plain.load_state_dict(routed.state_dict())
    plain.forward = lambda x: plain.head(plain.body(x))
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
        rep = fp8pass.explain(routed, torch.randn(16, 32))
        assert sorted(rep.linears) == ["a.weight", "b.weight", "head.weight"] and rep.skipped == []
        assert not [b for b in rep.graph_breaks if "HOP" in b]
        grads = {}
        for name, model in (("routed", routed), ("plain", plain)):
            torch._dynamo.reset()
            cm = torch.compile(model, backend=fp8pass.backend(Config(compiler="aot_eager",
                                                                     grad_stochastic_rounding=False)))
            grads[name] = []
            for step in range(3):
                x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step)) * (1 + step)
                cm(x).square().sum().backward()
                grads[name].append([p.grad.clone() for p in (model.a.weight, model.b.weight, model.head.weight)])
                model.zero_grad()
    assert _ROUTING == []
    for got, want in zip(grads["routed"], grads["plain"]):
        for g, r in zip(got, want):
            torch.testing.assert_close(g, r, rtol=0, atol=0)


class _OffloadedBlock(nn.Module):
    """HF's ``activation_checkpointing_enable(offload=True)`` in miniature: the checkpoint inside
    ``torch.autograd.graph.save_on_cpu`` (unpinned here: the CPU has no pinned allocator)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(32, 64), nn.Linear(64, 32), nn.Linear(32, 32)

    def body(self, x):
        return self.b(torch.relu(self.a(x)))

    def forward(self, x):
        with torch.autograd.graph.save_on_cpu(pin_memory=False):
            h = checkpoint(self.body, x, use_reentrant=False)
        return self.head(h)


def test_save_on_cpu_around_a_checkpoint_is_named():
    """Dynamo does not trace save_on_cpu: the frame runs eagerly; explain says so and names fp8pass's offload."""
    rep = fp8pass.explain(_OffloadedBlock(), torch.randn(16, 32))
    assert rep.linears == [] and sorted(w for w, _ in rep.skipped) == ["a.weight", "b.weight", "head.weight"]
    notes = [b for b in rep.graph_breaks if "save_on_cpu" in b]
    assert len(notes) == 1 and "fp8pass.offload_saved_activations()" in notes[0], rep.graph_breaks


# --------------------------------------------------------------------------------------------------
# HF Llama (2 layers) with gradient_checkpointing_enable()

@pytest.fixture
def hf_checkpointing():
    """transformers 5.25 routes attention through the ``kernels`` package, which sets a module-level
    variable in every call and undoes it before returning: a side effect Dynamo refuses inside a
    checkpointed layer unless told to skip replaying it (test_side_effect_in_checkpointed_forward_is_named
    checks what happens without). Earlier transformers have no such side effect; the flag changes nothing."""
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
        yield


def _llama(**ckpt_kwargs):
    model = Z.build("Llama")
    if ckpt_kwargs is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=ckpt_kwargs)
    return model


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


_KINDS = {"non_reentrant": dict(use_reentrant=False), "reentrant": dict(use_reentrant=True),
          "selective": dict(use_reentrant=False, context_fn=_sac_context)}


def _eager_grads(model, ids):
    loss = Z.loss_fn(model, ids)
    loss.backward()
    grads = _grads(model)
    model.zero_grad()
    return loss.detach(), grads


@pytest.mark.parametrize("kind", ["non_reentrant", pytest.param("reentrant", marks=pytest.mark.slow), "selective"])
def test_hf_llama_gradient_checkpointing_is_fp8(kind, hf_checkpointing):
    model = _llama(**_KINDS[kind])
    ids = Z.ids()
    rep = fp8pass.explain(model, ids)
    # 2 layers x (q, k, v, o, gate, up, down) = 14 of 14 linears FP8; kept: lm_head (policy) and the
    # two attention lines, as without activation checkpointing
    assert len(rep.linears) == 14 and len(rep.swiglus) == 2
    assert sorted(w for w, _ in rep.skipped) == ["lm_head.weight", "model.layers.0.self_attn",
                                                  "model.layers.1.self_attn"]
    assert sum(why.startswith("attention, kept") for _, why in rep.skipped) == 2

    loss0, g0 = _eager_grads(model, ids)
    # FP8: gradients within cosine 0.98 of eager; the state steps once per step
    be = fp8pass.backend(Config(compiler="aot_eager", grad_stochastic_rounding=False))
    cm = torch.compile(model, backend=be)
    for step in range(2):
        loss = Z.loss_fn(cm, ids)
        loss.backward()
        if step == 0:
            g8 = _grads(model)
            assert abs(loss.item() - loss0.item()) <= 0.02 * loss0.item()
            assert g8.keys() == g0.keys()
            cos = torch.nn.functional.cosine_similarity(
                torch.cat([g0[n].flatten().double() for n in g0]), torch.cat([g8[n].flatten().double() for n in g0]),
                dim=0)
            assert cos >= 0.98, cos.item()
        model.zero_grad()
        steps = _steps(model)
        # 14 linears' input/weight/grad_output states; a GLU's W_down is current-scaled under
        # Smooth-SwiGLU's channel mode (its weight state never records), as without AC
        want = {k: 0 if k.endswith("down_proj.weight.weight.steps") else step + 1 for k in steps}
        assert len(steps) == 3 * 14 and steps == want, steps


def test_hf_llama_gradient_checkpointing_with_fp8pass_offload(hf_checkpointing):
    """fp8pass.offload_saved_activations around the compiled forward (what to use instead of HF's offload=True):
    the saved tensors move to host memory and come back, the gradients bit-identical to the run without it."""
    ids = Z.ids()
    grads, stats = {}, None
    for offload in (False, True):
        torch._dynamo.reset()
        model = _llama(use_reentrant=False)
        cm = torch.compile(model, backend=fp8pass.backend(Config(compiler="aot_eager", grad_stochastic_rounding=False)))
        for _ in range(2):
            if offload:
                with fp8pass.offload_saved_activations(min_bytes=0) as off:
                    loss = Z.loss_fn(cm, ids)
                stats = off.stats
            else:
                loss = Z.loss_fn(cm, ids)
            loss.backward()
        grads[offload] = _grads(model)
    assert stats.offloaded_tensors > 0 and stats.restored_tensors > 0, stats
    assert grads[True].keys() == grads[False].keys() and len(grads[False]) == 21
    for n, g in grads[False].items():
        assert torch.equal(grads[True][n], g), n


def test_hf_llama_gradient_checkpointing_identity_format_is_eager(hf_checkpointing):
    model = _llama(use_reentrant=False)
    ids = Z.ids()
    loss0, g0 = _eager_grads(model, ids)
    be = fp8pass.backend(Config(fwd_format="identity", bwd_format="identity", compiler="aot_eager",
                                grad_stochastic_rounding=False))
    loss_id = Z.loss_fn(torch.compile(model, backend=be), ids)
    loss_id.backward()
    g_id = _grads(model)
    rep = be.report()
    assert len(rep.linears) == 14 and rep.graph_after.count("fp8pass.swiglu_down.default(") == 2
    torch.testing.assert_close(loss_id, loss0, rtol=1e-5, atol=0)
    assert g_id.keys() == g0.keys()
    for n in g0:
        assert (g_id[n] - g0[n]).abs().max() <= 1e-4 * g0[n].abs().max().clamp_min(1e-30), n


# --------------------------------------------------------------------------------------------------
# bodies that are listed, not rewritten


class _Cond(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x):
        h = self.a(x)
        return torch.cond(h.sum() > 0, lambda t: self.b(t), lambda t: t * 2, (h,))


def test_cond_branch_linears_are_listed_as_kept():
    model = _Cond()
    rep = fp8pass.explain(model, torch.randn(16, 32))
    assert rep.linears == ["a.weight"]
    assert len(rep.skipped) == 1 and rep.skipped[0][0] == "b.weight"
    assert "torch.cond" in rep.skipped[0][1] and "kept in high precision" in rep.skipped[0][1]
    # compiled: a in FP8, the cond branch as written
    be = fp8pass.backend(Config(compiler="aot_eager", fwd_format="identity", bwd_format="identity"))
    x = torch.randn(16, 32)
    torch.testing.assert_close(torch.compile(model, backend=be)(x), model(x))


class _Loop(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x):
        from torch._higher_order_ops.while_loop import while_loop

        h = self.a(x)
        return while_loop(lambda i, t: i < 3, lambda i, t: (i + 1, self.b(t)), (torch.zeros((), dtype=torch.int64), h))[1]


def test_while_loop_body_linears_are_listed_as_kept():
    with torch.no_grad():
        rep = fp8pass.explain(_Loop(), torch.randn(16, 32))
    assert rep.linears == ["a.weight"]
    assert len(rep.skipped) == 1 and rep.skipped[0][0] == "b.weight"
    assert "torch.while_loop" in rep.skipped[0][1] and "kept in high precision" in rep.skipped[0][1]


class _Flex(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(32, 96)

    def forward(self, x):
        from torch.nn.attention.flex_attention import flex_attention

        q, k, v = self.qkv(x).view(1, 16, 3, 2, 16).permute(2, 0, 3, 1, 4)
        return flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s * 0.5)


def test_flex_attention_is_listed_as_attention():
    # FlexAttention has no CPU backward in torch 2.13: explain traces it without grad
    with torch.no_grad():
        rep = fp8pass.explain(_Flex(), torch.randn(16, 32))
    assert rep.linears == ["qkv.weight"]
    assert len(rep.skipped) == 1 and rep.skipped[0][1].startswith("attention, kept (1 op")
