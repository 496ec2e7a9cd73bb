"""A small whole-page decode workload for compute-sanitizer (memcheck / racecheck): ragged lengths at block
and stage boundaries, persistent grids of 1/3/5/7 programs and the default (pieces spanning requests),
window + soft cap + sinks, Hk 1/2/8, GQA 16, head-major caches (cases 5-7: token-major pages, the
``TOKEN_MAJOR`` prototype); then the bounds contract's garbage block
ids and lengths through the routed API (one kv head: tests/bounds_cases.py's decode case, 2 seeds).
Checks results against the reference (exit 1 on a mismatch or a failed check). ``UQ_SANITIZE_CASES=3,4``
picks cases, ``UQ_SANITIZE_BOUNDS=0`` skips the bounds part (a short racecheck)."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ultraquant as uq  # noqa: E402
from tests import bounds_cases  # noqa: E402
from tests.gpu.test_kernels_gpu import _problem, check_close  # noqa: E402
from ultraquant import reference as R  # noqa: E402
from ultraquant.kernels import plans  # noqa: E402
from ultraquant.kernels.families.decode_wholepage import WholePageTuning, decode_wholepage  # noqa: E402

CASES = [
    # seq_lens, Hq, Hk, block, sinks, window, softcap, head_major, programs (persistent grid)
    ([700, 1, 64, 65], 32, 8, 64, False, None, None, True, 3),
    ([300, 17], 12, 2, 32, True, 100, 30.0, True, 7),
    ([129, 5], 8, 1, 16, True, None, None, True, 1),
    ([0, 3000, 1, 17, 900, 0, 2500, 64], 32, 8, 16, True, None, None, True, 5),  # ragged: pieces span requests
    ([1000, 40, 0, 2600], 32, 2, 16, False, 700, 20.0, True, None),  # the default grid (one per SM), GQA 16
    # token-major pages (TOKEN_MAJOR): the pair-padded ring, the second copy's masked tail, both layouts' ids
    ([0, 3000, 1, 17, 900, 0, 2500, 64], 32, 8, 16, True, None, None, False, 5),
    ([1000, 40, 0, 2600], 32, 2, 16, False, 700, 20.0, False, None),
    ([300, 17, 64], 16, 4, 64, True, None, 30.0, False, 3),
]
PICK = os.environ.get("UQ_SANITIZE_CASES")  # comma-separated case indices (default: all)
for i, (lens, hq, hk, bs, sinks, window, softcap, head_major, programs) in enumerate(CASES):
    if PICK and str(i) not in PICK.split(","):
        continue
    tuning = WholePageTuning(programs=programs)
    prob, query, sk = _problem(lens, hq, hk, 128, bs, head_major, seed=5, sinks=sinks)
    ref = R.decode_attention(query.float(), prob.kv_cache, prob.block_table, prob.seq_lens, 0.1, sinks=sk,
                             sliding_window=window, softcap=softcap)
    out = torch.full_like(query, float("nan"))
    decode_wholepage(query, prob.kv_cache, prob.block_table, prob.seq_lens, 0.1, sinks=sk, sliding_window=window,
              softcap=softcap, out=out, tuning=tuning)
    torch.cuda.synchronize()
    print(lens, check_close(out, ref, str(lens)), flush=True)
os.environ.pop("ULTRAQUANT_CHECK_VALUES", None)
failures: list[str] = []
for seed in range(2 if os.environ.get("UQ_SANITIZE_BOUNDS", "1") != "0" else 0):
    p = bounds_cases.Problem("cuda", seed, hk=1, gqa=4, bs=16)
    assert plans.takes_wholepage(128, 4, 1, 16, tuple(p.cache.stride()), p.cache.device,
                          cache_aligned=p.cache.data_ptr() % 16 == 0)
    uq.check_errors()
    for splits in (1, 3):
        bounds_cases.decode_case(p, failures, splits)
torch.cuda.synchronize()
print(f"bounds (garbage ids and lengths, whole-page at one kv head): {len(failures)} failed checks", failures,
      flush=True)
print("done")
sys.exit(1 if failures else 0)
