#!/bin/bash
# Decode v8 round 4 (issue 14) in ONE time-boxed device call: the v8 GPU suite through the Gluon JIT,
# then decode A, B, D for ring/register variants against v7 and bf16 SDPA with the read ceiling of the
# same run (tools/v8_bench.py). Writes $OUT/v8r4/{tests.log,bench.json,bench.log}. From the repo root:
#   bash tools/v8r4_device.sh            (TEST_S, BENCH_S, RINGS, SPLITS, SHAPES override)
export PYTHONPATH=$PWD
PY=${PY:-python3}
OUT=${OUT:-/tmp/out}; D="$OUT/v8r4"; mkdir -p "$D"
T0=$SECONDS
ULTRAQUANT_BACKEND=triton ULTRAQUANT_CACHE_DIR="$D/cache" timeout ${TEST_S:-110} $PY -m pytest -q -p no:cacheprovider \
  tests/gpu/test_decode_v8_gpu.py ${TESTS_K:+-k "$TESTS_K"} > "$D/tests.log" 2>&1
echo "tests rc=$? ($((SECONDS - T0)) s)"; tail -15 "$D/tests.log"
timeout ${BENCH_S:-150} $PY tools/v8_bench.py --json "$D/bench.json" --shapes ${SHAPES:-A,B,D} --no-stream \
  --rings "${RINGS:-8:2x4,8:1x4:r128,8:2x2:r128}" --splits-scale "${SPLITS:-1,2}" > "$D/bench.log" 2>&1
echo "bench rc=$? ($((SECONDS - T0)) s)"
sed -n '/^shape name/,$p' "$D/bench.log" || tail -30 "$D/bench.log"
grep -E "Error|error" "$D/bench.log" | head -5
echo "total $((SECONDS - T0)) s"
