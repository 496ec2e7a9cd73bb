#!/bin/bash
# Issue 24 (2026-12-04, evening), one H200 call: the head-major ring copy by per-thread consecutive rows (branch
# `percopy`, in .pc/) against main (the tree), Gluon JIT. (1) the branch's GPU suites and sanitizers, both trees'
# serving rows compiled in parallel; (2) alone on the GPU: `bench --serving --no-aot` on both trees, A-D at block 64
# and `bench --spec-decode` on the branch.
set -u
export PYTHONUNBUFFERED=1 ULTRAQUANT_CACHE_DIR=/tmp/uq_c TRITON_CACHE_DIR=/tmp/tc ULTRAQUANT_BACKEND=triton
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; t0=$(date +%s); ROOT=$PWD; PC=$ROOT/.pc
el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
cd $PC; export PYTHONPATH=$PC
timeout 330 python3 -m pytest -q -rfE -p no:cacheprovider -m gpu tests/gpu/test_decode_wholepage_gpu.py > $OUT/wp_gpu.log 2>&1 &
timeout 330 python3 -m pytest -q -rfE -p no:cacheprovider -m gpu tests/gpu/test_spec_decode_gpu.py tests/gpu/test_bounds_gpu.py \
  > $OUT/mq_gpu.log 2>&1 &
timeout 300 compute-sanitizer --tool memcheck --print-limit 20 python3 tests/gpu/sanitize_wholepage.py > $OUT/san.log 2>&1 &
UQ_SANITIZE_BOUNDS=0 UQ_SANITIZE_CASES=1,3,4,5 timeout 300 compute-sanitizer --tool racecheck --print-limit 20 \
  python3 tests/gpu/sanitize_wholepage.py > $OUT/race.log 2>&1 &
(timeout 190 compute-sanitizer --tool memcheck --print-limit 20 python3 tests/gpu/sanitize_spec_decode.py > $OUT/mq_san.log 2>&1;
 timeout 130 compute-sanitizer --tool racecheck --print-limit 20 python3 tests/gpu/sanitize_spec_decode.py >> $OUT/mq_san.log 2>&1) &
(timeout 300 python3 -m ultraquant.cli bench --spec-decode > /dev/null 2>&1) &  # compiles the branch's multi-query configs
for tree in $ROOT $PC; do
  (cd $tree && PYTHONPATH=$tree timeout 240 python3 benchmarks/lab/ring_sweep.py warm /dev/null \
    "ragged,GQA16,one kv,short,A,B,C,D" policy > /dev/null 2>&1) &
done
wait; el "phase 1 done"; cd $ROOT
tail -1 $OUT/wp_gpu.log; tail -1 $OUT/mq_gpu.log; grep -h "^FAILED" $OUT/wp_gpu.log $OUT/mq_gpu.log | head
for f in san race mq_san; do echo "$f: $(grep -h 'ERROR SUMMARY\|RACECHECK SUMMARY' $OUT/$f.log | tr '\n' ' ')"; done
for t in pc main; do tree=$ROOT; [ $t = pc ] && tree=$PC
  (cd $tree && PYTHONPATH=$tree timeout 100 python3 -m ultraquant.cli bench --serving --no-aot --json $OUT/serving_$t.json \
    > $OUT/serving_$t.log 2>&1); el "serving $t rc=$?"; done
(cd $PC && PYTHONPATH=$PC timeout 80 python3 -m ultraquant.cli bench --shapes A,B,C,D --layouts head --no-stream \
  --json $OUT/bs64_pc.json > $OUT/bs64_pc.log 2>&1); el "bs64 pc rc=$?"
(cd $PC && PYTHONPATH=$PC timeout 90 python3 -m ultraquant.cli bench --spec-decode --json $OUT/spec_pc.json \
  > $OUT/spec_pc.log 2>&1); el "spec pc rc=$?"
for f in serving_pc serving_main; do echo "== $f"; grep -E "ceiling| us " $OUT/$f.log | grep -v "no blob" | head -20; done
echo "== bs64 pc"; grep -E "ceiling|uq-head \(" $OUT/bs64_pc.log | tail -4
echo "== spec pc"; grep -E "decode|spec" $OUT/spec_pc.log | grep -v prefill | tail -8
cd $OUT && tar czf logs.tgz $(ls *.log | grep -v '^call.log$') && rm -f $(ls *.log | grep -v '^call.log$')
