"""Ring shape (NSUB x STAGES) sweep of the whole-page decode on the serving rows (issue 24): per row and
tuning the graph-replay time and the largest difference from split-KV decode (an independent kernel).
The stage loop is unrolled over NSUB sub-stages, so NSUB sets the loop's code size (GQA 16's 2614-instruction
loop stalls on instruction fetch: ncu no_instruction 18% there); STAGES x NSUB the bytes in flight.

    python3 benchmarks/lab/ring_sweep.py warm|time OUT.json ROWS TUNINGS
ROWS: comma-separated prefixes of ``serving_shapes()`` names; TUNINGS: ``nsub x stages`` pairs, e.g. 4x2,2x4,1x8,
each optionally followed by ``:w16`` (warps), ``:r128`` (register cap), ``:p264`` (persistent programs), e.g.
``1x4:w16:r128`` (16 warps per SM) or ``2x2:r128:p264`` (two programs per SM); ``policy``: the routed op.
``warm`` compiles every (row, tuning) on a small batch (run one process per row in parallel first).
"""

from __future__ import annotations

import functools
import json
import sys
from dataclasses import replace

import torch

from ultraquant import config
from ultraquant.bench.decode import make_ragged_problem, measure_ceiling, serving_shapes, time_graph
from ultraquant.kernels.families.decode_wholepage import WholePageTuning, decode_wholepage


def main(mode: str, out: str, rows: list[str], tunings: list[tuple[str, WholePageTuning | None]]) -> None:
    import ultraquant as uq

    shapes = [s for s in serving_shapes() if any(s.name.startswith(r) for r in rows)]
    res: dict = {"ceiling_tbps": measure_ceiling() if mode == "time" else None, "rows": []}
    for s in shapes:
        lens = (1024,) * 2 if mode == "warm" else s.lens
        p = make_ragged_problem(lens, s.Hq, s.Hk, s.D, s.block, s.head_major, seed=3)
        scale = s.D ** -0.5
        tuning = replace(config.get().tuning, decode_wholepage=False)
        with config.overridden(tuning=tuning, backend="triton"):
            ref = uq.decode_attention(p.query, p.kv_cache, p.block_table, p.seq_lens, scale).float()
        for name, tuned in tunings:
            call = (functools.partial(uq.decode_attention, p.query, p.kv_cache, p.block_table, p.seq_lens, scale,
                                      out=p.out) if tuned is None else
                    functools.partial(decode_wholepage, p.query, p.kv_cache, p.block_table, p.seq_lens, scale,
                                      out=p.out, tuning=tuned))

            call()
            torch.cuda.synchronize()
            if mode != "time":
                continue
            diff = float((p.out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-12))
            us = time_graph(call)
            nbytes = sum(s.lens) * s.Hk * uq.slot_size(s.D)
            row = dict(row=s.name, tuning=name, us=us,
                       pct=100 * nbytes / us / 1e6 / res["ceiling_tbps"], diff=diff)
            res["rows"].append(row)
            print(f"{s.name:34s} {name:14s} {us:8.1f} us {row['pct']:5.1f}% diff {diff:.1e}", flush=True)
            with open(out, "w") as f:
                json.dump(res, f, indent=1)
        del p
        torch.cuda.empty_cache()
    print(f"{mode} done", flush=True)


def parse_tuning(spec: str) -> tuple[str, WholePageTuning | None]:
    """``NSUBxSTAGES[:wW][:rR][:pP]`` -> (spec, tuning); ``policy``: the routed ``decode_attention`` (None)."""
    if spec == "policy":
        return spec, None
    ring, *opts = spec.split(":")
    nsub, stages = (int(x) for x in ring.split("x"))
    fields = {"w": "warps", "r": "maxnreg", "p": "programs"}
    extra = {fields[o[0]]: int(o[1:]) for o in opts}
    return spec, WholePageTuning(nsub=nsub, stages=stages, **extra)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3].split(","), [parse_tuning(t) for t in sys.argv[4].split(",")])
