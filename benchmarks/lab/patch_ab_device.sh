#!/bin/bash
# A/B of kernel patches on the device (issues 24/25): applies PATCHES (space-separated patch files, required) to
# the device's copy of the tree and runs, against main: (1) the GPU suites (whole-page, multi-query, bounds,
# attention) and sanitizers of the patched tree, A-D at block 64 compiled meanwhile; (2) alone on the GPU: `bench
# --serving --no-aot` through the patched blobs, main's, the patched again (A/B/A in one run), A-D at block 64
# (JIT), `bench --spec-decode` through the patched blobs and main's, ncu stall counters of NCU_ROWS (comma-separated rows of
# benchmarks/lab/serving_ncu.py; default three, empty: none). Needs two blob folders carried (ignored): .new/ =
# sm_90 blobs of the patched tree, .blobs/ = main's (both from benchmarks/lab/ab_blobs.sh with the same PATCHES).
# First used as interior_device.sh for the unmasked interior and movmatrix patches (landed in 3662513; NOTES,
# "Session of 2026-12-06"). Main's rows run in a pristine copy of the tree (/tmp/main_tree): a patch that changes a
# kernel's parameters changes its blob keys, so main's blobs only match main's code.
. benchmarks/lab/ab_setup.sh
. benchmarks/lab/gpu_suites.sh
for n in new_1 main new_2; do serving_run $n; done
ULTRAQUANT_BACKEND=triton timeout 80 python3 -m ultraquant.cli bench --shapes A,B,C,D --layouts head --no-stream \
  --json $OUT/bs64.json > $OUT/bs64.log 2>&1; el "bs64 rc=$?"
ULTRAQUANT_GENERATED=$PWD/.new timeout 90 python3 -m ultraquant.cli bench --spec-decode --json $OUT/spec.json > $OUT/spec.log 2>&1
el "spec rc=$?"
(cd $MT && PYTHONPATH=$MT ULTRAQUANT_GENERATED=$MT/.blobs timeout 90 python3 -m ultraquant.cli bench --spec-decode \
  --json $OUT/spec_main.json > $OUT/spec_main.log 2>&1); el "spec main rc=$?"
M=gpu__time_duration.sum,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active
for s in wait math_pipe_throttle long_scoreboard short_scoreboard barrier no_instruction mio_throttle; do
  M=$M,smsp__average_warps_issue_stalled_${s}_per_issue_active.ratio; done
IFS=, read -ra ROWS <<< "${NCU_ROWS-A bs16,GQA16 32/2,one kv head}"  # NCU_ROWS: the rows to profile, comma-separated
for row in "${ROWS[@]}"; do f=$(echo "$row" | tr " /" "__")  # the patched blobs' stalls
  ULTRAQUANT_GENERATED=$PWD/.new timeout 50 ncu -k regex:uq_decode_wholepage --launch-skip 1 --launch-count 1 \
    --metrics $M python3 benchmarks/lab/serving_ncu.py "$row" > "$OUT/ncu_$f.log" 2>&1; el "ncu $row rc=$?"; done
for n in new_1 main new_2; do echo "== serving $n"; grep -E "ceiling| us |no blob" $OUT/serving_$n.log | head -20; done
echo "== bs64"; grep -E "ceiling|uq-head \(" $OUT/bs64.log | tail -5
for f in spec spec_main; do echo "== $f"; grep -E "decode|spec" $OUT/$f.log | grep -v prefill | tail -8; done
echo "== ncu"; grep -hE "^\s+(smsp|gpu__)" $OUT/ncu_*.log
# one archive back: the device returns at most 8 files (2026-12-06 night lost a call's JSON files that way)
cd $OUT && tar czf all.tgz --exclude=all.tgz --exclude=call.log * && find . -type f ! -name all.tgz ! -name call.log -delete
