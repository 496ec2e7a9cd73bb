#!/bin/bash
# Issue 24 (2026-12-04): benchmarks/lab/ring_sweep.py on the H200: compile every (row, ring) in parallel, then
# time them alone on the GPU. $OUT/ring_sweep.json + .log.
set -u
export PYTHONUNBUFFERED=1 ULTRAQUANT_CACHE_DIR=/tmp/uq_c PYTHONPATH=$PWD TRITON_CACHE_DIR=/tmp/tc
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; t0=$(date +%s)
ROWS="GQA16 32/2,GQA16 16/1,one kv head,ragged 96,A bs16"; RINGS="4x2,2x4,1x8,2x2,1x4"
IFS=,; for r in $ROWS; do for g in $RINGS; do
  timeout 150 python3 benchmarks/lab/ring_sweep.py warm /dev/null "$r" $g > /dev/null 2>&1 &
done; done; unset IFS; wait
echo "warm done at +$(( $(date +%s) - t0 ))s"
timeout 200 python3 benchmarks/lab/ring_sweep.py time $OUT/ring_sweep.json "$ROWS" $RINGS 2>&1 | tee $OUT/ring_sweep.log
echo "done at +$(( $(date +%s) - t0 ))s"
