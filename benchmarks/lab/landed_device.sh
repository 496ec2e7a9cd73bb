#!/bin/bash
# Issues 24/25, the landed code's calls, sm_90 blobs of the tree in .blobs/ (benchmarks/lab/ab_blobs.sh with PATCHES
# empty). PHASE=bench (alone on the GPU): `bench --spec-decode` through the blobs three times, `bench --serving
# --no-aot` twice, A-D at block 64 (Gluon JIT: no block-64 blobs). PHASE=suites: the GPU suites and sanitizers
# (gpu_suites.sh). Every output packed into $OUT/$PHASE.tgz (the device returns few files).
set -u
export PYTHONUNBUFFERED=1 ULTRAQUANT_CACHE_DIR=/tmp/uq_c TRITON_CACHE_DIR=/tmp/tc PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; t0=$(date +%s); BLOBS=$PWD/.blobs; PHASE=${PHASE:-bench}
el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
if [ "$PHASE" = bench ]; then
  for i in 1 2 3; do ULTRAQUANT_GENERATED=$BLOBS timeout 90 python3 -m ultraquant.cli bench --spec-decode \
    --json $OUT/spec_$i.json > $OUT/spec_$i.log 2>&1; el "spec $i rc=$?"; grep -E "spec k|decode " $OUT/spec_$i.log; done
  for i in 1 2; do ULTRAQUANT_GENERATED=$BLOBS timeout 110 python3 -m ultraquant.cli bench --serving --no-aot \
    --json $OUT/serving_$i.json > $OUT/serving_$i.log 2>&1; el "serving $i rc=$?"
    grep -E "ceiling| us |no blob" $OUT/serving_$i.log | head -24; done
  ULTRAQUANT_BACKEND=triton timeout 120 python3 -m ultraquant.cli bench --shapes A,B,C,D --layouts head --no-stream \
    --json $OUT/bs64.json > $OUT/bs64.log 2>&1; el "bs64 rc=$?"; grep -E "ceiling|uq-head \(" $OUT/bs64.log | tail -5
else
  . benchmarks/lab/gpu_suites.sh
fi
cd $OUT && tar czf $PHASE.tgz --exclude='*.tgz' --exclude=call.log * && find . -type f ! -name '*.tgz' -delete
