#!/bin/bash
# Issue 24: the warp copies on the device. PATCHES (default benchmarks/lab/warp_copy_all.patch: the whole-page and
# the multi-query decode; warp_copy.patch: the whole-page decode alone). Before it, on the CPU, with the same
# PATCHES: `bash benchmarks/lab/ab_blobs.sh` (.new/ patched, .blobs/ main; carry both).
# PHASE=bench (alone on the GPU, ~5 min): `bench --serving` through the blobs, new / main / new, `bench
# --spec-decode` new / main, then A-D at block 64 (JIT) on the patched tree. PHASE=check (~6 min): the patched
# tree's whole-page, bounds and spec-decode GPU suites beside racecheck of the head-major sanitizer cases (the patch
# changes how the ring's copies are ordered: warp-local waits, no CTA barrier), then memcheck (all cases + bounds)
# beside synccheck and the multi-query racecheck. PHASE=all: both, bench first (BS64=0 CHECK_S=150 fit one call).
# PHASE=sweep: the patched tree's JIT launch shapes (ring_sweep.py): 8 warps (4x2) against 16 warps (2x2:w16, 128
# registers, no spill in the loop once the copies are the warps' own) on the D=128 rows of GQA <= 8.
# Everything packed into $OUT/warp_copy.tgz after each phase.
PATCHES=${PATCHES:-benchmarks/lab/warp_copy_all.patch}
. benchmarks/lab/ab_setup.sh
PHASE=${PHASE:-bench}
pack() { (cd $OUT && tar czf warp_copy.tgz --exclude=warp_copy.tgz --exclude=call.log $(ls | grep -v '^warp_copy.tgz$\|^call.log$')); }
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
if [ "$PHASE" = sweep ]; then
  timeout 400 python3 benchmarks/lab/ring_sweep.py time $OUT/sweep.json \
    "A bs16,B bs16,D bs16,ragged 96,ragged 80,one kv head,short 256" 4x2,2x2:w16 > $OUT/sweep.log 2>&1
  el "sweep rc=$?"; grep -E " us " $OUT/sweep.log; pack; PHASE=done
fi
if [ "$PHASE" = all ] || [ "$PHASE" = bench ]; then
  for n in new_1 main new_2; do serving_run $n; grep -E "ceiling| us |no blob" $OUT/serving_$n.log | head -14; pack; done
  for n in new main; do d=$PWD g=$PWD/.new; [ $n = main ] && d=$MT g=$MT/.blobs
    (cd $d && PYTHONPATH=$d ULTRAQUANT_GENERATED=$g timeout 90 python3 -m ultraquant.cli bench --spec-decode \
      --json $OUT/spec_$n.json > $OUT/spec_$n.log 2>&1); el "spec $n rc=$?"; grep -E "spec k|decode " $OUT/spec_$n.log
    pack; done
  if [ "${BS64:-1}" = 1 ]; then
    ULTRAQUANT_BACKEND=triton timeout 120 python3 -m ultraquant.cli bench --shapes A,B,C,D --layouts head --no-stream \
      --json $OUT/bs64_new.json > $OUT/bs64_new.log 2>&1; el "bs64 rc=$?"; grep -E "ceiling|uq-head \(" $OUT/bs64_new.log | tail -5
    pack
  fi
fi
if [ "$PHASE" = all ] || [ "$PHASE" = check ]; then
  S=${CHECK_S:-170}
  timeout $S python3 -m pytest -q -rfE -p no:cacheprovider -m gpu tests/gpu/test_decode_wholepage_gpu.py \
    tests/gpu/test_bounds_gpu.py tests/gpu/test_spec_decode_gpu.py > $OUT/wp_gpu.log 2>&1 &
  UQ_SANITIZE_BOUNDS=0 UQ_SANITIZE_CASES=0,1,2,3,4 timeout $S compute-sanitizer --tool racecheck --print-limit 20 \
    python3 tests/gpu/sanitize_wholepage.py > $OUT/racecheck.log 2>&1 &
  wait; el "suite + racecheck"; tail -n2 $OUT/wp_gpu.log; grep -h "^FAILED" $OUT/wp_gpu.log | head
  grep -h "RACECHECK SUMMARY\|ERROR SUMMARY" $OUT/racecheck.log; pack
  timeout $S compute-sanitizer --tool memcheck --print-limit 20 python3 tests/gpu/sanitize_wholepage.py \
    > $OUT/memcheck.log 2>&1 &
  UQ_SANITIZE_BOUNDS=0 UQ_SANITIZE_CASES=3,4 timeout $S compute-sanitizer --tool synccheck \
    python3 tests/gpu/sanitize_wholepage.py > $OUT/synccheck.log 2>&1 &
  timeout $S compute-sanitizer --tool racecheck --print-limit 20 python3 tests/gpu/sanitize_spec_decode.py \
    > $OUT/racecheck_mq.log 2>&1 &
  wait; el "memcheck + synccheck + multi-query racecheck"
  grep -h "ERROR SUMMARY\|RACECHECK SUMMARY" $OUT/memcheck.log $OUT/synccheck.log $OUT/racecheck_mq.log; pack
fi
find $OUT -type f ! -name warp_copy.tgz ! -name call.log -delete
