#!/bin/bash
# One device call that re-checks everything GPU-side before a release: the kernels' GPU suite, the
# benchmark, the AOT runtime on sm_90 blobs built here (carried as generated/sm_90), the attention
# layer's GPU simulation, and compute-sanitizer memcheck over the kernels. Each step has a time box so
# the whole call fits a short lease. Usage on the device (repo root): bash tools/h200_final.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/uq_final}
mkdir -p "$OUT"
# ultraquant.runtime/.codegen are package-dir mappings; without an install, link them into the package.
# (On the device only: the links would shadow the real packages in a checkout.)
[ -n "${UQ_LINK-1}" ] && { [ -e ultraquant/runtime ] || ln -s ../runtime ultraquant/runtime; }
[ -n "${UQ_LINK-1}" ] && { [ -e ultraquant/codegen ] || ln -s ../codegen ultraquant/codegen; }
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export ULTRAQUANT_GENERATED=$PWD/generated ULTRAQUANT_CACHE_DIR=$(mktemp -d)
UQ=(python3 -c "from ultraquant.cli import main; main()")
PYT=(python3 -m pytest -q -p no:cacheprovider)
t0=$(date +%s)
step() { echo "== $1 at +$(( $(date +%s) - t0 ))s" | tee -a "$OUT/summary.txt"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/summary.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/summary.txt"

step kernels-gpu-tests
timeout ${T_KTESTS:-100} "${PYT[@]}" -m gpu tests/gpu/test_kernels_gpu.py > "$OUT/kernels_gpu.log" 2>&1
tail -3 "$OUT/kernels_gpu.log" | tee -a "$OUT/summary.txt"
step bench
timeout ${T_BENCH:-150} "${UQ[@]}" bench --layouts head --no-stream --plot "$OUT/decode_latency.png" \
  --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
tail -22 "$OUT/bench.log" | tee -a "$OUT/summary.txt"
step runtime
timeout ${T_VERIFY:-25} "${UQ[@]}" verify --device 0 2>&1 | tail -3 | tee -a "$OUT/summary.txt"
timeout ${T_RTESTS:-80} "${PYT[@]}" -rA tests/gpu/test_runtime_gpu.py -k "not memcheck" > "$OUT/runtime_gpu.log" 2>&1
grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/runtime_gpu.log" | tail -20 | tee -a "$OUT/summary.txt"
step attention-gpu
timeout ${T_ATTN:-60} "${PYT[@]}" -m gpu tests/gpu/test_attention_gpu.py 2>&1 | tail -3 | tee -a "$OUT/summary.txt"
step memcheck
timeout ${T_SAN:-70} compute-sanitizer --tool memcheck --print-limit 10 python3 tools/h200_sanitize.py \
  > "$OUT/memcheck.log" 2>&1
tail -4 "$OUT/memcheck.log" | tee -a "$OUT/summary.txt"
step done
