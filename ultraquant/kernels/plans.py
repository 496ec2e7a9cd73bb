"""Which family plans a call: a public op's validated arguments -> one :class:`LaunchPlan`.

The routing rules among kernels live here (:func:`takes_wholepage`: whole-page decode on NVIDIA
where its coverage rule holds, split-KV decode elsewhere; :func:`takes_multiquery`: which
speculative-decoding steps the multi-query decode serves), so the JIT path, warmup and codegen's
selections cannot disagree about a call. The Triton JIT path runs ``fn[plan.grid](*plan.args,
**plan.spec.constexprs, ...)``; the AOT runtime launches the blob whose manifest key is
``plan.spec.key()`` with the same args and grid.
"""

from __future__ import annotations

import logging

import torch

from ..config import Tuning
from .families import prefill as prefill_family
from .families.decode_multiquery import multiquery_call, plan_decode_multiquery
from .families.decode_splitkv import decode_splitkv_spec, plan_decode_splitkv
from .families.decode_wholepage import (
    WholePageTuning,
    decode_wholepage_spec,
    dense_strides,
    is_token_major,
    plan_decode_wholepage,
    wholepage_call,
)
from .families.dequant import plan_dequant
from .families.store import plan_store, store_few_rows
from .specialization import LaunchPlan, Specialization, slot_alignment, target_of

NO_TUNING = Tuning()
"""The plans' own choices everywhere."""

_log = logging.getLogger("ultraquant")


def takes_wholepage(head_size: int, gqa: int, num_kv_heads: int | None, block_size: int,
                    cache_strides: tuple[int, ...] | None, device: torch.device, tuning: Tuning = NO_TUNING,
                    cache_aligned: bool = True) -> bool:
    """THE decode rule (docs/kernels.md, "Which decode runs"): the whole-page decode (Gluon, sm_90)
    where the target is ``"cuda"`` and its coverage rule holds for the call's cache (head-major or
    token-major pages, 16-byte aligned; ``cache_strides`` None: the dense, token-major layout), unless
    ``tuning.decode_wholepage`` is off; split-KV decode everywhere else."""
    if not tuning.decode_wholepage or num_kv_heads is None:
        return False
    strides = dense_strides(head_size, num_kv_heads, block_size) if cache_strides is None else cache_strides
    return wholepage_call(head_size, gqa, num_kv_heads, block_size, strides, target_of(device), cache_aligned)


_warned_layouts: set[tuple[int, ...]] = set()


def warn_slow_layout(head_size: int, gqa: int, num_kv_heads: int, block_size: int, cache_strides: tuple[int, ...],
                     device: torch.device, tuning: Tuning = NO_TUNING) -> bool:
    """Log once per stride pattern when only the cache's layout keeps a decode off the whole-page kernel
    (pages neither head-major nor token-major, e.g. padded slots or a strided view, on NVIDIA: split-KV
    decode, about half as fast); True when it warned. ``ultraquant.empty_kv_cache`` and a plain
    ``torch.zeros`` of the ops' shape both give a layout the whole-page decode streams."""
    if not tuning.decode_wholepage or target_of(device) != "cuda":
        return False
    strides = tuple(cache_strides[:3])
    if wholepage_call(head_size, gqa, num_kv_heads, block_size, strides, "cuda"):
        return False  # served already
    if not wholepage_call(head_size, gqa, num_kv_heads, block_size, dense_strides(head_size, num_kv_heads,
                                                                                   block_size), "cuda"):
        return False  # the config is split-KV's whatever the layout
    key = (head_size, gqa, num_kv_heads, block_size, *strides)
    if key in _warned_layouts:
        return False
    _warned_layouts.add(key)
    _log.warning("ultraquant: decode over a cache with strides %s (%d kv heads; neither head-major nor token-major "
                 "pages) runs split-KV decode, about half as fast as the whole-page decode: allocate the cache "
                 "with ultraquant.empty_kv_cache or a plain torch.zeros (docs/kernels.md, 'Which decode runs')",
                 strides, num_kv_heads)
    return True


def wholepage_tuning(tuning: Tuning, batch: int = 1) -> WholePageTuning:
    """The whole-page launch shape under the run-time tuning: its defaults, and a forced split count
    ``s`` as a persistent grid of ``batch * s`` programs (``s`` pieces per request of an equal batch)."""
    return WholePageTuning(programs=batch * tuning.decode_splits if tuning.decode_splits else None)


def decode_call_spec(head_size: int, gqa: int, block_size: int, query_dtype: torch.dtype | str,
                     out_dtype: torch.dtype | str, has_sinks: bool, has_window: bool, has_softcap: bool,
                     cache_strides: tuple[int, ...] | None, device: torch.device, tuning: Tuning = NO_TUNING,
                     num_kv_heads: int | None = None) -> Specialization:
    """The decode variant a call plans: whole-page by :func:`takes_wholepage` (needs ``num_kv_heads``),
    else split-KV with slot alignment from the cache strides (None: the dense layout), target from the
    device, tuning overrides. :func:`plan_decode` and warmup both use it (keys gain ``divisible`` at
    the launch)."""
    if takes_wholepage(head_size, gqa, num_kv_heads, block_size, cache_strides, device, tuning):
        return decode_wholepage_spec(head_size=head_size, gqa=gqa, num_kv_heads=num_kv_heads, block_size=block_size,
                                     query_dtype=query_dtype, out_dtype=out_dtype, has_sinks=has_sinks,
                                     has_window=has_window, has_softcap=has_softcap, tuning=wholepage_tuning(tuning),
                                     token_major=is_token_major(head_size, cache_strides, num_kv_heads, block_size))
    return decode_splitkv_spec(head_size=head_size, gqa=gqa, block_size=block_size, query_dtype=query_dtype,
                               out_dtype=out_dtype, has_sinks=has_sinks, has_window=has_window, has_softcap=has_softcap,
                               align=slot_alignment(head_size, cache_strides), target=target_of(device),
                               tile=tuning.decode_tile, warps=tuning.decode_warps, stages=tuning.decode_stages,
                               maxnreg=tuning.decode_maxnreg)


def prefill_call_spec(head_size: int, gqa: int, block_size: int, query_dtype: torch.dtype | str,
                      key_dtype: torch.dtype | str, out_dtype: torch.dtype | str, has_sinks: bool, has_window: bool,
                      has_softcap: bool, cache_strides: tuple[int, ...] | None, device: torch.device) -> Specialization:
    """The prefill variant a call plans (see :func:`decode_call_spec`)."""
    return prefill_family.prefill_spec(head_size=head_size, gqa=gqa, block_size=block_size, query_dtype=query_dtype,
                                       key_dtype=key_dtype, out_dtype=out_dtype, has_sinks=has_sinks,
                                       has_window=has_window, has_softcap=has_softcap,
                                       align=slot_alignment(head_size, cache_strides), target=target_of(device))


def plan_decode(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                scale: float, sinks: torch.Tensor | None, sliding_window: int | None, softcap: float | None,
                out: torch.Tensor, tuning: Tuning = NO_TUNING) -> LaunchPlan:
    """Launch of decode: whole-page or split-KV by :func:`takes_wholepage`, decided once per call."""
    b, hq, d = query.shape
    hk, bs = kv_cache.shape[2], kv_cache.shape[1]
    if takes_wholepage(
        d, hq // hk, hk, bs, tuple(kv_cache.stride()), query.device, tuning, kv_cache.data_ptr() % 16 == 0
    ):
        return plan_decode_wholepage(query, kv_cache, block_table, seq_lens, scale, sinks, sliding_window, softcap, out,
                                     tuning=wholepage_tuning(tuning, b))
    warn_slow_layout(d, hq // hk, hk, bs, tuple(kv_cache.stride()), query.device, tuning)
    spec = decode_call_spec(d, hq // hk, bs, query.dtype, out.dtype, sinks is not None, sliding_window is not None,
                            softcap is not None, tuple(kv_cache.stride()[:3]), query.device, tuning)
    return plan_decode_splitkv(
        query, kv_cache, block_table, seq_lens, scale, sinks, sliding_window, softcap, out, spec, tuning.decode_splits
    )


def plan_prefill(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                 sinks: torch.Tensor | None, sliding_window: int | None, softcap: float | None, out: torch.Tensor,
                 tuning: Tuning = NO_TUNING) -> LaunchPlan:
    """Launch of the chunked-prefill kernel; the grid bounds the tiles from N and B (no host sync)."""
    hk, bs = kv_cache.shape[2], kv_cache.shape[1]
    spec = prefill_call_spec(query.shape[2], query.shape[1] // hk, bs, query.dtype, key.dtype, out.dtype,
                             sinks is not None, sliding_window is not None, softcap is not None,
                             tuple(kv_cache.stride()[:3]), query.device)
    return prefill_family.plan_prefill(query, key, value, kv_cache, block_table, seq_lens, query_start_loc, scale,
                                       sinks, sliding_window, softcap, out, spec, tuning.prefill_splits)


def takes_multiquery(head_size: int, gqa: int, num_kv_heads: int, block_size: int, cache_strides: tuple[int, ...],
                     device: torch.device, max_query_len: int, tuning: Tuning = NO_TUNING,
                     cache_aligned: bool = True) -> bool:
    """THE speculative-decoding rule: the multi-query decode (Gluon, sm_90) where the whole-page
    decode's cache rule holds (and ``tuning.decode_wholepage`` is on), D=128, and at most 16 new
    tokens per request; elsewhere the attention layer sends the step to the prefill kernel."""
    if not tuning.decode_wholepage:
        return False
    return multiquery_call(head_size, gqa, num_kv_heads, block_size, cache_strides, target_of(device),
                           max_query_len, cache_aligned)


def plan_spec_decode(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                     query_start_loc: torch.Tensor, max_query_len: int, scale: float, sinks: torch.Tensor | None,
                     sliding_window: int | None, softcap: float | None, out: torch.Tensor,
                     tuning: Tuning = NO_TUNING) -> LaunchPlan:
    """Launch of the multi-query decode (callers check :func:`takes_multiquery`); the grid comes from
    static shapes and the host bound ``max_query_len`` (no host sync)."""
    return plan_decode_multiquery(query, kv_cache, block_table, seq_lens, query_start_loc, max_query_len, scale,
                                  sinks, sliding_window, softcap, out, tuning.decode_splits)


__all__ = ["LaunchPlan", "NO_TUNING", "decode_call_spec", "plan_decode", "plan_dequant", "plan_prefill",
           "plan_spec_decode", "plan_store", "prefill_call_spec", "store_few_rows", "takes_multiquery",
           "takes_wholepage", "warn_slow_layout", "wholepage_tuning"]
