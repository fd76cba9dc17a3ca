"""The two forms in which Dynamo records tensor parallel's DTensor conversions, as annotate classifies them.

torch 2.13 records the calls themselves (``DTensor.from_local(x, mesh, placements, run_check=False)``, the
methods ``redistribute`` / ``to_local``); torch 2.11 records a call of a wrapper it makes per call site
(``prim from_local``, ``prim_redistribute``, ``prim_to_local``, in ``torch._dynamo.variables``) that keeps
the non-tensor arguments in its closure. The whole TP GLU match on a real graph of each torch is in
tests/distributed/test_tensor_parallel.py; here the classification, runnable on either torch.
"""

import pytest
import torch
from torch import fx

from fp8pass.passes.annotate import dtensor_call, has_side_effects


def _wrapper(name: str, module: str, **kwargs_as_value):
    """A wrapper built as Dynamo 2.11 builds one: the call's keyword arguments live in its closure."""

    def fn(x):
        return x.to_local(**kwargs_as_value)

    fn.__name__, fn.__module__ = name, module
    return fn


def _call(graph: fx.Graph, x: fx.Node, target, op: str = "call_function", **kwargs) -> fx.Node:
    return graph.create_node(op, target, (x,), kwargs)


def test_dynamo_wrappers_are_the_conversions_they_wrap():
    graph = fx.Graph()
    x = graph.placeholder("x")
    wrapped = {conversion: _call(graph, x, _wrapper(name, module, run_check=False))
               for conversion, name, module in (("from_local", "prim from_local", "torch._dynamo.variables.torch"),
                                                ("redistribute", "prim_redistribute", "torch._dynamo.variables.tensor"),
                                                ("to_local", "prim_to_local", "torch._dynamo.variables.tensor"))}
    for conversion, node in wrapped.items():
        assert dtensor_call(node) == conversion
        assert not has_side_effects(node), conversion  # matchable, and removable once unused, as the calls
    # the method forms
    assert dtensor_call(_call(graph, x, "to_local", op="call_method")) == "to_local"
    assert dtensor_call(_call(graph, x, "redistribute", op="call_method")) == "redistribute"
    # a function of the same name outside Dynamo is not one
    assert dtensor_call(_call(graph, x, _wrapper("prim_to_local", "mylib"))) is None
    assert dtensor_call(_call(graph, x, torch.relu)) is None


def test_a_from_local_that_runs_its_check_keeps_its_side_effects_in_either_form():
    graph = fx.Graph()
    x = graph.placeholder("x")
    checked = _call(graph, x, _wrapper("prim from_local", "torch._dynamo.variables.torch", run_check=True))
    assert dtensor_call(checked) == "from_local" and has_side_effects(checked)

    def unreadable(x):  # a wrapper whose closure has no keyword arguments: counted as running the check
        return x

    unreadable.__name__, unreadable.__module__ = "prim from_local", "torch._dynamo.variables.torch"
    assert has_side_effects(_call(graph, x, unreadable))


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")
def test_the_from_local_call_itself_has_effects_only_with_its_check():
    from torch.distributed.tensor import DTensor

    graph = fx.Graph()
    x = graph.placeholder("x")
    assert has_side_effects(_call(graph, x, DTensor.from_local, run_check=True))
    plain = _call(graph, x, DTensor.from_local, run_check=False)
    assert dtensor_call(plain) == "from_local" and not has_side_effects(plain)
