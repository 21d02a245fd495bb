#!/usr/bin/env bash
# Every GPU step in one go: the test suite on the GPU, then the benchmarks.
# Results (logs, JSON, markdown tables) go to ${OUT:-bench-results}.
set -uo pipefail
out=${OUT:-bench-results}
mkdir -p "$out"
export AUTOFUSER_CACHE_DIR=${AUTOFUSER_CACHE_DIR:-$(mktemp -d)}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -m pytest -q -p no:cacheprovider tests/test_capture.py tests/test_cuda.py tests/test_conformance.py -k "sample0-form0 or test_capture or test_cuda" 2>&1 | tail -n 30 | tee "$out/tests.log"
python3 benchmarks/bandwidth.py --out "$out" 2>&1 | tee "$out/bandwidth.log"
