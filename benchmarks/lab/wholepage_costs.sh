#!/bin/bash
# Issue 24, session 3, device call 1: the whole-page decode's fixed and per-stage costs (Gluon JIT). Warms every
# kernel in parallel processes (one Triton cache), times benchmarks/lab/wholepage_costs.py's length sweeps for the
# tree, a no-math copy of it (the stage loop's math removed: the copy pipeline alone) and tuning variants, then
# ncu (sections + per-instruction stall sampling, summarized by benchmarks/lab/ncu_source_sum.py) of one kv head,
# GQA 16 32/2 and the ragged 96-request batch. From the repo root: OUT=... bash benchmarks/lab/wholepage_costs.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/uq_tc ULTRAQUANT_CACHE_DIR=/tmp/uq_c
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
W=benchmarks/lab/wholepage_costs.py
T=${SHAPES_TIME:-one,one64,one256,gqa16,gqa16h1,A,A64,ragged}
NM=/tmp/nomath; rm -rf $NM; mkdir -p $NM; cp -r ultraquant benchmarks $NM/
sed -i 's/for jp in gl.static_range(NSUB \/\/ PAIR):/for jp in gl.static_range(0):/' $NM/ultraquant/kernels/gluon/decode_wholepage.py
grep -c "static_range(0):" $NM/ultraquant/kernels/gluon/decode_wholepage.py
t0=$(date +%s)
for s in ${T//,/ }; do timeout 200 python3 $W base warm /dev/null $s > $OUT/warm_base_$s.log 2>&1 & done
for s in one gqa16 A; do (cd $NM && PYTHONPATH=$NM timeout 200 python3 $W nomath warm /dev/null $s > $OUT/warm_nomath_$s.log 2>&1) & done
for s in one gqa16 A; do timeout 200 python3 $W ns2st4 warm /dev/null $s nsub=2 stages=4 > $OUT/warm_ns2st4_$s.log 2>&1 & done
wait; echo "warm done at +$(( $(date +%s) - t0 ))s"; tail -qn1 $OUT/warm_*.log
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
python3 -c "from ultraquant.bench.decode import measure_ceiling; print(f'ceiling {measure_ceiling():.3f} TB/s')"
timeout 120 python3 $W base time $OUT/base.json $T
(cd $NM && PYTHONPATH=$NM timeout 60 python3 $W nomath time $OUT/nomath.json one,gqa16,A)
timeout 60 python3 $W ns2st4 time $OUT/ns2st4.json one,gqa16,A nsub=2 stages=4
echo "timing done at +$(( $(date +%s) - t0 ))s"
for s in ${NCU_SHAPES:-one gqa16 ragged}; do
  timeout 90 ncu --clock-control none -k "regex:uq_decode_wholepage" --launch-skip 1 -c 1 --section SpeedOfLight \
    --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
    --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section SourceCounters \
    -f -o $OUT/ncu_$s python3 $W ncu /dev/null $s > $OUT/ncu_$s.log 2>&1
  echo "ncu $s rc=$? at +$(( $(date +%s) - t0 ))s"
  ncu -i $OUT/ncu_$s.ncu-rep --page details > $OUT/ncu_${s}_details.txt 2>&1
  ncu -i $OUT/ncu_$s.ncu-rep --page source --csv --print-source sass > $OUT/ncu_${s}_src.csv 2>&1
  python3 benchmarks/lab/ncu_source_sum.py $OUT/ncu_${s}_src.csv 30 > $OUT/ncu_${s}_src.txt 2>&1
  grep -E "Duration|DRAM Throughput|Registers Per|Issue Slots Busy|Issued Warp|No Eligible|Achieved Occ|Warp Cycles Per Issued|Tensor|Pipe" $OUT/ncu_${s}_details.txt | head -20
  head -12 $OUT/ncu_${s}_src.txt
done
rm -f $OUT/*.ncu-rep
echo "done at +$(( $(date +%s) - t0 ))s"
