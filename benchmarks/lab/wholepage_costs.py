"""A piece's fixed cost against a stage's cost in the whole-page decode (issue 24): graph-replay times of
uniform block-16 batches at several lengths (each row records the schedule's stages per program and active
programs from the CPU model, so a fit over rows of one grid gives the stage cost as the slope and the
piece's fixed cost as the intercept), A at block 16 against block 64, and the ragged 96-request batch.

    PYTHONPATH=<tree> python3 benchmarks/lab/wholepage_costs.py NAME warm|time|ncu OUT.json SHAPES [k=v ...]

``SHAPES``: comma-separated keys of :data:`SHAPES` (``key@L``: that length only; ``empty``: a one-element fill,
the launch cost alone); ``k=v``:
:class:`WholePageTuning` fields. ``warm`` compiles each shape's kernel on a small batch; ``ncu`` runs each
shape's longest length twice (profile the second launch). Results: benchmarks/NOTES.md, "Serving decode", session 3.
"""

from __future__ import annotations

import json
import sys

import torch

from ultraquant.bench.decode import make_decode_problem, make_ragged_problem, serving_shapes, time_graph
from ultraquant.format import slot_size
from ultraquant.kernels.families.decode_wholepage import (
    WholePageTuning,
    decode_wholepage,
    stage_tokens,
    wholepage_programs,
    wholepage_schedule,
)

SHAPES: dict[str, tuple[int, int, int, int, int, tuple[int, ...]]] = {
    # key: (B, Hq, Hk, D, block, lengths); A-D as the shapes at block 16 and (suffix 64) block 64
    "one": (16, 8, 1, 128, 16, (4096, 8192, 16384, 32768, 65536)),
    "one64": (16, 8, 1, 128, 64, (32768,)),
    "one256": (16, 8, 1, 128, 256, (32768,)),
    "gqa16": (8, 32, 2, 128, 16, (4096, 8192, 16384, 32768, 65536)),
    "gqa16h1": (16, 16, 1, 128, 16, (8192, 16384, 32768)),
    "A": (8, 32, 8, 128, 16, (8192, 16384, 32768, 65536)),
    "A64": (8, 32, 8, 128, 64, (32768,)),
    "B": (32, 32, 8, 128, 16, (8192,)),
    "B64": (32, 32, 8, 128, 64, (8192,)),
    "C": (8, 16, 2, 256, 16, (32768,)),
    "C64": (8, 16, 2, 256, 64, (32768,)),
    "D": (64, 32, 8, 128, 16, (2048,)),
    "D64": (64, 32, 8, 128, 64, (2048,)),
}


def _value(v: str) -> object:
    return {"True": True, "False": False}.get(v, int(v) if v.lstrip("-").isdigit() else v)


def main(name: str, mode: str, out: str, keys: list[str], tuning: WholePageTuning) -> None:
    rows: list[dict] = []

    def call(p, D: int = 128) -> None:
        decode_wholepage(p.query, p.kv_cache, p.block_table, p.seq_lens, D ** -0.5, out=p.out, tuning=tuning)

    def record(key: str, p, lens: list[int], hk: int, D: int = 128) -> None:
        programs = wholepage_programs(torch.device("cuda"), tuning.programs)
        tt = stage_tokens(D, hk, tuning)
        pieces = wholepage_schedule(lens, programs, tt, cap=p.block_table.shape[1] * p.kv_cache.shape[1])
        per_prog: dict[int, list[int]] = {}
        for pc in pieces:
            per_prog.setdefault(pc.program, []).append(-(-(pc.t_hi - pc.t_lo) // tt))
        us = time_graph(lambda: call(p, D))
        nbytes = sum(lens) * hk * slot_size(D)
        row = dict(variant=name, shape=key, L=max(lens), us=us, bytes=nbytes, tbps=nbytes / us / 1e6,
                   active=len(per_prog), max_stages=max(sum(v) for v in per_prog.values()),
                   max_pieces=max(len(v) for v in per_prog.values()), tuning=str(tuning))
        rows.append(row)
        print(f"{name:8s} {key:8s} L={row['L']:6d} {us:8.1f} us {row['tbps']:5.2f} TB/s active {row['active']:3d} "
              f"stages/prog {row['max_stages']:3d} pieces/prog {row['max_pieces']}", flush=True)
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)

    for key in keys:
        if key == "empty":  # a graph of one-element fills: the launch cost every replayed kernel pays
            x = torch.zeros(1, device="cuda")
            us = time_graph(x.zero_) if mode == "time" else 0.0
            rows.append(dict(variant=name, shape=key, L=0, us=us))
            print(f"{name:8s} empty    {us:8.1f} us", flush=True)
            continue
        if key == "ragged":
            s = next(s for s in serving_shapes() if s.name.startswith("ragged 96"))
            small = mode == "warm"
            lens = (1024,) * 4 if small else s.lens
            p = make_ragged_problem(lens, s.Hq, s.Hk, s.D, s.block, s.head_major, seed=3)
            if mode == "time":
                record(key, p, list(lens), s.Hk)
            else:
                for _ in range(2 if mode == "ncu" else 1):
                    call(p)
            torch.cuda.synchronize()
            continue
        key, _, only = key.partition("@")
        B, hq, hk, D, block, lengths = SHAPES[key]
        lengths = (int(only),) if only else lengths
        L = max(lengths) if mode != "warm" else 1024
        p = make_decode_problem(B if mode != "warm" else 2, L, hq, hk, D, block)
        if mode == "warm":
            call(p, D)
        elif mode == "ncu":
            p.seq_lens.fill_(L)
            call(p, D)
            call(p, D)
        else:
            for n in lengths:
                p.seq_lens.fill_(n)
                record(key, p, [n] * B, hk, D)
        torch.cuda.synchronize()
        print(f"{name} {key} {mode} done", flush=True)
        del p
        torch.cuda.empty_cache()


if __name__ == "__main__":
    kw = {k: _value(v) for k, v in (a.split("=", 1) for a in sys.argv[5:])}
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(","), WholePageTuning(**kw))
