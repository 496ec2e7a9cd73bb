"""The split-KV decode family (``triton/attention.py``: ``uq_decode_splitkv``), portable to every target.

Grid ``(B, Hk, splits)``: each program reads one kv head's token range and the last program of a
(request, kv head) merges the splits. :data:`DECODE_PARAMS` and :func:`decode_args` are the run-time
ABI of every decode kernel (this one, the whole-page decode, the FlyDSL decodes), so one LaunchPlan
shape serves them all.
"""

from __future__ import annotations

from typing import Any

import torch

from ...format import check_head_size
from ..catalog import alignable
from ..flags import error_words
from ..heuristics import decode_splits
from ..specialization import (
    LaunchPlan,
    Specialization,
    fit_divisible,
    pow2_at_least,
    signature_of,
    slot_alignment,
    type_name,
)
from ..workspace import decode_workspace, dummy_f32

DECODE_PARAMS: tuple[tuple[str, str], ...] = (("q_ptr", "*{query}"), ("cache_ptr", "*u8"), ("bt_ptr", "*i32"),
                                              ("seqlen_ptr", "*i32"), ("sinks_ptr", "*fp32"), ("out_ptr", "*{out}"),
                                              ("part_ptr", "*fp32"), ("ml_ptr", "*fp32"), ("counter_ptr", "*i32"),
                                              ("err_ptr", "*i32"), ("scale", "fp32"), ("softcap", "fp32"),
                                              ("window", "i32"), ("num_splits", "i32"), ("num_blocks", "i32"),
                                              ("bt_cols", "i32"), ("stride_qb", "i32"), ("stride_qh", "i32"),
                                              ("stride_ob", "i32"), ("stride_oh", "i32"), ("stride_cb", "i32"),
                                              ("stride_ct", "i32"), ("stride_ch", "i32"), ("stride_btb", "i32"))


def decode_args(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                sinks: torch.Tensor, out: torch.Tensor, workspace: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                err: torch.Tensor, scale: float, softcap: float | None, window: int | None,
                splits: int) -> tuple[Any, ...]:
    """The run-time arguments of every decode kernel (split-KV, whole-page, FlyDSL), in DECODE_PARAMS order."""
    return (query, kv_cache, block_table, seq_lens, sinks, out, *workspace, err, float(scale), float(softcap or 0.0),
            int(window or 0), splits, kv_cache.shape[0], block_table.shape[1], query.stride(0), query.stride(1),
            out.stride(0), out.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
            block_table.stride(0))


def decode_splitkv_spec(*, head_size: int, gqa: int, block_size: int, query_dtype: torch.dtype | str = "bf16",
                        out_dtype: torch.dtype | str | None = None, has_sinks: bool = False, has_window: bool = False,
                        has_softcap: bool = False, align: int | None = None, target: str = "portable",
                        tile: int | None = None, warps: int | None = None, stages: int | None = None,
                        maxnreg: int | None = None, **_: Any) -> Specialization:
    """The split-KV decode kernel for one head size, GQA group, block size and feature set.

    ``target`` ``"cuda"`` selects the inline-PTX FP4 decode (constexpr ``FP4_PTX``); anything else
    (``"hip"``, ``"portable"``: AMD, the CPU interpreter) the plain-Triton one. See :func:`target_of`.
    ``tile``/``warps``/``stages``/``maxnreg`` override the tuned defaults (sweeps only).
    """
    d = check_head_size(head_size)
    # Defaults from the H200 sweeps of the split-KV decode (benchmarks/NOTES.md, section "v7 (session 2)").
    tile = tile or (64 if d <= 256 else 32)
    warps = warps or (4 if d <= 128 else 8)
    stages = stages or 2
    return Specialization(
        kernel="uq_decode_splitkv",
        signature=signature_of(DECODE_PARAMS, query=type_name(query_dtype), out=type_name(out_dtype or query_dtype)),
        constexprs={"D": d, "LOG2D": d.bit_length() - 1, "GQA": int(gqa), "ROWS": max(16, pow2_at_least(int(gqa))),
                    "BLOCK_SIZE": int(block_size), "TILE": tile, "HAS_SINKS": bool(has_sinks),
                    "HAS_WINDOW": bool(has_window), "HAS_SOFTCAP": bool(has_softcap),
                    "ALIGN": int(align or slot_alignment(d)), "FP4_PTX": target == "cuda",
                    "V_IN_LOAD_LAYOUT": d >= 256},
        num_warps=warps,
        num_stages=stages,
        maxnreg=maxnreg,
        divisible=alignable("uq_decode_splitkv"),
    )


def plan_decode_splitkv(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                        scale: float, sinks: torch.Tensor | None, sliding_window: int | None, softcap: float | None,
                        out: torch.Tensor, spec: Specialization, forced_splits: int | None = None) -> LaunchPlan:
    """Launch of split-KV decode for ``spec`` (from :func:`decode_splitkv_spec`); the split count
    depends on static shapes only (``forced_splits``: tuning)."""
    b, hq, d = query.shape
    hk, bs = kv_cache.shape[2], kv_cache.shape[1]
    rows = spec.constexprs["ROWS"]
    splits = decode_splits(b, hk, block_table.shape[1] * bs, query.device, d, forced_splits)
    part, ml, counter = decode_workspace(query.device, b * hk * splits * rows * d, b * hk * splits * 2 * rows, b * hk)
    args = decode_args(query, kv_cache, block_table, seq_lens, sinks if sinks is not None else dummy_f32(query.device),
                       out, (part, ml, counter), error_words(query.device), scale, softcap, sliding_window, splits)
    return LaunchPlan(
        fit_divisible(spec, args, alignable(spec.kernel)), args, (b, hk, splits), notes={"num_splits": splits}
    )
