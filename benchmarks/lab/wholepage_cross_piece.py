"""Offline evidence for cross-piece pipelining in the whole-page decode (issue 24, branch `xpiece`; no GPU).

``sass OUTDIR [name ...]``: sm_90 SASS census (benchmarks/lab/wholepage_token_major_sass.py's ``census``: registers,
spills, shared memory, instruction count, the stage loop's size and opcode mix, masked ``.sass`` dumps) of the
configurations below; run it on main's tree and on the patched tree (``wholepage_cross_piece.patch``, in git at
c9a34bb; refuted on the H200, benchmarks/NOTES.md) and diff.
``pieces``: the CPU model of the schedule (``wholepage_schedule``) on the ``--serving`` rows at 132 programs:
pieces per program, and the pieces after a program's first (each pays the per-piece fixed cost; with the
patch its first stage is already in flight when the previous piece's epilogue runs).

    .venv/bin/python benchmarks/lab/wholepage_cross_piece.py sass /tmp/xp_after
    .venv/bin/python benchmarks/lab/wholepage_cross_piece.py pieces
"""

from __future__ import annotations

import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

CONFIGS: dict[str, dict] = {
    "A_d128_gqa4_hk8_bs16": {"head_size": 128, "gqa": 4, "num_kv_heads": 8, "block_size": 16},
    "d128_gqa16_hk2_bs16": {"head_size": 128, "gqa": 16, "num_kv_heads": 2, "block_size": 16},
    "d128_gqa8_hk1_bs16": {"head_size": 128, "gqa": 8, "num_kv_heads": 1, "block_size": 16},
    "d256_gqa8_hk2_bs16": {"head_size": 256, "gqa": 8, "num_kv_heads": 2, "block_size": 16},
    "A_d128_gqa4_hk8_bs16_tm": {"head_size": 128, "gqa": 4, "num_kv_heads": 8, "block_size": 16,
                                "token_major": True},
    "d128_gqa4_hk8_bs16_m16": {"head_size": 128, "gqa": 4, "num_kv_heads": 8, "block_size": 16, "rows_in_n": False},
    "d128_gqa4_hk8_bs16_w16": {"head_size": 128, "gqa": 4, "num_kv_heads": 8, "block_size": 16, "warps": 16,
                               "nsub": 1, "stages": 4, "maxnreg": 128},
}


def sass(outdir: str, names: list[str]) -> None:
    from benchmarks.lab.wholepage_token_major_sass import census

    os.makedirs(outdir, exist_ok=True)
    with open(os.path.join(outdir, "summary.jsonl"), "a") as f:
        for n in names or list(CONFIGS):
            row = census(n, CONFIGS[n], outdir)
            row.pop("loop_ops", None)
            print(json.dumps(row), flush=True)
            f.write(json.dumps(row) + "\n")


def pieces(programs: int = 132) -> None:
    from ultraquant.bench.decode import serving_shapes
    from ultraquant.kernels.families.decode_wholepage import stage_tokens, wholepage_schedule

    for s in serving_shapes():
        tt = stage_tokens(s.D, s.Hk)
        sched = wholepage_schedule(list(s.lens), programs, tt, cap=1 << 30)
        per = collections.Counter(p.program for p in sched)
        stages = collections.Counter()
        for p in sched:
            stages[p.program] += -(-(p.t_hi - p.t_lo) // tt) if p.t_hi > p.t_lo else 0
        worst = max(per.values())
        hist = collections.Counter(per.values())
        # the critical program: most stages, then most pieces
        crit = max(per, key=lambda q: (stages[q], per[q]))
        print(f"{s.name:38s} TT={tt:3d} programs={len(per):3d} pieces={len(sched):4d} "
              f"extra pieces={len(sched) - len(per):3d} max/program={worst} hist={dict(sorted(hist.items()))} "
              f"critical program {crit}: {stages[crit]} stages, {per[crit]} pieces; "
              f"max pieces among programs with max stages: "
              f"{max(per[q] for q in per if stages[q] == stages[crit])}")


if __name__ == "__main__":
    if sys.argv[1] == "sass":
        sass(sys.argv[2], sys.argv[3:])
    else:
        pieces(*(int(a) for a in sys.argv[2:]))
