#!/usr/bin/env bash
# Fetch the wheels that graphkiln[flashinfer] needs and the GPU machine's image lacks, into .whl/
# (ignored by git), to carry there as /work/.library/device/README.md describes. Run it here, in
# the repository, where pip can reach the index; the GPU machine cannot.
#
#   flashinfer_python-0.5.3-py3-none-any.whl                 ~7.0 MB
#   apache_tvm_ffi-0.1.15.post2-cp312-...manylinux_2_28.whl  ~3.3 MB
#   nvidia_cudnn_frontend-1.32.0-cp312-...manylinux_2_28.whl ~11.6 MB   (about 21 MiB in all)
#
# The image already has flashinfer's other requirements (click, einops, ninja, numpy, nvidia-ml-py,
# packaging, requests, tabulate, torch, tqdm; typing-extensions for tvm-ffi) except
# nvidia-cutlass-dsl, which is left out: only flashinfer's CuTe-DSL kernels import it, never
# `import flashinfer` or the paged decode/prefill wrappers this backend uses (FlashInfer 0.5.3 was
# imported and run there with these three wheels alone).
#
# On the GPU machine, with `.whl` in the run's carry, start the command with:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit;
# FlashInfer compiles its kernels at first use (about 20 s per dtype and head size) into
# ~/.cache/flashinfer (FLASHINFER_WORKSPACE_BASE moves it); a fresh machine starts empty.
set -euo pipefail
cd "$(dirname "$0")/../.."
dest="${WHEEL_DIR:-.whl}"
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dest" \
  flashinfer-python==0.5.3 apache-tvm-ffi==0.1.15.post2 nvidia-cudnn-frontend==1.32.0
ls -l "$dest"/flashinfer_python-0.5.3-*.whl "$dest"/apache_tvm_ffi-0.1.15.post2-*.whl \
  "$dest"/nvidia_cudnn_frontend-1.32.0-*.whl
