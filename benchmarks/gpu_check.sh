#!/usr/bin/env bash
# One prepared GPU session on a bare H200 (or H100), in under 8 minutes: the GPU tests, then the GPU
# benchmarks, each stage under its own timeout inside one overall budget, so one hang cannot eat it.
# Writes $OUT/gpu_check.json and $OUT/gpu_check.md (plus every stage's log and JSON).
#
#   bash benchmarks/gpu_check.sh                          # on the GPU machine, from the repository root
#   FP8PASS_GPU_CHECK_CPU=1 bash benchmarks/gpu_check.sh  # anywhere: the same script on tiny CPU shapes
#                                                         # (kernels compiled for sm_90 without a GPU, GPU
#                                                         # tests collected, every benchmark stage --smoke)
#
# Install: nothing from a registry (the GPU machine may reach none). fp8pass runs from this checkout
# (an editable install without build isolation if pip can, PYTHONPATH in any case), so the image's own
# torch and triton are what is measured. Wheels in .whl/ (not committed: e.g. torchao, whose wheels carry
# compiled CUDA extensions) are installed from there if the folder was carried; without torchao its
# comparison is skipped with a note in the table.
#
# The CPU suite on a CUDA host is a separate command: python -m pytest -q (conftest.py interprets Triton).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
CPU_MODE=${FP8PASS_GPU_CHECK_CPU:-0}
if [ "$CPU_MODE" = 1 ]; then BUDGET=${GPU_CHECK_BUDGET:-1800}; else BUDGET=${GPU_CHECK_BUDGET:-470}; fi  # seconds
# CPU mode compiles one variant family per kernel (GPU_COMPILE_ONLY= compiles all ~100: ~10 min on 2 cores)
COMPILE_ONLY=${GPU_COMPILE_ONLY-"cast e4m3 sr=True,amax,transpose_cast T=True,tiles e2m1,swiglu,adam e4m3/e5m2 block=128 sr=True,adam e4m3/e5m2 block=8192 sr=False,adam split e4m3/e5m2 sr=True"}
START=$SECONDS
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
PY=${PYTHON:-python3}

if [ "$CPU_MODE" != 1 ]; then
  timeout 60 $PY -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/install.txt" 2>&1 \
    || echo "editable install skipped (see install.txt); running from PYTHONPATH" | tee -a "$OUT/install.txt"
  if compgen -G ".whl/*.whl" >/dev/null; then
    timeout 60 $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/fp8pass_site .whl/*.whl \
      && export PYTHONPATH="$PYTHONPATH:/tmp/fp8pass_site"
  fi
fi
$PY - <<'PY' | tee "$OUT/env.txt"
import platform, os, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
print("gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else None)
print("cpu capability", torch.backends.cpu.get_cpu_capability(), "load", os.getloadavg())
for mod in ("triton", "torchao"):
    try:
        print(mod, __import__(mod).__version__)
    except ImportError:
        print(mod, "not installed")
PY

status=0
# stage NAME TIMEOUT COMMAND...: runs COMMAND under min(TIMEOUT, what is left of BUDGET); records the
# outcome in $OUT/stage_NAME.json when the command did not write it (timeouts, crashes, skips).
stage() {
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET - (SECONDS - START) - 10))
  if [ "$left" -lt 20 ]; then
    echo "stage $name skipped: the ${BUDGET}s budget is spent"
    printf '{"status": "skipped: budget spent", "seconds": 0}\n' >"$OUT/stage_$name.json"
    status=1; return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== stage $name (timeout ${limit}s)"
  local t0=$SECONDS rc=0
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1 || rc=$?
  tail -n 5 "$OUT/$name.log"
  if [ "$rc" -ne 0 ]; then
    status=1
    local why="failed (exit $rc)"; [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && why="timed out after ${limit}s"
    echo "stage $name: $why"
    printf '{"status": "%s", "seconds": %d, "result": {}}\n' "$why" $((SECONDS - t0)) >"$OUT/stage_$name.json"
  elif [ ! -f "$OUT/stage_$name.json" ]; then
    printf '{"status": "ok", "seconds": %d, "result": {}}\n' $((SECONDS - t0)) >"$OUT/stage_$name.json"
  fi
}

if [ "$CPU_MODE" = 1 ]; then
  export TRITON_INTERPRET=0
  stage compile 900 env -u TRITON_INTERPRET $PY benchmarks/gpu_compile.py --only "$COMPILE_ONLY" \
    --json "$OUT/compile.json"
  stage gpu_tests 120 $PY -m pytest -q -p no:cacheprovider --collect-only tests/gpu
  SMOKE="--smoke"; export TRITON_INTERPRET=1  # --smoke runs the Triton kernels in the interpreter
else
  # The GPU tests alone (every Triton kernel compiled for the GPU, against its torch reference).
  stage gpu_tests 270 $PY -m pytest -q -p no:cacheprovider -ra tests/gpu --junitxml="$OUT/gpu_tests.xml"
  SMOKE=""
fi
stage gemm 70 $PY benchmarks/gpu_bench.py gemm $SMOKE --json "$OUT/stage_gemm.json"
stage adam 60 $PY benchmarks/gpu_bench.py adam $SMOKE --json "$OUT/stage_adam.json"
stage mlp 45 $PY benchmarks/gpu_bench.py mlp $SMOKE --json "$OUT/stage_mlp.json"
stage train 150 $PY benchmarks/gpu_bench.py train $SMOKE --json "$OUT/stage_train.json"
$PY benchmarks/gpu_bench.py merge "$OUT" || status=1
echo "gpu_check finished in $((SECONDS - START))s with status $status; results in $OUT/gpu_check.md"
exit $status
