#!/bin/bash
# Store v4 (issue 14 "Also") in ONE time-boxed device call (at most ~100 s): the store's GPU tests (bytes
# vs ultraquant.reference for D 64..512 and every encoder, head-major int32 slots, the alignment
# fallback on unaligned caches, the bounds contract with garbage slots, every bench launch shape
# byte-identical to the plan's store) and the sm_90 store blobs'
# self-tests (verify --device), then, alone on the GPU, `ultraquant bench` with only the ceiling and
# the store rows (N=16384 x 8 heads x D=128 and a 64-token decode step; through the blobs when
# $ULTRAQUANT_GENERATED has them) plus the store's launch shapes through the Triton JIT
# (--store-variants). Writes $OUT/store/{tests.log,bench.log,bench.json}. From the repo root:
#   bash tools/store_device.sh        (carry generated/sm_90: make kernels ARCH=sm_90 HEAD_SIZES=128
#                                      GQA=4 BLOCK_SIZES=16 OPS=store_kv)
export PYTHONPATH=$PWD
[ -d "$PWD/generated/sm_90" ] && export ULTRAQUANT_GENERATED=${ULTRAQUANT_GENERATED:-$PWD/generated}
PY=${PY:-python3}
OUT=${OUT:-/tmp/out}; D="$OUT/store"; mkdir -p "$D"
W=$(mktemp -d)
T0=$SECONDS
K=tests/gpu/test_kernels_gpu.py
PT="-m pytest -x -q -p no:cacheprovider"
TEST_S=${TEST_S:-55}
{ timeout 10 nvidia-smi -L; timeout 20 $PY -c "import torch, triton; print(torch.__version__, triton.__version__)"
  echo "blobs: ${ULTRAQUANT_GENERATED:-none}"; } > "$W/0_env" 2>&1
# (1) correctness: compile-bound, so ten processes at once (the Triton cache is shared); a tenth
# compiles the bench's store variants meanwhile (a 64-token store: the same specializations).
PIDS=""
i=0
for sel in "test_store_bytes and (64- or 128-rne) or head_major_int32" "test_store_bytes and (128-upstream or 128-mse)" \
    "test_store_bytes and (256- or 512-)" "alignment and (128-0-0 or 128-0-2)" \
    "alignment and (128-4 or 128-1 or 128-0-4)" "alignment and (128-2 or 128-8 or 128-0-8)" \
    "alignment and (64- or 256-)" "variants_same_bytes"; do
  i=$((i + 1))
  ULTRAQUANT_BACKEND=triton timeout $TEST_S $PY $PT "$K" -k "$sel" > "$W/1_kernels_$i" 2>&1 &
  PIDS="$PIDS $!"
done
ULTRAQUANT_BACKEND=triton timeout $TEST_S $PY $PT tests/gpu/test_bounds_gpu.py > "$W/2_bounds" 2>&1 &
PIDS="$PIDS $!"
ULTRAQUANT_CACHE_DIR="$W/verdicts" timeout $TEST_S $PY -m ultraquant.cli verify --device 0 > "$W/3_verify" 2>&1 &
PIDS="$PIDS $!"
timeout $TEST_S $PY -c "from ultraquant.bench.decode import STORE_VARIANTS, bench_store
for v in (None, *STORE_VARIANTS): bench_store(64, 8, 128, v)" > "$W/4_warm" 2>&1 &
PIDS="$PIDS $!"
for p in $PIDS; do wait $p; echo "pid $p rc=$?" >> "$W/0_env"; done
echo "tests done ($((SECONDS - T0)) s)" >> "$W/0_env"
for f in "$W"/[0-9]*; do echo "== $(basename "$f")"; tail -25 "$f"; done > "$D/tests.log"
grep -E "passed|failed|error|rc=|OK|FAIL" "$D/tests.log" | head -40
# (2) timing, alone on the GPU: ceiling + store rows (+ launch shapes), CUDA-graph replay
LEFT=$((95 - (SECONDS - T0))); [ $LEFT -lt 15 ] && LEFT=15
timeout $LEFT $PY -m ultraquant.cli bench --shapes "" --no-stream --store-variants --json "$D/bench.json" \
  > "$D/bench.log" 2>&1
echo "bench rc=$? ($((SECONDS - T0)) s)" | tee -a "$D/bench.log"
grep -E "^(ceiling|store)" "$D/bench.log" || tail -20 "$D/bench.log"
rm -rf "$W"
echo "total $((SECONDS - T0)) s"
