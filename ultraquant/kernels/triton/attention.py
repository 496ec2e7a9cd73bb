"""Triton attention kernels over the UltraQuant paged cache (imports triton).

* :func:`uq_decode_splitkv`: one new query token per request. Program (request, kv head, split) serves all
  query heads of its kv head (each KV byte is read once), rotates the query in registers, streams its
  share of the sequence in TILE-token tiles (FP4 -> fp16 decode with the scales kept outside the
  elements, ``tl.dot`` for QK and PV, online softmax in the log2 domain), then either writes the
  output (one split) or an fp32 partial; the last split to finish (atomic ticket) merges the partials
  and the sinks and writes ``out``: one launch, fixed grid, no host sync.
* :func:`uq_prefill`: varlen chunks of new tokens. Program (query tile, kv head) attends to the
  cached prefix (rotated query vs the cache) and causally to the chunk's own raw K/V.

Both honour sinks (an extra logit per query head), sliding windows and soft caps.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import block_ids, blocks_inside, clamp_length, fwht, pow2_f32, row_capacity, scale_f32


@triton.jit
def _tanh(x):
    """tanh from exp2 (portable: no libdevice)."""
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * 1.4426950408889634)) + 1.0)


@triton.jit
def _online_softmax(s, m_i, l_i, toks, tmask, qpos, window, softcap, HAS_WINDOW: tl.constexpr,
                    HAS_SOFTCAP: tl.constexpr):
    """One online-softmax step on scores ``s [R, T]`` (log2 domain, pre-scaled): soft cap, masks
    (causal against ``qpos``, window, ``tmask``) to -inf, new running max and sum.

    Returns ``(p, alpha, m_new, l_new)``: the tile's probabilities relative to ``m_new`` and the factor
    that rescales the old state. Rows that have seen nothing keep m = -inf and p = 0.
    """
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
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _softmax_step(acc, m_i, l_i, q, q_lo, kt, v, toks, tmask, qpos, window, softcap,
                  HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """One step over raw keys ``kt [D, T]`` (transposed) and values ``v [T, D]`` (bf16).

    ``q [R, D]`` (+ ``q_lo``: bf16 hi + lo) is pre-scaled by scale*log2(e), or by scale alone when a
    soft cap follows.
    """
    s = tl.dot(q, kt)
    s = tl.dot(q_lo, kt, s)
    p, alpha, m_new, l_i = _online_softmax(s, m_i, l_i, toks, tmask, qpos, window, softcap, HAS_WINDOW,
                                           HAS_SOFTCAP)
    acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), v)
    return acc, m_new, l_i


def _nibble_pair(out: str, src: str, mag_shift: int, sign_shift: int) -> str:
    """PTX: two fp16 subnormal patterns into ``out`` from the nibbles of the two bytes in ``src``'s
    16-bit lanes: magnitude bits shifted to 11..9, the sign bit to 15."""
    return (f"shl.b32 a, {src}, {mag_shift}; shl.b32 c, {src}, {sign_shift}; and.b32 a, a, 0x0E000E00; "
            f"and.b32 c, c, 0x80008000; or.b32 {out}, a, c;")


_NIBBLES_FP16_ASM = tl.constexpr(" ".join([
    "{ .reg .b32 x, y, a, c;",
    "prmt.b32 x, $4, 0, 0x4140;",  # bytes 0 and 1 of the input word into the two 16-bit lanes
    "prmt.b32 y, $4, 0, 0x4342;",  # bytes 2 and 3
    _nibble_pair("$0", "x", 9, 12),  # low nibbles (even elements) of bytes 0, 1
    _nibble_pair("$1", "y", 9, 12),  # ... of bytes 2, 3
    _nibble_pair("$2", "x", 5, 8),  # high nibbles (odd elements) of bytes 0, 1
    _nibble_pair("$3", "y", 5, 8),  # ... of bytes 2, 3
    "}",
]))
"""The PTX of :func:`_nibbles_fp16_ptx` (outputs $0..$3, input word $4)."""


@triton.jit
def _nibbles_fp16_ptx(b, PURE: tl.constexpr = True):
    """NVIDIA: (low, high) nibbles of uint8 ``b`` as fp16 subnormal patterns, 4 bytes per register.

    PRMT spreads two bytes into the two 16-bit lanes of a word, then two shifts and two masked ORs
    build two fp16 values at once (magnitude bits to 11..9, sign to 15): about 2 instructions per
    element where the portable integer code needs ~5 (a byte extract, shifts and a lane pack each).
    ``PURE=False`` pins the decode to the layout the bytes were loaded in: for V (whose MMA operand
    pairs tokens, not bytes) Triton then moves decoded fp16 through shared memory instead of gathering
    single bytes. On the H200 that is faster at D=256 and slower at D=128 (benchmarks/NOTES.md, split-KV decode sweeps),
    although it issues fewer instructions at both; the plans choose per head
    size (constexpr ``V_IN_LOAD_LAYOUT``).
    """
    return tl.inline_asm_elementwise(
        asm=_NIBBLES_FP16_ASM,
        constraints="=r,=r,=r,=r,r",
        args=[b],
        dtype=(tl.float16, tl.float16),
        is_pure=PURE,
        pack=4,
    )


@triton.jit
def _floor_log2(x):
    """floor(log2(x)) of positive normal float32 ``x`` from its exponent bits (-127 for 0)."""
    return ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127


@triton.jit
def _load_fp16_codes(base, tmask, T: tl.constexpr, D: tl.constexpr, FP4_PTX: tl.constexpr,
                     PURE: tl.constexpr = True):
    """One tensor (K or V) of T cached tokens as fp16 halves and a per-token power of two (``PURE``:
    see :func:`_nibbles_fp16_ptx`).

    Returns ``(even, odd, top)``: ``even``/``odd`` are ``[T, D/2]`` fp16 holding elements 0, 2, 4...
    and 1, 3, 5... (low and high nibbles: no interleave), and element d of token t equals
    ``half[t, d//2] * 2**(top[t] - 127)`` with ``top`` the token's largest scale byte. Each code becomes
    fp16 through its subnormal bit pattern (``fp4 * 2**-14``), then one fp16 multiply by
    ``2**(scale - top + 14)``, exact unless a group's scale is 2**-28 below its token's largest (then
    it flushes to zero: far below bf16 resolution of that token). Masked tokens read as zeros.
    """
    G: tl.constexpr = D // 32
    b = tl.load(base[:, None] + tl.arange(0, D // 2)[None, :], mask=tmask[:, None], other=0)
    if FP4_PTX:
        lo, hi = _nibbles_fp16_ptx(b, PURE)
    else:
        b = b.to(tl.int16)
        lo = (((b & 7) << 9) | ((b & 8) << 12)).to(tl.float16, bitcast=True)
        hi = (((b & 0x70) << 5) | ((b & 0x80) << 8)).to(tl.float16, bitcast=True)
    sb = tl.load(base[:, None] + (D // 2 + tl.arange(0, G))[None, :], mask=tmask[:, None], other=0).to(tl.int32)
    top = tl.max(sb, axis=1)
    field = tl.maximum(sb - top[:, None] + 29, 0)
    rel = (field << 10).to(tl.int16).to(tl.float16, bitcast=True)
    rel = tl.reshape(tl.broadcast_to(rel[:, :, None], [T, G, 16]), [T, D // 2])
    return lo * rel, hi * rel, top


@triton.jit
def _attend_paged(acc_e, acc_o, vtop_run, m_i, l_i, q_e, q_o, rowfac, qpos, rmask, cache_ptr, bt_row_ptr, head_off,
                  t_lo, t_hi, window, softcap, stride_cb, stride_ct, num_blocks, err_ptr, D: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, HAS_WINDOW: tl.constexpr,
                  HAS_SOFTCAP: tl.constexpr, ALIGN: tl.constexpr, FP4_PTX: tl.constexpr,
                  V_IN_LOAD_LAYOUT: tl.constexpr):
    """Attend to cached tokens ``[t_lo, t_hi)`` of one request and kv head (rotated space).

    Query: fp16 even/odd halves times ``rowfac`` (:func:`_paged_query`); scores are two fp16 MMAs
    (even and odd elements, no nibble interleave) rescaled per token by its K power of two. Values:
    probabilities times each token's V power of two relative to a running reference exponent
    ``vtop_run``, as fp16, two MMAs into ``acc_e``/``acc_o`` (even/odd output elements) kept in units
    of ``2**(vtop_run - 127)``. Per element the FP4 decode is a few bit operations and half an fp16x2
    multiply. ``rmask`` marks real query rows (padding rows must not steer the reference exponent).
    ALIGN (from the host: gcd of 16 and the cache strides) lets the compiler vectorize slot loads.

    Bounds: one pass over the range's block ids first (one id per entry, not per token); when all
    are inside the cache the tile loop runs without checks, else a copy of it that reads a block id
    outside [0, num_blocks) as an empty block (its tokens masked out, nothing read).
    """
    if blocks_inside(bt_row_ptr, t_lo, t_hi, num_blocks, err_ptr, BLOCK_SIZE):
        acc_e, acc_o, vtop_run, m_i, l_i = _attend_tiles(
            acc_e, acc_o, vtop_run, m_i, l_i, q_e, q_o, rowfac, qpos, rmask, cache_ptr, bt_row_ptr, head_off,
            t_lo, t_hi, window, softcap, stride_cb, stride_ct, num_blocks, D, BLOCK_SIZE, TILE, HAS_WINDOW,
            HAS_SOFTCAP, ALIGN, FP4_PTX, V_IN_LOAD_LAYOUT, False)
    else:
        acc_e, acc_o, vtop_run, m_i, l_i = _attend_tiles(
            acc_e, acc_o, vtop_run, m_i, l_i, q_e, q_o, rowfac, qpos, rmask, cache_ptr, bt_row_ptr, head_off,
            t_lo, t_hi, window, softcap, stride_cb, stride_ct, num_blocks, D, BLOCK_SIZE, TILE, HAS_WINDOW,
            HAS_SOFTCAP, ALIGN, FP4_PTX, V_IN_LOAD_LAYOUT, True)
    return acc_e, acc_o, vtop_run, m_i, l_i


@triton.jit
def _attend_tiles(acc_e, acc_o, vtop_run, m_i, l_i, q_e, q_o, rowfac, qpos, rmask, cache_ptr, bt_row_ptr, head_off,
                  t_lo, t_hi, window, softcap, stride_cb, stride_ct, num_blocks, D: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, HAS_WINDOW: tl.constexpr,
                  HAS_SOFTCAP: tl.constexpr, ALIGN: tl.constexpr, FP4_PTX: tl.constexpr,
                  V_IN_LOAD_LAYOUT: tl.constexpr, CHECKED: tl.constexpr):
    """The tile loop of :func:`_attend_paged`. ``CHECKED``: a token of a block id outside the cache
    reads nothing and carries its emptiness in its K power of two (-1: no scale byte is negative) and
    a V power of two far below any real one (out of the reference exponent, probability flushed), so
    the masks of the score layout need no extra layout conversion."""
    for t0 in range(t_lo, t_hi, TILE):
        toks = t0 + tl.arange(0, TILE)
        inside = toks < t_hi
        blk, live = block_ids(bt_row_ptr, toks, inside, num_blocks, BLOCK_SIZE, CHECKED)
        off = blk.to(tl.int64) * stride_cb + (toks % BLOCK_SIZE).to(tl.int64) * stride_ct + head_off
        base = cache_ptr + tl.multiple_of(off, ALIGN)
        k_e, k_o, ktop = _load_fp16_codes(base, live, TILE, D, FP4_PTX)
        tmask = inside
        if CHECKED:
            ktop = tl.where(live, ktop, -1)
            tmask = inside & (ktop >= 0)
        s = tl.dot(q_e, tl.trans(k_e))
        s = tl.dot(q_o, tl.trans(k_o), s)
        s = s * rowfac[:, None] * scale_f32(ktop)[None, :]
        p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i, toks, tmask, qpos, window, softcap, HAS_WINDOW,
                                             HAS_SOFTCAP)
        v_e, v_o, vtop = _load_fp16_codes(base + (D // 2 + D // 32), live, TILE, D, FP4_PTX, not V_IN_LOAD_LAYOUT)
        if CHECKED:
            vtop = tl.where(live, vtop, -2000)
        # New reference exponent: the largest contribution (p times the token's V power of two) of
        # this tile, or the old one shrunk by the rows' largest alpha, whichever is bigger. Then every
        # fp16 probability stays below 2 and anything flushed is 2**-24 below the largest term.
        pmax = tl.max(tl.where(rmask[:, None], p, 0.0), axis=0)
        ctop = tl.where(inside, vtop + _floor_log2(pmax), -1000)
        shrink = _floor_log2(tl.max(tl.where(rmask, alpha, 0.0), axis=0))
        run = tl.maximum(vtop_run + shrink, tl.max(ctop, axis=0))
        c = alpha * pow2_f32(tl.minimum(vtop_run - run, 127))
        pv = (p * pow2_f32(tl.minimum(vtop - run, 127))[None, :]).to(tl.float16)
        acc_e = tl.dot(pv, v_e, acc_e * c[:, None])
        acc_o = tl.dot(pv, v_o, acc_o * c[:, None])
        vtop_run = run
    return acc_e, acc_o, vtop_run, m_i, l_i


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
    denom = tl.where(l_i > 0.0, l_i, 1.0)
    o = tl.where((l_i > 0.0)[:, None], acc / denom[:, None], 0.0)
    cols = tl.arange(0, D)
    tl.store(out_rows_ptr[:, None] + cols[None, :], o.to(out_rows_ptr.dtype.element_ty), mask=rmask[:, None])


@triton.jit
def _prescale(q, scale, HAS_SOFTCAP: tl.constexpr):
    """Query times the softmax scale, and times log2(e) unless a soft cap (which works on natural
    logits) converts the scores to the log2 domain itself."""
    if HAS_SOFTCAP:
        return q * scale
    return q * (scale * 1.4426950408889634)


@triton.jit
def _scale_query(q, scale, HAS_SOFTCAP: tl.constexpr):
    """float32 query rows -> two bf16 MMA operands (hi + lo), pre-scaled, for raw (bf16) keys.

    Why two: a bf16 query alone costs about 0.5% relative error in the output (measured against the
    float64 reference); hi + lo carries 16 significant bits for one more MMA per tile.
    """
    q = _prescale(q, scale, HAS_SOFTCAP)
    q_hi = q.to(tl.bfloat16)
    return q_hi, (q - q_hi.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _paged_query(q, scale, R: tl.constexpr, D: tl.constexpr, LOG2D: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """float32 query rows -> the cache-side operands of :func:`_attend_paged`: rotated, pre-scaled,
    split into even/odd elements as fp16 times a per-row power of two ``rowfac`` (each row's largest
    magnitude lands in [2**14, 2**15): fp16 keeps 11 significant bits without overflow for any
    finite query, so no unscaled narrow cast can turn a large query into inf/NaN)."""
    q = _prescale(fwht(q, R, D, LOG2D), scale, HAS_SOFTCAP)
    e = tl.maximum(_floor_log2(tl.max(tl.abs(q), axis=1)), -100)
    q = q * pow2_f32(14 - e)[:, None]
    q_e, q_o = tl.split(tl.reshape(q, [R, D // 2, 2]))
    return q_e.to(tl.float16), q_o.to(tl.float16), pow2_f32(e - 14)


@triton.jit
def _paged_state(R: tl.constexpr, D: tl.constexpr):
    """Initial (acc_e, acc_o, vtop_run) of :func:`_attend_paged`."""
    return tl.zeros([R, D // 2], dtype=tl.float32), tl.zeros([R, D // 2], dtype=tl.float32), tl.full([], 0, tl.int32)


@triton.jit
def _paged_acc(acc_e, acc_o, vtop_run, R: tl.constexpr, D: tl.constexpr):
    """The even/odd accumulators of :func:`_attend_paged` as one float32 ``[R, D]`` in true units."""
    return tl.reshape(tl.join(acc_e, acc_o), [R, D]) * pow2_f32(vtop_run - 127)


@triton.jit
def uq_decode_splitkv(q_ptr, cache_ptr, bt_ptr, seqlen_ptr, sinks_ptr, out_ptr, part_ptr, ml_ptr, counter_ptr, err_ptr,
              scale, softcap, window, num_splits, num_blocks, bt_cols,
              stride_qb, stride_qh, stride_ob, stride_oh,
              stride_cb, stride_ct, stride_ch, stride_btb,
              D: tl.constexpr, LOG2D: tl.constexpr, GQA: tl.constexpr, ROWS: tl.constexpr,
              BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, HAS_SINKS: tl.constexpr,
              HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, ALIGN: tl.constexpr, FP4_PTX: tl.constexpr,
              V_IN_LOAD_LAYOUT: tl.constexpr):
    """Split-KV paged decode; grid (B, Hk, num_splits). See the module docstring."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    num_kv = tl.num_programs(1)
    length = clamp_length(tl.load(seqlen_ptr + b), bt_cols, err_ptr, BLOCK_SIZE)
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
    q_e, q_o, rowfac = _paged_query(q, scale, ROWS, D, LOG2D, HAS_SOFTCAP)
    qpos = tl.zeros([ROWS], dtype=tl.int32) + (length - 1)

    acc_e, acc_o, vtop = _paged_state(ROWS, D)
    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc_e, acc_o, vtop, m_i, l_i = _attend_paged(acc_e, acc_o, vtop, m_i, l_i, q_e, q_o, rowfac, qpos, rmask, cache_ptr,
                                                 bt_ptr + b.to(tl.int64) * stride_btb, kvh.to(tl.int64) * stride_ch,
                                                 t_lo, t_hi, window, softcap, stride_cb, stride_ct, num_blocks,
                                                 err_ptr, D, BLOCK_SIZE,
                                                 TILE, HAS_WINDOW, HAS_SOFTCAP, ALIGN, FP4_PTX,
                                                 V_IN_LOAD_LAYOUT)
    acc = _paged_acc(acc_e, acc_o, vtop, ROWS, D)
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
               part_ptr, ml_ptr, counter_ptr, err_ptr,
               scale, softcap, window, num_reqs, num_splits, num_blocks, bt_cols,
               stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_on, stride_oh,
               stride_cb, stride_ct, stride_ch, stride_btb,
               D: tl.constexpr, LOG2D: tl.constexpr, GQA: tl.constexpr, GQA_PAD: tl.constexpr,
               ROWS: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
               HAS_SINKS: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
               ALIGN: tl.constexpr, FP4_PTX: tl.constexpr, V_IN_LOAD_LAYOUT: tl.constexpr):
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
        cap = row_capacity(length, bt_cols, err_ptr, BLOCK_SIZE)
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

        acc_e, acc_o, vtop = _paged_state(ROWS, D)
        m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([ROWS], dtype=tl.float32)
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(pos_first - window + 1, 0)
        per = tl.cdiv(tl.cdiv(tl.maximum(ctx - lo, 0), num_splits), TILE) * TILE
        c_lo = lo + sp * per
        c_hi = tl.minimum(tl.minimum(c_lo + per, ctx), cap)  # the cache is read within the row only
        if c_lo < c_hi:
            q_e, q_o, rowfac = _paged_query(q, scale, ROWS, D, LOG2D, HAS_SOFTCAP)
            acc_e, acc_o, vtop, m_i, l_i = _attend_paged(acc_e, acc_o, vtop, m_i, l_i, q_e, q_o, rowfac, qpos,
                                                         rmask, cache_ptr, bt_ptr + req.to(tl.int64) * stride_btb,
                                                         kvh.to(tl.int64) * stride_ch, c_lo, c_hi, window,
                                                         softcap, stride_cb, stride_ct, num_blocks, err_ptr, D,
                                                         BLOCK_SIZE, TILE,
                                                         HAS_WINDOW, HAS_SOFTCAP, ALIGN, FP4_PTX,
                                                         V_IN_LOAD_LAYOUT)
        acc = _paged_acc(acc_e, acc_o, vtop, ROWS, D)
        if sp == num_splits - 1:
            q_raw, q_raw_lo = _scale_query(q, scale, HAS_SOFTCAP)
            k_base = k_ptr + q_start.to(tl.int64) * stride_kn + kvh * stride_kh
            v_base = v_ptr + q_start.to(tl.int64) * stride_vn + kvh * stride_vh
            acc, m_i, l_i = _attend_raw(acc, m_i, l_i, q_raw, q_raw_lo, qpos, k_base, v_base, stride_kn,
                                        stride_vn, ctx, tl.maximum(lo, ctx), pos_last + 1, window, softcap, D,
                                        TILE, HAS_WINDOW, HAS_SOFTCAP)
        out_rows = out_ptr + tokrow * stride_on + heads * stride_oh
        _store_partial_or_finish(acc, m_i, l_i, rows, cols, heads, rmask, out_rows, sinks_ptr, part_ptr, ml_ptr,
                                 counter_ptr, t * tl.num_programs(1) + kvh, sp, num_splits, ROWS, D, HAS_SINKS)
