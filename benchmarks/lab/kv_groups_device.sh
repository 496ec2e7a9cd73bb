#!/bin/bash
# Issue 24, one device call for benchmarks/lab/kv_groups.patch (a one-piece request writes out directly; small
# batches split each request into kv-head groups): the patched tree's GPU suites and sanitizers (gpu_suites.sh,
# SUITES_S=300), then `bench --serving --no-aot` patched / main / patched through .new/ and .blobs/
# (ab_blobs.sh with the same PATCHES). Everything packed into $OUT/all.tgz.
export PATCHES=${PATCHES:-benchmarks/lab/kv_groups.patch}
. benchmarks/lab/ab_setup.sh
SUITES_S=${SUITES_S:-300} . benchmarks/lab/gpu_suites.sh
for n in ${RUNS:-new_1 main new_2}; do serving_run $n; grep -E "ceiling| us |no blob" $OUT/serving_$n.log | head -14; done
cd $OUT && tar czf all.tgz --exclude=all.tgz --exclude=call.log * && find . -type f ! -name all.tgz ! -name call.log -delete
