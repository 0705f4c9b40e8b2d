#!/usr/bin/env bash
# Fetch the wheels that graphkiln[flashinfer] and graphkiln[quant] need, for a CUDA machine without access to the package
# index (Python 3.12, x86-64), into .whl/ (ignored by git). Run it where pip can reach the index,
# then copy the repository with .whl/ to the CUDA machine; tests/gpu/run.sh installs them.
#
#   flashinfer_python-0.5.3-py3-none-any.whl                 ~7.0 MB
#   apache_tvm_ffi-0.1.15.post2-cp312-...manylinux_2_28.whl  ~3.3 MB
#   nvidia_cudnn_frontend-1.32.0-cp312-...manylinux_2_28.whl ~11.6 MB   (about 21 MiB in all)
#   compressed_tensors, loguru, psutil (graphkiln[quant]: compressed-tensors checkpoints)  ~0.5 MB
#   pydantic, pydantic_core, annotated_types, typing_inspection (compressed-tensors requires pydantic, which a
#   CUDA image with torch and transformers need not have)  ~2.5 MB
#
# A CUDA image with torch usually has flashinfer's other requirements (click, einops, ninja, numpy, nvidia-ml-py,
# packaging, requests, tabulate, torch, tqdm; typing-extensions for tvm-ffi) except
# nvidia-cutlass-dsl, which is left out: only flashinfer's CuTe-DSL kernels import it, never
# `import flashinfer` or the paged decode/prefill wrappers this backend uses (FlashInfer 0.5.3 was
# imported and run with these three wheels alone).
#
# FlashInfer compiles its kernels at first use (about 20 s per dtype and head size) into
# ~/.cache/flashinfer (FLASHINFER_WORKSPACE_BASE moves it); a fresh machine starts empty.
set -euo pipefail
cd "$(dirname "$0")/../.."
dest="${WHEEL_DIR:-.whl}"
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dest" \
  flashinfer-python==0.5.3 apache-tvm-ffi==0.1.15.post2 nvidia-cudnn-frontend==1.32.0 \
  compressed-tensors==0.20.0 loguru==0.7.3 psutil==7.2.2 \
  pydantic==2.12.5 pydantic-core==2.41.5 annotated-types==0.7.0 typing-inspection==0.4.2
ls -l "$dest"/flashinfer_python-0.5.3-*.whl "$dest"/apache_tvm_ffi-0.1.15.post2-*.whl \
  "$dest"/nvidia_cudnn_frontend-1.32.0-*.whl
