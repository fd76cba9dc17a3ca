"""The one kernels package: one selector reads FP8PASS_KERNELS, device modules declare what they offer
(never probed with hasattr), and the CPU path runs without triton installed."""

import dataclasses
import pathlib
import re
import subprocess
import sys
import textwrap
import types

import pytest
import torch

from fp8pass import kernels
from fp8pass.kernels import cpu, interface, selection

PACKAGE = pathlib.Path(kernels.__file__).parent.parent


def test_device_modules_declare_exactly_what_they_offer():
    from fp8pass.kernels import cuda

    assert interface.declaration_errors(cpu) == []
    assert interface.declaration_errors(cuda) == []
    assert cpu.OFFERS != cuda.OFFERS  # the two devices differ, and say how


def test_a_wrong_declaration_is_reported_both_ways():
    fake = types.ModuleType("fake_device")
    for name in interface.COMMON:
        setattr(fake, name, lambda *a: None)
    fake.transpose_cast = lambda *a: None  # present but not declared
    fake.OFFERS = interface.Offers(scale_on_device=True, transpose_cast=False, values_without_codes=False,
                                   upcast_gemm_operands=False)  # declared but cast_delayed/cast_current absent
    errors = interface.declaration_errors(fake)
    assert any("transpose_cast is False but transpose_cast is present" in e for e in errors)
    assert any("scale_on_device is True but cast_delayed is absent" in e for e in errors)
    del fake.cast
    assert any("lacks common function cast" in e for e in interface.declaration_errors(fake))
    del fake.OFFERS
    assert interface.declaration_errors(fake) == ["fake_device declares no OFFERS"]


def test_callers_read_offers_never_probe_modules():
    """No module outside fp8pass/kernels asks a kernel module what it has with hasattr, and only the
    selector reads FP8PASS_KERNELS."""
    probes, readers = [], []
    for path in PACKAGE.rglob("*.py"):
        src = path.read_text()
        rel = path.relative_to(PACKAGE).as_posix()
        if re.search(r"hasattr\((kern|cpu|cuda|cpu_kernels)\b", src) and not rel.startswith("kernels/"):
            probes.append(rel)
        if re.search(r"environ[^\n]*FP8PASS_KERNELS|getenv\([^\n]*FP8PASS_KERNELS", src):
            readers.append(rel)
        if rel != "kernels/selection.py" and re.search(r"environ(\.get)?\(\s*ENV\b", src):
            readers.append(rel)
    assert probes == []
    assert readers == []  # the selector spells it through its ENV constant


def test_selector_choices_and_errors(monkeypatch):
    monkeypatch.setenv("FP8PASS_KERNELS", "auto")
    assert selection.family_name("cpu") == "torch" and kernels.for_device("cpu") is cpu
    assert not selection.forced()
    monkeypatch.setenv("FP8PASS_KERNELS", "Torch")  # case-insensitive
    assert selection.requested() == "torch" and selection.forced()
    monkeypatch.setenv("FP8PASS_KERNELS", "cuda")
    with pytest.raises(ValueError, match=r"FP8PASS_KERNELS='cuda' is not one of auto, torch, triton"):
        selection.family_name("cpu")
    monkeypatch.setenv("FP8PASS_KERNELS", "auto")
    with pytest.raises(RuntimeError, match="no kernels for device type 'meta'"):
        kernels.for_device("meta")


def test_triton_chosen_but_missing_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr(selection, "triton_available", lambda: False)
    monkeypatch.setenv("FP8PASS_KERNELS", "triton")
    with pytest.raises(RuntimeError, match=r"triton is not installed: pip install 'fp8pass\[triton\]'"):
        kernels.for_device("cpu")
    monkeypatch.setenv("FP8PASS_KERNELS", "auto")
    assert selection.family_name("cuda") == "torch"  # auto: torch numerics without triton
    with pytest.raises(RuntimeError, match="triton is not installed"):
        kernels.for_device("cuda")


def test_offers_drive_the_cast_route(monkeypatch):
    """casting takes the values-only loop because cpu.OFFERS says so: declared off, the codes are made."""
    from fp8pass import E4M3
    from fp8pass.runtime import casting

    monkeypatch.setenv("FP8PASS_KERNELS", "torch")
    x = torch.randn(64, 32)
    op = casting.cast_with_scale(x, torch.tensor(4.0), E4M3, up=torch.bfloat16, keep_codes=False)
    assert op.data.dtype == torch.bfloat16  # values, no codes
    monkeypatch.setattr(cpu, "OFFERS", dataclasses.replace(cpu.OFFERS, values_without_codes=False))
    op2 = casting.cast_with_scale(x, torch.tensor(4.0), E4M3, up=torch.bfloat16, keep_codes=False)
    assert op2.data.dtype == torch.float8_e4m3fn and torch.equal(op2.up, op.data)


BLOCK_TRITON = textwrap.dedent("""
    import importlib.abc, sys
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    sys.meta_path.insert(0, Block())
""")


def test_cpu_path_runs_without_triton(tmp_path):
    """With triton absent: import, an FP8 compiled step, quantize and the FP8 AdamW step all run, and
    FP8PASS_KERNELS=triton names the missing package."""
    script = BLOCK_TRITON + textwrap.dedent("""
        import os, torch, fp8pass, fp8pass.optim
        from fp8pass import kernels
        assert not kernels.triton_available()
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.SiLU(), torch.nn.Linear(32, 32))
        cm = torch.compile(m, backend=fp8pass.backend(fp8pass.Config(compiler="aot_eager")))
        opt = fp8pass.optim.AdamW(m.parameters(), lr=1e-3)
        cm(torch.randn(8, 32)).sum().backward()
        opt.step()
        fp8pass.quantize(torch.randn(64, 64), fp8pass.E4M3, granularity="row")
        assert "triton" not in sys.modules
        os.environ["FP8PASS_KERNELS"] = "triton"
        try:
            kernels.for_device("cpu")
        except RuntimeError as e:
            print("ERR", e)
    """)
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("FP8PASS_KERNELS", "TRITON_INTERPRET")}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ERR fp8pass's kernels for cpu tensors here are Triton kernels, and triton is not installed" in out.stdout
