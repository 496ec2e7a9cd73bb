"""Small decode v8 workload for compute-sanitizer (memcheck / racecheck): ragged lengths at block and
split boundaries, 1/3/7 splits, window + soft cap + sinks, Hk 1/2/8, head-major caches, the no-math
stream. Checks results against the reference (exit 1 on a mismatch)."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.gpu.test_kernels_gpu import _problem, check_close  # noqa: E402
from ultraquant import reference as R  # noqa: E402
from ultraquant.kernels.decode_v8_plan import V8Tuning, decode_v8  # noqa: E402

CASES = [
    # seq_lens, Hq, Hk, block, sinks, window, softcap, head_major, splits
    ([700, 1, 64, 65], 32, 8, 64, False, None, None, True, 3),
    ([300, 17], 12, 2, 32, True, 100, 30.0, True, 7),
    ([129, 5], 8, 1, 16, True, None, None, True, 1),
]
for lens, hq, hk, bs, sinks, window, softcap, head_major, splits in CASES:
    tuning = V8Tuning(splits=splits)
    prob, query, sk = _problem(lens, hq, hk, 128, bs, head_major, seed=5, sinks=sinks)
    ref = R.decode_attention(query.float(), prob.kv_cache, prob.block_table, prob.seq_lens, 0.1, sinks=sk,
                             sliding_window=window, softcap=softcap)
    out = torch.full_like(query, float("nan"))
    decode_v8(query, prob.kv_cache, prob.block_table, prob.seq_lens, 0.1, sinks=sk, sliding_window=window,
              softcap=softcap, out=out, tuning=tuning)
    decode_v8(query, prob.kv_cache, prob.block_table, prob.seq_lens, 0.1, out=torch.empty_like(out), math=False,
              tuning=tuning)
    torch.cuda.synchronize()
    print(lens, check_close(out, ref, str(lens)), flush=True)
print("done")
