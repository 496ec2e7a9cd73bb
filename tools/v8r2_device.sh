#!/bin/bash
# Decode v8 round 2 (issue 14) in ONE time-boxed device call (150 s in all): a short correctness check
# against ultraquant.reference, then decode + the no-math stream of v8's grid on shapes A, B, D with
# bf16 SDPA, v7 and the read ceiling in the same run. Writes $OUT/v8r2/{env.txt,tests.log,bench.json,
# bench.log} and prints a compact table. Run from the repo root: bash tools/v8r2_device.sh
export PYTHONPATH=$PWD
PY=${PY:-python3}
OUT=${OUT:-/tmp/out}; D="$OUT/v8r2"; mkdir -p "$D"
T0=$SECONDS
timeout 10 nvidia-smi -L > "$D/env.txt" 2>&1
timeout 20 $PY -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$D/env.txt" 2>&1
cat "$D/env.txt"
# (a) correctness: ragged lengths (0..32768), sinks, window + soft cap, Hk 1/2/4/8, blocks 16/32/64,
# the V 2^20-outlier case, token-major refused (each case compiles one kernel: ~4 s); GQA <= 8 cases
# run the rows-in-N math, the GQA 16 case the 16-M-row math
G=tests/gpu/test_decode_v8_gpu.py
timeout ${TEST_S:-50} $PY -m pytest -q -x -p no:cacheprovider \
  "$G::test_decode_v8[gqa4-hk8-b64-long]" "$G::test_decode_v8[gqa6-hk2-b32-window-softcap]" \
  "$G::test_decode_v8[gqa16-hk1-b16-batch64]" "$G::test_decode_v8[gqa3-hk4-b64-softcap-sinks]" \
  "$G::test_decode_v8_wide_dynamic_range" "$G::test_decode_v8_token_major_is_refused" \
  > "$D/tests.log" 2>&1
echo "tests rc=$? ($((SECONDS - T0)) s)"; tail -3 "$D/tests.log"
# (b) timing: ceiling, bf16 SDPA, v7, v8's no-math stream (gate 1) + decode (8 warps, ring 2x4, query
# rows as 8 MMA N rows (default) and as 16 M rows), shapes A, B, D
LEFT=$((145 - (SECONDS - T0))); [ $LEFT -gt ${BENCH_S:-90} ] && LEFT=${BENCH_S:-90}
timeout $LEFT $PY tools/v8_bench.py --json "$D/bench.json" --shapes A,B,D --rings 8:2x4,8:2x4:m16 \
  > "$D/bench.log" 2>&1
echo "bench rc=$? ($((SECONDS - T0)) s)"
timeout 5 $PY - "$D/bench.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"ceiling {r['ceiling_tbps']:.3f} TB/s\nshape name us %ceiling vs-sdpa")
for x in r["rows"]:
    print(f"{x['shape']} {x['name']:40s} {x['us']:8.1f} {x['pct_ceiling']:5.1f} {x['vs_sdpa'] or '':.4}")
PY
tail -5 "$D/bench.log" | grep -i "error\|Traceback" && tail -20 "$D/bench.log"
echo "total $((SECONDS - T0)) s"
