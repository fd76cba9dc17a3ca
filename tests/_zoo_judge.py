"""How a zoo model is judged under the fp8 backend: the Hugging Face zoo (tests/integrations/test_hf_zoo.py) and the
client zoo (torchtitan / litgpt / torchtune, tests/integrations/test_client_zoo.py) both call ``judge``.

Per model: the identity format equals eager (loss to 1e-4, every gradient to ``identity_tolerance``
of its max: 1e-4 where the model's matmuls compute in fp32, more where its own code computes some in
bf16/fp16, see there); FP8 (E4M3 forward, E5M2 gradients) keeps the loss within 2% of eager; every parameter with an eager
gradient gets a compiled one; the gradient cosine per parameter group (the same parameter in every
layer) >= ``group_bound`` and over all parameters >= 0.98; explain's GLUs, expert stacks and linears
equal the counts from the module tree (``expected``, fp8pass/testing/hf_zoo.py ``expected_counts``); with
``account``, explain accounts for every matmul weight (tests/_accounting.py), and the count check takes
explain's "ran eagerly between graphs" entries (weights no graph takes) as listed.
"""

from __future__ import annotations

import re

import torch
from _accounting import assert_accounts_for_matmul_weights
from torch.utils._python_dispatch import TorchDispatchMode

import fp8pass
from fp8pass.config import Config

# The whole zoos (slow, HF and client) ask 0.98 of the concatenated gradient and 0.9 of each group: in tiny random
# models some groups' gradients are sums over many tokens of a small quantity (routers and gates that
# score tokens, learned positions, q_norm, DiffLlama's lambdas) and their FP8 noise is of the same size
# (measured 0.93-0.98 for a handful of groups, and it moves with the width). The fast subset keeps
# 0.98 per group; the identity-format check catches rewrite errors in both.
WHOLE_ZOO_GROUP_BOUND = 0.9


_MATMULS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm,
             torch.ops.aten._grouped_mm}


class _MatmulDtypes(TorchDispatchMode):
    """Records the output dtype of every matmul that runs under it (the dtype the model computes it in)."""

    def __init__(self):
        super().__init__()
        self.dtypes: set[torch.dtype] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in _MATMULS:
            self.dtypes.add(out.dtype)
        return out


def identity_tolerance(dtypes) -> float:
    """The identity format's gradient bound (relative to each gradient's max) for a model whose eager
    matmuls compute in ``dtypes``.

    fp32 (and fp64) matmuls: 1e-4, fp32 rounding of a graph that computes the original ops in another
    order. A model whose own code computes matmuls in a lower precision (torchtitan's MoE experts:
    ``torch._grouped_mm(x.bfloat16(), w.bfloat16()...)`` in an fp32 model): 2 machine epsilons of the
    coarsest such dtype (bf16: 2**-6 = 1.6e-2). The rewrite computes the same math there in that dtype,
    but not with the same roundings: the fused expert GLU (``fp8_grouped_swiglu_down``) evaluates
    ``act(gate) * up`` in fp32 and rounds its one result, where the eager code rounds the activation and
    the product to bf16 each, so the gradients differ by bf16 rounding (measured 0.88 eps at most,
    torchtitan qwen3_moe, docs/results/client_zoo.md). A single grouped GEMM is bit-exact.
    """
    eps = max((torch.finfo(d).eps for d in dtypes if d.is_floating_point), default=0.0)
    return max(1e-4, 2 * eps) if eps > torch.finfo(torch.float32).eps else 1e-4


def eager_casts(monkeypatch):
    """A fresh Dynamo around each zoo test, CPU casts unfused (as the zoo results were measured); each zoo
    test module makes it its autouse fixture: ``_eager_casts = pytest.fixture(autouse=True)(J.eager_casts)``."""
    monkeypatch.setenv("FP8PASS_CPU_FUSED", "0")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def group(name: str) -> str:
    """Parameters of the same kind in every layer form one group (``layers.*.self_attn.q_proj.weight``)."""
    return re.sub(r"\.\d+\.", ".*.", name)


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def compiled_run(model, loss_fn, ids, cfg):
    """(loss, gradients, explain report) of one compiled forward/backward under ``fp8pass.backend(cfg)``."""
    model.zero_grad()
    be = fp8pass.backend(cfg)
    loss = loss_fn(torch.compile(model, backend=be), ids)
    loss.backward()
    g = grads(model)
    model.zero_grad()
    report = be.report()
    torch._dynamo.reset()  # (which clears the backend's records)
    return loss.detach(), g, report


def judge(model, loss_fn, ids, *, group_bound: float = 0.98, expected=None, account: bool = False):
    """Judge ``model`` (fp32, train mode) on ``loss_fn(model, ids)``; returns the FP8 run's explain report.

    group_bound: least gradient cosine per parameter group (the whole gradient always needs 0.98).
    expected: the module tree's counts (``ExpectedCounts``); ``None`` skips the count checks.
    account: also assert that ``fp8pass.explain(model, ids)`` accounts for every matmul weight
        (``model(ids)`` must be the forward ``loss_fn`` runs); the HF zoo's is
        tests/passes/test_explain_accounting.py.
    """
    with _MatmulDtypes() as seen:
        loss0 = loss_fn(model, ids)
    tol = identity_tolerance(seen.dtypes)
    loss0.backward()
    g0 = grads(model)
    model.zero_grad()

    # identity format: the rewritten graphs compute the original math
    loss_id, g_id, _ = compiled_run(model, loss_fn, ids, Config(fwd_format="identity", bwd_format="identity",
                                                                 compiler="aot_eager", grad_stochastic_rounding=False))
    assert torch.allclose(loss_id, loss0, rtol=1e-4, atol=0), (loss_id, loss0)
    assert g_id.keys() == g0.keys(), set(g0) ^ set(g_id)
    for n in g0:
        scale = g0[n].abs().max().clamp_min(1e-30)
        assert (g_id[n] - g0[n]).abs().max() <= tol * scale, (n, tol)

    # FP8 (E4M3 forward, E5M2 gradients)
    fp8 = Config(compiler="aot_eager", grad_stochastic_rounding=False)
    loss8, g8, rep8 = compiled_run(model, loss_fn, ids, fp8)
    assert abs(loss8.item() - loss0.item()) <= 0.02 * abs(loss0.item())
    assert g8.keys() == g0.keys(), f"no compiled gradient for {sorted(set(g0) - set(g8))}"
    groups: dict[str, list] = {}
    for n in g0:
        groups.setdefault(group(n), []).append(n)
    total_norm = torch.cat([g.flatten().double() for g in g0.values()]).norm()
    for grp, names in groups.items():
        a = torch.cat([g0[n].flatten().double() for n in names])
        b = torch.cat([g8[n].flatten().double() for n in names])
        # a gradient that is zero in exact math (attention's key bias) is rounding noise in both runs
        if a.norm() > 1e-6 * total_norm:
            cos = torch.nn.functional.cosine_similarity(a, b, dim=0).item()
            assert cos >= group_bound, (grp, cos)
    every = [n for n in g0 if g0[n].norm() > 0]
    total = torch.nn.functional.cosine_similarity(torch.cat([g0[n].flatten().double() for n in every]),
                                                  torch.cat([g8[n].flatten().double() for n in every]), dim=0)
    assert total.item() >= 0.98, total

    # explain's accounting of the matmul weights (its own forward; the weights no graph takes are listed)
    outside = set()
    if account:
        outside = assert_accounts_for_matmul_weights(model, ids, config=fp8).outside
        torch._dynamo.reset()

    # explain's counts against the module tree
    if expected is None:
        return rep8
    assert len(rep8.swiglus) == expected.glus, str(rep8)
    assert len(rep8.experts) == expected.expert_stacks, str(rep8)
    dense = [w for w in rep8.linears if not any(w in e.weights for e in rep8.experts)]
    glu_weights = {w for s in rep8.swiglus for w in (s.gate, s.up, s.down)}
    # every other linear module (routers included) is FP8 or listed as kept with its weight and reason
    kept = {w for w, r in rep8.skipped if w.endswith(".weight") and "lm_head" not in w and "keep_high_precision" not in r}
    kept |= {w for w in outside if "lm_head" not in w}  # (a compile's report does not list them; explain's does)
    assert len([w for w in dense if w not in glu_weights]) + len(kept) == expected.linears + expected.routers, str(rep8)
    assert not rep8.graph_breaks, rep8.graph_breaks
    return rep8
