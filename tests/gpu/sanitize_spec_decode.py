"""Small multi-query decode (speculative-decoding step) workload for compute-sanitizer (memcheck /
racecheck): ragged counts 0..16 at block and piece boundaries, Hk 1/2/8, window + soft cap + sinks,
one and two M tiles per program, an empty request, head-major caches. Checks results against the reference
(exit 1 on a mismatch)."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ultraquant as uq  # noqa: E402
from tests.gpu.test_kernels_gpu import check_close  # noqa: E402
from tests.gpu.test_spec_decode_gpu import _step  # noqa: E402
from ultraquant import reference as R  # noqa: E402

CASES = [
    # seq_lens, new tokens, Hq, Hk, block, sinks, window, softcap (the first: one M tile, programs of one;
    # the rest: programs of two)
    ([700, 33, 1], [4, 2, 1], 32, 8, 16, True, 64, None),
    ([700, 1, 64, 65], [4, 1, 8, 0], 32, 8, 16, False, None, None),
    ([300, 17], [16, 3], 16, 2, 32, True, 100, 30.0),
    ([129, 5], [7, 5], 8, 1, 64, True, None, None),
]
for lens, news, hq, hk, bs, sinks, window, softcap in CASES:
    prob, query, qsl, sk = _step(lens, news, hq, hk, 128, bs, sinks, torch.bfloat16, seed=5)
    mq = max(news)
    ref = R.spec_decode_attention(query.float(), prob.kv_cache, prob.block_table, prob.seq_lens, qsl, 0.1,
                                  max_query_len=mq, sinks=sk, sliding_window=window, softcap=softcap)
    out = torch.full_like(query, float("nan"))
    uq.spec_decode_attention(query, prob.kv_cache, prob.block_table, prob.seq_lens, qsl, 0.1, max_query_len=mq,
                             sinks=sk, sliding_window=window, softcap=softcap, out=out)
    torch.cuda.synchronize()
    print(lens, news, check_close(out, ref, str(lens)), flush=True)
print("errors", int(uq.check_errors()))
print("done")
