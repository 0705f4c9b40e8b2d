#!/usr/bin/env bash
# Fetch the wheels `python -m bench serve` needs beyond torch (graphkiln[serve] and httpx, with their
# requirements: about 10 MB, Python 3.12, x86-64) into .whl-serve/ (ignored by git), for a CUDA machine
# without access to the package index. Run it where pip reaches the index, copy the repository with
# .whl-serve/ over, and there:
#   python3 -m pip install -q --no-index --find-links .whl-serve fastapi uvicorn uvloop httptools prometheus_client httpx
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "${WHEEL_DIR:-.whl-serve}" 'fastapi>=0.110' 'uvicorn>=0.29' 'uvloop>=0.19' 'httptools>=0.6' \
  'prometheus_client>=0.20' 'httpx>=0.27'
