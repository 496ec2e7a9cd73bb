"""Triton kernel: quantize new tokens' K (rotated) and V into the paged cache (imports triton)."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (
    concat,
    fwht,
    fwht_lanes,
    pack_scales,
    quantize_store,
    quantize_store_codes,
    quantize_words,
    shift_in,
    slot_rows,
    split_halves,
    store_scales,
    store_words,
)


@triton.jit
def uq_store_kv(key_ptr, value_ptr, cache_ptr, slot_ptr, err_ptr,
                n_rows, num_kv_heads, block_size, num_slots,
                stride_kn, stride_kh, stride_vn, stride_vh,
                stride_cb, stride_ct, stride_ch,
                D: tl.constexpr, LOG2D: tl.constexpr, ENCODER: tl.constexpr, BLOCK_R: tl.constexpr,
                ALIGN: tl.constexpr, WHOLE_ROWS: tl.constexpr, LANES: tl.constexpr):
    """One program quantizes BLOCK_R (token, kv head) rows of K and V.

    Row r is token ``r // Hk``, kv head ``r % Hk``; its slot is ``slot_mapping[token]`` (negative:
    skipped, nothing written; ``>= num_slots`` (blocks x block size): skipped too, and error word
    ERR_SLOT set). K is rotated in registers by a Walsh-Hadamard butterfly (float32), then both are quantized
    per group of 32 (UE8M0 scale + FP4 E2M1 codes, nibble-packed). ``ALIGN``: bytes every slot
    address is a multiple of (the plan's gcd of 16, the cache's base and strides): the slot words are
    stored as vectors that wide. ``WHOLE_ROWS``: the launch gives each thread whole rows (BLOCK_R =
    32 x num_warps), so reshuffling a row's words costs nothing. ``LANES``: 0 as just said; L > 0:
    rows spread over L lanes (see ``_quantize_rows``).
    """
    # LANES stores a word per lane: no declared slot alignment there (see _quantize_rows).
    tok, head, dst, valid = slot_rows(tl.program_id(0), slot_ptr, err_ptr, n_rows, num_kv_heads, block_size,
                                      num_slots, stride_cb, stride_ct, stride_ch, BLOCK_R, ALIGN if LANES == 0 else 1)
    dst = cache_ptr + dst
    tok64 = tok.to(tl.int64)
    if ((stride_kn | stride_kh | stride_vn | stride_vh) & 7) == 0:
        # Row offsets written as multiples of 8 elements, so the compiler can prove 16-byte aligned
        # rows and load 8 elements per instruction (AOT builds know nothing about the strides; the
        # JIT sees them only when divisible by 16). Any other strides take the element-wise branch.
        koff = (tok64 * (stride_kn >> 3) + head * (stride_kh >> 3)) * 8
        voff = (tok64 * (stride_vn >> 3) + head * (stride_vh >> 3)) * 8
        _quantize_rows(key_ptr, value_ptr, koff, voff, dst, valid, D, LOG2D, ENCODER, BLOCK_R, ALIGN, WHOLE_ROWS,
                       LANES)
    else:
        koff = tok64 * stride_kn + head * stride_kh
        voff = tok64 * stride_vn + head * stride_vh
        _quantize_rows(key_ptr, value_ptr, koff, voff, dst, valid, D, LOG2D, ENCODER, BLOCK_R, ALIGN, WHOLE_ROWS,
                       LANES)

@triton.jit
def _quantize_rows(key_ptr, value_ptr, koff, voff, dst, valid, D: tl.constexpr, LOG2D: tl.constexpr,
                   ENCODER: tl.constexpr, R: tl.constexpr, ALIGN: tl.constexpr, WHOLE_ROWS: tl.constexpr,
                   LANES: tl.constexpr):
    """Load, rotate (K) and quantize ``R`` rows at element offsets ``koff``/``voff`` into their slots
    ``dst`` (multiples of ``ALIGN`` bytes).

    The ``[R, D/8, 8]`` loads give each thread whole rows (rows over lanes and warps, 8-element vectors
    in registers) up to D=128: the butterfly, the group absmax and the nibble packing never leave the
    thread (no shuffles), and each thread writes its rows' slot words itself. A slot is K codes | K
    scales | V codes | V scales; where the V codes start off the vector width (D=128: byte 68) the
    words from the K scales on are shifted in registers (:func:`shift_in`) and stored as whole vectors.
    With whole rows per thread, D >= 128 is quantized in halves (fewer live registers: no spills at
    D=128); so is D >= 256 at 8 rows per program (fewer instructions there, while 4 or 16 rows spread
    over the threads get more: offline SASS counts in benchmarks/NOTES.md, "Store").
    """
    G: tl.constexpr = D // 32
    HALVES: tl.constexpr = D >= 128 and (WHOLE_ROWS or (D >= 256 and R == 8))
    VOFF: tl.constexpr = D // 2 + G
    VEC: tl.constexpr = 16 if ALIGN > 16 else ALIGN
    # [R, D/C, C] loads, contiguous along C only. LANES > 0: C = 8 x LANES elements over LANES lanes
    # (8 per lane and load), the D/C chunks in registers: each load instruction covers 32/LANES rows'
    # C-element runs. Otherwise C = 8: rows over lanes, whole rows in registers.
    C: tl.constexpr = (8 * LANES if 8 * LANES < D else D) if LANES > 0 else 8
    cols = tl.arange(0, D // C)[None, :, None] * C + tl.arange(0, C)[None, None, :]
    koff = koff[:, None, None]
    voff = voff[:, None, None]
    vmask = valid[:, None, None]
    k = tl.load(key_ptr + koff + cols, mask=vmask, other=0.0)
    if LANES > 0:
        k = fwht_lanes(tl.reshape(k.to(tl.float32), [R, D]), R, D, LOG2D)
    else:
        k = fwht(tl.reshape(k.to(tl.float32), [R, D]), R, D, LOG2D)
    VALIGN: tl.constexpr = ALIGN if VOFF % ALIGN == 0 else (VOFF & -VOFF)
    if LANES > 0:
        # A row's code words are one per lane: stored a word per lane (4-byte stores, coalesced over
        # the row's lanes), the scale bytes as bytes (a group's 4 lanes hold the same byte).
        ks = _store_lane_words(k, dst, valid, R, D, ENCODER, ALIGN, C)
        tl.store(dst[:, None] + (D // 2 + tl.arange(0, G))[None, :], ks.to(tl.uint8), mask=valid[:, None])
        v = tl.reshape(tl.load(value_ptr + voff + cols, mask=vmask, other=0.0).to(tl.float32), [R, D])
        vs = _store_lane_words(v, dst + VOFF, valid, R, D, ENCODER, VALIGN, C)
        tl.store(dst[:, None] + (VOFF + D // 2 + tl.arange(0, G))[None, :], vs.to(tl.uint8), mask=valid[:, None])
        return
    ks = quantize_store_codes(k, dst, valid, R, D, ENCODER, ALIGN, HALVES)
    v = tl.load(value_ptr + voff + cols, mask=vmask, other=0.0)
    v = tl.reshape(v.to(tl.float32), [R, D])
    if VEC >= 8 and VOFF % VEC != 0 and G >= 4 and G <= 8 and WHOLE_ROWS:
        # Whole rows per thread (elsewhere the shuffling costs more than it saves). From byte D/2 on:
        # K scale words, V code words, V scale words (D/8 + G/2 words). The V code words are shifted
        # up by the KW = G/4 K scale words; the last KW go with the V scale words. In halves, as
        # quantize_store_codes.
        KW: tl.constexpr = G // 4
        carry = tl.reshape(pack_scales(ks, R, G), [R, 1, KW])
        a, b = split_halves(v, R, D)
        sa, carry = _store_shifted(a, dst + D // 2, carry, valid, R, D // 2, ENCODER, KW, ALIGN)
        sb, carry = _store_shifted(b, dst + (D // 2 + D // 4), carry, valid, R, D // 2, ENCODER, KW, ALIGN)
        vs = concat(sa, sb, R, G // 2)
        store_words(dst + D, concat(tl.reshape(carry, [R, KW]), pack_scales(vs, R, G), R, KW), valid, R, 2 * KW,
                    ALIGN)
    else:
        store_scales(dst + D // 2, ks, valid, R, G, ALIGN)
        quantize_store(v, dst + VOFF, valid, R, D, ENCODER, VALIGN, HALVES)


@triton.jit
def _store_lane_words(x, ptr, row_mask, R: tl.constexpr, D: tl.constexpr, ENCODER: tl.constexpr, A: tl.constexpr,
                      C: tl.constexpr):
    """LANES: quantize ``x [R, D]`` (spread as the ``[R, D/C, C]`` loads), store the code words (a
    word per thread and chunk) at ``ptr`` (alignment not declared: a word per store, in the layout
    the words already have) and return the scale bytes."""
    codes, scales = quantize_words(x, R, D, ENCODER, True)
    if A >= 4:
        W: tl.constexpr = C // 8
        cols = tl.arange(0, D // C)[None, :, None] * W + tl.arange(0, W)[None, None, :]
        tl.store(ptr.to(tl.pointer_type(tl.int32))[:, None, None] + cols, tl.reshape(codes, [R, D // C, W]),
                 mask=row_mask[:, None, None])
    else:
        store_words(ptr, codes, row_mask, R, D // 8, A)
    return scales


@triton.jit
def _store_shifted(x, ptr, carry, row_mask, R: tl.constexpr, N: tl.constexpr, ENCODER: tl.constexpr,
                   KW: tl.constexpr, A: tl.constexpr):
    """Quantize ``x [R, N]``, shift its code words up by ``KW`` with ``carry [R, 1, KW]`` entering,
    store them at ``ptr`` and return (scale bytes, the KW words shifted out)."""
    codes, scales = quantize_words(x, R, N, ENCODER)
    t, out = shift_in(tl.reshape(codes, [R, N // (8 * KW), KW]), carry, R, N // (8 * KW), KW)
    store_words(ptr, tl.reshape(t, [R, N // 8]), row_mask, R, N // 8, A)
    return scales, out
