#!/bin/bash
# Issue 24 + 25, one H200 call (2026-12-04, after token_major_device.sh): token-major and D=256 head-major
# through fresh sm_90 blobs ($BLOBS), ncu of A on both page layouts, the multi-query merge layout and its
# stage barriers (the PTX hook ultraquant/kernels/gluon/ring_barriers.py of commit d2f59f4, not landed) A/B, and the GPU
# suites the changes touch, in parallel, with compute-sanitizer. $OUT/summary.txt + $OUT/ss.tgz.
set -u
export PYTHONUNBUFFERED=1 ULTRAQUANT_CACHE_DIR=/tmp/uq_c PYTHONPATH=$PWD TRITON_CACHE_DIR=/tmp/tc
OUT=${OUT:-/tmp/out}; R=$(mktemp -d); mkdir -p "$OUT"; S=$R/summary.txt; t0=$(date +%s)
save() { cp $S $OUT/ && tar -czf $OUT/ss.tgz -C $R . ; }
at() { echo "$1 at +$(( $(date +%s) - t0 ))s" | tee -a $S; }
ULTRAQUANT_GENERATED=$BLOBS timeout 150 python3 -m ultraquant.cli bench --serving --no-aot \
  --serving-rows "token-major,A bs16,C bs16" --json $R/serving_aot.json > $R/serving_aot.log 2>&1
at "aot bench rc=$?"; grep -E "ceiling|us |rror|blob" $R/serving_aot.log | tee -a $S; save
for v in keep drop; do
  if [ $v = keep ]; then export ULTRAQUANT_MQ_KEEP_BARRIERS=1; else unset ULTRAQUANT_MQ_KEEP_BARRIERS; fi
  TRITON_CACHE_DIR=/tmp/tc_$v timeout 150 python3 -m ultraquant.cli bench --spec-decode --json $R/mq_$v.json \
    > $R/mq_$v.log 2>&1
  at "spec bench $v rc=$?"; grep -E "ceiling|us |x " $R/mq_$v.log | head -20 | tee -a $S; save
done
unset ULTRAQUANT_MQ_KEEP_BARRIERS
M=l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,smsp__inst_executed.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,gpu__time_duration.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,lts__t_sectors_srcunit_tex_op_read.sum
for l in hm tm; do
  timeout 120 ncu -k regex:uq_decode_wholepage --launch-skip 1 --launch-count 1 --metrics $M \
    python3 benchmarks/lab/token_major_ncu.py $l > $R/ncu_$l.txt 2>&1
  at "ncu $l rc=$?"; grep -E "^\s+(l1tex|smsp|dram|gpu__|lts)" $R/ncu_$l.txt | tee -a $S
done; save
P=(python3 -m pytest -q -rfE -p no:cacheprovider)
python3 -m pytest --collect-only -q -m gpu tests/gpu/test_decode_wholepage_gpu.py 2>/dev/null | grep "::" > $R/ids.txt
echo "whole-page ids: $(wc -l < $R/ids.txt)" | tee -a $S
for i in 0 1 2; do
  awk -v i=$i 'NR % 3 == i' $R/ids.txt > $R/ids_$i.txt
  timeout 200 "${P[@]}" $(cat $R/ids_$i.txt) > $R/wholepage_gpu_$i.log 2>&1 &
done
timeout 200 "${P[@]}" -m gpu tests/gpu/test_spec_decode_gpu.py > $R/spec_gpu.log 2>&1 &
timeout 200 "${P[@]}" -m gpu tests/gpu/test_kernels_gpu.py -k "decode and d256" > $R/kernels_d256_gpu.log 2>&1 &
for t in memcheck racecheck synccheck; do
  timeout 200 compute-sanitizer --tool $t --print-limit 20 python3 tests/gpu/sanitize_spec_decode.py \
    > $R/spec_$t.log 2>&1 &
done
UQ_SANITIZE_BOUNDS=0 timeout 200 compute-sanitizer --tool memcheck --print-limit 20 \
  python3 tests/gpu/sanitize_wholepage.py > $R/wp_memcheck.log 2>&1 &
wait
for f in $R/wholepage_gpu_*.log $R/spec_gpu.log $R/kernels_d256_gpu.log; do
  echo "$(basename $f): $(tail -1 $f)"; grep -h "^FAILED\|^ERROR" $f | head -8; done | tee -a $S
for t in spec_memcheck spec_racecheck spec_synccheck wp_memcheck; do
  echo "$t: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $R/$t.log | tail -1)"; grep -vE "^=========" $R/$t.log | tail -3
done | tee -a $S
at "C done"; save
