"""fp8pass.optim.AdamW(offload_state=True): the state lives in host memory between steps, the updates
are bit-identical to offload off, and state dicts cross between the two.

On the CPU "host memory" is a plain copy (the CUDA path without streams): the optimizer's own
accounting (``device_state_nbytes``, ``is_host_copy``) tells what stays resident on the device.
"""

import pytest
import torch

import fp8pass.optim as fo
from fp8pass.optim.offload import device_state_nbytes, is_host_copy

SHAPES = [(3, 100), (7,), (64, 40), (300,), (129,)]


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _grads(params, g):
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-2


def _steps(opt, params, n, g):
    for _ in range(n):
        _grads(params, g)
        opt.step()


OPTIONS = {
    "default": dict(),
    "capturable": dict(capturable=True),
    "lr tensor": dict(capturable=True, lr=torch.tensor(1e-2)),
    "stochastic": dict(rounding="stochastic", stochastic_flush=True),
    "per-tensor scale, sqrt v": dict(block_size=None, v_sqrt=True),
    "bf16 moments": dict(m_format="bf16", v_format="bf16"),
    "compiled chunks": dict(kernels="compiled"),
}


@pytest.mark.parametrize("case", list(OPTIONS))
def test_offloaded_steps_are_bit_identical(case):
    out = []
    for offload in (False, True):
        params = _params()
        kw = dict(OPTIONS[case])
        if kw.get("rounding") == "stochastic":
            kw["generator"] = torch.Generator().manual_seed(5)
        opt = fo.AdamW(params, lr=kw.pop("lr", 1e-2), offload_state=offload, **kw)
        _steps(opt, params, 4, torch.Generator().manual_seed(1))
        out.append((params, opt))
    (p_off, o_off), (p_on, o_on) = out
    assert all(torch.equal(a, b) for a, b in zip(p_off, p_on))
    for a, b in zip(p_off, p_on):
        sa, sb = o_off.state[a], o_on.state[b]
        assert sa.keys() == sb.keys()
        assert all(torch.equal(sa[k], sb[k]) and sa[k].dtype == sb[k].dtype for k in sa)


def test_between_steps_only_the_step_counts_stay_on_the_device():
    params = _params()
    on, off = fo.AdamW(params, offload_state=True), fo.AdamW(_params(), offload_state=False)
    _steps(on, params, 2, torch.Generator().manual_seed(1))
    _steps(off, list(off.param_groups[0]["params"]), 2, torch.Generator().manual_seed(1))
    assert device_state_nbytes(on) == 4 * len(SHAPES)  # the fp32 step counts (on the CPU, the device here)
    assert device_state_nbytes(off) == fo.state_nbytes(off) == fo.state_nbytes(on)
    for st in on.state.values():
        assert {k for k, v in st.items() if is_host_copy(v)} == set(st) - {"step"}


def test_the_host_tensors_are_updated_in_place():
    """The copy back writes into the host tensors the state came from: no new host memory per step."""
    params = _params()
    opt = fo.AdamW(params, offload_state=True)
    g = torch.Generator().manual_seed(1)
    _steps(opt, params, 1, g)
    before = {(i, k): v for i, st in enumerate(opt.state.values()) for k, v in st.items() if k != "step"}
    values = {key: v.clone() for key, v in before.items()}
    _steps(opt, params, 1, g)
    after = {(i, k): v for i, st in enumerate(opt.state.values()) for k, v in st.items() if k != "step"}
    assert all(after[key] is before[key] for key in before)
    assert any(not torch.equal(values[key], after[key]) for key in before)


@pytest.mark.parametrize("saved_with, loaded_into", [(True, False), (False, True), (True, True)])
def test_state_dicts_cross_between_offload_on_and_off(saved_with, loaded_into):
    """Two steps with one setting, state_dict, load into a fresh optimizer with the other, two more
    steps: bit-identical to four steps without offload; the saved dicts have the same keys, dtypes
    and shapes either way."""
    g = torch.Generator().manual_seed(1)
    ref_params = _params()
    ref = fo.AdamW(ref_params, lr=1e-2)
    _steps(ref, ref_params, 2, g)
    ref_sd = ref.state_dict()

    g = torch.Generator().manual_seed(1)
    params = _params()
    first = fo.AdamW(params, lr=1e-2, offload_state=saved_with)
    _steps(first, params, 2, g)
    sd = first.state_dict()
    assert sd["param_groups"] == ref_sd["param_groups"]
    for i, st in sd["state"].items():
        assert {k: (v.dtype, v.shape) for k, v in st.items()} == \
            {k: (v.dtype, v.shape) for k, v in ref_sd["state"][i].items()}
    second = fo.AdamW(params, lr=1e-2, offload_state=loaded_into)
    second.load_state_dict(sd)
    if loaded_into:
        assert device_state_nbytes(second) == 4 * len(SHAPES)
    state = torch.Generator().manual_seed(2)
    ref_state = torch.Generator().manual_seed(2)
    _steps(second, params, 2, state)
    _steps(ref, ref_params, 2, ref_state)
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))


def test_to_torch_state_dict_reads_offloaded_state():
    params = _params()
    opt = fo.AdamW(params, offload_state=True)
    _steps(opt, params, 1, torch.Generator().manual_seed(1))
    torch_sd = fo.to_torch_state_dict(opt.state_dict())
    m, _ = opt.moments(params[0])
    assert torch.equal(torch_sd["state"][0]["exp_avg"], m)


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_offload_state_must_be_a_bool(bad):
    with pytest.raises(ValueError, match="offload_state must be True or False"):
        fo.AdamW(_params(), offload_state=bad)


def test_parameters_without_gradients_keep_their_state_where_it_is():
    params = _params()
    opt = fo.AdamW(params, offload_state=True)
    _steps(opt, params, 1, torch.Generator().manual_seed(1))
    params[0].grad = None
    kept = dict(opt.state[params[0]])
    opt.step()
    assert all(opt.state[params[0]][k] is v for k, v in kept.items())


def test_build_optimizer_passes_the_option_to_fp8_adam_only():
    from fp8pass.train.recipes import build_optimizer, get_recipe

    model = torch.nn.Linear(8, 8)
    with pytest.raises(ValueError, match="offload_state is an option of fp8pass.optim.AdamW"):
        build_optimizer(model, get_recipe("bf16"), lr=1e-3, weight_decay=0.1, offload_state=True)
    opt = build_optimizer(model, get_recipe("bf16-fp8adam"), lr=1e-3, weight_decay=0.1, offload_state=True)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    assert device_state_nbytes(opt) == 2 * 4  # weight and bias: their step counts only
    assert fo.state_nbytes(opt) > 100


def test_a_step_that_fails_midway_leaves_every_state_on_the_host():
    params = _params()
    opt = fo.AdamW(params, offload_state=True)
    _steps(opt, params, 1, torch.Generator().manual_seed(1))
    params[2].grad = torch.zeros(SHAPES[2]).to_sparse()  # the step raises at the third parameter
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        opt.step()
    for st in opt.state.values():
        assert all(is_host_copy(v) for k, v in st.items() if k != "step")
    assert device_state_nbytes(opt) == 4 * len(SHAPES)
