"""The multi-query decode (speculative-decoding steps, Gluon, NVIDIA sm_90+) on a GPU against the float64
reference over the same cache bytes.

Through the public op (``ultraquant.spec_decode_attention``; the plan must pick ``uq_decode_multiquery``):
GQA 1..16, Hk 1/2/4/8, blocks 16..128, ragged new-token counts 0..16 per request (0: a padding request),
lengths 1..131072, sinks, sliding window, soft cap, fp16/bf16 queries, NaN-poisoned outputs, equality with
``reference.prefill_attention`` fed the cache's rows of the new tokens, CUDA graph capture at the largest
count and replay with new counts and lengths; programs of one and of two M tiles (``TILES``: the plan takes two
from two tiles on, a test forces one); D=256 stays on the prefill kernel (``spec_decode_takes_kernel``).
"""

from __future__ import annotations

import pytest
import torch

import ultraquant as uq
from tests.gpu.test_kernels_gpu import check_close
from tests.helpers import make_paged
from ultraquant import reference as R
from ultraquant.kernels import plans

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.version.hip is not None
                       or torch.cuda.get_device_capability() < (9, 0), reason="needs an NVIDIA sm_90+ GPU"),
]

CASES = {
    # name: (seq_lens, new tokens per request, Hq, Hk, block, sinks, window, softcap, dtype)
    "gqa4-hk8-b16-k3": ([32768, 4000, 17, 4], [4, 4, 4, 4], 32, 8, 16, False, None, None, torch.bfloat16),
    "gqa4-hk8-b16-k7": ([32768, 9000, 8, 100], [8, 8, 8, 8], 32, 8, 16, False, None, None, torch.bfloat16),
    "gqa4-hk8-ragged": ([5000, 1, 63, 64, 65, 129, 2, 3000], [1, 1, 16, 2, 7, 3, 2, 0], 32, 8, 64, False, None,
                        None, torch.bfloat16),
    "gqa1-hk4-b16-sinks": ([1, 15, 16, 17, 300], [1, 15, 3, 16, 9], 4, 4, 16, True, None, None, torch.float16),
    "gqa3-hk2-b32-window-softcap": ([5000, 31, 33, 2], [5, 16, 1, 2], 6, 2, 32, False, 1000, 30.0,
                                    torch.bfloat16),
    "gqa5-hk1-b128-sinks-window": ([4000, 129, 127], [6, 13, 2], 5, 1, 128, True, 128, None, torch.float16),
    "gqa8-hk2-b64-softcap-sinks": ([3000, 2047, 64, 1], [16, 4, 11, 1], 16, 2, 64, True, None, 50.0,
                                   torch.bfloat16),
    "gqa16-hk1-b16-batch32": ([(i * 977) % 2048 + 16 for i in range(32)], [1 + i % 16 for i in range(32)], 16, 1,
                              16, True, 500, None, torch.bfloat16),
    "gqa16-hk8-b32-long": ([131072, 700], [3, 16], 128, 8, 32, False, None, None, torch.float16),
    "gqa2-hk8-b16-window16": ([3000, 40], [8, 16], 16, 8, 16, True, 16, None, torch.bfloat16),
    # more requests than the schedule reads per chunk (256)
    "gqa4-hk8-b16-300-requests": ([(i * 389) % 1500 + 4 for i in range(300)], [1 + i % 4 for i in range(300)], 32,
                                  8, 16, False, None, None, torch.bfloat16),
}


def _step(lens, news, hq, hk, d, bs, sinks, dtype, seed):
    """A head-major cache of ``lens`` tokens, queries for ``news`` new tokens per request, the rebased
    query_start_loc and sinks."""
    prob = make_paged(lens, hk, d, bs, seed=seed, dtype=torch.bfloat16, device="cuda", head_major=True)
    gen = torch.Generator().manual_seed(seed)
    n = sum(news)
    query = (torch.randn(n, hq, d, generator=gen) * 2).to(dtype).cuda()
    qsl = torch.tensor([0] + list(torch.tensor(news).cumsum(0).tolist()), dtype=torch.int32, device="cuda")
    sk = (torch.randn(hq, generator=gen) * 2).cuda() if sinks else None
    return prob, query, qsl, sk


@pytest.mark.parametrize("name", list(CASES))
def test_spec_decode(name):
    lens, news, hq, hk, bs, sinks, window, softcap, dtype = CASES[name]
    d = 128
    prob, query, qsl, sk = _step(lens, news, hq, hk, d, bs, sinks, dtype, seed=len(name))
    scale = d ** -0.5
    mq = max(news)
    assert uq.ops.spec_decode_takes_kernel(query, prob.kv_cache, mq)
    plan = plans.plan_spec_decode(query, prob.kv_cache, prob.block_table, prob.seq_lens, qsl, mq, scale, sk, window,
                                  softcap, torch.empty_like(query))
    assert plan.spec.kernel == "uq_decode_multiquery", plan.spec.key()
    out = torch.full_like(query, float("nan"))
    uq.spec_decode_attention(query, prob.kv_cache, prob.block_table, prob.seq_lens, qsl, scale, max_query_len=mq,
                             sinks=sk, sliding_window=window, softcap=softcap, out=out)
    torch.cuda.synchronize()
    assert int(uq.check_errors()) == 0
    ref = R.spec_decode_attention(query.float(), prob.kv_cache, prob.block_table, prob.seq_lens, qsl, scale,
                                  max_query_len=mq, sinks=sk, sliding_window=window, softcap=softcap)
    check_close(out, ref, name)
    # the same step as the reference's prefill with the cache's own rows of the new tokens
    ks, vs = R.dequant_kv(prob.kv_cache, prob.block_table, prob.seq_lens)
    kk = torch.cat([k[len(k) - m:] for k, m in zip(ks, news, strict=True)])
    vv = torch.cat([v[len(v) - m:] for v, m in zip(vs, news, strict=True)])
    pre = R.prefill_attention(query.float(), kk, vv, prob.kv_cache, prob.block_table, prob.seq_lens, qsl, scale,
                              sinks=sk, sliding_window=window, softcap=softcap)
    check_close(out, pre, f"{name} vs prefill_attention")


@pytest.mark.parametrize("name", ["gqa4-hk8-b16-k7", "gqa4-hk8-ragged", "gqa3-hk2-b32-window-softcap",
                                  "gqa5-hk1-b128-sinks-window", "gqa16-hk1-b16-batch32"])
def test_spec_decode_one_tile_programs(name, monkeypatch):
    """Steps of two or more M tiles, on programs of one tile each (the plan picks two per program there):
    the one-tile kernel against the reference on ragged rows, windows, sinks, soft cap."""
    from ultraquant.kernels.families import decode_multiquery as fam

    monkeypatch.setattr(fam, "multiquery_program_tiles", lambda gqa, max_tokens: 1)
    lens, news, hq, hk, bs, sinks, window, softcap, dtype = CASES[name]
    prob, query, qsl, sk = _step(lens, news, hq, hk, 128, bs, sinks, dtype, seed=len(name))
    mq = max(news)
    plan = plans.plan_spec_decode(query, prob.kv_cache, prob.block_table, prob.seq_lens, qsl, mq, 128 ** -0.5, sk,
                                  window, softcap, torch.empty_like(query))
    assert plan.spec.constexprs["TILES"] == 1 and plan.grid[0] == fam.multiquery_tiles(hq // hk, mq) > 1
    out = torch.full_like(query, float("nan"))
    uq.spec_decode_attention(query, prob.kv_cache, prob.block_table, prob.seq_lens, qsl, 128 ** -0.5,
                             max_query_len=mq, sinks=sk, sliding_window=window, softcap=softcap, out=out)
    torch.cuda.synchronize()
    assert int(uq.check_errors()) == 0
    ref = R.spec_decode_attention(query.float(), prob.kv_cache, prob.block_table, prob.seq_lens, qsl, 128 ** -0.5,
                                  max_query_len=mq, sinks=sk, sliding_window=window, softcap=softcap)
    check_close(out, ref, f"{name} one tile per program")


def test_spec_decode_d256_keeps_prefill():
    prob, query, qsl, _ = _step([300, 40], [4, 4], 8, 2, 256, 16, False, torch.bfloat16, seed=3)
    assert not uq.ops.spec_decode_takes_kernel(query, prob.kv_cache, 4)


def test_spec_decode_graph_replay():
    """Captured once at the largest count (8 tokens), replayed with other per-request counts and lengths."""
    capacity = [4000, 4000, 2500, 4000]
    hq, hk, d, bs, mq = 32, 8, 128, 16, 8
    prob = make_paged(capacity, hk, d, bs, seed=7, dtype=torch.bfloat16, device="cuda", head_major=True)
    gen = torch.Generator().manual_seed(7)
    query = (torch.randn(4 * mq, hq, d, generator=gen) * 2).to(torch.bfloat16).cuda()
    out = torch.full_like(query, float("nan"))
    seq_lens = torch.tensor(capacity, dtype=torch.int32, device="cuda")
    qsl = torch.arange(0, 4 * mq + 1, mq, dtype=torch.int32, device="cuda")
    scale = d ** -0.5

    def step():
        uq.spec_decode_attention(query, prob.kv_cache, prob.block_table, seq_lens, qsl, scale, max_query_len=mq,
                                 out=out)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        step()
    for news, lens in (([8, 8, 8, 8], [4000, 100, 2500, 9]), ([1, 3, 8, 2], [17, 3999, 8, 33]),
                       ([2, 2, 2, 2], [2, 2, 2, 2]), ([8, 0, 5, 4], [2048, 2049, 31, 4000])):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        q = torch.tensor([0] + torch.tensor(news).cumsum(0).tolist(), dtype=torch.int32)
        qsl.copy_(q)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        n = int(q[-1])
        ref = R.spec_decode_attention(query[:n].float(), prob.kv_cache, prob.block_table, seq_lens, qsl, scale,
                                      max_query_len=mq)
        check_close(out[:n], ref, f"replay {news} {lens}")
