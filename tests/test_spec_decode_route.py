"""The attention layer's speculative-decoding routes on the CPU: which op serves a step, and what it computes.

``ops.spec_decode_takes_kernel`` is False on the CPU (the accuracy path keeps every route and its
numerics); patched True, the layer must send small continuations and speculative-decoding decodes
(``decode_query_len`` > 1) to ``spec_decode_attention`` (there the reference: new tokens' K/V read
back from the cache), with the right token and request offsets.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import layer_batch
from ultraquant import UltraQuantError, ops
from ultraquant import reference as R
from ultraquant.attention import AttentionMetadata, UltraQuantAttention

HQ, HK, D, BS = 8, 2, 128, 16


def _batch(q_lens, seq_lens, decode_query_len=1, seed=0):
    md, query, key, value, cache = layer_batch(q_lens, seq_lens, num_heads=HQ, num_kv_heads=HK, head_size=D,
                                               block_size=BS, num_blocks=40, seed=seed)
    if decode_query_len > 1:
        md = AttentionMetadata.build(query_lens=q_lens, seq_lens=seq_lens, block_table=md.block_table,
                                     slot_mapping=md.slot_mapping, decode_query_len=decode_query_len)
    return md, query, key, value, cache


def _want_spec(layer, md, query, cache, req0, req1, tok0, tok1):
    """The reference of requests req0..req1-1 as one spec-decoding step (after the layer stored them)."""
    qsl = md.query_start_loc[req0:req1 + 1] - tok0
    return R.spec_decode_attention(query[tok0:tok1], cache, md.block_table[req0:req1], md.seq_lens[req0:req1],
                                   qsl.to(torch.int32), layer.scale, max_query_len=16)


@pytest.fixture
def kernel_on(monkeypatch):
    monkeypatch.setattr(ops, "spec_decode_takes_kernel", lambda q, c, m: m <= 16)


def test_cpu_routes_are_unchanged():
    """Without a multi-query kernel (the CPU) small continuations stay on prefill_attention (raw K/V)."""
    md, query, key, value, cache = _batch([1, 4, 3], [50, 60, 30])
    layer = UltraQuantAttention(HQ, HK, D, D ** -0.5)
    out = layer(query, key, value, cache, md)
    assert layer.prefill_routes == {"small:kernel": 1}
    qsl = (md.query_start_loc[1:] - 1).to(torch.int32)
    want = R.prefill_attention(query[1:], key[1:], value[1:], cache, md.block_table[1:], md.seq_lens[1:], qsl,
                               layer.scale)
    assert torch.allclose(out[1:], want, atol=1e-5)


def test_small_continuations_take_the_multiquery_decode(kernel_on):
    md, query, key, value, cache = _batch([1, 4, 3, 2], [50, 60, 30, 2])  # the last: a first chunk
    layer = UltraQuantAttention(HQ, HK, D, D ** -0.5)
    out = layer(query, key, value, cache, md)
    assert layer.prefill_routes["small:multiquery"] == 1
    assert layer.prefill_routes["first:sdpa"] == 1
    want = _want_spec(layer, md, query, cache, 1, 3, 1, 8)
    assert torch.allclose(out[1:8], want, atol=1e-5)
    # the cache's rows of the new tokens differ from their raw K/V: the route is not the prefill kernel's
    raw = R.prefill_attention(query[1:8], key[1:8], value[1:8], cache, md.block_table[1:3], md.seq_lens[1:3],
                              torch.tensor([0, 4, 7], dtype=torch.int32), layer.scale)
    assert not torch.allclose(out[1:8], raw, atol=1e-5)


def test_large_continuations_keep_their_route(kernel_on):
    md, query, key, value, cache = _batch([20], [100])
    layer = UltraQuantAttention(HQ, HK, D, D ** -0.5)
    layer(query, key, value, cache, md)
    assert "small:multiquery" not in layer.prefill_routes and layer.route_counts["large"] == 1


@pytest.mark.parametrize("kernel", [True, False])
def test_spec_decode_decodes(monkeypatch, kernel):
    """decode_query_len 4: requests of 1..4 new tokens are decodes (one launch), a longer chunk after them
    stays a prefill run at the right token offset. ``kernel`` False: a GPU without the multi-query decode
    (the step falls back to the prefill kernel on its raw K/V)."""
    monkeypatch.setattr(ops, "spec_decode_takes_kernel", lambda q, c, m: kernel)
    monkeypatch.setattr(ops, "spec_decode_served", lambda q, c, m: kernel)
    md, query, key, value, cache = _batch([4, 1, 3, 2, 9], [70, 33, 16, 40, 60], decode_query_len=4)
    assert (md.num_decodes, md.num_decode_tokens) == (4, 10)
    layer = UltraQuantAttention(HQ, HK, D, D ** -0.5)
    out = layer(query, key, value, cache, md)
    assert layer.route_counts["spec_decode"] == 1 and "decode" not in layer.route_counts
    assert layer.prefill_routes[f"spec_decode:{'multiquery' if kernel else 'kernel'}"] == 1
    assert layer.route_counts["small"] == 1  # the 9-token chunk
    assert layer.prefill_routes[f"small:{'multiquery' if kernel else 'kernel'}"] == 1
    if kernel:
        want = _want_spec(layer, md, query, cache, 0, 4, 0, 10)
    else:
        want = R.prefill_attention(query[:10], key[:10], value[:10], cache, md.block_table[:4], md.seq_lens[:4],
                                   md.query_start_loc[:5], layer.scale)
    assert torch.allclose(out[:10], want, atol=1e-5)
    qsl = torch.tensor([0, 9], dtype=torch.int32)
    if kernel:  # a small continuation too: the multi-query decode
        tail = _want_spec(layer, md, query, cache, 4, 5, 10, 19)
    else:
        tail = R.prefill_attention(query[10:], key[10:], value[10:], cache, md.block_table[4:], md.seq_lens[4:],
                                   qsl, layer.scale)
    assert torch.allclose(out[10:], tail, atol=1e-5)


def test_cpu_spec_decode_decodes_read_the_cache():
    """On the CPU the decodes of a speculative-decoding step go to the reference spec-decode (their own
    K/V read back from the cache, as a decode reads its token), not to the prefill fallback."""
    md, query, key, value, cache = _batch([2, 1, 3], [40, 33, 16], decode_query_len=3)
    layer = UltraQuantAttention(HQ, HK, D, D ** -0.5)
    out = layer(query, key, value, cache, md)
    assert layer.prefill_routes == {"spec_decode:reference": 1}
    assert torch.allclose(out, _want_spec(layer, md, query, cache, 0, 3, 0, 6), atol=1e-5)
    one = AttentionMetadata.build(query_lens=[1], seq_lens=[33], block_table=md.block_table[1:2],
                                  slot_mapping=md.slot_mapping[2:3])
    dec = UltraQuantAttention(HQ, HK, D, D ** -0.5)(query[2:3], key[2:3], value[2:3], cache, one, store=False)
    assert torch.allclose(out[2:3], dec, atol=1e-5)  # a 1-token request: exactly the decode's result


def test_build_decode_query_len():
    md = AttentionMetadata.build(query_lens=[2, 1, 3, 5], seq_lens=[10, 10, 10, 10], block_table=[[0]] * 4,
                                 slot_mapping=list(range(11)), decode_query_len=3)
    assert (md.num_decodes, md.num_decode_tokens, md.decode_query_len) == (3, 6, 3)
    md1 = AttentionMetadata.build(query_lens=[2, 1], seq_lens=[10, 10], block_table=[[0]] * 2,
                                  slot_mapping=list(range(3)))
    assert (md1.num_decodes, md1.num_decode_tokens) == (0, 0)
    with pytest.raises(UltraQuantError, match="decode_query_len"):
        AttentionMetadata.build(query_lens=[1], seq_lens=[1], block_table=[[0]], slot_mapping=[0],
                                decode_query_len=0)
