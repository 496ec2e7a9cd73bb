#!/bin/bash
# Issues 24/25: main's evidence on whatever card comes (sm_90 blobs of the tree in .blobs/, from
# benchmarks/lab/ab_blobs.sh with PATCHES empty). On an H200: landed_device.sh's bench phase (spec-decode x3,
# serving x2, block 64). Otherwise (the H100: its bench rows ran in the call before): the GPU suites and
# sanitizers of main (gpu_suites.sh, full length), then A-D at block 64 timed alone (Gluon JIT; compiled during
# the suites). Everything packed into $OUT/main.tgz.
set -u
export PYTHONUNBUFFERED=1 ULTRAQUANT_CACHE_DIR=/tmp/uq_c TRITON_CACHE_DIR=/tmp/tc PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; t0=$(date +%s)
el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$name"
if [[ $name == *H200* ]]; then
  OUT=$OUT PHASE=bench bash benchmarks/lab/landed_device.sh; exit
fi
. benchmarks/lab/gpu_suites.sh
ULTRAQUANT_BACKEND=triton timeout 120 python3 -m ultraquant.cli bench --shapes A,B,C,D --layouts head --no-stream \
  --json $OUT/bs64.json > $OUT/bs64.log 2>&1; el "bs64 rc=$?"; tail -12 $OUT/bs64.log
cd $OUT && tar czf main.tgz --exclude='*.tgz' --exclude=call.log * && find . -type f ! -name '*.tgz' -delete
