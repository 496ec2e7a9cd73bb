"""NVIDIA-only Gluon decode kernel over the UltraQuant paged cache (experiment, issue 3; imports triton).

:func:`uq_decode_gluon` takes exactly the arguments, constexprs, grid and workspace of
:func:`ultraquant.kernels.attention.uq_decode` (one LaunchPlan serves both), for D=128 and GQA <= 16.
What it does differently, with explicit layouts (``triton.experimental.gluon``):

* Every warp owns its own tokens: a program's tile is ``num_warps x TW`` tokens, warp w takes the
  w-th ``TW``; scores, online softmax and the PV accumulator are per warp (batched 3D mma.sync with
  the warp as the batch dimension), so the loop has no barrier and no cross-warp traffic. The warps'
  (m, l, acc) merge once at the end, then the usual split merge (atomic ticket).
* The query is rotated once (butterfly in registers) and kept as the MMA A operand.
* K bytes are loaded straight into the MMA B-operand layout (``k_width=8``: a lane holds 8
  consecutive bytes of a token: 8-byte loads), decoded FP4 -> fp16 and multiplied by the per-group
  relative scale in one inline-PTX block.
* V bytes are loaded 4 contiguous bytes per lane and permuted in registers so that each fp16x2
  register pairs two tokens (the PV B operand), with the output columns permuted accordingly (undone
  at the store): no byte gathers from shared memory.

Scale handling follows v7 exactly (per-token largest scale byte as a power of two on the score
column / probability, per-group fp16 relative factors), so accuracy matches v7's.
Sinks and soft caps follow the same constexprs; windows too (the split range starts at the window).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def _pow2(e):
    """``2**e`` as an exact float32 for int32 ``e`` in [-126, 127] (0.0 below)."""
    b = e + 127
    return gl.where(b > 0, b << 23, 0).to(gl.float32, bitcast=True)


@gluon.jit
def _floor_log2(x):
    """floor(log2(x)) of non-negative normal float32 ``x`` from its exponent bits (-127 for 0)."""
    return ((x.to(gl.int32, bitcast=True) >> 23) & 0xFF) - 127


@gluon.jit
def _fp4_decode(b, rel):
    """(low, high) nibbles of uint8 ``b`` as fp16 times fp16 ``rel`` (elementwise, 4 bytes per asm).

    Per 4 bytes: two PRMT place bytes (0, 1) and (2, 3) in the 16-bit lanes, then per fp16x2 output
    two shifts and two masks build the subnormal pattern ``fp4 * 2**-14`` (magnitude to bits 11..9,
    sign to 15) and one ``mul.f16x2`` applies the relative scale. ``rel`` arrives as two fp16x2
    registers whose lanes match the byte pairs (for V they pair two tokens: the same code serves).
    """
    return gl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 x, y, a, c;
        prmt.b32 x, $4, 0, 0x4140;
        prmt.b32 y, $4, 0, 0x4342;
        shl.b32 a, x, 9;
        shl.b32 c, x, 12;
        and.b32 a, a, 0x0E000E00;
        and.b32 c, c, 0x80008000;
        or.b32 a, a, c;
        mul.rn.f16x2 $0, a, $5;
        shl.b32 a, y, 9;
        shl.b32 c, y, 12;
        and.b32 a, a, 0x0E000E00;
        and.b32 c, c, 0x80008000;
        or.b32 a, a, c;
        mul.rn.f16x2 $1, a, $6;
        shl.b32 a, x, 5;
        shl.b32 c, x, 8;
        and.b32 a, a, 0x0E000E00;
        and.b32 c, c, 0x80008000;
        or.b32 a, a, c;
        mul.rn.f16x2 $2, a, $5;
        shl.b32 a, y, 5;
        shl.b32 c, y, 8;
        and.b32 a, a, 0x0E000E00;
        and.b32 c, c, 0x80008000;
        or.b32 a, a, c;
        mul.rn.f16x2 $3, a, $6;
        }
        """,
        constraints="=r,=r,=r,=r,r,r,r",
        args=[b, rel],
        dtype=(gl.float16, gl.float16),
        is_pure=True,
        pack=4,
    )


@gluon.jit
def _token_scales(w):
    """Per token: its four scale bytes packed in int32 ``w`` -> (largest byte ``top``, ``w``)."""
    b0 = w & 0xFF
    b1 = (w >> 8) & 0xFF
    b2 = (w >> 16) & 0xFF
    b3 = (w >> 24) & 0xFF
    return gl.maximum(gl.maximum(b0, b1), gl.maximum(b2, b3))


@gluon.jit
def _rel_scale(w, top, group):
    """fp16 ``2**(scale byte of group - top)`` of each element (times 2**14: the decode's 2**-14),
    from the token's scale word ``w`` and largest byte ``top`` (broadcast) and the element's group.
    Flushes to 0 a group 2**28 below its token's largest (far below bf16 resolution of that token)."""
    sb = (w >> (group * 8)) & 0xFF
    field = gl.maximum(sb - top + 29, 0)
    return (field << 10).to(gl.int16).to(gl.float16, bitcast=True)


@gluon.jit
def _fwht_rows(x, NW: gl.constexpr, R: gl.constexpr, D: gl.constexpr, LOG2D: gl.constexpr):
    """``x @ H`` over the last axis of float32 ``[NW, R, D]`` (each thread holds whole rows)."""
    for i in gl.static_range(LOG2D):
        x = gl.reshape(x, [NW, R, D // (2 << i), 2, 1 << i])
        x = gl.permute(x, [0, 1, 2, 4, 3])
        a, b = gl.split(x)
        x = gl.join(a + b, a - b)
        x = gl.permute(x, [0, 1, 2, 4, 3])
        x = gl.reshape(x, [NW, R, D])
    return x * (1.0 / gl.sqrt(float(D)))


@gluon.jit
def uq_decode_gluon(q_ptr, cache_ptr, bt_ptr, seqlen_ptr, sinks_ptr, out_ptr, part_ptr, ml_ptr, counter_ptr,
                    scale, softcap, window, num_splits,
                    stride_qb, stride_qh, stride_ob, stride_oh,
                    stride_cb, stride_ct, stride_ch, stride_btb,
                    D: gl.constexpr, LOG2D: gl.constexpr, GQA: gl.constexpr, ROWS: gl.constexpr,
                    BLOCK_SIZE: gl.constexpr, TILE: gl.constexpr, HAS_SINKS: gl.constexpr,
                    HAS_WINDOW: gl.constexpr, HAS_SOFTCAP: gl.constexpr, ALIGN: gl.constexpr,
                    FP4_PTX: gl.constexpr, V_IN_LOAD_LAYOUT: gl.constexpr):
    """Split-KV paged decode, grid (B, Hk, num_splits); see the module docstring."""
    gl.static_assert(D == 128, "gluon decode: D=128 only")
    gl.static_assert(ROWS == 16, "gluon decode: GQA <= 16 (16 MMA rows)")
    gl.static_assert(ALIGN % 8 == 0, "gluon decode: slots must be 8-byte aligned")
    gl.static_assert(FP4_PTX, "gluon decode: NVIDIA only")
    NW: gl.constexpr = gl.num_warps()
    TW: gl.constexpr = TILE // NW
    gl.static_assert(TW == 16, "gluon decode: 16 tokens per warp per tile")
    H: gl.constexpr = D // 2
    G: gl.constexpr = D // 32

    # ---- layouts: warp = MMA batch
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1, 1],
                                                  instr_shape=[1, 16, 8])
    QA: gl.constexpr = gl.DotOperandLayout(0, MMA, 8)   # q halves [NW, ROWS, H]
    KB: gl.constexpr = gl.DotOperandLayout(1, MMA, 8)   # K halves [NW, H, TW]: 8 bytes per lane
    PA: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)   # probabilities [NW, ROWS, TW]
    VB: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)   # V halves [NW, TW, H] (columns permuted)
    ROW: gl.constexpr = gl.SliceLayout(2, MMA)          # [NW, ROWS]
    WARP: gl.constexpr = gl.SliceLayout(1, ROW)         # [NW]
    # V bytes as loaded: [NW, TW, 8 (lane group g), 8 (byte r)], byte 8g + r of the V codes; after
    # permute/reshape to [NW, TW, 64] the column index is 8r + g (what VB puts on lane group g).
    VL: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4], [0, 1, 0, 0], [0, 8, 0, 0]],
        lane_bases=[[0, 2, 0, 0], [0, 4, 0, 0], [0, 0, 1, 0], [0, 0, 2, 0], [0, 0, 4, 0]],
        warp_bases=[[1, 0, 0, 0], [2, 0, 0, 0]], block_bases=[], shape=[NW, TW, 8, 8])
    QL: gl.constexpr = gl.BlockedLayout([1, 1, D], [1, 32, 1], [NW, 1, 1], [2, 1, 0])

    b = gl.program_id(0)
    kvh = gl.program_id(1)
    sp = gl.program_id(2)
    num_kv = gl.num_programs(1)
    length = gl.load(seqlen_ptr + b)
    lo = 0
    if HAS_WINDOW:
        lo = gl.maximum(length - window, 0)
    per = gl.cdiv(gl.cdiv(length - lo, num_splits), TILE) * TILE
    t_lo = lo + sp * per
    t_hi = gl.minimum(t_lo + per, length)

    # ---- query: rotate, scale, fp16 halves times a per-row power of two (as v7), once
    qr = gl.arange(0, ROWS, gl.SliceLayout(0, gl.SliceLayout(2, QL)))
    qc = gl.arange(0, D, gl.SliceLayout(0, gl.SliceLayout(1, QL)))
    qr3 = gl.expand_dims(gl.expand_dims(qr, 0), 2)
    qc3 = gl.expand_dims(gl.expand_dims(qc, 0), 1)
    heads3 = kvh * GQA + qr3
    qoff = heads3 * stride_qh + qc3 + gl.zeros([NW, ROWS, D], gl.int32, QL)
    q = gl.load(q_ptr + b.to(gl.int64) * stride_qb + qoff, mask=(qr3 < GQA) & (qc3 < D), other=0.0).to(gl.float32)
    q = _fwht_rows(q, NW, ROWS, D, LOG2D)
    if HAS_SOFTCAP:
        q = q * scale
    else:
        q = q * (scale * LOG2E)
    amax = gl.max(gl.abs(q), axis=2)
    e = gl.maximum(_floor_log2(amax), -100)
    q = q * gl.expand_dims(_pow2(14 - e), 2)
    q_e, q_o = gl.split(gl.reshape(q, [NW, ROWS, H, 2]))
    q_e = gl.convert_layout(q_e.to(gl.float16), QA)
    q_o = gl.convert_layout(q_o.to(gl.float16), QA)
    rowfac = gl.convert_layout(_pow2(e - 14), ROW)
    rows = gl.arange(0, ROWS, gl.SliceLayout(0, ROW))
    rowbias = gl.expand_dims(gl.where(rows < GQA, 0.0, float("-inf")), 0)

    # ---- per-warp token indices in the K (KB), score (MMA) and V (VL) layouts
    bt_row = bt_ptr + b.to(gl.int64) * stride_btb
    head_off = kvh.to(gl.int64) * stride_ch
    wk = gl.expand_dims(gl.arange(0, NW, gl.SliceLayout(1, gl.SliceLayout(1, KB))), 1) * TW
    nk = gl.expand_dims(gl.arange(0, TW, gl.SliceLayout(0, gl.SliceLayout(1, KB))), 0)
    jk = gl.expand_dims(gl.expand_dims(gl.arange(0, H, gl.SliceLayout(0, gl.SliceLayout(2, KB))), 0), 2)
    kgroup = jk // 16
    TOK: gl.constexpr = gl.SliceLayout(1, MMA)         # [NW, TW] score columns
    ws = gl.expand_dims(gl.arange(0, NW, gl.SliceLayout(1, TOK)), 1) * TW
    ns = gl.expand_dims(gl.arange(0, TW, gl.SliceLayout(0, TOK)), 0)
    S3: gl.constexpr = gl.SliceLayout(3, VL)
    wv = gl.expand_dims(gl.expand_dims(gl.arange(0, NW, gl.SliceLayout(1, gl.SliceLayout(2, S3))), 1), 2) * TW
    nv = gl.expand_dims(gl.expand_dims(gl.arange(0, TW, gl.SliceLayout(0, gl.SliceLayout(2, S3))), 0), 2)
    gv = gl.expand_dims(gl.expand_dims(gl.arange(0, 8, gl.SliceLayout(0, gl.SliceLayout(1, S3))), 0), 1)
    R3: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, VL)))
    rv = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.arange(0, 8, R3), 0), 1), 2)

    acc_e = gl.zeros([NW, ROWS, H], gl.float32, MMA)
    acc_o = gl.zeros([NW, ROWS, H], gl.float32, MMA)
    m_i = gl.full([NW, ROWS], float("-inf"), gl.float32, ROW)
    l_i = gl.zeros([NW, ROWS], gl.float32, ROW)
    run = gl.full([NW], -254, gl.int32, WARP)
    for t0 in range(t_lo, t_hi, TILE):
        # K: token slots, 8-byte loads in the B-operand layout, decode + relative scales
        tk = t0 + wk + nk
        blk = gl.load(bt_row + tk // BLOCK_SIZE, mask=tk < t_hi, other=0)
        off = gl.multiple_of(blk.to(gl.int64) * stride_cb + (tk % BLOCK_SIZE).to(gl.int64) * stride_ct + head_off,
                             [ALIGN, ALIGN])
        kbase = cache_ptr + off
        kw = gl.load((kbase + H).to(gl.pointer_type(gl.int32)))
        ktop = _token_scales(kw)
        kb = gl.load(gl.expand_dims(kbase, 1) + jk)
        krel = _rel_scale(gl.expand_dims(kw, 1), gl.expand_dims(ktop, 1), kgroup)
        k_lo, k_hi = _fp4_decode(kb, krel)
        s = mma_v2(q_e, k_lo, gl.zeros([NW, ROWS, TW], gl.float32, MMA))
        s = mma_v2(q_o, k_hi, s)

        # scores: token power of two, row power of two, padding rows and tail tokens to -inf
        ts = t0 + ws + ns
        colfac = gl.expand_dims(_pow2(gl.convert_layout(ktop, TOK) - 127), 1)
        s = s * colfac
        if HAS_SOFTCAP:
            s = s * gl.expand_dims(rowfac, 2)
            s = softcap * (1.0 - 2.0 / (gl.exp2(s / softcap * (2.0 * LOG2E)) + 1.0)) * LOG2E
            s = s + gl.expand_dims(rowbias, 2)
        else:
            s = gl.fma(s, gl.expand_dims(rowfac, 2), gl.expand_dims(rowbias, 2))
        s = gl.where(gl.expand_dims(ts < t_hi, 1), s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=2))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s - gl.expand_dims(m_safe, 2))
        l_i = l_i * alpha + gl.sum(p, axis=2)
        m_i = m_new

        # V: scale word per token, reference exponent from the largest contribution p * 2**vtop
        tv = t0 + wv + nv
        vblk = gl.load(bt_row + tv // BLOCK_SIZE, mask=tv < t_hi, other=0)
        voff = gl.multiple_of(vblk.to(gl.int64) * stride_cb + (tv % BLOCK_SIZE).to(gl.int64) * stride_ct + head_off,
                              [ALIGN, ALIGN, ALIGN])
        vbase = cache_ptr + voff + (H + G)
        vw = gl.load((vbase + H).to(gl.pointer_type(gl.int32)))
        vtop = _token_scales(vw)
        vb = gl.load(gl.expand_dims(vbase + gv * 8, 3) + rv)
        vrel = _rel_scale(gl.expand_dims(vw, 3), gl.expand_dims(vtop, 3), gl.expand_dims(gv // 2, 3) + rv * 0)
        vb = gl.convert_layout(gl.reshape(gl.permute(vb, [0, 1, 3, 2]), [NW, TW, H]), VB)
        vrel = gl.convert_layout(gl.reshape(gl.permute(vrel, [0, 1, 3, 2]), [NW, TW, H]), VB)
        v_lo, v_hi = _fp4_decode(vb, vrel)

        vexp = gl.convert_layout(gl.max(vtop, axis=2), TOK) - 127
        contrib = p * gl.expand_dims(_pow2(gl.minimum(vexp, 127)), 1)
        ctop = _floor_log2(gl.max(gl.max(contrib, axis=2), axis=1))
        shrink = _floor_log2(gl.max(alpha, axis=1))
        new_run = gl.maximum(run + shrink, ctop)
        c = alpha * gl.expand_dims(_pow2(gl.minimum(run - new_run, 127)), 1)
        fac = _pow2(gl.minimum(vexp - gl.expand_dims(gl.convert_layout(new_run, gl.SliceLayout(1, TOK)), 1), 127))
        pv = gl.convert_layout((p * gl.expand_dims(fac, 1)).to(gl.float16), PA)
        acc_e = mma_v2(pv, v_lo, acc_e * gl.expand_dims(c, 2))
        acc_o = mma_v2(pv, v_hi, acc_o * gl.expand_dims(c, 2))
        run = new_run

    # ---- merge the warps (once), undo the V column permutation, then the split merge
    m_w = gl.max(m_i, axis=0)
    m_ws = gl.where(m_w == float("-inf"), 0.0, m_w)
    a_w = gl.exp2(m_i - gl.expand_dims(m_ws, 0))
    l_w = gl.sum(l_i * a_w, axis=0)
    f = gl.expand_dims(a_w * gl.expand_dims(_pow2(gl.minimum(run, 127)), 1), 2)
    acc_e = gl.sum(acc_e * f, axis=0)
    acc_o = gl.sum(acc_o * f, axis=0)
    OUT: gl.constexpr = gl.SliceLayout(0, MMA)
    nn = gl.arange(0, H, gl.SliceLayout(0, OUT))
    d_e = 2 * (8 * (nn % 8) + nn // 8)
    orow = gl.arange(0, ROWS, gl.SliceLayout(1, OUT))
    m_o = gl.convert_layout(m_w, gl.SliceLayout(1, OUT))
    l_o = gl.convert_layout(l_w, gl.SliceLayout(1, OUT))
    out_rows = out_ptr + b.to(gl.int64) * stride_ob + (kvh * GQA + orow) * stride_oh
    if num_splits == 1:
        _finish(acc_e, d_e, m_o, l_o, orow, kvh * GQA + orow, sinks_ptr, out_rows, GQA, HAS_SINKS)
        _finish(acc_o, d_e + 1, m_o, l_o, orow, kvh * GQA + orow, sinks_ptr, out_rows, GQA, HAS_SINKS)
    else:
        pair = b * num_kv + kvh
        slot = (pair * num_splits + sp).to(gl.int64)
        prow = part_ptr + slot * (ROWS * D) + gl.expand_dims(orow, 1) * D
        gl.store(prow + gl.expand_dims(d_e, 0), acc_e)
        gl.store(prow + gl.expand_dims(d_e + 1, 0), acc_o)
        gl.store(ml_ptr + slot * (2 * ROWS) + orow, m_o)
        gl.store(ml_ptr + slot * (2 * ROWS) + ROWS + orow, l_o)
        gl.thread_barrier()
        ticket = gl.atomic_add(counter_ptr + pair, 1)
        if ticket == num_splits - 1:
            ML: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [NW, 1], [1, 0])
            mrow = gl.arange(0, ROWS, gl.SliceLayout(1, ML))
            mcol = gl.arange(0, D, gl.SliceLayout(0, ML))
            acc = gl.zeros([ROWS, D], gl.float32, ML)
            m_a = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, ML))
            l_a = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, ML))
            for s in range(0, num_splits):
                src = (pair * num_splits + s).to(gl.int64)
                acc2 = gl.load(part_ptr + src * (ROWS * D) + gl.expand_dims(mrow, 1) * D + gl.expand_dims(mcol, 0),
                               cache_modifier=".cg")
                m2 = gl.load(ml_ptr + src * (2 * ROWS) + mrow, cache_modifier=".cg")
                l2 = gl.load(ml_ptr + src * (2 * ROWS) + ROWS + mrow, cache_modifier=".cg")
                m_n = gl.maximum(m_a, m2)
                m_s = gl.where(m_n == float("-inf"), 0.0, m_n)
                a1 = gl.exp2(m_a - m_s)
                a2 = gl.exp2(m2 - m_s)
                acc = acc * gl.expand_dims(a1, 1) + acc2 * gl.expand_dims(a2, 1)
                l_a = l_a * a1 + l2 * a2
                m_a = m_n
            m_rows = out_ptr + b.to(gl.int64) * stride_ob + (kvh * GQA + mrow) * stride_oh
            _finish(acc, mcol, m_a, l_a, mrow, kvh * GQA + mrow, sinks_ptr, m_rows, GQA, HAS_SINKS)
            gl.atomic_xchg(counter_ptr + pair, 0)


@gluon.jit
def _finish(acc, cols, m_i, l_i, rows, heads, sinks_ptr, out_rows_ptr, GQA: gl.constexpr, HAS_SINKS: gl.constexpr):
    """Fold the sinks into the denominator and store ``acc / l`` into columns ``cols`` of the real
    rows (zeros where nothing was seen). ``acc [ROWS, N]``; ``m_i``, ``l_i``, ``rows``, ``heads``
    in the row slice of its layout."""
    rmask = rows < GQA
    if HAS_SINKS:
        sink = gl.load(sinks_ptr + heads, mask=rmask, other=0.0).to(gl.float32) * LOG2E
        m_new = gl.maximum(m_i, sink)
        l_i = l_i * gl.exp2(m_i - m_new) + gl.exp2(sink - m_new)
        acc = acc * gl.expand_dims(gl.exp2(m_i - m_new), 1)
    denom = gl.where(l_i > 0.0, l_i, 1.0)
    o = gl.where(gl.expand_dims(l_i > 0.0, 1), acc / gl.expand_dims(denom, 1), 0.0)
    ptrs = gl.expand_dims(out_rows_ptr, 1) + gl.expand_dims(cols, 0)
    gl.store(ptrs, o.to(out_rows_ptr.dtype.element_ty), mask=gl.expand_dims(rmask, 1) & gl.expand_dims(cols >= 0, 0))
