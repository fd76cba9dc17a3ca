import os

import torch

# Triton kernels run on CPU through the interpreter; triton reads this when a kernel is decorated,
# so it must be set before any fp8pass kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "tests/gpu" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(skip)


@pytest.fixture(params=["torch", "triton"])
def kernels(request, monkeypatch):
    """Run a test once per kernel family (FP8PASS_KERNELS)."""
    monkeypatch.setenv("FP8PASS_KERNELS", request.param)
    return request.param
