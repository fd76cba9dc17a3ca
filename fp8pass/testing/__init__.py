"""Model fixtures shared by the tests, the benchmarks and the experiments (not part of the training API).

- ``fp8pass.testing.models``: tiny modules, one per GLU form real code uses, and a torchtitan-style Llama.
- ``fp8pass.testing.hf_zoo``: the Hugging Face decoder zoo (needs ``transformers``).
- ``fp8pass.testing.client_zoo``: tiny models from torchtitan / litgpt / torchtune's own model code.

Import the submodule you need; this package imports none of them, so ``transformers`` and the client
stacks load only when their zoo is used.
"""
