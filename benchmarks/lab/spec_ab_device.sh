#!/bin/bash
# A/B of a multi-query patch when device time is short (issue 25): applies PATCHES to the device's copy of the tree,
# times `bench --spec-decode` through the patched blobs (.new/), main's (pristine copy in /tmp/main_tree with .blobs/)
# and the patched again first, then runs the GPU suites and sanitizers of the patched tree (gpu_suites.sh), and
# packs every output into $OUT/all.tgz (the device returns few files). Blobs from benchmarks/lab/ab_blobs.sh.
. benchmarks/lab/ab_setup.sh
for r in new_1:$PWD:$PWD/.new main:$MT:$MT/.blobs new_2:$PWD:$PWD/.new; do IFS=: read -r n d g <<< "$r"
  (cd $d && PYTHONPATH=$d ULTRAQUANT_GENERATED=$g timeout 90 python3 -m ultraquant.cli bench --spec-decode \
    --json $OUT/spec_$n.json > $OUT/spec_$n.log 2>&1); el "spec $n rc=$?"
  grep -E "spec k|decode " $OUT/spec_$n.log; done
. benchmarks/lab/gpu_suites.sh
cd $OUT && tar czf all.tgz --exclude=all.tgz --exclude=call.log * && find . -type f ! -name all.tgz ! -name call.log -delete
