"""The client zoo: tiny models built from other training stacks' own model code (torchtitan 0.3.0,
litgpt 0.5.13, torchtune 0.6.1), as test infrastructure beside the Hugging Face zoo (fp8pass/testing/hf_zoo.py).

``zoo()`` lists the names (``<stack>/<model>``), ``available(name)`` says whether the stack is installed,
``build(name)`` returns a seeded fp32 model in train mode, ``loss_fn(model, ids)`` its LM loss on
``ids(...)`` (the stacks' models return logits). Counting what the fp8 rewriter should find is
fp8pass/testing/hf_zoo.py's ``expected_counts`` (the module names below are among its GLU names).

What differs from each stack's training run, and why:

- torchtitan: its language models attend with FlexAttention (no backward on CPU) or varlen attention
  (CUDA only); each layer's inner attention is swapped for torchtitan's own ``ScaledDotProductAttention``
  (causal). With one document per sequence that is the same math as its block-causal mask. The debug
  flavors keep their width (dim 256) but 2 layers, and MoE layers 4 experts (top-2, expert FFN 64).
- litgpt, torchtune: their component builders / ``Config`` with tiny sizes; no weights downloaded.
  torchtune's embedding is re-initialised with std 0.02 (see ``_torchtune``).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util

import torch

from fp8pass.testing import hf_zoo as _hf_zoo

VOCAB = 128


def ids(batch: int = 2, seq: int = 32, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, seq), generator=g)


def loss_fn(model, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy. (The HF zoo's same-position loss is trivial for a tied LM head whose
    embedding is not small: torchtune's tied llama3_2 scores its input token and the loss is 0.)"""
    logits = model(ids)
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


# ----------------------------------------------------------------------------------------------
# torchtitan

def _titan_config(family: str, flavor: str, layers: int = 2):
    """The flavor's model config from torchtitan's registry, with 2 layers, SDPA, 4 experts."""
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention, VarlenAttention
    from torchtitan.models.common.moe import GroupedExperts, TokenChoiceTopKRouter

    cfg = importlib.import_module(f"torchtitan.models.{family}").model_registry(flavor).model
    cfg.layers = cfg.layers[:layers]

    def shrink(node):
        if isinstance(node, (list, tuple)):
            for v in node:
                shrink(v)
        if not dataclasses.is_dataclass(node):
            return
        for f in dataclasses.fields(node):
            v = getattr(node, f.name)
            if isinstance(v, (FlexAttention.Config, VarlenAttention.Config)):
                setattr(node, f.name, ScaledDotProductAttention.Config())
            elif f.name == "num_experts" and isinstance(v, int):
                setattr(node, f.name, 4)
            elif f.name == "top_k" and isinstance(v, int):
                setattr(node, f.name, min(v, 2))
            elif f.name == "hidden_dim" and isinstance(node, GroupedExperts.Config):
                setattr(node, f.name, 64)
            elif f.name == "gate" and isinstance(node, TokenChoiceTopKRouter.Config):
                v.out_features = 4  # the router's scores: one per expert
            else:
                shrink(v)

    shrink(cfg)
    return cfg


def _titan(family: str, flavor: str = "debugmodel"):
    def build() -> torch.nn.Module:
        cfg = _titan_config(family, flavor)
        torch.manual_seed(0)
        model = cfg.build()
        model.init_states()
        return model
    return build


# ----------------------------------------------------------------------------------------------
# litgpt

_LITGPT_TINY = dict(block_size=64, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=64,
                    n_query_groups=2, head_size=16, intermediate_size=128, norm_class_name="RMSNorm", bias=False,
                    rotary_percentage=1.0, parallel_residual=False)


def _litgpt(mlp_class_name: str, **extra):
    def build() -> torch.nn.Module:
        from litgpt.config import Config
        from litgpt.model import GPT

        torch.manual_seed(0)
        return GPT(Config(**{**_LITGPT_TINY, "mlp_class_name": mlp_class_name, **extra}))
    return build


# ----------------------------------------------------------------------------------------------
# torchtune

_TUNE_TINY = dict(vocab_size=VOCAB, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64, max_seq_len=128,
                  intermediate_dim=128)


def _torchtune(module: str, builder: str, **extra):
    def build() -> torch.nn.Module:
        fn = getattr(importlib.import_module(f"torchtune.models.{module}._component_builders"), builder)
        torch.manual_seed(0)
        model = fn(**{**_TUNE_TINY, **extra})
        # torchtune's models expect a checkpoint; its embedding keeps nn.Embedding's N(0, 1), which behind
        # a tied LM head saturates the softmax (gradients ~1e-14). HF's initialisation, std 0.02:
        torch.nn.init.normal_(model.tok_embeddings.weight, std=0.02)
        return model
    return build


# ----------------------------------------------------------------------------------------------

BUILDERS = {
    "torchtitan/llama3": _titan("llama3"),
    "torchtitan/qwen3": _titan("qwen3"),
    "torchtitan/qwen3_moe": _titan("qwen3", "debugmodel_moe"),
    "torchtitan/deepseek_v3": _titan("deepseek_v3"),
    "litgpt/LLaMAMLP": _litgpt("LLaMAMLP"),
    "litgpt/GemmaMLP": _litgpt("GemmaMLP", gelu_approximate="tanh"),
    "litgpt/LLaMAMoE": _litgpt("LLaMAMoE", n_expert=4, n_expert_per_token=2, moe_intermediate_size=32),
    "torchtune/llama3_2": _torchtune("llama3_2", "llama3_2"),
    # torchtune's qwen2_5 model builders call the qwen2 component builder (biased q/k/v, untied output)
    "torchtune/qwen2_5": _torchtune("qwen2", "qwen2"),
    "torchtune/mistral": _torchtune("mistral", "mistral"),
    "torchtune/phi3": _torchtune("phi3", "phi3"),
    "torchtune/gemma": _torchtune("gemma", "gemma", head_dim=16),
}

# Not in the zoo, and why (docs/results/client_zoo.md).
EXCLUDED = {
    "torchtitan/gpt_oss": "its eager fp32 forward fails in torchtitan's own code: the experts compute in bf16 "
                          "(w.transpose(-2, -1).bfloat16()) and the combine's scatter_add into the fp32 output "
                          "raises 'Expected self.dtype to be equal to src.dtype'; its attention sinks also need "
                          "FlexAttention's / varlen's log-sum-exp, which SDPA does not return",
    "torchtitan/llama4": "torchtitan 0.3.0 ships no llama4 model (torchtitan.models has llama3, qwen3, qwen3_5, "
                         "deepseek_v3, gpt_oss, kimi_k2_7, flux, muse_glimmer)",
}


# How each stack is installed (the client zoo skips a stack that is not).
INSTALL = {
    "torchtitan": "pip install -e '.[test,clients]' -c constraints-test.txt",
    "torchtune": "pip install -e '.[test,clients]' -c constraints-test.txt",
    "litgpt": "pip install litgpt==0.5.13 into an environment of its own: it caps huggingface_hub < 1.4, which "
              "transformers 5.24 cannot import (pyproject.toml, clients)",
}


def zoo() -> list[str]:
    return list(BUILDERS)


def stack(name: str) -> str:
    return name.split("/", 1)[0]


def available(name: str) -> bool:
    """The stack is installed and imports (torchtune needs torchao; see docs/results/client_zoo.md)."""
    if importlib.util.find_spec(stack(name)) is None:
        return False
    try:
        importlib.import_module(stack(name))
    except ImportError:
        return False
    return True


def build(name: str) -> torch.nn.Module:
    return BUILDERS[name]().float().train()


def output_module(model: torch.nn.Module) -> torch.nn.Module | None:
    """The LM head (``expected_counts``'s ``output``): torchtitan's and litgpt's ``lm_head``, torchtune's
    ``output`` (``None`` where it is tied: torchtune's ``TiedLinear`` is no module)."""
    for name in ("lm_head", "output"):
        m = getattr(model, name, None)
        if isinstance(m, torch.nn.Module):
            return m
    return None


def expected_counts(model: torch.nn.Module):
    """fp8pass/testing/hf_zoo.py's counts from the module tree, with this stack's LM head."""
    return _hf_zoo.expected_counts(model, output_module(model))
