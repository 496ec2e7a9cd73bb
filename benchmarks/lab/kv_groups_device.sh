#!/bin/bash
# Issue 24, one device call for benchmarks/lab/kv_groups.patch (small batches split each request into kv-head
# groups, in the whole-page and the multi-query decode): the patched tree's GPU suites and sanitizers (gpu_suites.sh,
# SUITES_S=300), then `bench --serving --no-aot` patched / main / patched (RUNS) and `bench --spec-decode` patched /
# main through .new/ and .blobs/ (ab_blobs.sh with the same PATCHES). Everything packed into $OUT/all.tgz.
export PATCHES=${PATCHES:-benchmarks/lab/kv_groups.patch}
. benchmarks/lab/ab_setup.sh
SUITES_S=${SUITES_S:-300} . benchmarks/lab/gpu_suites.sh
for n in ${RUNS:-new_1 main new_2}; do serving_run $n; grep -E "ceiling| us |no blob" $OUT/serving_$n.log | head -14; done
# speculative-decoding steps (the multi-query decode takes the same work items): patched then main's blobs
ULTRAQUANT_GENERATED=$PWD/.new timeout 90 python3 -m ultraquant.cli bench --spec-decode --json $OUT/spec_new.json \
  > $OUT/spec_new.log 2>&1; el "spec new rc=$?"
(cd $MT && PYTHONPATH=$MT ULTRAQUANT_GENERATED=$MT/.blobs timeout 90 python3 -m ultraquant.cli bench --spec-decode \
  --json $OUT/spec_main.json > $OUT/spec_main.log 2>&1); el "spec main rc=$?"
for f in spec_new spec_main; do echo "== $f"; grep -E "decode|spec" $OUT/$f.log | grep -v prefill | tail -8; done
cd $OUT && tar czf all.tgz --exclude=all.tgz --exclude=call.log * && find . -type f ! -name all.tgz ! -name call.log -delete
