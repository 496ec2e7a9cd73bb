"""Triton kernel: a batch of requests' cached K/V back to float tensors (imports triton)."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import ERR_BLOCK, ERR_SEQ_LEN, block_ids, clamp_length, fwht, load_dequant


@triton.jit
def uq_dequant_kv(cache_ptr, bt_ptr, seqlen_ptr, cu_ptr, k_out_ptr, v_out_ptr, err_ptr,
                  num_blocks, bt_cols, out_rows,
                  stride_cb, stride_ct, stride_ch, stride_btb,
                  stride_kn, stride_kh, stride_vn, stride_vh,
                  D: tl.constexpr, LOG2D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
                  ORIGINAL_SPACE: tl.constexpr):
    """Program (tile, request, kv head) decodes TILE tokens of one request's cache to K and V rows.

    Token t of request b goes to row ``cu[b] + t`` of the outputs (packed varlen layout). K is
    returned in the original space when ORIGINAL_SPACE (the butterfly again: H is symmetric and
    orthonormal), else in the rotated space the cache holds (what a rotated query needs).
    Bounds: the length is clamped to the block-table row; a tile with a row outside [0, out_rows)
    is not written (two scalar compares); a block id outside [0, num_blocks) reads as an empty
    block (zeros; one compare per token). Each sets its error word. No fast/checked branch here (no
    loop to keep lean, and a branch around the butterfly's shuffles made ptxas emit collective
    loops and spill at D=64).
    """
    tile = tl.program_id(0)
    b = tl.program_id(1)
    kvh = tl.program_id(2)
    length = clamp_length(tl.load(seqlen_ptr + b), bt_cols, err_ptr, BLOCK_SIZE)
    t_lo = tile * TILE
    if t_lo < length:
        row0 = tl.load(cu_ptr + b).to(tl.int64) + t_lo
        t_hi = tl.minimum(length, t_lo + TILE)
        rows_ok = (row0 >= 0) & (row0 + (t_hi - t_lo) <= out_rows)
        tl.store(err_ptr + ERR_SEQ_LEN, 1, mask=~rows_ok)
        toks = t_lo + tl.arange(0, TILE)
        tmask = toks < tl.where(rows_ok, t_hi, t_lo)
        blk, live = block_ids(bt_ptr + b.to(tl.int64) * stride_btb, toks, tmask, num_blocks, BLOCK_SIZE, True)
        tl.store(err_ptr + ERR_BLOCK + tl.zeros_like(toks), 1, mask=tmask & ~live)
        base = (cache_ptr + blk.to(tl.int64) * stride_cb + (toks % BLOCK_SIZE).to(tl.int64) * stride_ct
                + kvh.to(tl.int64) * stride_ch)
        k = load_dequant(base, base + D // 2, live, TILE, D)
        if ORIGINAL_SPACE:
            k = fwht(k, TILE, D, LOG2D)
        v = load_dequant(base + (D // 2 + D // 32), base + (D + D // 32), live, TILE, D)
        row = row0 + tl.arange(0, TILE)
        cols = tl.arange(0, D)
        kp = k_out_ptr + row[:, None] * stride_kn + kvh * stride_kh + cols[None, :]
        tl.store(kp, k.to(k_out_ptr.dtype.element_ty), mask=tmask[:, None])
        vp = v_out_ptr + row[:, None] * stride_vn + kvh * stride_vh + cols[None, :]
        tl.store(vp, v.to(v_out_ptr.dtype.element_ty), mask=tmask[:, None])
