"""DDP / FSDP2 with backend fp8 on CPU: 2 gloo processes vs one process on the same global batch.

Multi-process tests carry the ``distributed`` marker (``python -m pytest -m distributed``).
"""

import pytest
import torch

import _dist

pytestmark = pytest.mark.distributed


@pytest.fixture(autouse=True)
def _eager_cpu_casts(monkeypatch):
    # the compiled CPU cast recompiles per shape inside aot_eager graphs; eager casts give the same bits
    monkeypatch.setenv("FP8PASS_CPU_FUSED", "0")

STEPS = 5
# FP8 bound for the loss of a 5-step run: the 2-rank run differs from one process only in the
# summation order of gradients and in step 1's bootstrap scales (each rank's own current amax).
LOSS_RTOL = 2e-3


def _check_scales_identical(outs):
    for step, (a, b) in enumerate(zip(outs[0]["scales"], outs[1]["scales"])):
        assert a.keys() == b.keys() and len(a) > 0
        for k in a:
            assert torch.equal(a[k], b[k]), f"step {step}: {k} differs between ranks: {a[k]} vs {b[k]}"


def test_ddp_matches_single_process_and_resumes_on_one_rank(tmp_path):
    """2-rank DDP + fp8pass.optim.AdamW, DCP at step 3; 1 process resumes steps 4-5."""
    optim = "fp8adam"
    outs = _dist.spawn(_dist.ddp_worker, 2, tmp_path, STEPS, optim, 3)
    ref = _dist.single_process(STEPS, optim)
    resumed = _dist.resume_single_process(str(tmp_path / "ckpt"), 3, STEPS - 3, optim)
    # resharding 2 ranks -> 1: same losses as the uninterrupted 2-rank run (only the gradient
    # summation order differs: one process sums the global batch at once)
    torch.testing.assert_close(torch.tensor(resumed["loss"]), torch.tensor(outs[0]["loss"][3:]), rtol=1e-3, atol=0)
    for k, v in resumed["scales"][0].items():  # loaded state, then one step on the global batch
        torch.testing.assert_close(v[2:], outs[0]["scales"][3][k][2:], rtol=1e-6, atol=0, msg=k)
    _check_scales_identical(outs)
    assert outs[0]["sync_calls"] == STEPS  # one collective per step
    torch.testing.assert_close(torch.tensor(outs[0]["loss"]), torch.tensor(ref["loss"]), rtol=LOSS_RTOL, atol=0)
    # the reduced histories equal to the single process's: same global amax per step. Gradients are per-rank means that
    # DDP averages, so each rank's grad_output is world x the single process's (scale / world).
    for step in range(STEPS):
        for k, v in ref["scales"][step].items():
            rtol = 2e-2
            if k.endswith("grad_output"):
                # step 1 casts gradients with each rank's own bootstrap scale; its different rounding
X
                v, rtol = torch.cat([v[:1] / 2, v[1:] * 2]), 0.15
            torch.testing.assert_close(outs[0]["scales"][step][k], v, rtol=rtol, atol=0, msg=f"{step} {k}")
