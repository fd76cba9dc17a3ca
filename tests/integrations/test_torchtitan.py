"""torchtitan trains with fp8pass through its own compile path (docs/integrations.md, "torchtitan").

torchtitan compiles each TransformerBlock with ``compile.backend`` (torchtitan.distributed.compile
``apply_compile``, called by every model's parallelize function after activation checkpointing and
before FSDP). These tests call that function with fp8pass's backend on a 2-layer torchtitan Llama 3
(fp8pass/testing/client_zoo.py: its debug flavor, SDPA inner attention since FlexAttention has no CPU
backward) and train it; skipped where torchtitan is not installed (the ``clients`` extra).
"""

import copy

import pytest
import torch

pytest.importorskip("torchtitan")

import _zoo_judge as J  # noqa: E402
from torchtitan.config import CompileConfig  # noqa: E402
from torchtitan.distributed.compile import apply_compile  # noqa: E402
from torchtitan.distributed.parallel_dims import ParallelDims  # noqa: E402

import fp8pass  # noqa: E402
from fp8pass.config import Config  # noqa: E402
from fp8pass.testing import client_zoo as C  # noqa: E402

_eager_casts = pytest.fixture(autouse=True)(J.eager_casts)

ONE_PROCESS = dict(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)


def _train(model, steps, ids):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        loss = C.loss_fn(model, ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_llama3_trains_through_torchtitans_apply_compile():
    model = C.build("torchtitan/llama3")
    reference = copy.deepcopy(model)
    be = fp8pass.backend(Config(compiler="aot_eager"))
    apply_compile(model, compile_config=CompileConfig(enable=True, backend=be), parallel_dims=ParallelDims(**ONE_PROCESS))
    ids = C.ids(4, 64)
    losses8 = _train(model, 4, ids)
    losses32 = _train(reference, 4, ids)

    rep = be.report()
    # one graph per TransformerBlock: wqkv, wo and the SwiGLU's w1/w3/w2 in FP8, the LM head outside (eager)
    assert rep.num_graphs == 2, str(rep)
    assert sorted(rep.linears) == sorted(f"layers.{i}.{w}.weight" for i in range(2) for w in (
        "attention.qkv_linear.wqkv", "attention.wo", "feed_forward.w1", "feed_forward.w3", "feed_forward.w2")), rep.linears
    assert len(rep.swiglus) == 2
    assert all(torch.isfinite(torch.tensor(losses8)))
    assert losses8[-1] < losses8[0] - 0.1, losses8
    for a, b in zip(losses8, losses32):  # the FP8 bound the HF zoo uses, at every step
        assert abs(a - b) <= 0.02 * b, (losses8, losses32)


def test_flex_attention_model_refuses_a_non_inductor_backend():
    """What docs/integrations.md says: torchtitan's apply_compile accepts only "inductor" and "aot_eager"
    for models that use FlexAttention (its regional-inductor scoop), so ``compile.backend = "fp8"``
    needs ``attn_backend="varlen"`` (CUDA) there. Fails (and the doc changes) if torchtitan lifts it."""
    from torchtitan.models.llama3 import model_registry

    cfg = model_registry("debugmodel", attn_backend="flex").model
    cfg.layers = cfg.layers[:1]
    model = cfg.build()
    with pytest.raises(ValueError, match="neither 'inductor' nor 'aot_eager'"):
        apply_compile(model, compile_config=CompileConfig(enable=True, backend="fp8"),
                      parallel_dims=ParallelDims(**ONE_PROCESS))


@pytest.mark.parametrize("ac", ["full", "selective"])
def test_llama3_with_torchtitans_activation_checkpointing_keeps_fp8(ac):
    """torchtitan wraps each block for activation checkpointing before compiling it (its llama3 debug
    config uses selective AC): the 10 linears must still be FP8."""
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    model = C.build("torchtitan/llama3")
    (FullAC if ac == "full" else SelectiveAC).Config().build().apply(model)
    be = fp8pass.backend(Config(compiler="aot_eager"))
    apply_compile(model, compile_config=CompileConfig(enable=True, backend=be), parallel_dims=ParallelDims(**ONE_PROCESS))
    C.loss_fn(model, C.ids()).backward()
    assert len(be.report().linears) == 10, str(be.report())
