"""Triton kernel: a batch of requests' cached K/V back to float tensors (imports triton)."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import ERR_SEQ_LEN, block_ids, blocks_inside, clamp_length, fwht, load_dequant


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
    Bounds (scalar checks per tile, per-token ones only where an id is bad): the length is clamped
    to the block-table row; a tile with a row outside [0, out_rows) is not written; a block id
    outside [0, num_blocks) reads as an empty block (zeros). Each sets its error word.
    """
    tile = tl.program_id(0)
    b = tl.program_id(1)
    kvh = tl.program_id(2)
    length = clamp_length(tl.load(seqlen_ptr + b), bt_cols, err_ptr, BLOCK_SIZE)
    t_lo = tile * TILE
    if t_lo < length:
        t_hi = tl.minimum(length, t_lo + TILE)
        row0 = tl.load(cu_ptr + b).to(tl.int64) + t_lo
        rows_ok = (row0 >= 0) & (row0 + (t_hi - t_lo) <= out_rows)
        tl.store(err_ptr + ERR_SEQ_LEN, 1, mask=~rows_ok)
        if rows_ok:
            bt_row = bt_ptr + b.to(tl.int64) * stride_btb
            if blocks_inside(bt_row, t_lo, t_hi, num_blocks, err_ptr, BLOCK_SIZE, 2):
                _dequant_tile(cache_ptr, bt_row, k_out_ptr, v_out_ptr, num_blocks, t_lo, t_hi, row0, kvh,
                              stride_cb, stride_ct, stride_ch, stride_kn, stride_kh, stride_vn, stride_vh,
                              D, LOG2D, BLOCK_SIZE, TILE, ORIGINAL_SPACE, False)
            else:
                _dequant_tile(cache_ptr, bt_row, k_out_ptr, v_out_ptr, num_blocks, t_lo, t_hi, row0, kvh,
                              stride_cb, stride_ct, stride_ch, stride_kn, stride_kh, stride_vn, stride_vh,
                              D, LOG2D, BLOCK_SIZE, TILE, ORIGINAL_SPACE, True)


@triton.jit
def _dequant_tile(cache_ptr, bt_row, k_out_ptr, v_out_ptr, num_blocks, t_lo, t_hi, row0, kvh,
                  stride_cb, stride_ct, stride_ch, stride_kn, stride_kh, stride_vn, stride_vh,
                  D: tl.constexpr, LOG2D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
                  ORIGINAL_SPACE: tl.constexpr, CHECKED: tl.constexpr):
    """Tokens ``[t_lo, t_hi)`` of one request and kv head to output rows ``row0 + t - t_lo``
    (``CHECKED``: block ids outside the cache read as zeros)."""
    toks = t_lo + tl.arange(0, TILE)
    tmask = toks < t_hi
    blk, live = block_ids(bt_row, toks, tmask, num_blocks, BLOCK_SIZE, CHECKED)
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
