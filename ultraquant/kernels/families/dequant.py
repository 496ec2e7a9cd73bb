"""The dequant family: cache -> packed K (original or rotated space) and V rows (``triton/dequant.py``)."""

from __future__ import annotations

from typing import Any

import torch

from ...format import check_head_size
from ..catalog import alignable
from ..flags import error_words
from ..heuristics import cdiv
from ..specialization import LaunchPlan, Specialization, fit_divisible, signature_of, type_name

DEQUANT_PARAMS: tuple[tuple[str, str], ...] = (
    ("cache_ptr", "*u8"),
    ("bt_ptr", "*i32"),
    ("seqlen_ptr", "*i32"),
    ("cu_ptr", "*i32"),
    ("k_out_ptr", "*{out}"),
    ("v_out_ptr", "*{out}"),
    ("err_ptr", "*i32"),
    ("num_blocks", "i32"),
    ("bt_cols", "i32"),
    ("out_rows", "i32"),
    ("stride_cb", "i32"),
    ("stride_ct", "i32"),
    ("stride_ch", "i32"),
    ("stride_btb", "i32"),
    ("stride_kn", "i32"),
    ("stride_kh", "i32"),
    ("stride_vn", "i32"),
    ("stride_vh", "i32"),
)


def dequant_spec(
    *, head_size: int, block_size: int, out_dtype: torch.dtype | str = "bf16", original_space: bool = True, **_: Any
) -> Specialization:
    """The dequant kernel: cache -> packed K (original or rotated space) and V of ``out_dtype``."""
    d = check_head_size(head_size)
    return Specialization(
        kernel="uq_dequant_kv",
        signature=signature_of(DEQUANT_PARAMS, out=type_name(out_dtype)),
        constexprs={
            "D": d,
            "LOG2D": d.bit_length() - 1,
            "BLOCK_SIZE": int(block_size),
            "TILE": 32 if d <= 256 else 16,
            "ORIGINAL_SPACE": bool(original_space),
        },
        num_warps=4,
        num_stages=1,
        divisible=alignable("uq_dequant_kv"),
    )


def plan_dequant(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens: torch.Tensor,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
    head_size: int,
    original_space: bool = True,
) -> LaunchPlan:
    """Launch of the dequant kernel: request b's tokens go to rows ``cu_seqlens[b]:`` of the outputs."""
    spec = dequant_spec(
        head_size=head_size, block_size=kv_cache.shape[1], out_dtype=k_out.dtype, original_space=original_space
    )
    tile = spec.constexprs["TILE"]
    max_tokens = block_table.shape[1] * kv_cache.shape[1]
    args = (
        kv_cache,
        block_table,
        seq_lens,
        cu_seqlens,
        k_out,
        v_out,
        error_words(kv_cache.device),
        kv_cache.shape[0],
        block_table.shape[1],
        min(k_out.shape[0], v_out.shape[0]),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        block_table.stride(0),
        k_out.stride(0),
        k_out.stride(1),
        v_out.stride(0),
        v_out.stride(1),
    )
    grid = (max(1, cdiv(max_tokens, tile)), block_table.shape[0], kv_cache.shape[2])
    return LaunchPlan(fit_divisible(spec, args, alignable("uq_dequant_kv")), args, grid)
