"""Shape A (or another bench shape) through the whole-page decode, twice: the workload for
``ncu -k regex:uq_`` (occupancy, DRAM %, stall reasons)."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ultraquant.bench.decode import SHAPES, make_decode_problem  # noqa: E402
from ultraquant.kernels.families.decode_wholepage import decode_wholepage  # noqa: E402

s = SHAPES[sys.argv[1] if len(sys.argv) > 1 else "A"]
p = make_decode_problem(s["B"], s["L"], s["Hq"], s["Hk"], s["D"], s["block"], head_major=True)
for _ in range(2):
    decode_wholepage(p.query, p.kv_cache, p.block_table, p.seq_lens, s["D"] ** -0.5, out=p.out)
torch.cuda.synchronize()
print("done")
