#!/bin/bash
# Issue 24/25, the landing call (2026-12-04): `bench --serving --no-aot` through fresh sm_90 blobs ($BLOBS:
# the serving rows' whole-page configs on both page layouts, and the store), alone on the GPU; ncu of
# shape A on both layouts; `bench --spec-decode` (JIT); then in parallel the whole-page, decode, bounds and
# multi-query GPU suites and compute-sanitizer on the token-major cases and the bounds workload.
set -u
export PYTHONUNBUFFERED=1 ULTRAQUANT_CACHE_DIR=/tmp/uq_c PYTHONPATH=$PWD TRITON_CACHE_DIR=/tmp/tc
OUT=${OUT:-/tmp/out}; R=$(mktemp -d); mkdir -p "$OUT"; S=$R/summary.txt; t0=$(date +%s)
save() { cp $S $OUT/ && tar -czf $OUT/land.tgz -C $R . ; }
at() { echo "$1 at +$(( $(date +%s) - t0 ))s" | tee -a $S; }
ULTRAQUANT_GENERATED=$BLOBS timeout 220 python3 -m ultraquant.cli bench --serving --no-aot \
  --json $R/serving.json > $R/serving.log 2>&1
at "serving bench rc=$?"; grep -E "ceiling|us |rror|blob" $R/serving.log | tee -a $S; save
M=l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,smsp__inst_executed.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,lts__t_sectors_srcunit_tex_op_read.sum
for l in hm tm; do
  timeout 100 ncu -k regex:uq_decode_wholepage --launch-skip 1 --launch-count 1 --metrics $M \
    python3 benchmarks/lab/token_major_ncu.py $l > $R/ncu_$l.txt 2>&1
  at "ncu $l rc=$?"; grep -E "^\s+(l1tex|smsp|dram|gpu__|lts)" $R/ncu_$l.txt | tee -a $S
done; save
timeout 120 python3 -m ultraquant.cli bench --spec-decode --json $R/spec.json > $R/spec.log 2>&1
at "spec bench rc=$?"; grep -E "ceiling|us |x " $R/spec.log | head -16 | tee -a $S; save
P=(python3 -m pytest -q -rfE -p no:cacheprovider)
python3 -m pytest --collect-only -q -m gpu tests/gpu/test_decode_wholepage_gpu.py 2>/dev/null | grep "::" > $R/ids.txt
echo "whole-page ids: $(wc -l < $R/ids.txt)" | tee -a $S
for i in 0 1 2; do
  awk -v i=$i 'NR % 3 == i' $R/ids.txt > $R/ids_$i.txt
  timeout 220 "${P[@]}" $(cat $R/ids_$i.txt) > $R/wholepage_gpu_$i.log 2>&1 &
done
timeout 220 "${P[@]}" -m gpu tests/gpu/test_kernels_gpu.py tests/gpu/test_bounds_gpu.py -k "decode or garbage" \
  > $R/kernels_bounds_gpu.log 2>&1 &
timeout 220 "${P[@]}" -m gpu tests/gpu/test_spec_decode_gpu.py > $R/spec_gpu.log 2>&1 &
for t in memcheck racecheck; do
  UQ_SANITIZE_CASES=5,6,7 UQ_SANITIZE_BOUNDS=0 timeout 220 compute-sanitizer --tool $t --print-limit 20 \
    python3 tests/gpu/sanitize_wholepage.py > $R/tm_$t.log 2>&1 &
done
timeout 220 compute-sanitizer --tool memcheck --print-limit 20 python3 tests/gpu/sanitize.py --bounds \
  > $R/bounds_memcheck.log 2>&1 &
timeout 220 compute-sanitizer --tool memcheck --print-limit 20 python3 tests/gpu/sanitize_spec_decode.py \
  > $R/spec_memcheck.log 2>&1 &
wait
for f in $R/wholepage_gpu_*.log $R/kernels_bounds_gpu.log $R/spec_gpu.log; do
  echo "$(basename $f): $(tail -1 $f)"; grep -h "^FAILED\|^ERROR" $f | head -8; done | tee -a $S
for t in tm_memcheck tm_racecheck bounds_memcheck spec_memcheck; do
  echo "$t: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $R/$t.log | tail -1)"; grep -vE "^=========" $R/$t.log | tail -2
done | tee -a $S
at "C done"; save
