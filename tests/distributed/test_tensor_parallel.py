"""Tensor parallel (DTensor) with backend fp8: the ops' sharding rules, and FSDP2 x TP on a 2 x 2 mesh.

The 4-process test carries the ``distributed`` and ``slow`` markers (``python -m pytest -m distributed
tests/distributed/test_tensor_parallel.py``); its single-process twin (a 1 x 1 mesh: every op dispatched through
DTensor) and the rule checks run in the default suite.
"""

import _dist
import _dist_tp
import pytest
import torch

# FP8 bound for the loss of a 3-step run: the sharded run differs from one process in its first step's
# bootstrap scales (each rank casts its shard with the shard's own amax) and in summation orders.
LOSS_RTOL = 5e-3


@pytest.fixture(autouse=True)
def _eager_cpu_casts(monkeypatch):
    # the compiled CPU cast recompiles per shape inside aot_eager graphs; eager casts give the same bits
    monkeypatch.setenv("FP8PASS_CPU_FUSED", "0")


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
def test_fsdp2_x_tensor_parallel_2x2_matches_single_process(tmp_path, sequence_parallel):
    """dp=2 x tp=2 (4 gloo ranks), norms sequence parallel or not: losses within the FP8 bound of one process
    on the global batch, every rank's scaling state bit-identical after every step, FP8 all-gather of the
    FSDP2 weights kept."""
    outs = _dist.spawn(_dist_tp.mesh_worker, 4, tmp_path, 2, 2, sequence_parallel, True)
    ref = _dist_tp.single_process()
    _check_mesh_run(outs, ref, tp=2)


def test_single_process_twin_1x1_mesh(tmp_path):
    """The same program on a 1 x 1 mesh (every fp8pass op dispatched through DTensor, FSDP2 with FP8
    all-gather on one rank): the single-process twin of the 2 x 2 test, with the same checks. FSDP2
    re-gathers the weights in place for backward on one rank too, so the backend keeps their forward
    codes (``weight_may_be_regathered``) instead of recasting them (autograd's version check failed)."""
    outs = _dist.spawn(_dist_tp.mesh_worker, 1, tmp_path, 1, 1, False, True)
    ref = _dist_tp.single_process()
    _check_mesh_run(outs, ref, tp=1)


def test_glu_fused_through_the_tp_hooks_1x1_mesh(tmp_path):
    """explain on a 1 x 1 mesh: the SwiGLU seen through ColwiseParallel's ``redistribute().to_local()`` and
    RowwiseParallel's ``from_local`` is one fused GLU, with and without sequence parallel (as without TP);
    plans that gather gate/up before the product are listed "not fused" with their reason, never silent."""
    (out,) = _dist.spawn(_dist_tp.explain_worker, 1, tmp_path)
    for plan in ("tp", "tp_sp"):
        assert out[plan]["swiglus"] == ["mlp.down.weight"], (plan, out[plan])
        assert out[plan]["not_fused"] == [], (plan, out[plan])
        assert len(out[plan]["linears"]) == 7, (plan, out[plan])  # q, k, v, o, gate, up + the GLU's down
    gathered = out["gathered"]
    assert gathered["swiglus"] == [] and len(gathered["not_fused"]) == 1, gathered
    assert "mlp" in gathered["not_fused"][0] and "tensor parallel form not recognised" in gathered["not_fused"][0]
    redistributed = out["redistributed"]
    assert redistributed["swiglus"] == [] and len(redistributed["not_fused"]) == 1, redistributed
    assert "tensor parallel: the gate projection's output is redistributed" in redistributed["not_fused"][0]


def test_dtensor_conversions_are_named_in_the_form_this_torch_records(tmp_path):
    """Dynamo records a TP hook's ``from_local`` / ``redistribute`` / ``to_local`` as the calls (torch 2.13) or
    as per-call wrappers (torch 2.11); ``annotate.dtensor_call`` names each in either, none with side
    effects (so the patterns may match them)."""
    (out,) = _dist.spawn(_dist_tp.conversions_worker, 1, tmp_path)
    assert out["nodes"] == [("from_local", False), ("redistribute", False), ("to_local", False), (None, False)], out


def _check_mesh_run(outs, ref, tp: int):
    n_blocks = _dist_tp.LAYERS
    out = outs[0]
    # every linear of every block is FP8, and each block's SwiGLU is fused (swiglu_down, Smooth-SwiGLU)
    # through the TP hooks' DTensor to_local / from_local calls, as in the one-process run
    assert len(out["fp8_linears"]) == 7 * n_blocks, out["fp8_linears"]
    assert out["swiglus"] == ref["swiglus"] == [f"layers.{i}.mlp.down.weight" for i in range(n_blocks)], (out["swiglus"], ref["swiglus"])
    torch.testing.assert_close(torch.tensor(out["loss"]), torch.tensor(ref["loss"]), rtol=LOSS_RTOL, atol=0)
    # every rank's state (scale, history, steps) equal: weights sharded over TP and over FSDP agree
    for r, o in enumerate(outs[1:], 1):
        for step in range(_dist_tp.STEPS):
            a, b = out["states"][step], o["states"][step]
            assert a.keys() == b.keys() and len(a) == len(ref["states"][step])
            for k in a:
                assert torch.equal(a[k], b[k]), f"step {step}: {k} differs between rank 0 and rank {r}"
    # one amax reduction per step, over the whole mesh (one rank: none needed)
    assert out["reductions"] == (_dist_tp.STEPS if len(outs) > 1 else 0)
    # FSDP2 all-gathers the FP8-eligible weights as FP8 codes, TP-sharded ones included
    gathered = [n for n, t in out["local_types"].items() if t == "FP8ShardWeight"]
    assert len(gathered) == 6 * n_blocks and out["fp8_gathers"] > 0
    if tp > 1:
        assert len(out["tp_weights"]) == 7 * n_blocks  # q, k, v, o, gate, up, down hold TP shards


@pytest.mark.distributed
@pytest.mark.slow
def test_op_rules_on_two_ranks_equal_the_unsharded_ops(tmp_path):
    """fp8_linear colwise / rowwise and swiglu_down (ffn-sharded) on DTensors over 2 ranks: identity format
    equal to the unsharded op within fp32 rounding (the placements are right, forward and backward);
    E4M3 (each shard scaled by its own current amax) close to it. And a reduction group without a TP rank
    is refused."""
    outs = _dist.spawn(_dist_tp.op_rules_worker, 2, tmp_path)
    # Config(amax_reduction=<group of rank 0>) on a TP mesh of ranks 0 and 1: refused, naming rank 1
    assert "does not contain ranks [1]" in outs[0]["refused"]
    assert outs[1]["refused"] is None  # not a member of that group: nothing to check there
    for case, res in outs[0]["rules"].items():
        fmt, kind = case.split()
        assert res["placements"][0] == ("(Shard(dim=2),)" if kind == "colwise" else "(Partial(sum),)"), case
        assert res["placements"][1] == "(Partial(sum),)", case
        # Smooth-SwiGLU's per-channel scales: each rank's are its own channels', the unsharded op's bits
        assert res["placements"][2] == "(Shard(dim=0),)", case
        assert torch.equal(*res["channel_scales"]), case
        for name, pair in res.items():
            if name in ("placements", "channel_scales"):
                continue
            got, want = pair
            if fmt == "identity":
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"{case} {name}")
            else:
                cos = torch.nn.functional.cosine_similarity(got.flatten().double(), want.flatten().double(), 0)
                assert cos > 0.99, f"{case} {name}: cosine {cos}"


# -- the rules themselves (no process group: specs stand in for DTensorSpecs) --------------------------

def _spec(*shape, p=None, mesh_dims=1):
    from types import SimpleNamespace

    from torch.distributed.tensor import Replicate

    return SimpleNamespace(placements=(p or Replicate(),) * mesh_dims, mesh=SimpleNamespace(device_type="cpu"),
                           tensor_meta=SimpleNamespace(shape=shape, dtype=torch.float32))


def _states(n=8):
    return [_spec(16) for _ in range(n)]


def _knob_kwargs(granularity="tensor"):
    return dict(fwd_format="e4m3", bwd_format="e5m2", granularity=granularity, block=128, power_of_two=False,
                grad_rounding="nearest", margin=0.0, interval=1, algo="max", out_dtype=None, fast_accum=False)


def _rule(name, op=None):
    import fp8pass.distributed.tensor_parallel as tpr

    return tpr._make_rule(op or getattr(torch.ops.fp8pass, name).default, tpr.RULES[name])


def test_every_fp8pass_op_has_a_dtensor_rule():
    from torch.distributed.tensor import DTensor

    import fp8pass.distributed.tensor_parallel as tpr

    n = tpr.register_sharding_rules()
    registered = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs
    ops = [op for name, op in tpr._fp8pass_ops() if name != "delayed_record_"]
    assert n == len(ops) and n >= 15  # linear, GLU, precast, grouped, NVFP4 ops and backwards, the records
    missing = [str(op) for op in ops if op not in registered]
    assert not missing
    names = {name for name, _ in tpr._fp8pass_ops()}
    assert set(tpr.RULES) <= names and "delayed_record_many_" in names


def test_linear_rule_colwise_rowwise_batch_and_replicate():
    from torch.distributed.tensor import Partial, Replicate, Shard

    R = Replicate()
    cases = _rule("fp8_linear")(_spec(2, 8, 32), _spec(64, 32), None, _states(), _states(), _states(),
                                **_knob_kwargs())
    # one placement per output (7) and per tensor leaf (x, weight, 3 x 8 state tensors)
    assert all(len(outs) == 7 and len(ins) == 2 + 24 for outs, ins in cases)
    (outs, ins), = [c for c in cases if c[1][1] == Shard(0)]  # colwise
    assert outs == [Shard(2), R, R, R, R, Shard(0), R] and ins[0] == R and set(ins[2:]) == {R}
    (outs, ins), = [c for c in cases if c[1][1] == Shard(1)]  # rowwise: y partial sums, x's codes sharded like x
    assert outs == [Partial(), R, R, Shard(1), R, Shard(1), R] and ins[0] == Shard(2)
    assert ([Shard(0), R, R, Shard(0), R, R, R], [Shard(0), R] + [R] * 24) in cases  # tokens sharded
    assert ([R] * 7, [R] * 26) in cases
    # a bias follows the weight (colwise) or is a partial term (rowwise: added once over the ranks)
    with_bias = _rule("fp8_linear")(_spec(2, 8, 32), _spec(64, 32), _spec(64), _states(), _states(), _states(),
                                    **_knob_kwargs())
    pairs = [(ins[1], ins[2]) for _, ins in with_bias]
    assert (Shard(0), Shard(0)) in pairs and (Shard(1), Partial()) in pairs


def test_rule_positions_come_from_the_schema_extra_tensor_arguments_replicate():
    """An op whose schema gains a tensor argument (a rounding seed) keeps its rule: inputs are placed by
    name, the new one Replicate."""
    from torch.distributed.tensor import Replicate, Shard

    from fp8pass.op_schema import LinearKnobs

    lib = torch.library.Library("fp8pass_tp_test", "FRAGMENT")
    lib.define("linear_seeded(Tensor seed, Tensor x, Tensor weight, Tensor? bias, Tensor[] x_state, "
               f"Tensor[] w_state, Tensor[] g_state, {LinearKnobs.schema()}) -> "
               "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
    op = torch.ops.fp8pass_tp_test.linear_seeded.default
    cases = _rule("fp8_linear", op)(_spec(2), _spec(2, 8, 32), _spec(64, 32), None, _states(), _states(), _states(),
                                    **_knob_kwargs())
    colwise = [ins for _, ins in cases if ins[2] == Shard(0)]
    assert colwise == [[Replicate(), Replicate(), Shard(0)] + [Replicate()] * 24]


def test_backward_rules_keep_the_saved_placements():
    from torch.distributed.tensor import Partial, Replicate, Shard

    R = Replicate()
    bwd = _rule("fp8_linear_backward")
    dtypes = dict(x_dtype=torch.float32, w_dtype=torch.float32, want_bias_grad=False)
    # colwise forward saved x's codes replicated and W's by rows: dy comes sharded on out-features
    (cases,) = [bwd(_spec(2, 8, 64), _spec(16, 32), _spec(), _spec(64, 32, p=Shard(0)), _spec(), _states(),
                    **dtypes, **_knob_kwargs())]
    assert cases == [([Partial(), Shard(0), Shard(0), R], [Shard(2), R, R, Shard(0), R] + [R] * 8)]
    cases = bwd(_spec(2, 8, 64), _spec(16, 32, p=Shard(1)), _spec(), _spec(64, 32, p=Shard(1)), _spec(), _states(),
                **dtypes, **_knob_kwargs())
    assert cases == [([Shard(1), Shard(1), R, R], [R, Shard(1), R, Shard(1), R] + [R] * 8)]
    glu = _rule("swiglu_down_backward")(_spec(2, 8, 32), _spec(16, 64, p=Shard(1)), _spec(), _spec(32, 64, p=Shard(1)),
                                        _spec(), _spec(64, p=Shard(0)), _spec(16, 64, p=Shard(1)), _spec(),
                                        _spec(16, 64, p=Shard(1)), _spec(), _states(), gate_dtype=torch.float32,
                                        w_dtype=torch.float32, **_knob_kwargs(), activation="silu", smooth="channel",
                                        recast_weight=False)
    assert glu == [([Shard(1), Shard(1), Shard(1), R],
                    [R, Shard(1), R, Shard(1), R, Shard(0), Shard(1), R, Shard(1), R] + [R] * 8)]


def test_swiglu_rule_shards_the_ffn_and_its_channel_scales():
    from torch.distributed.tensor import Partial, Replicate, Shard

    cases = _rule("swiglu_down")(_spec(2, 8, 64), _spec(2, 8, 64), _spec(32, 64), _states(), _states(), _states(),
                                 **_knob_kwargs(), activation="silu", smooth="channel", recast_weight=False)
    (outs, ins), = [(o, i) for o, i in cases if i[2] == Shard(1)]
    assert ins[:3] == [Shard(2), Shard(2), Shard(1)] and outs[0] == Partial() and outs[7] == Shard(0)
    assert len(outs) == 12 and set(ins[3:]) == {Replicate()}


def test_row_scales_and_multi_dim_meshes_gather_instead():
    """Per-row/block scales differ between a shard and the whole tensor, and on a DTensor mesh of 2+ dims the
    saved codes could be sharded differently per dim: those take the all-Replicate rule (correct, gathered)."""
    from torch.distributed.tensor import Replicate

    R = Replicate()
    rule = _rule("fp8_linear")
    row = rule(_spec(2, 8, 32), _spec(64, 32), None, _states(), _states(), _states(), **_knob_kwargs("row"))
    assert row == [([R] * 7, [R] * 26)]
    two_d = rule(_spec(2, 8, 32, mesh_dims=2), _spec(64, 32, mesh_dims=2), None, _states(), _states(), _states(),
                 **_knob_kwargs())
    assert two_d == [([R] * 7, [R] * 26)]


def test_cast_input_rule_shards_x_alt_with_the_codes():
    """``fp8_cast_input``'s ``x_alt`` ([rows, in] on the CPU: the codes in the GEMM dtype; on the GPU the
    column-major codes that backward saves) is sharded like ``x_data``, so a saved ``x_alt`` carries the
    placement the backward rule reads."""
    from torch.distributed.tensor import Replicate, Shard

    cases = _rule("fp8_cast_input")(_spec(2, 8, 32), _states(), **_knob_kwargs())
    (outs, ins), = [c for c in cases if c[1][0] == Shard(2)]
    assert outs == [Shard(1), Replicate(), Replicate(), Shard(1)]
    (outs, _), = [c for c in cases if c[1][0] == Shard(0)]
    assert outs[0] == outs[3] == Shard(0)
