"""Time the whole-page decode against the read ceiling, bf16 SDPA and the split-KV decode
in one run, timed like ``ultraquant bench`` (CUDA-graph replay, no flush, head-major caches).

    python benchmarks/lab/wholepage_bench.py --json out.json [--shapes A,B,C,D] [--rings 8:2x4,8:2x4:m16,16:1x4]

``--rings`` lists ``warps:NSUBxSTAGES[:m16][:r128]`` variants (NSUB 0: the default for the head
size; ``m16``: query rows as 16 MMA M rows instead of 8 N rows; 16 warps, and ``r128``, run under a
128-register cap: two 8-warp programs per SM when the ring fits twice). Shapes the whole-page decode
does not cover get only the SDPA and split-KV rows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Callable
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ultraquant import config  # noqa: E402
from ultraquant.bench.decode import (  # noqa: E402
    SHAPES,
    bench_decode,
    bench_sdpa,
    make_decode_problem,
    measure_ceiling,
    time_graph,
)
from ultraquant.kernels.families.decode_wholepage import (  # noqa: E402
    WholePageTuning,
    decode_wholepage,
    whole_runs,
    wholepage_programs,
    wholepage_supports,
)


def time_wholepage(p, scale: float, tuning: WholePageTuning) -> float:
    """Graph-replay microseconds of one whole-page launch."""
    return time_graph(lambda: decode_wholepage(p.query, p.kv_cache, p.block_table, p.seq_lens, scale, out=p.out,
                                        tuning=tuning))


def _variants(spec: str) -> list[WholePageTuning]:
    out = []
    for variant in spec.split(","):
        warps, ring, *flags = variant.split(":")
        nsub, stages = (int(x) for x in ring.split("x"))
        capped = warps == "16" or "r128" in flags
        out.append(WholePageTuning(warps=int(warps), nsub=nsub, stages=stages, maxnreg=128 if capped else None,
                            rows_in_n="m16" not in flags))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    ap.add_argument("--shapes", default="A,B,C,D")
    ap.add_argument("--rings", default="8:2x4,8:2x4:m16", help="warps:NSUBxSTAGES[:m16] variants")
    ap.add_argument("--splits-scale", default="1", help="scales of the persistent grid (programs per SM)")
    ap.add_argument("--no-splitkv", action="store_true", help="skip the split-KV decode rows")
    a = ap.parse_args()
    rows: list[dict] = []
    ceiling = measure_ceiling()
    print(f"ceiling {ceiling:.3f} TB/s", flush=True)
    result = {"ceiling_tbps": ceiling, "rows": rows}

    def add(shape: str, name: str, us: float, nbytes: int, sdpa: float | None, **extra) -> None:
        tbps = nbytes / (us * 1e-6) / 1e12
        rows.append(dict(shape=shape, name=name, us=us, tbps=tbps, pct_ceiling=100 * tbps / ceiling,
                         vs_sdpa=None if sdpa is None else sdpa / us, **extra))
        print(f"{shape} {name:44s} {us:8.1f} us {100 * tbps / ceiling:5.1f}% "
              f"{'' if sdpa is None else f'{sdpa / us:.2f}x'}", flush=True)
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)

    def attempt(shape: str, name: str, fn: Callable[[], float], nbytes: int, sdpa: float, **extra) -> None:
        try:
            add(shape, name, fn(), nbytes, sdpa, **extra)
        except Exception:
            traceback.print_exc()

    for shape in a.shapes.split(","):
        s = SHAPES[shape]
        p = make_decode_problem(s["B"], s["L"], s["Hq"], s["Hk"], s["D"], s["block"], head_major=True)
        sdpa = bench_sdpa(s["B"], s["L"], s["Hq"], s["Hk"], s["D"])
        add(shape, "sdpa-bf16", sdpa, 2 * s["B"] * s["L"] * s["Hk"] * s["D"] * 2, None)
        if not a.no_splitkv:  # split-KV through the plan with the whole-page decode switched off
            os.environ["ULTRAQUANT_DECODE_WHOLEPAGE"] = "0"
            config.reload()
            add(shape, "split-KV decode (JIT)", bench_decode(p, s["D"]), p.stored_bytes, sdpa)
            del os.environ["ULTRAQUANT_DECODE_WHOLEPAGE"]
            config.reload()
        scale = s["D"] ** -0.5
        base_programs = wholepage_programs(p.query.device)
        ok = wholepage_supports(head_size=s["D"], gqa=s["Hq"] // s["Hk"], num_kv_heads=s["Hk"], block_size=s["block"],
                         runs=whole_runs(s["D"], tuple(p.kv_cache.stride()), s["Hk"]), target="cuda")
        for base in (_variants(a.rings) if ok else []):
            for k in (float(x) for x in a.splits_scale.split(",")):
                t = WholePageTuning(**{**base.__dict__, "programs": max(1, int(base_programs * k))})
                tag = (f"w{t.warps} ring {t.nsub}x{t.stages}{'' if t.rows_in_n else ' m16'}"
                       f"{' r128' if t.maxnreg else ''} programs {t.programs}")
                attempt(shape, f"whole-page decode {tag}",
                        partial(time_wholepage, p, scale, t), p.stored_bytes, sdpa, **t.__dict__)
        p = None
        torch.cuda.empty_cache()
    print("\nshape name us %ceiling vs-sdpa")
    for r in rows:
        print(f"{r['shape']} {r['name']:44s} {r['us']:8.1f} {r['pct_ceiling']:5.1f} "
              f"{'' if r['vs_sdpa'] is None else round(r['vs_sdpa'], 2)}")


if __name__ == "__main__":
    main()
