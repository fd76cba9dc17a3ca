#!/usr/bin/env bash
# The one prepared GPU run on a bare H200 (or H100): at most 9 minutes of wall time, install included, so
# one 10-minute device call holds it; every stage under its own timeout, the limits summing within the budget.
#
#   OUT=$OUT bash benchmarks/gpu_check.sh                       # on the GPU machine, from the repository root
#   FP8PASS_GPU_CHECK_CPU=1 bash benchmarks/gpu_check.sh        # anywhere: the full CPU check (kernels compiled
#                                                               # for sm_90 without a GPU, every stage on tiny
#                                                               # shapes compiled, the GPU tests collected and skipped)
#   FP8PASS_GPU_CHECK_CPU=quick bash benchmarks/gpu_check.sh    # the harness alone: ~30-40 s of CPU time
#                                                               # (tiny eager stages; tests/project/test_gpu_check.py)
#
# Order: install, the goal stages (train, gemm, adam, mlp, moe; benchmarks/gpu_bench.py), then the GPU
# tests (tests/gpu, -n 8 -v --timeout 120) in the time left.
#
# What lands in $OUT (the device returns at most 8 files; this writes at most 6, never more at once):
#   gpu_check.log    everything every stage printed, appended (stage headers "== stage NAME")
#   gpu_check.json   env, plan, every stage's status and seconds, every case as soon as it is measured
#                    (with the cost model's prediction beside it), the GPU tests' outcomes; for a stage
#                    that failed or timed out, its traceback (a timeout's: every thread's stack) and its
#                    last 60 log lines
#   gpu_check.md     the table rendered from gpu_check.json (rewritten with it)
#   gpu_tests.xml    the GPU tests' junit XML
#   *.tmp            one at a time: gpu_check.json/md are written to a temp file, then renamed over
#
# FP8PASS_GPU_CHECK_FAIL=STAGE makes STAGE raise (benchmark stages: after their first case), a test hook.
# Install: nothing from a registry. fp8pass runs from this checkout (an editable install without build
# isolation if pip can, PYTHONPATH in any case), so the image's torch and triton are what is measured.
# Wheels in .whl/ (git-ignored; e.g. torchao) are installed from there if the folder was carried.
set -uo pipefail
cd "$(dirname "$0")/.."
CPU_MODE=${FP8PASS_GPU_CHECK_CPU:-0}
INJECT=${FP8PASS_GPU_CHECK_FAIL:-}
PY=${PYTHON:-python3}
BOOK="$PY -m benchmarks.gpu_bench"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1

# Limits in seconds, in the order the stages run; the GPU tests take what is left, at least TESTS_MIN.
case "$CPU_MODE" in
  0)     MODE=gpu;   BUDGET=${GPU_CHECK_BUDGET:-540}
         PLAN="install=45,train=170,gemm=90,adam=40,mlp=45,moe=45"; TESTS_MIN=80; RESERVE=10; WORKERS=8 ;;
  1)     MODE=smoke; BUDGET=${GPU_CHECK_BUDGET:-1800}
         PLAN="compile=600,train=400,gemm=200,adam=100,mlp=100,moe=100"; TESTS_MIN=60; RESERVE=10; WORKERS=0 ;;
  quick) MODE=quick; BUDGET=${GPU_CHECK_BUDGET:-420}  # ~30 s of CPU; limits for a loaded 2-core machine
         PLAN="train=90,gemm=60,adam=60,mlp=60,moe=60"; TESTS_MIN=60; RESERVE=5; WORKERS=0 ;;
  *) echo "FP8PASS_GPU_CHECK_CPU must be 0, 1 or quick (got $CPU_MODE)" >&2; exit 2 ;;
esac
PLAN_SUM=$(( $(echo "$PLAN" | tr ',' '\n' | cut -d= -f2 | paste -sd+) ))
if [ $((PLAN_SUM + TESTS_MIN + RESERVE)) -gt "$BUDGET" ]; then
  echo "stage limits ($PLAN_SUM s) + GPU tests ($TESTS_MIN s) + reserve ($RESERVE s) exceed the ${BUDGET} s budget" >&2
  exit 2
fi
if [ "${GPU_CHECK_DRY:-0}" = 1 ]; then  # the plan alone: nothing runs, nothing is written
  echo "mode $MODE: budget ${BUDGET} s = stages $PLAN ($PLAN_SUM s) + GPU tests >= $TESTS_MIN s + reserve $RESERVE s"
  exit 0
fi
limit_of() { echo "$PLAN" | tr ',' '\n' | grep "^$1=" | cut -d= -f2; }
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG=$OUT/gpu_check.log
: >"$LOG"
rm -f "$OUT/gpu_tests.xml"
START=$SECONDS
say() { echo "$*" | tee -a "$LOG"; }
$BOOK start "$OUT" --mode "$MODE" --budget "$BUDGET" --plan "$PLAN,gpu_tests=$TESTS_MIN" || exit 1

# stage NAME LIMIT SIGNAL [--tests] -- COMMAND...: COMMAND under min(LIMIT, what the budget has left),
# its output appended to the log; the outcome recorded in gpu_check.json (status, seconds; for a failure
# or timeout the traceback and the log's last lines). SIGNAL is what timeout sends first (TERM: the
# stage dumps its threads' stacks; INT: pytest stops and still writes its junit XML).
stage() {
  local name=$1 limit=$2 sig=$3 tests=""; shift 3
  if [ "$1" = "--tests" ]; then tests=--tests; shift; fi
  shift  # --
  local left=$((BUDGET - (SECONDS - START) - RESERVE))
  if [ "$left" -lt 5 ]; then
    say "== stage $name skipped: the ${BUDGET} s budget is spent"
    $BOOK record "$OUT" "$name" --skip "the ${BUDGET} s budget is spent"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  # the benchmark stages raise an injected failure themselves (after a case); any other stage is replaced
  if [ "$INJECT" = "$name" ] && [[ " $BENCH_STAGES " != *" $name "* ]]; then
    set -- "$PY" -c "raise RuntimeError('injected failure in stage $name (FP8PASS_GPU_CHECK_FAIL)')"
  fi
  local offset t0=$SECONDS rc=0
  $BOOK record "$OUT" "$name" --limit "$limit"
  say "== stage $name (limit ${limit} s, at $((SECONDS - START)) s of ${BUDGET})"
  offset=$(stat -c %s "$LOG")  # the stage's own output starts here
  timeout -s "$sig" --kill-after=15 "$limit" "$@" >>"$LOG" 2>&1 || rc=$?
  $BOOK record "$OUT" "$name" --rc "$rc" --seconds $((SECONDS - t0)) --log-offset "$offset" $tests
  say "== stage $name: exit $rc after $((SECONDS - t0)) s"
}
BENCH_STAGES="train gemm adam mlp moe"  # gpu_bench.BENCH_STAGES, in the order they run
bench() { stage "$1" "$(limit_of "$1")" TERM -- $BOOK run "$1" "$OUT" --mode "$MODE"; }

if [ "$MODE" = gpu ]; then
  unset TRITON_INTERPRET
  install() {
    $PY -m pip install -q --no-deps --no-build-isolation --no-index -e . \
      || echo "editable install failed: fp8pass runs from PYTHONPATH"
    if compgen -G ".whl/*.whl" >/dev/null; then
      $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/fp8pass_site .whl/*.whl
    fi
  }
  export -f install
  export PY
  stage install "$(limit_of install)" TERM -- bash -c install
  compgen -G ".whl/*.whl" >/dev/null && export PYTHONPATH="$PYTHONPATH:/tmp/fp8pass_site"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw,memory.used --format=csv >>"$LOG" 2>&1
else
  if [ "$MODE" = smoke ]; then
    # one variant family per kernel (GPU_COMPILE_ONLY= compiles all ~100: ~10 min on 2 cores)
    COMPILE_ONLY=${GPU_COMPILE_ONLY-"cast e4m3 sr=True,amax,transpose_cast T=True,tiles e2m1,swiglu,adam e4m3/e5m2 block=128 sr=True,adam e4m3/e5m2 block=8192 sr=False,adam split e4m3/e5m2 sr=True"}
    stage compile "$(limit_of compile)" TERM -- env -u TRITON_INTERPRET $PY -m benchmarks.gpu_compile --only "$COMPILE_ONLY"
  fi
  export TRITON_INTERPRET=1  # the benchmark stages run the Triton kernels in the interpreter
  # quick: fp8pass's CPU kernels eager (their Inductor-compiled loops cost seconds of C++ builds)
  [ "$MODE" = quick ] && export FP8PASS_CPU_FUSED=0
fi
for s in $BENCH_STAGES; do bench "$s"; done
# The GPU tests (every Triton kernel compiled for the GPU against its torch reference) in the time left;
# without CUDA they are collected and skipped. conftest.py leaves TRITON_INTERPRET alone for tests/gpu.
# pytest-xdist and pytest-timeout are in the device image; a CPU venv (CI's) may lack them.
if $PY -c "import xdist, pytest_timeout" 2>/dev/null; then PARALLEL="-n $WORKERS --timeout 120"
else PARALLEL=""; say "pytest-xdist or pytest-timeout missing: the GPU tests run serially, without a per-test limit"; fi
stage gpu_tests $((BUDGET - (SECONDS - START) - RESERVE)) INT --tests -- env -u TRITON_INTERPRET \
  $PY -m pytest tests/gpu -p no:cacheprovider -v $PARALLEL --junitxml="$OUT/gpu_tests.xml"
$BOOK finish "$OUT" --seconds $((SECONDS - START)) | tee -a "$LOG"
exit "${PIPESTATUS[0]}"
