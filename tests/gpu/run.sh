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
# -v: each test's outcome is in the log as it ends, so a run cut short still says what failed.
python3 -m pytest tests/gpu/test_attention_backends.py tests/gpu/test_block_decode.py tests/gpu/test_prefill_heads.py tests/gpu/test_linear.py tests/gpu/test_quantized_kernels.py tests/gpu/test_fp8_kernels.py tests/gpu/test_int4_kernels.py -v -n 6 -p no:logging 2>&1 | tee "$OUT/attention.log" | grep -E "FAILED|ERROR|passed|failed" | tail -15
for tests in test_runtime_gpu.py test_engine_lifecycle_gpu.py test_kv_cache_gpu.py test_startup_gpu.py test_tensor_parallel_gpu.py test_symm_mem_all_reduce_gpu.py test_quantized.py; do
  python3 -m pytest "tests/gpu/$tests" -v -p no:logging --durations=3 2>&1 | tee "$OUT/${tests%.py}.log" | grep -E "FAILED|ERROR|passed|failed" | tail -12
done
cat "$OUT/report.jsonl"
