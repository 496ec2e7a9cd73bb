"""The store family: quantize K and V rows into their cache slots (``triton/store.py``).

Parameter list, encoder ids, spec (config -> Specialization: launch shape per target and head size)
and launch plan (validated op arguments -> LaunchPlan).
"""

from __future__ import annotations

from typing import Any

import torch

from ...format import check_head_size
from ..catalog import alignable
from ..flags import error_words
from ..heuristics import STORE_FEW_ROWS_PER_SM, cdiv, num_sms
from ..specialization import (
    LaunchPlan,
    Specialization,
    fit_divisible,
    signature_of,
    slot_alignment,
    target_of,
    type_name,
)

ENCODER_IDS: dict[str, int] = {"rne": 0, "upstream": 1, "mse": 2}
"""Constexpr ``ENCODER`` of each encoder name."""

STORE_PARAMS: tuple[tuple[str, str], ...] = (
    ("key_ptr", "*{key}"),
    ("value_ptr", "*{value}"),
    ("cache_ptr", "*u8"),
    ("slot_ptr", "*{slot}"),
    ("err_ptr", "*i32"),
    ("n_rows", "i32"),
    ("num_kv_heads", "i32"),
    ("block_size", "i32"),
    ("num_slots", "i64"),
    ("stride_kn", "i32"),
    ("stride_kh", "i32"),
    ("stride_vn", "i32"),
    ("stride_vh", "i32"),
    ("stride_cb", "i32"),
    ("stride_ct", "i32"),
    ("stride_ch", "i32"),
)


def store_spec(
    *,
    head_size: int,
    key_dtype: torch.dtype | str = "bf16",
    value_dtype: torch.dtype | str | None = None,
    slot_dtype: torch.dtype | str = "i64",
    encoder: str = "rne",
    few_rows: bool = False,
    align: int | None = None,
    target: str = "portable",
    **_: Any,
) -> Specialization:
    """The store kernel for one head size, input dtypes, slot_mapping dtype and encoder; ``few_rows``
    for calls with too few (token, kv head) rows to fill the GPU at one row per thread; ``align``
    (constexpr ``ALIGN``) the bytes every slot address is a multiple of (default: the dense layout's,
    :func:`slot_alignment`; the plan passes the call's, cache base included); ``target`` (see
    :func:`target_of`) the launch shape: on NVIDIA rows over 4 lanes (``LANES``) from D=128 on."""
    d = check_head_size(head_size)
    # On NVIDIA from D=128 on: each row spread over 4 lanes (LANES=4: its 32-element runs over 4 lanes,
    # 8 elements per lane and load), 32 rows of 4 warps per program (8 rows of 1 warp for few rows):
    # loads and stores that cover whole sectors, at ~1.4x the instructions of one row per thread. One row per thread
    # (below) made every load and store instruction touch 32 lines, and that pattern alone took the
    # 63 us the store took (benchmarks/NOTES.md, "Store v4"). Elsewhere one row per thread keeps the
    # butterfly, absmax and packing in registers: on NVIDIA at D=64 one warp of 32 rows per program
    # (WHOLE_ROWS: the slot words shifted in registers); 128 rows of 4 warps on AMD/CPU (a 64-lane
    # wave splits rows over 2 lanes); fewer rows where a whole row per thread would spill; few_rows
    # (a decode step's store) spreads a row over 8 threads so small stores fill the GPU.
    lanes = 4 if target == "cuda" and d >= 128 else 0
    row_per_thread = d <= 64 or (d == 128 and encoder != "mse")
    whole = target == "cuda" and row_per_thread and not few_rows and not lanes
    if lanes:
        block_r = 8 if few_rows else 32
    elif few_rows:
        block_r = 16 if d <= 128 else 4
    elif row_per_thread:
        block_r = 32 if whole else 128
    else:
        block_r = 32 if d == 128 else 8
    return Specialization(
        kernel="uq_store_kv",
        signature=signature_of(
            STORE_PARAMS,
            key=type_name(key_dtype),
            value=type_name(value_dtype or key_dtype),
            slot=type_name(slot_dtype),
        ),
        constexprs={
            "D": d,
            "LOG2D": d.bit_length() - 1,
            "ENCODER": ENCODER_IDS[encoder],
            "BLOCK_R": block_r,
            "ALIGN": int(align or slot_alignment(d)),
            "WHOLE_ROWS": whole,
            "LANES": lanes,
        },
        num_warps=1 if whole or (lanes and few_rows) else 4,
        num_stages=1,
        maxnreg=144 if whole and d == 128 and encoder == "rne" else None,
        divisible=alignable("uq_store_kv"),
    )


def store_few_rows(rows: int, device: torch.device) -> bool:
    """Whether a store of ``rows`` (token, kv head) rows on ``device`` takes the few-rows layout."""
    return rows < STORE_FEW_ROWS_PER_SM * num_sms(device)


def plan_store(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    encoder: str = "rne",
    few_rows: bool | None = None,
) -> LaunchPlan:
    """Launch of the store kernel for validated arguments (key/value last dim contiguous).
    ``few_rows`` picks the layout (see :func:`store_spec`); None: from the row count."""
    n, hk, d = key.shape
    rows = n * hk
    if few_rows is None:
        few_rows = store_few_rows(rows, key.device)
    # The slot alignment the kernel's vector stores assume, from this cache's base and strides: a cache
    # that is not aligned like the dense layout plans another specialization (smaller ALIGN).
    align = slot_alignment(d, (kv_cache.data_ptr(), *kv_cache.stride()[:3]))
    spec = store_spec(
        head_size=d,
        key_dtype=key.dtype,
        value_dtype=value.dtype,
        slot_dtype=slot_mapping.dtype,
        encoder=encoder,
        few_rows=few_rows,
        align=align,
        target=target_of(key.device),
    )
    args = (
        key,
        value,
        kv_cache,
        slot_mapping,
        error_words(key.device),
        rows,
        hk,
        kv_cache.shape[1],
        kv_cache.shape[0] * kv_cache.shape[1],
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
    )
    return LaunchPlan(
        fit_divisible(spec, args, alignable("uq_store_kv")),
        args,
        (max(1, cdiv(rows, spec.constexprs["BLOCK_R"])), 1, 1),
    )
