#!/usr/bin/env bash
# The CUDA test run in one command: install graphkiln, wheels from .whl/ if any
# (tests/gpu/carry_wheels.sh), the attention tests in parallel, then the runtime and quantized-product tests.
# Logs and the measurements the tests record (report.jsonl) go to $OUT (default: ./gpu-test-logs).
#   bash tests/gpu/run.sh
set -uo pipefail
OUT="${OUT:-$PWD/gpu-test-logs}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 GRAPHKILN_GPU_REPORT="$OUT/report.jsonl"
python3 -m pip install --no-deps --no-build-isolation -e . -q 2>&1 | grep -v WARN
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
python3 -m pytest tests/gpu/test_attention_backends.py tests/gpu/test_linear.py tests/gpu/test_quantized_kernels.py -q -n 6 -p no:logging 2>&1 | tee "$OUT/attention.log" | tail -5
python3 -m pytest tests/gpu/test_runtime_gpu.py tests/gpu/test_kv_cache_gpu.py tests/gpu/test_startup_gpu.py tests/gpu/test_tensor_parallel_gpu.py -q -p no:logging --durations=6 2>&1 | tee "$OUT/runtime.log" | tail -12
python3 -m pytest tests/gpu/test_quantized.py -q -p no:logging --durations=6 2>&1 | tee "$OUT/quantized.log" | tail -12
cat "$OUT/report.jsonl"
