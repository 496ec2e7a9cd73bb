"""The whole-page decode: paged decode that streams whole pages over a balanced persistent grid, for
NVIDIA sm_90, in Gluon.

Schedule (graph-safe, no host plan): the grid is fixed per device (``(programs, 1, 1)``, one program
per SM); every call, each program reads ``seq_lens`` and computes the same schedule (:func:`_schedule`):
a request has ``max(1, cdiv(len - lo_run, TT))`` units (``TT``-token ring stages from its window's first
stage) and costs ``PIECE_UNITS`` more (a piece's overhead; none for equal requests), the batch's ``total``
cost is dealt in equal contiguous shares ``[p total // active, (p + 1) total // active)`` to ``active =
min(programs, cdiv(total, MIN_UNITS))`` programs, so a request's tokens may span programs and a program may
serve several requests in turn (one piece each; a program of many short requests gets fewer stages). A piece leaves one
partial per kv head in workspace slot ``program + request`` (unique: the pieces form a staircase); every
program derives from the same arithmetic which programs hold a request's pieces (:func:`_owner`), so
the one that takes the request's last ticket merges them in the same launch and writes ``out``; a request
served by one piece writes ``out`` directly. The
run-time arguments are split-KV decode's, the split count's slot holding the batch size
(``WHOLEPAGE_PARAMS``; a pure-Python model of the schedule:
``families.decode_wholepage.wholepage_schedule``).

Reads: one program (CTA) owns ALL kv heads of a piece and streams it through an asynchronous
global -> shared-memory ring (``cp.async``, ``STAGES`` deep): stage ``i`` holds ``TT = NSUB * WT * 16``
consecutive tokens of every kv head as ``NSUB * NW`` runs of 16 whole slots, each run one contiguous
piece of a head-major page copied with 16-byte ``cp.async`` (136 chunks at D=128) into the ring exactly as it
lies in global memory. The math reads its operands (K codes, V codes, the two scale words) straight from that
raw ring through padded shared layouts (136-byte slots = 128 + 8 padding bytes), so no copy is split into
pieces. Each run is read by one warp only (run ``j NW + w``: warp ``w``), so each warp copies its own runs
(:func:`_issue_stage`: inline PTX at ``global_smem`` + the ring's offset 0, which Triton's barrier analysis does
not see) and waits for its own copies: the stage loop has no CTA barrier. Token-major pages (``TOKEN_MAJOR``, a
prototype: Hk > 1, the ``(block, token, head, slot)`` order) are contiguous per block for ALL kv heads: a stage is
copied as it lies in the page in 16-byte chunks (:func:`_issue_stage_tm`), 16 bytes of padding after every token
pair, and the same views read it at token-major bases (:func:`_token_major_layout`).

Math, per warp (warp ``w`` serves kv head ``w // WT`` and the ``w % WT``-th ``TW`` tokens of each
sub-tile; per-warp online softmax, no cross-warp traffic in the loop), as the Gluon experiment of
the prototype that passed every correctness case (benchmarks/NOTES.md): batched 3-D ``mma_v2`` (the warp is the batch),
the query rotated once in registers, FP4 codes decoded by inline PTX straight into the MMA operands
(a code word's four fp16 pairs in 11 instructions, :func:`_word_pairs`), K scales after the MMA per
32-element group, V scales like split-KV (each token's largest scale on the probability with a running
reference exponent; V outliers 2^20 apart stay exact); above GQA 8 (D=128) two 8-row query groups share
each decoded K/V fragment (:func:`_qk_runs2`, :func:`_pv_word2`). Each piece is one call of the noinline
:func:`_serve_piece`, which allocates the ring (ptxas schedules its stage loop as in a one-piece kernel;
a ring passed in from the kernel would overlap the callee's scratch). After the loop the WT warps of each kv head
combine their (m, l, acc) inside the program and each piece leaves one partial per kv head in the
workspace; the last program of a request (atomic ticket) merges them for all heads, folds the sinks
and writes ``out``.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from ..flags import KernelError
from ..triton.attention import _nibble_pair

LOG2E = gl.constexpr(1.4426950408889634)
ERR_BLOCK = gl.constexpr(KernelError.BLOCK_OUT_OF_RANGE.bit_length() - 1)
ERR_SEQ_LEN = gl.constexpr(KernelError.SEQ_LEN_OUT_OF_RANGE.bit_length() - 1)
"""Error words (``err_ptr``) of the bounds contract (docs/kernels.md, "Bounds"), as the Triton kernels'."""

_FP4_SCALED_ASM = gl.constexpr(" ".join([
    "{ .reg .b32 x, y, a, c;",
    "prmt.b32 x, $4, 0, 0x4140;",  # bytes 0 and 1 of the input word into the two 16-bit lanes
    "prmt.b32 y, $4, 0, 0x4342;",  # bytes 2 and 3
    _nibble_pair("a", "x", 9, 12), "mul.rn.f16x2 $0, a, $5;",  # low nibbles of bytes 0, 1, scaled
    _nibble_pair("a", "y", 9, 12), "mul.rn.f16x2 $1, a, $6;",
    _nibble_pair("a", "x", 5, 8), "mul.rn.f16x2 $2, a, $5;",  # high nibbles
    _nibble_pair("a", "y", 5, 8), "mul.rn.f16x2 $3, a, $6;",
    "}",
]))
"""split-KV decode's nibble -> fp16 PTX (``_nibble_pair``) with the relative scales ($5, $6) multiplied in."""


def _word_pairs(outs: list[str], src: str) -> str:
    """PTX: the four nibble pairs (``i``, ``i + 4``) of word ``src`` as fp16 patterns ``fp4 * 2**-14``
    (magnitude bits to 11..9, sign to 15) into ``outs[i]``. Every byte first becomes one pattern byte
    per nibble: the low nibbles' (X: magnitude << 1, sign << 4) and the high nibbles' (Y: magnitude
    >> 3, sign in place), then bytes 1, 3 stay where they are (pairs 2, 3) and bytes 0, 2 move up one
    byte (pairs 0, 1): 11 instructions per word instead of 4 per pair."""
    o0, o1, o2, o3 = outs
    return (f"shl.b32 t1, {src}, 1; shl.b32 t2, {src}, 4; and.b32 t1, t1, 0x0E0E0E0E; "
            f"and.b32 t2, t2, 0x80808080; or.b32 t1, t1, t2; "
            f"shr.b32 t3, {src}, 3; and.b32 t3, t3, 0x0E0E0E0E; and.b32 t2, {src}, 0x80808080; "
            f"or.b32 t3, t3, t2; "
            f"prmt.b32 {o0}, t1, 0, 0x2404; and.b32 {o2}, t1, 0xFF00FF00; "
            f"prmt.b32 {o1}, t3, 0, 0x2404; and.b32 {o3}, t3, 0xFF00FF00;")


def _qk_ptx(groups: int = 1) -> str:
    """PTX of :func:`_qk_runs` (``groups`` = 2: :func:`_qk_runs2`, two 8-row query groups over the same K
    fragments): per scale group g, the K words of tokens n and n + 8 become fp16 A fragments of two
    ``m16n8k16`` steps (nibbles (0, 4) and (1, 5) of a word are the first step's k pairs, (2, 6) and
    (3, 7) the second's), two MMAs per row group with its query fragments, then the group's UE8M0 scale
    (byte g of the scale words of tokens n / n + 8: ``byte << 23`` is ``2**(byte - 127)``) times the
    group's scores, summed into row group r's outputs $4r..$4r + 3. Inputs from $4G: K words (2 x 4),
    scale words (4), then per row group 4 x 4 query words. The decode is shared by the row groups."""
    acc_regs = [f"{c}{k}" for c in "ef"[:groups] for k in range(4)]
    lines = ["{ .reg .b32 t1, t2, t3, p0, p1, p2, p3, r0, r1, r2, r3, fa, fb; "
             f".reg .f32 {', '.join(acc_regs)}, z;", "mov.f32 z, 0f00000000;"]
    base = 4 * groups
    kw = base + 8
    for g in range(4):
        x = base + (g % 2) + 4 * (g // 2)  # token n's word of group g; token n + 8's is 2 further
        lines += [_word_pairs(["p0", "p1", "p2", "p3"], f"${x}"), _word_pairs(["r0", "r1", "r2", "r3"], f"${x + 2}")]
        for r in range(groups):
            e = "ef"[r]
            q = base + 12 + 16 * r + 4 * g
            mma = f"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {{{e}0, {e}1, {e}2, {e}3}}, "
            for step in range(2):
                a = f"{{p{2 * step}, r{2 * step}, p{2 * step + 1}, r{2 * step + 1}}}, "
                acc = "{z, z, z, z}" if step == 0 else f"{{{e}0, {e}1, {e}2, {e}3}}"
                lines += [mma + a + f"{{${q + 2 * step}, ${q + 2 * step + 1}}}, {acc};"]
        shift = 23 - 8 * g
        lines += [f"shl.b32 fa, ${kw}, {shift}; shl.b32 fb, ${kw + 2}, {shift};" if shift > 0
                  else f"shr.b32 fa, ${kw}, 1; shr.b32 fb, ${kw + 2}, 1;",
                  "and.b32 fa, fa, 0x7F800000; and.b32 fb, fb, 0x7F800000;"]
        for r in range(groups):
            e, o = "ef"[r], 4 * r
            if g == 0:
                lines += [f"mul.f32 ${o}, {e}0, fa; mul.f32 ${o + 1}, {e}1, fa; mul.f32 ${o + 2}, {e}2, fb; "
                          f"mul.f32 ${o + 3}, {e}3, fb;"]
            else:
                lines += [f"fma.rn.f32 ${o}, {e}0, fa, ${o}; fma.rn.f32 ${o + 1}, {e}1, fa, ${o + 1}; "
                          f"fma.rn.f32 ${o + 2}, {e}2, fb, ${o + 2};", f"fma.rn.f32 ${o + 3}, {e}3, fb, ${o + 3};"]
    return " ".join(lines + ["}"])


_QK_ASM = gl.constexpr(_qk_ptx())
_QK_CONSTRAINTS = gl.constexpr(",".join(["=f"] * 4 + ["r"] * 28))
"""Scores of one 16-token run (:func:`_qk_runs`): 4 scores out, 7 x 4 words in."""
_QK2_ASM = gl.constexpr(_qk_ptx(2))
_QK2_CONSTRAINTS = gl.constexpr(",".join(["=f"] * 8 + ["r"] * 44))
"""The same for two row groups (:func:`_qk_runs2`): 2 x 4 scores out, 3 x 4 + 2 x 4 x 4 words in."""


def _vword_pairs_ptx(vw: int, half: int) -> list[str]:
    """PTX: bytes ``2 half``, ``2 half + 1`` of the V words ``$vw..$vw + 3`` of tokens (a, b, c, d), tokens a, b
    (c, d) put in the two 16-bit lanes by PRMT, as the nibble pairs ``p0..p3`` (``r0..r3``) of
    :func:`_word_pairs`: the fp16 operands of both decodes' PV MMAs (registers t1..t3, z0, z1 scratch)."""
    sel = "0x5410" if half == 0 else "0x7632"
    return [f"prmt.b32 z0, ${vw}, ${vw + 1}, {sel}; prmt.b32 z1, ${vw + 2}, ${vw + 3}, {sel};",
            _word_pairs(["p0", "p1", "p2", "p3"], "z0"), _word_pairs(["r0", "r1", "r2", "r3"], "z1")]


def _pv_word_ptx(groups: int = 1) -> str:
    """PTX of :func:`_pv_word` (``groups`` = 2: :func:`_pv_word2`, two 8-row groups of probabilities
    over the same V fragments): the four 16-dim output tiles whose V codes are the four bytes of one V
    word of tokens (a, b, c, d). PRMT puts bytes 0, 1 (then 2, 3) of tokens a and b (c and d) into the
    two 16-bit lanes, so the word's nibble pairs (:func:`_word_pairs`) are the tiles' fp16 A fragments:
    byte k's low / high nibbles are fragments 0 / 1 of tile k (tokens a, b; 2 / 3 for c, d). Times the
    tokens' relative scales (a, b; c, d), one ``m16n8k16`` MMA per tile and row group with that group's
    probability fragments. Operands: outputs (row group r, tile k) $16r + 4k.., the accumulators in
    the same order from $16G, then the V words (4), then per row group the words of :func:`_pv_frags`
    (4: the group's two probability fragments, then the relative scales, which only the first group's
    words carry)."""
    n = 16 * groups
    vw, rel = 2 * n, 2 * n + 6
    lines = ["{ .reg .b32 t1, t2, t3, z0, z1, p0, p1, p2, p3, r0, r1, r2, r3;"]
    for half in range(2):
        lines += _vword_pairs_ptx(vw, half)
        for b in range(2):  # tile k = 2 half + b: pairs 2b, 2b + 1
            k = 2 * half + b
            a0, a1, a2, a3 = f"p{2 * b}", f"p{2 * b + 1}", f"r{2 * b}", f"r{2 * b + 1}"
            lines += [f"mul.rn.f16x2 {a0}, {a0}, ${rel}; mul.rn.f16x2 {a1}, {a1}, ${rel}; "
                      f"mul.rn.f16x2 {a2}, {a2}, ${rel + 1}; mul.rn.f16x2 {a3}, {a3}, ${rel + 1};"]
            for r in range(groups):
                o, pf = 16 * r + 4 * k, 2 * n + 4 + 4 * r
                lines += [f"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {{${o}, ${o + 1}, ${o + 2}, "
                          f"${o + 3}}}, {{{a0}, {a1}, {a2}, {a3}}}, {{${pf}, ${pf + 1}}}, {{${n + o}, ${n + o + 1}, "
                          f"${n + o + 2}, ${n + o + 3}}};"]
    return " ".join(lines + ["}"])

_PV_ASM = gl.constexpr(_pv_word_ptx())
_PV_CONSTRAINTS = gl.constexpr(",".join(["=f"] * 16 + ["f"] * 16 + ["r"] * 8))
"""The four output tiles of one V word of one run (:func:`_pv_word`): 4 x 4 accumulators out and in,
2 x 4 words."""
_PV2_ASM = gl.constexpr(_pv_word_ptx(2))
_PV2_CONSTRAINTS = gl.constexpr(",".join(["=f"] * 32 + ["f"] * 32 + ["r"] * 12))
"""The same for two row groups (:func:`_pv_word2`): 2 x 4 x 4 accumulators out and in, 3 x 4 words."""


def _pv_frags_ptx(rel: bool) -> str:
    """PTX of :func:`_pv_frags`: the score layout's probabilities (``$4..$7``: tokens g, g + 8 of lane group
    g, rows 2t, 2t + 1) as fp16 pairs of the two 8 x 8 token x row blocks, each transposed across the warp
    by one ``movmatrix`` into the PV B fragments (tokens 2t, 2t + 1 and 2t + 8, 2t + 9 of row g: ``$0``,
    ``$1``); with ``rel``, the relative scales (``$8..$11``, fp16 bits, by row = the consumer's lane
    group) the same way into ``$2``, ``$3``."""
    mov = "movmatrix.sync.aligned.m8n8.trans.b16"
    lines = ["{ .reg .b32 x0, x1;", "cvt.rn.f16x2.f32 x0, $5, $4; cvt.rn.f16x2.f32 x1, $7, $6;",
             f"{mov} $0, x0; {mov} $1, x1;"]
    if rel:
        lines += ["prmt.b32 x0, $8, $9, 0x5410; prmt.b32 x1, $10, $11, 0x5410;", f"{mov} $2, x0; {mov} $3, x1;"]
    else:
        lines += ["mov.b32 $2, 0; mov.b32 $3, 0;"]
    return " ".join(lines + ["}"])


_PVF_ASM = gl.constexpr(_pv_frags_ptx(True))
_PF_ASM = gl.constexpr(_pv_frags_ptx(False))


@gluon.constexpr_function
def _v_layout(nw, tw, words=False):
    """V bytes as read from shared memory: [NW, TW tokens, 8 (lane group g), 8 (byte r)], byte 8g + r
    of the V codes; after permute/reshape to [NW, TW, 64] the column index is 8r + g (what the PV
    B operand puts on lane group g). Tokens 16..TW-1 go to further registers. ``words``: the same
    elements with bytes 4..7 after the next token in register order, so the shared load is 4-byte
    words (the V codes start at slot byte 68: 8-byte loads there are misaligned); converting to the
    plain layout only renames registers."""
    r4 = [[0, 1, 0, 0], [0, 0, 0, 4]] if words else [[0, 0, 0, 4], [0, 1, 0, 0]]
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 1], [0, 0, 0, 2]] + r4 + [[0, 8, 0, 0]]
        + [[0, 16 << i, 0, 0] for i in range(tw.bit_length() - 5)],
        lane_bases=[[0, 2, 0, 0], [0, 4, 0, 0], [0, 0, 1, 0], [0, 0, 2, 0], [0, 0, 4, 0]],
        warp_bases=[[1 << i, 0, 0, 0] for i in range(nw.bit_length() - 1)], block_bases=[],
        shape=[nw, tw, 8, 8])


TOKEN_BASES = gl.constexpr([8, 4, 1, 2])
"""Logical token (MMA column / PV row) of each bit of a run's physical token index (a bit permutation):
the 4 tokens one half-warp reads for K (logical 0..3) sit 4 slots (8 banks) apart, so the K reads have
no bank conflicts at the 136-byte slot stride (identity order: 4-way); V reads stay at most 2-way."""


@gluon.constexpr_function
def _hm_token_bases(slot):
    """``TOKEN_BASES`` per slot size (0: D=128's) for head-major runs. At D=256 (272-byte slots, a 4-bank
    token stride) the identity order is the conflict-free one (K and scale reads 1-way, D=128's order 2-way,
    in the bank model of tests/test_decode_wholepage_token_major.py; shape C 3% faster on the H200,
    benchmarks/NOTES.md)."""
    return [1, 2, 4, 8] if slot == 272 else TOKEN_BASES.value


@gluon.jit
def _physical_token(j):
    """The physical token of a run that holds logical token ``j`` (inverse of ``TOKEN_BASES``)."""
    return ((j >> 3) & 1) | (((j >> 2) & 1) << 1) | ((j & 1) << 2) | (((j >> 1) & 1) << 3)


@gluon.constexpr_function
def _pair_pad(hk, slot, token_major):
    """Words of shared-memory padding after every second token of a token-major ring stage (0 for
    head-major). A token of all ``hk`` kv heads is ``hk * slot / 4`` words; unless that is ``4 * odd``
    mod 32 banks, consecutive tokens of one head would share banks (8 kv heads at D=128: 272 words = 16
    banks, the K reads 4-way conflicts). 4 words per token pair (half a per-token padding, as good in the
    bank model) with the token order of :func:`_tm_token_bases` makes the K and scale reads conflict-free and
    the V reads 2-way at D=128, as head-major's (tests/test_decode_wholepage_token_major.py models them)."""
    if not token_major:
        return 0
    return 0 if (hk * slot // 4) % 8 == 4 else 4


@gluon.constexpr_function
def _tm_spad(hk, slot, tt, xp, nw, token_major):
    """``SPAD`` of :func:`_tm_stage` (0 for head-major)."""
    return _tm_stage(hk, slot, tt, xp, nw, "SPAD") if token_major else 0


@gluon.constexpr_function
def _tm_token_bases(hk, slot):
    """Logical token of each bit of a token-major run's physical token index (``TOKEN_BASES``' role), per
    (kv heads, slot bytes): chosen with :func:`_pair_pad` by the bank model of
    tests/test_decode_wholepage_token_major.py."""
    return {(2, 136): [1, 2, 4, 8], (4, 136): [1, 2, 8, 4], (8, 136): [2, 1, 4, 8],
            (2, 272): [1, 2, 8, 4], (4, 272): [1, 2, 4, 8], (8, 272): [8, 1, 2, 4]}[(hk, slot)]


@gluon.constexpr_function
def _tm_bit(hk, slot, i):
    """log2 of bit ``i``'s logical token in :func:`_tm_token_bases`."""
    return _tm_token_bases(hk, slot)[i].bit_length() - 1


@gluon.jit
def _tm_physical_token(j, HK: gl.constexpr, SLOT: gl.constexpr):
    """The physical token of a token-major run that holds logical token ``j`` (inverse of
    :func:`_tm_token_bases`)."""
    p = j * 0
    for i in gl.static_range(4):
        p = p | (((j >> _tm_bit(HK, SLOT, i)) & 1) << i)
    return p


@gluon.constexpr_function
def _slot_layout(interval, pad, shape, last=None, hk=0, xpad=0, slot=0, nsub=1, spad=0):
    """Padded view of ring entries ``[NW, 16 tokens, 2, ...]``: identity over the slot piece (the last
    axes; ``last``: the logical index of each bit of the last axis instead), ``interval + pad`` elements
    per slot, run tokens permuted by ``_hm_token_bases(slot)``. ``hk`` > 0: a token-major stage
    (``_token_major_layout``)."""
    if hk:
        return _token_major_layout(interval, pad, shape, last, hk, xpad, slot, nsub, spad)
    bases = []
    for dim in reversed(range(len(shape))):
        for bit in range(shape[dim].bit_length() - 1):
            v = _hm_token_bases(slot)[bit] if dim == 1 else 1 << bit
            if last is not None and dim == len(shape) - 1:
                v = last[bit]
            bases.append([v if i == dim else 0 for i in range(len(shape))])
    return gl.PaddedSharedLayout([[interval, pad]], bases, [], list(shape))


@gluon.constexpr_function
def _token_major_layout(interval, pad, shape, last, hk, xpad, slot, nsub, spad):
    """:func:`_slot_layout` over a token-major ring entry (``WT`` groups of 16 tokens x ``hk`` kv heads,
    each token's ``hk`` slots contiguous as in the page, ``xpad`` padding elements after every second
    token): slot ``s`` of the entry holds kv head ``s % hk`` (warps ``h WT ..``) of physical token
    ``(s // hk) % 16`` of token group ``s // (16 hk)`` (warp ``% WT``), tokens ordered by
    :func:`_tm_token_bases`; ``spad`` elements after every stage of ``nsub`` entries (:func:`_tm_stage`)."""
    n = len(shape)
    bases = []
    for dim in reversed(range(2, n)):
        for bit in range(shape[dim].bit_length() - 1):
            v = last[bit] if last is not None and dim == n - 1 else 1 << bit
            bases.append([v if i == dim else 0 for i in range(n)])
    wt = shape[0] // hk
    bases += [[wt << b if i == 0 else 0 for i in range(n)] for b in range(hk.bit_length() - 1)]
    bases += [[t if i == 1 else 0 for i in range(n)] for t in _tm_token_bases(hk, slot)]
    bases += [[1 << b if i == 0 else 0 for i in range(n)] for b in range(wt.bit_length() - 1)]
    pairs = [[interval, pad]] + ([[2 * hk * interval, xpad]] if xpad else [])
    pairs += [[_prod(shape) * nsub, spad]] if spad else []
    return gl.PaddedSharedLayout(pairs, bases, [], list(shape))


@gluon.constexpr_function
def _prod(shape):
    """The product of ``shape``."""
    n = 1
    for x in shape:
        n *= x
    return n


@gluon.constexpr_function
def _merge_step(per_thread, budget):
    """Partials per step of the last program's merge: their loads overlap, up to ``budget`` values per thread
    (``per_thread`` of each partial) and 8 partials, so the merge does not spill (the decode: 64 in
    :func:`_merge_layout`; the multi-query decode: 128, its layout holding few row scalars)."""
    return max(1, min(8, budget // max(1, per_thread)))


@gluon.constexpr_function
def _merge_layout(hk, rows, d, nw):
    """The last program's layout of ``[HK, rows, D]`` partials: warps over the kv heads, then the rows, then
    the dims; lanes and up to 4 consecutive dims per thread (16-byte loads) along the dims, so no two threads
    load the same element while the tensor has >= 32 * NW of them (warps only over heads and dims loaded
    each element NW / HK times at Hk < NW: 8x at one kv head, through L2, ~20 us at GQA 16 Hk 2)."""
    wh = min(hk, nw)
    wr = min(rows, nw // wh)
    wd = nw // (wh * wr)
    vec = max(1, min(4, d // (32 * wd)))
    return gl.BlockedLayout([1, 1, vec], [1, 1, 32], [wh, wr, wd], [2, 1, 0])


@gluon.jit
def _fold_partials(acc, m_a, l_a, accs, ms, ls, MERGE: gl.constexpr):
    """Fold ``MERGE`` loaded partials (``accs`` [HK, rows, D], row maxima ``ms`` and sums ``ls`` in base 2)
    into the running merge ``(acc, m_a, l_a)``: one rescale of the running rows, one per partial."""
    m_n = m_a
    for k in gl.static_range(MERGE):
        m_n = gl.maximum(m_n, ms[k])
    m_s = gl.where(m_n == float("-inf"), 0.0, m_n)
    a1 = gl.exp2(m_a - m_s)
    acc = acc * gl.expand_dims(a1, 2)
    l_a = l_a * a1
    for k in gl.static_range(MERGE):
        a2 = gl.exp2(ms[k] - m_s)
        acc = acc + accs[k] * gl.expand_dims(a2, 2)
        l_a = l_a + ls[k] * a2
    return acc, m_n, l_a


@gluon.jit
def _fold_sink(acc, m_a, l_a, sink):
    """The merged rows with each head's sink logit (base 2) added to the softmax's mass (no value)."""
    m_n = gl.maximum(m_a, sink)
    acc = acc * gl.expand_dims(gl.exp2(m_a - m_n), 2)
    l_a = l_a * gl.exp2(m_a - m_n) + gl.exp2(sink - m_n)
    return acc, l_a


@gluon.jit
def _normalized(acc, l_a):
    """The merged rows' output ``acc / l``; rows that saw no key (``l == 0``) are 0."""
    denom = gl.where(l_a > 0.0, l_a, 1.0)
    return gl.where(gl.expand_dims(l_a > 0.0, 2), acc / gl.expand_dims(denom, 2), 0.0)


@gluon.jit
def _write_out(acc, m_a, l_a, out_ptr, b, sinks_ptr, h3, r3, c3, h2, r2, live3, live2, stride_ob, stride_oh,
               GQA: gl.constexpr, HAS_SINKS: gl.constexpr):
    """Request ``b``'s merged ``[HK, rows, D]`` partial ``(acc, m_a, l_a)`` to its output row: each head's sink
    folded in, normalized, row ``r`` of kv head ``h`` at query head ``h GQA + r``. ``h3``/``r3``/``c3`` and
    ``h2``/``r2``: the indices in ``acc``'s and in ``l_a``'s layouts; ``live3``/``live2``: their real rows
    (``r < GQA``)."""
    if HAS_SINKS:
        sink = gl.load(sinks_ptr + h2 * GQA + r2, mask=live2, other=0.0).to(gl.float32) * LOG2E
        acc, l_a = _fold_sink(acc, m_a, l_a, sink)
    o = _normalized(acc, l_a)
    optr = out_ptr + b.to(gl.int64) * stride_ob + (h3 * GQA + r3) * stride_oh + c3
    gl.store(optr, o.to(out_ptr.dtype.element_ty), mask=live3)


@gluon.constexpr_function
def _pick(cond, a, b):
    """``a`` if ``cond`` else ``b`` (layouts chosen by a constexpr flag)."""
    return a if cond else b


@gluon.jit
def _iota3(n: gl.constexpr, axis: gl.constexpr, L: gl.constexpr):
    """``arange(n)`` along ``axis`` of a 3-D tensor in layout ``L`` (size 1 on the other axes)."""
    if axis == 0:
        return gl.expand_dims(gl.expand_dims(gl.arange(0, n, gl.SliceLayout(1, gl.SliceLayout(2, L))), 1), 2)
    elif axis == 1:
        return gl.expand_dims(gl.expand_dims(gl.arange(0, n, gl.SliceLayout(0, gl.SliceLayout(2, L))), 0), 2)
    else:
        return gl.expand_dims(gl.expand_dims(gl.arange(0, n, gl.SliceLayout(0, gl.SliceLayout(1, L))), 0), 1)


@gluon.constexpr_function
def _with_unit_axes(layout, n):
    """Linear ``layout`` with ``n`` trailing size-1 axes (to load a sliced shared view)."""
    def ins(bases):
        return [list(b) + [0] * n for b in bases]
    return gl.DistributedLinearLayout(ins(layout.reg_bases), ins(layout.lane_bases), ins(layout.warp_bases),
                                      ins(layout.block_bases), list(layout.shape) + [1] * n)


@gluon.jit
def _piece(view, shape: gl.constexpr, layout: gl.constexpr, load: gl.constexpr):
    """Load index 0 of every trailing axis of a ring view past ``shape`` (the slot piece, not the rest
    of the slot) as ``shape`` in ``load`` (``layout`` or a register reordering of it that sets the
    vector width of the shared loads), returned in ``layout``; no data moves between threads."""
    R: gl.constexpr = len(shape)
    if len(view.shape) == R + 2:
        view = view.slice(0, 1, R + 1)
    view = view.slice(0, 1, R)
    x = view.load(_with_unit_axes(gl.to_linear_layout(load, shape), len(view.shape) - R))
    return gl.convert_layout(gl.reshape(x, shape), layout)


@gluon.jit
def _pow2(e):
    """``2**e`` as an exact float32 for int32 ``e`` in [-126, 127] (0.0 below)."""
    return (gl.maximum(e + 127, 0) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _floor_log2(x):
    """floor(log2(x)) of non-negative normal float32 ``x`` from its exponent bits (-127 for 0)."""
    return ((x.to(gl.int32, bitcast=True) >> 23) & 0xFF) - 127


@gluon.jit
def _fp4_decode(b, rel):
    """(low, high) nibbles of uint8 ``b`` as fp16 times fp16 ``rel`` (4 bytes per asm block): two
    PRMT place byte pairs in the 16-bit lanes, shifts and masks build the subnormal pattern
    ``fp4 * 2**-14``, one ``mul.f16x2`` applies the relative scale."""
    return gl.inline_asm_elementwise(
        asm=_FP4_SCALED_ASM,
        constraints="=r,=r,=r,=r,r,r,r",
        args=[b, rel],
        dtype=(gl.float16, gl.float16),
        is_pure=True,
        pack=4,
    )


@gluon.jit
def _qk_runs(ka, kb, kw, q0, q1, q2, q3):
    """Scores ``S^T`` of one 16-token run (MMA accumulator layout ``[NW, 16, 8]``) from K code words
    ``ka``/``kb`` (element (n, 2i + c): word i of scale group c / 2 + c of token n), the token's scale
    word ``kw`` and the query fragments ``q0..q3`` (:func:`_query_frags`): the FP4 codes go to fp16
    fragments one scale group at a time (two MMA k-steps per group), and the UE8M0 scales multiply
    each group's partial scores after the MMA (no per-element scale, no relative scales)."""
    return gl.inline_asm_elementwise(
        asm=_QK_ASM,
        constraints=_QK_CONSTRAINTS,
        args=[ka, kb, kw, q0, q1, q2, q3],
        dtype=gl.float32,
        is_pure=True,
        pack=4,
    )


@gluon.jit
def _query_frags(q, NW: gl.constexpr, L: gl.constexpr):
    """The query's fp16 B fragments for :func:`_qk_runs`: float32 ``q`` ``[NW, 8 rows, 128]`` as words of
    two fp16 (row r, group g, lane t, step s, fragment b: elements ``32g + 8t + 2s + b`` and ``+ 4``,
    the k pair that K word t's nibbles give that fragment), laid out in ``L`` (the MMA accumulator
    layout of ``[NW, 16, 8]``: element (8s + r, 2t + b)), one tensor per scale group g."""
    x = gl.permute(gl.reshape(q, [NW, 8, 4, 4, 2, 2, 2]), [0, 1, 2, 3, 5, 6, 4])  # r, g, t, s, b, pair
    bits = x.to(gl.float16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    lo, hi = gl.split(bits)
    w = gl.permute(lo | (hi << 16), [0, 4, 1, 3, 5, 2])  # s, r, t, b, g
    w = gl.reshape(w, [NW, 16, 8, 2, 2])                 # g = 2 * g1 + g0
    e0, e1 = gl.split(w)                                 # g0 = 0, 1
    g0, g2 = gl.split(e0)
    g1, g3 = gl.split(e1)
    return (gl.convert_layout(g0, L), gl.convert_layout(g1, L), gl.convert_layout(g2, L),
            gl.convert_layout(g3, L))


@gluon.jit
def _pv_word(acc0, acc1, acc2, acc3, vw, fr):
    """``acc += V^T P^T`` for the four output tiles of one V word of one run (MMA accumulator layout
    ``[NW, 16, 8]``): tile row r of lane group g of the tile of byte k of V word w is dim
    ``16 g + 2 (4 w + k) + r // 8``; ``vw`` holds that V word of tokens (a, b, c, d) = (2t, 2t + 1,
    2t + 8, 2t + 9), ``fr`` the probability fragments and those tokens' relative scales as fp16 pairs
    (:func:`_pv_operands`)."""
    return gl.inline_asm_elementwise(
        asm=_PV_ASM,
        constraints=_PV_CONSTRAINTS,
        args=[acc0, acc1, acc2, acc3, vw, fr],
        dtype=(gl.float32, gl.float32, gl.float32, gl.float32),
        is_pure=True,
        pack=4,
    )


@gluon.jit
def _qk_runs2(ka, kb, kw, q0, q1, q2, q3, q4, q5, q6, q7):
    """:func:`_qk_runs` for two 8-row query groups (fragments ``q0..q3`` and ``q4..q7``) over the same K
    fragments (decoded once): the scores of rows 0..7 and 8..15."""
    return gl.inline_asm_elementwise(
        asm=_QK2_ASM,
        constraints=_QK2_CONSTRAINTS,
        args=[ka, kb, kw, q0, q1, q2, q3, q4, q5, q6, q7],
        dtype=(gl.float32, gl.float32),
        is_pure=True,
        pack=4,
    )


@gluon.jit
def _pv_word2(acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, vw, fr, fr2):
    """:func:`_pv_word` for two 8-row groups (accumulators ``acc0..3`` with ``fr``, ``acc4..7`` with the
    second group's probability fragments ``fr2``) over the same V fragments (decoded and scaled once)."""
    return gl.inline_asm_elementwise(
        asm=_PV2_ASM,
        constraints=_PV2_CONSTRAINTS,
        args=[acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, vw, fr, fr2],
        dtype=(gl.float32, gl.float32, gl.float32, gl.float32, gl.float32, gl.float32, gl.float32, gl.float32),
        is_pure=True,
        pack=4,
    )


@gluon.jit
def _pv_frags(pf, rel, with_rel: gl.constexpr):
    """The PV operand words of one run from the score layout ``[NW, 16 tokens, 8 rows]`` (the MMA accumulator
    layout): float32 probabilities ``pf`` and int32 ``rel`` (fp16 bits) become, per thread, the B fragments
    (words 0, 1) and, ``with_rel``, the relative scales of those tokens (words 2, 3) by ``movmatrix``
    transposes (:func:`_pv_frags_ptx`): 2 conversions and 2-4 transposes a run instead of a shuffle
    transposition of packed halves."""
    return gl.inline_asm_elementwise(
        asm=_PVF_ASM if with_rel else _PF_ASM,
        constraints="=r,=r,=r,=r,f,f,f,f,r,r,r,r",
        args=[pf, rel],
        dtype=gl.int32,
        is_pure=True,
        pack=4,
    )


@gluon.jit
def _pv_operands(p, vsw, vsw1, vtop, nr_t, D: gl.constexpr, with_rel: gl.constexpr, L: gl.constexpr):
    """Probability fragments and relative V scales of one run for :func:`_pv_word` (:func:`_pv_frags`),
    both from the score layout ``[NW, 16 tokens, 8 rows]``: ``p * 2**(top - 127 - nr)`` (the token's largest
    V scale against the running reference exponent ``nr_t``) and ``2**(scale of group g D / 256 - top + 14)``
    (``_rel_scale``; g: the consumer's lane group, which is the row index here; scale words ``vsw``,
    ``vsw1``: groups 0..3, 4..7)."""
    pf = p * _pow2(gl.minimum(vtop - 127 - nr_t, 127))
    rel = pf.to(gl.int32, bitcast=True)
    if with_rel:
        grp = gl.expand_dims(gl.expand_dims(gl.arange(0, 8, gl.SliceLayout(0, gl.SliceLayout(1, L))), 0), 1) * D // 256
        if D == 256:
            vsw = gl.where(grp < 4, vsw, vsw1)
        rel = _rel_scale(vsw, vtop, grp % 4).to(gl.int16, bitcast=True).to(gl.int32)
    return _pv_frags(pf, rel, with_rel)


@gluon.constexpr_function
def _vword_layout(nw, wpt, slot_words, hk=0, xpad=0, nsub=1, spad=0):
    """Padded view ``[NW, 16, 8, wpt, 2]`` of V code words for :func:`_pv_word`: element (i, j, w, 0) is
    V word ``wpt (i % 8) + w`` of run token ``j + 8 (i // 8)`` (tokens permuted by ``_hm_token_bases``), slots
    of ``16 wpt`` + padding words (``slot_words`` in all). ``hk`` > 0: a token-major entry
    (:func:`_token_major_layout`: head bits, then tokens, then token groups)."""
    bases = [[0, 0, 0, 1 << b, 0] for b in range(wpt.bit_length() - 1)]
    bases += [[0, 1, 0, 0, 0], [0, 2, 0, 0, 0], [0, 4, 0, 0, 0], [0, 0, 0, 0, 1]]
    if hk:
        wt = nw // hk
        bases += [[wt << b, 0, 0, 0, 0] for b in range(hk.bit_length() - 1)]
        for t in _tm_token_bases(hk, 4 * slot_words):
            bases.append([0, 8, 0, 0, 0] if t == 8 else [0, 0, t, 0, 0])
        bases += [[1 << b, 0, 0, 0, 0] for b in range(wt.bit_length() - 1)]
        pairs = [[16 * wpt, slot_words - 16 * wpt]] + ([[32 * wpt * hk, xpad]] if xpad else [])
        pairs += [[nw * 16 * 8 * wpt * 2 * nsub, spad]] if spad else []
        return gl.PaddedSharedLayout(pairs, bases, [], [nw, 16, 8, wpt, 2])
    for t in _hm_token_bases(4 * slot_words):
        bases.append([0, 8, 0, 0, 0] if t == 8 else [0, 0, t, 0, 0])
    bases += [[1 << i, 0, 0, 0, 0] for i in range(nw.bit_length() - 1)]
    return gl.PaddedSharedLayout([[16 * wpt, slot_words - 16 * wpt]], bases, [], [nw, 16, 8, wpt, 2])


@gluon.jit
def _token_top(w):
    """Largest of the four scale bytes packed in int32 ``w``."""
    b0 = w & 0xFF
    b1 = (w >> 8) & 0xFF
    b2 = (w >> 16) & 0xFF
    b3 = (w >> 24) & 0xFF
    return gl.maximum(gl.maximum(b0, b1), gl.maximum(b2, b3))


@gluon.jit
def _rel_scale(w, top, group):
    """fp16 ``2**(scale byte of group - top)`` (times 2**14: the decode's 2**-14) from the token's
    scale word ``w`` and largest byte ``top``; 0 for a group 2**28 below its token's largest."""
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
def _fwht_split(x, NW: gl.constexpr, R: gl.constexpr, D: gl.constexpr, LOG2D: gl.constexpr, L2: gl.constexpr):
    """``x @ H`` over the last axis of float32 ``[NW, R, D]`` held as 4 lane chunks of ``D / 4`` per row
    (``QL2``): H_D = H_4 (x) H_{D/4}, the chunk-local transform in registers, then one layout change puts
    the 4 chunks of each element in one thread's registers (``L2``) for the last two levels."""
    x = _fwht_rows(gl.reshape(x, [NW, R * 4, D // 4]), NW, R * 4, D // 4, LOG2D - 2)
    x = gl.convert_layout(gl.permute(gl.reshape(x, [NW, R, 4, D // 4]), [0, 1, 3, 2]), L2)
    x = _fwht_rows(gl.reshape(x, [NW, R * (D // 4), 4]), NW, R * (D // 4), 4, 2)
    return gl.reshape(gl.permute(gl.reshape(x, [NW, R, D // 4, 4]), [0, 1, 3, 2]), [NW, R, D])


@gluon.constexpr_function
def _halves_layout(nw, rows):
    """``[NW, rows, 256]`` with element bits 0..2 and 5..7 in registers (the two 128-element halves split
    in place, and :func:`_query_frags` finds its k pairs and groups in registers), bits 3, 4 (the MMA
    lane of a fragment) and the rows on lanes."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1 << b] for b in (0, 1, 2, 5, 6, 7)],
        lane_bases=[[0, 0, 8], [0, 0, 16]] + [[0, 1 << b, 0] for b in range(rows.bit_length() - 1)],
        warp_bases=[[1 << i, 0, 0] for i in range(nw.bit_length() - 1)], block_bases=[],
        shape=[nw, rows, 256])


@gluon.constexpr_function
def _tm_stage(hk, slot, tt, xp, nw, key):
    """Shape of a token-major ring stage, item ``key``: ``STW`` words from one stage to the next, ``NCH`` its
    16-byte chunks of data, ``PC`` chunks per token pair, ``DC`` data chunks per pair, ``N1``/``N2`` the two
    copies' chunk counts (powers of two; the second's chunks past ``NCH`` are masked, and a masked
    ``cp.async`` writes zeros, so ``SPAD`` words, a power of two, end the stage to hold them), ``SL`` the
    padded layout of ``[STAGES, U]`` whose entries start every stage's words (``U``: a power of two).
    A token pair (``2 hk slot`` bytes, contiguous in the page) and ``xp`` padding words (:func:`_pair_pad`)."""
    td = hk * slot // 4
    pc = (2 * td + xp) // 4
    dc = td // 2
    nch = tt // 2 * pc
    data = tt // 2 * (2 * td + xp)
    n1 = 1 << (nch.bit_length() - 1)
    n2 = 0 if nch == n1 else max(32 * nw, 1 << (nch - n1 - 1).bit_length())
    spad = 0 if 4 * (n1 + n2) <= data else 1 << (4 * (n1 + n2) - data - 1).bit_length()
    stw = data + spad
    u = 1 << (stw.bit_length() - 1)
    extra = stw - u
    pairs = []
    for m, k in enumerate(b for b in reversed(range(extra.bit_length())) if extra >> b & 1):
        pairs.append([u >> m, 1 << (k - m)])  # 2**m intervals of u >> m per stage, 2**(k - m) words each
    bases = [[1 << b] for b in range(u.bit_length() - 1)]
    return {"STW": stw, "NCH": nch, "PC": pc, "DC": dc, "N1": n1, "N2": n2, "U": u, "SPAD": spad,
            "SL": gl.PaddedSharedLayout(pairs, bases, [], [u])}[key]


@gluon.jit
def _issue_stage_tm(stages, stage, cache_ptr, bt_row, t0, t_hi, stride_cb, inside, num_blocks,
                    TT: gl.constexpr, NW: gl.constexpr, HK: gl.constexpr, SLOT: gl.constexpr, XP: gl.constexpr,
                    BLOCK_SIZE: gl.constexpr):
    """:func:`_issue_stage` for token-major pages: tokens ``[t0, t0 + TT)`` of ALL kv heads are, per
    page, one contiguous run (token ``t`` of head ``h`` at ``(t HK + h) SLOT`` bytes), copied with 16-byte
    ``cp.async`` into ring stage ``stage`` (``stages``: :func:`_tm_stage`'s layout) as it lies in the page,
    ``XP`` words of padding after every token pair (:func:`_pair_pad`): chunk ``i`` of the stage is chunk
    ``i % PC`` of token pair ``i // PC`` (the pair's last chunk, the padding, is not copied). Two copies of
    ``N1`` and ``N2`` chunks (powers of two). A token pair is read or zero-filled with its 16-token run
    (as head-major's runs: the same bytes)."""
    NCH: gl.constexpr = _tm_stage(HK, SLOT, TT, XP, NW, "NCH")
    PC: gl.constexpr = _tm_stage(HK, SLOT, TT, XP, NW, "PC")
    DC: gl.constexpr = _tm_stage(HK, SLOT, TT, XP, NW, "DC")
    N1: gl.constexpr = _tm_stage(HK, SLOT, TT, XP, NW, "N1")
    N2: gl.constexpr = _tm_stage(HK, SLOT, TT, XP, NW, "N2")
    TOKB: gl.constexpr = HK * SLOT
    CL: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [NW, 1], [1, 0])
    ROWS: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    chunks = stages.index(stage)._reinterpret(gl.int32, [2 * N1, 4], ROWS)
    NBL: gl.constexpr = _stage_blocks(TT, BLOCK_SIZE)
    ids = ()
    for j in gl.static_range(NBL):  # the stage's block ids, once per stage (not per chunk)
        ids = ids + (gl.load(bt_row + t0 // BLOCK_SIZE + j, mask=t0 + j * BLOCK_SIZE < t_hi, other=0),)
    w = gl.expand_dims(gl.arange(0, 4, gl.SliceLayout(0, CL)), 0)
    c = gl.expand_dims(gl.arange(0, N1, gl.SliceLayout(1, CL)), 1)
    base, ok = _pair_chunks(c, PC, DC, NCH, bt_row, t0, t_hi, stride_cb, ids, NBL, inside, num_blocks, TOKB,
                            TT, BLOCK_SIZE)
    p = gl.multiple_of((cache_ptr + base).to(gl.pointer_type(gl.int32)), [16, 16])
    async_copy.async_copy_global_to_shared(chunks.slice(0, N1), p + w, mask=ok & (w >= 0))
    if N2 > 0:
        c2 = gl.expand_dims(gl.arange(0, N2, gl.SliceLayout(1, CL)), 1) + N1
        base2, ok2 = _pair_chunks(c2, PC, DC, NCH, bt_row, t0, t_hi, stride_cb, ids, NBL, inside, num_blocks, TOKB,
                                  TT, BLOCK_SIZE)
        p2 = gl.multiple_of((cache_ptr + base2).to(gl.pointer_type(gl.int32)), [16, 16])
        async_copy.async_copy_global_to_shared(chunks.slice(N1, N2), p2 + w, mask=ok2 & (w >= 0))


@gluon.jit
def _pair_chunks(c, PC: gl.constexpr, DC: gl.constexpr, NCH: gl.constexpr, bt_row, t0, t_hi, stride_cb, ids,
                 NBL: gl.constexpr, inside, num_blocks, TOKB: gl.constexpr, TT: gl.constexpr,
                 BLOCK_SIZE: gl.constexpr):
    """Byte offsets in a token-major cache of stage chunks ``c`` (chunk ``c % PC`` of token pair ``c // PC``)
    and which to read (a data chunk of the stage whose 16-token run starts before ``t_hi`` and, unless
    ``inside``, whose block id is inside ``[0, num_blocks)``); block ids picked from the stage's ``ids``
    (:func:`_stage_blocks`) or loaded per chunk."""
    tau = (c // PC) * 2                               # the pair's first token in the stage
    within = c % PC
    # a data chunk of the stage: its run's first token (loop invariant), else past any length (one compare a stage)
    run = gl.where((within < DC) & (c < NCH), (tau // 16) * 16, 1 << 30)
    ok = run < t_hi - t0
    if NBL == 0 and TT % BLOCK_SIZE == 0:  # stages start on block boundaries: a chunk's block slot and offset
        # in its page do not depend on the stage (loop invariants)
        blk = gl.load(bt_row + t0 // BLOCK_SIZE + tau // BLOCK_SIZE, mask=ok, other=0)
        ok = ok & (inside | _id_inside(blk, num_blocks))
        base = blk.to(gl.int64) * stride_cb + ((tau % BLOCK_SIZE) * TOKB + within * 16).to(gl.int64)
    elif NBL == 0:
        tok = t0 + tau
        blk = gl.load(bt_row + tok // BLOCK_SIZE, mask=ok, other=0)
        ok = ok & (inside | _id_inside(blk, num_blocks))
        base = blk.to(gl.int64) * stride_cb + ((tok % BLOCK_SIZE) * TOKB + within * 16).to(gl.int64)
    else:
        blk, ok = _stage_block(tau // BLOCK_SIZE, ids, NBL, ok, inside, num_blocks)
        base = blk.to(gl.int64) * stride_cb + (t0 % BLOCK_SIZE) * TOKB + ((tau % BLOCK_SIZE) * TOKB + within * 16)
    return base, ok


@gluon.jit
def _advance_ring_tm(stages, it, cache_ptr, bt_row, t_lo, t_hi, stride_cb, inside, num_blocks,
                     STAGES: gl.constexpr, TT: gl.constexpr, NSUB: gl.constexpr, NW: gl.constexpr,
                     HK: gl.constexpr, SLOT: gl.constexpr, XP: gl.constexpr, BLOCK_SIZE: gl.constexpr):
    """:func:`_advance_ring` for token-major pages (:func:`_issue_stage_tm`; Triton's copies, a CTA barrier)."""
    async_copy.wait_group(STAGES - 2)
    gl.thread_barrier()
    _issue_stage_tm(stages, (it + STAGES - 1) % STAGES, cache_ptr, bt_row, t_lo + (it + STAGES - 1) * TT,
                    t_hi, stride_cb, inside, num_blocks, TT, NW, HK, SLOT, XP, BLOCK_SIZE)
    async_copy.commit_group()
    return (it % STAGES) * NSUB, t_lo + it * TT


@gluon.jit
def _lanes_warps(NW: gl.constexpr):
    """The lane and the warp of each thread, ``[NW, 32]`` int32 with one element per thread: the operands of the
    per-thread inline PTX of :func:`_issue_stage` / :func:`_own_copies_landed`."""
    CP: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [NW, 1], [1, 0])
    zero = gl.zeros([NW, 32], gl.int32, CP)
    return (gl.expand_dims(gl.arange(0, 32, gl.SliceLayout(0, CP)), 0) + zero,
            gl.expand_dims(gl.arange(0, NW, gl.SliceLayout(1, CP)), 1) + zero)


@gluon.jit
def _run_token(t0, j, warp, WT: gl.constexpr):
    """First token of warp ``warp``'s run ``j`` in the stage from token ``t0`` (its ``w % WT``-th 16 tokens of
    sub-tile ``j``)."""
    return t0 + j * (WT * 16) + (warp % WT) * 16


@gluon.constexpr_function
def _warp_copy_ptx(nsub, slot, nw):
    """PTX of :func:`_issue_stage`: the ``cp.async`` of one warp's ``nsub`` runs of a stage (run ``j`` of the
    warp is the ring's run ``j nw + w``, ``16 slot`` bytes), their 16-byte chunks back to back, 32 consecutive
    chunks per instruction (512 contiguous bytes but at a run boundary; lanes past the last chunk copy nothing), then
    one commit group. Operands: ``$0`` a dummy output, ``$1`` the lane's byte offset in shared memory of its chunk 0
    (stage, warp and lane parts), ``$2`` the lane, ``$3..`` the runs' global pointers (lane part included), then
    their copy sizes (16 or 0: a zero fill).
    The shared address is ``global_smem`` plus the offset: the ring is the piece's first allocation, at offset 0
    (``tests/test_decode_wholepage_warp_copy.py`` checks it)."""
    run_bytes = 16 * slot
    chunks = nsub * slot
    ptr, size = 3, 3 + nsub
    lines = ["{ .reg .pred p, q; .reg .b32 s, t, o, z; .reg .b64 g, h;", "mov.u32 s, global_smem;",
             "add.u32 s, s, $1;"]
    for k in range(-(-chunks // 32)):
        c0 = 32 * k
        j, j2 = c0 // slot, min(c0 + 31, chunks - 1) // slot
        gi = 16 * (c0 - slot * j)
        si = j * nw * run_bytes + gi
        if c0 + 32 > chunks:  # the last chunks: lanes past the warp's runs copy nothing
            assert j == j2, "the last, partial copy instruction lies in one run"
            lines += [f"setp.lt.u32 q, $2, {chunks - c0};",
                      f"@q cp.async.cg.shared.global [s+{si}], [${ptr + j}+{gi}], 16, ${size + j};"]
            continue
        if j == j2:
            lines.append(f"cp.async.cg.shared.global [s+{si}], [${ptr + j}+{gi}], 16, ${size + j};")
            continue
        gi2 = 16 * (c0 - slot * j2)
        lines += [f"setp.lt.u32 p, $2, {slot * j2 - c0};",
                  f"add.s64 g, ${ptr + j}, {gi}; add.s64 h, ${ptr + j2}, {gi2}; selp.b64 g, g, h, p;",
                  f"selp.b32 o, {si}, {j2 * nw * run_bytes + gi2}, p; add.u32 t, s, o;",
                  f"selp.b32 z, ${size + j}, ${size + j2}, p;",
                  "cp.async.cg.shared.global [t], [g], 16, z;"]
    return " ".join(lines + ["cp.async.commit_group;", "mov.u32 $0, 0;", "}"])


@gluon.constexpr_function
def _own_copies_ptx(pending):
    """PTX of :func:`_own_copies_landed`."""
    return f"cp.async.wait_group {pending}; bar.warp.sync -1; mov.u32 $0, 0;"


@gluon.jit
def _own_copies_landed(lane, PENDING: gl.constexpr):
    """Wait until at most ``PENDING`` of this thread's newest copy groups are in flight, then order the warp
    (``bar.warp.sync``): a warp reads only the runs it copied (:func:`_issue_stage`), so no CTA barrier."""
    gl.inline_asm_elementwise(asm=_own_copies_ptx(PENDING), constraints="=r,r", args=[lane], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _ring_drained(lane):
    """After a piece's stage loop: every thread's copies (the zero fills past the range too) landed, and every warp
    is past them, before the epilogue's scratch may reuse the ring's bytes."""
    _own_copies_landed(lane, 0)
    gl.thread_barrier()


@gluon.jit
def _warp_ids(bt_row, t0, t_hi, warp, NSUB: gl.constexpr, NW: gl.constexpr, WT: gl.constexpr,
              BLOCK_SIZE: gl.constexpr):
    """Block ids of the runs warp ``warp`` copies in the stage from token ``t0`` (run ``j``: the block of its first
    token, :func:`_run_token`; 0 past ``t_hi``), loaded a stage before their copies
    (:func:`_advance_ring`)."""
    ids = ()
    for j in gl.static_range(NSUB):
        tok = _run_token(t0, j, warp, WT)
        ids = ids + (gl.load(bt_row + tok // BLOCK_SIZE, mask=tok < t_hi, other=0),)
    return ids


@gluon.jit
def _issue_stage(stage, cache_ptr, t0, t_hi, stride_cb, stride_ch, inside, num_blocks, ids, lane, warp,
                 NSUB: gl.constexpr, NW: gl.constexpr, WT: gl.constexpr, SLOT: gl.constexpr,
                 BLOCK_SIZE: gl.constexpr):
    """Start the async copies of ring stage ``stage`` (tokens from ``t0``, head-major pages): warp ``w`` copies the
    runs it reads (``j NW + w``: kv head ``w // WT``, tokens from :func:`_run_token`, block ids ``ids`` from
    :func:`_warp_ids`) by inline-PTX ``cp.async``
    (:func:`_warp_copy_ptx`) that the compiler's shared-memory barrier analysis does not see, so no stage needs a
    CTA barrier. Runs past ``t_hi`` and, unless ``inside``, of ids outside ``[0, num_blocks)`` are zero-filled.
    ``lane``/``warp``: ``[NW, 32]``, one per thread."""
    ptrs = ()
    sizes = ()
    for j in gl.static_range(NSUB):
        tok = _run_token(t0, j, warp, WT)
        blk = ids[j]
        ok = (tok < t_hi) & (inside | _id_inside(blk, num_blocks))
        base = (blk.to(gl.int64) * stride_cb + (warp // WT).to(gl.int64) * stride_ch
                + ((tok % BLOCK_SIZE) * SLOT + 16 * lane).to(gl.int64))
        ptrs = ptrs + (cache_ptr + base,)
        sizes = sizes + (gl.where(ok, 16, 0),)
    off = (stage * (NSUB * NW) + warp) * (16 * SLOT) + 16 * lane
    if NSUB == 4:
        gl.inline_asm_elementwise(asm=_warp_copy_ptx(NSUB, SLOT, NW), constraints="=r,r,r,l,l,l,l,r,r,r,r",
                                  args=[off, lane, ptrs[0], ptrs[1], ptrs[2], ptrs[3], sizes[0], sizes[1], sizes[2],
                                        sizes[3]], dtype=gl.int32, is_pure=False, pack=1)
    elif NSUB == 2:
        gl.inline_asm_elementwise(asm=_warp_copy_ptx(NSUB, SLOT, NW), constraints="=r,r,r,l,l,r,r",
                                  args=[off, lane, ptrs[0], ptrs[1], sizes[0], sizes[1]], dtype=gl.int32,
                                  is_pure=False, pack=1)
    else:
        gl.static_assert(NSUB == 1, "warp copies: NSUB 1, 2 or 4")
        gl.inline_asm_elementwise(asm=_warp_copy_ptx(NSUB, SLOT, NW), constraints="=r,r,r,l,r",
                                  args=[off, lane, ptrs[0], sizes[0]], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _advance_ring(it, cache_ptr, bt_row, t_lo, t_hi, stride_cb, stride_ch, inside, num_blocks, ids, lane, warp,
                  STAGES: gl.constexpr, TT: gl.constexpr, NSUB: gl.constexpr, NW: gl.constexpr,
                  WT: gl.constexpr, SLOT: gl.constexpr, BLOCK_SIZE: gl.constexpr):
    """Top of stage loop iteration ``it`` (head-major pages): each warp waits until its own copies of stage ``it``
    landed (at most ``STAGES - 2`` younger groups pending), issues the stage ``STAGES - 1`` ahead from its block ids
    ``ids`` (:func:`_issue_stage`) and loads those of the stage after it. Returns stage ``it``'s first run in the
    ring, its first token and the next block ids."""
    _own_copies_landed(lane, STAGES - 2)
    _issue_stage((it + STAGES - 1) % STAGES, cache_ptr, t_lo + (it + STAGES - 1) * TT, t_hi, stride_cb,
                 stride_ch, inside, num_blocks, ids, lane, warp, NSUB, NW, WT, SLOT, BLOCK_SIZE)
    nxt = _warp_ids(bt_row, t_lo + (it + STAGES) * TT, t_hi, warp, NSUB, NW, WT, BLOCK_SIZE)
    return (it % STAGES) * NSUB, t_lo + it * TT, nxt


@gluon.jit
def _combine_token_groups(x_rows, m_rows, l_rows, HK: gl.constexpr, WT: gl.constexpr, ROWS: gl.constexpr,
                          D: gl.constexpr, EP: gl.constexpr):
    """A program's partial per kv head: the ``WT`` warps of a kv head (its token groups) hold partials
    of disjoint tokens; fold them (in-thread in layout ``EP``) into one accumulator, max and sum per
    row. Returns ``[HK, ROWS, D]`` and two ``[HK, ROWS]``."""
    E3: gl.constexpr = gl.SliceLayout(3, EP)
    x4 = gl.convert_layout(gl.reshape(x_rows, [HK, WT, ROWS, D]), EP)
    m4 = gl.convert_layout(gl.reshape(m_rows, [HK, WT, ROWS]), E3)
    l4 = gl.convert_layout(gl.reshape(l_rows, [HK, WT, ROWS]), E3)
    m_c = gl.max(m4, axis=1)
    m_z = gl.where(m_c == float("-inf"), 0.0, m_c)
    sc = gl.exp2(m4 - gl.expand_dims(m_z, 1))
    return gl.sum(x4 * gl.expand_dims(sc, 3), axis=1), m_c, gl.sum(l4 * sc, axis=1)


@gluon.jit
def _online_start(G: gl.constexpr, SHAPE: gl.constexpr, L: gl.constexpr, LW: gl.constexpr):
    """The online softmax's starting state for ``G`` row groups: running maxima -inf, running sums 0,
    and each warp's accumulator exponent (``run``, layout ``LW``) at its floor."""
    m = ()
    lsum = ()
    for _g in gl.static_range(G):
        m = m + (gl.full(SHAPE, float("-inf"), gl.float32, L),)
        lsum = lsum + (gl.zeros(SHAPE, gl.float32, L),)
    return m, lsum, gl.full([SHAPE[0]], -254, gl.int32, LW)


@gluon.jit
def _online_update(ss, m_prev, l_prev, G: gl.constexpr, N: gl.constexpr, TAX: gl.constexpr):
    """One online-softmax step of ``G`` row groups, each over its ``N`` score tiles ``ss[i * G + g]``
    (log2 units, masked scores -inf): per group one max and one sum over the token axis ``TAX`` for all
    ``N`` tiles. Returns the probabilities (``ps[g * N + i]``), each group's accumulator rescale factor,
    and the new running maxima and sums (tuples of ``G``); a row with no live score yet keeps max -inf
    and gets p = 0."""
    ps = ()
    alphas = ()
    m_new = ()
    l_new = ()
    for g in gl.static_range(G):
        smax = ss[g]
        for i in gl.static_range(1, N):
            smax = gl.maximum(smax, ss[i * G + g])
        m_g = gl.maximum(m_prev[g], gl.max(smax, axis=TAX))
        m_safe = gl.where(m_g == float("-inf"), 0.0, m_g)
        alpha = gl.exp2(m_prev[g] - m_safe)
        psum = gl.exp2(ss[g] - gl.expand_dims(m_safe, TAX))
        ps = ps + (psum,)
        for i in gl.static_range(1, N):
            p_i = gl.exp2(ss[i * G + g] - gl.expand_dims(m_safe, TAX))
            ps = ps + (p_i,)
            psum = psum + p_i
        alphas = alphas + (alpha,)
        m_new = m_new + (m_g,)
        l_new = l_new + (l_prev[g] * alpha + gl.sum(psum, axis=TAX),)
    return ps, alphas, m_new, l_new


@gluon.constexpr_function
def _stage_blocks(tt, block_size):
    """How many block ids a ``tt``-token stage loads up front: 1 when a block holds whole stages, 2 when
    a stage is two whole blocks (stages start on ``tt`` boundaries), else 0: each chunk loads its own (4 ids
    picked per row measured slower on the H200, benchmarks/NOTES.md). Token-major copies only: a head-major warp
    loads its runs' ids a stage ahead (:func:`_warp_ids`)."""
    if block_size % tt == 0:
        return 1
    if tt == 2 * block_size:
        return tt // block_size
    return 0


@gluon.jit
def _stage_block(jl, ids, NBL: gl.constexpr, ok, inside, num_blocks):
    """Block id of the stage's block slot ``jl`` (picked from its ``ids``, loaded once per stage) and ``ok``
    narrowed, unless ``inside``, to ids inside ``[0, num_blocks)`` (token-major copies, :func:`_pair_chunks`)."""
    blk = ids[0] + jl * 0
    for j in gl.static_range(1, NBL):
        blk = gl.where(jl == j, ids[j], blk)
    return blk, ok & (inside | _id_inside(blk, num_blocks))


@gluon.constexpr_function
def _ids_chunk(nw, warp_local):
    """Block ids per chunk of :func:`_blocks_inside`: 256 that every warp holds whole (``warp_local``: the layout
    replicates over the warps, so the check's reduction stays inside a warp: no shared memory, no barrier), or
    one per thread (``32 nw``; the reduction through shared memory, behind a CTA barrier)."""
    return 256 if warp_local else 32 * nw


@gluon.constexpr_function
def _ids_layout(nw, warp_local):
    """Layout of a :func:`_ids_chunk` chunk of block ids."""
    return gl.BlockedLayout([8 if warp_local else 1], [32], [nw], [0])


@gluon.jit
def _first_blocks(bt_row, t_lo, limit, BLOCK_SIZE: gl.constexpr, NW: gl.constexpr, WARP_LOCAL: gl.constexpr):
    """The first chunk of :func:`_blocks_inside` (:func:`_ids_chunk` ids from token ``t_lo``'s of a block-table row,
    0 from ``limit``'s on), loaded on its own so the decode can issue it beside its query, not a round trip after its
    first copies; warp-local there (``WARP_LOCAL``), so no warp waits at a barrier for another's loads. The
    multi-query decode checks before its first copies, where warp-local only adds loads (its 4-token step measured
    5-7% slower), so it keeps one id per thread."""
    L: gl.constexpr = _ids_layout(NW, WARP_LOCAL)
    j = t_lo // BLOCK_SIZE + gl.arange(0, _ids_chunk(NW, WARP_LOCAL), L)
    return gl.load(bt_row + j, mask=j < gl.cdiv(limit, BLOCK_SIZE), other=0)


@gluon.jit
def _id_inside(blk, num_blocks):
    """Whether block ids ``blk`` lie inside ``[0, num_blocks)`` (the cache)."""
    return (blk >= 0) & (blk < num_blocks)


@gluon.jit
def _bad_ids(blk, used, num_blocks):
    """1 where a ``used`` block id lies outside ``[0, num_blocks)`` (int32, for an OR over chunks)."""
    return (used & ((blk < 0) | (blk >= num_blocks))).to(gl.int32)


@gluon.jit
def _blocks_inside(bt_row, t_lo, t_hi, num_blocks, err_ptr, first, BLOCK_SIZE: gl.constexpr):
    """True when every block id covering tokens ``[t_lo, t_hi)`` of a block-table row is inside
    ``[0, num_blocks)`` (else sets the error word): one check per entry, once per program, as the
    Triton kernels' ``blocks_inside``; the loop then masks per token only when this is False. ``first``: the
    range's first ids (:func:`_first_blocks`), whose size and layout the later chunks take."""
    L: gl.constexpr = first.type.layout
    CHUNK: gl.constexpr = first.shape[0]
    hi = gl.cdiv(t_hi, BLOCK_SIZE)
    bad = _bad_ids(first, t_lo // BLOCK_SIZE + gl.arange(0, CHUNK, L) < hi, num_blocks)
    for j0 in range(t_lo // BLOCK_SIZE + CHUNK, hi, CHUNK):
        j = j0 + gl.arange(0, CHUNK, L)
        used = j < hi
        bad = bad | _bad_ids(gl.load(bt_row + j, mask=used, other=0), used, num_blocks)
    found = gl.max(bad, axis=0)
    gl.store(err_ptr + ERR_BLOCK, 1, mask=found != 0)
    return found == 0


@gluon.jit
def _run_scores(kwa, kwb, kwc, kwd, kc8, kw, kw1, q0, q1, q2, q3, q4, q5, q6, q7, q_e, q_o, kgroup, rowfac, rowbias,
                softcap, D: gl.constexpr, NW: gl.constexpr, TW: gl.constexpr, ROWS: gl.constexpr, H: gl.constexpr,
                ROWS_IN_N: gl.constexpr, HAS_SOFTCAP: gl.constexpr, MMA: gl.constexpr, KB: gl.constexpr,
                TK: gl.constexpr, RAX: gl.constexpr, TAX: gl.constexpr):
    """log2-domain scores of one 16-token run (ring entry views ``kwa..kwd``/``kc8``, scale words ``kw``,
    ``kw1``), unmasked (:func:`_mask_runs`). Rows in N: K words
    straight into :func:`_qk_runs` (twice at D=256: groups 0..3, 4..7); m16: fp16 halves times relative
    scales (``_fp4_decode``), the token's largest scale on the score column."""
    if ROWS_IN_N:
        ka = _piece(kwa.permute([0, 1, 3, 2]), [NW, TW, ROWS], MMA, MMA)
        kb = _piece(kwb.permute([0, 1, 3, 2]), [NW, TW, ROWS], MMA, MMA)
        kw3 = gl.expand_dims(kw, 2) + gl.zeros([NW, TW, ROWS], gl.int32, MMA)
        s = _qk_runs(ka, kb, kw3, q0, q1, q2, q3)
        if D == 256:
            kc = _piece(kwc.permute([0, 1, 3, 2]), [NW, TW, ROWS], MMA, MMA)
            kd = _piece(kwd.permute([0, 1, 3, 2]), [NW, TW, ROWS], MMA, MMA)
            kw3 = gl.expand_dims(kw1, 2) + gl.zeros([NW, TW, ROWS], gl.int32, MMA)
            s = s + _qk_runs(kc, kd, kw3, q4, q5, q6, q7)
    else:
        ktop = _token_top(kw)
        kb = _piece(kc8.permute([0, 3, 1, 2]), [NW, H, TW], KB, KB)
        krel = _rel_scale(gl.expand_dims(kw, 1), gl.expand_dims(ktop, 1), kgroup)
        k_lo, k_hi = _fp4_decode(kb, krel)
        s = mma_v2(q_e, k_lo, gl.zeros([NW, ROWS, TW], gl.float32, MMA))
        s = mma_v2(q_o, k_hi, s)
        s = s * gl.expand_dims(_pow2(gl.convert_layout(ktop, TK) - 127), RAX)
    return _scale_scores(s, rowfac, rowbias, softcap, HAS_SOFTCAP, TAX)


@gluon.jit
def _mask_runs(ss, t0, j, ws, ns, t_hi, lo, inside, bt_row, num_blocks, RG: gl.constexpr, PAIR: gl.constexpr,
               WT: gl.constexpr, TW: gl.constexpr, HAS_WINDOW: gl.constexpr, BLOCK_SIZE: gl.constexpr,
               RAX: gl.constexpr):
    """The scores ``ss[i * RG + g]`` of runs ``j .. j + PAIR - 1`` of the stage from token ``t0`` with the
    tokens outside the request, the window or the cache set to -inf (:func:`_score_live`; the loop calls this
    only on stages that are not whole: its interior skips the masks)."""
    masked = ()
    for i in gl.static_range(PAIR):
        ts = t0 + (j + i) * (WT * TW) + ws + ns
        live = gl.expand_dims(_score_live(ts, t_hi, lo, inside, bt_row, num_blocks, HAS_WINDOW, BLOCK_SIZE), RAX)
        for g in gl.static_range(RG):
            masked = masked + (gl.where(live, ss[i * RG + g], float("-inf")),)
    return masked


@gluon.jit
def _score_live(ts, t_hi, lo, inside, bt_row, num_blocks, HAS_WINDOW: gl.constexpr, BLOCK_SIZE: gl.constexpr):
    """Which tokens ``ts`` of a run count: inside the request, the window and (unless ``inside``) the cache."""
    live = ts < t_hi
    if HAS_WINDOW:
        live = live & (ts >= lo)
    if not inside:  # a range with a bad block id (bounds): its tokens are empty
        tb = gl.load(bt_row + ts // BLOCK_SIZE, mask=live, other=0)
        live = live & _id_inside(tb, num_blocks)
    return live


@gluon.jit
def _scale_scores(s, rowfac, rowbias, softcap, HAS_SOFTCAP: gl.constexpr, TAX: gl.constexpr):
    """Raw scores ``s`` to the log2 domain: the rows' power of two ``rowfac``, the soft cap, padding rows
    (``rowbias``) at -inf."""
    rf = gl.expand_dims(rowfac, TAX)
    rb = gl.expand_dims(rowbias, TAX)
    if HAS_SOFTCAP:
        s = s * rf
        s = softcap * (1.0 - 2.0 / (gl.exp2(s / softcap * (2.0 * LOG2E)) + 1.0)) * LOG2E
        s = s + rb
    else:
        s = gl.fma(s, rf, rb)
    return s


@gluon.jit
def _run_scores2(kwa, kwb, kw, q0, q1, q2, q3, q4, q5, q6, q7, rowfac, rowfac2, rowbias, rowbias2, softcap,
                 NW: gl.constexpr, TW: gl.constexpr, HAS_SOFTCAP: gl.constexpr, MMA: gl.constexpr):
    """:func:`_run_scores` with rows in N for two 8-row query groups (D=128; fragments ``q0..q3``, ``q4..q7``):
    the K words are loaded and decoded once (:func:`_qk_runs2`); the scores of rows 0..7 and 8..15, unmasked."""
    ka = _piece(kwa.permute([0, 1, 3, 2]), [NW, TW, 8], MMA, MMA)
    kb = _piece(kwb.permute([0, 1, 3, 2]), [NW, TW, 8], MMA, MMA)
    kw3 = gl.expand_dims(kw, 2) + gl.zeros([NW, TW, 8], gl.int32, MMA)
    s, s2 = _qk_runs2(ka, kb, kw3, q0, q1, q2, q3, q4, q5, q6, q7)
    return (_scale_scores(s, rowfac, rowbias, softcap, HAS_SOFTCAP, 1),
            _scale_scores(s2, rowfac2, rowbias2, softcap, HAS_SOFTCAP, 1))


@gluon.jit
def _run_pv(acc_e, acc_o, vc8, vw, vtop, vexp, p, nr, vgroup, NW: gl.constexpr, TW: gl.constexpr, H: gl.constexpr,
            ROWS_IN_N: gl.constexpr, VL: gl.constexpr, VLW: gl.constexpr, VA: gl.constexpr, VB: gl.constexpr,
            PTB: gl.constexpr, PA: gl.constexpr, RAX: gl.constexpr):
    """``acc += V^T P^T`` (or ``P V``) of one run: V codes (ring entry view ``vc8``) as fp16 halves times
    their relative scales, probabilities ``p`` times ``2**(vexp - nr)`` (the token's largest V scale
    against the running reference exponent ``nr``) in fp16."""
    vb = _piece(vc8.permute([0, 1, 3, 4, 2]), [NW, TW, H // 8, 8], VL, VLW)
    vrel = _rel_scale(gl.expand_dims(vw, 3), gl.expand_dims(vtop, 3), vgroup)
    vb = gl.reshape(gl.permute(vb, [0, 1, 3, 2]), [NW, TW, H])
    vrel = gl.reshape(gl.permute(vrel, [0, 1, 3, 2]), [NW, TW, H])
    fac = _pow2(gl.minimum(vexp - nr, 127))
    pf = (p * gl.expand_dims(fac, RAX)).to(gl.float16)
    if ROWS_IN_N:
        v_lo, v_hi = _fp4_decode(gl.convert_layout(gl.permute(vb, [0, 2, 1]), VA),
                                 gl.convert_layout(gl.permute(vrel, [0, 2, 1]), VA))
        pv = gl.convert_layout(pf, PTB)
        acc_e = mma_v2(v_lo, pv, acc_e)
        acc_o = mma_v2(v_hi, pv, acc_o)
    else:
        v_lo, v_hi = _fp4_decode(gl.convert_layout(vb, VB), gl.convert_layout(vrel, VB))
        pv = gl.convert_layout(pf, PA)
        acc_e = mma_v2(pv, v_lo, acc_e)
        acc_o = mma_v2(pv, v_hi, acc_o)
    return acc_e, acc_o


@gluon.constexpr_function
def _tile_shape(nw, bits):
    """Shape ``[NW, h, g, j, b0 .. b{bits-1}]`` of the joined tiles (:func:`_partial_rows`)."""
    return [nw, 2, 8, 8] + [2] * bits


@gluon.constexpr_function
def _tile_order(bits):
    """Axis order taking ``[NW, h, g, j, b0 .. b{bits-1}]`` (joined tiles, tile index bits lowest first)
    to ``[NW, j, g, tile, h]``: the partial's rows, then dims ``(D / 8) g + 2 tile + h``."""
    return [0, 3, 2] + [4 + bits - 1 - k for k in range(bits)] + [1]


@gluon.jit
def _partial_rows(accs, NT: gl.constexpr, NW: gl.constexpr, ROWS: gl.constexpr, D: gl.constexpr,
                  ROWS_IN_N: gl.constexpr):
    """A warp's accumulator as ``[NW, ROWS, D]`` (query rows, dims in order) from its MMA tiles (rows in
    N: tile t, row i of lane group g is dim ``(D / 8) g + 2 t + i // 8``; m16: even / odd dims
    ``2 (8 (n % 8) + n // 8)``), by joins, permutes and reshapes (register renaming, no data moves)."""
    if ROWS_IN_N:
        xs = accs
        LOG2NT: gl.constexpr = NT.bit_length() - 1
        for _lvl in gl.static_range(LOG2NT):
            ys = ()
            for k in gl.static_range(NT // (2 << _lvl)):
                ys = ys + (gl.join(xs[2 * k], xs[2 * k + 1]),)
            xs = ys
        x = gl.reshape(xs[0], _tile_shape(NW, LOG2NT).value)
        rows = gl.reshape(gl.permute(x, _tile_order(LOG2NT).value), [NW, ROWS, D])
    else:
        x = gl.reshape(gl.join(accs[0], accs[1]), [NW, ROWS, 8, 8, 2])  # n = 8 a + b, dim 16 b + 2 a + e
        rows = gl.reshape(gl.permute(x, [0, 1, 3, 2, 4]), [NW, ROWS, D])
    return rows


@gluon.jit
def _units(length, window, cap, TT: gl.constexpr, HAS_WINDOW: gl.constexpr):
    """Work units of a request of ``length`` tokens (clamped to ``[0, cap]``): its ``TT``-token stages from
    the stage holding the window's first token, at least 1 (an empty request still has its zeros
    written by the program that owns its unit). Scalar or tensor ``length``."""
    n = gl.minimum(gl.maximum(length, 0), cap)
    lo = n * 0
    if HAS_WINDOW:
        lo = gl.maximum(n - window, 0)
    return gl.maximum(gl.cdiv(n - (lo // TT) * TT, TT), 1)


@gluon.jit
def _add(a, b):
    """``a + b`` (the combine of the schedule's prefix sum)."""
    return a + b


@gluon.jit
def _owner(unit, progs, total):
    """The program whose units ``[p total // progs, (p + 1) total // progs)`` hold ``unit``."""
    return (((unit + 1).to(gl.int64) * progs - 1) // total).to(gl.int32)


@gluon.jit
def _schedule(seqlen_ptr, num_requests, window, cap, pid, progs, TT: gl.constexpr, HAS_WINDOW: gl.constexpr,
              MIN_UNITS: gl.constexpr, PIECE_UNITS: gl.constexpr, NW: gl.constexpr):
    """The balanced schedule from ``seq_lens`` on the device: each request costs its units (:func:`_units`)
    plus ``pc = PIECE_UNITS`` (its piece's overhead; 0 for equal requests), and the batch's ``total`` cost
    goes over ``active = min(progs, cdiv(total, MIN_UNITS))`` programs (a piece is never shorter than
    ``MIN_UNITS`` at the batch's average; equal requests, at most ``progs`` of them: ``k`` whole programs
    each, ``k = min(progs // B, cdiv(units, MIN_UNITS))``), program ``pid``'s share ``[w0, w1) = [pid total //
    active, (pid + 1) total // active)`` (empty from ``active`` on). Request b's units lie at ``[C_b + pc,
    C_b + pc + units_b)`` of the cost line; the program serves the requests whose units meet its share, from
    ``b_first`` (its units starting at ``cs``) to ``b_last`` (``b_last < b_first``: no work), and returns
    ``pc`` (the next request's units start ``pc`` after a piece's end). Two passes over ``seq_lens`` (the
    second hits L1). Modelled by ``families.decode_wholepage.wholepage_schedule``."""
    # one warp's worth of requests per chunk, the same in every warp (the layout replicates over the warps): the
    # reductions and the scan stay inside a warp (shuffles), with no shared memory and no barrier
    L: gl.constexpr = gl.BlockedLayout([8], [32], [NW], [0])
    CH: gl.constexpr = 256
    zero = gl.sum(gl.zeros([CH], gl.int32, L), axis=0)
    total = zero
    umax = zero
    umin = zero + 2147483647
    for c0 in range(0, num_requests, CH):
        j = c0 + gl.arange(0, CH, L)
        ok = j < num_requests
        ln = gl.load(seqlen_ptr + j, mask=ok, other=0)
        u = _units(ln, window, cap, TT, HAS_WINDOW)
        total += gl.sum(gl.where(ok, u, 0), axis=0)
        umax = gl.maximum(umax, gl.max(gl.where(ok, u, 0), axis=0))
        umin = gl.minimum(umin, gl.min(gl.where(ok, u, 2147483647), axis=0))
    # equal requests: k whole programs each (shares end on request ends: no program pays two pieces)
    equal = (umax == umin) & (num_requests <= progs)
    pc = gl.where(equal, 0, PIECE_UNITS)
    total = gl.maximum(total + pc * num_requests, 1)
    active = gl.minimum(progs, gl.cdiv(total, MIN_UNITS))
    k = gl.maximum(gl.minimum(progs // gl.maximum(num_requests, 1), gl.cdiv(umax, MIN_UNITS)), 1)
    active = gl.where(equal, k * num_requests, active)
    w0 = gl.minimum(pid.to(gl.int64) * total // active, total).to(gl.int32)
    w1 = gl.minimum((pid + 1).to(gl.int64) * total // active, total).to(gl.int32)
    b_first = zero  # requests whose units end at or before w0, and their cost
    cs = pc
    b_last = zero - 1  # requests whose units start before w1, less one: the last one this program serves
    done = zero
    for c0 in range(0, num_requests, CH):
        j = c0 + gl.arange(0, CH, L)
        ok = j < num_requests
        ln = gl.load(seqlen_ptr + j, mask=ok, other=0)
        u = gl.where(ok, _units(ln, window, cap, TT, HAS_WINDOW) + pc, 0)  # each request's cost
        end = gl.associative_scan(u, 0, _add) + done
        before = ok & (end <= w0)
        b_first += gl.sum(before.to(gl.int32), axis=0)
        cs += gl.sum(gl.where(before, u, 0), axis=0)
        b_last += gl.sum((ok & (end - u + pc < w1)).to(gl.int32), axis=0)
        done += gl.sum(u, axis=0)
    b_last = gl.where(w1 > w0, b_last, b_first - 1)
    return total, active, w0, w1, b_first, cs, b_last, pc


@gluon.jit(noinline=True)
def _serve_piece(q_ptr, cache_ptr, bt_ptr, seqlen_ptr, sinks_ptr, out_ptr, part_ptr, ml_ptr, counter_ptr,
                 err_ptr, scale, softcap, window, num_blocks, cap, stride_qb, stride_qh, stride_ob, stride_oh,
                 stride_cb, stride_ch, stride_btb, b, cs, w0, w1, total, active, pid,
                 D: gl.constexpr, LOG2D: gl.constexpr, GQA: gl.constexpr, ROWS: gl.constexpr,
                 GQA_PAD: gl.constexpr, HK: gl.constexpr, WT: gl.constexpr, NSUB: gl.constexpr,
                 STAGES: gl.constexpr, TW: gl.constexpr, BLOCK_SIZE: gl.constexpr, HAS_SINKS: gl.constexpr,
                 HAS_WINDOW: gl.constexpr, HAS_SOFTCAP: gl.constexpr, ROWS_IN_N: gl.constexpr,
                 TOKEN_MAJOR: gl.constexpr = False):
    """Serve request ``b``'s piece of this program's units ``[w0, w1)`` (the request's units start at
    ``cs``): stream it through the ring; a request served by one piece writes ``out``, else the piece leaves
    one partial per kv head in slot ``pid + b`` and the request's last piece (atomic ticket) merges them into
    ``out``. Returns the request's end unit."""
    NW: gl.constexpr = gl.num_warps()
    H: gl.constexpr = D // 2
    G: gl.constexpr = D // 32
    TT: gl.constexpr = NSUB * WT * TW
    PAIR: gl.constexpr = NSUB  # runs per online-softmax update: the whole stage
    # partials per merge step: _merge_layout holds distinct elements, so the 64-value budget holds at any Hk
    MERGE: gl.constexpr = _merge_step(HK * GQA_PAD * D // (32 * NW), 64)
    RG: gl.constexpr = ROWS // 8 if ROWS_IN_N else 1  # row groups: 8 query rows each in N (GQA 9..16: 2)
    RR: gl.constexpr = ROWS // RG                     # rows of a group

    # ---- layouts: warp = MMA batch
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1, 1],
                                                  instr_shape=[1, 16, 8])
    QA: gl.constexpr = gl.DotOperandLayout(0, MMA, 8)   # q halves [NW, ROWS, H]
    KB: gl.constexpr = gl.DotOperandLayout(1, MMA, 8)   # K halves [NW, H, TW]: 8 bytes per lane
    PA: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)   # probabilities [NW, ROWS, TW]
    VB: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)   # V halves [NW, TW, H] (columns permuted)
    ROW: gl.constexpr = gl.SliceLayout(2, MMA)          # [NW, ROWS]
    WARP: gl.constexpr = gl.SliceLayout(1, ROW)         # [NW]
    TOK: gl.constexpr = gl.SliceLayout(1, MMA)          # [NW, TW] score columns
    VL: gl.constexpr = _v_layout(NW, TW)
    VLW: gl.constexpr = _v_layout(NW, TW, True)
    # the query: rows in 4 lane chunks of D / 4 (whole rows per thread repeated each row on 4 lanes and cost
    # 7 x 128 adds per row group in straight-line code, which runs cold once per piece: benchmarks/NOTES.md)
    QL: gl.constexpr = gl.BlockedLayout([1, 1, D // 4], [1, 8, 4], [NW, 1, 1], [2, 1, 0])
    QL2: gl.constexpr = gl.BlockedLayout([1, 1, D // 16, 4], [1, 8, 4, 1], [NW, 1, 1, 1], [3, 2, 1, 0])
    # ---- the ring: STAGES x NR runs of 16 whole slots (16 x 136 B), run q at 2176*q bytes. Entries are
    # the leading dimension (the layouts describe one entry; padding counts over the whole buffer).
    NR: gl.constexpr = NSUB * NW
    SLOT: gl.constexpr = 2 * (H + G)
    # allocated flat: a padded allocation stops at the last run's 512th word, but its copy fills the
    # whole 136-byte slot stride (17 rows of 128 B), so the last run's 17th row would land past the end
    FLAT: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    RINT: gl.constexpr = 8 * H                         # words of a run's first 2H bytes per token
    RING: gl.constexpr = gl.PaddedSharedLayout.with_identity_for([[RINT, 4 * SLOT - RINT]], [NR, RINT], [1, 0])
    # allocated here, not by the kernel: Triton 3.6 places a noinline function's scratch at the start of
    # shared memory whatever the caller holds there, so a ring passed in would be overwritten
    # token-major pages (TOKEN_MAJOR): a stage is TT tokens x HK slots as in the page, XP padding words after
    # every second token (_pair_pad); the copy writes whole 16-byte chunks (_issue_stage_tm), the views below
    # are the same pieces at token-major bases (_token_major_layout)
    XP: gl.constexpr = _pair_pad(HK, SLOT, TOKEN_MAJOR)
    TMK: gl.constexpr = HK if TOKEN_MAJOR else 0
    SPAD: gl.constexpr = _tm_spad(HK, SLOT, TT, XP, NW, TOKEN_MAJOR)
    if TOKEN_MAJOR:
        STW: gl.constexpr = _tm_stage(HK, SLOT, TT, XP, NW, "STW")
        alloc = gl.allocate_shared_memory(gl.int32, [STAGES * STW], FLAT)
        stages = alloc._reinterpret(gl.int32, [STAGES, _tm_stage(HK, SLOT, TT, XP, NW, "U")],
                                    _tm_stage(HK, SLOT, TT, XP, NW, "SL"))  # .index(s): stage s's first word
        # viewed at once as a power-of-two flat shape (layouts need one), as `words` below
        ring = alloc._reinterpret(gl.int32, [STAGES * NR * 1024 * (D // 128)], FLAT)
    else:
        ring = gl.allocate_shared_memory(gl.int32, [STAGES * NR * (SLOT * 4)], FLAT)._reinterpret(
            gl.int32, [STAGES, NR, RINT], RING)
    gl.thread_barrier()  # every warp is past the caller's (and the previous piece's) shared memory use
    # math views of sub-tile entries (NW runs): K codes at slot byte 0, V codes at byte H + G, the scale
    # words at words H/4 and SLOT/4 - 1. Each view is [NW, TW, 2, n] over 2n-element slot pieces padded
    # to the slot (128 + 8 bytes, 32 + 2 words) and based at its piece's offset; slicing index 0 of the
    # size-2 axis skips the rest of the slot (shared layouts cannot broadcast)
    PB: gl.constexpr = _slot_layout(2 * H, SLOT - 2 * H, [NW, TW, 2, H], None, TMK, 4 * XP, SLOT, NSUB, 4 * SPAD)
    PV: gl.constexpr = _slot_layout(2 * H, SLOT - 2 * H, [NW, TW, 2, H // 8, 8], None, TMK, 4 * XP, SLOT, NSUB,
                                    4 * SPAD)
    SW2: gl.constexpr = 32 * (D // 128)               # a slot's words without its 2 (or 4) padding words
    PWD: gl.constexpr = _slot_layout(SW2, SLOT // 4 - SW2, [NW, TW, 2, SW2 // 2], None, TMK, XP, SLOT, NSUB,
                                     SPAD)
    # K code words for _qk_runs: [NW, TW, *, 8 (score column 2i + c: word 4c + i)], index 0 of axis 2
    PKW: gl.constexpr = _slot_layout(SW2, SLOT // 4 - SW2, [NW, TW, SW2 // 8, 8], [2, 4, 1], TMK, XP, SLOT, NSUB,
                                     SPAD)
    E: gl.constexpr = STAGES * NSUB
    RUNB: gl.constexpr = 4096 * (D // 128)            # a power of two >= a run's bytes
    bytes8 = ring._reinterpret(gl.uint8, [STAGES * NR * RUNB], FLAT)
    words = ring._reinterpret(gl.int32, [STAGES * NR * RUNB // 4], FLAT)
    kc8 = ring._reinterpret(gl.uint8, [E, NW, TW, 2, H], PB)
    kwa = words._reinterpret(gl.int32, [E, NW, TW, SW2 // 8, 8], PKW)  # groups 0, 1 (words 0..7)
    kwb = words.slice(8, 8)._reinterpret(gl.int32, [E, NW, TW, SW2 // 8, 8], PKW)  # groups 2, 3
    kwc = words.slice(16, 16)._reinterpret(gl.int32, [E, NW, TW, SW2 // 8, 8], PKW)  # D=256: groups 4, 5
    kwd = words.slice(24, 8)._reinterpret(gl.int32, [E, NW, TW, SW2 // 8, 8], PKW)  # D=256: groups 6, 7
    # V code words for _pv_word: [NW, 16, 8, WPT, 2] views based at V words 0..WPT-1 (:func:`_vword_layout`)
    WPT: gl.constexpr = D // 64
    PVW: gl.constexpr = _vword_layout(NW, WPT, SLOT // 4, TMK, XP, NSUB, SPAD)
    V0: gl.constexpr = (H + G) // 4
    vwa = words.slice(V0, 1)._reinterpret(gl.int32, [E, NW, 16, 8, WPT, 2], PVW)
    vwb = words.slice(V0 + 1, 1)._reinterpret(gl.int32, [E, NW, 16, 8, WPT, 2], PVW)
    vwc = words.slice(V0 + 2, 1)._reinterpret(gl.int32, [E, NW, 16, 8, WPT, 2], PVW)
    vwd = words.slice(V0 + 3, 1)._reinterpret(gl.int32, [E, NW, 16, 8, WPT, 2], PVW)
    vc8 = bytes8.slice(H + G, 4)._reinterpret(gl.uint8, [E, NW, TW, 2, H // 8, 8], PV)
    ks = words.slice(H // 4, H // 4)._reinterpret(gl.int32, [E, NW, TW, 2, SW2 // 2], PWD)
    ks1 = words.slice(H // 4 + 1, 1)._reinterpret(gl.int32, [E, NW, TW, 2, SW2 // 2], PWD)  # D=256: groups 4..7
    vs = words.slice((SLOT - G) // 4, 1)._reinterpret(gl.int32, [E, NW, TW, 2, SW2 // 2], PWD)
    vs1 = words.slice((SLOT - G) // 4 + 1, 1)._reinterpret(gl.int32, [E, NW, TW, 2, SW2 // 2], PWD)  # D=256
    KW: gl.constexpr = gl.SliceLayout(1, KB)            # [NW, TW] K scale words
    # rows in N: S^T [NW, TW, ROWS] = K [NW, TW, H] q^T [NW, H, ROWS]; O^T [NW, H, ROWS] = V^T P^T
    PTB: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)   # P^T [NW, TW, ROWS]
    VA: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)   # V^T halves [NW, H, TW] (rows permuted as VB's columns)
    TOKT: gl.constexpr = gl.SliceLayout(2, MMA)         # [NW, TW] score rows (tokens)
    ROWT: gl.constexpr = gl.SliceLayout(1, MMA)         # [NW, ROWS] score columns (query rows)
    WARPT: gl.constexpr = gl.SliceLayout(1, ROWT)       # [NW]
    VW: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, VL))  # [NW, TW] V scale words

    # ---- the query first: its loads depend on nothing the piece computes, so they overlap the length's and the
    # block ids' round trips instead of waiting behind the first stage's copies (benchmarks/NOTES.md)
    qr3 = _iota3(RR, 1, QL)
    qc3 = _iota3(D, 2, QL)
    qh3 = _iota3(NW, 0, QL) // WT
    q_row = q_ptr + b.to(gl.int64) * stride_qb + (qh3 * GQA + qr3) * stride_qh + qc3
    q_ins = ()
    for g in gl.static_range(RG):  # rows in N above GQA 8: RG = 2 groups of 8 rows
        q_ins = q_ins + (gl.load(q_row + g * RR * stride_qh, mask=(qr3 + g * RR < GQA) & (qc3 < D), other=0.0),)
    bt_row = bt_ptr + b.to(gl.int64) * stride_btb
    t_skip = (gl.maximum(cs, w0) - cs) * TT  # the piece's first token past the request's first stage
    if not HAS_WINDOW:  # the piece's first stage does not depend on the length: its ids load with the query
        first_ids = _first_blocks(bt_row, t_skip, cap, BLOCK_SIZE, NW, True)
    length = gl.load(seqlen_ptr + b)
    gl.store(err_ptr + ERR_SEQ_LEN, 1, mask=(length < 0) | (length > cap))
    length = gl.minimum(gl.maximum(length, 0), cap)
    lo = 0
    if HAS_WINDOW:
        lo = gl.maximum(length - window, 0)
    lo_run = (lo // TT) * TT  # stages start on TT-token boundaries (whole runs); tokens below lo are masked
    ce = cs + _units(length, window, cap, TT, HAS_WINDOW)
    t_lo = lo_run + t_skip
    t_hi = gl.minimum(lo_run + (gl.minimum(ce, w1) - cs) * TT, length)
    n_it = gl.cdiv(gl.maximum(t_hi - t_lo, 0), TT)
    first = _owner(cs, active, total)  # the programs that hold pieces of request b: first .. last
    nparts = _owner(ce - 1, active, total) - first + 1
    if HAS_WINDOW:
        first_ids = _first_blocks(bt_row, t_lo, t_hi, BLOCK_SIZE, NW, True)
    # ---- prologue: STAGES - 1 stages in flight, each run checking its own block id (the range's check below
    # waits for its block-table loads; the copies do not)
    c_lane, c_warp = _lanes_warps(NW)
    for i in gl.static_range(STAGES - 1):
        if TOKEN_MAJOR:
            _issue_stage_tm(stages, i, cache_ptr, bt_row, t_lo + i * TT, t_hi, stride_cb, False, num_blocks,
                            TT, NW, HK, SLOT, XP, BLOCK_SIZE)
            async_copy.commit_group()
        else:
            _issue_stage(i, cache_ptr, t_lo + i * TT, t_hi, stride_cb, stride_ch, False, num_blocks,
                         _warp_ids(bt_row, t_lo + i * TT, t_hi, c_warp, NSUB, NW, WT, BLOCK_SIZE), c_lane, c_warp,
                         NSUB, NW, WT, SLOT, BLOCK_SIZE)
    if TOKEN_MAJOR:
        ids = ()
    else:
        ids = _warp_ids(bt_row, t_lo + (STAGES - 1) * TT, t_hi, c_warp, NSUB, NW, WT, BLOCK_SIZE)
    inside = _blocks_inside(bt_row, t_lo, t_hi, num_blocks, err_ptr, first_ids, BLOCK_SIZE)

    # score axes: rows (query rows) and tokens; QR/QW/TK: per-row, per-warp, per-token state layouts
    RAX: gl.constexpr = _pick(ROWS_IN_N, 2, 1)
    TAX: gl.constexpr = 3 - RAX
    QR: gl.constexpr = _pick(ROWS_IN_N, ROWT, ROW)
    QW: gl.constexpr = _pick(ROWS_IN_N, WARPT, WARP)
    TK: gl.constexpr = _pick(ROWS_IN_N, TOKT, TOK)
    KWL: gl.constexpr = _pick(ROWS_IN_N, TOKT, KW)
    # ---- query: rotate, scale, fp16 halves times a per-row power of two (as split-KV), once per row group;
    # qf: 10 values per group (rows in N: fragments q0..q7; m16: the halves q_e, q_o)
    qf = ()
    rowfacs = ()
    rowbiases = ()
    for g in gl.static_range(RG):  # each row group its own query fragments, over the same decoded K/V fragments
        q = _fwht_split(q_ins[g].to(gl.float32), NW, RR, D, LOG2D, QL2)
        if HAS_SOFTCAP:
            q = q * scale
        else:
            q = q * (scale * LOG2E)
        amax = gl.max(gl.abs(q), axis=2)
        e = gl.maximum(_floor_log2(amax), -100)
        if ROWS_IN_N:
            # fp16 with the row's largest element in [2**14, 2**15); K's fp16 codes are fp4 * 2**-14
            q = q * gl.expand_dims(_pow2(14 - e), 2)
            if D == 256:  # groups 0..3 and 4..7 (two _qk_runs per run)
                q = gl.convert_layout(q, _halves_layout(NW, RR))
                qa, qb = gl.split(gl.permute(gl.reshape(q, [NW, RR, 2, 128]), [0, 1, 3, 2]))
                q0, q1, q2, q3 = _query_frags(qa, NW, MMA)
                q4, q5, q6, q7 = _query_frags(qb, NW, MMA)
            else:
                q0, q1, q2, q3 = _query_frags(q, NW, MMA)
                q4 = 0
                q5 = 0
                q6 = 0
                q7 = 0
            q_e = 0
            q_o = 0
            rowscale = _pow2(e)
        else:
            q = q * gl.expand_dims(_pow2(14 - e), 2)
            q_e, q_o = gl.split(gl.reshape(q, [NW, RR, H, 2]))
            q_e = gl.convert_layout(q_e.to(gl.float16), QA)
            q_o = gl.convert_layout(q_o.to(gl.float16), QA)
            q0 = 0
            q1 = 0
            q2 = 0
            q3 = 0
            q4 = 0
            q5 = 0
            q6 = 0
            q7 = 0
            rowscale = _pow2(e - 14)
        qf = qf + (q0, q1, q2, q3, q4, q5, q6, q7, q_e, q_o)
        rowfacs = rowfacs + (gl.convert_layout(rowscale, QR),)
        rows = gl.arange(0, RR, gl.SliceLayout(0, QR)) + g * RR
        rowbiases = rowbiases + (gl.expand_dims(gl.where(rows < GQA, 0.0, float("-inf")), 0),)

    # ---- per-warp token offsets in the per-token layout; K groups in the K operand layout; V byte groups
    ws = gl.expand_dims(gl.arange(0, NW, gl.SliceLayout(1, TK)) % WT, 1) * TW
    if TOKEN_MAJOR:  # token order of _tm_token_bases
        ns = gl.expand_dims(_tm_physical_token(gl.arange(0, TW, gl.SliceLayout(0, TK)), HK, SLOT), 0)
    elif SLOT == 272:  # D=256 head-major: the identity order (_hm_token_bases)
        ns = gl.expand_dims(gl.arange(0, TW, gl.SliceLayout(0, TK)), 0)
    else:
        ns = gl.expand_dims(_physical_token(gl.arange(0, TW, gl.SliceLayout(0, TK))), 0)
    kgroup = 0  # m16 only: the K and V groups of the fp16-halves path
    vgroup = 0
    if not ROWS_IN_N:
        kgroup = _iota3(H, 1, KB) // 16
        SV: gl.constexpr = gl.SliceLayout(3, VL)
        gv = gl.expand_dims(gl.expand_dims(gl.arange(0, 8, gl.SliceLayout(0, gl.SliceLayout(1, SV))), 0), 1)
        R3: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, VL)))
        rv = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.arange(0, 8, R3), 0), 1), 2)
        vgroup = gl.expand_dims(gv // 2, 3) + rv * 0

    # accumulators: rows in N, 8 tiles [NW, 16 dims, 8 rows] (_pv_word) per row group; m16, even / odd dims
    # [NW, 16, 64]; accs[g * NT + t]: tile t of row group g
    NT: gl.constexpr = D // 16 if ROWS_IN_N else 2
    ACC: gl.constexpr = _pick(ROWS_IN_N, [NW, 16, RR], [NW, RR, H])
    accs = ()
    for _t in gl.static_range(RG * NT):
        accs = accs + (gl.zeros(ACC, gl.float32, MMA),)
    m_i, l_i, run = _online_start(RG, [NW, RR], QR, QW)
    for it in range(n_it):
        if TOKEN_MAJOR:
            cur, t0 = _advance_ring_tm(stages, it, cache_ptr, bt_row, t_lo, t_hi, stride_cb, inside, num_blocks,
                                       STAGES, TT, NSUB, NW, HK, SLOT, XP, BLOCK_SIZE)
        else:
            cur, t0, ids = _advance_ring(it, cache_ptr, bt_row, t_lo, t_hi, stride_cb, stride_ch, inside,
                                         num_blocks, ids, c_lane, c_warp, STAGES, TT, NSUB, NW, WT, SLOT, BLOCK_SIZE)
        whole = inside & (t0 + TT <= t_hi)  # every token of the stage counts: the loop's interior, no masks
        if HAS_WINDOW:
            whole = whole & (t0 >= lo)
        for jp in gl.static_range(NSUB // PAIR):
            j = jp * PAIR
            kw = _piece(ks.index(cur + j), [NW, TW], KWL, KWL)
            # scores of PAIR runs (ss[i * RG + g]), then ONE online-softmax update per row group for all of
            # them (one cross-lane max, one sum, one rescale of the accumulator per PAIR * 16 tokens)
            ss = ()
            for i in gl.static_range(PAIR):
                kwi = kw
                if i > 0:
                    kwi = _piece(ks.index(cur + j + i), [NW, TW], KWL, KWL)
                kwi1 = kwi
                if D == 256:
                    kwi1 = _piece(ks1.index(cur + j + i), [NW, TW], KWL, KWL)
                e_i = cur + j + i
                if RG == 1:
                    ss = ss + (_run_scores(kwa.index(e_i), kwb.index(e_i), kwc.index(e_i), kwd.index(e_i),
                                           kc8.index(e_i), kwi, kwi1, qf[0], qf[1], qf[2], qf[3], qf[4], qf[5],
                                           qf[6], qf[7], qf[8], qf[9], kgroup, rowfacs[0], rowbiases[0], softcap,
                                           D, NW, TW, RR, H, ROWS_IN_N, HAS_SOFTCAP, MMA, KB, TK, RAX, TAX),)
                else:
                    ss = ss + _run_scores2(kwa.index(e_i), kwb.index(e_i), kwi, qf[0], qf[1], qf[2], qf[3], qf[10],
                                           qf[11], qf[12], qf[13], rowfacs[0], rowfacs[1], rowbiases[0],
                                           rowbiases[1], softcap, NW, TW, HAS_SOFTCAP, MMA)
            if not whole:  # an edge stage: the request's end, the window's start, or a bad block id
                ss = _mask_runs(ss, t0, j, ws, ns, t_hi, lo, inside, bt_row, num_blocks, RG, PAIR, WT, TW,
                                HAS_WINDOW, BLOCK_SIZE, RAX)
            ps, alphas, m_i, l_i = _online_update(ss, m_i, l_i, RG, PAIR, TAX)  # ps[g * PAIR + i]

            # V: scale word per token, reference exponent from the largest contribution of the runs
            vws = ()
            vws1 = ()
            vtops = ()
            vexps = ()
            for i in gl.static_range(PAIR):
                if ROWS_IN_N:  # the score layout's tokens
                    vw = _piece(vs.index(cur + j + i), [NW, TW], TK, TK)
                    vtop = _token_top(vw)
                    vw1 = vw
                    if D == 256:
                        vw1 = _piece(vs1.index(cur + j + i), [NW, TW], TK, TK)
                        vtop = gl.maximum(vtop, _token_top(vw1))
                    vws1 = vws1 + (vw1,)
                    vexps = vexps + (vtop - 127,)
                else:
                    vw = gl.expand_dims(_piece(vs.index(cur + j + i), [NW, TW], VW, VW), 2)
                    vtop = _token_top(vw)
                    vexps = vexps + (gl.convert_layout(gl.max(vtop, axis=2), TK) - 127,)
                vws = vws + (vw,)
                vtops = vtops + (vtop,)
            cmax = ps[0] * gl.expand_dims(_pow2(gl.minimum(vexps[0], 127)), RAX)
            for k in gl.static_range(1, RG * PAIR):
                cmax = gl.maximum(cmax, ps[k] * gl.expand_dims(_pow2(gl.minimum(vexps[k % PAIR], 127)), RAX))
            ctop = _floor_log2(gl.max(gl.max(cmax, axis=TAX), axis=1))
            alpha_top = gl.max(alphas[0], axis=1)
            for g in gl.static_range(1, RG):
                alpha_top = gl.maximum(alpha_top, gl.max(alphas[g], axis=1))
            shrink = _floor_log2(alpha_top)
            new_run = gl.maximum(run + shrink, ctop)
            nr = gl.expand_dims(gl.convert_layout(new_run, gl.SliceLayout(1, TK)), 1)
            scaled = ()
            for g in gl.static_range(RG):
                c = gl.expand_dims(alphas[g] * gl.expand_dims(_pow2(gl.minimum(run - new_run, 127)), 1), TAX)
                for t in gl.static_range(NT):
                    scaled = scaled + (accs[g * NT + t] * c,)
            accs = scaled
            for i in gl.static_range(PAIR):
                if ROWS_IN_N:
                    fr = _pv_operands(ps[i], gl.expand_dims(vws[i], 2), gl.expand_dims(vws1[i], 2),
                                      gl.expand_dims(vtops[i], 2), gl.expand_dims(nr, 2), D, True, MMA)
                    vwt = (_piece(vwa.index(cur + j + i), [NW, 16, RR], MMA, MMA),
                           _piece(vwb.index(cur + j + i), [NW, 16, RR], MMA, MMA))
                    if D == 256:
                        vwt = vwt + (_piece(vwc.index(cur + j + i), [NW, 16, RR], MMA, MMA),
                                     _piece(vwd.index(cur + j + i), [NW, 16, RR], MMA, MMA))
                    tiles = ()
                    if RG == 1:
                        for v in gl.static_range(NT // 4):  # tile 4 v + k: byte k of the thread's V word v
                            t0_, t1_, t2_, t3_ = _pv_word(accs[4 * v], accs[4 * v + 1], accs[4 * v + 2],
                                                          accs[4 * v + 3], vwt[v], fr)
                            tiles = tiles + (t0_, t1_, t2_, t3_)
                    else:  # the second row group's probabilities (its relative V scales are the first's)
                        fr2 = _pv_operands(ps[PAIR + i], gl.expand_dims(vws[i], 2), gl.expand_dims(vws1[i], 2),
                                           gl.expand_dims(vtops[i], 2), gl.expand_dims(nr, 2), D, False, MMA)
                        tiles2 = ()
                        for v in gl.static_range(NT // 4):
                            o = _pv_word2(accs[4 * v], accs[4 * v + 1], accs[4 * v + 2], accs[4 * v + 3],
                                          accs[NT + 4 * v], accs[NT + 4 * v + 1], accs[NT + 4 * v + 2],
                                          accs[NT + 4 * v + 3], vwt[v], fr, fr2)
                            tiles = tiles + (o[0], o[1], o[2], o[3])
                            tiles2 = tiles2 + (o[4], o[5], o[6], o[7])
                        tiles = tiles + tiles2
                    accs = tiles
                else:
                    acc_e, acc_o = _run_pv(accs[0], accs[1], vc8.index(cur + j + i), vws[i], vtops[i], vexps[i],
                                           ps[i], nr, vgroup, NW, TW, H, ROWS_IN_N, VL, VLW, VA, VB, PTB, PA, RAX)
                    accs = (acc_e, acc_o)
            run = new_run
    if TOKEN_MAJOR:
        async_copy.wait_group(0)
    else:
        _ring_drained(c_lane)

    pair0 = b * HK
    # ---- the program's partial of each kv head (acc * 2**run, m, l; its WT token groups combined
    # here, across warps) to the workspace, coalesced: slot (pid + b)*HK + h (the schedule's piece index)
    f = gl.expand_dims(gl.expand_dims(_pow2(gl.minimum(run, 127)), 1), TAX)
    xs = ()
    for g in gl.static_range(RG):
        scaled = ()
        for t in gl.static_range(NT):
            scaled = scaled + (accs[g * NT + t] * f,)
        xs = xs + (_partial_rows(scaled, NT, NW, RR, D, ROWS_IN_N),)
    if RG == 1:
        x_rows = xs[0]
        m_rows = m_i[0]
        l_rows = l_i[0]
    else:  # row 8 g + r of the partial: row r of group g
        x_rows = gl.reshape(gl.permute(gl.join(xs[0], xs[1]), [0, 3, 1, 2]), [NW, ROWS, D])
        m_rows = gl.reshape(gl.permute(gl.join(m_i[0], m_i[1]), [0, 2, 1]), [NW, ROWS])
        l_rows = gl.reshape(gl.permute(gl.join(l_i[0], l_i[1]), [0, 2, 1]), [NW, ROWS])
    EP: gl.constexpr = gl.BlockedLayout([1, WT, 1, 4], [1, 1, 1, 32], [HK, 1, WT, 1], [3, 1, 2, 0])  # WT in-thread
    E3: gl.constexpr = gl.SliceLayout(3, EP)
    acc_c, m_c, l_c = _combine_token_groups(x_rows, m_rows, l_rows, HK, WT, ROWS, D, EP)
    P3: gl.constexpr = gl.SliceLayout(1, EP)
    P2: gl.constexpr = gl.SliceLayout(1, E3)
    ph = _iota3(HK, 0, P3)
    pr = _iota3(ROWS, 1, P3)
    pc = _iota3(D, 2, P3)
    pmask = (pr < GQA) & (pc >= 0) & (ph >= 0)
    if nparts == 1:  # the request's only piece: its output from the registers (no workspace, no ticket)
        O2: gl.constexpr = gl.SliceLayout(2, P3)
        m_o = gl.convert_layout(m_c, O2)
        l_o = gl.convert_layout(l_c, O2)
        oh2 = gl.expand_dims(gl.arange(0, HK, gl.SliceLayout(1, O2)), 1)
        or2 = gl.expand_dims(gl.arange(0, ROWS, gl.SliceLayout(0, O2)), 0)
        _write_out(acc_c, m_o, l_o, out_ptr, b, sinks_ptr, ph, pr, pc, oh2, or2, pmask, (or2 < GQA) & (oh2 >= 0),
                   stride_ob, stride_oh, GQA, HAS_SINKS)
        return ce
    pslot = ((pid + b) * HK + ph).to(gl.int64)
    gl.store(part_ptr + pslot * (ROWS * D) + pr * D + pc, acc_c, mask=pmask)
    ph2 = gl.expand_dims(gl.arange(0, HK, gl.SliceLayout(1, P2)), 1)
    pr2 = gl.expand_dims(gl.arange(0, ROWS, gl.SliceLayout(0, P2)), 0)
    mlp = ml_ptr + ((pid + b) * HK + ph2).to(gl.int64) * (2 * ROWS) + pr2
    mlmask = (pr2 < GQA) & (ph2 >= 0)
    gl.store(mlp, m_c, mask=mlmask)
    gl.store(mlp + ROWS, l_c, mask=mlmask)
    gl.thread_barrier()
    ticket = gl.atomic_add(counter_ptr + pair0, 1)
    if ticket == nparts - 1:
        # ---- last program of this request: merge every head's nparts partials (slots first + b ..)
        ML: gl.constexpr = _merge_layout(HK, GQA_PAD, D, NW)
        mh = gl.expand_dims(gl.expand_dims(gl.arange(0, HK, gl.SliceLayout(1, gl.SliceLayout(2, ML))), 1), 2)
        mr = gl.expand_dims(gl.expand_dims(gl.arange(0, GQA_PAD, gl.SliceLayout(0, gl.SliceLayout(2, ML))), 0), 2)
        mc = gl.expand_dims(gl.expand_dims(gl.arange(0, D, gl.SliceLayout(0, gl.SliceLayout(1, ML))), 0), 1)
        M2: gl.constexpr = gl.SliceLayout(2, ML)
        mh2 = gl.expand_dims(gl.arange(0, HK, gl.SliceLayout(1, M2)), 1)
        mr2 = gl.expand_dims(gl.arange(0, GQA_PAD, gl.SliceLayout(0, M2)), 0)
        acc = gl.zeros([HK, GQA_PAD, D], gl.float32, ML)
        m_a = gl.full([HK, GQA_PAD], float("-inf"), gl.float32, M2)
        l_a = gl.zeros([HK, GQA_PAD], gl.float32, M2)
        rmask3 = (mr < GQA) & (mc >= 0) & (mh >= 0)
        rmask2 = (mr2 < GQA) & (mh2 >= 0)
        for s0 in range(0, nparts, MERGE):  # MERGE partials per step: their loads overlap
            accs2 = ()
            ms2 = ()
            ls2 = ()
            for k in gl.static_range(MERGE):
                s = s0 + k
                src3 = ((first + s + b) * HK + mh).to(gl.int64)
                src2 = ((first + s + b) * HK + mh2).to(gl.int64)
                accs2 = accs2 + (gl.load(part_ptr + src3 * (ROWS * D) + mr * D + mc, mask=rmask3 & (s < nparts),
                                         other=0.0, cache_modifier=".cg"),)
                ms2 = ms2 + (gl.load(ml_ptr + src2 * (2 * ROWS) + mr2, mask=rmask2 & (s < nparts),
                                     other=float("-inf"), cache_modifier=".cg"),)
                ls2 = ls2 + (gl.load(ml_ptr + src2 * (2 * ROWS) + ROWS + mr2, mask=rmask2 & (s < nparts),
                                     other=0.0, cache_modifier=".cg"),)
            acc, m_a, l_a = _fold_partials(acc, m_a, l_a, accs2, ms2, ls2, MERGE)
        _write_out(acc, m_a, l_a, out_ptr, b, sinks_ptr, mh, mr, mc, mh2, mr2, rmask3, rmask2, stride_ob, stride_oh,
                   GQA, HAS_SINKS)
        gl.atomic_xchg(counter_ptr + pair0, 0, sem="relaxed")  # no fence: the launch boundary orders it
    return ce


@gluon.jit
def uq_decode_wholepage(q_ptr, cache_ptr, bt_ptr, seqlen_ptr, sinks_ptr, out_ptr, part_ptr, ml_ptr, counter_ptr,
                        err_ptr, scale, softcap, window, num_requests, num_blocks, bt_cols,
                        stride_qb, stride_qh, stride_ob, stride_oh,
                        stride_cb, stride_ct, stride_ch, stride_btb,
                        D: gl.constexpr, LOG2D: gl.constexpr, GQA: gl.constexpr, ROWS: gl.constexpr,
                        GQA_PAD: gl.constexpr, HK: gl.constexpr, WT: gl.constexpr, NSUB: gl.constexpr,
                        STAGES: gl.constexpr, TW: gl.constexpr, BLOCK_SIZE: gl.constexpr, HAS_SINKS: gl.constexpr,
                        HAS_WINDOW: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
                        ROWS_IN_N: gl.constexpr, MIN_TOKENS: gl.constexpr, PIECE_UNITS: gl.constexpr,
                        TOKEN_MAJOR: gl.constexpr = False):
    """Whole-page paged decode over a persistent grid ``(programs, 1, 1)`` balanced from ``seq_lens`` on
    the device (``num_requests``: the batch size); see the module docstring.
    ``ROWS_IN_N``: the query rows are the MMA N dimension (S^T = K Q^T, O^T = V^T P^T; 8 rows per MMA, ROWS =
    16 as two 8-row groups over the same decoded K/V fragments) instead of 16 padded M rows. Each piece is one
    call of the noinline :func:`_serve_piece`. ``TOKEN_MAJOR``: the cache's pages are token-major
    (``(block, token, head, slot)`` memory order, Hk > 1): :func:`_issue_stage_tm`."""
    gl.static_assert(D == 128 or (D == 256 and ROWS_IN_N), "the whole-page decode: D=128, or D=256 with rows in N")
    gl.static_assert((ROWS == 16 and not ROWS_IN_N) or (ROWS == 8 and ROWS_IN_N) or (ROWS == 16 and D == 128),
                     "the whole-page decode: 16 M rows (GQA <= 16), 8 N rows (GQA <= 8) or two groups of 8 in N "
                     "(GQA <= 16, D=128)")
    gl.static_assert(TW == 16, "the whole-page decode: 16-token runs per warp")
    NW: gl.constexpr = gl.num_warps()
    gl.static_assert(NW == HK * WT, "the whole-page decode: num_warps must be HK * WT")
    TT: gl.constexpr = NSUB * WT * TW
    MIN_UNITS: gl.constexpr = max(1, MIN_TOKENS // TT)  # the schedule's shortest piece at the average

    # ---- the balanced schedule (module docstring): this program's share [w0, w1) of the batch's total cost
    pid = gl.program_id(0)
    progs = gl.num_programs(0)
    cap = bt_cols * BLOCK_SIZE  # bounds: a length outside [0, the row's capacity] is clamped, error word set
    total, active, w0, w1, b_first, cs, b_last, pc = _schedule(seqlen_ptr, num_requests, window, cap, pid, progs,
                                                               TT, HAS_WINDOW, MIN_UNITS, PIECE_UNITS, NW)
    # each piece is one call of a noinline function: ptxas then schedules the stage loop as in a kernel
    # without the piece loop around it (inlined, it issued the shared loads closer to their uses and the
    # uniform shapes ran 12-19% slower than the static split: benchmarks/NOTES.md, "Serving decode")
    for b in range(b_first, b_last + 1):
        cs = _serve_piece(q_ptr, cache_ptr, bt_ptr, seqlen_ptr, sinks_ptr, out_ptr, part_ptr, ml_ptr, counter_ptr,
                          err_ptr, scale, softcap, window, num_blocks, cap, stride_qb, stride_qh, stride_ob, stride_oh,
                          stride_cb, stride_ch, stride_btb, b, cs, w0, w1, total, active, pid,
                          D, LOG2D, GQA, ROWS, GQA_PAD, HK, WT, NSUB, STAGES, TW, BLOCK_SIZE,
                          HAS_SINKS, HAS_WINDOW, HAS_SOFTCAP, ROWS_IN_N, TOKEN_MAJOR) + pc
