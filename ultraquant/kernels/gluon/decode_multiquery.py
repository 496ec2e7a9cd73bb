"""The multi-query decode: a speculative-decoding step (2-16 new tokens per request) over the 4-bit cache,
on the whole-page structure, for NVIDIA sm_90, in Gluon.

A step verifies ``n`` drafted tokens per request: ``n`` query tokens at the end of the request's sequence,
their own K/V already in the cache (stored by the step's store before attention, as vLLM does and as the
decode does for its one token). The query rows of one kv head are the ``n x GQA`` (token, head) pairs in
token-major order (row ``r``: token ``r // GQA``, query head ``r % GQA`` of the kv head), 16 per M tile; a
program serves ``TILES`` (1 or 2) M tiles for ALL kv heads, grid ``(tiles / TILES, programs)``: each tile
group is dealt over the persistent programs by the whole-page decode's balanced schedule of the batch's
lengths (:func:`~.decode_wholepage._schedule`, computed on the device, so a CUDA graph replays any lengths and
counts), a program serving its pieces of one request after another (one noinline :func:`_serve_piece` call
each), and reads the pages exactly as the whole-page decode does: a ``cp.async`` ring of whole 16-token runs
(:func:`~.decode_wholepage._issue_stage`). Each run's codes are decoded once for all the program's tiles: K by
scale group (:func:`_group_scores`: the codes in the MMA's k order as fp16 ``fp4 * 2**-14`` by the decode's
word PTX, the UE8M0 group scales on the partial scores), V by V words (:func:`_pv_words`: each thread's code
words of four tokens, the decode's word PTX, straight into the PV MMAs' B fragments, 16 output tiles of 8 dims).

What differs from the decode: each row's own causal limit (row ``r`` sees cached tokens ``< seq_len - n + r //
GQA + 1``; with a window, also ``>= limit - window``), each request's own count ``n = qsl[b + 1] - qsl[b]``
read on the device (ragged 0..``max_tokens``; rows past ``n`` are empty, a piece past them reads nothing),
queries and outputs addressed by token rows like the prefill kernel, the schedule's units reaching ``window +
max_tokens`` below a request's length (every row's window), and a partial slot per (tile, program + request)
and merge ticket per (tile, request).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from .decode_wholepage import (
    ERR_SEQ_LEN,
    LOG2E,
    _advance_ring,
    _blocks_inside,
    _combine_token_groups,
    _first_blocks,
    _floor_log2,
    _fold_partials,
    _fold_sink,
    _fwht_split,
    _id_inside,
    _iota3,
    _issue_stage,
    _lanes_warps,
    _merge_step,
    _normalized,
    _online_start,
    _online_update,
    _owner,
    _physical_token,
    _piece,
    _pow2,
    _rel_scale,
    _ring_drained,
    _schedule,
    _slot_layout,
    _token_top,
    _units,
    _vword_layout,
    _vword_pairs_ptx,
    _warp_ids,
    _word_pairs,
)

MQ_ROWS = gl.constexpr(16)
"""Query rows per M tile: (token, head) pairs of one kv head, token-major."""


_WORD_CODES_ASM = gl.constexpr("{ .reg .b32 t1, t2, t3; " + _word_pairs(["$0", "$1", "$2", "$3"], "$4") + " }")
"""The whole-page decode's word PTX (:func:`~.decode_wholepage._word_pairs`, 11 instructions a word): the
8 codes of 4 K bytes as fp16 ``fp4 * 2**-14``, dims (0, 4, 1, 5) and (2, 6, 3, 7) of the word."""


@gluon.jit
def _word_codes(b):
    """Two fp16 tensors from uint8 ``b`` (4 adjacent code bytes a register): of each word the dims
    (0, 4, 1, 5) and (2, 6, 3, 7), the k order of :data:`K_ORDER` (no relative scales: the group scales
    multiply the scores, :func:`_group_scores`)."""
    return gl.inline_asm_elementwise(asm=_WORD_CODES_ASM, constraints="=r,=r,=r,=r,r", args=[b],
                                     dtype=(gl.float16, gl.float16), is_pure=True, pack=4)


@gluon.jit
def _groups4(x, NW: gl.constexpr, R: gl.constexpr, AXIS: gl.constexpr, L: gl.constexpr):
    """The four 32-dim scale groups of ``x`` (64 dim pairs on ``AXIS`` 1 or 2, ``R`` on the other; group
    g: pairs 16 g .. 16 g + 15), each in layout ``L``."""
    if AXIS == 1:
        y = gl.permute(gl.reshape(x, [NW, 2, 2, 16, R]), [0, 3, 4, 1, 2])  # g = 2 g1 + g0 -> last axes
    else:
        y = gl.permute(gl.reshape(x, [NW, R, 2, 2, 16]), [0, 1, 4, 2, 3])
    e0, e1 = gl.split(y)  # g0 = 0, 1
    g0, g2 = gl.split(e0)
    g1, g3 = gl.split(e1)
    return (gl.convert_layout(g0, L), gl.convert_layout(g1, L), gl.convert_layout(g2, L),
            gl.convert_layout(g3, L))


@gluon.constexpr_function
def _row_merge_layout(hk, rows, d, nw):
    """The last program's layout of ``[HK, 16, D]`` partials: warps over the kv heads, then the rows; lanes over
    up to 8 rows and the dims (up to 4 consecutive a thread: 16-byte loads), so no two threads load the same
    element and a thread holds 2 rows' running maxima and sums at 8 kv heads, not all 16 (the decode's
    :func:`~.decode_wholepage._merge_layout` puts the lanes on the dims only): the fold's row work
    shrinks 8x and two 64-value partials fit in flight."""
    wh = min(hk, nw)
    wr = min(rows, nw // wh)
    wd = nw // (wh * wr)
    lr = min(rows // wr, 8)
    ld = 32 // lr
    vec = max(1, min(4, d // (ld * wd)))
    return gl.BlockedLayout([1, 1, vec], [1, lr, ld], [wh, wr, wd], [2, 1, 0])


K_ORDER = gl.constexpr([1, 8, 2, 4, 16, 32])
"""The MMA k index of each bit of a K code byte's index (dim pair) in its slot: bytes ``4 t .. 4 t + 3`` of a
16-byte scale group are k ``2 t, 2 t + 1, 2 t + 8, 2 t + 9``, the four k values lane ``t`` of a quad holds
in an ``m16n8k16`` B fragment, so one 32-bit shared load feeds them; the query takes the same order
(:func:`_k_order`)."""


@gluon.jit
def _query_groups(q, NW: gl.constexpr, R: gl.constexpr, L: gl.constexpr):
    """fp16 A operands (layout ``L``) of float32 ``q`` ``[NW, R, 128]`` in the k order of the K codes
    (:func:`_word_codes`, :data:`K_ORDER`): for scale group g and half c (the word's dims (0, 4, 1, 5) or
    (2, 6, 3, 7)), element k = dim ``32 g + 8 t + 4 k0 + 2 c + k3`` (k = k0 + 2 t + 8 k3); returned
    (g0 c0, g0 c1, g1 c0, ...)."""
    y = gl.reshape(q, [NW, R, 2, 2, 2, 2, 2, 2, 2])  # dim bits g1 g0 t1 t0 k0 c k3
    y = gl.reshape(gl.permute(y, [0, 1, 8, 4, 5, 6, 2, 3, 7]), [NW, R, 16, 2, 2, 2])  # k, g1, g0, c
    c0, c1 = gl.split(y.to(gl.float16))
    a0, a1 = gl.split(c0)  # g0
    b0, b1 = gl.split(c1)
    g0c0, g2c0 = gl.split(a0)
    g1c0, g3c0 = gl.split(a1)
    g0c1, g2c1 = gl.split(b0)
    g1c1, g3c1 = gl.split(b1)
    return (gl.convert_layout(g0c0, L), gl.convert_layout(g0c1, L), gl.convert_layout(g1c0, L),
            gl.convert_layout(g1c1, L), gl.convert_layout(g2c0, L), gl.convert_layout(g2c1, L),
            gl.convert_layout(g3c0, L), gl.convert_layout(g3c1, L))


@gluon.jit
def _group_scale(kw, g: gl.constexpr):
    """``2**(byte g of the scale words kw - 127)`` as float32 (UE8M0 ``byte << 23``)."""
    if g == 3:
        bits = (kw >> 1) & 0x7F800000
    else:
        bits = (kw << (23 - 8 * g)) & 0x7F800000
    return bits.to(gl.float32, bitcast=True)


@gluon.jit
def _group_scores(kc8, kw, qs, qz, TILES: gl.constexpr, NW: gl.constexpr, TW: gl.constexpr, ROWS: gl.constexpr,
                  H: gl.constexpr, MMA: gl.constexpr, KB: gl.constexpr, QA: gl.constexpr):
    """Raw scores ``Q K^T`` ``[NW, ROWS, TW]`` of one 16-token run for each of ``TILES`` M tiles, by scale
    group: the K codes (ring entry view ``kc8``) become fp16 ``fp4 * 2**-14`` once (:func:`_word_codes`),
    two MMAs per 32-dim group and tile with the query's group fragments ``qs`` (tile t, group g, half c:
    ``qs[8 t + 2 g + c]``), then the group's UE8M0 scale (scale words ``kw`` ``[NW, TW]`` in the
    score-column layout) times its partial scores; no per-element relative scales."""
    kb = _piece(kc8.permute([0, 3, 1, 2]), [NW, H, TW], KB, KB)  # the fp16 B layout: 4 code bytes a word
    k_a, k_b = _word_codes(kb)
    ka = _groups4(k_a, NW, TW, 1, KB)
    kb4 = _groups4(k_b, NW, TW, 1, KB)
    out = ()
    for t in gl.static_range(TILES):
        s = gl.zeros([NW, ROWS, TW], gl.float32, MMA)
        for g in gl.static_range(4):
            sg = mma_v2(qs.index(8 * t + 2 * g + qz).load(QA), ka[g], gl.zeros([NW, ROWS, TW], gl.float32, MMA))
            sg = mma_v2(qs.index(8 * t + 2 * g + 1 + qz).load(QA), kb4[g], sg)
            s = s + sg * gl.expand_dims(_group_scale(kw, g), 1)
        out = out + (s,)
    return out


@gluon.jit
def _stage_scores(kc8, ks, q_smem, cur, t0, t_hi, ws, ns, inside, bt_row, num_blocks, rfs, lims, firsts, softcap,
                  whole, TILES: gl.constexpr, NSUB: gl.constexpr, NW: gl.constexpr, WT: gl.constexpr,
                  TW: gl.constexpr, ROWS: gl.constexpr, H: gl.constexpr, BLOCK_SIZE: gl.constexpr,
                  HAS_SOFTCAP: gl.constexpr, HAS_WINDOW: gl.constexpr, MMA: gl.constexpr, KB: gl.constexpr,
                  QA: gl.constexpr, TK: gl.constexpr):
    """Scores (log2 units) of the ``NSUB`` runs of the stage at ring entry ``cur`` (tokens from ``t0``), for each
    tile (``ss[i TILES + t]``). Unless the stage is ``whole`` (every token visible to every real row: the loop's
    interior; padding rows' outputs are never stored), each row under its own causal limit (0 for rows past
    the request's tokens) and window start; tokens past the range's end ``t_hi``, or of a bad block id
    (bounds), are empty (-inf)."""
    qz = (t0 < 0).to(gl.int32)  # 0, but not provably: the query fragments are loaded here, not hoisted
    ss = ()
    for i in gl.static_range(NSUB):
        kw = _piece(ks.index(cur + i), [NW, TW], TK, TK)
        st = _group_scores(kc8.index(cur + i), kw, q_smem, qz, TILES, NW, TW, ROWS, H, MMA, KB, QA)
        for t in gl.static_range(TILES):
            s = st[t] * rfs[t]
            if HAS_SOFTCAP:
                s = softcap * (1.0 - 2.0 / (gl.exp2(s / softcap * (2.0 * LOG2E)) + 1.0)) * LOG2E
            ss = ss + (s,)
    if not whole:
        masked = ()
        for i in gl.static_range(NSUB):
            ts = t0 + i * (WT * TW) + ws + ns
            live = ts < t_hi
            if not inside:
                tb = gl.load(bt_row + ts // BLOCK_SIZE, mask=live, other=0)
                live = live & _id_inside(tb, num_blocks)
            ts3 = gl.expand_dims(ts, 1)
            live3 = gl.expand_dims(live, 1)
            for t in gl.static_range(TILES):
                seen = (ts3 < lims[t]) & live3
                if HAS_WINDOW:
                    seen = seen & (ts3 >= firsts[t])
                masked = masked + (gl.where(seen, ss[i * TILES + t], float("-inf")),)
        ss = masked
    return ss


def _pv_half_ptx(tiles: int, half: int) -> str:
    """PTX of :func:`_pv_half` (``tiles`` M tiles): bytes ``2 half``, ``2 half + 1`` of one V word of tokens
    (a, b, c, d) = (2t, 2t + 1, 2t + 8, 2t + 9): PRMT pairs tokens a, b (c, d) in the 16-bit lanes, the word's
    nibble pairs (:func:`~.decode_wholepage._word_pairs`) are then four B fragments ``{p_i, r_i}`` (dim ``i`` of
    the half: one ``m16n8k16`` n-tile each), times the tokens' relative scales, one MMA per n-tile and M tile
    with its probability A fragment. Operands: outputs (M tile t, n-tile i) $16t + 4i.., the accumulators in the
    same order from $16T, then the V words (4), the A fragments (4 per tile), the relative scales (2 of 4)."""
    n = 16 * tiles
    vw, pf, rel = 2 * n, 2 * n + 4, 2 * n + 4 + 4 * tiles
    lines = ["{ .reg .b32 t1, t2, t3, z0, z1, p0, p1, p2, p3, r0, r1, r2, r3;", *_vword_pairs_ptx(vw, half)]
    for i in range(4):
        lines += [f"mul.rn.f16x2 p{i}, p{i}, ${rel}; mul.rn.f16x2 r{i}, r{i}, ${rel + 1};"]
        for t in range(tiles):
            o, a = 16 * t + 4 * i, pf + 4 * t
            lines += [f"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {{${o}, ${o + 1}, ${o + 2}, ${o + 3}}}, "
                      f"{{${a}, ${a + 1}, ${a + 2}, ${a + 3}}}, {{p{i}, r{i}}}, "
                      f"{{${n + o}, ${n + o + 1}, ${n + o + 2}, ${n + o + 3}}};"]
    return " ".join(lines + ["}"])


_PV1_ASM0 = gl.constexpr(_pv_half_ptx(1, 0))
_PV1_ASM1 = gl.constexpr(_pv_half_ptx(1, 1))
_PV1_CONSTRAINTS = gl.constexpr(",".join(["=f"] * 16 + ["f"] * 16 + ["r"] * 12))
_PV2_ASM0 = gl.constexpr(_pv_half_ptx(2, 0))
_PV2_ASM1 = gl.constexpr(_pv_half_ptx(2, 1))
_PV2_CONSTRAINTS = gl.constexpr(",".join(["=f"] * 32 + ["f"] * 32 + ["r"] * 16))
"""One half V word for one (two) M tiles (:func:`_pv_half`): 4 (8) accumulator tiles out and in, the words."""


def _frags_ptx(rel: bool) -> str:
    """PTX of :func:`_frags` over the score layout ``[NW, 16 rows, 16 tokens]`` (8 values a thread: rows g,
    g + 8 x tokens 2t, 2t + 1, then the same for tokens 2t + 8, 2t + 9): the probabilities' fp16 A fragment
    (``$0..$3``, as the accumulator's fp16 pairs) and, with ``rel``, the relative scales of tokens (2t, 2t +
    1) and (2t + 8, 2t + 9) as fp16 pairs (``$4``, ``$5``)."""
    lines = ["{ cvt.rn.f16x2.f32 $0, $9, $8; cvt.rn.f16x2.f32 $1, $11, $10; cvt.rn.f16x2.f32 $2, $13, $12;",
             "cvt.rn.f16x2.f32 $3, $15, $14;",
             "prmt.b32 $4, $16, $17, 0x5410; prmt.b32 $5, $20, $21, 0x5410;" if rel
             else "mov.b32 $4, 0; mov.b32 $5, 0;",
             "mov.b32 $6, 0; mov.b32 $7, 0; }"]
    return " ".join(lines)


_FRAGS_ASM = gl.constexpr(_frags_ptx(False))
_FRAGS_REL_ASM = gl.constexpr(_frags_ptx(True))
_FRAGS_CONSTRAINTS = gl.constexpr(",".join(["=r"] * 8 + ["f"] * 8 + ["r"] * 8))


@gluon.jit
def _frags(p, rel, WITH_REL: gl.constexpr, NW: gl.constexpr, MMA: gl.constexpr):
    """The probabilities ``p`` (float32) and relative scales ``rel`` (int32, fp16 bits) of one run, both in the
    score layout ``[NW, 16 rows, 16 tokens]``, as two ``[NW, 16, 8]`` int32 tensors in ``MMA`` (no data moves
    between threads): the A fragment words (4) and the scale pairs (words 0, 1; :func:`_frags_ptx`)."""
    if WITH_REL:
        f = gl.inline_asm_elementwise(asm=_FRAGS_REL_ASM, constraints=_FRAGS_CONSTRAINTS, args=[p, rel],
                                      dtype=gl.int32, is_pure=True, pack=8)
    else:
        f = gl.inline_asm_elementwise(asm=_FRAGS_ASM, constraints=_FRAGS_CONSTRAINTS, args=[p, rel],
                                      dtype=gl.int32, is_pure=True, pack=8)
    a, r = gl.split(gl.permute(gl.reshape(f, [NW, 16, 2, 8]), [0, 1, 3, 2]))  # the token bit 3 is a register bit
    return gl.convert_layout(a, MMA), gl.convert_layout(r, MMA)


@gluon.jit
def _pv_half(accs, vw, frs, rel, HALF: gl.constexpr, TILES: gl.constexpr):
    """``acc += P V`` of one run for the four n-tiles of bytes ``2 HALF``, ``2 HALF + 1`` of the thread's V word
    ``vw`` (:func:`_pv_half_ptx`), for each M tile (``accs``: 4 per tile, ``frs``: A fragments per tile)."""
    A1: gl.constexpr = _PV1_ASM0 if HALF == 0 else _PV1_ASM1
    A2: gl.constexpr = _PV2_ASM0 if HALF == 0 else _PV2_ASM1
    if TILES == 1:
        out = gl.inline_asm_elementwise(asm=A1, constraints=_PV1_CONSTRAINTS,
                                        args=[accs[0], accs[1], accs[2], accs[3], vw, frs[0], rel],
                                        dtype=(gl.float32, gl.float32, gl.float32, gl.float32), is_pure=True, pack=4)
    else:
        out = gl.inline_asm_elementwise(asm=A2, constraints=_PV2_CONSTRAINTS,
                                        args=[accs[0], accs[1], accs[2], accs[3], accs[4], accs[5], accs[6], accs[7],
                                              vw, frs[0], frs[1], rel],
                                        dtype=(gl.float32, gl.float32, gl.float32, gl.float32, gl.float32, gl.float32,
                                               gl.float32, gl.float32), is_pure=True, pack=4)
    return out


@gluon.jit
def _pv_words(accs, vwa, vwb, vsw, vtop, vexp, ps, RUN: gl.constexpr, nr, TILES: gl.constexpr, NSUB: gl.constexpr,
              NW: gl.constexpr, MMA: gl.constexpr):
    """``acc += P V`` of run ``RUN`` of the stage for each of ``TILES`` M tiles (n-tile k of tile t at
    :func:`_acc_index`: dims ``16 g + k`` of lane group g; probabilities ``ps[t NSUB + RUN]``). The V code words
    (ring views ``vwa``, ``vwb``: words 2g, 2g + 1 of tokens 2t, 2t + 1, 2t + 8, 2t + 9) are decoded once for all
    tiles by the word PTX; their relative scales (group g / 2) come from the tokens' scale words ``vsw`` and
    largest bytes ``vtop`` (score-column layout); the probabilities times ``2**(vexp - nr)`` go to fp16."""
    words = (_piece(vwa, [NW, 16, 8], MMA, MMA), _piece(vwb, [NW, 16, 8], MMA, MMA))
    fac = gl.expand_dims(_pow2(gl.minimum(vexp - nr, 127)), 1)
    grp = (_iota3(16, 1, MMA) % 8) // 2  # the row's lane group g: its V words' scale group (D=128)
    rel = _rel_scale(gl.expand_dims(vsw, 1), gl.expand_dims(vtop, 1), grp).to(gl.int16, bitcast=True).to(gl.int32)
    frs, rels = _frags(ps[RUN] * fac, rel, True, NW, MMA)  # the scale pairs once, with the first tile's fragment
    frs = (frs,)
    for t in gl.static_range(1, TILES):
        frs = frs + (_frags(ps[t * NSUB + RUN] * fac, rel, False, NW, MMA)[0],)
    return _pv_quarter(accs, words[0], frs, rels, 0, TILES) + _pv_quarter(accs, words[0], frs, rels, 1, TILES) \
        + _pv_quarter(accs, words[1], frs, rels, 2, TILES) + _pv_quarter(accs, words[1], frs, rels, 3, TILES)


@gluon.constexpr_function
def _acc_index(t, k, tiles):
    """Position of n-tile ``k`` of M tile ``t`` in the accumulators (:func:`_pv_words`): quarter-major (the
    four n-tiles of one half V word, :func:`_pv_half`, of every tile), then tile, then n-tile."""
    return 4 * tiles * (k // 4) + 4 * t + k % 4


@gluon.jit
def _pv_quarter(accs, vw, frs, rel, Q: gl.constexpr, TILES: gl.constexpr):
    """n-tiles ``4 Q .. 4 Q + 3`` of every M tile after one run: :func:`_pv_half` of half ``Q % 2`` of V word
    ``vw`` on accumulators ``4 TILES Q ..`` (:func:`_acc_index`)."""
    B: gl.constexpr = 4 * TILES * Q
    if TILES == 1:
        sub = (accs[B], accs[B + 1], accs[B + 2], accs[B + 3])
    else:
        sub = (accs[B], accs[B + 1], accs[B + 2], accs[B + 3], accs[B + 4], accs[B + 5], accs[B + 6], accs[B + 7])
    return _pv_half(sub, vw, frs, rel, Q % 2, TILES)


@gluon.jit
def _rescaled(accs, cs, TILES: gl.constexpr):
    """Every accumulator times its M tile's factor ``cs[t]`` (:func:`_acc_index`: tile ``(i // 4) % TILES``)."""
    out = ()
    for i in gl.static_range(16 * TILES):
        out = out + (accs[i] * cs[(i // 4) % TILES],)
    return out


@gluon.jit
def _word_rows(tiles, NW: gl.constexpr, ROWS: gl.constexpr, D: gl.constexpr):
    """A tile's accumulator as ``[NW, ROWS, D]`` from its 16 n-tiles (:func:`_pv_words`: tile k, column g is dim
    ``16 g + k``), by joins, a permute and a reshape (register renaming, no data moves)."""
    xs = tiles
    for _lvl in gl.static_range(4):
        ys = ()
        for k in gl.static_range(8 >> _lvl):
            ys = ys + (gl.join(xs[2 * k], xs[2 * k + 1]),)
        xs = ys
    return gl.reshape(gl.permute(xs[0], [0, 1, 2, 6, 5, 4, 3]), [NW, ROWS, D])


@gluon.jit
def _row_limits(tile, length, n_new, window, GQA: gl.constexpr, ROWS: gl.constexpr, HAS_WINDOW: gl.constexpr,
                L: gl.constexpr):
    """Per row of M tile ``tile`` (layout ``L``, ``[ROWS]``): its causal limit (cached tokens ``< lim``; 0
    unless it is a real (token, head) pair of the request's ``n_new`` tokens) and its first visible
    token (0 without a window)."""
    tok = (tile * ROWS + gl.arange(0, ROWS, L)) // GQA
    lim = gl.where(tok < n_new, length - n_new + tok + 1, 0)
    first = lim * 0
    if HAS_WINDOW:
        first = gl.maximum(lim - window, 0)
    return lim, first


@gluon.jit(noinline=True)
def _serve_piece(q_ptr, cache_ptr, bt_ptr, seqlen_ptr, qsl_ptr, sinks_ptr, out_ptr, part_ptr, ml_ptr, counter_ptr,
                 err_ptr, scale, softcap, window, reach, max_tokens, num_requests, num_blocks, cap,
                 stride_qn, stride_qh, stride_on, stride_oh, stride_cb, stride_ch, stride_btb,
                 b, cs, w0, w1, total, active, pid, progs, tg,
                 D: gl.constexpr, LOG2D: gl.constexpr, GQA: gl.constexpr, HK: gl.constexpr,
                 WT: gl.constexpr, NSUB: gl.constexpr, STAGES: gl.constexpr, TW: gl.constexpr,
                 BLOCK_SIZE: gl.constexpr, HAS_SINKS: gl.constexpr, HAS_WINDOW: gl.constexpr,
                 HAS_SOFTCAP: gl.constexpr, TILES: gl.constexpr):
    """Serve request ``b``'s piece of this program's units ``[w0, w1)`` (the request's units start at ``cs``)
    for the ``TILES`` M tiles of tile group ``tg``: stream it through the ring, leave one partial per tile and
    kv head in slot ``pid + b`` and, for the request's last piece (atomic ticket per tile), merge its pieces
    into ``out``. Returns the request's end unit."""
    gl.static_assert(D == 128, "the multi-query decode: D=128 (the 16-M-row path)")
    gl.static_assert(TW == 16, "the multi-query decode: 16-token runs per warp")
    NW: gl.constexpr = gl.num_warps()
    gl.static_assert(NW == HK * WT, "the multi-query decode: num_warps must be HK * WT")
    ROWS: gl.constexpr = MQ_ROWS
    H: gl.constexpr = D // 2
    G: gl.constexpr = D // 32
    TT: gl.constexpr = NSUB * WT * TW
    # partials per merge step (their loads overlap): 128 values a thread in flight, _row_merge_layout holding
    # distinct elements and few row scalars
    MERGE: gl.constexpr = _merge_step(HK * ROWS * D // (32 * NW), 128)

    # ---- layouts (the whole-page decode's 16-M-row path): warp = MMA batch
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1, 1],
                                                  instr_shape=[1, 16, 8])
    QA: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)   # q halves, one scale group [NW, ROWS, 16]
    KB: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)   # K codes / halves [NW, H, TW] (k pairs in a word)
    QR: gl.constexpr = gl.SliceLayout(2, MMA)           # [NW, ROWS]
    QW: gl.constexpr = gl.SliceLayout(1, QR)            # [NW]
    TK: gl.constexpr = gl.SliceLayout(1, MMA)           # [NW, TW] score columns
    # the query rows in 4 lane chunks of D / 4 (the decode's QL: whole rows per thread repeat each of the 16
    # rows on 2 lanes and cost 7 x 128 adds per row per tile, once per piece)
    QL: gl.constexpr = gl.BlockedLayout([1, 1, D // 4], [1, 8, 4], [NW, 1, 1], [2, 1, 0])
    QL2: gl.constexpr = gl.BlockedLayout([1, 1, D // 16, 4], [1, 8, 4, 1], [NW, 1, 1, 1], [3, 2, 1, 0])
    # ---- the ring, as the whole-page decode's (STAGES x NR runs of 16 whole 136-byte slots)
    NR: gl.constexpr = NSUB * NW
    SLOT: gl.constexpr = 2 * (H + G)
    RINT: gl.constexpr = 8 * H
    RING: gl.constexpr = gl.PaddedSharedLayout.with_identity_for([[RINT, 4 * SLOT - RINT]], [NR, RINT], [1, 0])
    FLAT: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    QS: gl.constexpr = gl.SwizzledSharedLayout(8, 4, 2, [2, 1, 0])  # ldmatrix of 32-byte rows: no conflicts
    ring = gl.allocate_shared_memory(gl.int32, [STAGES * NR * (SLOT * 4)], FLAT)._reinterpret(
        gl.int32, [STAGES, NR, RINT], RING)
    gl.thread_barrier()  # every warp is past the previous piece's shared memory use
    # K code bytes in the MMA's k order (:data:`K_ORDER`): a thread's 4 k values of a k step are 4 adjacent bytes
    PB: gl.constexpr = _slot_layout(2 * H, SLOT - 2 * H, [NW, TW, 2, H], K_ORDER)
    SW2: gl.constexpr = 32
    PWD: gl.constexpr = _slot_layout(SW2, SLOT // 4 - SW2, [NW, TW, 2, SW2 // 2])
    E: gl.constexpr = STAGES * NSUB
    RUNB: gl.constexpr = 4096
    words = ring._reinterpret(gl.int32, [STAGES * NR * RUNB // 4], FLAT)
    kc8 = ring._reinterpret(gl.uint8, [E, NW, TW, 2, H], PB)
    # V code words for _pv_words: [NW, 16, 8, 2, 2] views based at V words 0 and 1 (the decode's _vword_layout)
    PVW: gl.constexpr = _vword_layout(NW, 2, SLOT // 4)
    V0: gl.constexpr = (H + G) // 4
    vwa = words.slice(V0, 1)._reinterpret(gl.int32, [E, NW, 16, 8, 2, 2], PVW)
    vwb = words.slice(V0 + 1, 1)._reinterpret(gl.int32, [E, NW, 16, 8, 2, 2], PVW)
    ks = words.slice(H // 4, H // 4)._reinterpret(gl.int32, [E, NW, TW, 2, SW2 // 2], PWD)
    vs = words.slice((SLOT - G) // 4, 1)._reinterpret(gl.int32, [E, NW, TW, 2, SW2 // 2], PWD)

    length = gl.load(seqlen_ptr + b)
    q_start = gl.load(qsl_ptr + b)
    n_new = gl.load(qsl_ptr + b + 1) - q_start
    # bounds: a length outside [0, capacity] or a count outside [0, min(length, max_tokens)] is clamped,
    # error word set (the count bound: the grid's tiles cover max_tokens tokens)
    length_bad = (length < 0) | (length > cap)
    length = gl.minimum(gl.maximum(length, 0), cap)
    count_bad = (n_new < 0) | (n_new > length) | (n_new > max_tokens)
    gl.store(err_ptr + ERR_SEQ_LEN, 1, mask=length_bad | count_bad)
    n_new = gl.minimum(gl.maximum(n_new, 0), gl.minimum(length, max_tokens))
    # the tiles' token range: up to their last real row's limit, from their first row's window start
    tok_first = (tg * TILES * ROWS) // GQA
    tok_last = gl.minimum(((tg + 1) * TILES * ROWS - 1) // GQA, n_new - 1)
    hi = gl.where(tok_first < n_new, length - n_new + tok_last + 1, 0)
    lo = 0
    if HAS_WINDOW:
        lo = gl.maximum(length - n_new + tok_first + 1 - window, 0)
        lo = gl.minimum(lo, hi)
    # the piece: the request's units [cs, ce) are its TT-token stages from its scheduled first stage (the window
    # reach covers every row's window), this program's share of them, cut to the tiles' range [lo, hi)
    lo_s = 0
    if HAS_WINDOW:
        lo_s = gl.maximum(length - reach, 0)
    lo_s = (lo_s // TT) * TT
    ce = cs + _units(length, reach, cap, TT, HAS_WINDOW)
    t_lo = gl.maximum(lo_s + (gl.maximum(cs, w0) - cs) * TT, (lo // TT) * TT)
    t_hi = gl.minimum(lo_s + (gl.minimum(ce, w1) - cs) * TT, hi)
    n_it = gl.cdiv(gl.maximum(t_hi - t_lo, 0), TT)
    bt_row = bt_ptr + b.to(gl.int64) * stride_btb

    # ---- the query rows (token r // GQA, head h GQA + r % GQA), before the ring copies queue up
    qr3 = _iota3(ROWS, 1, QL)
    qc3 = _iota3(D, 2, QL)
    qh3 = _iota3(NW, 0, QL) // WT
    q_ins = ()
    for t in gl.static_range(TILES):
        qflat = (tg * TILES + t) * ROWS + qr3
        qtok = qflat // GQA
        qoff = (q_start + qtok).to(gl.int64) * stride_qn + (qh3 * GQA + qflat % GQA) * stride_qh + qc3
        q_ins = q_ins + (gl.load(q_ptr + qoff, mask=(qtok < n_new) & (qc3 < D), other=0.0),)
    inside = _blocks_inside(bt_row, t_lo, t_hi, num_blocks, err_ptr,
                            _first_blocks(bt_row, t_lo, t_hi, BLOCK_SIZE, NW, False), BLOCK_SIZE)

    c_lane, c_warp = _lanes_warps(NW)
    for i in gl.static_range(STAGES - 1):
        _issue_stage(i, cache_ptr, t_lo + i * TT, t_hi, stride_cb, stride_ch, inside, num_blocks,
                     _warp_ids(bt_row, t_lo + i * TT, t_hi, c_warp, NSUB, NW, WT, BLOCK_SIZE), c_lane, c_warp,
                     NSUB, NW, WT, SLOT, BLOCK_SIZE)
    ids = _warp_ids(bt_row, t_lo + (STAGES - 1) * TT, t_hi, c_warp, NSUB, NW, WT, BLOCK_SIZE)

    # ---- queries: rotate, scale, fp16 with the row's largest element in [2**14, 2**15) (K's fp16 codes are
    # fp4 * 2**-14), per scale group in the K codes' k order; each row's factor back and causal limits
    qs = ()
    rfs = ()
    lims = ()
    firsts = ()
    # the smallest limit of the tiles' real rows (limit >= 1; padding rows have 0, their outputs are never
    # stored, so they need no mask) and the largest window start: a stage inside both (and the range, with
    # every block id good) needs no mask
    lim_lo = length
    first_hi = length * 0
    for t in gl.static_range(TILES):
        q = _fwht_split(q_ins[t].to(gl.float32), NW, ROWS, D, LOG2D, QL2)
        if HAS_SOFTCAP:
            q = q * scale
        else:
            q = q * (scale * LOG2E)
        e = gl.maximum(_floor_log2(gl.max(gl.abs(q), axis=2)), -100)
        qs = qs + _query_groups(q * gl.expand_dims(_pow2(14 - e), 2), NW, ROWS, QA)
        rfs = rfs + (gl.expand_dims(gl.convert_layout(_pow2(e), QR), 2),)
        lim, first = _row_limits(tg * TILES + t, length, n_new, window, GQA, ROWS, HAS_WINDOW,
                                 gl.SliceLayout(0, QR))
        lims = lims + (gl.expand_dims(gl.expand_dims(lim, 0), 2),)
        firsts = firsts + (gl.expand_dims(gl.expand_dims(first, 0), 2),)
        lim_lo = gl.minimum(lim_lo, gl.min(gl.where(lim > 0, lim, length), axis=0))
        first_hi = gl.maximum(first_hi, gl.max(first, axis=0))
    # the query fragments live in shared memory (loaded per MMA): their registers go to the accumulators
    q_smem = gl.allocate_shared_memory(gl.float16, [8 * TILES, NW, ROWS, 16], QS)
    for j in gl.static_range(8 * TILES):
        q_smem.index(j).store(qs[j])
    gl.thread_barrier()  # the stores are read in the stage loop: synced once here, not at its first read every stage

    ws = gl.expand_dims(gl.arange(0, NW, gl.SliceLayout(1, TK)) % WT, 1) * TW
    ns = gl.expand_dims(_physical_token(gl.arange(0, TW, gl.SliceLayout(0, TK))), 0)

    accs = ()  # n-tile k of M tile t at _acc_index(t, k, TILES) (_pv_words)
    for _t in gl.static_range(16 * TILES):
        accs = accs + (gl.zeros([NW, ROWS, 8], gl.float32, MMA),)
    m_is, l_is, run = _online_start(TILES, [NW, ROWS], QR, QW)
    for it in range(n_it):
        cur, t0, ids = _advance_ring(it, cache_ptr, bt_row, t_lo, t_hi, stride_cb, stride_ch, inside,
                                     num_blocks, ids, c_lane, c_warp, STAGES, TT, NSUB, NW, WT, SLOT, BLOCK_SIZE)
        whole = inside & (t0 >= first_hi) & (t0 + TT <= gl.minimum(lim_lo, t_hi))
        ss = _stage_scores(kc8, ks, q_smem, cur, t0, t_hi, ws, ns, inside, bt_row, num_blocks, rfs, lims,
                           firsts, softcap, whole, TILES, NSUB, NW, WT, TW, ROWS, H, BLOCK_SIZE, HAS_SOFTCAP,
                           HAS_WINDOW, MMA, KB, QA, TK)
        ps, alphas, m_is, l_is = _online_update(ss, m_is, l_is, TILES, NSUB, 2)  # ps[t NSUB + i]

        # V: scale word per token, one reference exponent per warp (all tiles) from the largest contribution
        vws = ()
        vtops = ()
        vexps = ()
        for i in gl.static_range(NSUB):
            vw = _piece(vs.index(cur + i), [NW, TW], TK, TK)
            vtop = _token_top(vw)
            vexps = vexps + (vtop - 127,)
            vws = vws + (vw,)
            vtops = vtops + (vtop,)
        cmax = ps[0] * gl.expand_dims(_pow2(gl.minimum(vexps[0], 127)), 1)
        amax = gl.max(alphas[0], axis=1)
        for t in gl.static_range(TILES):
            for i in gl.static_range(NSUB):
                if t + i > 0:
                    cmax = gl.maximum(cmax, ps[t * NSUB + i] * gl.expand_dims(_pow2(gl.minimum(vexps[i], 127)), 1))
            if t > 0:
                amax = gl.maximum(amax, gl.max(alphas[t], axis=1))
        ctop = _floor_log2(gl.max(gl.max(cmax, axis=2), axis=1))
        new_run = gl.maximum(run + _floor_log2(amax), ctop)
        down = gl.expand_dims(_pow2(gl.minimum(run - new_run, 127)), 1)
        nr = gl.expand_dims(gl.convert_layout(new_run, gl.SliceLayout(1, TK)), 1)
        scaled = ()
        for t in gl.static_range(TILES):
            scaled = scaled + (gl.expand_dims(alphas[t] * down, 2),)
        accs = _rescaled(accs, scaled, TILES)
        for i in gl.static_range(NSUB):
            accs = _pv_words(accs, vwa.index(cur + i), vwb.index(cur + i), vws[i], vtops[i], vexps[i], ps, i, nr,
                             TILES, NSUB, NW, MMA)
        run = new_run
    _ring_drained(c_lane)

    f = gl.expand_dims(gl.expand_dims(_pow2(gl.minimum(run, 127)), 1), 2)
    # partial (EP: a kv head's WT token groups in-thread) and merge (ML) layouts
    EP: gl.constexpr = gl.BlockedLayout([1, WT, 1, 4], [1, 1, 1, 32], [HK, 1, WT, 1], [3, 1, 2, 0])
    E3: gl.constexpr = gl.SliceLayout(3, EP)
    P3: gl.constexpr = gl.SliceLayout(1, EP)
    P2: gl.constexpr = gl.SliceLayout(1, E3)
    ML: gl.constexpr = _row_merge_layout(HK, ROWS, D, NW)
    M2: gl.constexpr = gl.SliceLayout(2, ML)
    for t in gl.static_range(TILES):
        tile = tg * TILES + t
        rows = ()
        for k in gl.static_range(16):
            rows = rows + (accs[_acc_index(t, k, TILES)] * f,)
        m_i = m_is[t]
        l_i = l_is[t]
        pair0 = (b * gl.num_programs(0) * TILES + tile) * HK  # the (tile, request) ticket's kv heads
        slot0 = tile * (progs + num_requests) + pid + b  # this piece's partial slot of the tile
        # ---- the program's partial of each kv head (its WT token groups combined) to the workspace
        acc_c, m_c, l_c = _combine_token_groups(_word_rows(rows, NW, ROWS, D), m_i,
                                                l_i, HK, WT, ROWS, D, EP)
        ph = _iota3(HK, 0, P3)
        pr = _iota3(ROWS, 1, P3)
        pc = _iota3(D, 2, P3)
        pslot = ((slot0 * HK + ph) * WT).to(gl.int64)
        gl.store(part_ptr + pslot * (ROWS * D) + pr * D + pc, acc_c, mask=(pr >= 0) & (pc >= 0) & (ph >= 0))
        ph2 = gl.expand_dims(gl.arange(0, HK, gl.SliceLayout(1, P2)), 1)
        pr2 = gl.expand_dims(gl.arange(0, ROWS, gl.SliceLayout(0, P2)), 0)
        mlp = ml_ptr + ((slot0 * HK + ph2) * WT).to(gl.int64) * (2 * ROWS) + pr2
        mlmask = (pr2 >= 0) & (ph2 >= 0)
        gl.store(mlp, m_c, mask=mlmask)
        gl.store(mlp + ROWS, l_c, mask=mlmask)
        gl.thread_barrier()
        ticket = gl.atomic_add(counter_ptr + pair0, 1)
        # the programs holding pieces of request b, p_first .. p_first + nparts - 1 (two 64-bit divisions),
        # computed while the ticket's round trip is in flight instead of ahead of the block ids
        p_first = _owner(cs, active, total)
        nparts = _owner(ce - 1, active, total) - p_first + 1
        if ticket == nparts - 1:
            # ---- last piece of this (tile, request): merge every head's partials, fold the sinks
            mh = _iota3(HK, 0, ML)
            mr = _iota3(ROWS, 1, ML)
            mc = _iota3(D, 2, ML)
            mh2 = gl.expand_dims(gl.arange(0, HK, gl.SliceLayout(1, M2)), 1)
            mr2 = gl.expand_dims(gl.arange(0, ROWS, gl.SliceLayout(0, M2)), 0)
            acc = gl.zeros([HK, ROWS, D], gl.float32, ML)
            m_a = gl.full([HK, ROWS], float("-inf"), gl.float32, M2)
            l_a = gl.zeros([HK, ROWS], gl.float32, M2)
            for s0 in range(0, nparts, MERGE):
                accs2 = ()
                ms2 = ()
                ls2 = ()
                for k in gl.static_range(MERGE):
                    s = s0 + k
                    src = tile * (progs + num_requests) + p_first + s + b
                    src3 = ((src * HK + mh) * WT).to(gl.int64)
                    src2 = ((src * HK + mh2) * WT).to(gl.int64)
                    live3 = (s < nparts) & (mr >= 0) & (mc >= 0) & (mh >= 0)
                    live2 = (s < nparts) & (mr2 >= 0) & (mh2 >= 0)
                    accs2 = accs2 + (gl.load(part_ptr + src3 * (ROWS * D) + mr * D + mc, mask=live3, other=0.0,
                                             cache_modifier=".cg"),)
                    ms2 = ms2 + (gl.load(ml_ptr + src2 * (2 * ROWS) + mr2, mask=live2, other=float("-inf"),
                                         cache_modifier=".cg"),)
                    ls2 = ls2 + (gl.load(ml_ptr + src2 * (2 * ROWS) + ROWS + mr2, mask=live2, other=0.0,
                                         cache_modifier=".cg"),)
                acc, m_a, l_a = _fold_partials(acc, m_a, l_a, accs2, ms2, ls2, MERGE)
            flat2 = tile * ROWS + mr2
            rmask2 = (flat2 // GQA < n_new) & (mh2 >= 0)
            if HAS_SINKS:
                sink = gl.load(sinks_ptr + mh2 * GQA + flat2 % GQA, mask=rmask2, other=0.0).to(gl.float32) * LOG2E
                acc, l_a = _fold_sink(acc, m_a, l_a, sink)
            o = _normalized(acc, l_a)
            flat3 = tile * ROWS + mr
            orow = (q_start + flat3 // GQA).to(gl.int64) * stride_on
            optr = out_ptr + orow + (mh * GQA + flat3 % GQA) * stride_oh + mc
            gl.store(optr, o.to(out_ptr.dtype.element_ty), mask=(flat3 // GQA < n_new) & (mc >= 0) & (mh >= 0))
            gl.atomic_xchg(counter_ptr + pair0, 0, sem="relaxed")  # no fence: the launch boundary orders it
    return ce


@gluon.jit
def uq_decode_multiquery(q_ptr, cache_ptr, bt_ptr, seqlen_ptr, qsl_ptr, sinks_ptr, out_ptr, part_ptr, ml_ptr,
                         counter_ptr, err_ptr, scale, softcap, window, max_tokens, num_requests, num_blocks, bt_cols,
                         stride_qn, stride_qh, stride_on, stride_oh,
                         stride_cb, stride_ct, stride_ch, stride_btb,
                         D: gl.constexpr, LOG2D: gl.constexpr, GQA: gl.constexpr, HK: gl.constexpr,
                         WT: gl.constexpr, NSUB: gl.constexpr, STAGES: gl.constexpr, TW: gl.constexpr,
                         BLOCK_SIZE: gl.constexpr, HAS_SINKS: gl.constexpr, HAS_WINDOW: gl.constexpr,
                         HAS_SOFTCAP: gl.constexpr, TILES: gl.constexpr, MIN_TOKENS: gl.constexpr,
                         PIECE_UNITS: gl.constexpr):
    """Multi-query whole-page decode, grid ``(tile groups, programs)``: ``TILES`` M tiles per program (each
    run's codes decoded once for all of them) over the whole-page decode's balanced schedule of the batch
    (:func:`~.decode_wholepage._schedule`, per tile group); see the module docstring."""
    TT: gl.constexpr = NSUB * WT * TW
    MIN_UNITS: gl.constexpr = max(1, MIN_TOKENS // TT)
    tg = gl.program_id(0)  # M tiles tg TILES .. tg TILES + TILES - 1
    pid = gl.program_id(1)
    progs = gl.num_programs(1)
    cap = bt_cols * BLOCK_SIZE
    reach = 0  # how far below a request's length its rows' windows reach: every row's window start is inside
    if HAS_WINDOW:
        reach = gl.minimum(window, cap) + max_tokens
    total, active, w0, w1, b_first, cs, b_last, pc = _schedule(seqlen_ptr, num_requests, reach, cap, pid, progs, TT,
                                                               HAS_WINDOW, MIN_UNITS, PIECE_UNITS, HK * WT)
    # one noinline call per piece, as the whole-page decode (ptxas schedules the stage loop as in a one-piece kernel)
    for b in range(b_first, b_last + 1):
        cs = _serve_piece(q_ptr, cache_ptr, bt_ptr, seqlen_ptr, qsl_ptr, sinks_ptr, out_ptr, part_ptr, ml_ptr,
                          counter_ptr, err_ptr, scale, softcap, window, reach, max_tokens, num_requests, num_blocks,
                          cap, stride_qn, stride_qh, stride_on, stride_oh, stride_cb, stride_ch, stride_btb,
                          b, cs, w0, w1, total, active, pid, progs, tg,
                          D, LOG2D, GQA, HK, WT, NSUB, STAGES, TW, BLOCK_SIZE, HAS_SINKS, HAS_WINDOW, HAS_SOFTCAP,
                          TILES) + pc
