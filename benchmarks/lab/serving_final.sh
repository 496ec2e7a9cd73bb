#!/bin/bash
# Issue 24, session 3, final device call: `ultraquant bench --serving --no-aot` through the blobs in $BLOBS (alone
# on the GPU), A-D at block 16 and 64 through the Gluon JIT (benchmarks/lab/wholepage_costs.py, same run), then in
# parallel the whole-page GPU suite (4 shards) and compute-sanitizer memcheck + racecheck of
# tests/gpu/sanitize_wholepage.py. Everything lands in $OUT/final.tgz plus $OUT/summary.txt.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/uq_tc ULTRAQUANT_CACHE_DIR=/tmp/uq_c
OUT=${OUT:-/tmp/out}; R=$(mktemp -d); mkdir -p "$OUT"
S=$R/summary.txt; t0=$(date +%s)
save() { cp $S $OUT/ && tar -czf $OUT/final.tgz -C $R . ; }  # after every phase: a time-out keeps what ran
W=benchmarks/lab/wholepage_costs.py
BS=${BS_SHAPES:-A@32768,A64,B,B64,C,C64,D,D64}
for k in ${BS//,/ }; do timeout 150 python3 $W base warm /dev/null $k > $R/warm_$k.log 2>&1 & done
ULTRAQUANT_GENERATED=$BLOBS timeout ${T_BENCH:-100} python3 -m ultraquant.cli bench --serving --no-aot \
  --json $R/serving.json > $R/serving.log 2>&1
echo "bench rc=$? at +$(( $(date +%s) - t0 ))s" | tee -a $S; grep -E "ceiling|us " $R/serving.log | tee -a $S; save
wait; timeout ${T_BS:-40} python3 $W base time $R/bs.json $BS 2>&1 | grep -v " done$" | tee -a $S
echo "bs16/bs64 done at +$(( $(date +%s) - t0 ))s" | tee -a $S; save
python3 -m pytest --collect-only -q -m gpu tests/gpu/test_decode_wholepage_gpu.py 2>/dev/null | grep "::" > $R/ids.txt
for i in 0 1 2 3; do
  awk -v i=$i 'NR % 4 == i' $R/ids.txt > $R/ids_$i.txt
  timeout ${T_WP:-85} python3 -m pytest -q -rfE -p no:cacheprovider $(cat $R/ids_$i.txt) > $R/wholepage_gpu_$i.log 2>&1 &
done
timeout ${T_SAN:-85} compute-sanitizer --tool memcheck --print-limit 20 python3 tests/gpu/sanitize_wholepage.py \
  > $R/memcheck.log 2>&1 &
UQ_SANITIZE_BOUNDS=0 UQ_SANITIZE_CASES=3,4 timeout ${T_SAN:-85} compute-sanitizer --tool racecheck --print-limit 20 \
  python3 tests/gpu/sanitize_wholepage.py > $R/racecheck.log 2>&1 &
wait
for i in 0 1 2 3; do echo "shard $i: $(wc -l < $R/ids_$i.txt) ids: $(tail -1 $R/wholepage_gpu_$i.log)" | tee -a $S; done
grep -h "FAILED\|Error" $R/wholepage_gpu_*.log | head -20 | tee -a $S
for t in memcheck racecheck; do echo "$t: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $R/$t.log | tail -1)"; grep -E "failed checks|^\[" $R/$t.log | tail -7; done | tee -a $S
echo "done at +$(( $(date +%s) - t0 ))s" | tee -a $S; save
