"""Lab (issue 24, with ``benchmarks/lab/pdl.patch``): what programmatic dependent launch buys the whole-page decode.
Per ``--serving`` row (name prefixes in argv[2], comma-separated): the decode alone (a graph of 10 back-to-back
decodes, as ``bench --serving``) and a serving step's pair (the store of one new token per request, then the
decode), each as microseconds per call (CUDA-graph replay of 10 calls).
The patch's loader launches the whole-page blobs with the PDL attribute while ``ULTRAQUANT_PDL=1`` (read at each
launch or capture), so the same blobs run both ways, alternated twice; and the PDL decode right after the store
must equal the plain one bit for bit. argv[1]: the JSON output.

    ULTRAQUANT_GENERATED=.new python3 benchmarks/lab/pdl_probe.py out.json "GQA16 16/1,A bs16"
"""

from __future__ import annotations

import json
import os
import sys

import torch

import ultraquant as uq
from ultraquant.bench.decode import make_ragged_problem, serving_shapes, time_graph


def pdl(on: bool) -> None:
    os.environ["ULTRAQUANT_PDL"] = "1" if on else "0"


def probe(prefix: str) -> dict:
    """One row: the bit-for-bit check, then plain / PDL timings alternated twice."""
    s = next(x for x in serving_shapes() if x.name.startswith(prefix.strip()))
    p = make_ragged_problem(s.lens, s.Hq, s.Hk, s.D, s.block, s.head_major, seed=3)
    scale = s.D ** -0.5
    B = len(s.lens)
    last = p.seq_lens.long() - 1
    slots = p.block_table[torch.arange(B, device="cuda"), last // s.block].long() * s.block + last % s.block
    gen = torch.Generator(device="cuda").manual_seed(5)
    k = torch.randn(B, s.Hk, s.D, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(B, s.Hk, s.D, device="cuda", dtype=torch.bfloat16, generator=gen)

    def decode() -> None:
        uq.decode_attention(p.query, p.kv_cache, p.block_table, p.seq_lens, scale, out=p.out)

    def store() -> None:
        uq.store_kv(k, v, p.kv_cache, slots)

    def step() -> None:
        store()
        decode()

    pdl(True)
    step()  # the new tokens stored, then the PDL decode: it must see them (griddepcontrol.wait)
    torch.cuda.synchronize()
    got = p.out.float().clone()
    pdl(False)
    decode()
    torch.cuda.synchronize()
    diff = float((got - p.out.float()).abs().max())
    r = {"name": s.name, "max_diff_pdl_vs_plain": diff}
    for rep in (1, 2):
        for on in (False, True):
            pdl(on)
            tag = f"{'pdl' if on else 'plain'}_{rep}"
            r[tag] = {"decode_us": time_graph(decode), "store_us": time_graph(store), "step_us": time_graph(step)}
            print(f"{s.name[:34]:34s} {tag:7s} decode {r[tag]['decode_us']:7.1f} store {r[tag]['store_us']:5.1f} "
                  f"step {r[tag]['step_us']:7.1f} us", flush=True)
    print(f"{s.name[:34]:34s} max |pdl - plain| {diff:.2e}", flush=True)
    return r


rows = [probe(x) for x in sys.argv[2].split(",")]
json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, open(sys.argv[1], "w"), indent=1)
