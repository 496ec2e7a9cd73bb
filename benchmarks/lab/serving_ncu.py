"""One ``--serving`` row (by name prefix) through the routed decode, called twice (profile the second launch):
the workload for ``ncu -k regex:uq_decode_wholepage --launch-skip 1 --launch-count 1`` (issue 24: what bounds a
row's stage loop; benchmarks/NOTES.md, "Serving decode").

    ncu -k regex:uq_decode_wholepage --launch-skip 1 --launch-count 1 --metrics ... \\
        python3 benchmarks/lab/serving_ncu.py "GQA16 32/2"
"""

from __future__ import annotations

import sys

import torch

import ultraquant as uq
from ultraquant.bench.decode import make_ragged_problem, serving_shapes

s = next(s for s in serving_shapes() if s.name.startswith(sys.argv[1]))
p = make_ragged_problem(s.lens, s.Hq, s.Hk, s.D, s.block, s.head_major, seed=3)
for _ in range(2):
    uq.decode_attention(p.query, p.kv_cache, p.block_table, p.seq_lens, s.D ** -0.5, out=p.out)
torch.cuda.synchronize()
print(s.name, "done")
