#!/bin/bash
# The runtime issues' (6, 9, 17) one device call: verify --device, GPU tests, two-GPU tests, start-up
# benchmark, host-cost benchmark, memcheck. Usage on the device (repo root): bash tests/gpu/runtime_device.sh
# Blobs: $ULTRAQUANT_GENERATED (default .rtblobs, carried). Logs go to $OUT (or /tmp/uq_rt_out).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/uq_rt_out}
mkdir -p "$OUT"
export ULTRAQUANT_GENERATED=${ULTRAQUANT_GENERATED:-$PWD/.rtblobs}
export ULTRAQUANT_CACHE_DIR=$(mktemp -d)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
t0=$(date +%s)
step() { echo "== $1 at +$(( $(date +%s) - t0 ))s"; }
nvidia-smi -L | tee "$OUT/smi.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())" | tee -a "$OUT/smi.txt"
step verify-device
timeout ${T_VERIFY:-45} python3 -m ultraquant.cli verify --device 0 2>&1 \
  | tee "$OUT/verify_device.log" | tail -4
step gpu-tests
timeout ${T_TESTS:-170} python3 -m pytest -q -rA -p no:cacheprovider tests/gpu/test_runtime_gpu.py -k "not memcheck" \
  2>&1 | tee "$OUT/runtime_gpu.log" | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|Error" | tail -30
step multi-gpu
timeout ${T_MULTI:-75} python3 -m pytest -q -rA -p no:cacheprovider tests/gpu/test_multi_gpu.py \
  2>&1 | tee "$OUT/multi_gpu.log" | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|Error" | tail -12
step bench
timeout ${T_BENCH:-90} python3 -m ultraquant.bench.startup --json "$OUT/runtime_bench.json" 2>&1 \
  | tee "$OUT/bench.log" | tail -12
step host-bench
timeout ${T_HOST:-90} python3 -m ultraquant.cli bench --host --json "$OUT/host_bench.json" 2>&1 \
  | tee "$OUT/host_bench.log" | tail -8
step memcheck
timeout ${T_MEMCHECK:-110} python3 -m pytest -q -rA -s -p no:cacheprovider tests/gpu/test_runtime_gpu.py -k memcheck \
  2>&1 | tee "$OUT/memcheck.log" | grep -E "ERROR SUMMARY|AOT-SMOKE|PASSED|FAILED|passed|failed" | tail -6
step done
