"""The chunked-prefill family (``triton/attention.py``: ``uq_prefill``): cached prefix + causal chunk."""

from __future__ import annotations

from typing import Any

import torch

from ...format import check_head_size
from ..catalog import alignable
from ..flags import error_words
from ..heuristics import cdiv, prefill_splits
from ..specialization import (
    LaunchPlan,
    Specialization,
    fit_divisible,
    pow2_at_least,
    signature_of,
    slot_alignment,
    type_name,
)
from ..workspace import decode_workspace, dummy_f32, dummy_i32

PREFILL_PARAMS: tuple[tuple[str, str], ...] = (
    ("q_ptr", "*{query}"),
    ("k_ptr", "*{key}"),
    ("v_ptr", "*{key}"),
    ("cache_ptr", "*u8"),
    ("bt_ptr", "*i32"),
    ("seqlen_ptr", "*i32"),
    ("qsl_ptr", "*i32"),
    ("sinks_ptr", "*fp32"),
    ("out_ptr", "*{out}"),
    ("part_ptr", "*fp32"),
    ("ml_ptr", "*fp32"),
    ("counter_ptr", "*i32"),
    ("err_ptr", "*i32"),
    ("scale", "fp32"),
    ("softcap", "fp32"),
    ("window", "i32"),
    ("num_reqs", "i32"),
    ("num_splits", "i32"),
    ("num_blocks", "i32"),
    ("bt_cols", "i32"),
    ("stride_qn", "i32"),
    ("stride_qh", "i32"),
    ("stride_kn", "i32"),
    ("stride_kh", "i32"),
    ("stride_vn", "i32"),
    ("stride_vh", "i32"),
    ("stride_on", "i32"),
    ("stride_oh", "i32"),
    ("stride_cb", "i32"),
    ("stride_ct", "i32"),
    ("stride_ch", "i32"),
    ("stride_btb", "i32"),
)
"""Every kernel receives the cache's size (the store ``num_slots`` = blocks x block size, i64; the
readers ``num_blocks``) and, where it reads a block table, the table's row length (``bt_cols``), plus
``err_ptr``, the per-device error words (:mod:`.flags`): the bounds contract of docs/kernels.md,
"Bounds". A new kernel follows it."""


def prefill_spec(
    *,
    head_size: int,
    gqa: int,
    block_size: int,
    query_dtype: torch.dtype | str = "bf16",
    key_dtype: torch.dtype | str | None = None,
    out_dtype: torch.dtype | str | None = None,
    has_sinks: bool = False,
    has_window: bool = False,
    has_softcap: bool = False,
    align: int | None = None,
    target: str = "portable",
    **_: Any,
) -> Specialization:
    """The chunked-prefill kernel (cached prefix + causal chunk) for one config (``target``: see
    :func:`~.decode_splitkv.decode_splitkv_spec`)."""
    d = check_head_size(head_size)
    gpad = pow2_at_least(int(gqa))
    rows = max(16, gpad, 64 if d <= 128 else (32 if d <= 256 else 16))
    return Specialization(
        kernel="uq_prefill",
        signature=signature_of(
            PREFILL_PARAMS,
            query=type_name(query_dtype),
            key=type_name(key_dtype or query_dtype),
            out=type_name(out_dtype or query_dtype),
        ),
        constexprs={
            "D": d,
            "LOG2D": d.bit_length() - 1,
            "GQA": int(gqa),
            "GQA_PAD": gpad,
            "ROWS": rows,
            "BLOCK_SIZE": int(block_size),
            "TILE": 32,
            "HAS_SINKS": bool(has_sinks),
            "HAS_WINDOW": bool(has_window),
            "HAS_SOFTCAP": bool(has_softcap),
            "ALIGN": int(align or slot_alignment(d)),
            "FP4_PTX": target == "cuda",
            "V_IN_LOAD_LAYOUT": d >= 256,
        },
        num_warps=4 if d <= 128 else 8,
        num_stages=2,
        divisible=alignable("uq_prefill"),
    )


def plan_prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None,
    sliding_window: int | None,
    softcap: float | None,
    out: torch.Tensor,
    spec: Specialization,
    forced_splits: int | None = None,
) -> LaunchPlan:
    """Launch of the chunked-prefill kernel for ``spec``; the grid bounds the tiles from N and B (no
    host sync)."""
    n, hq, d = query.shape
    hk, bs = kv_cache.shape[2], kv_cache.shape[1]
    rows = spec.constexprs["ROWS"]
    qt = rows // spec.constexprs["GQA_PAD"]
    nreq = seq_lens.shape[0]
    tiles = max(1, cdiv(n, qt) + nreq)
    splits = prefill_splits(tiles * hk, block_table.shape[1] * bs, query.device, forced_splits)
    if splits > 1:
        part, ml, counter = decode_workspace(
            query.device, tiles * hk * splits * rows * d, tiles * hk * splits * 2 * rows, tiles * hk
        )
    else:
        part = ml = dummy_f32(query.device)
        counter = dummy_i32(query.device)
    args = (
        query,
        key,
        value,
        kv_cache,
        block_table,
        seq_lens,
        query_start_loc,
        sinks if sinks is not None else dummy_f32(query.device),
        out,
        part,
        ml,
        counter,
        error_words(query.device),
        float(scale),
        float(softcap or 0.0),
        int(sliding_window or 0),
        nreq,
        splits,
        kv_cache.shape[0],
        block_table.shape[1],
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        block_table.stride(0),
    )
    return LaunchPlan(
        fit_divisible(spec, args, alignable(spec.kernel)), args, (tiles, hk, splits), notes={"num_splits": splits}
    )
