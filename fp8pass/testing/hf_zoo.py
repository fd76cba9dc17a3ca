"""The Hugging Face decoder zoo: every decoder-only ``*ForCausalLM`` architecture of the installed
transformers that builds from a tiny config with no downloads (plus GPT-2, the ``Conv1D`` case),
as test and benchmark infrastructure.

``zoo()`` lists the names, ``build(name)`` returns a seeded, dropout-free model in train mode,
``expected_counts(model)`` counts from the modules (not from graphs) what the fp8 rewriter should
find: GLU MLPs, expert stacks (3-D expert weights), plain linears, LM head, embeddings.

Left out on purpose: encoder stacks used as decoders (BERT/RoBERTa family), seq2seq decoders
(BART, Marian, Whisper, ...), multimodal/audio wrappers, and pure recurrent/state-space models;
see ``EXCLUDED`` for the reasons.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
import transformers

# Sizes every config gets where it has the field (constructor argument or attribute).
TINY = dict(
    vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=64, head_dim=16, max_position_embeddings=128,
    # MoE: 4 experts, top-2, small expert FFN, one shared expert
    moe_intermediate_size=32, num_experts=4, num_local_experts=4, n_routed_experts=4,
    num_experts_per_tok=2, moe_topk=2, n_shared_experts=1, shared_expert_intermediate_size=32,
    first_k_dense_replace=1, n_group=1, topk_group=1,
    # MLA (DeepSeek)
    kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    # GPT-2 / Bloom / MPT / Falcon style names
    n_layer=2, n_embd=64, n_head=4, n_positions=128, n_inner=64, d_model=64, n_heads=4, n_layers=2,
    ffn_hidden_size=64,
    pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=False,
)

# Per-architecture overrides on top of TINY (applied last).
OVERRIDES: dict[str, dict] = {
    # MLA: rope and head sizes are coupled (head_dim is the rope part); K/V come out of kv_b_proj with
    # all heads, so kv heads = heads (with 2, repeat_kv doubles them and SDPA fails under Dynamo)
    "DeepseekV3": dict(head_dim=8, num_key_value_heads=4),
    "DeepseekV2": dict(head_dim=8, num_key_value_heads=4),
    # hybrid Mamba/attention: 2 layers, attention at layer 0, MoE at layer 1
    "Jamba": dict(attn_layer_period=2, attn_layer_offset=0, expert_layer_period=2, expert_layer_offset=1,
                  mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8, use_mamba_kernels=False),
    # every layer MoE (default step 1), dense MLP size for the non-MoE path
    "Llama4": dict(intermediate_size=32, intermediate_size_mlp=64, interleave_moe_layer_step=1,
                   attention_chunk_size=16, no_rope_layers=[1, 1]),
    "GptOss": dict(intermediate_size=32, sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    "Mixtral": dict(intermediate_size=32),
    "GraniteMoe": dict(intermediate_size=32),
    "GraniteMoeShared": dict(intermediate_size=32),
    "Olmoe": dict(intermediate_size=32),
    "Phimoe": dict(intermediate_size=32),
    "JetMoe": dict(intermediate_size=32, num_key_value_heads=4, kv_channels=16),
    "MiniMax": dict(intermediate_size=32, layer_types=["full_attention", "full_attention"]),
}

# Class name when it is not ``<Name>ForCausalLM``; config class when not ``cls.config_class``.
CLASS_NAMES = {"GPT2": "GPT2LMHeadModel"}
CONFIG_CLASSES = {"Llama4": "Llama4TextConfig"}

DENSE = [
    "Llama", "Mistral", "Ministral", "Qwen2", "Qwen3", "Gemma", "Gemma2", "Gemma3", "VaultGemma",
    "Phi", "Phi3", "Cohere", "Cohere2", "Granite", "Olmo", "Olmo2", "Olmo3", "StableLm", "Starcoder2",
    "GPTNeoX", "Falcon", "Bloom", "OPT", "GPT2", "GPTBigCode", "Mpt", "Nemotron", "Persimmon", "Glm",
    "Glm4", "Helium", "SmolLM3", "Ernie4_5", "Exaone4", "Arcee", "Apertus", "BitNet", "SeedOss",
    "HunYuanDenseV1", "DiffLlama",
]
MOE = [
    "Mixtral", "Qwen2Moe", "Qwen3Moe", "GraniteMoe", "GraniteMoeShared", "DeepseekV2", "DeepseekV3",
    "Llama4", "Jamba", "GptOss", "Olmoe", "Phimoe", "JetMoe", "Dots1", "Glm4Moe", "Ernie4_5_Moe",
    "HunYuanMoEV1", "MiniMax", "FlexOlmo",
]

EXCLUDED = {
    "encoder stack as decoder": ["Bert", "Roberta", "XLMRoberta", "Camembert", "Electra", "Ernie", "RoFormer",
                                 "RemBert", "RoCBert", "MegatronBert", "Data2VecText", "BigBird", "Xmod"],
    "seq2seq decoder": ["Bart", "MBart", "Marian", "Pegasus", "PLBart", "Blenderbot", "BlenderbotSmall", "Mvp",
                        "Whisper", "TrOCR", "ProphetNet", "BigBirdPegasus"],
    "multimodal/audio": ["Git", "Fuyu", "Clvp", "Musicgen", "MusicgenMelody", "Moshi", "CsmDepthDecoder",
                         "Phi4Multimodal", "Mllama", "Emu3"],
    "recurrent/state-space": ["Rwkv", "Mamba", "Mamba2", "FalconMamba", "xLSTM", "RecurrentGemma"],
}


# The fast subset, one of each form the zoo covers (gated MLP, fused gate_up, Conv1D, two MoEs): the
# zoo tests and the explain accounting run these by default, the rest under the slow marker.
FAST = ["Llama", "Phi3", "GPT2", "Mixtral", "Llama4"]


def zoo(moe: bool | None = None) -> list[str]:
    """Architecture names (``build`` takes them); ``moe=True``/``False`` filters."""
    if moe is None:
        return DENSE + MOE
    return list(MOE if moe else DENSE)


def is_moe(name: str) -> bool:
    return name in MOE


def model_class(name: str):
    return getattr(transformers, CLASS_NAMES.get(name, f"{name}ForCausalLM"))


def config(name: str, layers: int = 2, **extra):
    """A tiny config for ``name``: TINY where the config has the field, then OVERRIDES, then ``extra``;
    every dropout probability 0 (eager and compiled runs comparable)."""
    cls = model_class(name)
    ccls = getattr(transformers, CONFIG_CLASSES[name]) if name in CONFIG_CLASSES else cls.config_class
    want = {**TINY, **OVERRIDES.get(name, {}), **extra}
    want["num_hidden_layers"] = want["n_layer"] = want["num_layers"] = want["n_layers"] = layers
    params = inspect.signature(ccls.__init__).parameters
    cfg = ccls(**{k: v for k, v in want.items() if k in params})
    for k, v in want.items():
        if k not in params and hasattr(cfg, k):
            try:
                setattr(cfg, k, v)
            except Exception:  # read-only / per-layer properties
                pass
    for k in list(vars(cfg)):
        if ("dropout" in k or "pdrop" in k) and isinstance(getattr(cfg, k), float):
            setattr(cfg, k, 0.0)
    return cfg


def build(name: str, layers: int = 2, dtype: torch.dtype = torch.float32, experts_impl: str | None = None,
          **config_overrides) -> torch.nn.Module:
    """``name``'s model from a tiny config, seeded (``torch.manual_seed(0)``), in train mode.

    experts_impl: for MoE models, the transformers experts implementation ("eager" per-expert loop,
    "grouped_mm", "batched_mm"); ``None`` keeps transformers' default (``grouped_mm`` where it
    dispatches, which under Dynamo in fp32 is ``torch.ops.transformers.grouped_mm_fallback``).
    """
    cfg = config(name, layers, **config_overrides)
    torch.manual_seed(0)
    model = model_class(name)(cfg)
    if experts_impl is not None:
        if not hasattr(model, "set_experts_implementation"):
            raise ValueError(f"{name} has no set_experts_implementation")
        model.set_experts_implementation(experts_impl)
    return model.to(dtype).train()


def experts_implementation(model) -> str | None:
    return getattr(model.config, "_experts_implementation", None)


def loss_fn(model, ids: torch.Tensor) -> torch.Tensor:
    """Next-token-free LM loss used by tests and the survey (cross entropy of logits vs ids)."""
    out = model(ids)
    logits = out.logits if hasattr(out, "logits") else out[0]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())


def ids(batch: int = 2, seq: int = 16, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (batch, seq), generator=g)


# ----------------------------------------------------------------------------------------------
# expected counts, from the modules

_GLU_NAMES = [("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"), ("gate_up_proj", None, "down_proj"),
              ("wi_0", "wi_1", "wo"), ("fc_1", "fc_2", "proj")]  # the last: litgpt (fp8pass/testing/client_zoo.py)


@dataclass
class ExpectedCounts:
    """What the module tree holds (the fp8 rewriter's targets), counted without tracing.

    glus: dense GLU MLP modules (gate/up/down or fused gate_up + down, 2-D weights; shared experts
        included). fused_glus: those with a fused gate_up projection (of ``glus``).
    expert_stacks: modules holding 3-D expert weights (one per MoE layer's experts).
    expert_weights: the 3-D weight tensors (e.g. 2 per stack: gate_up [E, 2F, H] and down [E, H, F]).
    routers: the router/gate projections of the MoE layers (2-D, [E, H]).
    linears: nn.Linear / Conv1D modules outside GLUs and expert stacks, routers and LM head excluded.
    conv1d: how many of ``linears`` are transformers' GPT-2 style ``Conv1D`` (weight [in, out]).
    lm_head: 1 if there is a separate output projection; tied: it shares the embedding weight.
    embeddings: nn.Embedding modules.
    """
    glus: int = 0
    fused_glus: int = 0
    expert_stacks: int = 0
    expert_weights: int = 0
    routers: int = 0
    linears: int = 0
    conv1d: int = 0
    lm_head: int = 0
    tied: bool = False
    embeddings: int = 0
    glu_names: list = field(default_factory=list, repr=False)
    expert_names: list = field(default_factory=list, repr=False)


def _is_linear(m) -> bool:
    from transformers.pytorch_utils import Conv1D
    return isinstance(m, (torch.nn.Linear, Conv1D))


def _weight2d(m, attr) -> bool:
    """``m.attr`` is a 2-D projection: a Linear/Conv1D child or a 2-D parameter."""
    c = getattr(m, attr, None)
    if isinstance(c, torch.nn.Module):
        return _is_linear(c) or (isinstance(getattr(c, "weight", None), torch.Tensor) and c.weight.dim() == 2)
    return isinstance(c, torch.Tensor) and c.dim() == 2


def expected_counts(model: torch.nn.Module, output: torch.nn.Module | None = None) -> ExpectedCounts:
    """output: the LM head module of a model without ``get_output_embeddings`` (fp8pass/testing/client_zoo.py)."""
    from transformers.pytorch_utils import Conv1D
    c = ExpectedCounts()
    covered: set[str] = set()  # module names counted as part of a GLU / expert stack / router
    mods = dict(model.named_modules())

    # expert stacks: owners of 3-D parameters; sibling owners of one 3-D weight each (GraniteMoe's
    # input_linear / output_linear) are one stack, their parent.
    owners: dict[str, list[str]] = {}
    for pname, p in model.named_parameters():
        mod, _, _ = pname.rpartition(".")
        if p.dim() == 3 and not isinstance(mods[mod], torch.nn.modules.conv._ConvNd):  # Mamba's conv1d
            owners.setdefault(mod, []).append(pname)
    stacks: dict[str, list[str]] = {}
    for mod, ps in owners.items():
        parent = mod.rpartition(".")[0]
        key = parent if len(ps) == 1 and sum(o.rpartition(".")[0] == parent for o in owners) > 1 else mod
        stacks.setdefault(key, []).extend(ps)
    c.expert_stacks = len(stacks)
    c.expert_weights = sum(len(v) for v in stacks.values())
    c.expert_names = sorted(stacks)
    for key in stacks:
        covered |= {n for n in mods if n == key or n.startswith(key + ".")}

    # GLU MLPs
    for name, m in mods.items():
        if name in covered:
            continue
        for gate, up, down in _GLU_NAMES:
            if _weight2d(m, gate) and _weight2d(m, down) and (up is None or _weight2d(m, up)):
                c.glus += 1
                c.fused_glus += up is None
                c.glu_names.append(name)
                covered |= {f"{name}.{a}" for a in (gate, up, down) if a}
                break

    # routers: the gate/router of a module that holds an expert stack
    for key in stacks:
        parent = key.rpartition(".")[0]
        for n, m in mods.items():
            if n.rpartition(".")[0] == parent and n.rpartition(".")[2] in ("gate", "router") and n not in covered:
                w = getattr(m, "weight", None)
                if isinstance(w, torch.Tensor) and w.dim() == 2:
                    c.routers += 1
                    covered |= {x for x in mods if x == n or x.startswith(n + ".")}

    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else output
    inp = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if out is not None:
        c.lm_head = 1
        c.tied = inp is not None and out.weight is inp.weight
    for name, m in mods.items():
        if m is out or name in covered:
            continue
        if _is_linear(m):
            c.linears += 1
            c.conv1d += isinstance(m, Conv1D)
        elif isinstance(m, torch.nn.Embedding):
            c.embeddings += 1
    return c


# ----------------------------------------------------------------------------------------------
# diagnosing an FP8 gradient gap (docs/results/hf_zoo.md, FlexOlmo)

WIDER = dict(hidden_size=128, n_embd=128, d_model=128, intermediate_size=256, n_inner=256)


def gradient_cosines(name: str, cfg=None, **config_overrides) -> tuple[dict[str, float], float]:
    """(cosine of the compiled run's gradient to eager fp32 per parameter group, over all parameters)
    for ``name`` at the zoo test's sizes (``WIDER``, ids (4, 128)); ``cfg`` defaults to the test's FP8 Config."""
    import re

    import fp8pass
    from fp8pass.config import Config

    cfg = cfg or Config(compiler="aot_eager", grad_stochastic_rounding=False)
    model = build(name, **{**WIDER, "router_jitter_noise": 0.0, "input_jitter_noise": 0.0, **config_overrides})
    batch = ids(4, 128)

    def grads(m):
        return {n: p.grad.detach().double().flatten() for n, p in m.named_parameters() if p.grad is not None}

    loss_fn(model, batch).backward()
    g0 = grads(model)
    model.zero_grad()
    torch._dynamo.reset()
    loss_fn(torch.compile(model, backend=fp8pass.backend(cfg)), batch).backward()
    g8 = grads(model)
    torch._dynamo.reset()
    groups: dict[str, list[str]] = {}
    for n in g0:
        groups.setdefault(re.sub(r"\.\d+\.", ".*.", n), []).append(n)
    cos = torch.nn.functional.cosine_similarity
    per_group = {k: cos(torch.cat([g0[n] for n in ns]), torch.cat([g8[n] for n in ns]), dim=0).item()
                 for k, ns in groups.items()}
    return per_group, cos(torch.cat(list(g0.values())), torch.cat([g8[n] for n in g0]), dim=0).item()


def routing_changes(name: str, cfg=None, **config_overrides) -> list[tuple[float, float]]:
    """Per MoE layer: (fraction of tokens whose top-k expert set differs between eager fp32 and the
    compiled forward, relative error of the router logits), at the zoo test's sizes."""
    import fp8pass
    from fp8pass.config import Config

    cfg = cfg or Config(compiler="aot_eager")
    model = build(name, **{**WIDER, "router_jitter_noise": 0.0, "input_jitter_noise": 0.0, **config_overrides})
    batch = ids(4, 128)
    k = model.config.num_experts_per_tok
    with torch.no_grad():
        eager = model(batch, output_router_logits=True).router_logits
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=fp8pass.backend(cfg))(batch, output_router_logits=True).router_logits
        torch._dynamo.reset()
    out = []
    for a, b in zip(eager, compiled):
        top_a, top_b = (t.topk(k, -1).indices.sort(-1).values for t in (a, b))
        out.append(((top_a != top_b).any(-1).float().mean().item(), ((a - b).norm() / a.norm()).item()))
    return out


if __name__ == "__main__":  # python -m fp8pass.testing.hf_zoo FlexOlmo [num_experts_per_tok=4 ...]
    import os
    import sys

    os.environ.setdefault("FP8PASS_CPU_FUSED", "0")  # as tests/integrations/test_hf_zoo.py runs
    arch = sys.argv[1]
    overrides = {k: int(v) for k, v in (a.split("=") for a in sys.argv[2:])}
    groups, total = gradient_cosines(arch, **overrides)
    for grp, c in groups.items():
        print(f"{grp:55s} {c:.4f}")
    print(f"{'all parameters':55s} {total:.4f}")
    if is_moe(arch) and hasattr(build(arch).config, "num_experts_per_tok"):
        for i, (changed, rel) in enumerate(routing_changes(arch, **overrides)):
            print(f"MoE layer {i}: top-k expert set changed for {changed:.1%} of tokens, router logits rel. error {rel:.3f}")
