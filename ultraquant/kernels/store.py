"""Triton kernel: quantize new tokens' K (rotated) and V into the paged cache (imports triton)."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import fwht, quantize_store


@triton.jit
def uq_store_kv(key_ptr, value_ptr, cache_ptr, slot_ptr,
                n_rows, num_kv_heads, block_size,
                stride_kn, stride_kh, stride_vn, stride_vh,
                stride_cb, stride_ct, stride_ch,
                D: tl.constexpr, LOG2D: tl.constexpr, ENCODER: tl.constexpr, BLOCK_R: tl.constexpr):
    """One program quantizes BLOCK_R (token, kv head) rows of K and V.

    Row r is token ``r // Hk``, kv head ``r % Hk``; its slot is ``slot_mapping[token]`` (negative:
    skipped, nothing written). K is rotated in registers by a Walsh-Hadamard butterfly (float32),
    then both are quantized per group of 32 (UE8M0 scale + FP4 E2M1 codes, nibble-packed).
    """
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    in_range = rows < n_rows
    tok = rows // num_kv_heads
    head = rows % num_kv_heads
    slot = tl.load(slot_ptr + tok, mask=in_range, other=-1).to(tl.int64)
    valid = in_range & (slot >= 0)
    slot = tl.where(valid, slot, 0)
    blk = slot // block_size
    off = slot % block_size
    dst = cache_ptr + blk * stride_cb + off * stride_ct + head.to(tl.int64) * stride_ch
    cols = tl.arange(0, D)
    tok64 = tok.to(tl.int64)
    k = tl.load(key_ptr + tok64[:, None] * stride_kn + head[:, None] * stride_kh + cols[None, :],
                mask=valid[:, None], other=0.0).to(tl.float32)
    k = fwht(k, BLOCK_R, D, LOG2D)
    quantize_store(k, dst, dst + D // 2, valid, BLOCK_R, D, ENCODER)
    v = tl.load(value_ptr + tok64[:, None] * stride_vn + head[:, None] * stride_vh + cols[None, :],
                mask=valid[:, None], other=0.0).to(tl.float32)
    vdst = dst + (D // 2 + D // 32)
    quantize_store(v, vdst, vdst + D // 2, valid, BLOCK_R, D, ENCODER)
