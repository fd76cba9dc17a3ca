"""Tiny models of other training stacks (torchtitan, litgpt, torchtune; fp8pass/testing/client_zoo.py) under the
fp8 backend, judged like the Hugging Face zoo (tests/_zoo_judge.py): no crash; every parameter with an
eager gradient gets a compiled one; gradient cosine >= 0.98 per parameter group and overall; the
identity format equal to eager to fp32 rounding (to bf16 rounding where the stack's own code computes
in bf16: torchtitan's experts; ``_zoo_judge.identity_tolerance``); explain's GLUs, expert stacks and
linears equal the counts from the modules, and explain accounts for every matmul weight (FP8, kept, or
ran eagerly between graphs: litgpt LLaMAMoE's router; tests/_accounting.py). A stack that is not
installed is skipped (``fp8pass.testing.client_zoo.INSTALL`` says how). A fast subset runs by default; the rest is
``slow`` (python -m pytest -m slow tests/integrations/test_client_zoo.py). Results: docs/results/client_zoo.md.
"""

import _zoo_judge as J
import pytest

from fp8pass.testing import client_zoo as C

_eager_casts = pytest.fixture(autouse=True)(J.eager_casts)

FAST = ["torchtitan/llama3", "litgpt/LLaMAMLP", "torchtune/llama3_2"]

def _params(names):
    out = []
    for n in names:
        marks = []
        if not C.available(n):
            marks.append(pytest.mark.skip(reason=f"{C.stack(n)} is not installed ({C.INSTALL[C.stack(n)]})"))
        out.append(pytest.param(n, marks=marks))
    return out


def _check(name, group_bound=0.98):
    model = C.build(name)
    # 256 tokens: at 64, top-2-of-4 routing leaves the MoE groups' FP8 noise near the bound
    return J.judge(model, C.loss_fn, C.ids(4, 64), group_bound=group_bound, expected=C.expected_counts(model),
                   account=True)


@pytest.mark.parametrize("name", _params(FAST))
def test_client_zoo_fast_subset(name):
    _check(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", _params([n for n in C.zoo() if n not in FAST]))
def test_client_zoo_whole(name):
    _check(name, group_bound=J.WHOLE_ZOO_GROUP_BOUND)
