"""Speculative-decoding step timings (``ultraquant bench --spec-decode``) on a GPU.

Over one head-major cache (the A geometry: B=8 requests x 32768 tokens, 32/8 heads, D=128, block 16,
and a ragged batch of the same kv heads), one run times, as CUDA-graph replays
(:func:`ultraquant.bench.decode.time_graph`):

* ``decode``: one decode step (``ultraquant.decode_attention``, one new token per request);
* ``spec k=K``: a step verifying K drafted tokens (K + 1 new tokens per request) through
  ``ultraquant.spec_decode_attention`` (the multi-query decode where it serves the call);
* ``prefill k=K``: the same step through ``ultraquant.prefill_attention`` (the route small
  continuations took before: the split-KV prefill kernel, the chunk's K/V raw);

each with its ratio to the decode row (the issue's gates: 4 tokens <= 1.5x, 8 tokens <= 2.5x). The
ragged batch has lengths 1..32768 and counts 1..K+1 per request (bound K + 1).
"""

from __future__ import annotations

from typing import Any

import torch

from .decode import time_graph

A_GEOMETRY: dict[str, int] = dict(B=8, L=32768, Hq=32, Hk=8, D=128, block=16)
"""The issue's A geometry at block 16 (head-major pages)."""

DRAFTS: tuple[int, ...] = (1, 3, 7)
"""Drafted tokens per request timed (k + 1 new tokens per step)."""


def _cache(lens: list[int], hk: int, d: int, bs: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A head-major cache holding ``lens`` tokens (stored by the store kernel) and its block table."""
    import ultraquant as uq

    per = [-(-n // bs) for n in lens]
    nblocks = sum(per) + 1
    raw = torch.zeros(nblocks, hk, bs, uq.slot_size(d), dtype=torch.uint8, device="cuda")
    cache = raw.permute(0, 2, 1, 3)
    ids = torch.randperm(nblocks - 1, generator=gen).to(torch.int32) + 1
    table = torch.zeros(len(lens), max(per), dtype=torch.int32)
    slots = []
    at = 0
    for i, (n, p) in enumerate(zip(lens, per, strict=True)):
        table[i, :p] = ids[at:at + p]
        at += p
        pos = torch.arange(n)
        slots.append(table[i, pos // bs].long() * bs + pos % bs)
    table = table.cuda()
    slot_mapping = torch.cat(slots).cuda()
    for s in range(0, slot_mapping.numel(), 1 << 18):
        sm = slot_mapping[s:s + (1 << 18)]
        k = torch.randn(sm.numel(), hk, d, device="cuda", dtype=torch.bfloat16)
        uq.store_kv(k, torch.randn_like(k), cache, sm)
    torch.cuda.synchronize()
    return cache, table


def _rows(name: str, lens: list[int], counts_of: dict[int, list[int]], g: dict[str, int],
          gen: torch.Generator) -> list[dict[str, Any]]:
    """Decode, spec-decode and prefill-route rows of one batch (``counts_of[k]``: new tokens per request)."""
    import ultraquant as uq

    hq, hk, d, bs = g["Hq"], g["Hk"], g["D"], g["block"]
    cache, table = _cache(lens, hk, d, bs, gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    scale = d ** -0.5
    b = len(lens)
    q1 = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
    o1 = torch.empty_like(q1)
    dec = time_graph(lambda: uq.decode_attention(q1, cache, table, seq_lens, scale, out=o1))
    rows = [dict(batch=name, row="decode", new_tokens=1, us=dec, vs_decode=1.0)]
    for k, counts in counts_of.items():
        n = sum(counts)
        mq = k + 1
        q = torch.randn(n, hq, d, device="cuda", dtype=torch.bfloat16)
        kk = torch.randn(n, hk, d, device="cuda", dtype=torch.bfloat16)
        vv = torch.randn_like(kk)
        o = torch.empty_like(q)
        qsl = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        kernel = uq.ops.spec_decode_takes_kernel(q, cache, mq)
        if kernel:
            us = time_graph(lambda q=q, qsl=qsl, o=o, mq=mq: uq.spec_decode_attention(
                q, cache, table, seq_lens, qsl, scale, max_query_len=mq, out=o))
            rows.append(dict(batch=name, row=f"spec k={k}", new_tokens=mq, us=us, vs_decode=us / dec))
        us = time_graph(lambda q=q, kk=kk, vv=vv, qsl=qsl, o=o: uq.prefill_attention(
            q, kk, vv, cache, table, seq_lens, qsl, scale, out=o))
        rows.append(dict(batch=name, row=f"prefill k={k}", new_tokens=mq, us=us, vs_decode=us / dec))
    return rows


def run_spec_decode_bench(geometry: dict[str, int] | None = None) -> dict[str, Any]:
    """Every row at the A geometry and on a ragged batch, printed and returned (JSON-able)."""
    g = dict(geometry or A_GEOMETRY)
    gen = torch.Generator().manual_seed(20261202)
    uniform = _rows("A", [g["L"]] * g["B"], {k: [k + 1] * g["B"] for k in DRAFTS}, g, gen)
    lens = [g["L"], 1 << 14, 3001, 9, 20000, 1 << 12, 777, 32000][: g["B"]]
    ragged_counts = {k: [1 + (i * 5) % (k + 1) for i in range(len(lens))] for k in DRAFTS}
    ragged_counts = {k: [min(c, n) for c, n in zip(cs, lens, strict=True)] for k, cs in ragged_counts.items()}
    ragged = _rows("ragged", lens, ragged_counts, g, gen)
    rows = uniform + ragged
    for r in rows:
        print(f"{r['batch']:7s} {r['row']:12s} new={r['new_tokens']:2d} {r['us']:9.1f} us  "
              f"{r['vs_decode']:5.2f}x decode")
    return {"geometry": g, "ragged_lens": lens, "ragged_counts": ragged_counts, "rows": rows,
            "gpu": torch.cuda.get_device_name()}
