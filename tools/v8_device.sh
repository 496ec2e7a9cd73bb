#!/bin/bash
# One device call for decode v8 (issue 14): GPU tests, bench (stream gate + decode), ncu on shape A.
# Usage on the device machine: bash tools/v8_device.sh  (writes into $OUT)
export PYTHONPATH=$PWD
# ultraquant.runtime/.codegen are package-dir mappings; without an install, link them into the package.
[ -e ultraquant/runtime ] || ln -s ../runtime ultraquant/runtime
[ -e ultraquant/codegen ] || ln -s ../codegen ultraquant/codegen
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${STEPS:-"tests bench ncu"}
nvidia-smi -L > "$OUT/env.txt"; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$OUT/env.txt"
for step in $STEPS; do
  case $step in
    tests) timeout ${TEST_S:-200} python3 -m pytest -q -p no:cacheprovider tests/gpu/test_decode_v8_gpu.py \
             ${TEST_K:+-k "$TEST_K"} 2>&1 | tail -40 > "$OUT/tests.log"; tail -3 "$OUT/tests.log" ;;
    bench) timeout ${BENCH_S:-300} python3 tools/v8_bench.py --json "$OUT/bench.json" ${BENCH_ARGS} > "$OUT/bench.log" 2>&1;
           tail -${BENCH_TAIL:-45} "$OUT/bench.log" ;;
    ncu) timeout ${NCU_S:-90} ncu --clock-control none -k "regex:uq_decode_v8" -c ${NCU_C:-6} --section SpeedOfLight \
           --section Occupancy --section WarpStateStats --section LaunchStats --section MemoryWorkloadAnalysis \
           python3 tools/v8_ncu.py A > "$OUT/ncu_A.txt" 2>&1;
         grep -E "uq_decode_v8|Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Theoretical Occ|Stall|Memory Throughput" "$OUT/ncu_A.txt" | head -40 ;;
    memcheck|racecheck) timeout ${SAN_S:-90} compute-sanitizer --tool $step --print-limit 20 python3 tools/v8_sanitize.py \
           > "$OUT/sanitize_$step.log" 2>&1; echo "$step rc=$?"; tail -4 "$OUT/sanitize_$step.log" ;;
  esac
done
