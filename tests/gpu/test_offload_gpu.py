"""Offload on CUDA (skipped without a GPU): the side-stream path of fp8pass.memory.HostTransfer.

Bit-identical to offload off, host copies pinned, device memory between steps reduced by the offloaded
bytes, and no host sync while the copies run. Written without a GPU (none was lent): not yet run.
"""

import pytest
import torch

import fp8pass
import fp8pass.optim as fo
from fp8pass.optim.offload import device_state_nbytes

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).cuda()) for s in [(256, 1024), (1000,), (64, 40)]]


def _train_opt(offload: bool, steps=4):
    params = _params()
    opt = fo.AdamW(params, lr=1e-2, offload_state=offload)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=g) * 1e-2).cuda()
        opt.step()
    return params, opt


def test_offloaded_optimizer_state_is_pinned_bit_identical_and_off_the_device():
    (p_off, o_off), (p_on, o_on) = _train_opt(False), _train_opt(True)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(p_off, p_on))
    for a, b in zip(p_off, p_on):
        for k, v in o_on.state[b].items():
            if k != "step":
                assert v.device.type == "cpu" and v.is_pinned()
                assert torch.equal(v, o_off.state[a][k].cpu())
    assert device_state_nbytes(o_on) == 0  # the step counts are on the CPU too (capturable=False)
    sd = o_on.state_dict()  # waits for the copies back
    fresh = fo.AdamW(p_off, lr=1e-2)
    fresh.load_state_dict(sd)
    assert all(v.is_cuda for st in fresh.state.values() for k, v in st.items() if k != "step")


def test_saved_activations_go_to_pinned_memory_and_come_back_bit_identical():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).cuda()
    x = torch.randn(512, 1024, device="cuda")
    grads = []
    for offload in (False, True):
        model.zero_grad(set_to_none=True)
        ctx = fp8pass.offload_saved_activations(min_bytes=1 << 20)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        if offload:
            with ctx:
                loss = model(x).square().mean()
        else:
            loss = model(x).square().mean()
        torch.cuda.synchronize()  # the copies out are done; the next allocation lets their blocks go
        torch.empty(1, device="cuda")
        held = torch.cuda.memory_allocated() - before  # what the graph keeps for backward (and the loss)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        if offload:
            # x (still held here: it comes back itself), GELU's input and output, square's input
            s = ctx.stats
            assert (s.offloaded_tensors, s.restored_tensors, s.originals_alive) == (4, 3, 1)
            saved_off_device = s.offloaded_bytes - s.originals_alive_bytes
        else:
            held_without = held
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert held_without - held >= saved_off_device - (4 << 20)  # allocator rounding, the loss


def test_compiled_fp8_model_with_both_offloads_matches_without():
    from fp8pass.testing.models import SiluMul

    out = []
    for offload in (False, True):
        torch.manual_seed(0)
        model = SiluMul(256, 1024).cuda()
        fwd = torch.compile(model, backend=fp8pass.backend(fp8pass.Config(sr_seed=3)))
        opt = fo.AdamW(model.parameters(), lr=1e-3, offload_state=offload)
        g = torch.Generator(device="cuda").manual_seed(1)
        for _ in range(3):
            x = torch.randn(512, 256, device="cuda", generator=g)
            opt.zero_grad(set_to_none=True)
            with fp8pass.offload_saved_activations(min_bytes=1 << 16 if offload else 1 << 62):
                loss = fwd(x).square().mean()
            loss.backward()
            opt.step()
        out.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*out))
