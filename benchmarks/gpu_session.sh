#!/usr/bin/env bash
# One call on the H200 test machine: run the gpu-marked tests, then the benchmarks; logs and JSON land in $OUT.
#   usage: bash benchmarks/gpu_session.sh [tests|bench|all] [--quick]
set -uo pipefail
what=${1:-all}
quick=${2:-}
OUT=${OUT:-/tmp/dsa_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"

# DeepGEMM, when the caller has built it somewhere on that machine (never from this repository's files):
# DEEP_GEMM_PYTHONPATH=<folder holding deep_gemm> puts it on the path; without it the DeepGEMM tests skip.
if [ -n "${DEEP_GEMM_PYTHONPATH:-}" ]; then
  export PYTHONPATH=$DEEP_GEMM_PYTHONPATH:$PYTHONPATH
fi

if [ "$what" = tests ] || [ "$what" = all ]; then
  # One process per file: a kernel fault poisons the CUDA context of its process only.
  : > "$OUT/gpu_tests.txt"
  for file in tests/gpu/test_*.py; do
    timeout ${TEST_TIMEOUT:-300} python3 -m pytest -m gpu -q -p no:cacheprovider "$file" --timeout=180 -rs 2>&1 \
      >> "$OUT/gpu_tests.txt"
    echo "$file: $(tail -1 "$OUT/gpu_tests.txt")"
  done
fi

if [ "$what" = bench ] || [ "$what" = all ]; then
  for bench in benchmarks/bench_*.py; do
    echo "=== $bench"
    timeout ${BENCH_TIMEOUT:-300} python3 "$bench" --out "$OUT" $quick 2>&1 | tail -40
  done
fi
