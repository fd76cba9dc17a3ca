#!/usr/bin/env bash
# One prepared GPU session (an H200 lent through the device tool): GPU tests, then the kernel and
# training-step benchmarks, in under 8 minutes. Writes JSON + markdown under ${OUT:-gpu_out}.
#
#   bash benchmarks/gpu_check.sh            # from the repository root on the GPU machine
#
# Installs nothing but the wheels in .whl/ (if that folder was carried: e.g. torchao), and runs fp8pass
# from the checkout (PYTHONPATH=.), so the GPU image's own torch/triton are what is measured.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
python3 - <<'PY' | tee "$OUT/env.txt"
import torch, platform
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
print("gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else None)
try:
    import triton; print("triton", triton.__version__)
except ImportError:
    print("triton missing")
PY
status=0
# 1. GPU tests: Triton kernels compiled for real, bit-exact against the torch family (<= 3 min).
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/gpu_tests.txt" || status=1
# 2. Benchmarks with GPU shapes (<= 4 min together).
timeout 260 python3 benchmarks/suite.py --suite roofline,quantize,linear,optim,train \
  --timeout 120 --json "$OUT/bench.json" --md "$OUT/bench.md" 2>&1 | tail -60 || status=1
echo "gpu_check finished with status $status"
exit $status
