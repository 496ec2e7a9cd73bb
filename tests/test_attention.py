"""UltraQuantAttention and AttentionMetadata: argument checks, the host prefill plan, the threshold
lookup, the no-host-read decode path, and equivalence of the planned and unplanned prefill paths."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import layer_batch
from ultraquant import UltraQuantError, ops, reference
from ultraquant.attention import (
    AttentionMetadata,
    UltraQuantAttention,
    continuation_threshold,
    prefill_runs,
)
from ultraquant.format import SERVING_ENCODER, slot_size

HQ, HK, D, BS = 4, 2, 64, 4


@pytest.mark.parametrize(("kwargs", "name"), [
    (dict(num_heads=3), "Hq=3"),
    (dict(num_kv_heads=0), "num_kv_heads"),
    (dict(head_size=48), "head_size"),
    (dict(scale=0.0), "scale"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(softcap=-1.0), "softcap"),
    (dict(encoder="nearest"), "encoder"),
    (dict(continuation_threshold=0), "continuation_threshold"),
    (dict(sinks=torch.zeros(3)), "sinks"),
    (dict(sinks=torch.zeros(4, dtype=torch.int32)), "sinks"),
])
def test_constructor_rejects_bad_arguments(kwargs: dict, name: str) -> None:
    args = dict(num_heads=HQ, num_kv_heads=HK, head_size=D, scale=0.125) | kwargs
    with pytest.raises(UltraQuantError, match=name):
        UltraQuantAttention(**args)


def test_metadata_build() -> None:
    md = AttentionMetadata.build(query_lens=[1, 1, 3, 1], seq_lens=[5, 2, 3, 4],
                                 block_table=[[3, 1], [0], [2], [4]], slot_mapping=list(range(6)),
                                 num_padding_tokens=2)
    assert md.num_decodes == 2  # a one-token request after a prefill is not a decode row
    assert md.num_actual_tokens == 6 and md.slot_mapping.tolist() == [0, 1, 2, 3, 4, 5, -1, -1]
    assert md.query_start_loc.tolist() == [0, 1, 2, 5, 6]
    assert md.block_table.tolist() == [[3, 1], [0, 0], [2, 0], [4, 0]]
    assert (md.max_query_len, md.max_seq_len, md.num_reqs) == (3, 5, 4)
    with pytest.raises(UltraQuantError, match="query_lens"):
        AttentionMetadata.build(query_lens=[2], seq_lens=[1], block_table=[[0]], slot_mapping=[0, 1])
    with pytest.raises(UltraQuantError, match="slot_mapping"):
        AttentionMetadata.build(query_lens=[2], seq_lens=[2], block_table=[[0]], slot_mapping=[0])


def test_prefill_runs_groups_runs_of_one_kind() -> None:
    # requests: decode | first(4) first(2) | small(2) small(3) | large(5) large(6) | empty | first(1)
    q_lens = [1, 4, 2, 2, 3, 5, 6, 0, 1]
    seq = [9, 4, 2, 7, 10, 20, 6 + 8, 3, 1]
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    runs = prefill_runs(qsl, torch.tensor(seq, dtype=torch.int32), 1, threshold=3)
    assert [(r.kind, r.req_start, r.req_end, r.tok_start, r.tok_end) for r in runs] == [
        ("first", 1, 3, 1, 7), ("small", 3, 5, 7, 12), ("large", 5, 6, 12, 17), ("large", 6, 7, 17, 23),
        ("first", 8, 9, 23, 24)]


def test_threshold_follows_the_kernels_constant(monkeypatch: pytest.MonkeyPatch) -> None:
    from ultraquant.kernels import heuristics

    assert continuation_threshold() == heuristics.CONTINUATION_THRESHOLD
    monkeypatch.setattr(heuristics, "CONTINUATION_THRESHOLD", 7)
    assert continuation_threshold() == 7
    assert UltraQuantAttention(HQ, HK, D, 0.1).threshold == 7
    assert UltraQuantAttention(HQ, HK, D, 0.1, continuation_threshold=2).threshold == 2


def _batch(seed: int = 0, dtype: torch.dtype = torch.float32, q_lens=(1, 1, 5, 2, 6), seq=(6, 2, 5, 9, 11)):
    """A mixed batch over a cache holding every request's prefix; returns everything a forward needs."""
    return layer_batch(q_lens, seq, num_heads=HQ, num_kv_heads=HK, head_size=D, block_size=BS, num_blocks=24,
                       seed=seed, dtype=dtype)


def test_planned_and_unplanned_prefill_agree_with_the_ops() -> None:
    md, query, key, value, cache = _batch()
    sinks = torch.randn(HQ)
    opts = dict(sinks=sinks, sliding_window=4, softcap=5.0)
    planned = UltraQuantAttention(HQ, HK, D, 0.2, continuation_threshold=3, **opts)
    c1 = cache.clone()
    out1 = planned.forward(query, key, value, c1, md)
    assert dict(planned.route_counts) == {"store": 1, "decode": 1, "first": 1, "small": 1, "large": 1}
    unplanned = UltraQuantAttention(HQ, HK, D, 0.2, **opts)
    md2 = AttentionMetadata(**{**md.__dict__, "query_start_loc_cpu": None, "seq_lens_cpu": None})
    c2 = cache.clone()
    out2 = unplanned.forward(query, key, value, c2, md2)
    assert dict(unplanned.route_counts) == {"store": 1, "decode": 1, "prefill": 1}
    assert torch.equal(c1, c2)
    torch.testing.assert_close(out1, out2, atol=1e-6, rtol=1e-6)
    # And both equal the ops called directly.
    expect = torch.empty_like(query)
    expect[:2] = reference.decode_attention(query[:2], c1, md.block_table[:2], md.seq_lens[:2], 0.2, **opts)
    qsl = md.query_start_loc[2:] - 2
    expect[2:] = reference.prefill_attention(query[2:], key[2:], value[2:], c1, md.block_table[2:],
                                             md.seq_lens[2:], qsl, 0.2, **opts)
    torch.testing.assert_close(out1, expect, atol=1e-6, rtol=1e-6)


def test_out_layouts_padding_and_no_tokens() -> None:
    md, query, key, value, cache = _batch(q_lens=(1, 3), seq=(4, 3))
    layer = UltraQuantAttention(HQ, HK, D, 0.2)
    pad = torch.randn(2, HQ, D)
    q = torch.cat([query, pad]).reshape(6, HQ * D)
    k = torch.cat([key, torch.randn(2, HK, D)]).reshape(6, HK * D)
    v = torch.cat([value, torch.randn(2, HK, D)]).reshape(6, HK * D)
    out = torch.full((6, HQ * D), 7.0, dtype=torch.bfloat16)
    assert layer.forward(q, k, v, cache.clone(), md, out) is out
    assert (out[4:] == 7.0).all()
    ref = layer.forward(query, key, value, cache.clone(), md)
    torch.testing.assert_close(out[:4].view(4, HQ, D), ref.to(torch.bfloat16))
    empty = AttentionMetadata.build(query_lens=[], seq_lens=[], block_table=[], slot_mapping=[])
    before = cache.clone()
    out = torch.full((2, HQ, D), 3.0)
    layer.forward(pad, torch.randn(2, HK, D), torch.randn(2, HK, D), cache, empty, out)
    assert torch.equal(cache, before) and (out == 3.0).all()
    with pytest.raises(UltraQuantError, match="out"):
        layer.forward(query, key, value, cache, md, torch.empty(4, HQ, D // 2))
    with pytest.raises(UltraQuantError, match="num_actual_tokens"):
        layer.forward(query[:2], key[:2], value[:2], cache, md)
    with pytest.raises(UltraQuantError, match="key/value"):
        layer.forward(query, None, None, cache, md)


def test_decode_path_reads_nothing_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode-only forward (what a CUDA graph captures) makes no host read of a tensor value."""
    md, query, key, value, cache = _batch(q_lens=(1, 1, 1), seq=(3, 7, 1))
    md.query_start_loc_cpu = md.seq_lens_cpu = None
    calls = []
    monkeypatch.setattr(ops, "store_kv", lambda *a, **k: calls.append("store"))
    monkeypatch.setattr(ops, "decode_attention", lambda *a, **k: calls.append(("decode", k["out"].shape)))
    monkeypatch.setattr(ops, "prefill_attention", lambda *a, **k: calls.append("prefill"))
    layer = UltraQuantAttention(HQ, HK, D, 0.2, sinks=torch.zeros(HQ, dtype=torch.bfloat16))
    layer.setup("cpu", max_num_reqs=8)
    out = torch.empty(3, HQ, D)

    def boom(*_a, **_k):
        raise AssertionError("host read of a tensor value on the decode path")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    layer.forward(query, key, value, cache, md, out)
    monkeypatch.undo()
    assert calls == ["store", ("decode", (3, HQ, D))]
    assert layer.sinks.dtype == torch.float32


def test_store_and_setup() -> None:
    layer = UltraQuantAttention(HQ, HK, D, 0.2, sinks=torch.ones(HQ, dtype=torch.float16))
    layer.setup("cpu", max_num_reqs=4)
    assert layer.sinks.dtype == torch.float32 and layer._qsl_ws.shape[0] == 5
    ws = layer._qsl_ws
    layer.setup("cpu", max_num_reqs=2)  # never shrinks or reallocates
    assert layer._qsl_ws is ws
    layer.reset()
    assert layer.sinks is None
    cache = torch.zeros(4, BS, HK, slot_size(D), dtype=torch.uint8)
    k, v = torch.randn(3, HK * D), torch.randn(3, HK * D)
    layer.store(k, v, cache, torch.tensor([5, -1, 0]))
    expect = torch.zeros_like(cache)
    assert layer.encoder == SERVING_ENCODER == "mse"  # the layer stores with the most accurate encoder
    reference.store_kv(k.view(3, HK, D), v.view(3, HK, D), expect, torch.tensor([5, -1, 0]), encoder="mse")
    assert torch.equal(cache, expect) and cache[1, 1].any() and not cache[0, 1:].any()


def test_warmup_decode_sizes_every_batch_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def fake_decode(q, cache, table, lens, scale, **kw):
        assert not lens.any() and kw["out"].shape == q.shape and kw["sinks"].dtype == torch.float32
        calls.append((q.shape[0], table.shape[1]))

    monkeypatch.setattr(ops, "decode_attention", fake_decode)
    layer = UltraQuantAttention(HQ, HK, D, 0.2, sinks=torch.zeros(HQ))
    cache = torch.zeros(8, BS, HK, slot_size(D), dtype=torch.uint8)
    assert layer.warmup_decode(cache, max_num_reqs=4, max_seq_len=10, dtype=torch.float32) == 0  # CPU
    assert layer.warmup_decode(cache, max_num_reqs=4, max_seq_len=10, dtype=torch.float32, skip_cpu=False) == 4
    assert calls == [(4, 6), (3, 6), (2, 6), (1, 6)]  # largest first; width 2 * ceil(10 / 4)
    again = UltraQuantAttention(HQ, HK, D, 0.3, sinks=torch.ones(HQ))  # same shapes: already covered
    assert again.warmup_decode(cache, max_num_reqs=4, max_seq_len=10, dtype=torch.float32, skip_cpu=False) == 0
    assert layer.warmup_decode(cache, max_num_reqs=5, max_seq_len=10, dtype=torch.float32, skip_cpu=False) == 5
