"""The benchmark suite's runner logic (the timings themselves are never unit-tested)."""

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from benchmarks import suite
from benchmarks.train_step import backward_inputs, record_partitions, saved_bytes

ROOT = Path(__file__).resolve().parents[2]


def test_goals_take_the_worst_row_and_respect_selection():
    results = {
        "quantize": {"result": {"rows": [{"ratio_vs_clone": 0.9}, {"ratio_vs_clone": 0.4}]}},
        "optim": {"result": {"rows": [
            {"optimizer": "torch AdamW", "ratio": 1.0, "bytes_per_param": 8.0},
            {"optimizer": "fp8pass AdamW default (auto)", "ratio": 1.2, "bytes_per_param": 2.06}]}},
        "linear": {"result": {"cases": {"linear": {"fp8_current/baseline": 1.3, "fp8_delayed/baseline": 1.2}}}},
    }
    goals = {g["goal"]: g for g in suite.check_goals(results)}
    q = goals["CPU quantize / clone bandwidth"]
    assert q["measured"] == 0.4 and q["met"] is False
    o = goals["FP8 AdamW step / torch AdamW(foreach)"]
    assert o["measured"] == 1.2 and o["met"] is True  # the torch row (1.0) is not the fp8pass one
    assert goals["FP8 AdamW state bytes per parameter"]["measured"] == 2.06
    assert goals["CPU fp8 linear/MLP fwd+bwd / high precision (current scaling)"]["met"] is False
    assert goals["compile time fp8 / inductor (4 layers; 2 with --quick)"]["measured"] is None  # suite not run


def test_ratio_rows_and_markdown():
    rows = suite.ratio_rows({"rows": [{"dtype": "float32", "format": "e4m3", "ratio_vs_clone": 1.5, "ms": 3.0}]})
    assert rows == [("float32 e4m3 ratio_vs_clone", 1.5)]
    md = suite.to_markdown({"quantize": {"status": "ok", "cmd": "benchmarks/quantize.py", "seconds": 1.0,
                                         "result": {"rows": [{"ratio_vs_clone": 0.7}]}}},
                           suite.check_goals({"quantize": {"result": {"rows": [{"ratio_vs_clone": 0.7}]}}}),
                           {"cpu": "x"})
    assert "| CPU quantize / clone bandwidth | >= 0.5 | 0.7 | yes |" in md


def test_missing_script_and_unknown_suite(tmp_path, monkeypatch):
    missing = suite.Suite("ghost", "no_such_script.py")
    assert suite.run_suite(missing, quick=True, timeout=10)["status"] == "missing"
    with pytest.raises(SystemExit):
        suite.main(["--suite", "nonsense"])


def test_every_suite_script_exists_and_gpu_script_parses():
    for s in suite.SUITES.values():
        assert (ROOT / "benchmarks" / s.script).exists(), s.script
    assert subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu_check.sh")]).returncode == 0


def test_saved_bytes_counts_what_autograd_keeps():
    a = torch.randn(256, requires_grad=True)
    b = torch.randn(256, requires_grad=True)
    nbytes, out = saved_bytes(lambda: (a * b).sum())
    assert nbytes == 2 * 256 * 4  # mul saves both fp32 inputs
    assert out.requires_grad


def test_saved_bytes_leaves_out_excluded_storages():
    a = torch.randn(256, requires_grad=True)
    b = torch.randn(256, requires_grad=True)
    nbytes, _ = saved_bytes(lambda: (a * b).sum(), exclude={a.untyped_storage().data_ptr()})
    assert nbytes == 256 * 4


def test_partition_record_counts_what_the_compiled_forward_hands_to_backward():
    """An Inductor-compiled ``sin(x @ w)``: backward needs ``x.t()`` (a view of a graph input: no
    extra memory) and ``x @ w`` (64 x 32 fp32, saved). The hooks see the same bytes (the inputs'
    storages left out)."""
    torch._dynamo.reset()
    x = torch.randn(64, 16)
    w = torch.randn(16, 32, requires_grad=True)
    records: list = []
    with record_partitions(records):
        f = torch.compile(lambda x: torch.sin(x @ w).sum(), fullgraph=True)
        f(x).backward()
    assert len(records) == 1
    rec = records[0]
    assert rec["input_bytes"] == 64 * 16 * 4, rec
    assert rec["saved_bytes"] == 64 * 32 * 4, rec
    hooks, _ = saved_bytes(lambda: f(x), exclude={w.untyped_storage().data_ptr(), x.untyped_storage().data_ptr()})
    assert hooks == rec["saved_bytes"]
    graph = torch.fx.symbolic_trace(lambda a, b: a + b)  # placeholders named like neither class
    assert backward_inputs(graph) == {"saved_bytes": 0, "input_bytes": 0, "saved": [], "table": []}


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (exited, or a zombie waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_hanging_suite_times_out_and_its_whole_process_group_is_killed(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    script = tmp_path / "hang.py"
    script.write_text(textwrap.dedent(f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open({str(pid_file)!r}, "w").write(str(child.pid))
        time.sleep(600)
    """))
    t0 = time.perf_counter()
    res = suite.run_suite(suite.Suite("hang", str(script)), quick=True, timeout=3)
    assert time.perf_counter() - t0 < 60
    assert res["status"] == "timeout" and res["note"] == "timed out after 3 s"
    grandchild = int(pid_file.read_text())
    deadline = time.time() + 10
    while not _gone(grandchild) and time.time() < deadline:
        time.sleep(0.1)
    assert _gone(grandchild), "the suite's grandchild survived the timeout"


def test_a_failed_suite_carries_its_reason(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import sys\nprint('working')\nraise SystemExit('no GPU: the roofline needs CUDA')\n")
    res = suite.run_suite(suite.Suite("fail", str(script)), quick=True, timeout=60)
    assert res["status"] == "failed"
    assert res["note"] == "exit 1: no GPU: the roofline needs CUDA"
    killed = tmp_path / "killed.py"
    killed.write_text("import os, signal, sys\nprint('dying', file=sys.stderr)\nos.kill(os.getpid(), signal.SIGKILL)\n")
    res = suite.run_suite(suite.Suite("killed", str(killed)), quick=True, timeout=60)
    assert res["status"] == "failed" and res["note"] == "killed by SIGKILL: dying"


def test_bench_help_names_the_timeout(capsys):
    with pytest.raises(SystemExit):
        suite.main(["--help"])
    assert "process group is killed" in " ".join(capsys.readouterr().out.split())


def test_step_ab_experiments_name_todays_choice_first():
    """Each A/B experiment toggles an attribute that exists, and its first choice is what the code
    does today (the ratios are printed against it); bad round counts are refused."""
    from benchmarks import step_ab

    for name, (module, attr, choices) in step_ab.EXPERIMENTS.items():
        assert len(choices) == 2, name
        assert getattr(module, attr) == next(iter(choices.values())), name
    with pytest.raises(SystemExit):
        step_ab.main(["e5m2-upcast", "--rounds", "0"])


def test_exit_code_and_last_line_say_which_goals_were_missed_and_why():
    """Issue 34: --quick ended with exit code 1 and no word of why."""
    ok = {"status": "ok"}
    results = {"quantize": {**ok, "result": {"rows": [{"ratio_vs_clone": 0.9}]}},
               "linear": {**ok, "result": {"cases": {"linear": {"fp8_current/baseline": 1.4,
                                                                 "fp8_delayed/baseline": 1.1}}}},
               "compile": {"status": "timeout", "note": "timed out after 240 s"}}
    code, line = suite.verdict(results, suite.check_goals(results))
    assert code == suite.EXIT_SUITE_UNFINISHED == 3
    assert line == ("bench: 2 of 4 goals met; missed: CPU fp8 linear/MLP fwd+bwd / high precision (current "
                    "scaling) 1.4 (goal <= 1.25); not measured: compile time fp8 / inductor (4 layers; 2 with "
                    "--quick) (compile suite timeout: timed out after 240 s) -> exit 3")
    del results["compile"]
    assert suite.verdict(results, suite.check_goals(results))[0] == suite.EXIT_GOAL_MISSED == 1
    results["linear"]["result"]["cases"]["linear"]["fp8_current/baseline"] = 1.0
    assert suite.verdict(results, suite.check_goals(results)) == (0, "bench: 3 of 3 goals met -> exit 0")
    results["train"] = {**ok, "result": {"rows": [{"shape": "tiny", "step fp8/bf16-inductor": 1.2}]}}
    code, line = suite.verdict(results, suite.check_goals(results))
    assert code == 0 and line.endswith(
        "not measured: block training step fp8 / bf16-Inductor (CPU), block saved-for-backward bytes fp8 / "
        "bf16-Inductor, block params+grads+optimizer+saved fp8 / bf16-Inductor+AdamW (train suite does not measure "
        "it with these options (e.g. --quick's shapes)) -> exit 0")


def test_the_budget_leaves_out_what_it_cannot_fit(tmp_path, monkeypatch, capsys):
    """--quick has a whole-run budget: a suite that would start with less than MIN_SUITE_SECONDS left is
    not started, the last line names it, and the exit code is 3."""
    quick = tmp_path / "quick.py"
    quick.write_text("import json, sys\njson.dump({'rows': [{'ratio_vs_clone': 0.9}]}, open(sys.argv[2], 'w'))\n")
    monkeypatch.setitem(suite.SUITES, "quantize", suite.Suite("quantize", str(quick)))
    monkeypatch.setitem(suite.SUITES, "roofline", suite.Suite("roofline", str(quick)))
    assert suite.main(["--suite", "quantize", "--quick", "--budget", "600"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "bench: 1 of 1 goals met -> exit 0"
    assert suite.main(["--suite", "roofline,quantize", "--quick", "--budget", "10"]) == 3
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == ("bench: 0 of 1 goals met; not measured: CPU quantize / clone bandwidth (quantize suite skipped: "
                    "not started: 10 s budget spent (run it alone: --suite quantize)) -> exit 3")


def test_cpu_step_peak_counts_what_the_step_holds_at_once():
    """benchmarks/memory.py's CPU peak: the highest running sum of the profiler's allocation records
    during the second of two steps, exactly (a 4 MiB tensor alone beats 1 + 2 MiB held together; a
    tensor kept across steps counts twice while its replacement is made, then once)."""
    from benchmarks.memory import _profiled_peak

    mib = 2**20

    def transient():
        a = torch.empty(mib, dtype=torch.uint8)
        b = torch.empty(2 * mib, dtype=torch.uint8)
        del a, b
        c = torch.empty(4 * mib, dtype=torch.uint8)
        del c

    kept = {}

    def replaced():
        kept["x"] = torch.empty(mib, dtype=torch.uint8)

    assert _profiled_peak(transient) == 4 * mib
    assert _profiled_peak(replaced) == 2 * mib


def test_norm_benchmark_times_the_op_and_the_norm_it_replaces():
    """benchmarks/norm.py's cases: each runs forward + backward of its norm; the op's gradients are the
    Inductor norm's within E4M3's rounding of x_hat, and differ from them (the op's FP8 path ran)."""
    from benchmarks import norm

    steps = norm.cases(64, 512)
    grads = {}
    for name, step in steps.items():
        step()
        x, w = step.inputs
        grads[name] = (x.grad.clone(), w.grad.clone())
    ref_dx, ref_dw = grads["inductor norm"]
    torch.testing.assert_close(grads["eager norm"][0], ref_dx, rtol=1e-5, atol=1e-5)
    dx, dw = grads["fp8pass::rmsnorm"]
    assert not torch.equal(dx, ref_dx)
    assert (dx - ref_dx).abs().max() <= 2.0**-3 * ref_dx.abs().max()
    assert (dw - ref_dw).abs().max() <= 2.0**-3 * ref_dw.abs().max()
