#!/bin/bash
# Issue 24, one device call: (1) benchmarks/lab/pdl_probe.py on ROWS through the .pdl/ blobs (built from HEAD with
# benchmarks/lab/pdl.patch) in a copy of the tree with that patch, into $OUT/pdl.{json,log}; (2) the word-decode
# A/B, benchmarks/lab/serving_ab_device.sh with PATCHES / PATCHES2 (blobs .new/ .new2/ .blobs/ from ab_blobs.sh),
# into $OUT/ab/ab.tgz.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/ab"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
P=/tmp/pdl_tree; rm -rf $P && mkdir $P && cp -r ultraquant runtime codegen benchmarks pyproject.toml .pdl $P/
(cd $P && patch -p1 -s < benchmarks/lab/pdl.patch && PYTHONUNBUFFERED=1 PYTHONPATH=$P ULTRAQUANT_GENERATED=$P/.pdl \
  ULTRAQUANT_CACHE_DIR=/tmp/uq_p TRITON_CACHE_DIR=/tmp/tc_p timeout ${PDL_S:-150} python3 benchmarks/lab/pdl_probe.py \
  "$OUT/pdl.json" "${ROWS:-GQA16 16/1,GQA16 32/2,one kv head,ragged 80,ragged 96,A bs16}") > "$OUT/pdl.log" 2>&1
echo "pdl rc=$?"; tail -n 40 "$OUT/pdl.log"
OUT=$OUT/ab bash benchmarks/lab/serving_ab_device.sh
