"""The multi-query decode family (``gluon/decode_multiquery.py``, NVIDIA sm_90): a speculative-decoding
step (2..``MULTIQUERY_MAX_TOKENS`` new tokens per request) over the cache, without importing Triton.

The new tokens' K/V are read from the cache (the step stores them first, as vLLM does), so the call
is ``prefill_attention`` with ``key``/``value`` = the cache's own (dequantized) rows of the new tokens
(docs/api.md, ``spec_decode_attention``). Coverage: the whole-page decode's (head-major 16-byte
aligned runs, 1/2/4/8 kv heads, blocks of a multiple of 16) at D=128 and GQA 1-16 (the 16-M-row path);
the rest, and any call with more than :data:`MULTIQUERY_MAX_TOKENS` new tokens per request, is the
prefill kernel's. A program takes one or two M tiles (:func:`multiquery_program_tiles`; a blob each);
otherwise the query-token bound is a run-time argument (``max_tokens``) that sets the grid's tile groups,
and the programs are the whole-page decode's persistent grid, balanced over the batch on the device, so a
CUDA graph captured at the largest count replays any lengths and per-request counts up to it (read from
``seq_lens`` and ``query_start_loc`` on the device).
"""

from __future__ import annotations

from typing import Any

import torch

from ...errors import UltraQuantError
from ...format import check_head_size
from ..catalog import alignable
from ..flags import error_words
from ..heuristics import cdiv
from ..specialization import LaunchPlan, Specialization, fit_divisible, signature_of, type_name
from ..workspace import decode_workspace, dummy_f32
from .decode_wholepage import WHOLEPAGE_MIN_SPLIT_TOKENS, WHOLEPAGE_PIECE_UNITS, wholepage_call, wholepage_programs
from .decode_wholepage import unsupported as wholepage_unsupported

MULTIQUERY_ROWS = 16
"""Query rows ((token, head) pairs of one kv head, token-major) per M tile: the kernel's ``MQ_ROWS``."""

MULTIQUERY_MAX_TOKENS = 16
"""Most new tokens per request a step may have (the attention layer's small-continuation bound)."""

MULTIQUERY_WARPS = 8
"""Warps per program: Hk kv heads x 8/Hk token groups, as the whole-page decode."""

MULTIQUERY_PARAMS: tuple[tuple[str, str], ...] = (
    ("q_ptr", "*{query}"),
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
    ("max_tokens", "i32"),
    ("num_requests", "i32"),
    ("num_blocks", "i32"),
    ("bt_cols", "i32"),
    ("stride_qn", "i32"),
    ("stride_qh", "i32"),
    ("stride_on", "i32"),
    ("stride_oh", "i32"),
    ("stride_cb", "i32"),
    ("stride_ct", "i32"),
    ("stride_ch", "i32"),
    ("stride_btb", "i32"),
)
"""Run-time arguments: the decode's (``DECODE_PARAMS``, the split count's slot holding the batch size, as the
whole-page decode's) plus ``qsl_ptr`` (query_start_loc) and the query-token bound ``max_tokens``;
query/output strides are per token row (the prefill layout)."""


def multiquery_call(head_size: int, gqa: int, num_kv_heads: int, block_size: int, cache_strides: tuple[int, ...],
                    target: str, max_tokens: int, cache_aligned: bool = True) -> bool:
    """The plan's rule for one call: the whole-page decode's cache rule, D=128, and at most
    :data:`MULTIQUERY_MAX_TOKENS` new tokens per request (``max_tokens``, a host bound)."""
    return (head_size == 128 and 1 <= max_tokens <= MULTIQUERY_MAX_TOKENS
            and wholepage_call(head_size, gqa, num_kv_heads, block_size, cache_strides, target, cache_aligned,
                               token_major=False))


def unsupported(config: dict[str, Any]) -> str:
    """Why the multi-query decode does not serve ``config`` (matrix keys), or ``""``: the whole-page
    decode's coverage (:func:`.decode_wholepage.unsupported`) at D=128 (the 16-M-row path)."""
    if config.get("head_size", 0) != 128:
        return "the multi-query decode serves D=128 (the 16-M-row path); the prefill kernel serves the rest"
    why = wholepage_unsupported(config)
    return f"the multi-query decode covers what the whole-page decode does: {why}" if why else ""


def decode_multiquery_spec(
    *,
    head_size: int,
    gqa: int,
    num_kv_heads: int,
    block_size: int,
    query_dtype: torch.dtype | str = "bf16",
    out_dtype: torch.dtype | str | None = None,
    has_sinks: bool = False,
    has_window: bool = False,
    has_softcap: bool = False,
    tiles: int = 1,
    nsub: int | None = None,
    stages: int | None = None,
    **_: Any,
) -> Specialization:
    """The multi-query decode kernel for one config: ``tiles`` M tiles per program (1 or 2); the ring as the
    whole-page decode's default at one tile; one run per warp and stage, 8 stages (the same bytes in
    flight) at two, where the second tile's accumulators take the registers (more runs per stage spill
    in the loop: benchmarks/NOTES.md, "Speculative-decoding steps")."""
    d = check_head_size(head_size)
    if d != 128:
        raise UltraQuantError(f"the multi-query decode serves D=128, not {d} (the prefill kernel does)")
    hk = int(num_kv_heads)
    return Specialization(
        kernel="uq_decode_multiquery",
        signature=signature_of(MULTIQUERY_PARAMS, query=type_name(query_dtype),
                               out=type_name(out_dtype or query_dtype)),
        constexprs={
            "D": d,
            "LOG2D": d.bit_length() - 1,
            "GQA": int(gqa),
            "HK": hk,
            "WT": max(1, MULTIQUERY_WARPS // hk),
            "NSUB": nsub or (4 if tiles == 1 else 1),
            "STAGES": stages or (2 if tiles == 1 else 8),
            "TW": 16,
            "BLOCK_SIZE": int(block_size),
            "HAS_SINKS": bool(has_sinks),
            "HAS_WINDOW": bool(has_window),
            "HAS_SOFTCAP": bool(has_softcap),
            "TILES": int(tiles),
            "MIN_TOKENS": WHOLEPAGE_MIN_SPLIT_TOKENS,
            "PIECE_UNITS": WHOLEPAGE_PIECE_UNITS,
        },
        num_warps=hk * max(1, MULTIQUERY_WARPS // hk),
        num_stages=1,
        divisible=alignable("uq_decode_multiquery"),
    )


def multiquery_tiles(gqa: int, max_tokens: int) -> int:
    """M tiles per request: ``max_tokens x GQA`` rows, 16 per tile."""
    return cdiv(max(1, int(max_tokens)) * int(gqa), MULTIQUERY_ROWS)


MULTIQUERY_TILES: tuple[int, ...] = (1, 2)
"""M tiles per program the kernel is built for (constexpr ``TILES``; a blob each)."""


def multiquery_program_tiles(gqa: int, max_tokens: int) -> int:
    """M tiles per program for a call: 2 (each run's codes decoded once for both) where a request has
    two or more, else 1."""
    return 2 if multiquery_tiles(gqa, max_tokens) >= 2 else 1


def plan_decode_multiquery(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_tokens: int,
    scale: float,
    sinks: torch.Tensor | None,
    sliding_window: int | None,
    softcap: float | None,
    out: torch.Tensor,
    forced_programs: int | None = None,
    program_tiles: int | None = None,
) -> LaunchPlan:
    """Launch of the multi-query decode (callers check :func:`multiquery_call` first); grid
    ``(tiles / TILES, programs)``: tiles from the host bound ``max_tokens`` (rounded up to whole programs of
    :func:`multiquery_program_tiles`, or ``program_tiles``: the self-test of a given blob), the whole-page
    decode's persistent programs per device (:func:`.decode_wholepage.wholepage_programs`; ``forced_programs``
    overrides), each tile group balanced over them on the device from ``seq_lens``."""
    _, hq, d = query.shape
    hk, bs = kv_cache.shape[2], kv_cache.shape[1]
    gqa = hq // hk
    nreq = seq_lens.shape[0]
    per_program = program_tiles or multiquery_program_tiles(gqa, max_tokens)
    spec = decode_multiquery_spec(head_size=d, gqa=gqa, num_kv_heads=hk, block_size=bs, query_dtype=query.dtype,
                                  out_dtype=out.dtype, has_sinks=sinks is not None,
                                  has_window=sliding_window is not None, has_softcap=softcap is not None,
                                  tiles=per_program)
    groups = cdiv(multiquery_tiles(gqa, max_tokens), per_program)
    tiles = groups * per_program
    programs = wholepage_programs(query.device, forced_programs)
    parts = tiles * (programs + nreq) * hk * spec.constexprs["WT"]  # a slot per (tile, program + request, kv head)
    part, ml, counter = decode_workspace(query.device, parts * MULTIQUERY_ROWS * d, parts * 2 * MULTIQUERY_ROWS,
                                         nreq * tiles * hk)
    args = (
        query,
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
        int(max_tokens),
        nreq,
        kv_cache.shape[0],
        block_table.shape[1],
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        block_table.stride(0),
    )
    return LaunchPlan(fit_divisible(spec, args, alignable(spec.kernel)), args, (groups, programs, 1),
                      notes={"programs": programs, "tiles": tiles})


__all__ = [
    "MULTIQUERY_MAX_TOKENS",
    "MULTIQUERY_PARAMS",
    "MULTIQUERY_ROWS",
    "MULTIQUERY_TILES",
    "decode_multiquery_spec",
    "multiquery_call",
    "multiquery_program_tiles",
    "multiquery_tiles",
    "plan_decode_multiquery",
    "unsupported",
]
