"""The package's surface: what ``import fp8pass`` loads, what ``dir`` shows, no submodule hidden by a function."""

import importlib
import os
import pkgutil
import subprocess
import sys
import types
from pathlib import Path

import fp8pass

ROOT = Path(__file__).resolve().parents[2]


def test_dir_is_the_public_api():
    dunders = {k for k in vars(fp8pass) if k.startswith("__") and k.endswith("__")}
    assert dir(fp8pass) == sorted(set(fp8pass.__all__) | dunders)
    for leaked in ("config", "numerics", "passes", "runtime", "scaling_state", "importlib"):
        assert leaked not in dir(fp8pass)


def test_every_public_name_resolves():
    for name in fp8pass.__all__:
        assert getattr(fp8pass, name) is not None, name


def test_import_leaves_the_heavy_parts_for_later():
    # each of these took 1-3 s of `import fp8pass` (measured with python -X importtime)
    code = ("import sys, fp8pass\n"
            "heavy = [m for m in ('fp8pass.distributed', 'fp8pass.train', 'fp8pass.monitor', "
            "'torch.distributed.checkpoint', 'torch._dynamo.convert_frame') if m in sys.modules]\n"
            "print(heavy)\n"
            "fp8pass.distributed.AmaxSync\n"  # and on first use they load
            "print('fp8pass.distributed' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:2] == ["[]", "True"]


def test_no_submodule_is_shadowed_by_a_function():
    shadowed = []
    for info in pkgutil.walk_packages(fp8pass.__path__, "fp8pass."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        parent, _, leaf = info.name.rpartition(".")
        value = getattr(importlib.import_module(parent), leaf)
        if value is not module:
            shadowed.append(f"{info.name} is a {type(value).__name__}")
    assert shadowed == []
    assert isinstance(importlib.import_module("fp8pass.quantized"), types.ModuleType)
    assert callable(fp8pass.quantized.quantize) and callable(fp8pass.backend)
