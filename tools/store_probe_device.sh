#!/bin/bash
# Store probe (issue 14 Also) in ONE time-boxed device call (at most 100 s, nothing carried): where the
# large store's ~63 us go. `tools/store_probe.py` times, in one process and as CUDA-graph replays next
# to the ceiling: the store (random and sequential slots, and the 64-token decode step), no-math
# streams with the store's grid and its load/store patterns (rows on lanes as v3, or coalesced), the
# LANES store candidates (a row's 16-byte vectors over lanes, exact bytes), torch copies as anchors;
# then byte checks and the kernels one store_kv call launches. Writes $OUT/store_probe/{run.log,
# probe.log,probe.json}. From the repo root:
#   bash tools/store_probe_device.sh
export PYTHONPATH=$PWD
export ULTRAQUANT_BACKEND=triton
PY=${PY:-python3}
OUT=${OUT:-/tmp/out}; D="$OUT/store_probe"; mkdir -p "$D"
T0=$SECONDS
{ timeout 10 nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv
  timeout 88 $PY tools/store_probe.py --out "$D"; echo "probe rc=$?"; } > "$D/run.log" 2>&1
echo "total $((SECONDS - T0)) s" >> "$D/run.log"
tail -50 "$D/run.log"
