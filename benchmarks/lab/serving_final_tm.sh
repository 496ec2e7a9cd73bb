#!/bin/bash
# Issue 24, the landed code's call (2026-12-04): `bench --serving --no-aot` through the sm_90 blobs in $BLOBS
# (every serving row's whole-page config on both page layouts, and the store), alone on the GPU; then the
# token-major and graph-replay whole-page cases and memcheck of the token-major sanitizer cases.
set -u
export PYTHONUNBUFFERED=1 ULTRAQUANT_CACHE_DIR=/tmp/uq_c PYTHONPATH=$PWD TRITON_CACHE_DIR=/tmp/tc
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
ULTRAQUANT_GENERATED=$BLOBS timeout 200 python3 -m ultraquant.cli bench --serving --no-aot \
  --json $OUT/serving.json > $OUT/serving.log 2>&1
echo "bench rc=$?"; grep -E "ceiling|us |blob" $OUT/serving.log
timeout 200 python3 -m pytest -q -rfE -p no:cacheprovider -m gpu tests/gpu/test_decode_wholepage_gpu.py \
  -k "token_major or graph_replay or odd" > $OUT/tm_gpu.log 2>&1 &
UQ_SANITIZE_CASES=5,6,7 UQ_SANITIZE_BOUNDS=0 timeout 200 compute-sanitizer --tool memcheck --print-limit 20 \
  python3 tests/gpu/sanitize_wholepage.py > $OUT/tm_memcheck.log 2>&1 &
wait; tail -1 $OUT/tm_gpu.log; grep -h "^FAILED" $OUT/tm_gpu.log; grep "ERROR SUMMARY" $OUT/tm_memcheck.log
