"""Launch plans: a public op's validated arguments -> one :class:`LaunchPlan` (spec, args, grid).

The Triton JIT path runs ``fn[plan.grid](*plan.args, **plan.spec.constexprs, ...)``; the AOT runtime
launches the blob whose manifest key is ``plan.spec.key()`` with the same args and grid.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import Tuning
from .decode_v8_plan import V8Tuning, decode_v8_spec, plan_decode_v8, v8_call
from .flags import error_words
from .heuristics import STORE_FEW_ROWS_PER_SM, cdiv, decode_splits, num_sms, prefill_splits
from .specs import (
    Specialization,
    decode_args,
    decode_spec,
    dequant_spec,
    fit_divisible,
    prefill_spec,
    slot_alignment,
    store_spec,
    target_of,
)
from .workspace import _dummy_f32, _dummy_i32, decode_workspace

NO_TUNING = Tuning()
"""The plans' own choices everywhere."""


@dataclass(frozen=True)
class LaunchPlan:
    """One launch of one specialization: its run-time arguments and grid."""

    spec: Specialization
    args: tuple[Any, ...]
    grid: tuple[int, int, int]
    notes: dict[str, Any] = field(default_factory=dict)


def store_few_rows(rows: int, device: torch.device) -> bool:
    """Whether a store of ``rows`` (token, kv head) rows on ``device`` takes the few-rows layout."""
    return rows < STORE_FEW_ROWS_PER_SM * num_sms(device)


def plan_store(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
               encoder: str = "rne", few_rows: bool | None = None) -> LaunchPlan:
    """Launch of the store kernel for validated arguments (key/value last dim contiguous).
    ``few_rows`` picks the layout (see :func:`store_spec`); None: from the row count."""
    n, hk, d = key.shape
    rows = n * hk
    if few_rows is None:
        few_rows = store_few_rows(rows, key.device)
    # The slot alignment the kernel's vector stores assume, from this cache's base and strides: a cache
    # that is not aligned like the dense layout plans another specialization (smaller ALIGN).
    align = slot_alignment(d, (kv_cache.data_ptr(), *kv_cache.stride()[:3]))
    spec = store_spec(head_size=d, key_dtype=key.dtype, value_dtype=value.dtype, slot_dtype=slot_mapping.dtype,
                      encoder=encoder, few_rows=few_rows, align=align, target=target_of(key.device))
    args = (key, value, kv_cache, slot_mapping, error_words(key.device), rows, hk, kv_cache.shape[1],
            kv_cache.shape[0] * kv_cache.shape[1],
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2))
    return LaunchPlan(fit_divisible(spec, args), args, (max(1, cdiv(rows, spec.constexprs["BLOCK_R"])), 1, 1))


def plan_dequant(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                 cu_seqlens: torch.Tensor, k_out: torch.Tensor, v_out: torch.Tensor, head_size: int,
                 original_space: bool = True) -> LaunchPlan:
    """Launch of the dequant kernel: request b's tokens go to rows ``cu_seqlens[b]:`` of the outputs."""
    spec = dequant_spec(head_size=head_size, block_size=kv_cache.shape[1], out_dtype=k_out.dtype,
                        original_space=original_space)
    tile = spec.constexprs["TILE"]
    max_tokens = block_table.shape[1] * kv_cache.shape[1]
    args = (kv_cache, block_table, seq_lens, cu_seqlens, k_out, v_out, error_words(kv_cache.device),
            kv_cache.shape[0], block_table.shape[1], min(k_out.shape[0], v_out.shape[0]),
            kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), block_table.stride(0),
            k_out.stride(0), k_out.stride(1), v_out.stride(0), v_out.stride(1))
    grid = (max(1, cdiv(max_tokens, tile)), block_table.shape[0], kv_cache.shape[2])
    return LaunchPlan(fit_divisible(spec, args), args, grid)


def takes_v8(head_size: int, gqa: int, num_kv_heads: int | None, block_size: int,
             cache_strides: tuple[int, ...] | None, device: torch.device, tuning: Tuning = NO_TUNING,
             cache_aligned: bool = True) -> bool:
    """THE decode rule (docs/kernels.md, "Which decode runs"): decode v8 (Gluon, sm_90) where the target
    is ``"cuda"`` and :func:`~.decode_v8_plan.v8_supports` holds for the call's cache (head-major pages,
    16-byte aligned), unless ``tuning.decode_v8`` is off; v7 everywhere else."""
    if not tuning.decode_v8 or num_kv_heads is None or cache_strides is None:
        return False
    return v8_call(head_size, gqa, num_kv_heads, block_size, cache_strides, target_of(device), cache_aligned)


def v8_tuning(tuning: Tuning) -> V8Tuning:
    """v8's launch shape under the run-time tuning (a forced split count carries over)."""
    return V8Tuning(splits=tuning.decode_splits)


def decode_call_spec(head_size: int, gqa: int, block_size: int, query_dtype: torch.dtype | str,
                     out_dtype: torch.dtype | str, has_sinks: bool, has_window: bool, has_softcap: bool,
                     cache_strides: tuple[int, ...] | None, device: torch.device,
                     tuning: Tuning = NO_TUNING, num_kv_heads: int | None = None) -> Specialization:
    """The decode variant a call plans: v8 by :func:`takes_v8` (needs ``num_kv_heads``), else v7 with
    slot alignment from the cache strides (None: the dense layout), target from the device, tuning
    overrides. :func:`plan_decode` and warmup both use it (v8 keys gain ``divisible`` at the launch)."""
    if takes_v8(head_size, gqa, num_kv_heads, block_size, cache_strides, device, tuning):
        return decode_v8_spec(head_size=head_size, gqa=gqa, num_kv_heads=num_kv_heads, block_size=block_size,
                              query_dtype=query_dtype, out_dtype=out_dtype, has_sinks=has_sinks,
                              has_window=has_window, has_softcap=has_softcap, tuning=v8_tuning(tuning))
    return decode_spec(head_size=head_size, gqa=gqa, block_size=block_size, query_dtype=query_dtype,
                       out_dtype=out_dtype, has_sinks=has_sinks, has_window=has_window, has_softcap=has_softcap,
                       align=slot_alignment(head_size, cache_strides), target=target_of(device),
                       tile=tuning.decode_tile, warps=tuning.decode_warps, stages=tuning.decode_stages,
                       maxnreg=tuning.decode_maxnreg)


def prefill_call_spec(head_size: int, gqa: int, block_size: int, query_dtype: torch.dtype | str,
                      key_dtype: torch.dtype | str, out_dtype: torch.dtype | str, has_sinks: bool,
                      has_window: bool, has_softcap: bool, cache_strides: tuple[int, ...] | None,
                      device: torch.device) -> Specialization:
    """The prefill variant a call plans (see :func:`decode_call_spec`)."""
    return prefill_spec(head_size=head_size, gqa=gqa, block_size=block_size, query_dtype=query_dtype,
                        key_dtype=key_dtype, out_dtype=out_dtype, has_sinks=has_sinks, has_window=has_window,
                        has_softcap=has_softcap, align=slot_alignment(head_size, cache_strides),
                        target=target_of(device))


def plan_decode(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                seq_lens: torch.Tensor, scale: float, sinks: torch.Tensor | None,
                sliding_window: int | None, softcap: float | None, out: torch.Tensor,
                tuning: Tuning = NO_TUNING) -> LaunchPlan:
    """Launch of split-KV decode (v8 or v7 by :func:`takes_v8`); the split count depends on static
    shapes only."""
    b, hq, d = query.shape
    hk, bs = kv_cache.shape[2], kv_cache.shape[1]
    if takes_v8(d, hq // hk, hk, bs, tuple(kv_cache.stride()), query.device, tuning, kv_cache.data_ptr() % 16 == 0):
        return plan_decode_v8(query, kv_cache, block_table, seq_lens, scale, sinks, sliding_window, softcap, out,
                              tuning=v8_tuning(tuning))
    spec = decode_call_spec(d, hq // hk, bs, query.dtype, out.dtype, sinks is not None, sliding_window is not None,
                            softcap is not None, tuple(kv_cache.stride()[:3]), query.device, tuning)
    rows = spec.constexprs["ROWS"]
    splits = decode_splits(b, hk, block_table.shape[1] * bs, query.device, d, tuning.decode_splits)
    part, ml, counter = decode_workspace(query.device, b * hk * splits * rows * d, b * hk * splits * 2 * rows,
                                         b * hk)
    args = decode_args(query, kv_cache, block_table, seq_lens,
                       sinks if sinks is not None else _dummy_f32(query.device), out, (part, ml, counter),
                       error_words(query.device), scale, softcap, sliding_window, splits)
    return LaunchPlan(fit_divisible(spec, args), args, (b, hk, splits), notes={"num_splits": splits})


def plan_prefill(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                 scale: float, sinks: torch.Tensor | None, sliding_window: int | None,
                 softcap: float | None, out: torch.Tensor, tuning: Tuning = NO_TUNING) -> LaunchPlan:
    """Launch of the chunked-prefill kernel; the grid bounds the tiles from N and B (no host sync)."""
    n, hq, d = query.shape
    hk, bs = kv_cache.shape[2], kv_cache.shape[1]
    spec = prefill_call_spec(d, hq // hk, bs, query.dtype, key.dtype, out.dtype, sinks is not None,
                             sliding_window is not None, softcap is not None, tuple(kv_cache.stride()[:3]),
                             query.device)
    rows = spec.constexprs["ROWS"]
    qt = rows // spec.constexprs["GQA_PAD"]
    nreq = seq_lens.shape[0]
    tiles = max(1, cdiv(n, qt) + nreq)
    splits = prefill_splits(tiles * hk, block_table.shape[1] * bs, query.device, tuning.prefill_splits)
    if splits > 1:
        part, ml, counter = decode_workspace(query.device, tiles * hk * splits * rows * d,
                                             tiles * hk * splits * 2 * rows, tiles * hk)
    else:
        part = ml = _dummy_f32(query.device)
        counter = _dummy_i32(query.device)
    args = (query, key, value, kv_cache, block_table, seq_lens, query_start_loc,
            sinks if sinks is not None else _dummy_f32(query.device), out, part, ml, counter,
            error_words(query.device),
            float(scale), float(softcap or 0.0), int(sliding_window or 0), nreq, splits,
            kv_cache.shape[0], block_table.shape[1],
            query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            out.stride(0), out.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
            block_table.stride(0))
    return LaunchPlan(fit_divisible(spec, args), args, (tiles, hk, splits), notes={"num_splits": splits})
