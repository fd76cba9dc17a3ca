"""CPU check that a compiled FP8 step can be captured as a CUDA graph (issue 28, item 3).

Inductor captures a graph under ``mode="reduce-overhead"`` unless it finds a reason to skip: a mutated
graph input that is not static (its address may change between replays), a cudagraph-unsafe node, a
data-dependent (unbacked) shape, a host read. On CPU Inductor never tries (no CUDA), so this test applies
the same rules to the graphs the fp8 backend hands Inductor, taken where Inductor compiles them: every
mutated placeholder (the delayed-scaling states, recorded in place) must be one of the graph's static
inputs, no node may be cudagraph-unsafe or have unbacked sizes, no node may read a value to the host, and
no tensor constant may be baked into the graph (it would live on the CPU). On a GPU the same step is
captured for real by tests/gpu/test_host_sync_gpu.py (no ``cudagraph_skips``, state kept in place).
"""


import pytest
import torch
from torch._inductor import compile_fx as inductor_compile_fx
from torch._inductor.utils import get_first_incompatible_cudagraph_node

import fp8pass
from fp8pass.testing.models import tiny_titan_llama

HOST_READS = {"aten._local_scalar_dense.default", "aten.item.default", "aten.is_nonzero.default",
              "aten.equal.default"}


def _mutated_placeholders(gm: torch.fx.GraphModule) -> set[int]:
    """Indices of the placeholders an op of the graph writes (schema alias annotations ``(a!)``)."""
    index = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    written = set()
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        if schema is None:
            continue
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            for v in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(v, torch.fx.Node) and v in index:
                    written.add(index[v])
    return written


def _graphs_of_a_compiled_step(monkeypatch, model, inputs, cfg):
    """(is_backward, GraphModule, static input indices) of each graph Inductor compiles for two steps."""
    seen = []
    real = inductor_compile_fx._compile_fx_inner

    def spy(gm, example_inputs, **kwargs):
        seen.append((bool(kwargs.get("is_backward")), gm, tuple(kwargs.get("static_input_idxs", ()))))
        return real(gm, example_inputs, **kwargs)

    monkeypatch.setattr(inductor_compile_fx, "_compile_fx_inner", spy)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=fp8pass.backend(cfg), mode="reduce-overhead")
    for _ in range(2):
        compiled(*inputs).float().sum().backward()
    return seen


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_compiled_step_graphs_meet_inductors_cuda_graph_rules(monkeypatch, recipe):
    scaling = fp8pass.DelayedScaling() if recipe == "delayed" else fp8pass.CurrentScaling()
    cfg = fp8pass.Config(recipe=scaling, keep_high_precision=(), min_dim=16)
    graphs = _graphs_of_a_compiled_step(monkeypatch, tiny_titan_llama(n_layers=1), (torch.randint(0, 128, (2, 16)),), cfg)
    assert {bwd for bwd, _, _ in graphs} == {False, True}
    fp8_ops = 0
    mutated_total = 0
    for is_backward, gm, static in graphs:
        targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
        fp8_ops += sum(t.startswith("fp8pass.") for t in targets)
        mutated = _mutated_placeholders(gm)
        mutated_total += len(mutated)
        assert mutated <= set(static), (f"{'backward' if is_backward else 'forward'} graph mutates non-static "
                                        f"inputs {sorted(mutated - set(static))}: Inductor would skip the CUDA graph")
        assert get_first_incompatible_cudagraph_node(gm) is None
        assert not HOST_READS & set(targets)
        constants = [n.target for n in gm.graph.nodes
                     if n.op == "get_attr" and isinstance(getattr(gm, n.target, None), torch.Tensor)]
        assert constants == []
    assert fp8_ops > 0  # the FP8 ops are in these graphs
    # delayed scaling records its states in place, inside the graphs; under either recipe the backward
    # advances the weights' stochastic-rounding streams (fp8pass/runtime/sr.py) in place
    assert mutated_total > 0


def test_the_check_finds_a_mutated_non_static_input(monkeypatch):
    """The rule has teeth: a model that writes into its (non-static) input in place is reported."""

    class WritesInput(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(32, 32)

        def forward(self, x):
            x.mul_(2)
            return self.lin(x)

    graphs = _graphs_of_a_compiled_step(monkeypatch, WritesInput(), (torch.randn(4, 32),),
                                        fp8pass.Config(keep_high_precision=(), min_dim=16))
    forward = [(gm, static) for bwd, gm, static in graphs if not bwd]
    assert any(_mutated_placeholders(gm) - set(static) for gm, static in forward)
