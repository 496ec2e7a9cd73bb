"""Triton attention kernels over the UltraQuant paged cache (imports triton).

* :func:`uq_decode`: one new query token per request. Program (request, kv head, split) serves all
  query heads of its kv head (each KV byte is read once), rotates the query in registers, streams its
  share of the sequence in TILE-token tiles (FP4 -> bf16 decode, ``tl.dot`` for QK and PV, online
  softmax in the log2 domain), then either writes the output (one split) or an fp32 partial; the
  last split to finish (atomic ticket) merges the partials and the sinks and writes ``out``: one
  launch, fixed grid, no host sync.
* :func:`uq_prefill`: varlen chunks of new tokens. Program (query tile, kv head) attends to the
  cached prefix (rotated query vs the cache) and causally to the chunk's own raw K/V.

Both honour sinks (an extra logit per query head), sliding windows and soft caps.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from .common import DEQUANT_GATHER, fwht, load_dequant, load_dequant_gather

SHIFT14 = tl.constexpr(not DEQUANT_GATHER)
"""Cached K/V are decoded as value * 2**-14 (see common.load_dequant); the rotated query carries
2**14 and the output 2**14, exactly (powers of two). Raw chunk values get 2**-14 to match."""

QK_SPLIT = tl.constexpr(os.environ.get("ULTRAQUANT_QK_SPLIT", "1") == "1")
"""Tuning knob (set before import): the query as bf16 hi + lo (two QK MMAs, ~0.2% output error) or
one bf16 operand (``ULTRAQUANT_QK_SPLIT=0``: one MMA, ~0.5%)."""


@triton.jit
def _tanh(x):
    """tanh from exp2 (portable: no libdevice)."""
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * 1.4426950408889634)) + 1.0)


@triton.jit
def _softmax_step(acc, m_i, l_i, q, q_lo, kt, v, toks, tmask, qpos, window, softcap,
                  HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """One online-softmax step over a tile of keys ``kt [D, T]`` (transposed) and values ``v [T, D]``.

    ``q [R, D]`` is pre-scaled (by scale*log2(e), or by scale alone when a soft cap follows);
    scores use the log2 domain. Keys after a row's position (causal) or outside its window, and
    masked tokens, get -inf.
    """
    s = tl.dot(q, kt)
    if QK_SPLIT:
        s = tl.dot(q_lo, kt, s)
    if HAS_SOFTCAP:
        s = softcap * _tanh(s / softcap) * 1.4426950408889634
    valid = tmask[None, :] & (toks[None, :] <= qpos[:, None])
    if HAS_WINDOW:
        valid = valid & (toks[None, :] > qpos[:, None] - window)
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), v)
    return acc, m_new, l_i


@triton.jit
def _attend_paged(acc, m_i, l_i, q, q_lo, qpos, cache_ptr, bt_row_ptr, head_off, t_lo, t_hi, window, softcap,
                  stride_cb, stride_ct, D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
                  HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, ALIGN: tl.constexpr):
    """Attend to cached tokens ``[t_lo, t_hi)`` of one request and kv head (rotated space).

    ALIGN (from the host: gcd of 16 and the cache strides) tells the compiler every slot starts on an
    ALIGN-byte boundary, so slot bytes load as vectors through async copies: on sm_90 the D=128 loop
    drops from 1324 to 908 SASS instructions per tile and from 128 to 96 registers.
    """
    for t0 in range(t_lo, t_hi, TILE):
        toks = t0 + tl.arange(0, TILE)
        tmask = toks < t_hi
        blk = tl.load(bt_row_ptr + toks // BLOCK_SIZE, mask=tmask, other=0)
        off = blk.to(tl.int64) * stride_cb + (toks % BLOCK_SIZE).to(tl.int64) * stride_ct + head_off
        base = cache_ptr + tl.multiple_of(off, ALIGN)
        if DEQUANT_GATHER:
            kt = load_dequant_gather(base, base + D // 2, tmask, TILE, D, True).to(tl.bfloat16)
            v = load_dequant_gather(base + (D // 2 + D // 32), base + (D + D // 32), tmask, TILE, D,
                                    False).to(tl.bfloat16)
        else:
            kt = tl.trans(load_dequant(base, base + D // 2, tmask, TILE, D, SHIFT14).to(tl.bfloat16))
            v = load_dequant(base + (D // 2 + D // 32), base + (D + D // 32), tmask, TILE, D,
                             SHIFT14).to(tl.bfloat16)
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, q_lo, kt, v, toks, tmask, qpos, window, softcap,
                                      HAS_WINDOW, HAS_SOFTCAP)
    return acc, m_i, l_i


@triton.jit
def _attend_raw(acc, m_i, l_i, q, q_lo, qpos, k_base, v_base, stride_kn, stride_vn, pos0, t_lo, t_hi,
                window, softcap, D: tl.constexpr, TILE: tl.constexpr,
                HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """Attend to a chunk's own raw K/V at absolute positions ``[t_lo, t_hi)`` (row 0 is ``pos0``)."""
    cols = tl.arange(0, D)
    for t0 in range(t_lo, t_hi, TILE):
        toks = t0 + tl.arange(0, TILE)
        tmask = toks < t_hi
        rel = (toks - pos0).to(tl.int64)
        k = tl.load(k_base + rel[:, None] * stride_kn + cols[None, :], mask=tmask[:, None], other=0.0)
        v = tl.load(v_base + rel[:, None] * stride_vn + cols[None, :], mask=tmask[:, None], other=0.0)
        if SHIFT14:
            v = v.to(tl.float32) * 6.103515625e-05
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, q_lo, tl.trans(k.to(tl.bfloat16)), v.to(tl.bfloat16),
                                      toks, tmask,
                                      qpos, window, softcap, HAS_WINDOW, HAS_SOFTCAP)
    return acc, m_i, l_i


@triton.jit
def _merge(acc, m_i, l_i, acc2, m2, l2):
    """Merge two softmax states (log2 domain); states with m = -inf contribute nothing."""
    m_new = tl.maximum(m_i, m2)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    a1 = tl.exp2(m_i - m_safe)
    a2 = tl.exp2(m2 - m_safe)
    return acc * a1[:, None] + acc2 * a2[:, None], m_new, l_i * a1 + l2 * a2


@triton.jit
def _finish(acc, m_i, l_i, sinks_ptr, heads, rmask, out_rows_ptr, D: tl.constexpr, HAS_SINKS: tl.constexpr):
    """Fold the sinks into the denominator and store ``acc / l`` (zeros where nothing was seen)."""
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + heads, mask=rmask, other=0.0).to(tl.float32) * 1.4426950408889634
        m_new = tl.maximum(m_i, sink)
        l_i = l_i * tl.exp2(m_i - m_new) + tl.exp2(sink - m_new)
        acc = acc * tl.exp2(m_i - m_new)[:, None]
    if SHIFT14:
        denom = tl.where(l_i > 0.0, l_i, 1.0) * 6.103515625e-05
    else:
        denom = tl.where(l_i > 0.0, l_i, 1.0)
    o = tl.where((l_i > 0.0)[:, None], acc / denom[:, None], 0.0)
    cols = tl.arange(0, D)
    tl.store(out_rows_ptr[:, None] + cols[None, :], o.to(out_rows_ptr.dtype.element_ty), mask=rmask[:, None])


@triton.jit
def _scale_query(q, scale, R: tl.constexpr, D: tl.constexpr, LOG2D: tl.constexpr, ROTATE: tl.constexpr,
                 HAS_SOFTCAP: tl.constexpr):
    """float32 query rows -> two bf16 MMA operands (hi + lo): rotated (cache side), pre-scaled.

    Why two: a bf16 query alone costs about 0.5% relative error in the output (measured against the
    float64 reference); hi + lo carries 16 significant bits for one more MMA per tile.
    """
    if ROTATE:
        q = fwht(q, R, D, LOG2D)
        if SHIFT14:
            q = q * 16384.0
    if HAS_SOFTCAP:
        q = q * scale
    else:
        q = q * (scale * 1.4426950408889634)
    q_hi = q.to(tl.bfloat16)
    return q_hi, (q - q_hi.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def uq_decode(q_ptr, cache_ptr, bt_ptr, seqlen_ptr, sinks_ptr, out_ptr, part_ptr, ml_ptr, counter_ptr,
              scale, softcap, window, num_splits,
              stride_qb, stride_qh, stride_ob, stride_oh,
              stride_cb, stride_ct, stride_ch, stride_btb,
              D: tl.constexpr, LOG2D: tl.constexpr, GQA: tl.constexpr, ROWS: tl.constexpr,
              BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, HAS_SINKS: tl.constexpr,
              HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, ALIGN: tl.constexpr):
    """Split-KV paged decode; grid (B, Hk, num_splits). See the module docstring."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    num_kv = tl.num_programs(1)
    length = tl.load(seqlen_ptr + b)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(length - window, 0)
    per = tl.cdiv(tl.cdiv(length - lo, num_splits), TILE) * TILE
    t_lo = lo + sp * per
    t_hi = tl.minimum(t_lo + per, length)

    rows = tl.arange(0, ROWS)
    rmask = rows < GQA
    heads = kvh * GQA + rows
    cols = tl.arange(0, D)
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + cols[None, :],
                mask=rmask[:, None], other=0.0).to(tl.float32)
    q, q_lo = _scale_query(q, scale, ROWS, D, LOG2D, True, HAS_SOFTCAP)
    qpos = tl.zeros([ROWS], dtype=tl.int32) + (length - 1)

    acc = tl.zeros([ROWS, D], dtype=tl.float32)
    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc, m_i, l_i = _attend_paged(acc, m_i, l_i, q, q_lo, qpos, cache_ptr, bt_ptr + b.to(tl.int64) * stride_btb,
                                  kvh.to(tl.int64) * stride_ch, t_lo, t_hi, window, softcap,
                                  stride_cb, stride_ct, D, BLOCK_SIZE, TILE, HAS_WINDOW, HAS_SOFTCAP, ALIGN)
    out_rows = out_ptr + b.to(tl.int64) * stride_ob + heads * stride_oh
    _store_partial_or_finish(acc, m_i, l_i, rows, cols, heads, rmask, out_rows, sinks_ptr, part_ptr, ml_ptr,
                             counter_ptr, b * num_kv + kvh, sp, num_splits, ROWS, D, HAS_SINKS)


@triton.jit
def _store_partial_or_finish(acc, m_i, l_i, rows, cols, heads, rmask, out_rows, sinks_ptr, part_ptr, ml_ptr,
                             counter_ptr, pair, sp, num_splits, ROWS: tl.constexpr, D: tl.constexpr,
                             HAS_SINKS: tl.constexpr):
    """Finish directly (one split) or publish this split's state; the last split merges all."""
    if num_splits == 1:
        _finish(acc, m_i, l_i, sinks_ptr, heads, rmask, out_rows, D, HAS_SINKS)
    else:
        slot = (pair * num_splits + sp).to(tl.int64)
        tl.store(part_ptr + slot * (ROWS * D) + rows[:, None] * D + cols[None, :], acc)
        tl.store(ml_ptr + slot * (2 * ROWS) + rows, m_i)
        tl.store(ml_ptr + slot * (2 * ROWS) + ROWS + rows, l_i)
        tl.debug_barrier()
        ticket = tl.atomic_add(counter_ptr + pair, 1)
        if ticket == num_splits - 1:
            acc = tl.zeros([ROWS, D], dtype=tl.float32)
            m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([ROWS], dtype=tl.float32)
            for s in range(0, num_splits):
                src = (pair * num_splits + s).to(tl.int64)
                acc2 = tl.load(part_ptr + src * (ROWS * D) + rows[:, None] * D + cols[None, :],
                               cache_modifier=".cg")
                m2 = tl.load(ml_ptr + src * (2 * ROWS) + rows, cache_modifier=".cg")
                l2 = tl.load(ml_ptr + src * (2 * ROWS) + ROWS + rows, cache_modifier=".cg")
                acc, m_i, l_i = _merge(acc, m_i, l_i, acc2, m2, l2)
            _finish(acc, m_i, l_i, sinks_ptr, heads, rmask, out_rows, D, HAS_SINKS)
            tl.atomic_xchg(counter_ptr + pair, 0)


@triton.jit
def uq_prefill(q_ptr, k_ptr, v_ptr, cache_ptr, bt_ptr, seqlen_ptr, qsl_ptr, sinks_ptr, out_ptr,
               part_ptr, ml_ptr, counter_ptr,
               scale, softcap, window, num_reqs, num_splits,
               stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_on, stride_oh,
               stride_cb, stride_ct, stride_ch, stride_btb,
               D: tl.constexpr, LOG2D: tl.constexpr, GQA: tl.constexpr, GQA_PAD: tl.constexpr,
               ROWS: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
               HAS_SINKS: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
               ALIGN: tl.constexpr):
    """Varlen chunked prefill; grid (cdiv(N, QT) + B, Hk, num_splits), QT = ROWS // GQA_PAD tokens.

    Program t finds its (request, tile) by scanning query_start_loc (no host-side tile table); the
    rows are (query token, query head of this kv head) pairs. Keys: the cached prefix (rotated query
    vs the cache), split over ``num_splits`` programs for short chunks over long prefixes, then the
    chunk's raw K/V causally (last split). Split states merge like decode's (atomic ticket).
    """
    QT: tl.constexpr = ROWS // GQA_PAD
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    req = -1
    tile = 0
    cum = 0
    for i in range(0, num_reqs):
        n_i = tl.load(qsl_ptr + i + 1) - tl.load(qsl_ptr + i)
        nt = tl.cdiv(n_i, QT)
        hit = (t >= cum) & (t < cum + nt)
        req = tl.where(hit, i, req)
        tile = tl.where(hit, t - cum, tile)
        cum += nt
    if req >= 0:
        q_start = tl.load(qsl_ptr + req)
        q_len = tl.load(qsl_ptr + req + 1) - q_start
        length = tl.load(seqlen_ptr + req)
        ctx = length - q_len
        rows = tl.arange(0, ROWS)
        qi = tile * QT + rows // GQA_PAD
        g = rows % GQA_PAD
        rmask = (g < GQA) & (qi < q_len)
        heads = kvh * GQA + g
        tokrow = (q_start + qi).to(tl.int64)
        cols = tl.arange(0, D)
        q = tl.load(q_ptr + tokrow[:, None] * stride_qn + heads[:, None] * stride_qh + cols[None, :],
                    mask=rmask[:, None], other=0.0).to(tl.float32)
        qpos = ctx + qi
        pos_first = ctx + tile * QT
        pos_last = tl.minimum(ctx + tile * QT + QT, length) - 1

        acc = tl.zeros([ROWS, D], dtype=tl.float32)
        m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([ROWS], dtype=tl.float32)
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(pos_first - window + 1, 0)
        per = tl.cdiv(tl.cdiv(tl.maximum(ctx - lo, 0), num_splits), TILE) * TILE
        c_lo = lo + sp * per
        c_hi = tl.minimum(c_lo + per, ctx)
        if c_lo < c_hi:
            q_rot, q_rot_lo = _scale_query(q, scale, ROWS, D, LOG2D, True, HAS_SOFTCAP)
            acc, m_i, l_i = _attend_paged(acc, m_i, l_i, q_rot, q_rot_lo, qpos, cache_ptr,
                                          bt_ptr + req.to(tl.int64) * stride_btb, kvh.to(tl.int64) * stride_ch,
                                          c_lo, c_hi, window, softcap, stride_cb, stride_ct, D, BLOCK_SIZE,
                                          TILE, HAS_WINDOW, HAS_SOFTCAP, ALIGN)
        if sp == num_splits - 1:
            q_raw, q_raw_lo = _scale_query(q, scale, ROWS, D, LOG2D, False, HAS_SOFTCAP)
            k_base = k_ptr + q_start.to(tl.int64) * stride_kn + kvh * stride_kh
            v_base = v_ptr + q_start.to(tl.int64) * stride_vn + kvh * stride_vh
            acc, m_i, l_i = _attend_raw(acc, m_i, l_i, q_raw, q_raw_lo, qpos, k_base, v_base, stride_kn,
                                        stride_vn, ctx, tl.maximum(lo, ctx), pos_last + 1, window, softcap, D,
                                        TILE, HAS_WINDOW, HAS_SOFTCAP)
        out_rows = out_ptr + tokrow * stride_on + heads * stride_oh
        _store_partial_or_finish(acc, m_i, l_i, rows, cols, heads, rmask, out_rows, sinks_ptr, part_ptr, ml_ptr,
                                 counter_ptr, t * tl.num_programs(1) + kvh, sp, num_splits, ROWS, D, HAS_SINKS)
