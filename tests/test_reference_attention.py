"""decode_attention / prefill_attention equal an independent float64 softmax attention computed
over the dequantized cache, head by head, with GQA, sinks, sliding window and soft cap."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import make_paged
from ultraquant import reference as R


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: int, scale: float,
                    sink: float | None, window: int | None, softcap: float | None) -> torch.Tensor:
    """One query vector (D,) over keys/values (L, D) at positions 0..L-1, float64, plain loops."""
    logits, vecs = [], []
    for j in range(k.shape[0]):
        if j > q_pos or (window is not None and j <= q_pos - window):
            continue
        s = scale * float(q.double() @ k[j].double())
        if softcap is not None:
            s = softcap * math.tanh(s / softcap)
        logits.append(s)
        vecs.append(v[j].double())
    if sink is not None:
        logits.append(sink)
    if not logits:
        return torch.zeros(q.shape[0], dtype=torch.float64)
    m = max(logits)
    w = [math.exp(s - m) for s in logits]
    total = sum(w)
    out = torch.zeros(q.shape[0], dtype=torch.float64)
    for wi, vec in zip(w, vecs, strict=False):  # the sink weight has no value vector
        out += wi / total * vec
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


CASES = [  # (Hq, Hk, D, block_size, seq_lens, sinks, window, softcap)
    (2, 2, 32, 4, [1, 3, 5, 9], False, None, None),
    (8, 2, 64, 16, [15, 17, 1], True, None, None),
    (6, 1, 32, 8, [7, 9, 30], False, 5, None),
    (16, 2, 32, 8, [8, 2, 25], True, 6, 20.0),
    (16, 1, 64, 16, [33], False, None, 5.0),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"gqa{c[0] // c[1]}-d{c[2]}-bs{c[3]}")
def test_decode_matches_naive(case: tuple) -> None:
    hq, hk, d, bs, lens, use_sinks, window, softcap = case
    p = make_paged(lens, hk, d, bs, seed=hq * d + bs)
    gen = torch.Generator().manual_seed(7)
    query = torch.randn(len(lens), hq, d, generator=gen)
    sinks = torch.randn(hq, generator=gen) if use_sinks else None
    scale = d**-0.5
    out = torch.full_like(query, float("nan"))
    got = R.decode_attention(query, p.kv_cache, p.block_table, p.seq_lens, scale, sinks=sinks,
                             sliding_window=window, softcap=softcap, out=out)
    assert got is out
    keys, values = R.dequant_kv(p.kv_cache, p.block_table, p.seq_lens)
    g = hq // hk
    expected = torch.stack([
        torch.stack([naive_attention(query[b, h], keys[b][:, h // g], values[b][:, h // g], n - 1, scale,
                                     None if sinks is None else float(sinks[h]), window, softcap)
                     for h in range(hq)])
        for b, n in enumerate(lens)])
    assert rel_err(out, expected) < 1e-5


def test_decode_zero_length_gives_zeros_and_sink_only_gives_zeros() -> None:
    p = make_paged([0, 4], 1, 32, 4)
    q = torch.randn(2, 2, 32)
    out = R.decode_attention(q, p.kv_cache, p.block_table, p.seq_lens, 0.1, sinks=torch.zeros(2))
    assert torch.equal(out[0], torch.zeros(2, 32)) and out[1].abs().sum() > 0


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"gqa{c[0] // c[1]}-d{c[2]}-bs{c[3]}")
def test_prefill_matches_naive(case: tuple) -> None:
    """Each request's last ``q_len`` tokens are a new chunk: prefix from the cache, chunk raw."""
    hq, hk, d, bs, lens, use_sinks, window, softcap = case
    p = make_paged(lens, hk, d, bs, seed=hq + d + bs)
    q_lens = [min(n, 1 + (3 * i) % 7) for i, n in enumerate(lens)]
    q_lens[0] = lens[0]  # a first chunk (empty prefix)
    gen = torch.Generator().manual_seed(11)
    n_tok = sum(q_lens)
    query = torch.randn(n_tok, hq, d, generator=gen)
    key = torch.cat([p.keys[i][n - q:] for i, (n, q) in enumerate(zip(lens, q_lens, strict=True))])
    value = torch.cat([p.values[i][n - q:] for i, (n, q) in enumerate(zip(lens, q_lens, strict=True))])
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    sinks = torch.randn(hq, generator=gen) if use_sinks else None
    scale = 0.3 / d**0.5
    out = R.prefill_attention(query, key, value, p.kv_cache, p.block_table, p.seq_lens, qsl, scale,
                              sinks=sinks, sliding_window=window, softcap=softcap)
    keys, values = R.dequant_kv(p.kv_cache, p.block_table, p.seq_lens)
    g = hq // hk
    rows = []
    for i, (n, q) in enumerate(zip(lens, q_lens, strict=True)):
        k_all = torch.cat([keys[i][: n - q].double(), p.keys[i][n - q:].double()])
        v_all = torch.cat([values[i][: n - q].double(), p.values[i][n - q:].double()])
        for t in range(q):
            rows.append(torch.stack([
                naive_attention(query[int(qsl[i]) + t, h], k_all[:, h // g], v_all[:, h // g], n - q + t,
                                scale, None if sinks is None else float(sinks[h]), window, softcap)
                for h in range(hq)]))
    assert rel_err(out, torch.stack(rows)) < 1e-5


def test_decode_equals_last_row_of_prefill_over_cache() -> None:
    """A decode step is a prefill chunk of one token whose K/V came from the cache itself."""
    p = make_paged([6, 11], 2, 32, 4, seed=3)
    q = torch.randn(2, 4, 32)
    dec = R.decode_attention(q, p.kv_cache, p.block_table, p.seq_lens, 0.2)
    keys, values = R.dequant_kv(p.kv_cache, p.block_table, p.seq_lens)
    k_last = torch.stack([keys[0][-1], keys[1][-1]])
    v_last = torch.stack([values[0][-1], values[1][-1]])
    pre = R.prefill_attention(q, k_last, v_last, p.kv_cache, p.block_table, p.seq_lens,
                              torch.tensor([0, 1, 2], dtype=torch.int32), 0.2)
    assert rel_err(pre, dec) < 1e-6


def test_blocks_before_the_window_are_never_read() -> None:
    """vLLM may point blocks that lie wholly before the window at a null block with arbitrary bytes."""
    bs, window = 4, 5
    p = make_paged([21], 1, 32, bs, seed=5)
    q = torch.randn(1, 2, 32)
    clean = R.decode_attention(q, p.kv_cache, p.block_table, p.seq_lens, 0.2, sliding_window=window)
    dirty = p.kv_cache.clone()
    dirty[p.block_table[0, :3].long()] = 0xFF  # positions 0..11; the window starts at 16
    got = R.decode_attention(q, dirty, p.block_table, p.seq_lens, 0.2, sliding_window=window)
    assert torch.isfinite(got).all() and torch.equal(got, clean)
    key, value = torch.randn(2, 1, 32), torch.randn(2, 1, 32)
    qsl = torch.tensor([0, 2], dtype=torch.int32)
    pre_clean = R.prefill_attention(q.repeat(2, 1, 1), key, value, p.kv_cache, p.block_table, p.seq_lens,
                                    qsl, 0.2, sliding_window=window)
    pre_dirty = R.prefill_attention(q.repeat(2, 1, 1), key, value, dirty, p.block_table, p.seq_lens,
                                    qsl, 0.2, sliding_window=window)
    assert torch.isfinite(pre_dirty).all() and torch.equal(pre_dirty, pre_clean)
