#!/bin/bash
# Everything GPU-side before a release: the kernels' and prefill routes' GPU suites, the decode/store
# and prefill-route benchmarks, the AOT runtime on sm_90 blobs built here (carried as generated/sm_90),
# the attention layer's GPU simulation, compute-sanitizer memcheck over the kernels and an ncu profile
# of decode. Each step has a time box; all of them exceed one 10-minute device call, so split them:
#   STEPS="kernels-gpu-tests prefill-routes-gpu-tests bench prefill-bench" bash tools/h200_final.sh
#   STEPS="runtime attention-gpu memcheck ncu" bash tools/h200_final.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/uq_final}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export ULTRAQUANT_GENERATED=$PWD/generated ULTRAQUANT_CACHE_DIR=$(mktemp -d)
UQ=(python3 -m ultraquant.cli)
PYT=(python3 -m pytest -q -p no:cacheprovider)
t0=$(date +%s)
STEPS=${STEPS:-"kernels-gpu-tests prefill-routes-gpu-tests bench prefill-bench runtime attention-gpu memcheck ncu"}
# step NAME: announce NAME and return 0 when it is one of $STEPS (two device calls can split the list).
step() { case " $STEPS done " in *" $1 "*) echo "== $1 at +$(( $(date +%s) - t0 ))s" | tee -a "$OUT/summary.txt";;
         *) return 1;; esac; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/summary.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/summary.txt"

if step kernels-gpu-tests; then
timeout ${T_KTESTS:-100} "${PYT[@]}" -m gpu tests/gpu/test_kernels_gpu.py > "$OUT/kernels_gpu.log" 2>&1
tail -3 "$OUT/kernels_gpu.log" | tee -a "$OUT/summary.txt"
fi
if step prefill-routes-gpu-tests; then
timeout ${T_PTESTS:-90} "${PYT[@]}" -m gpu tests/gpu/test_prefill_routes_gpu.py > "$OUT/prefill_routes_gpu.log" 2>&1
tail -3 "$OUT/prefill_routes_gpu.log" | tee -a "$OUT/summary.txt"
fi
if step bench; then
timeout ${T_BENCH:-150} "${UQ[@]}" bench --layouts head --no-stream --plot "$OUT/decode_latency.png" \
  --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
tail -22 "$OUT/bench.log" | tee -a "$OUT/summary.txt"
fi
if step prefill-bench; then
timeout ${T_PBENCH:-120} "${UQ[@]}" bench --prefill --json "$OUT/prefill.json" > "$OUT/prefill.log" 2>&1
tail -32 "$OUT/prefill.log" | tee -a "$OUT/summary.txt"
fi
if step runtime; then
timeout ${T_VERIFY:-25} "${UQ[@]}" verify --device 0 2>&1 | tail -3 | tee -a "$OUT/summary.txt"
timeout ${T_RTESTS:-80} "${PYT[@]}" -rA tests/gpu/test_runtime_gpu.py -k "not memcheck" > "$OUT/runtime_gpu.log" 2>&1
grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/runtime_gpu.log" | tail -20 | tee -a "$OUT/summary.txt"
fi
if step attention-gpu; then
timeout ${T_ATTN:-60} "${PYT[@]}" -m gpu tests/gpu/test_attention_gpu.py 2>&1 | tail -3 | tee -a "$OUT/summary.txt"
fi
if step memcheck; then
timeout ${T_SAN:-70} compute-sanitizer --tool memcheck --print-limit 10 python3 tools/h200_sanitize.py \
  > "$OUT/memcheck.log" 2>&1
tail -4 "$OUT/memcheck.log" | tee -a "$OUT/summary.txt"
fi
if step ncu; then
timeout ${T_NCU:-90} ncu --clock-control none -k uq_decode -s 1 -c 1 --section SpeedOfLight --section Occupancy \
  --section LaunchStats --section SchedulerStats --section WarpStateStats --section InstructionStats \
  python3 tools/h200_ncu.py A > "$OUT/ncu_decode_A.txt" 2>&1
grep -E "Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Issued Ipc|Executed Ipc A|No Eligible|Warp Cycles Per Issued" \
  "$OUT/ncu_decode_A.txt" | tee -a "$OUT/summary.txt"
fi
step done
