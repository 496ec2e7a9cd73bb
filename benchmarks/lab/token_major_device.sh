#!/bin/bash
# Issue 24, one H200 call (2026-12-04): token-major pages routed to the whole-page decode, validated and timed;
# shape C's head-major token order (identity at D=256); the FP8-QK census's timing-only variants.
#   W  compiles: the census's variant trees (A@32768) and the D=256 token-order tree (C@32768), in parallel
#   T  alone on the GPU: `bench --serving --no-aot` (Gluon JIT) for token-major A / A / C / D at bs 16, then
#      graph-replay times of every tree (benchmarks/lab/wholepage_costs.py)
#   C  in parallel: the whole-page GPU suite (4 shards), the routed decode / bounds / attention suites, the
#      token-major sanitizer cases (memcheck + racecheck), the bounds workload under memcheck, and the D=256
#      token-order tree's D=256 cases
# Everything lands in $OUT/tm.tgz plus $OUT/summary.txt (saved after every phase: a time-out keeps what ran).
set -u
export PYTHONUNBUFFERED=1 ULTRAQUANT_CACHE_DIR=/tmp/uq_c
OUT=${OUT:-/tmp/out}; R=$(mktemp -d); mkdir -p "$OUT"; S=$R/summary.txt; t0=$(date +%s); ROOT=$PWD
save() { cp $S $OUT/ && tar -czf $OUT/tm.tgz -C $R . ; }
at() { echo "$1 at +$(( $(date +%s) - t0 ))s" | tee -a $S; }
W=benchmarks/lab/wholepage_costs.py
MODES="no_conversion native_proxy_2term fp8_mma_sync pv_no_scale_mul"
for m in $MODES; do python3 benchmarks/lab/fp8_qk_census.py --write-tree $m /tmp/var_$m > /dev/null; done
rm -rf /tmp/var_d256 && mkdir -p /tmp/var_d256 && cp -rL ultraquant benchmarks tests pyproject.toml /tmp/var_d256/
G=/tmp/var_d256/ultraquant/kernels/gluon/decode_wholepage.py
sed -i 's/^TOKEN_BASES = gl.constexpr(\[8, 4, 1, 2\])/TOKEN_BASES = gl.constexpr([1, 2, 4, 8])/' $G
sed -i 's/^    return ((j >> 3) \& 1) | (((j >> 2) \& 1) << 1) | ((j \& 1) << 2) | (((j >> 1) \& 1) << 3)$/    return j/' $G
grep -c "gl.constexpr(\[1, 2, 4, 8\])\|^    return j$" $G | sed 's/^/d256 tree edits (want 2): /' | tee -a $S
TREES="base:$ROOT:A@32768,C@32768 d256:/tmp/var_d256:C@32768"
for m in $MODES; do TREES="$TREES $m:/tmp/var_$m:A@32768"; done
for t in $TREES; do n=${t%%:*}; r=${t#*:}; d=${r%%:*}; k=${r#*:}
  (cd $d && PYTHONPATH=$d TRITON_CACHE_DIR=/tmp/tc_$n timeout 200 python3 $ROOT/$W $n warm /dev/null $k \
     > $R/warm_$n.log 2>&1) &
done
wait; at "W done"; tail -qn1 $R/warm_*.log | tee -a $S; save

export TRITON_CACHE_DIR=/tmp/tc_base PYTHONPATH=$ROOT
ULTRAQUANT_BACKEND=triton timeout 200 python3 -m ultraquant.cli bench --serving --no-aot \
  --serving-rows "token-major,A bs16,C bs16,D bs16" --json $R/serving_tm.json > $R/serving_tm.log 2>&1
at "bench rc=$?"; grep -E "ceiling|us |rror" $R/serving_tm.log | tee -a $S; save
for t in $TREES; do n=${t%%:*}; r=${t#*:}; d=${r%%:*}; k=${r#*:}
  (cd $d && PYTHONPATH=$d TRITON_CACHE_DIR=/tmp/tc_$n timeout 60 python3 $ROOT/$W $n time $R/time_$n.json $k \
     2>&1 | grep -v " done$" | tee -a $S)
done
at "T done"; save

P=(python3 -m pytest -q -rfE -p no:cacheprovider)
"${P[@]}" --collect-only -q -m gpu tests/gpu/test_decode_wholepage_gpu.py 2>/dev/null | grep "::" > $R/ids.txt
for i in 0 1 2; do
  awk -v i=$i 'NR % 3 == i' $R/ids.txt > $R/ids_$i.txt
  timeout 200 "${P[@]}" $(cat $R/ids_$i.txt) > $R/wholepage_gpu_$i.log 2>&1 &
done
timeout 220 "${P[@]}" -m gpu tests/gpu/test_kernels_gpu.py tests/gpu/test_bounds_gpu.py -k "decode or garbage" \
  > $R/kernels_bounds_gpu.log 2>&1 &
timeout 220 "${P[@]}" -m gpu tests/gpu/test_attention_gpu.py > $R/attention_gpu.log 2>&1 &
UQ_SANITIZE_CASES=5,6,7 UQ_SANITIZE_BOUNDS=0 timeout 200 compute-sanitizer --tool memcheck --print-limit 20 \
  python3 tests/gpu/sanitize_wholepage.py > $R/tm_memcheck.log 2>&1 &
UQ_SANITIZE_CASES=5,6,7 UQ_SANITIZE_BOUNDS=0 timeout 200 compute-sanitizer --tool racecheck --print-limit 20 \
  python3 tests/gpu/sanitize_wholepage.py > $R/tm_racecheck.log 2>&1 &
timeout 200 compute-sanitizer --tool memcheck --print-limit 20 python3 tests/gpu/sanitize.py --bounds \
  > $R/bounds_memcheck.log 2>&1 &
(cd /tmp/var_d256 && PYTHONPATH=/tmp/var_d256 TRITON_CACHE_DIR=/tmp/tc_d256 timeout 200 "${P[@]}" -m gpu \
  tests/gpu/test_decode_wholepage_gpu.py -k "d256 and not tm" > $R/d256_tree_gpu.log 2>&1) &
wait
for f in $R/wholepage_gpu_*.log $R/kernels_bounds_gpu.log $R/attention_gpu.log $R/d256_tree_gpu.log; do
  echo "$(basename $f): $(tail -1 $f)"; grep -h "^FAILED\|^ERROR" $f | head -8; done | tee -a $S
for t in tm_memcheck tm_racecheck bounds_memcheck; do
  echo "$t: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $R/$t.log | tail -1)"; grep -vE "^=========" $R/$t.log | tail -4
done | tee -a $S
at "C done"; save
