#!/bin/bash
# Issue 24 (2026-12-04, evening): one H200 call. The working tree has benchmarks/lab/wholepage_cross_piece.patch
# applied; .base/ holds main's tree (HEAD 4885d53). (1) the patched kernel's GPU suite and sanitizers, with every
# timed config compiled in parallel for both trees; (2) alone on the GPU: `bench --serving --no-aot` on both trees
# (Gluon JIT), main's bs64 A-D rows, and a launch-shape sweep (16 warps, two programs per SM) on main's tree.
set -u
export PYTHONUNBUFFERED=1 ULTRAQUANT_CACHE_DIR=/tmp/uq_c TRITON_CACHE_DIR=/tmp/tc ULTRAQUANT_BACKEND=triton
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; t0=$(date +%s); ROOT=$PWD; BASE=$ROOT/.base
el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
SWEEP_ROWS="A bs16,GQA16 32/2,one kv head"; SWEEP="4x2,1x4:w16:r128,2x2:r128:p264,2x2:p264"
PYTHONPATH=$ROOT timeout 260 python3 -m pytest -q -rfE -p no:cacheprovider -m gpu tests/gpu/test_decode_wholepage_gpu.py \
  > $OUT/xp_gpu.log 2>&1 &
PYTHONPATH=$ROOT UQ_SANITIZE_BOUNDS=0 UQ_SANITIZE_CASES=3,4,5,6 timeout 260 compute-sanitizer --tool racecheck \
  --print-limit 20 python3 tests/gpu/sanitize_wholepage.py > $OUT/xp_racecheck.log 2>&1 &
PYTHONPATH=$ROOT timeout 260 compute-sanitizer --tool memcheck --print-limit 20 python3 tests/gpu/sanitize_wholepage.py \
  > $OUT/xp_memcheck.log 2>&1 &
PYTHONPATH=$ROOT UQ_SANITIZE_BOUNDS=0 UQ_SANITIZE_CASES=3,5 timeout 260 compute-sanitizer --tool synccheck \
  python3 tests/gpu/sanitize_wholepage.py > $OUT/xp_synccheck.log 2>&1 &
for tree in $ROOT $BASE; do
  (cd $tree && PYTHONPATH=$tree timeout 240 python3 benchmarks/lab/ring_sweep.py warm /dev/null "ragged,GQA16,one kv,short,A,B,C,D" policy \
    > /dev/null 2>&1) &
done
IFS=,; for g in $SWEEP; do (cd $BASE && PYTHONPATH=$BASE timeout 240 python3 benchmarks/lab/ring_sweep.py warm /dev/null "$SWEEP_ROWS" "$g" \
  > /dev/null 2>&1) & done; unset IFS
wait; el "phase 1 done"
tail -1 $OUT/xp_gpu.log; grep -h "^FAILED" $OUT/xp_gpu.log | head; for f in racecheck memcheck synccheck; do
  echo "$f: $(grep -h 'ERROR SUMMARY\|RACECHECK SUMMARY' $OUT/xp_$f.log | tr '\n' ' ') mismatches: $(grep -c -i 'mismatch\|fail' $OUT/xp_$f.log)"; done
(cd $ROOT && PYTHONPATH=$ROOT timeout 130 python3 -m ultraquant.cli bench --serving --no-aot --json $OUT/xp_serving.json \
  > $OUT/xp_serving.log 2>&1); el "patched bench rc=$?"
(cd $BASE && PYTHONPATH=$BASE timeout 130 python3 -m ultraquant.cli bench --serving --no-aot --json $OUT/base_serving.json \
  > $OUT/base_serving.log 2>&1); el "base bench rc=$?"
(cd $BASE && PYTHONPATH=$BASE timeout 100 python3 -m ultraquant.cli bench --shapes A,B,C,D --layouts head --no-stream \
  --json $OUT/base_bs64.json > $OUT/base_bs64.log 2>&1); el "bs64 rc=$?"
(cd $BASE && PYTHONPATH=$BASE timeout 100 python3 benchmarks/lab/ring_sweep.py time $OUT/base_sweep.json "$SWEEP_ROWS" "$SWEEP" \
  > $OUT/base_sweep.log 2>&1); el "sweep rc=$?"
for f in xp_serving base_serving base_bs64; do echo "== $f"; grep -E "ceiling|  us|us " $OUT/$f.log | head -40; done
cat $OUT/base_sweep.log
