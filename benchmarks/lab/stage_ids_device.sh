#!/bin/bash
# Issue 24/25 (2026-12-04, evening), one H200 call: the whole-page decode with a stage's block ids loaded once
# (`_stage_blocks` up to 4 ids; the tree), main before it in .base/ (4885d53), sm_90 blobs of the tree in .blobs/.
# (1) GPU suites (whole-page, multi-query, routed) and sanitizers, with the JIT rows compiled in parallel;
# (2) alone on the GPU: `bench --serving --no-aot` through the blobs; the Hk 8 rows JIT on both trees (A/B);
# A-D at block 64 (JIT); `bench --spec-decode` through the blobs.
set -u
export PYTHONUNBUFFERED=1 ULTRAQUANT_CACHE_DIR=/tmp/uq_c TRITON_CACHE_DIR=/tmp/tc
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; t0=$(date +%s); ROOT=$PWD; BASE=$ROOT/.base; BLOBS=$ROOT/.blobs
el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
AB="ragged 96,ragged 64,short,A bs16,B bs16,D bs16,A token"
export PYTHONPATH=$ROOT
timeout 250 python3 -m pytest -q -rfE -p no:cacheprovider -m gpu tests/gpu/test_decode_wholepage_gpu.py > $OUT/wp_gpu.log 2>&1 &
timeout 250 python3 -m pytest -q -rfE -p no:cacheprovider -m gpu tests/gpu/test_spec_decode_gpu.py tests/gpu/test_attention_gpu.py \
  tests/gpu/test_bounds_gpu.py > $OUT/mq_routed_gpu.log 2>&1 &
timeout 250 compute-sanitizer --tool memcheck --print-limit 20 python3 tests/gpu/sanitize_wholepage.py > $OUT/san.log 2>&1 &
UQ_SANITIZE_BOUNDS=0 UQ_SANITIZE_CASES=3,4,5 timeout 250 compute-sanitizer --tool racecheck --print-limit 20 \
  python3 tests/gpu/sanitize_wholepage.py > $OUT/race.log 2>&1 &
timeout 250 compute-sanitizer --tool memcheck --print-limit 20 python3 tests/gpu/sanitize_spec_decode.py > $OUT/mq_mem.log 2>&1 &
for tree in $ROOT $BASE; do
  (cd $tree && PYTHONPATH=$tree ULTRAQUANT_BACKEND=triton timeout 240 python3 benchmarks/lab/ring_sweep.py warm /dev/null \
    "ragged 96,ragged 64,short,A,B bs16,D bs16" policy > /dev/null 2>&1) &
done
wait; el "phase 1 done"
tail -1 $OUT/wp_gpu.log; tail -1 $OUT/mq_routed_gpu.log; grep -h "^FAILED" $OUT/wp_gpu.log $OUT/mq_routed_gpu.log | head
for f in san race mq_mem; do echo "$f: $(grep -h 'ERROR SUMMARY\|RACECHECK SUMMARY' $OUT/$f.log | tr '\n' ' ')"; done
ULTRAQUANT_GENERATED=$BLOBS timeout 150 python3 -m ultraquant.cli bench --serving --no-aot --json $OUT/serving_blobs.json \
  > $OUT/serving_blobs.log 2>&1; el "blobs bench rc=$?"
(cd $BASE && PYTHONPATH=$BASE ULTRAQUANT_BACKEND=triton timeout 100 python3 -m ultraquant.cli bench --serving --no-aot \
  --serving-rows "$AB" --json $OUT/ab_main.json > $OUT/ab_main.log 2>&1); el "main JIT rc=$?"
ULTRAQUANT_BACKEND=triton timeout 100 python3 -m ultraquant.cli bench --serving --no-aot --serving-rows "$AB" \
  --json $OUT/ab_ids.json > $OUT/ab_ids.log 2>&1; el "ids JIT rc=$?"
ULTRAQUANT_BACKEND=triton timeout 100 python3 -m ultraquant.cli bench --shapes A,B,C,D --layouts head --no-stream \
  --json $OUT/bs64.json > $OUT/bs64.log 2>&1; el "bs64 rc=$?"
ULTRAQUANT_GENERATED=$BLOBS timeout 120 python3 -m ultraquant.cli bench --spec-decode --json $OUT/spec_blobs.json \
  > $OUT/spec_blobs.log 2>&1; el "spec rc=$?"
for f in serving_blobs ab_main ab_ids; do echo "== $f"; grep -E "ceiling| us |blob" $OUT/$f.log | head -30; done
echo "== bs64"; grep -E "ceiling|uq-head \(" $OUT/bs64.log | head; echo "== spec"; grep -vE "^\s*$" $OUT/spec_blobs.log | tail -25
cd $OUT && tar czf results.tgz $(ls *.log *.json | grep -v '^call.log$') && rm -f $(ls *.log *.json | grep -v '^call.log$')
