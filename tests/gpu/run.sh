#!/usr/bin/env bash
# The CUDA test run in one command: install graphkiln, wheels from .whl/ if any
# (tests/gpu/carry_wheels.sh), the attention and kernel tests in parallel, then the engine tests one file at a time.
# Logs and the measurements the tests record (report.jsonl) go to $OUT (default: ./gpu-test-logs).
#   bash tests/gpu/run.sh                          # everything
#   bash tests/gpu/run.sh kernels                  # the attention and kernel files only
#   bash tests/gpu/run.sh engine                   # the engine files only
#   bash tests/gpu/run.sh test_startup_gpu.py      # named files, one at a time
set -uo pipefail
OUT="${OUT:-$PWD/gpu-test-logs}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 GRAPHKILN_GPU_REPORT="$OUT/report.jsonl"
python3 -m pip install --no-deps --no-build-isolation -e . -q 2>&1 | grep -v WARN
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
KERNELS="test_attention_backends.py test_block_decode.py test_prefill_heads.py test_linear.py test_rms_norm.py test_rope_gpu.py
         test_rope_attention_gpu.py
         test_quantized_kernels.py test_fp8_kernels.py test_int4_kernels.py test_int8_kernels.py"
ENGINE="test_runtime_gpu.py test_engine_lifecycle_gpu.py test_kv_cache_gpu.py test_startup_gpu.py
        test_tensor_parallel_gpu.py test_symm_mem_all_reduce_gpu.py test_quantized.py test_weights_reader_gpu.py
        test_flashinfer_engine_gpu.py"

run_file() {
  python3 -m pytest "tests/gpu/$1" -v -p no:logging --durations=3 2>&1 | tee "$OUT/${1%.py}.log" \
    | grep -E "FAILED|ERROR|passed|failed" | tail -12
}

for group in ${*:-kernels engine}; do
  case "$group" in
    kernels)  # -v: each test's outcome is in the log as it ends, so a run cut short still says what failed.
      python3 -m pytest $(printf 'tests/gpu/%s ' $KERNELS) -v -n 6 -p no:logging 2>&1 | tee "$OUT/kernels.log" \
        | grep -E "FAILED|ERROR|passed|failed" | tail -15 ;;
    engine)
      for file in $ENGINE; do run_file "$file"; done ;;
    *)
      run_file "$group" ;;
  esac
done
cat "$OUT/report.jsonl" 2>/dev/null
