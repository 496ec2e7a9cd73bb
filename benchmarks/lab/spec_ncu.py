"""One speculative-decoding step at the A geometry (``bench --spec-decode``'s cache and lengths), called twice
(profile the second launch): the workload for ``ncu -k regex:uq_decode_multiquery --launch-skip 1 -c 1`` (issue
25: where the 8-token step's time goes, the stage loop against the piece's prologue and the last program's merge).

    ncu -k regex:uq_decode_multiquery --launch-skip 1 -c 1 --section SourceCounters ... \\
        python3 benchmarks/lab/spec_ncu.py 8
"""

from __future__ import annotations

import sys

import torch

import ultraquant as uq
from ultraquant.bench.specdecode import A_GEOMETRY, _cache

n = int(sys.argv[1]) if len(sys.argv) > 1 else 8
g = A_GEOMETRY
cache, table = _cache([g["L"]] * g["B"], g["Hk"], g["D"], g["block"], torch.Generator().manual_seed(1))
seq_lens = torch.full((g["B"],), g["L"], dtype=torch.int32, device="cuda")
q = torch.randn(n * g["B"], g["Hq"], g["D"], device="cuda", dtype=torch.bfloat16)
qsl = torch.arange(0, n * g["B"] + 1, n, dtype=torch.int32, device="cuda")
o = torch.empty_like(q)
for _ in range(2):
    uq.spec_decode_attention(q, cache, table, seq_lens, qsl, g["D"] ** -0.5, max_query_len=n, out=o)
torch.cuda.synchronize()
print(f"spec {n} done")
