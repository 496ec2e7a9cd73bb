#!/bin/bash
# Issue 24, session 3, device calls: the whole-page decode's fixed and per-stage costs (Gluon JIT). Builds variant
# copies of the tree (nomath: the stage loop's math removed, the copy pipeline alone; noloop: no stage loop, the
# piece's prologue / epilogue / merge alone; nomerge: no last-program merge; noop: the schedule alone, no piece), warms every kernel in parallel
# processes (one Triton cache), times benchmarks/lab/wholepage_costs.py's shapes for each, then ncu (sections +
# per-instruction stall sampling, summarized by benchmarks/lab/ncu_source_sum.py). Everything lands in
# $OUT/costs.tgz plus $OUT/summary.txt. From the repo root: OUT=... bash benchmarks/lab/wholepage_costs.sh
set -u
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/uq_tc ULTRAQUANT_CACHE_DIR=/tmp/uq_c
OUT=${OUT:-/tmp/out}; R=$(mktemp -d); mkdir -p "$OUT"
W=benchmarks/lab/wholepage_costs.py
BASE=${BASE_SHAPES:-}                     # base tree's shapes (comma list; empty: none)
VAR=${VAR_SHAPES:-one@32768,gqa16@32768,gqa16h1@16384,A@32768,ragged}
VARIANTS=${VARIANTS:-nomath noloop nomerge}
NCU=${NCU_SHAPES:-one@32768 gqa16@32768 ragged}
declare -A SED=([nomath]='s/for jp in gl.static_range(NSUB \/\/ PAIR):/for jp in gl.static_range(0):/'
                [noloop]='s/    for it in range(n_it):/    for it in range(0):/'
                [nomerge]='s/    if ticket == nparts - 1:/    if ticket == -7:/'
                [noop]='s/    for b in range(b_first, b_last + 1):/    for b in range(b_first, b_first):/')
t0=$(date +%s)
trees="base:$PWD"
for v in $VARIANTS; do
  d=/tmp/var_$v; rm -rf $d; mkdir -p $d; cp -rL ultraquant benchmarks $d/
  sed -i "${SED[$v]}" $d/ultraquant/kernels/gluon/decode_wholepage.py
  echo "$v: $(diff <(cat ultraquant/kernels/gluon/decode_wholepage.py) $d/ultraquant/kernels/gluon/decode_wholepage.py | grep -c '^>') line(s) changed" | tee -a $R/summary.txt
  trees="$trees $v:$d"
done
for t in $trees; do n=${t%%:*}; d=${t#*:}; s=$VAR; [ $n = base ] && s=$BASE${BASE:+,}$VAR
  for k in ${s//,/ }; do (cd $d && PYTHONPATH=$d timeout 200 python3 $W $n warm /dev/null $k > $R/warm_${n}_$k.log 2>&1) & done
done
wait; echo "warm done at +$(( $(date +%s) - t0 ))s" | tee -a $R/summary.txt; grep -L "warm done" $R/warm_*.log | tee -a $R/summary.txt
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader | tee -a $R/summary.txt
PYTHONPATH=$PWD python3 -c "from ultraquant.bench.decode import measure_ceiling; print(f'ceiling {measure_ceiling():.3f} TB/s')" | tee -a $R/summary.txt
for t in $trees; do n=${t%%:*}; d=${t#*:}; s=$VAR; [ $n = base ] && s=$BASE${BASE:+,}$VAR
  (cd $d && PYTHONPATH=$d timeout 120 python3 $W $n time $R/time_$n.json $s 2>&1 | grep -v " done$" | tee -a $R/summary.txt)
done
echo "timing done at +$(( $(date +%s) - t0 ))s" | tee -a $R/summary.txt
for k in $NCU; do
  PYTHONPATH=$PWD timeout 90 ncu --clock-control none -k "regex:uq_decode_wholepage" --launch-skip 1 -c 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
    --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section SourceCounters \
    -f -o $R/ncu_$k python3 $W base ncu /dev/null $k > $R/ncu_$k.log 2>&1
  echo "ncu $k rc=$? at +$(( $(date +%s) - t0 ))s" | tee -a $R/summary.txt
  ncu -i $R/ncu_$k.ncu-rep --page details > $R/ncu_${k}_details.txt 2>&1
  ncu -i $R/ncu_$k.ncu-rep --page source --csv --print-source sass > $R/ncu_${k}_src.csv 2>&1
  python3 benchmarks/lab/ncu_source_sum.py $R/ncu_${k}_src.csv 40 > $R/ncu_${k}_src.txt 2>&1
  grep -E "Duration|DRAM Throughput|Registers Per|Issue Slots Busy|No Eligible|Warp Cycles Per Issued" $R/ncu_${k}_details.txt | head -8 | tee -a $R/summary.txt
  head -10 $R/ncu_${k}_src.txt | tee -a $R/summary.txt
  rm -f $R/ncu_$k.ncu-rep
done
echo "done at +$(( $(date +%s) - t0 ))s" | tee -a $R/summary.txt
cp $R/summary.txt $OUT/ && tar -czf $OUT/costs.tgz -C $R .
