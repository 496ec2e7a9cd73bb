#!/bin/bash
# Issues 24/25 (2026-12-04, evening), a short H200 call on the landed code's blobs (.blobs/): `bench --spec-decode`
# twice more (the 8-token step sits on its 2.5x gate), then ncu stall counters of three serving rows' decode.
set -u
export PYTHONUNBUFFERED=1 ULTRAQUANT_CACHE_DIR=/tmp/uq_c TRITON_CACHE_DIR=/tmp/tc PYTHONPATH=$PWD ULTRAQUANT_GENERATED=$PWD/.blobs
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; t0=$(date +%s)
for i in 1 2; do timeout 60 python3 -m ultraquant.cli bench --spec-decode --json $OUT/spec_$i.json > $OUT/spec_$i.log 2>&1
  echo "[+$(( $(date +%s) - t0 ))s] spec $i rc=$?"; grep -E "^A .*spec|^A .*decode" $OUT/spec_$i.log; done
M=gpu__time_duration.sum,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed
for s in wait math_pipe_throttle long_scoreboard short_scoreboard barrier no_instruction mio_throttle lg_throttle; do
  M=$M,smsp__average_warps_issue_stalled_${s}_per_issue_active.ratio; done
for row in "GQA16 32/2" "A bs16" "one kv head"; do f=$(echo "$row" | tr " /" "__")
  timeout 50 ncu -k regex:uq_decode_wholepage --launch-skip 1 --launch-count 1 --metrics $M \
    python3 benchmarks/lab/serving_ncu.py "$row" > "$OUT/ncu_$f.txt" 2>&1
  echo "[+$(( $(date +%s) - t0 ))s] ncu $row rc=$?"; grep -E "^\s+(smsp|dram|gpu__)" "$OUT/ncu_$f.txt"; done
cd $OUT && cat ncu_*.txt > ncu.txt && rm -f ncu_*.txt
