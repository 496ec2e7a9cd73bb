#!/bin/bash
# Issue 24/25: bench --spec-decode twice of two sm_90 trees in one call (new: the working tree and its blobs in
# .new/; main: .maintree/ with its blobs in .maintree/.blobs/; carry both), then the working tree's spec-decode GPU
# suite (JIT; a subset: one_tile, graph_replay, batch32, window). Printouts and JSON in $OUT.
set -u
export PYTHONUNBUFFERED=1 ULTRAQUANT_CACHE_DIR=/tmp/uq_c TRITON_CACHE_DIR=/tmp/tc
OUT=${OUT:-/tmp/out}; mkdir -p $OUT; t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
R=$PWD
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
for n in new_1 main_1 new_2 main_2; do d=$R g=$R/.new; [[ $n == main_* ]] && d=$R/.maintree g=$R/.maintree/.blobs
  (cd $d && PYTHONPATH=$d ULTRAQUANT_GENERATED=$g timeout 90 python3 -m ultraquant.cli bench --spec-decode \
    --json $OUT/spec_$n.json > $OUT/spec_$n.log 2>&1); el "spec $n rc=$?"; grep -E "spec k|decode " $OUT/spec_$n.log; done
PYTHONPATH=$R timeout 90 python3 -m pytest -q -rfE -p no:cacheprovider -m gpu tests/gpu/test_spec_decode_gpu.py -k "one_tile or graph_replay or batch32 or window" > $OUT/spec_gpu.log 2>&1
el "spec suite rc=$?"; tail -n2 $OUT/spec_gpu.log; grep -h "^FAILED" $OUT/spec_gpu.log | head
