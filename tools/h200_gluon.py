"""Check and time the Gluon decode kernel (ultraquant/kernels/gluon_decode.py) on a CUDA GPU.

1. Correctness: ragged batches (lengths 1, block boundaries, 32768), GQA 1/4/6/8/16, head- and
   token-major caches, sinks + window + soft cap, default split count, 1 split and 3 splits, against
   the float64 reference (``ultraquant.reference.decode_attention``) with the GPU suite's tolerances
   (rel <= 1e-2, cosine >= 0.9999). One PASS/FAIL line per case.
2. Timing: shapes A, B, D of ``ultraquant bench`` (CUDA-graph replay), Gluon vs the Triton kernel
   behind ``uq.decode_attention``, with the same launch plan (args, grid, workspace).

Usage on the device (about 1-2 minutes): ``python3 tools/h200_gluon.py [--json out.json]``
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

import ultraquant as uq
from ultraquant import reference as R
from ultraquant.commands.bench import SHAPES, make_decode_problem, measure_ceiling, time_graph
from ultraquant.kernels.gluon_decode import uq_decode_gluon
from ultraquant.kernels.plans import plan_decode

MAX_REL = 1e-2
MIN_COS = 0.9999

CASES = {
    # name: (seq_lens, Hq, Hk, block, head_major, sinks, window, softcap)
    "gqa4-b64-ragged-32k": ([32768, 1, 63, 64, 65, 8191], 32, 8, 64, True, False, None, None),
    "gqa1-b16-short": ([1, 15, 16, 17, 300], 4, 4, 16, True, False, None, None),
    "gqa8-b128-token-major": ([4000, 129, 127, 1], 8, 1, 128, False, False, None, None),
    "gqa16-b16-batch16": ([(i * 977) % 2048 + 1 for i in range(16)], 16, 1, 16, True, False, None, None),
    "gqa6-b32-sinks-window-softcap": ([5000, 31, 33, 1], 12, 2, 32, False, True, 1000, 30.0),
}
SPLITS = (None, "1", "3")
"""Split counts per case: the plan's default (several at these sizes), forced 1, forced 3."""


def gluon_decode(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                 scale: float, out: torch.Tensor, sinks: torch.Tensor | None = None,
                 sliding_window: int | None = None, softcap: float | None = None) -> None:
    """Launch the Gluon kernel with exactly the plan ``uq.decode_attention`` would use."""
    plan = plan_decode(query, kv_cache, block_table, seq_lens, scale, sinks, sliding_window, softcap, out)
    uq_decode_gluon[plan.grid](*plan.args, **plan.spec.constexprs, num_warps=plan.spec.num_warps,
                               num_stages=plan.spec.num_stages)


def compare(got: torch.Tensor, ref: torch.Tensor) -> tuple[bool, float, float]:
    """(ok, relative L2 error, cosine) of ``got`` against the float64 reference; NaN = unwritten."""
    g, r = got.double().flatten().cpu(), ref.double().flatten().cpu()
    if g.isnan().any():
        return False, float("nan"), float("nan")
    rel = float((g - r).norm() / r.norm().clamp_min(1e-300))
    cos = float(torch.nn.functional.cosine_similarity(g, r, dim=0))
    return rel <= MAX_REL and cos >= MIN_COS, rel, cos


def check_cases() -> int:
    """Run every case x split count; returns the number of failures."""
    failures = 0
    D = 128
    for name, (lens, hq, hk, bs, head_major, with_sinks, window, softcap) in CASES.items():
        L = -(-max(lens) // bs) * bs
        p = make_decode_problem(len(lens), L, hq, hk, D, bs, head_major=head_major, seed=len(name))
        p.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        sinks = torch.randn(hq, device="cuda", dtype=torch.float32) * 2 if with_sinks else None
        scale = D ** -0.5
        ref = R.decode_attention(p.query.float(), p.kv_cache, p.block_table, p.seq_lens, scale, sinks=sinks,
                                 sliding_window=window, softcap=softcap)
        for splits in SPLITS:
            os.environ.pop("ULTRAQUANT_DECODE_SPLITS", None)
            if splits:
                os.environ["ULTRAQUANT_DECODE_SPLITS"] = splits
            out = torch.full_like(p.query, float("nan"))
            label = f"{name} splits={splits or 'default'}"
            try:
                gluon_decode(p.query, p.kv_cache, p.block_table, p.seq_lens, scale, out, sinks, window, softcap)
                torch.cuda.synchronize()
                ok, rel, cos = compare(out, ref)
            except Exception as exc:  # a compile or launch error is a finding, not a crash
                print(f"FAIL {label}: {type(exc).__name__}: {exc}"[:400], flush=True)
                failures += 1
                continue
            failures += not ok
            print(f"{'PASS' if ok else 'FAIL'} {label}: rel {rel:.2e} cos {cos:.6f}", flush=True)
        os.environ.pop("ULTRAQUANT_DECODE_SPLITS", None)
        del p
        torch.cuda.empty_cache()
    return failures


def time_shapes(names: tuple[str, ...] = ("A", "B", "D")) -> list[dict]:
    """Graph-replay time of the Triton kernel and the Gluon kernel per shape, with % of the ceiling."""
    ceiling = measure_ceiling()
    print(f"ceiling {ceiling:.2f} TB/s", flush=True)
    print(f"{'shape':>5} {'triton us':>10} {'gluon us':>9} {'triton %':>9} {'gluon %':>8} {'speedup':>8}", flush=True)
    rows = []
    for name in names:
        s = SHAPES[name]
        p = make_decode_problem(s["B"], s["L"], s["Hq"], s["Hk"], s["D"], s["block"])
        args = (p.query, p.kv_cache, p.block_table, p.seq_lens, s["D"] ** -0.5)
        t_tri = time_graph(lambda args=args, out=p.out: uq.decode_attention(*args, out=out))
        t_glu = time_graph(lambda args=args, out=p.out: gluon_decode(*args, out))
        pct = [100 * p.stored_bytes / (t * 1e-6) / 1e12 / ceiling for t in (t_tri, t_glu)]
        rows.append({"shape": name, "triton_us": t_tri, "gluon_us": t_glu, "triton_pct": pct[0], "gluon_pct": pct[1]})
        print(f"{name:>5} {t_tri:10.1f} {t_glu:9.1f} {pct[0]:9.1f} {pct[1]:8.1f} {t_tri / t_glu:7.2f}x", flush=True)
        del p
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str]) -> None:
    start = time.time()
    failures = check_cases()
    print(f"correctness: {failures} failure(s) ({time.time() - start:.0f} s)", flush=True)
    rows = time_shapes()
    if argv[:1] == ["--json"]:
        with open(argv[1], "w") as f:
            json.dump({"failures": failures, "rows": rows}, f, indent=1)
    print(f"total {time.time() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
