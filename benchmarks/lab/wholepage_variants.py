"""Time the whole-page decode of the source tree on ``PYTHONPATH`` on the uniform block-16 shapes and the
``--serving`` ragged batches (issue 24: compare kernel variants checked out side by side, one run).

    PYTHONPATH=<tree> python3 benchmarks/lab/wholepage_variants.py NAME warm|time OUT.json [A,D,one,GQA16,ragged]

``warm`` compiles each shape's kernel and prints its largest difference to split-KV decode (trees that
have ``bench.decode._splitkv_diff``); ``time`` writes graph-replay microseconds per shape to OUT.json.
Results: benchmarks/NOTES.md, "Serving decode".
"""

from __future__ import annotations

import json
import sys
import time

import torch

from ultraquant.bench.decode import make_decode_problem, time_graph
from ultraquant.kernels.families.decode_wholepage import decode_wholepage

UNIFORM = [("A bs16", 8, 32768, 32, 8, 128), ("B bs16", 32, 8192, 32, 8, 128), ("C bs16", 8, 32768, 16, 2, 256),
           ("D bs16", 64, 2048, 32, 8, 128), ("one kv head 8/1 B16x32k", 16, 32768, 8, 1, 128),
           ("GQA16 32/2 B8x32k", 8, 32768, 32, 2, 128)]


def main(name: str, mode: str, out: str, only: list[str] | None) -> None:
    try:  # the serving suite's batches and the split-KV check exist from the balanced schedule on
        from ultraquant.bench.decode import _splitkv_diff, make_ragged_problem, serving_shapes
        ragged = [s for s in serving_shapes() if s.name.startswith("ragged")]
    except ImportError:
        ragged, _splitkv_diff, make_ragged_problem = [], None, None
    rows: list[dict] = []

    def one(label: str, p, d: int) -> None:
        def call() -> None:
            decode_wholepage(p.query, p.kv_cache, p.block_table, p.seq_lens, d ** -0.5, out=p.out)

        t0 = time.time()
        call()
        torch.cuda.synchronize()
        if mode == "warm":
            diff = _splitkv_diff(p, d) if _splitkv_diff else None
            print(f"{name} {label} warm {time.time() - t0:.1f}s diff vs split-KV {diff}", flush=True)
            return
        us = time_graph(call)
        rows.append(dict(variant=name, shape=label, us=us, bytes=p.stored_bytes))
        print(f"{name:8s} {label:34s} {us:8.1f} us", flush=True)
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)

    for label, b, length, hq, hk, d in UNIFORM:
        if not only or label.split()[0] in only:
            one(label, make_decode_problem(b, length, hq, hk, d, 16), d)
            torch.cuda.empty_cache()
    for s in ragged:
        if not only or "ragged" in only:
            one(s.name, make_ragged_problem(s.lens, s.Hq, s.Hk, s.D, s.block, s.head_major, seed=3), s.D)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(",") if len(sys.argv) > 4 and sys.argv[4] else None)
