"""Tests that change process-wide settings put them back: run them twice in one process and check.

The README's test command runs the whole suite in one process with whatever pytest the user's pip
resolves today; a test that leaves Dynamo config, torch threads or an environment variable changed
breaks (or silently changes) every test after it.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

# The tests that change global state (config patches, thread counts, env vars, patched module
# attributes), each followed by one that reads what the other changed.
MUTATING_TESTS = [
    "train/test_train_fp8.py::test_recompile_limit_raises_instead_of_training_without_fp8",
    "train/test_train_loop.py::test_cli_trains_plots_and_resumes",
    "passes/test_backend.py::test_mode_and_options_passed_through_torch_compile",
    "optim/test_optim.py::test_state_bytes_per_parameter",
    "kernels/test_kernel_families.py::test_quantize_dispatch_uses_triton",
    "kernels/test_kernel_families.py::test_bad_family_name",
    "runtime/test_runtime_linear.py::test_gemm_dtype_follows_cpu_capability_and_override",
    "train/test_train_loop.py::test_precision_follows_the_cpu_and_is_recorded",
    "train/test_train_fp8.py::test_compiled_identity_pipeline_tracks_eager_across_optimizer_steps",
]

RUNNER = textwrap.dedent("""
    import json, sys
    import pytest
    from _state_guard import StateGuard

    args, runs = sys.argv[1:], []
    for _ in range(2):  # the second run sees whatever the first left behind
        guard = StateGuard()
        code = pytest.main(["-q", "-p", "no:cacheprovider", "-p", "no:randomly", *args], plugins=[guard])
        runs.append({"exit": int(code), "leaks": guard.leaks})
    print("RESULT " + json.dumps(runs))
""")


def _run_twice(args, cwd, timeout=300):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", RUNNER, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):]), proc.stdout


def test_state_changing_tests_pass_twice_in_one_process_and_restore_everything():
    runs, out = _run_twice([str(TESTS / t) for t in MUTATING_TESTS], cwd=TESTS.parent)
    for run in runs:
        assert run["leaks"] == {}, run["leaks"]
        assert run["exit"] == 0, out[-3000:]


def test_the_guard_catches_a_test_that_forgets_to_restore(tmp_path):
    (tmp_path / "test_leaky.py").write_text(textwrap.dedent("""
        import os
        import torch
        import torch._dynamo

        def test_leaks():
            torch._dynamo.config.recompile_limit = 3
            os.environ["FP8PASS_LEAKED"] = "1"
            torch.set_num_threads(1 if torch.get_num_threads() > 1 else 2)

        def test_restores():
            with torch._dynamo.config.patch(recompile_limit=5):
                pass
    """))
    runs, _ = _run_twice([str(tmp_path / "test_leaky.py")], cwd=tmp_path, timeout=120)
    leaks = runs[0]["leaks"]
    assert list(leaks) == ["test_leaky.py::test_leaks"]
    found = "\n".join(leaks["test_leaky.py::test_leaks"])
    assert "torch._dynamo.config.recompile_limit: 8 -> 3" in found
    assert "os.environ['FP8PASS_LEAKED']: None -> '1'" in found
    assert "num_threads" in found
