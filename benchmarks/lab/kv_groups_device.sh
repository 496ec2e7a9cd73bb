#!/bin/bash
# Issue 24, the device call(s) for benchmarks/lab/kv_groups.patch (small batches split each request into kv-head
# groups, in the whole-page and the multi-query decode), through .new/ and .blobs/ (ab_blobs.sh with the same
# PATCHES). PHASE (default "bench checks"), in this order so the decision data comes first:
#   bench:  `bench --serving --no-aot` patched / main / patched (RUNS), then `bench --spec-decode` patched / main;
#   checks: the patched tree's GPU suites and sanitizers (gpu_suites.sh), each job bounded by the call's time left
#           (SUITES_S, default min(330, 570 - elapsed)); a cut run is finished by a second call with PHASE=checks.
# The card's name first (an H200's serving rows are also the gates' numbers). Everything packed into $OUT/all.tgz.
export PATCHES=${PATCHES:-benchmarks/lab/kv_groups.patch}
. benchmarks/lab/ab_setup.sh
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | head -1 | tee $OUT/card.txt
PHASE=${PHASE:-bench checks}
if [[ $PHASE == *bench* ]]; then
  for n in ${RUNS:-new_1 main new_2}; do serving_run $n; grep -E "ceiling| us |no blob" $OUT/serving_$n.log | head -14; done
  # speculative-decoding steps (the multi-query decode takes the same work items): patched then main's blobs
  ULTRAQUANT_GENERATED=$PWD/.new timeout 90 python3 -m ultraquant.cli bench --spec-decode --json $OUT/spec_new.json \
    > $OUT/spec_new.log 2>&1; el "spec new rc=$?"
  (cd $MT && PYTHONPATH=$MT ULTRAQUANT_GENERATED=$MT/.blobs timeout 90 python3 -m ultraquant.cli bench --spec-decode \
    --json $OUT/spec_main.json > $OUT/spec_main.log 2>&1); el "spec main rc=$?"
  for f in spec_new spec_main; do echo "== $f"; grep -E "decode|spec" $OUT/$f.log | grep -v prefill | tail -8; done
fi
if [[ $PHASE == *checks* ]]; then
  left=$(( 570 - $(date +%s) + t0 )); [ "$left" -gt 330 ] && left=330
  if [ "$left" -ge 60 ]; then SUITES_S=${SUITES_S:-$left} . benchmarks/lab/gpu_suites.sh
  else el "checks skipped: ${left}s left (run again with PHASE=checks)"; fi
fi
cd $OUT && tar czf all.tgz --exclude=all.tgz --exclude=call.log * && find . -type f ! -name all.tgz ! -name call.log -delete
