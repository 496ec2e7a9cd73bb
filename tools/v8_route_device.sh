#!/bin/bash
# Routed decode v8 (issue 14) in ONE time-boxed device call (about 150 s): the GPU decode tests through
# ultraquant.decode_attention under ULTRAQUANT_BACKEND=aot (the sm_90 blobs of $ULTRAQUANT_GENERATED;
# only the cases those blobs cover) and =triton (every routed case), graph capture + replay, the
# blobs' own self-tests (verify --device), then decode A, B, D: v8 AOT / v8 JIT / v7 AOT / v7 JIT vs
# bf16 SDPA; the bounds contract (issue 17) on v8 (garbage block ids / lengths). Writes $OUT/v8route/{env.txt,*.log,bench.json}. Run from the repo root:
#   PYTHONPATH=$PWD ULTRAQUANT_GENERATED=$PWD/generated bash tools/v8_route_device.sh
# The blobs: make kernels ARCH=sm_90 HEAD_SIZES=128 GQA=1,4,16 BLOCK_SIZES=16,32,64 KV_HEADS=1,4,8 \
#   OPS=decode_attention,decode_attention_v8
export PYTHONPATH=$PWD
export ULTRAQUANT_GENERATED=${ULTRAQUANT_GENERATED:-$PWD/generated}
PY=${PY:-python3}
OUT=${OUT:-/tmp/out}; D="$OUT/v8route"; mkdir -p "$D"
T0=$SECONDS
{ timeout 10 nvidia-smi -L; timeout 20 $PY -c "import torch, triton; print(torch.__version__, triton.__version__)"
  ls "$ULTRAQUANT_GENERATED/sm_90" | grep -c cubin; } > "$D/env.txt" 2>&1
cat "$D/env.txt"
G=tests/gpu/test_decode_v8_gpu.py
K=tests/gpu/test_kernels_gpu.py
PT="-m pytest -q -p no:cacheprovider"
# (1) four processes at once (correctness only; each its own self-test verdict cache)
# aot: the routed cases whose configs the blobs cover (a miss raises under aot: no silent JIT)
ULTRAQUANT_BACKEND=aot ULTRAQUANT_CACHE_DIR="$D/cache-aot" timeout ${TEST_S:-75} $PY $PT \
  "$G::test_decode_v8[gqa4-hk8-b64-long]" "$G::test_decode_v8[gqa4-hk8-b64-sinks]" \
  "$G::test_decode_v8[gqa16-hk1-b16-batch64]" "$G::test_decode_v8[gqa1-hk4-b16-sinks]" \
  "$G::test_decode_v8[gqa16-hk8-b32]" "$G::test_decode_v8_wide_dynamic_range" \
  "$G::test_decode_v8_graph_replay_new_seq_lens_and_stream" "$G::test_decode_v8_bounds_contract" \
  "$K::test_decode[native-d128-gqa4-b64-long]" "$K::test_decode[native-d128-gqa16-b16-batch64]" \
  "$K::test_decode_wide_dynamic_range[native]" "$K::test_decode_graph_replay_new_seq_lens_and_stream" \
  > "$D/tests_aot.log" 2>&1 &
A=$!
# triton: every routed v8 case + the v7 direct entry, and the whole decode part of the kernel suite
ULTRAQUANT_BACKEND=triton ULTRAQUANT_CACHE_DIR="$D/cache-t1" timeout ${TEST_S:-75} $PY $PT "$G" \
  -k "not rings_and_splits and not 16_warps" > "$D/tests_triton_v8.log" 2>&1 &
B=$!
ULTRAQUANT_BACKEND=triton ULTRAQUANT_CACHE_DIR="$D/cache-t2" timeout ${TEST_S:-75} $PY $PT "$K" \
  -k "test_decode" > "$D/tests_triton_kernels.log" 2>&1 &
C=$!
ULTRAQUANT_CACHE_DIR="$D/cache-verify" timeout ${TEST_S:-75} $PY -m ultraquant.cli verify --device 0 \
  > "$D/verify_device.log" 2>&1 &
V=$!
for p in $A $B $C $V; do wait $p; echo "pid $p rc=$?"; done
echo "tests done ($((SECONDS - T0)) s)"
for f in tests_aot tests_triton_v8 tests_triton_kernels verify_device; do echo "== $f"; tail -3 "$D/$f.log"; done
# (2) timing, alone on the GPU
LEFT=$((148 - (SECONDS - T0))); [ $LEFT -lt 20 ] && LEFT=20
timeout $LEFT $PY tools/v8_route_bench.py --json "$D/bench.json" --shapes A,B,D > "$D/bench.log" 2>&1
echo "bench rc=$? ($((SECONDS - T0)) s)"
grep -E "^(ceiling|[ABD] )" "$D/bench.log"; grep -A5 "^summary" "$D/bench.log" || tail -30 "$D/bench.log"
echo "total $((SECONDS - T0)) s"
