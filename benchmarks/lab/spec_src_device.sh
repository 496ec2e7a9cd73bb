#!/bin/bash
# Issue 25 (2026-12-06, night): after patch_ab_device.sh in the same call (the patched tree in $PWD, main's in
# /tmp/main_tree, blobs in .new/ and /tmp/main_tree/.blobs/), ncu's per-instruction stall sampling of the 8- and
# 4-token steps at the A geometry (benchmarks/lab/spec_ncu.py) through both trees' blobs, summarized by
# benchmarks/lab/ncu_source_sum.py and split by region (stage loop, merge loop, the rest) by
# benchmarks/lab/ncu_regions.py; then (DECODE_ROW set) the same sampling of that serving row's whole-page decode
# through the patched tree's blobs (benchmarks/lab/serving_ncu.py).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; t0=$(date +%s)
el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
for r in new:$PWD:$PWD/.new main:/tmp/main_tree:/tmp/main_tree/.blobs; do IFS=: read -r n d g <<< "$r"
  for k in 8 4; do
    (cd $d && PYTHONPATH=$d ULTRAQUANT_GENERATED=$g ULTRAQUANT_CACHE_DIR=/tmp/uq_c TRITON_CACHE_DIR=/tmp/tc \
      timeout 120 ncu -k regex:uq_decode_multiquery --launch-skip 1 -c 1 --section WarpStateStats \
      --section SchedulerStats --section SourceCounters --section SpeedOfLight -f -o $OUT/mq_${n}_$k \
      python3 benchmarks/lab/spec_ncu.py $k > $OUT/mq_${n}_$k.log 2>&1); el "ncu $n $k rc=$?"
    ncu -i $OUT/mq_${n}_$k.ncu-rep --page source --csv --print-source sass > $OUT/mq_${n}_${k}_src.csv 2>&1
    ncu -i $OUT/mq_${n}_$k.ncu-rep --page details > $OUT/mq_${n}_${k}_details.txt 2>&1
    python3 benchmarks/lab/ncu_source_sum.py $OUT/mq_${n}_${k}_src.csv 25 > $OUT/mq_${n}_${k}_src.txt 2>&1
    python3 benchmarks/lab/ncu_regions.py $OUT/mq_${n}_${k}_src.csv >> $OUT/mq_${n}_${k}_src.txt 2>&1
    grep -E "Duration|Warp Cycles Per Issued|Issued Warp" $OUT/mq_${n}_${k}_details.txt | head -4
    head -12 $OUT/mq_${n}_${k}_src.txt; tail -8 $OUT/mq_${n}_${k}_src.txt
    gzip -f $OUT/mq_${n}_${k}_src.csv; rm -f $OUT/mq_${n}_$k.ncu-rep
  done
done
if [ -n "${DECODE_ROW-}" ]; then f=dec_$(echo "$DECODE_ROW" | tr " /" "__")
  ULTRAQUANT_GENERATED=$PWD/.new ULTRAQUANT_CACHE_DIR=/tmp/uq_c TRITON_CACHE_DIR=/tmp/tc PYTHONPATH=$PWD timeout 120 \
    ncu -k regex:uq_decode_wholepage --launch-skip 1 -c 1 --section WarpStateStats --section SchedulerStats \
    --section SourceCounters -f -o $OUT/$f python3 benchmarks/lab/serving_ncu.py "$DECODE_ROW" > $OUT/$f.log 2>&1
  el "ncu $DECODE_ROW rc=$?"
  ncu -i $OUT/$f.ncu-rep --page source --csv --print-source sass > $OUT/${f}_src.csv 2>&1
  python3 benchmarks/lab/ncu_source_sum.py $OUT/${f}_src.csv 40 > $OUT/${f}_src.txt 2>&1
  python3 benchmarks/lab/ncu_regions.py $OUT/${f}_src.csv >> $OUT/${f}_src.txt 2>&1
  head -12 $OUT/${f}_src.txt; gzip -f $OUT/${f}_src.csv; rm -f $OUT/$f.ncu-rep
fi
