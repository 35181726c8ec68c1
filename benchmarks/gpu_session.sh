#!/usr/bin/env bash
# One call on the H200 test machine: build upstream DeepGEMM from the git-ignored .deps (when carried), run the
# gpu-marked tests, then the benchmarks; logs and JSON land in $OUT.
#   usage: bash benchmarks/gpu_session.sh [tests|bench|all] [--quick]
# Nothing from .deps is ever committed; the build lives in /tmp on the device machine.
set -uo pipefail
what=${1:-all}
quick=${2:-}
OUT=${OUT:-/tmp/dsa_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"

if [ -f .deps/build_deepgemm.sh ] && [ "${SKIP_DEEPGEMM:-0}" != 1 ]; then
  start=$(date +%s)
  if DG_SMOKE=${DG_SMOKE:-1} bash .deps/build_deepgemm.sh > "$OUT/deepgemm_build_tail.txt" 2>&1; then
    source /tmp/dg_site/dg_env.sh
    echo "DeepGEMM built in $(( $(date +%s) - start )) s" | tee -a "$OUT/gpu.txt"
  else
    echo "DeepGEMM build FAILED after $(( $(date +%s) - start )) s; tail:" | tee -a "$OUT/gpu.txt"
    tail -25 "$OUT/deepgemm_build_tail.txt"
  fi
  tail -c 12000 "$OUT/deepgemm_build_tail.txt" > "$OUT/deepgemm_build_tail.txt.tmp" && mv "$OUT/deepgemm_build_tail.txt.tmp" "$OUT/deepgemm_build_tail.txt"
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
