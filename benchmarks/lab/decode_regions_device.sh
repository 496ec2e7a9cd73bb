#!/bin/bash
# Issue 24: where the small rows' time goes in the current whole-page decode. ncu's per-instruction stall sampling
# of each row in ROWS (`--serving` row name prefixes, `;`-separated) through main's sm_90 blobs in .blobs/
# (benchmarks/lab/serving_ncu.py), summarized by benchmarks/lab/ncu_source_sum.py (samples by times executed:
# the stage loop against the once-per-piece prologue / epilogue) and benchmarks/lab/ncu_regions.py; packed into
# $OUT/regions.tgz.
set -u
export PYTHONUNBUFFERED=1 ULTRAQUANT_CACHE_DIR=/tmp/uq_c TRITON_CACHE_DIR=/tmp/tc PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/g"; t0=$(date +%s)
el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
nvidia-smi --query-gpu=name --format=csv,noheader
IFS=';' read -ra rows <<< "${ROWS:-GQA16 32/2;GQA16 16/1;one kv head;A bs16}"
for row in "${rows[@]}"; do f=$(echo "$row" | tr " /" "__")
  ULTRAQUANT_GENERATED=$PWD/.blobs timeout 100 ncu -k regex:uq_decode_wholepage --launch-skip 1 -c 1 \
    --section WarpStateStats --section SchedulerStats --section SourceCounters --section SpeedOfLight -f \
    -o $OUT/g/$f python3 benchmarks/lab/serving_ncu.py "$row" > $OUT/g/$f.log 2>&1; el "ncu $row rc=$?"
  ncu -i $OUT/g/$f.ncu-rep --page source --csv --print-source sass > $OUT/g/${f}_src.csv 2>&1
  ncu -i $OUT/g/$f.ncu-rep --page details > $OUT/g/${f}_details.txt 2>&1
  python3 benchmarks/lab/ncu_source_sum.py $OUT/g/${f}_src.csv 30 > $OUT/g/${f}_src.txt 2>&1
  python3 benchmarks/lab/ncu_regions.py $OUT/g/${f}_src.csv >> $OUT/g/${f}_src.txt 2>&1
  grep -E "Duration|Warp Cycles Per Issued|Issued Warp|Issue Slots Busy" $OUT/g/${f}_details.txt | head -5
  head -14 $OUT/g/${f}_src.txt; tail -8 $OUT/g/${f}_src.txt
  gzip -f $OUT/g/${f}_src.csv; rm -f $OUT/g/$f.ncu-rep
done
cd $OUT && tar czf regions.tgz g && rm -rf g
