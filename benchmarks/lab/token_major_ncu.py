"""Shape A at block 16 (B 8 x 32k, 32/8, D=128) on head-major or token-major pages, the routed decode
called twice (profile the second launch): ncu's view of why token-major A is slower than head-major A
(issue 24; benchmarks/NOTES.md, "Token-major pages in the whole-page decode").

    ncu -k regex:uq_decode_wholepage --launch-skip 1 --launch-count 1 --metrics ... \\
        python3 benchmarks/lab/token_major_ncu.py hm|tm
"""

from __future__ import annotations

import sys

import torch

import ultraquant as uq
from ultraquant.bench.decode import make_ragged_problem

p = make_ragged_problem((32768,) * 8, 32, 8, 128, 16, head_major=sys.argv[1] == "hm", seed=3)
for _ in range(2):
    uq.decode_attention(p.query, p.kv_cache, p.block_table, p.seq_lens, 128 ** -0.5, out=p.out)
torch.cuda.synchronize()
print(sys.argv[1], "done")
