#!/bin/bash
# All GPU work of one device call for the kernels issue: GPU tests, compute-sanitizer, benchmark.
# Usage on the device (repo root):  bash tools/h200_kernels.sh [tests] [sanitize] [bench]
# (no argument: all three). Logs and results go to $OUT (the device tool's folder) or /tmp/uq_out.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/uq_out}
mkdir -p "$OUT"
steps=${*:-tests sanitize bench}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/smi.txt"
t0=$(date +%s)
for step in $steps; do
  case $step in
    tests)
      timeout ${T_TESTS:-200} python3 -m pytest -q --maxfail=6 -m gpu tests/gpu/test_kernels_gpu.py -p no:cacheprovider \
        2>&1 | tee "$OUT/gpu_tests.log" | tail -25 ;;
    sanitize)
      timeout ${T_SAN:-120} compute-sanitizer --tool memcheck --print-limit 20 python3 tools/h200_sanitize.py \
        2>&1 | tee "$OUT/memcheck.log" | tail -6 ;;
    racecheck)
      timeout 200 compute-sanitizer --tool racecheck --print-limit 20 python3 tools/h200_sanitize.py \
        2>&1 | tee "$OUT/racecheck.log" | tail -6 ;;
    bench)
      timeout ${T_BENCH:-240} python3 -m ultraquant.cli bench ${BENCH_ARGS:---plot $OUT/decode_latency.png} \
        --json "$OUT/bench${BENCH_TAG:-}.json" 2>&1 | tee "$OUT/bench${BENCH_TAG:-}.log" | tail -30 ;;
  esac
  echo "== $step done at +$(( $(date +%s) - t0 ))s"
done
