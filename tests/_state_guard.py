"""A pytest plugin that records every test leaving process-wide state changed.

Used by tests/project/test_isolation.py: tests that change Dynamo/Inductor config, torch's threads or dtype,
or environment variables must put them back, or a later test runs under settings it never asked for
(pytest >= 9.2's monkeypatch even deletes a torch config entry on undo instead of restoring it).
"""

from __future__ import annotations

import os

import pytest


def _config_copy(module_name: str) -> dict:
    import importlib

    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return {}
    return module.get_config_copy()


def snapshot() -> dict:
    """The process-wide settings a test could change and forget."""
    import torch._dynamo  # noqa: F401  (registers torch._dynamo.config)

    state = {
        "num_threads": torch.get_num_threads(),
        "default_dtype": torch.get_default_dtype(),
        "grad_enabled": torch.is_grad_enabled(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "mkldnn_enabled": torch.backends.mkldnn.enabled,
        # pytest itself rewrites PYTEST_CURRENT_TEST around every test
        "environ": {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"},
    }
    for name in ("torch._dynamo.config", "torch._inductor.config", "torch._functorch.config"):
        for key, value in _config_copy(name).items():
            state[f"{name}.{key}"] = value
    return state


def differences(before: dict, after: dict) -> list[str]:
    changed = []
    for key in sorted(set(before) | set(after)):
        if key == "environ":
            env_before, env_after = before[key], after[key]
            for var in sorted(set(env_before) | set(env_after)):
                if env_before.get(var) != env_after.get(var):
                    changed.append(f"os.environ[{var!r}]: {env_before.get(var)!r} -> {env_after.get(var)!r}")
        elif key not in before or key not in after:
            changed.append(f"{key}: {'removed' if key not in after else 'added'}")
        elif before[key] != after[key]:
            changed.append(f"{key}: {before[key]!r} -> {after[key]!r}")
    return changed


class StateGuard:
    """Compares the snapshot before a test's setup with the one after its teardown."""

    def __init__(self):
        self.leaks: dict[str, list[str]] = {}

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        before = snapshot()
        yield
        changed = differences(before, snapshot())
        if changed:
            self.leaks[item.nodeid] = changed
