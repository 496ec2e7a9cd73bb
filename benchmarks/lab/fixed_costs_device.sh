#!/bin/bash
# Issue 24, one device call: on an H200 first the gates' card of the landed blobs (h200_check.sh, ~5 min; .blobs/
# carried), then on any card the whole-page decode's fixed costs by variant trees (wholepage_costs.sh: the base
# tree's length sweeps, noop = the schedule alone, noloop = pieces without a stage loop, nomerge; and the launch
# cost of an empty graph kernel). Outputs: $OUT/bench.tgz (H200 only), $OUT/summary.txt, $OUT/costs.tgz.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 330 bash benchmarks/lab/h200_check.sh 2>&1 | tail -40
VARIANTS="noop noloop nomerge" VAR_SHAPES=${VAR_SHAPES:-empty,one,gqa16h1@16384,gqa16@32768,A@32768,ragged} NCU_SHAPES="" \
  timeout 240 bash benchmarks/lab/wholepage_costs.sh 2>&1 | grep -v "^warm\|line(s) changed" | tail -60
