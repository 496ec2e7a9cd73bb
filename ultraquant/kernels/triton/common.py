"""Triton device helpers shared by the UltraQuant kernels (imports triton).

Everything here is a ``@triton.jit`` function inlined into the kernels of ``store``, ``dequant`` and
``attention``: the FP4 E2M1 encoder (all three tie/scale rules of :mod:`ultraquant.reference`), the
UE8M0 scale rule computed on the float32 bits (bit-exact with the reference), the FP4 decoder built on
an fp16 subnormal bit pattern (no table, no branch), and a Walsh-Hadamard butterfly that applies the
normalized Sylvester matrix H in registers (log2 D add/subtract stages, then one multiply).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..flags import KernelError

ERR_SLOT = tl.constexpr(KernelError.SLOT_OUT_OF_RANGE.bit_length() - 1)
ERR_BLOCK = tl.constexpr(KernelError.BLOCK_OUT_OF_RANGE.bit_length() - 1)
ERR_SEQ_LEN = tl.constexpr(KernelError.SEQ_LEN_OUT_OF_RANGE.bit_length() - 1)
"""Indices of the error words (``err_ptr``) the kernels store 1 into (:mod:`ultraquant.kernels.flags`)."""


@triton.jit
def row_capacity(length, bt_cols, err_ptr, BLOCK_SIZE: tl.constexpr):
    """Tokens a block-table row covers; a request ``length`` outside [0, that] sets the error word."""
    cap = bt_cols * BLOCK_SIZE
    tl.store(err_ptr + ERR_SEQ_LEN, 1, mask=(length < 0) | (length > cap))
    return cap


@triton.jit
def clamp_length(length, bt_cols, err_ptr, BLOCK_SIZE: tl.constexpr):
    """A request's length clamped to [0, what its block-table row covers] (:func:`row_capacity`)."""
    return tl.minimum(tl.maximum(length, 0), row_capacity(length, bt_cols, err_ptr, BLOCK_SIZE))


@triton.jit
def blocks_inside(bt_row_ptr, t_lo, t_hi, num_blocks, err_ptr, BLOCK_SIZE: tl.constexpr, CHUNK: tl.constexpr = 64):
    """True when every block id covering tokens ``[t_lo, t_hi)`` of a block-table row is inside
    [0, num_blocks); otherwise sets the error word. One check per entry (CHUNK entries a step), not
    per token: callers branch once to a loop without per-token checks."""
    hi = tl.cdiv(t_hi, BLOCK_SIZE)
    bad = tl.zeros([CHUNK], dtype=tl.int32)
    for j0 in range(t_lo // BLOCK_SIZE, hi, CHUNK):
        j = j0 + tl.arange(0, CHUNK)
        used = j < hi
        blk = tl.load(bt_row_ptr + j, mask=used, other=0)
        bad = bad | (used & ((blk < 0) | (blk >= num_blocks))).to(tl.int32)
    found = tl.max(bad, axis=0)
    tl.store(err_ptr + ERR_BLOCK, 1, mask=found != 0)
    return found == 0


@triton.jit
def block_ids(bt_row_ptr, toks, tmask, num_blocks, BLOCK_SIZE: tl.constexpr, CHECKED: tl.constexpr):
    """Block ids of tokens ``toks`` (where ``tmask``) from one block-table row, and the tokens to read.

    ``CHECKED`` (attention: a range :func:`blocks_inside` found a bad id in; dequant: always): ids
    outside [0, num_blocks) become 0 and their tokens leave the returned mask (an empty block: never
    read). Otherwise the mask is ``tmask``.
    """
    blk = tl.load(bt_row_ptr + toks // BLOCK_SIZE, mask=tmask, other=0)
    if CHECKED:
        ok = (blk >= 0) & (blk < num_blocks)
        return tl.where(ok, blk, 0), tmask & ok
    return blk, tmask


@triton.jit
def _butterfly(x, R: tl.constexpr, D: tl.constexpr, LO: tl.constexpr, HI: tl.constexpr):
    """Stages LO..HI-1 of the unnormalized Walsh-Hadamard butterfly on ``x [R, D]``: stage i pairs the
    elements whose index differs in bit i (reshape so that bit is an axis of size 2, split, join sum
    and difference)."""
    for i in tl.static_range(LO, HI):
        x = tl.reshape(x, [R, D // (2 << i), 2, 1 << i])
        x = tl.permute(x, [0, 1, 3, 2])
        a, b = tl.split(x)
        x = tl.join(a + b, a - b)
        x = tl.permute(x, [0, 1, 3, 2])
        x = tl.reshape(x, [R, D])
    return x


@triton.jit
def fwht(x, R: tl.constexpr, D: tl.constexpr, LOG2D: tl.constexpr):
    """``x @ H`` for a float32 ``[R, D]`` tile, H the normalized Sylvester Hadamard matrix.

    log2(D) butterfly stages of adds (:func:`_butterfly`), then one scale by 1/sqrt(D). Why a
    butterfly and not a product with H: D log D adds instead of D^2 FMAs and no H in memory.
    """
    return _butterfly(x, R, D, 0, LOG2D) * (1.0 / tl.sqrt(float(D)))


@triton.jit
def fwht_lanes(x, R: tl.constexpr, D: tl.constexpr, LOG2D: tl.constexpr):
    """:func:`fwht` for a tile whose rows are spread over lanes, 8 contiguous elements per thread and
    load (the store's LANES layout): the stages within 8 elements as fwht's, the others take the
    partner from ``tl.flip`` on that index bit (one lane exchange where the bit is a lane's) and add
    it with one multiply-add by +-1: the same ``a + b`` and ``a - b`` of the same pairs in the same
    order as fwht, so the same bits."""
    S: tl.constexpr = 3 if LOG2D > 3 else LOG2D
    x = _butterfly(x, R, D, 0, S)
    for i in tl.static_range(S, LOG2D):
        y = tl.reshape(x, [R, D // (2 << i), 2, 1 << i])
        sign = (1 - 2 * tl.arange(0, 2)).to(tl.float32)[None, None, :, None]
        x = tl.reshape(tl.flip(y, 2) + y * sign, [R, D])
    return x * (1.0 / tl.sqrt(float(D)))


@triton.jit
def slot_rows(pid, slot_ptr, err_ptr, n_rows, num_kv_heads, block_size, num_slots, stride_cb, stride_ct, stride_ch,
              R: tl.constexpr, ALIGN: tl.constexpr):
    """The store's rows of program ``pid``: row r is token ``r // Hk``, kv head ``r % Hk``, at slot
    ``slot_mapping[token]``. Returns (token, kv head, the slot's int64 byte offset in the cache, declared
    a multiple of ``ALIGN``, valid): rows past ``n_rows`` and negative slots are not valid (offset
    0); slots ``>= num_slots`` neither, and they set error word ERR_SLOT. (The alignment is declared
    here: ``tl.multiple_of`` on a value returned from a jit function does not reach the code.)"""
    rows = pid * R + tl.arange(0, R)
    in_range = rows < n_rows
    tok = rows // num_kv_heads
    head = rows % num_kv_heads
    slot = tl.load(slot_ptr + tok, mask=in_range, other=-1).to(tl.int64)
    beyond = in_range & (slot >= num_slots)
    tl.store(err_ptr + ERR_SLOT + tl.zeros_like(rows), 1, mask=beyond)
    valid = in_range & (slot >= 0) & ~beyond
    slot = tl.where(valid, slot, 0)
    blk = slot // block_size
    off = slot % block_size
    return tok, head, tl.multiple_of(blk * stride_cb + off * stride_ct + head.to(tl.int64) * stride_ch, ALIGN), valid


@triton.jit
def pow2_f32(e):
    """``2**e`` as an exact float32 for int32 ``e`` in [-126, 127] (0.0 below, like the reference)."""
    b = e + 127
    return tl.where(b > 0, (b << 23), 0).to(tl.float32, bitcast=True)


@triton.jit
def upstream_exponent(amax):
    """Upstream's scale exponent of a float32 group absmax, on the bits (see reference).

    ``t = float32(0.156 * amax)``; exponent field + 1 when the mantissa is >= sqrt(2)'s; -126 for a
    zero/subnormal t; clamped to [-126, 127].
    """
    t = amax * 0.156
    bits = t.to(tl.int32, bitcast=True)
    field = (bits >> 23) & 0xFF
    exp = field - 127 + ((bits & 0x7FFFFF) >= 0x3504F4).to(tl.int32)
    exp = tl.where(field == 0, -126, exp)
    return tl.minimum(tl.maximum(exp, -126), 127)


@triton.jit
def e2m1_encode(x, inv, eb, ENCODER: tl.constexpr):
    """int32 E2M1 codes of ``y = x * inv`` (``inv = 2**-e`` float32, ``eb = e << 23`` int32, both
    broadcast per group). Zero and values rounding to zero may come back as ``8`` (negative zero):
    callers clear those nibbles (:func:`_clear_negative_zero`).

    ENCODER 0 / 2: ties to the even code (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4);
    ENCODER 1: upstream's rule, ties toward the lower level on the number line. No threshold
    compares: the grid step is 0.5 below 2, 1 in [2, 4), 2 in [4, 8), so with ``f = 2**floor(log2
    |y|)`` (at least 1; from x's exponent field minus e) the float ``m = 2**22 * f`` has an ulp of
    exactly that step and ``s = |y| + m`` (one FFMA) rounds to the grid, ties to even. The code is
    the step count ``bits(s) - bits(m)`` plus twice the binade index, saturated at 7 (6.0).
    Upstream's rule differs only on exact ties, where the rounding residual is a quarter of f.
    """
    xb = x.to(tl.int32, bitcast=True)
    m = _grid_magic(x, eb)
    mf = m.to(tl.float32, bitcast=True)
    # bits(m) = bits(f) + (22 << 23), so 2 log2 f = (bits(f) >> 22) - 254 = (bits(m) >> 22) - 298.
    if ENCODER == 1:
        a = tl.abs(x) * inv
        s = a + mf
        d = (s - mf) - a
        half = (m - (24 << 23)).to(tl.float32, bitcast=True)
        tie = tl.where(x < 0, (d == -half).to(tl.int32), -(d == half).to(tl.int32))
        code = s.to(tl.int32, bitcast=True) - m - 298 + (m >> 22) + tie
    else:
        s = tl.fma(tl.abs(x), inv, mf)
        code = s.to(tl.int32, bitcast=True) - m - 298 + (m >> 22)
    return tl.minimum(code, 7) | ((xb >> 28) & 8)


@triton.jit
def _clear_negative_zero(w):
    """int32 words of eight nibbles: nibbles equal to 8 (negative zero) become 0 (SWAR: a nibble keeps
    its sign bit only when a magnitude bit is set; no carry crosses nibbles)."""
    return w & ((((w & 0x77777777) + 0x77777777) & -0x77777778) | 0x77777777)


@triton.jit
def _grid_magic(x, eb):
    """int32 bits of ``m = 2**22 * f`` for ``y = x * 2**-e`` (``eb = e << 23``), ``f`` = 2**floor(log2
    |y|) at least 1.0: the float whose ulp is the E2M1 grid step at |y| (see :func:`e2m1_encode`).
    One add-and-max on the exponent field (no overflow: |x| <= 2**(e+5) in its group)."""
    return tl.maximum((x.to(tl.int32, bitcast=True) & 0x7F800000) + ((22 << 23) - eb), (127 + 22) << 23)


@triton.jit
def _e2m1_rne_value(a, inv, eb):
    """float32 ``|a| * inv`` rounded half to even to the E2M1 magnitudes (saturated at 6.0)."""
    m = _grid_magic(a, eb)
    mf = m.to(tl.float32, bitcast=True)
    return tl.minimum(tl.fma(tl.abs(a), inv, mf) - mf, 6.0)


@triton.jit
def e2m1_decode_f32(code):
    """Exact float32 value of int32 E2M1 codes, without the scale.

    The 3 magnitude bits placed at fp16 bits 11..9 (exponent low bits + top mantissa bit) give the
    fp16 number ``fp4 * 2**-14`` for all 8 magnitudes (code 1 is a subnormal); the sign goes to bit 15.
    """
    h = ((code & 7) << 9) | ((code & 8) << 12)
    return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def scale_f32(byte):
    """float32 ``2**(byte-127)`` of int32 UE8M0 bytes, 0.0 for the zero-group byte 0."""
    return (byte << 23).to(tl.float32, bitcast=True)


@triton.jit
def _max_nan(a, b):
    """Maximum that returns NaN if either operand is NaN (one FMNMX.NAN), as a reduce combiner."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _group_sq_err(ag, e):
    """float64 squared error of rne-rounding groups of magnitudes ``ag [R, G, 32]`` at exponents e.

    ``ag - q * 2**e`` is exact in float32 (q a rounded, saturated magnitude), so squaring in float64
    gives the reference's error terms.
    """
    q = _e2m1_rne_value(ag, pow2_f32(-e)[:, :, None], (e << 23)[:, :, None])
    d = (ag - q * pow2_f32(e)[:, :, None]).to(tl.float64)
    return tl.sum(d * d, axis=2)


@triton.jit
def _pack_pairs(x, R: tl.constexpr, N: tl.constexpr, BITS: tl.constexpr):
    """int32 ``[R, N]`` -> ``[R, N/2]``: element 2i in the low ``BITS`` bits, 2i+1 above them
    (little-endian packing; in registers when a thread holds whole rows). Elements must be in
    [0, 2**BITS)."""
    lo, hi = tl.split(tl.reshape(x, [R, N // 2, 2]))
    return lo + (hi << BITS)  # disjoint bits: + lets the compiler fuse shift and add (LEA/IMAD)


@triton.jit
def quantize_words(x, R: tl.constexpr, D: tl.constexpr, ENCODER: tl.constexpr, SPREAD: tl.constexpr = False):
    """Quantize a float32 tile ``x [R, D]`` (one vector per row) into its slot words.

    Returns ``(codes, scales)``: int32 ``[R, D/8]`` little-endian words of the nibble-packed codes
    (word j holds codes 8j..8j+7, code 8j+i in bits 4i..4i+3: the bytes the cache holds) and int32
    ``[R, D/32]`` scale bytes. Groups whose absmax is 0 or not finite get byte 0 and zero codes,
    exactly as ultraquant.reference.quantize. Written for a layout where each thread holds whole rows
    (see uq_store_kv): groups, nibble packing and the absmax stay in registers. ``SPREAD``: rows
    spread over lanes (8 elements per thread): zero groups are cleared on the codes (the words' group
    index would take a layout change).
    """
    G: tl.constexpr = D // 32
    xg = tl.reshape(x, [R, G, 32])
    amax = tl.reduce(tl.abs(xg), 2, _max_nan)
    zero = (amax == 0.0) | ~(amax < float("inf"))
    exp = upstream_exponent(amax)
    if ENCODER == 2:
        ag = tl.abs(xg)
        best = exp
        best_err = _group_sq_err(ag, exp)
        e_lo = tl.maximum(exp - 1, -126)
        err = _group_sq_err(ag, e_lo)
        better = err < best_err
        best = tl.where(better, e_lo, best)
        best_err = tl.where(better, err, best_err)
        e_hi = tl.minimum(exp + 1, 127)
        err = _group_sq_err(ag, e_hi)
        best = tl.where(err < best_err, e_hi, best)
        exp = best
    code = e2m1_encode(xg, pow2_f32(-exp)[:, :, None], (exp << 23)[:, :, None], ENCODER)
    if SPREAD:
        code = tl.where(zero[:, :, None], 0, code)
    words = _pack_pairs(_pack_pairs(_pack_pairs(tl.reshape(code, [R, D]), R, D, 4), R, D // 2, 8), R, D // 4, 16)
    words = _clear_negative_zero(words)
    if not SPREAD:
        words = tl.reshape(tl.where(zero[:, :, None], 0, tl.reshape(words, [R, G, 4])), [R, D // 8])
    return words, tl.where(zero, 0, exp + 127)


@triton.jit
def concat(a, b, R: tl.constexpr, N: tl.constexpr):
    """``[R, N]`` and ``[R, N]`` -> ``[R, 2N]``, a's elements first (register renaming in-thread)."""
    return tl.reshape(tl.permute(tl.join(a, b), [0, 2, 1]), [R, 2 * N])


@triton.jit
def pack_scales(scales, R: tl.constexpr, G: tl.constexpr):
    """int32 scale bytes ``[R, G]`` (G >= 4) -> ``[R, G/4]`` little-endian words."""
    return _pack_pairs(_pack_pairs(scales, R, G, 8), R, G // 2, 16)


@triton.jit
def shift_in(a, s, R: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    """Shift ``a [R, N, K]`` up by one along axis 1, ``s [R, 1, K]`` entering at index 0; returns the
    shifted tensor and the element shifted out ``[R, 1, K]``. Only splits and joins (recursively on
    the odd half), so in-thread data is renamed, never moved: how 4-byte-phased slot parts become
    aligned vectors."""
    if N == 1:
        return s, a
    else:
        e, o = tl.split(tl.permute(tl.reshape(a, [R, N // 2, 2, K]), [0, 1, 3, 2]))
        t, out = shift_in(o, s, R, N // 2, K)
        return tl.reshape(tl.permute(tl.join(t, e), [0, 1, 3, 2]), [R, N, K]), out


@triton.jit
def store_words(ptr, words, row_mask, R: tl.constexpr, W: tl.constexpr, A: tl.constexpr):
    """Write int32 ``words [R, W]`` to the bytes at ``ptr [R]`` (u8 pointers) of the rows in ``row_mask``.

    ``A``: bytes every row's address is a multiple of (a power of two). From 4 on, each thread
    stores its rows' words as ``min(A, 16)``-byte vectors straight from registers (the ``[R, W/V, V]``
    shape keeps rows on lanes, so no layout change through shared memory); below 4 byte stores.
    """
    if A >= 8:
        # Vectors of V words: contiguous along the last dim only, so the compiler orders lanes over
        # rows (as for the loads) and keeps each row in its thread.
        V: tl.constexpr = W if A // 4 > W else A // 4
        cols = tl.arange(0, W // V)[None, :, None] * V + tl.arange(0, V)[None, None, :]
        tl.store(ptr.to(tl.pointer_type(tl.int32))[:, None, None] + cols, tl.reshape(words, [R, W // V, V]),
                 mask=row_mask[:, None, None])
    elif A == 4:
        # One word per store: byte offsets 4 apart (no contiguity at all), cast to word pointers, keep
        # the lanes over rows too.
        wptr = (ptr[:, None] + tl.arange(0, W)[None, :] * 4).to(tl.pointer_type(tl.int32))
        tl.store(wptr, words, mask=row_mask[:, None])
    else:
        b = tl.join(tl.join(words & 0xFF, (words >> 16) & 0xFF), tl.join((words >> 8) & 0xFF, words >> 24 & 0xFF))
        tl.store(ptr[:, None] + tl.arange(0, 4 * W)[None, :], tl.reshape(b, [R, 4 * W]).to(tl.uint8),
                 mask=row_mask[:, None])


@triton.jit
def store_scales(ptr, scales, row_mask, R: tl.constexpr, G: tl.constexpr, A: tl.constexpr):
    """Write the int32 scale bytes ``scales [R, G]`` at ``ptr [R]`` (as words where G allows)."""
    if G >= 4:
        store_words(ptr, pack_scales(scales, R, G), row_mask, R, G // 4, A)
    else:
        tl.store(ptr[:, None] + tl.arange(0, G)[None, :], scales.to(tl.uint8), mask=row_mask[:, None])


@triton.jit
def quantize_store_codes(x, codes_ptr, row_mask, R: tl.constexpr, D: tl.constexpr, ENCODER: tl.constexpr,
                         A: tl.constexpr, HALVES: tl.constexpr, SPREAD: tl.constexpr = False):
    """Quantize ``x [R, D]`` (:func:`quantize_words`), write each row's D/2 code bytes at ``codes_ptr
    [R]`` (u8 pointers, multiples of ``A`` bytes; rows in ``row_mask``) and return the int32 scale
    bytes ``[R, D/32]``.

    ``HALVES``: quantize and store the two halves of D one after the other (see uq_store_kv's
    ``_quantize_rows``: fewer live registers where a thread holds whole rows).
    """
    if HALVES:
        a, b = split_halves(x, R, D)
        ca, sa = quantize_words(a, R, D // 2, ENCODER)
        store_words(codes_ptr, ca, row_mask, R, D // 16, A)
        cb, sb = quantize_words(b, R, D // 2, ENCODER)
        store_words(codes_ptr + D // 4, cb, row_mask, R, D // 16, A)
        return concat(sa, sb, R, D // 64)
    else:
        codes, scales = quantize_words(x, R, D, ENCODER, SPREAD)
        store_words(codes_ptr, codes, row_mask, R, D // 8, A)
        return scales


@triton.jit
def split_halves(x, R: tl.constexpr, D: tl.constexpr):
    """``[R, D]`` -> its first and second halves ``[R, D/2]`` (register renaming in-thread)."""
    return tl.split(tl.permute(tl.reshape(x, [R, 2, D // 2]), [0, 2, 1]))


@triton.jit
def quantize_store(x, codes_ptr, row_mask, R: tl.constexpr, D: tl.constexpr, ENCODER: tl.constexpr,
                   A: tl.constexpr, HALVES: tl.constexpr):
    """Quantize ``x [R, D]`` and write each row's D/2 code bytes and D/32 scale bytes at ``codes_ptr
    [R]`` (:func:`quantize_store_codes`)."""
    scales = quantize_store_codes(x, codes_ptr, row_mask, R, D, ENCODER, A, HALVES)
    store_scales(codes_ptr + D // 2, scales, row_mask, R, D // 32, A)


@triton.jit
def load_dequant(codes_ptr, scales_ptr, row_mask, R: tl.constexpr, D: tl.constexpr):
    """Load ``[R]`` rows of D/2 code bytes + D/32 scale bytes and return exact float32 ``[R, D]``
    (masked-off rows read as zero). The dequant kernel's decoder; attention decodes to fp16 halves
    instead (``attention._load_fp16_codes``), because its MMAs take them directly."""
    G: tl.constexpr = D // 32
    packed = tl.load(codes_ptr[:, None] + tl.arange(0, D // 2)[None, :], mask=row_mask[:, None], other=0)
    codes = tl.reshape(tl.join(packed.to(tl.int32) & 0xF, packed.to(tl.int32) >> 4), [R, G, 32])
    sb = tl.load(scales_ptr[:, None] + tl.arange(0, G)[None, :], mask=row_mask[:, None], other=0).to(tl.int32)
    return tl.reshape(e2m1_decode_f32(codes) * scale_f32(sb)[:, :, None], [R, D])
