#!/bin/bash
# Timing-only A/B/A of benchmarks/lab/piece_cost.patch on the device (2026-12-06, the session's last ~260 s of
# device time: no GPU suites). The patch adds a constexpr, so its blobs' keys differ from main's: each blob folder
# runs with its own tree (.new: a patched copy of this tree with blobs of that code; .blobs: main's, this tree).
# Each row's split-KV difference is printed (the bench's own check of the decode against split-KV decode).
set -u
export PYTHONUNBUFFERED=1 ULTRAQUANT_CACHE_DIR=/tmp/uq_c TRITON_CACHE_DIR=/tmp/tc
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; P=/tmp/pc
rm -rf $P && mkdir $P && cp -r ultraquant runtime codegen benchmarks tests docs pyproject.toml .new $P/ && \
  (cd $P && patch -p1 -s < benchmarks/lab/piece_cost.patch) || exit 3
for r in new_1:$P main:$PWD new_2:$P; do n=${r%%:*}; d=${r#*:}; g=$d/.new; [ $n = main ] && g=$PWD/.blobs
  (cd $d && PYTHONPATH=$d ULTRAQUANT_GENERATED=$g timeout 60 python3 -m ultraquant.cli bench --serving --no-aot \
    --json $OUT/pc_$n.json > $OUT/pc_$n.log 2>&1); echo "== $n rc=$?"; grep -E "ceiling| us " $OUT/pc_$n.log | cut -c1-110
done
