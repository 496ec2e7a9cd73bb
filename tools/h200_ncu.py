"""One warm decode launch for Nsight Compute: ``ncu --kernel-name uq_decode --launch-skip 1 ...``.

Usage on the device: ncu --clock-control none -k uq_decode -s 1 -c 1 --section SpeedOfLight ...
python3 tools/h200_ncu.py [A|B|C|D]
"""

from __future__ import annotations

import sys

import torch

import ultraquant as uq
from ultraquant.bench.decode import SHAPES, make_decode_problem


def main() -> None:
    s = SHAPES[sys.argv[1] if len(sys.argv) > 1 else "A"]
    p = make_decode_problem(s["B"], s["L"], s["Hq"], s["Hk"], s["D"], s["block"])
    for _ in range(2):
        uq.decode_attention(p.query, p.kv_cache, p.block_table, p.seq_lens, s["D"] ** -0.5, out=p.out)
    torch.cuda.synchronize()
    print("ncu workload done")


if __name__ == "__main__":
    main()
