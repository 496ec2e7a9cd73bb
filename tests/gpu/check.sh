#!/bin/bash
# The release check on an H200, in steps with time boxes; device calls split the list, e.g.
#   STEPS="kernels prefill attention wholepage spec runtime" bash tests/gpu/check.sh
#   STEPS="memcheck bench host startup" bash tests/gpu/check.sh
#   STEPS="wholepage-bench wholepage-san ncu" bash tests/gpu/check.sh     (whole-page decode: bench, sanitizers, ncu)
# Blobs: $RT_BLOBS (runtime tests: D=128 GQA 4 block 16, all ops) and $BENCH_BLOBS (bench shapes' decode
# and store), both sm_90 folders built here by `make kernels` and carried. $OUT gets summary.txt + logs.tgz.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/uq_final}
LOG=$(mktemp -d)  # every log; $OUT gets summary.txt and one archive of LOG (the device tool returns 8 files)
mkdir -p "$OUT"
RT_BLOBS=${RT_BLOBS:-$PWD/.final/rt} BENCH_BLOBS=${BENCH_BLOBS:-$PWD/.final/bench}
export ULTRAQUANT_CACHE_DIR=$(mktemp -d)
PYT=(python3 -m pytest -q -rfE -p no:cacheprovider)
t0=$(date +%s)
STEPS=${STEPS:-"kernels prefill attention wholepage spec runtime memcheck bench host startup wholepage-bench wholepage-san ncu"}
step() { case " $STEPS " in *" $1 "*) echo "== $1 at +$(( $(date +%s) - t0 ))s" | tee -a "$LOG/summary.txt";;
         *) return 1;; esac; }
last() { tail -${2:-2} "$1" | tee -a "$LOG/summary.txt"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG/summary.txt"

if step kernels; then  # Triton kernels vs the reference (both FP4 decodes), bounds cases, graph replay
  timeout ${T_KERNELS:-260} "${PYT[@]}" -m gpu tests/gpu/test_kernels_gpu.py tests/gpu/test_bounds_gpu.py \
    ${KERNELS_K:+-k "$KERNELS_K"} > "$LOG/kernels_gpu.log" 2>&1
  last "$LOG/kernels_gpu.log" 4
fi
if step prefill; then
  timeout ${T_PREFILL:-90} "${PYT[@]}" -m gpu tests/gpu/test_prefill_routes_gpu.py > "$LOG/prefill_routes_gpu.log" 2>&1
  last "$LOG/prefill_routes_gpu.log"
fi
if step attention; then
  timeout ${T_ATTN:-150} "${PYT[@]}" -m gpu tests/gpu/test_attention_gpu.py > "$LOG/attention_gpu.log" 2>&1
  last "$LOG/attention_gpu.log"
fi
if step wholepage; then
  timeout ${T_WP:-150} "${PYT[@]}" -m gpu tests/gpu/test_decode_wholepage_gpu.py > "$LOG/decode_wholepage_gpu.log" 2>&1
  last "$LOG/decode_wholepage_gpu.log"
fi
if step spec; then  # the multi-query (speculative-decoding) decode vs the reference, and under memcheck
  timeout ${T_SPEC:-150} "${PYT[@]}" -m gpu tests/gpu/test_spec_decode_gpu.py > "$LOG/spec_decode_gpu.log" 2>&1
  last "$LOG/spec_decode_gpu.log"
  timeout ${T_SPECSAN:-120} compute-sanitizer --tool memcheck --print-limit 20 python3 tests/gpu/sanitize_spec_decode.py \
    > "$LOG/spec_decode_memcheck.log" 2>&1
  echo "spec memcheck rc=$?" | tee -a "$LOG/summary.txt"; last "$LOG/spec_decode_memcheck.log" 3
fi
if step runtime; then  # blobs: load + self-test every one, then the runtime GPU suite (warmup + capture)
  ULTRAQUANT_GENERATED=$RT_BLOBS timeout ${T_VERIFY:-40} python3 -m ultraquant.cli verify --device 0 \
    > "$LOG/verify_device.log" 2>&1
  last "$LOG/verify_device.log" 3
  ULTRAQUANT_GENERATED=$RT_BLOBS timeout ${T_RUNTIME:-120} "${PYT[@]}" tests/gpu/test_runtime_gpu.py -k "not memcheck" \
    > "$LOG/runtime_gpu.log" 2>&1
  last "$LOG/runtime_gpu.log" 4
fi
if step memcheck; then  # garbage slot/block ids through every kernel under compute-sanitizer
  timeout ${T_MEMCHECK:-200} python3 tests/gpu/sanitize.py --memcheck --out "$LOG" --limit-s 90 \
    > "$LOG/memcheck.log" 2>&1
  last "$LOG/memcheck.log" 3
fi
if step bench; then  # decode A-D (JIT and AOT rows), store, vs bf16 SDPA and the read ceiling of this run
  ULTRAQUANT_GENERATED=$BENCH_BLOBS timeout ${T_BENCH:-170} python3 -m ultraquant.cli bench --layouts head \
    --json "$LOG/bench.json" > "$LOG/bench.log" 2>&1
  last "$LOG/bench.log" 24
fi
if step host; then
  ULTRAQUANT_GENERATED=$RT_BLOBS timeout ${T_HOST:-60} python3 -m ultraquant.cli bench --host \
    --json "$LOG/host_bench.json" > "$LOG/host_bench.log" 2>&1
  last "$LOG/host_bench.log" 10
fi
if step startup; then
  ULTRAQUANT_GENERATED=$RT_BLOBS timeout ${T_STARTUP:-90} python3 -m ultraquant.bench.startup \
    --json "$LOG/startup.json" > "$LOG/startup.log" 2>&1
  last "$LOG/startup.log" 12
fi
if step wholepage-bench; then  # the whole-page decode (JIT) on A-D against the read ceiling and bf16 SDPA
  timeout ${T_WPBENCH:-120} python3 benchmarks/lab/wholepage_bench.py --json "$LOG/wholepage_bench.json" --shapes A,B,C,D --no-splitkv \
    --rings "${WP_RINGS:-8:0x2}" > "$LOG/wholepage_bench.log" 2>&1
  sed -n '/^shape name/,$p' "$LOG/wholepage_bench.log" | tee -a "$LOG/summary.txt"
fi
if step wholepage-san; then  # the whole-page decode under compute-sanitizer memcheck and racecheck (tests/gpu/sanitize_wholepage.py)
  for tool in memcheck racecheck; do
    timeout ${T_WPSAN:-120} compute-sanitizer --tool $tool --print-limit 20 python3 tests/gpu/sanitize_wholepage.py \
      > "$LOG/wholepage_$tool.log" 2>&1
    echo "wholepage $tool rc=$?" | tee -a "$LOG/summary.txt"; last "$LOG/wholepage_$tool.log" 3
  done
fi
if step ncu; then  # the whole-page decode on shape A: occupancy, DRAM throughput, warp stall reasons
  timeout ${T_NCU:-120} ncu --clock-control none -k "regex:uq_decode_wholepage" -c 4 --section SpeedOfLight \
    --section Occupancy --section WarpStateStats --section LaunchStats --section MemoryWorkloadAnalysis \
    --section SchedulerStats python3 benchmarks/lab/wholepage_ncu.py A > "$LOG/ncu_wholepage_A.txt" 2>&1
  grep -E "uq_decode_wholepage|Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Stall|Issued Warp|No Eligible" \
    "$LOG/ncu_wholepage_A.txt" | head -40 | tee -a "$LOG/summary.txt"
fi
echo "== done at +$(( $(date +%s) - t0 ))s" | tee -a "$LOG/summary.txt"
cp "$LOG/summary.txt" "$OUT/" && tar -czf "$OUT/logs.tgz" -C "$LOG" .
