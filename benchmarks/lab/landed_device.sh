#!/bin/bash
# Issues 24/25 (2026-12-04, evening), the landed code's call: sm_90 blobs of the tree in .blobs/ (64: whole-page
# decode, multi-query decode, store; block 16). (1) GPU suites (whole-page, multi-query, bounds, attention) and
# sanitizers, A-D at block 64 compiled meanwhile; (2) alone on the GPU: `bench --serving --no-aot` through the
# blobs twice, A-D at block 64 (JIT: no block-64 blobs), `bench --spec-decode` through the blobs.
set -u
export PYTHONUNBUFFERED=1 ULTRAQUANT_CACHE_DIR=/tmp/uq_c TRITON_CACHE_DIR=/tmp/tc PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; t0=$(date +%s); BLOBS=$PWD/.blobs
el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
. benchmarks/lab/gpu_suites.sh
for i in 1 2; do ULTRAQUANT_GENERATED=$BLOBS timeout 100 python3 -m ultraquant.cli bench --serving --no-aot \
  --json $OUT/serving_$i.json > $OUT/serving_$i.log 2>&1; el "serving $i rc=$?"; done
ULTRAQUANT_BACKEND=triton timeout 80 python3 -m ultraquant.cli bench --shapes A,B,C,D --layouts head --no-stream \
  --json $OUT/bs64.json > $OUT/bs64.log 2>&1; el "bs64 rc=$?"
ULTRAQUANT_GENERATED=$BLOBS timeout 90 python3 -m ultraquant.cli bench --spec-decode --json $OUT/spec.json > $OUT/spec.log 2>&1
el "spec rc=$?"
for i in 1 2; do echo "== serving $i"; grep -E "ceiling| us |no blob" $OUT/serving_$i.log | head -20; done
echo "== bs64"; grep -E "ceiling|uq-head \(" $OUT/bs64.log | tail -5
echo "== spec"; grep -E "decode|spec" $OUT/spec.log | grep -v prefill | tail -8
cd $OUT && tar czf logs.tgz $(ls *.log | grep -v '^call.log$') && rm -f $(ls *.log | grep -v '^call.log$')
