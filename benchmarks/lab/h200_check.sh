#!/bin/bash
# Issues 24/25 on an H200 only (exits at once on another card): `bench --spec-decode` twice and `bench --serving
# --no-aot` once through main's sm_90 blobs in .blobs/ (benchmarks/lab/ab_blobs.sh with PATCHES empty), packed
# into $OUT/h200.tgz.
set -u
export PYTHONUNBUFFERED=1 ULTRAQUANT_CACHE_DIR=/tmp/uq_c TRITON_CACHE_DIR=/tmp/tc PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/h"; name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$name"; [[ $name == *H200* ]] || exit 0
for i in 1 2; do ULTRAQUANT_GENERATED=$PWD/.blobs timeout 90 python3 -m ultraquant.cli bench --spec-decode \
  --json $OUT/h/spec_$i.json > $OUT/h/spec_$i.log 2>&1; grep -E "spec k|decode " $OUT/h/spec_$i.log; done
ULTRAQUANT_GENERATED=$PWD/.blobs timeout 110 python3 -m ultraquant.cli bench --serving --no-aot \
  --json $OUT/h/serving.json > $OUT/h/serving.log 2>&1; grep -E "ceiling| us " $OUT/h/serving.log
cd $OUT && tar czf h200.tgz h && rm -rf h
