#!/bin/bash
# A/B of PATCHES when little device time is left: the most needed result first, everything packed into
# $OUT/all.tgz after each phase (a call cut short keeps what ran). (1) `bench --spec-decode` through main's blobs
# and the patched ones, alternating twice (issue 25's gate on main), (2) `bench --serving --no-aot` patched / main /
# patched through their blobs, (3) the patched tree's GPU suites and sanitizers (gpu_suites.sh; SUITES_S limits
# them, by default to the call's time left, min(330, 570 - elapsed), so the call stays under the device's 600 s; with
# under 60 s left they are skipped: a second call runs them alone,
# `bash -c '. benchmarks/lab/ab_setup.sh; SUITES_S=330 . benchmarks/lab/gpu_suites.sh'` with the same PATCHES).
# Blobs from benchmarks/lab/ab_blobs.sh.
. benchmarks/lab/ab_setup.sh
pack() { (cd $OUT && tar czf all.tgz --exclude=all.tgz --exclude=call.log $(ls | grep -v '^all.tgz$\|^call.log$')); }
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
for r in main_1:$MT new_1:$PWD main_2:$MT new_2:$PWD; do n=${r%%:*}; d=${r#*:}; g=$d/.new; [ $d = $MT ] && g=$MT/.blobs
  (cd $d && PYTHONPATH=$d ULTRAQUANT_GENERATED=$g timeout 90 python3 -m ultraquant.cli bench --spec-decode \
    --json $OUT/spec_$n.json > $OUT/spec_$n.log 2>&1); el "spec $n rc=$?"; grep -E "spec k|decode " $OUT/spec_$n.log; done; pack
for n in new_1 main new_2; do serving_run $n
  grep -E "ceiling| us |no blob" $OUT/serving_$n.log | head -20; pack; done
left=$(( 570 - $(date +%s) + t0 )); [ "$left" -gt 330 ] && left=330
if [ -n "${SUITES_S:-}" ] || [ "$left" -ge 60 ]; then SUITES_S=${SUITES_S:-$left} . benchmarks/lab/gpu_suites.sh
else el "suites skipped: ${left}s left"; fi
pack; find $OUT -type f ! -name all.tgz ! -name call.log -delete
