"""Triton kernel: quantize new tokens' K (rotated) and V into the paged cache (imports triton)."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import ERR_SLOT, fwht, quantize_store


@triton.jit
def uq_store_kv(key_ptr, value_ptr, cache_ptr, slot_ptr, err_ptr,
                n_rows, num_kv_heads, block_size, num_slots,
                stride_kn, stride_kh, stride_vn, stride_vh,
                stride_cb, stride_ct, stride_ch,
                D: tl.constexpr, LOG2D: tl.constexpr, ENCODER: tl.constexpr, BLOCK_R: tl.constexpr,
                ALIGN: tl.constexpr):
    """One program quantizes BLOCK_R (token, kv head) rows of K and V.

    Row r is token ``r // Hk``, kv head ``r % Hk``; its slot is ``slot_mapping[token]`` (negative:
    skipped, nothing written; ``>= num_slots`` (blocks x block size): skipped too, and error word
    ERR_SLOT set). K is rotated in registers by a Walsh-Hadamard butterfly (float32), then both are quantized
    per group of 32 (UE8M0 scale + FP4 E2M1 codes, nibble-packed). ``ALIGN``: bytes every slot
    address is a multiple of (the plan's gcd of 16, the cache's base and strides): the slot words are
    stored as vectors that wide.
    """
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
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
    dst = cache_ptr + tl.multiple_of(blk * stride_cb + off * stride_ct + head.to(tl.int64) * stride_ch, ALIGN)
    tok64 = tok.to(tl.int64)
    if ((stride_kn | stride_kh | stride_vn | stride_vh) & 7) == 0:
        # Row offsets written as multiples of 8 elements, so the compiler can prove 16-byte aligned
        # rows and load 8 elements per instruction (AOT builds know nothing about the strides; the
        # JIT sees them only when divisible by 16). Any other strides take the element-wise branch.
        koff = (tok64 * (stride_kn >> 3) + head * (stride_kh >> 3)) * 8
        voff = (tok64 * (stride_vn >> 3) + head * (stride_vh >> 3)) * 8
        _quantize_rows(key_ptr, value_ptr, koff, voff, dst, valid, D, LOG2D, ENCODER, BLOCK_R, ALIGN)
    else:
        koff = tok64 * stride_kn + head * stride_kh
        voff = tok64 * stride_vn + head * stride_vh
        _quantize_rows(key_ptr, value_ptr, koff, voff, dst, valid, D, LOG2D, ENCODER, BLOCK_R, ALIGN)

@triton.jit
def _quantize_rows(key_ptr, value_ptr, koff, voff, dst, valid, D: tl.constexpr, LOG2D: tl.constexpr,
                   ENCODER: tl.constexpr, R: tl.constexpr, ALIGN: tl.constexpr):
    """Load, rotate (K) and quantize ``R`` rows at element offsets ``koff``/``voff`` into their slots
    ``dst`` (multiples of ``ALIGN`` bytes).

    The ``[R, D/8, 8]`` loads give each thread whole rows (rows over lanes and warps, 8-element vectors
    in registers) up to D=128: the butterfly, the group absmax and the nibble packing never leave the
    thread (no shuffles), and each thread writes its rows' slot words itself. V is loaded before K is
    processed, so both loads are in flight at once.
    """
    VOFF: tl.constexpr = D // 2 + D // 32
    VALIGN: tl.constexpr = ALIGN if VOFF % ALIGN == 0 else (VOFF & -VOFF)
    cols = tl.arange(0, D // 8)[None, :, None] * 8 + tl.arange(0, 8)[None, None, :]
    k = tl.load(key_ptr + koff[:, None, None] + cols, mask=valid[:, None, None], other=0.0)
    k = fwht(tl.reshape(k.to(tl.float32), [R, D]), R, D, LOG2D)
    quantize_store(k, dst, valid, R, D, ENCODER, ALIGN)
    v = tl.load(value_ptr + voff[:, None, None] + cols, mask=valid[:, None, None], other=0.0)
    quantize_store(tl.reshape(v.to(tl.float32), [R, D]), dst + VOFF, valid, R, D, ENCODER, VALIGN)
