"""The multi-query decode: a speculative-decoding step (2-16 new tokens per request) over the 4-bit cache,
on the whole-page structure, for NVIDIA sm_90, in Gluon.

A step verifies ``n`` drafted tokens per request: ``n`` query tokens at the end of the request's
sequence, their own K/V already in the cache (stored by the step's store before attention, as vLLM
does and as the decode does for its one token). The query rows of one kv head are the ``n x GQA``
(token, head) pairs in token-major order (row ``r``: token ``r // GQA``, query head ``r % GQA`` of the
kv head); a program serves one 16-row M tile of them (``tile``) for ALL kv heads of a token range of
one request, grid ``(tiles, B, splits)``, and reads the pages exactly as the whole-page decode does:
a ``cp.async`` ring of whole 16-token runs (:func:`~.decode_wholepage._issue_stage`), FP4 decoded by
inline PTX into ``mma_v2`` operands (the 16-M-row path of :func:`~.decode_wholepage._run_scores` and
:func:`~.decode_wholepage._run_pv`). Tiles of one (request, split) are neighbours in launch order, so
the second tile of an 8-token GQA-4 step finds its pages in L2.

What differs from the decode: each row's own causal limit (row ``r`` sees cached tokens
``< seq_len - n + r // GQA + 1``; with a window, also ``>= limit - window``), each request's own
count ``n = qsl[b + 1] - qsl[b]`` read on the device (ragged 0..``max_tokens``; rows past ``n`` are
empty, a tile past them reads nothing), queries and outputs addressed by token rows like the prefill
kernel, and the partials / merge ticket per (tile, request).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from .decode_wholepage import (
    ERR_SEQ_LEN,
    LOG2E,
    _blocks_inside,
    _floor_log2,
    _fwht_rows,
    _iota3,
    _issue_stage,
    _merge_step,
    _partial_rows,
    _physical_token,
    _piece,
    _pow2,
    _run_pv,
    _run_scores,
    _slot_layout,
    _token_top,
    _v_layout,
)

MQ_ROWS = gl.constexpr(16)
"""Query rows per M tile: (token, head) pairs of one kv head, token-major."""


@gluon.jit
def _row_limits(tile, length, n_new, window, GQA: gl.constexpr, ROWS: gl.constexpr, HAS_WINDOW: gl.constexpr,
                L: gl.constexpr):
    """Per row of M tile ``tile`` (layout ``L``, ``[ROWS]``): whether it is a real (token, head) pair
    of the request's ``n_new`` tokens, its causal limit (cached tokens ``< lim``) and its first
    visible token (0 without a window)."""
    flat = tile * ROWS + gl.arange(0, ROWS, L)
    tok = flat // GQA
    valid = tok < n_new
    lim = gl.where(valid, length - n_new + tok + 1, 0)
    first = lim * 0
    if HAS_WINDOW:
        first = gl.maximum(lim - window, 0)
    return valid, lim, first


@gluon.jit
def uq_decode_multiquery(q_ptr, cache_ptr, bt_ptr, seqlen_ptr, qsl_ptr, sinks_ptr, out_ptr, part_ptr, ml_ptr,
                         counter_ptr, err_ptr, scale, softcap, window, max_tokens, num_splits, num_blocks, bt_cols,
                         stride_qn, stride_qh, stride_on, stride_oh,
                         stride_cb, stride_ct, stride_ch, stride_btb,
                         D: gl.constexpr, LOG2D: gl.constexpr, GQA: gl.constexpr, HK: gl.constexpr,
                         WT: gl.constexpr, NSUB: gl.constexpr, STAGES: gl.constexpr, TW: gl.constexpr,
                         BLOCK_SIZE: gl.constexpr, HAS_SINKS: gl.constexpr, HAS_WINDOW: gl.constexpr,
                         HAS_SOFTCAP: gl.constexpr):
    """Multi-query whole-page decode, grid ``(tiles, B, num_splits)``; see the module docstring."""
    gl.static_assert(D == 128, "the multi-query decode: D=128 (the 16-M-row path)")
    gl.static_assert(TW == 16, "the multi-query decode: 16-token runs per warp")
    NW: gl.constexpr = gl.num_warps()
    gl.static_assert(NW == HK * WT, "the multi-query decode: num_warps must be HK * WT")
    ROWS: gl.constexpr = MQ_ROWS
    H: gl.constexpr = D // 2
    G: gl.constexpr = D // 32
    TT: gl.constexpr = NSUB * WT * TW
    MERGE: gl.constexpr = _merge_step(HK * ROWS * D // (32 * NW), HK)

    # ---- layouts (the whole-page decode's 16-M-row path): warp = MMA batch
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1, 1],
                                                  instr_shape=[1, 16, 8])
    QA: gl.constexpr = gl.DotOperandLayout(0, MMA, 8)   # q halves [NW, ROWS, H]
    KB: gl.constexpr = gl.DotOperandLayout(1, MMA, 8)   # K halves [NW, H, TW]
    PA: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)   # probabilities [NW, ROWS, TW]
    VB: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)   # V halves [NW, TW, H]
    QR: gl.constexpr = gl.SliceLayout(2, MMA)           # [NW, ROWS]
    QW: gl.constexpr = gl.SliceLayout(1, QR)            # [NW]
    TK: gl.constexpr = gl.SliceLayout(1, MMA)           # [NW, TW] score columns
    VL: gl.constexpr = _v_layout(NW, TW)
    VLW: gl.constexpr = _v_layout(NW, TW, True)
    QL: gl.constexpr = gl.BlockedLayout([1, 1, D], [1, 32, 1], [NW, 1, 1], [2, 1, 0])
    # ---- the ring, as the whole-page decode's (STAGES x NR runs of 16 whole 136-byte slots)
    NR: gl.constexpr = NSUB * NW
    SLOT: gl.constexpr = 2 * (H + G)
    RINT: gl.constexpr = 8 * H
    RING: gl.constexpr = gl.PaddedSharedLayout.with_identity_for([[RINT, 4 * SLOT - RINT]], [NR, RINT], [1, 0])
    FLAT: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    ring = gl.allocate_shared_memory(gl.int32, [STAGES * NR * (SLOT * 4)], FLAT)._reinterpret(
        gl.int32, [STAGES, NR, RINT], RING)
    PB: gl.constexpr = _slot_layout(2 * H, SLOT - 2 * H, [NW, TW, 2, H])
    PV: gl.constexpr = _slot_layout(2 * H, SLOT - 2 * H, [NW, TW, 2, H // 8, 8])
    SW2: gl.constexpr = 32
    PWD: gl.constexpr = _slot_layout(SW2, SLOT // 4 - SW2, [NW, TW, 2, SW2 // 2])
    E: gl.constexpr = STAGES * NSUB
    RUNB: gl.constexpr = 4096
    bytes8 = ring._reinterpret(gl.uint8, [STAGES * NR * RUNB], FLAT)
    words = ring._reinterpret(gl.int32, [STAGES * NR * RUNB // 4], FLAT)
    kc8 = ring._reinterpret(gl.uint8, [E, NW, TW, 2, H], PB)
    vc8 = bytes8.slice(H + G, 4)._reinterpret(gl.uint8, [E, NW, TW, 2, H // 8, 8], PV)
    ks = words.slice(H // 4, H // 4)._reinterpret(gl.int32, [E, NW, TW, 2, SW2 // 2], PWD)
    vs = words.slice((SLOT - G) // 4, 1)._reinterpret(gl.int32, [E, NW, TW, 2, SW2 // 2], PWD)
    KW: gl.constexpr = gl.SliceLayout(1, KB)            # [NW, TW] K scale words
    VW: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, VL))  # [NW, TW] V scale words

    tile = gl.program_id(0)
    b = gl.program_id(1)
    sp = gl.program_id(2)
    length = gl.load(seqlen_ptr + b)
    cap = bt_cols * BLOCK_SIZE
    q_start = gl.load(qsl_ptr + b)
    n_new = gl.load(qsl_ptr + b + 1) - q_start
    # bounds: a length outside [0, capacity] or a count outside [0, min(length, max_tokens)] is clamped,
    # error word set (the count bound: the grid's tiles cover max_tokens tokens)
    length_bad = (length < 0) | (length > cap)
    length = gl.minimum(gl.maximum(length, 0), cap)
    count_bad = (n_new < 0) | (n_new > length) | (n_new > max_tokens)
    gl.store(err_ptr + ERR_SEQ_LEN, 1, mask=length_bad | count_bad)
    n_new = gl.minimum(gl.maximum(n_new, 0), gl.minimum(length, max_tokens))
    # the tile's token range: up to its last real row's limit, from its first row's window start
    tok_first = (tile * ROWS) // GQA
    tok_last = gl.minimum((tile * ROWS + ROWS - 1) // GQA, n_new - 1)
    hi = gl.where(tok_first < n_new, length - n_new + tok_last + 1, 0)
    lo = 0
    if HAS_WINDOW:
        lo = gl.maximum(length - n_new + tok_first + 1 - window, 0)
        lo = gl.minimum(lo, hi)
    lo_run = (lo // TT) * TT
    per = gl.cdiv(gl.cdiv(hi - lo_run, num_splits), TT) * TT
    t_lo = lo_run + sp * per
    t_hi = gl.minimum(t_lo + per, hi)
    n_it = gl.cdiv(gl.maximum(t_hi - t_lo, 0), TT)
    bt_row = bt_ptr + b.to(gl.int64) * stride_btb

    # ---- the query rows (token r // GQA, head h GQA + r % GQA), before the ring copies queue up
    qr3 = _iota3(ROWS, 1, QL)
    qc3 = _iota3(D, 2, QL)
    qh3 = _iota3(NW, 0, QL) // WT
    qflat = tile * ROWS + qr3
    qtok = qflat // GQA
    qoff = (q_start + qtok).to(gl.int64) * stride_qn + (qh3 * GQA + qflat % GQA) * stride_qh + qc3
    q_in = gl.load(q_ptr + qoff, mask=(qtok < n_new) & (qc3 < D), other=0.0)
    inside = _blocks_inside(bt_row, t_lo, t_hi, num_blocks, err_ptr, BLOCK_SIZE, NW)

    for i in gl.static_range(STAGES - 1):
        _issue_stage(ring, i, cache_ptr, bt_row, t_lo + i * TT, t_hi, stride_cb, stride_ch, inside, num_blocks,
                     NSUB, NW, WT, SLOT, BLOCK_SIZE)
        async_copy.commit_group()

    # ---- query: rotate, scale, fp16 halves times a per-row power of two, once
    q = _fwht_rows(q_in.to(gl.float32), NW, ROWS, D, LOG2D)
    if HAS_SOFTCAP:
        q = q * scale
    else:
        q = q * (scale * LOG2E)
    e = gl.maximum(_floor_log2(gl.max(gl.abs(q), axis=2)), -100)
    q = q * gl.expand_dims(_pow2(14 - e), 2)
    q_e, q_o = gl.split(gl.reshape(q, [NW, ROWS, H, 2]))
    q_e = gl.convert_layout(q_e.to(gl.float16), QA)
    q_o = gl.convert_layout(q_o.to(gl.float16), QA)
    rowfac = gl.convert_layout(_pow2(e - 14), QR)
    valid, lim, first = _row_limits(tile, length, n_new, window, GQA, ROWS, HAS_WINDOW, gl.SliceLayout(0, QR))
    rowbias = gl.expand_dims(gl.where(valid, 0.0, float("-inf")), 0)
    lim3 = gl.expand_dims(gl.expand_dims(lim, 0), 2)
    first3 = gl.expand_dims(gl.expand_dims(first, 0), 2)

    ws = gl.expand_dims(gl.arange(0, NW, gl.SliceLayout(1, TK)) % WT, 1) * TW
    ns = gl.expand_dims(_physical_token(gl.arange(0, TW, gl.SliceLayout(0, TK))), 0)
    kgroup = _iota3(H, 1, KB) // 16
    SV: gl.constexpr = gl.SliceLayout(3, VL)
    gv = gl.expand_dims(gl.expand_dims(gl.arange(0, 8, gl.SliceLayout(0, gl.SliceLayout(1, SV))), 0), 1)
    R3: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, VL)))
    rv = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.arange(0, 8, R3), 0), 1), 2)
    vgroup = gl.expand_dims(gv // 2, 3) + rv * 0

    acc_e = gl.zeros([NW, ROWS, H], gl.float32, MMA)
    acc_o = gl.zeros([NW, ROWS, H], gl.float32, MMA)
    m_i = gl.full([NW, ROWS], float("-inf"), gl.float32, QR)
    l_i = gl.zeros([NW, ROWS], gl.float32, QR)
    run = gl.full([NW], -254, gl.int32, QW)
    for it in range(n_it):
        async_copy.wait_group(STAGES - 2)
        gl.thread_barrier()
        nxt = (it + STAGES - 1) % STAGES
        _issue_stage(ring, nxt, cache_ptr, bt_row, t_lo + (it + STAGES - 1) * TT, t_hi, stride_cb, stride_ch,
                     inside, num_blocks, NSUB, NW, WT, SLOT, BLOCK_SIZE)
        async_copy.commit_group()
        cur = (it % STAGES) * NSUB
        t0 = t_lo + it * TT
        # scores of the stage's NSUB runs, each row under its own causal limit, then ONE online-softmax
        # update for all of them
        ss = ()
        for i in gl.static_range(NSUB):
            kw = _piece(ks.index(cur + i), [NW, TW], KW, KW)
            ts = t0 + i * (WT * TW) + ws + ns
            s = _run_scores(0, 0, 0, 0, kc8.index(cur + i), kw, kw, 0, 0, 0, 0, 0, 0, 0, 0, q_e, q_o,
                            kgroup, rowfac, rowbias, ts, t_hi, lo, inside, bt_row, num_blocks, softcap, D, NW, TW,
                            ROWS, H, False, HAS_SOFTCAP, HAS_WINDOW, BLOCK_SIZE, MMA, KB, TK, 1, 2)
            ts3 = gl.expand_dims(ts, 1)
            seen = ts3 < lim3
            if HAS_WINDOW:
                seen = seen & (ts3 >= first3)
            ss = ss + (gl.where(seen, s, float("-inf")),)
        smax = ss[0]
        for i in gl.static_range(1, NSUB):
            smax = gl.maximum(smax, ss[i])
        m_new = gl.maximum(m_i, gl.max(smax, axis=2))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        ps = ()
        for i in gl.static_range(NSUB):
            ps = ps + (gl.exp2(ss[i] - gl.expand_dims(m_safe, 2)),)
        psum = ps[0]
        for i in gl.static_range(1, NSUB):
            psum = psum + ps[i]
        l_i = l_i * alpha + gl.sum(psum, axis=2)
        m_i = m_new

        # V: scale word per token, reference exponent from the largest contribution of the runs
        vws = ()
        vtops = ()
        vexps = ()
        for i in gl.static_range(NSUB):
            vw = gl.expand_dims(_piece(vs.index(cur + i), [NW, TW], VW, VW), 2)
            vtop = _token_top(vw)
            vexps = vexps + (gl.convert_layout(gl.max(vtop, axis=2), TK) - 127,)
            vws = vws + (vw,)
            vtops = vtops + (vtop,)
        cmax = ps[0] * gl.expand_dims(_pow2(gl.minimum(vexps[0], 127)), 1)
        for i in gl.static_range(1, NSUB):
            cmax = gl.maximum(cmax, ps[i] * gl.expand_dims(_pow2(gl.minimum(vexps[i], 127)), 1))
        ctop = _floor_log2(gl.max(gl.max(cmax, axis=2), axis=1))
        shrink = _floor_log2(gl.max(alpha, axis=1))
        new_run = gl.maximum(run + shrink, ctop)
        c = gl.expand_dims(alpha * gl.expand_dims(_pow2(gl.minimum(run - new_run, 127)), 1), 2)
        nr = gl.expand_dims(gl.convert_layout(new_run, gl.SliceLayout(1, TK)), 1)
        acc_e = acc_e * c
        acc_o = acc_o * c
        for i in gl.static_range(NSUB):
            acc_e, acc_o = _run_pv(acc_e, acc_o, vc8.index(cur + i), vws[i], vtops[i], vexps[i], ps[i], nr,
                                   vgroup, NW, TW, H, False, VL, VLW, VB, VB, PA, PA, 1)
        run = new_run
    async_copy.wait_group(0)

    pair0 = (b * gl.num_programs(0) + tile) * HK
    # ---- the program's partial of each kv head (its WT token groups combined) to the workspace
    f = gl.expand_dims(gl.expand_dims(_pow2(gl.minimum(run, 127)), 1), 2)
    EP: gl.constexpr = gl.BlockedLayout([1, WT, 1, 4], [1, 1, 1, 32], [HK, 1, WT, 1], [3, 1, 2, 0])
    E3: gl.constexpr = gl.SliceLayout(3, EP)
    x4 = gl.convert_layout(gl.reshape(_partial_rows((acc_e * f, acc_o * f), 2, NW, ROWS, D, False),
                                      [HK, WT, ROWS, D]), EP)
    m4 = gl.convert_layout(gl.reshape(m_i, [HK, WT, ROWS]), E3)
    l4 = gl.convert_layout(gl.reshape(l_i, [HK, WT, ROWS]), E3)
    m_c = gl.max(m4, axis=1)
    m_z = gl.where(m_c == float("-inf"), 0.0, m_c)
    sc = gl.exp2(m4 - gl.expand_dims(m_z, 1))
    acc_c = gl.sum(x4 * gl.expand_dims(sc, 3), axis=1)
    l_c = gl.sum(l4 * sc, axis=1)
    P3: gl.constexpr = gl.SliceLayout(1, EP)
    P2: gl.constexpr = gl.SliceLayout(1, E3)
    ph = _iota3(HK, 0, P3)
    pr = _iota3(ROWS, 1, P3)
    pc = _iota3(D, 2, P3)
    pslot = (((pair0 + ph) * num_splits + sp) * WT).to(gl.int64)
    gl.store(part_ptr + pslot * (ROWS * D) + pr * D + pc, acc_c, mask=(pr >= 0) & (pc >= 0) & (ph >= 0))
    ph2 = gl.expand_dims(gl.arange(0, HK, gl.SliceLayout(1, P2)), 1)
    pr2 = gl.expand_dims(gl.arange(0, ROWS, gl.SliceLayout(0, P2)), 0)
    mlp = ml_ptr + (((pair0 + ph2) * num_splits + sp) * WT).to(gl.int64) * (2 * ROWS) + pr2
    mlmask = (pr2 >= 0) & (ph2 >= 0)
    gl.store(mlp, m_c, mask=mlmask)
    gl.store(mlp + ROWS, l_c, mask=mlmask)
    gl.thread_barrier()
    ticket = gl.atomic_add(counter_ptr + pair0, 1)
    if ticket == num_splits - 1:
        # ---- last program of this (tile, request): merge every head's partials, fold the sinks
        ML: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 1, 32], [HK, 1, NW // HK], [2, 1, 0])
        M2: gl.constexpr = gl.SliceLayout(2, ML)
        mh = _iota3(HK, 0, ML)
        mr = _iota3(ROWS, 1, ML)
        mc = _iota3(D, 2, ML)
        mh2 = gl.expand_dims(gl.arange(0, HK, gl.SliceLayout(1, M2)), 1)
        mr2 = gl.expand_dims(gl.arange(0, ROWS, gl.SliceLayout(0, M2)), 0)
        acc = gl.zeros([HK, ROWS, D], gl.float32, ML)
        m_a = gl.full([HK, ROWS], float("-inf"), gl.float32, M2)
        l_a = gl.zeros([HK, ROWS], gl.float32, M2)
        for s0 in range(0, num_splits, MERGE):
            accs2 = ()
            ms2 = ()
            ls2 = ()
            for k in gl.static_range(MERGE):
                s = s0 + k
                src3 = (((pair0 + mh) * num_splits + s) * WT).to(gl.int64)
                src2 = (((pair0 + mh2) * num_splits + s) * WT).to(gl.int64)
                live3 = (s < num_splits) & (mr >= 0) & (mc >= 0) & (mh >= 0)
                live2 = (s < num_splits) & (mr2 >= 0) & (mh2 >= 0)
                accs2 = accs2 + (gl.load(part_ptr + src3 * (ROWS * D) + mr * D + mc, mask=live3, other=0.0,
                                         cache_modifier=".cg"),)
                ms2 = ms2 + (gl.load(ml_ptr + src2 * (2 * ROWS) + mr2, mask=live2, other=float("-inf"),
                                     cache_modifier=".cg"),)
                ls2 = ls2 + (gl.load(ml_ptr + src2 * (2 * ROWS) + ROWS + mr2, mask=live2, other=0.0,
                                     cache_modifier=".cg"),)
            m_n = m_a
            for k in gl.static_range(MERGE):
                m_n = gl.maximum(m_n, ms2[k])
            m_s = gl.where(m_n == float("-inf"), 0.0, m_n)
            a1 = gl.exp2(m_a - m_s)
            acc = acc * gl.expand_dims(a1, 2)
            l_a = l_a * a1
            for k in gl.static_range(MERGE):
                a2 = gl.exp2(ms2[k] - m_s)
                acc = acc + accs2[k] * gl.expand_dims(a2, 2)
                l_a = l_a + ls2[k] * a2
            m_a = m_n
        flat2 = tile * ROWS + mr2
        rmask2 = (flat2 // GQA < n_new) & (mh2 >= 0)
        if HAS_SINKS:
            sink = gl.load(sinks_ptr + mh2 * GQA + flat2 % GQA, mask=rmask2, other=0.0).to(gl.float32) * LOG2E
            m_n = gl.maximum(m_a, sink)
            acc = acc * gl.expand_dims(gl.exp2(m_a - m_n), 2)
            l_a = l_a * gl.exp2(m_a - m_n) + gl.exp2(sink - m_n)
        denom = gl.where(l_a > 0.0, l_a, 1.0)
        o = gl.where(gl.expand_dims(l_a > 0.0, 2), acc / gl.expand_dims(denom, 2), 0.0)
        flat3 = tile * ROWS + mr
        orow = (q_start + flat3 // GQA).to(gl.int64) * stride_on
        optr = out_ptr + orow + (mh * GQA + flat3 % GQA) * stride_oh + mc
        gl.store(optr, o.to(out_ptr.dtype.element_ty), mask=(flat3 // GQA < n_new) & (mc >= 0) & (mh >= 0))
        gl.atomic_xchg(counter_ptr + pair0, 0)
