"""Every private torch API fp8pass relies on still resolves and behaves on the installed torch.

One test per row of docs/runtime.md's table "Private torch APIs and the versions they were checked on":
when a torch upgrade moves or changes one, the failing test names it, instead of a failure deep in a
compile. The CUDA-only GEMMs are checked through their meta functions (never ``torch._scaled_mm`` on
CPU tensors).
"""

import importlib
import inspect

import pytest
import torch
import torch.nn.functional as F


def _resolve(path: str):
    """``"module:attr.attr"`` -> the object (raises if any part is missing)."""
    module, _, rest = path.partition(":")
    obj = importlib.import_module(module)
    for part in rest.split(".") if rest else ():
        obj = getattr(obj, part)
    return obj


def _meta_fp8(*shape, dtype=torch.float8_e4m3fn):
    return torch.empty(*shape, dtype=dtype, device="meta")


@pytest.mark.parametrize("b_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_scaled_mm_meta(b_dtype):
    """kernels/cuda.py's call: row-major a, column-major b, scalar scales, bias, out_dtype, fast accum."""
    a, b = _meta_fp8(32, 64), _meta_fp8(48, 64, dtype=b_dtype).t()
    one = torch.ones((), device="meta")
    bias = torch.empty(48, dtype=torch.bfloat16, device="meta")
    out = torch._scaled_mm(a, b, scale_a=one, scale_b=one, bias=bias, out_dtype=torch.bfloat16, use_fast_accum=True)
    assert out.shape == (32, 48) and out.dtype == torch.bfloat16


def test_scaled_grouped_mm_meta():
    """kernels/cuda.py's grouped call: row-wise scales [M] and [E, N], column-major expert weights, offs."""
    E, M, K, N = 4, 64, 32, 48
    x, w = _meta_fp8(M, K), _meta_fp8(E, N, K).transpose(-2, -1)
    offs = torch.tensor([16, 32, 48, 64], dtype=torch.int32, device="meta")
    out = torch._scaled_grouped_mm(x, w, torch.ones(M, device="meta"), torch.ones(E, N, device="meta"), offs=offs,
                                   out_dtype=torch.bfloat16)
    assert out.shape == (M, N) and out.dtype == torch.bfloat16


def test_grouped_mm_cpu():
    """The graph target passes/patterns.py matches; the tests' MoE models call it on CPU."""
    x, w = torch.randn(8, 16, dtype=torch.bfloat16), torch.randn(2, 16, 8, dtype=torch.bfloat16)
    out = torch._grouped_mm(x, w, offs=torch.tensor([3, 8], dtype=torch.int32))
    torch.testing.assert_close(out[:3], x[:3] @ w[0])
    torch.testing.assert_close(out[3:], x[3:] @ w[1])


def test_foreach_inplace_ops():
    t = [torch.zeros(3), torch.zeros(2)]
    torch._foreach_copy_(t, [torch.ones(3), torch.ones(2)])
    torch._foreach_add_(t, [torch.ones(3), torch.ones(2)])
    torch._foreach_mul_(t, 2.0)
    assert [x.tolist() for x in t] == [[4.0] * 3, [4.0] * 2]


def test_disable_autocast_guard():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch._C._DisableAutocast():
            assert (torch.randn(2, 2) @ torch.randn(2, 2)).dtype == torch.float32
        assert (torch.randn(2, 2) @ torch.randn(2, 2)).dtype == torch.bfloat16


def test_mkldnn_bf16_probe():
    assert isinstance(torch.ops.mkldnn._is_mkldnn_bf16_supported(), bool)


def test_op_overload_types_and_tags():
    assert isinstance(torch.ops.aten.mm.default, torch._ops.OpOverload)
    assert isinstance(torch.ops.aten.mm, torch._ops.OpOverloadPacket)
    assert torch.Tag.nondeterministic_seeded in torch.ops.aten.rand_like.default.tags
    assert torch.Tag.nondeterministic_seeded not in torch.ops.aten.mm.default.tags


def test_activation_backward_ops():
    """runtime/swiglu.py's backward ops, against autograd."""
    x = torch.randn(16, dtype=torch.float64, requires_grad=True)
    g = torch.randn(16, dtype=torch.float64)
    for op, fn in [(lambda: torch.ops.aten.silu_backward(g, x), F.silu),
                   (lambda: torch.ops.aten.gelu_backward(g, x, approximate="tanh"), lambda t: F.gelu(t, approximate="tanh")),
                   (lambda: torch.ops.aten.threshold_backward(g, F.relu(x), 0.0), F.relu)]:
        (expected,) = torch.autograd.grad(fn(x), x, g)
        torch.testing.assert_close(op(), expected)


def test_aten_overloads_of_the_fp8_all_gather_subclass():
    """The overloads distributed/fp8_all_gather.py's ``__torch_dispatch__`` handles by identity."""
    names = ["_pin_memory.default", "_to_copy.default", "alias.default", "as_strided.default", "chunk.default",
             "clone.default", "copy_.default", "detach.default", "empty_like.default", "new_zeros.default",
             "slice.Tensor", "split.Tensor", "split_with_sizes.default", "view.default"]
    for name in names:
        packet, overload = name.split(".")
        assert isinstance(getattr(getattr(torch.ops.aten, packet), overload), torch._ops.OpOverload), name
    assert callable(torch.Tensor._make_wrapper_subclass)


def test_library_custom_op_surface():
    from torch.library import Library, custom_op, opcheck

    Library("fp8pass_api_probe", "FRAGMENT")

    @custom_op("fp8pass_api_probe::twice", mutates_args=())
    def twice(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @twice.register_fake
    def _(x):
        return torch.empty_like(x)

    twice.register_autograd(lambda ctx, grad: grad * 2)
    # the two checks that need no compile (the aot_dispatch ones take ~30 s here; the ops' own tests run them)
    opcheck(twice, (torch.randn(3, requires_grad=True),), test_utils=("test_schema", "test_faketensor"))
    x = torch.randn(3, requires_grad=True)
    (grad,) = torch.autograd.grad(torch.ops.fp8pass_api_probe.twice(x).sum(), x)
    assert grad.tolist() == [2.0] * 3


@pytest.mark.parametrize("path", [
    "torch._dynamo:reset", "torch._dynamo:mark_dynamic", "torch._dynamo:explain",
    "torch._dynamo.config:recompile_limit", "torch._dynamo.exc:FailOnRecompileLimitHit", "torch._dynamo.exc:Unsupported",
    "torch._dynamo.config:skip_fwd_side_effects_in_bwd_under_checkpoint",
    "torch._dynamo.backends.registry:lookup_backend", "torch._dynamo.backends.debugging:ExplainWithBackend",
    "torch._dynamo.symbolic_convert:InstructionTranslator.current_tx", "torch._guards:TracingContext.try_get",
    "torch._inductor:list_mode_options", "torch._inductor.compile_fx:compile_fx", "torch._inductor.config:get_config_copy",
    "torch._higher_order_ops.wrap:wrap", "torch.utils.checkpoint:CheckpointPolicy.MUST_SAVE",
    "torch.autograd:Variable._execution_engine.queue_callback", "torch.serialization:_get_layout",
    "torch.utils._pytree:tree_map", "torch.utils.weak:WeakIdKeyDictionary", "torch.utils.weak:WeakTensorKeyDictionary",
    "torch.distributed.checkpoint:DefaultLoadPlanner", "torch.distributed.checkpoint:FileSystemReader",
    "torch.distributed.checkpoint:FileSystemWriter", "torch.distributed.checkpoint.api:CheckpointException",
    "torch.distributed.checkpoint.filesystem:FileSystem", "torch.distributed.checkpoint.metadata:Metadata",
    "torch.distributed.checkpoint.metadata:TensorStorageMetadata", "torch.distributed.checkpoint.metadata:StorageMeta",
    "torch.distributed.checkpoint.state_dict:get_state_dict", "torch.distributed.checkpoint.state_dict:set_state_dict",
    "torch.distributed._composable_state:_module_state_mapping",
    "torch.distributed.fsdp._fully_shard._fsdp_state:FSDPState",
    "torch.distributed.tensor.experimental:register_sharding", "torch.distributed.tensor.placement_types:Partial",
])
def test_private_name_resolves(path):
    assert _resolve(path) is not None


def test_graph_break_counter():
    """graph_breaks.py: Dynamo counts each break in ``counters["graph_break"]``, keyed by its reason."""
    from torch._dynamo.utils import counters

    def f(x):
        x = x + 1
        torch._dynamo.graph_break()
        return x * 2

    torch._dynamo.reset()
    before = dict(counters["graph_break"])
    torch.compile(f, backend="eager")(torch.randn(3))
    new = [r for r, n in counters["graph_break"].items() if n > before.get(r, 0)]
    assert len(new) == 1 and new[0].startswith("Call to `torch._dynamo.graph_break()`"), new
    torch._dynamo.reset()


def test_higher_order_ops():
    ho = torch.ops.higher_order
    for name in ("tag_activation_checkpoint", "wrap", "cond", "while_loop"):
        assert isinstance(getattr(ho, name), torch._ops.HigherOrderOperator), name


def test_config_patches():
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        assert torch._dynamo.config.fail_on_recompile_limit_hit
    from torch._functorch import config as functorch_config

    with functorch_config.patch(enable_autograd_cache=False):
        assert functorch_config.enable_autograd_cache is False
    from torch._inductor import list_mode_options

    assert list_mode_options("max-autotune-no-cudagraphs")["max_autotune"] is True


def test_fsdp2_internals():
    """The FSDP2 attributes distributed/fsdp.py, fp8_all_gather.py and passes/annotate.py read (by source:
    building a real FSDP state needs a process group)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_state

    state_src = inspect.getsource(_fsdp_state.FSDPState)
    assert "_fsdp_param_group" in state_src  # torch 2.11: one group; 2.12+: also _fsdp_param_groups (a list)
    param_src = inspect.getsource(_fsdp_param.FSDPParam)
    for name in ("mesh_info", "_unsharded_param", "sharded_param", "fsdp_pre_all_gather", "fsdp_post_all_gather"):
        assert name in param_src, name
    assert callable(torch.distributed.fsdp.FSDPModule._get_fsdp_state)


def test_compiled_wrapper_layout():
    """passes/uncompiled.py reads the backend and the original module out of torch.compile's wrappers
    (``OptimizedModule.dynamo_ctx``, ``_compiled_call_impl``, ``_torchdynamo_orig_backend``)."""
    from fp8pass.passes.uncompiled import compile_backend_of, original_callable

    def backend(gm, example_inputs):
        return gm.forward

    m = torch.nn.Linear(2, 2)
    wrapped = torch.compile(m, backend=backend)
    assert compile_backend_of(wrapped) is backend and original_callable(wrapped) is m
    inplace = torch.nn.Linear(2, 2)
    inplace.compile(backend=backend)
    assert inplace._compiled_call_impl is not None and compile_backend_of(inplace) is backend


def test_backend_sees_frame_and_node_meta():
    """Inside a backend: the frame's ``self`` (passes/names.py, via InstructionTranslator.current_tx) and
    the Dynamo node metadata passes/annotate.py reads."""
    from fp8pass.passes.names import frame_root

    seen = {}

    def backend(gm, example_inputs):
        seen["root"] = frame_root()
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                seen.setdefault("grapharg", node.meta.get("grapharg") is not None)
                seen.setdefault("example_value", isinstance(node.meta.get("example_value"), torch.Tensor))
            if node.op == "call_function" and node.target is F.linear:
                seen["nn_module_stack"] = bool(node.meta.get("nn_module_stack"))
        return gm.forward

    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    torch.compile(model, backend=backend)(torch.randn(1, 2))
    assert seen == {"root": model, "grapharg": True, "example_value": True, "nn_module_stack": True}
