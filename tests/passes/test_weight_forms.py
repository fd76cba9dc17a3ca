"""What real code puts around a weight: dtype casts, contiguity calls and computed biases (issue 29, 2-3).

Each form is a minimal module: dense linears whose weight goes through ``.to(dtype)`` / ``.bfloat16()`` /
``.float()`` / ``.half()`` / ``.type_as(x)`` / ``.to(x.dtype)`` / ``.contiguous()`` before or after its
transpose; torchtitan's ``GroupedExperts`` (``torch._grouped_mm(x.bfloat16(), w.bfloat16().transpose(-2, -1),
offs=...)``) and GPT-OSS's ``w.transpose(-2, -1).bfloat16()``; torchtitan's ``ScaledBiasRowwiseLinear``
(``F.linear(x, w, bias / tp_degree)``). Each asserts the exact plan in explain, the identity format equal to
eager, FP8 gradients near eager's for every parameter, in the parameter's own dtype (fp32 master weights,
bf16 compute). A cast that would change the math (float64) is listed as kept with its reason.
"""

import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fp8pass
from fp8pass.config import Config

D, H, E = 32, 64, 4
IDENTITY = Config(fwd_format="identity", bwd_format="identity", compiler="aot_eager", grad_stochastic_rounding=False)
FP8 = Config(compiler="aot_eager", grad_stochastic_rounding=False)

bf16 = torch.bfloat16
# name -> (x, w) -> x @ w.T as the code writes it; the compute dtype the code asks for
DENSE_FORMS = {
    "F.linear(x.bfloat16(), w.to(bf16))": (lambda x, w: F.linear(x.bfloat16(), w.to(bf16)), bf16),
    "x.bfloat16() @ w.bfloat16().t()": (lambda x, w: x.bfloat16() @ w.bfloat16().t(), bf16),
    "x.bfloat16() @ w.t().bfloat16()": (lambda x, w: x.bfloat16() @ w.t().bfloat16(), bf16),
    "F.linear(xb, w.to(xb.dtype))": (lambda x, w: F.linear(x.to(bf16), w.to(x.to(bf16).dtype)), bf16),
    "F.linear(xb, w.type_as(xb))": (lambda x, w: (lambda xb: F.linear(xb, w.type_as(xb)))(x.bfloat16()), bf16),
    "matmul(x, w.t().contiguous())": (lambda x, w: torch.matmul(x, w.t().contiguous()), torch.float32),
    "x @ w.contiguous().T": (lambda x, w: x @ w.contiguous().T, torch.float32),
    "x.half() @ w.float().t().half().contiguous()": (lambda x, w: x.half() @ w.float().t().half().contiguous(),
                                                     torch.float16),
}


class DenseCast(nn.Module):
    """Two linears (``[H, D]`` then ``[D, H]`` weights, ``param_dtype`` master weights) in one form."""

    def __init__(self, form: str, param_dtype=torch.float32):
        super().__init__()
        self.lin = DENSE_FORMS[form][0] if form in DENSE_FORMS else None
        self.a = nn.Parameter((torch.randn(H, D) * D ** -0.5).to(param_dtype))
        self.b = nn.Parameter((torch.randn(D, H) * H ** -0.5).to(param_dtype))

    def forward(self, x):
        return self.lin(F.relu(self.lin(x, self.a)), self.b).float()


class UpcastBf16Weights(DenseCast):
    """bf16 parameters computed in fp32: ``F.linear(x, w.float())``."""

    def __init__(self):
        super().__init__("", param_dtype=bf16)
        self.lin = lambda x, w: F.linear(x, w.float())


class SharedCast(nn.Module):
    """The weight's cast also feeds something else: the linear becomes FP8, the cast stays for it."""

    def __init__(self, shared: bool):
        super().__init__()
        self.shared = shared
        self.a = nn.Parameter(torch.randn(H, D) * D ** -0.5)

    def forward(self, x):
        ab = self.a.bfloat16()
        y = F.linear(x.bfloat16(), ab).float()
        return y + ab.float().mean(1) if self.shared else y


class ScaledBiasLinear(nn.Module):
    """torchtitan's ScaledBiasRowwiseLinear (GPT-OSS attention ``wo``): ``F.linear(x, w, bias / tp_degree)``;
    then a plain bias-parameter linear, for comparison."""

    def __init__(self, tp_degree: int = 2):
        super().__init__()
        self.tp = tp_degree
        self.w = nn.Parameter(torch.randn(H, D) * D ** -0.5)
        self.bias = nn.Parameter(torch.randn(H))
        self.w2 = nn.Parameter(torch.randn(D, H) * H ** -0.5)
        self.bias2 = nn.Parameter(torch.randn(D))

    def forward(self, x):
        return F.linear(F.gelu(F.linear(x, self.w, self.bias / self.tp)), self.w2, self.bias2)


class BroadcastBias(nn.Module):
    """``F.linear`` with a computed bias of one value per (position, feature): not one value per output
    feature, so no FP8 op's bias; kept with the reason."""

    def __init__(self, positions: int):
        super().__init__()
        self.w = nn.Parameter(torch.randn(H, D) * D ** -0.5)
        self.pos_bias = nn.Parameter(torch.randn(positions, H))

    def forward(self, x):
        return F.linear(x, self.w, self.pos_bias * 0.5)


class Float64Cast(nn.Module):
    """A weight cast to float64 (with its input): FP8 does not apply; listed as kept with the reason."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(H, D) * D ** -0.5)

    def forward(self, x):
        return F.linear(x.double(), self.w.double()).float()


class GroupedExperts(nn.Module):
    """MoE experts over grouped GEMMs with offsets, the weights cast on the way (fp32 master weights).

    "plain": no cast (for bf16 parameters). "titan": torchtitan's ``GroupedExperts`` (SwiGLU; ``x.bfloat16()`` and ``w.bfloat16().transpose(-2, -1)``
    per projection, the output ``type_as(x)``); "gpt_oss": GPT-OSS's ``w.transpose(-2, -1).bfloat16()``
    (its clamped activation is not a GLU the patterns know: here GELU, two grouped linears).
    """

    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.w1 = nn.Parameter(torch.randn(E, H, D) * D ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E, D, H) * H ** -0.5)
        if form == "titan":
            self.w3 = nn.Parameter(torch.randn(E, H, D) * D ** -0.5)

    def forward(self, x, counts):
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        gmm = torch._grouped_mm
        if self.form == "titan":
            h = F.silu(gmm(x.bfloat16(), self.w1.bfloat16().transpose(-2, -1), offs=offs))
            h = h * gmm(x.bfloat16(), self.w3.bfloat16().transpose(-2, -1), offs=offs)
            return gmm(h, self.w2.bfloat16().transpose(-2, -1), offs=offs).type_as(x)
        if self.form == "plain":  # no cast (bf16 parameters and input)
            return gmm(F.gelu(gmm(x, self.w1.transpose(-2, -1), offs=offs)), self.w2.transpose(-2, -1), offs=offs)
        h = F.gelu(gmm(x.bfloat16(), self.w1.transpose(-2, -1).bfloat16(), offs=offs))
        return gmm(h, self.w2.transpose(-2, -1).bfloat16(), offs=offs).type_as(x)


COUNTS = torch.tensor([5, 7, 0, 12])  # an empty expert included


def _run(model, inputs, cfg=None):
    """Output and every parameter's gradient, eager (``cfg`` None) or compiled with ``cfg``."""
    model.zero_grad()
    m = model if cfg is None else torch.compile(model, backend=fp8pass.backend(cfg))
    y = m(*inputs)
    (y.float() * torch.linspace(-1, 1, y.shape[-1])).square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    torch._dynamo.reset()
    return y.detach(), grads


def _assert_identity_and_fp8_grads(model, inputs, rtol):
    """The identity format equals eager (``rtol``: the compute dtype's rounding; fp32: 1e-6), and FP8
    gradients reach every parameter in its own dtype and shape, cosine >= 0.98 to eager's."""
    y0, g0 = _run(model, inputs)
    y1, g1 = _run(model, inputs, IDENTITY)
    torch.testing.assert_close(y1, y0, rtol=rtol, atol=rtol * y0.abs().max().item())
    assert g0.keys() == g1.keys()
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=rtol, atol=rtol * g0[n].abs().max().item(), msg=n)
    y8, g8 = _run(model, inputs, FP8)
    assert F.cosine_similarity(y0.flatten().double(), y8.flatten().double(), dim=0) >= 0.98
    for n, p in model.named_parameters():
        assert g8[n].dtype == p.dtype == g0[n].dtype and g8[n].shape == p.shape, n
        cos = F.cosine_similarity(g0[n].flatten().double(), g8[n].flatten().double(), dim=0).item()
        assert cos >= 0.98, (n, cos)
    assert not torch.equal(y0, y8)  # FP8 really ran


_RTOL = {torch.float32: 1e-6, bf16: 2 ** -7, torch.float16: 2 ** -10}


@pytest.mark.parametrize("form", list(DENSE_FORMS))
def test_cast_weight_forms_are_fp8_linears(form):
    torch.manual_seed(0)
    m, x = DenseCast(form), torch.randn(2, 8, D)
    rep = fp8pass.explain(m, x)
    assert rep.linears == ["a", "b"] and rep.skipped == [], (rep.linears, rep.skipped)
    # the weights' casts and transposes went with the linears they fed (nothing else used them)
    assert not re.search(r"parameters_[ab]_\.\w+\(", rep.graph_after), rep.graph_after
    _assert_identity_and_fp8_grads(m, (x,), _RTOL[DENSE_FORMS[form][1]])


def test_bf16_master_weights_computed_in_fp32():
    """``F.linear(x, w.float())`` with bf16 parameters: FP8 linears computing in fp32, bf16 gradients."""
    torch.manual_seed(0)
    m, x = UpcastBf16Weights(), torch.randn(2, 8, D)
    rep = fp8pass.explain(m, x)
    assert rep.linears == ["a", "b"] and rep.skipped == []
    _assert_identity_and_fp8_grads(m, (x,), 1e-6)


@pytest.mark.parametrize("shared", [False, True])
def test_weight_cast_removed_only_when_nothing_else_reads_it(shared):
    torch.manual_seed(0)
    m, x = SharedCast(shared), torch.randn(2, 8, D)
    rep = fp8pass.explain(m, x)
    assert rep.linears == ["a"] and rep.skipped == []
    assert len(re.findall(r"parameters_a_\.bfloat16\(\)", rep.graph_after)) == int(shared)
    _assert_identity_and_fp8_grads(m, (x,), 2 ** -7)


def test_computed_bias_is_the_fp8_linears_bias():
    """``bias / tp_degree``: FP8 linear with that bias (added in high precision after the GEMM), its
    gradient reaching the bias parameter through the division."""
    torch.manual_seed(0)
    m, x = ScaledBiasLinear(), torch.randn(2, 8, D)
    rep = fp8pass.explain(m, x)
    assert rep.linears == ["w", "w2"] and rep.skipped == []
    _assert_identity_and_fp8_grads(m, (x,), 1e-6)


def test_bias_not_one_value_per_feature_is_kept_with_reason():
    torch.manual_seed(0)
    m, x = BroadcastBias(8), torch.randn(2, 8, D)
    rep = fp8pass.explain(m, x)
    assert rep.linears == []
    assert rep.skipped == [("w", "bias of shape (8, 64) broadcast to 64 output features (the FP8 ops add a "
                                 "bias of one value per output feature)")]
    y0, _ = _run(m, (x,))
    y1, _ = _run(m, (x,), FP8)
    assert torch.equal(y0, y1)  # kept: the original math


def test_float64_cast_is_kept_with_reason():
    torch.manual_seed(0)
    m, x = Float64Cast(), torch.randn(2, 8, D)
    rep = fp8pass.explain(m, x)
    assert rep.linears == []
    assert rep.skipped == [("w", "weight cast to torch.float64 before the matmul (FP8 computes in "
                                 "fp32/bf16/fp16): kept in high precision")]


@pytest.mark.parametrize("form", ["titan", "gpt_oss"])
def test_grouped_experts_with_cast_weights_are_fp8(form):
    torch.manual_seed(0)
    m, x = GroupedExperts(form), torch.randn(int(COUNTS.sum()), D)
    rep = fp8pass.explain(m, x, COUNTS)
    assert rep.skipped == []
    if form == "titan":  # one SwiGLU expert stack: gate and up read the same x.bfloat16() (twice written)
        assert [(e.weights, e.variant) for e in rep.experts] == [(("w1", "w3", "w2"), "swiglu experts")]
        assert len(re.findall(r"\.bfloat16\(\)", rep.graph_after)) == 1   # x's; the weights' casts went
    else:
        assert [(e.weights, e.variant) for e in rep.experts] == [(("w1", "w2"), "grouped linears")]
    _assert_identity_and_fp8_grads(m, (x, COUNTS), 2 ** -7)



@pytest.mark.parametrize("compiler", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
@pytest.mark.parametrize("form", ["plain", "gpt_oss"])
def test_grouped_experts_compile_with_delayed_scaling(compiler, form):
    """The per-expert delayed-scaling state enters AOT autograd with static shapes: symbolic ones, which
    no Dynamo source names, made Dynamo's guard generation fail (IndexError) on the grouped ops' state
    check, casts or not (bf16 parameters and input here)."""
    torch.manual_seed(0)
    m = GroupedExperts(form).bfloat16()
    x = torch.randn(int(COUNTS.sum()), D, dtype=bf16)
    y0, g0 = _run(m, (x, COUNTS))
    y8, g8 = _run(m, (x, COUNTS), Config(compiler=compiler, grad_stochastic_rounding=False))
    assert not torch.equal(y0, y8)  # FP8 ran
    assert F.cosine_similarity(y0.flatten().double(), y8.flatten().double(), dim=0) >= 0.98
    for n in g0:
        assert F.cosine_similarity(g0[n].flatten().double(), g8[n].flatten().double(), dim=0) >= 0.98, n
