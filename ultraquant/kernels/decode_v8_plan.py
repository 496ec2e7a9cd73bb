"""Specialization, plan rule and launch plan of decode v8 (issue 14), without importing Triton.

v8 (``ultraquant/kernels/gluon/decode_v8.py``) is an NVIDIA sm_90+ Gluon kernel: one program owns all
kv heads of a token range and streams whole pages through a ``cp.async`` shared-memory ring. It covers
D = 128, GQA <= 16, 1 <= Hk <= 8 (a power of two), slots 8-byte aligned (both cache layouts), any
block size that is a multiple of 16; :func:`v8_supports` is the rule, everything else goes to v7.
Same run-time arguments as v7 (``DECODE_PARAMS``) and the same per-device workspace.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..format import check_head_size
from .plan import LaunchPlan, Specialization
from .plans import (
    DECODE_PARAMS,
    _cdiv,
    _dummy_f32,
    _pow2_at_least,
    _signature,
    _tname,
    decode_workspace,
    num_sms,
    slot_alignment,
)

V8_PROGRAMS_PER_SM = 1
"""Programs per multiprocessor the v8 split count aims for (its ring takes most of the shared memory)."""

V8_MIN_SPLIT_TOKENS = 512
"""A v8 split never gets fewer tokens than this at the static ``max_seq_len`` bound (fewer, larger
splits won in every prototype)."""


def v8_supports(*, head_size: int, gqa: int, num_kv_heads: int, block_size: int, align: int,
                target: str) -> bool:
    """The plan rule: True where v8 serves the decode, False where v7 does."""
    return (target == "cuda" and head_size == 128 and 1 <= gqa <= 16 and num_kv_heads in (1, 2, 4, 8)
            and block_size % 16 == 0 and align % 8 == 0)



def decode_v8_spec(*, head_size: int, gqa: int, num_kv_heads: int, block_size: int,
                   query_dtype: torch.dtype | str = "bf16", out_dtype: torch.dtype | str | None = None,
                   has_sinks: bool = False, has_window: bool = False, has_softcap: bool = False,
                   align: int | None = None, math: bool = True, stages: int | None = None,
                   nsub: int | None = None, **_: Any) -> Specialization:
    """The v8 kernel for one config: 8 warps (Hk heads x 8/Hk token groups; ``ULTRAQUANT_V8_WARPS``),
    a ring of ``stages`` x ``nsub`` sub-tiles of 16 tokens per warp. ``math=False`` is the no-math
    stream of the same ring."""
    d = check_head_size(head_size)
    hk = int(num_kv_heads)
    warps = int(os.environ.get("ULTRAQUANT_V8_WARPS", 8))
    maxnreg = os.environ.get("ULTRAQUANT_V8_MAXNREG")
    wt = max(1, warps // hk)
    nsub = int(nsub or os.environ.get("ULTRAQUANT_V8_NSUB", 2))
    stages = int(stages or os.environ.get("ULTRAQUANT_V8_STAGES", 4))
    return Specialization(
        kernel="uq_decode_v8",
        signature=_signature(DECODE_PARAMS, query=_tname(query_dtype), out=_tname(out_dtype or query_dtype)),
        constexprs={"D": d, "LOG2D": d.bit_length() - 1, "GQA": int(gqa), "ROWS": 16,
                    "GQA_PAD": _pow2_at_least(int(gqa)), "HK": hk, "WT": wt, "NSUB": nsub, "STAGES": stages,
                    "TW": int(os.environ.get("ULTRAQUANT_V8_TW", 16)),
                    "BLOCK_SIZE": int(block_size), "HAS_SINKS": bool(has_sinks),
                    "HAS_WINDOW": bool(has_window), "HAS_SOFTCAP": bool(has_softcap),
                    "ALIGN": int(align or slot_alignment(d)), "MATH": bool(math)},
        num_warps=hk * wt, num_stages=1, maxnreg=int(maxnreg) if maxnreg else None)


def v8_splits(batch: int, max_tokens: int, device: torch.device) -> int:
    """Split count from static shapes: one wave of ``V8_PROGRAMS_PER_SM`` programs per SM, never
    splits shorter than ``V8_MIN_SPLIT_TOKENS``. ``ULTRAQUANT_V8_SPLITS`` overrides (tuning)."""
    forced = os.environ.get("ULTRAQUANT_V8_SPLITS")
    if forced:
        return max(1, int(forced))
    want = (num_sms(device) * V8_PROGRAMS_PER_SM) // max(1, batch)
    return max(1, min(want, _cdiv(max_tokens, V8_MIN_SPLIT_TOKENS)))


def plan_decode_v8(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                   seq_lens: torch.Tensor, scale: float, sinks: torch.Tensor | None,
                   sliding_window: int | None, softcap: float | None, out: torch.Tensor,
                   math: bool = True) -> LaunchPlan:
    """Launch of decode v8 (callers check :func:`v8_supports` first); grid ``(B, 1, splits)``."""
    b, hq, d = query.shape
    hk, bs = kv_cache.shape[2], kv_cache.shape[1]
    spec = decode_v8_spec(head_size=d, gqa=hq // hk, num_kv_heads=hk, block_size=bs, query_dtype=query.dtype,
                          out_dtype=out.dtype, has_sinks=sinks is not None,
                          has_window=sliding_window is not None, has_softcap=softcap is not None,
                          align=slot_alignment(d, tuple(kv_cache.stride()[:3])), math=math)
    c = spec.constexprs
    splits = v8_splits(b, block_table.shape[1] * bs, query.device)
    parts = b * hk * splits * c["WT"]
    part, ml, counter = decode_workspace(query.device, max(parts * c["ROWS"] * d, b * splits * 8 * 16),
                                         parts * 2 * c["ROWS"], b * hk)
    args = (query, kv_cache, block_table, seq_lens, sinks if sinks is not None else _dummy_f32(query.device),
            out, part, ml, counter,
            float(scale), float(softcap or 0.0), int(sliding_window or 0), splits,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), block_table.stride(0))
    return LaunchPlan(spec, args, (b, 1, splits), notes={"num_splits": splits})


def decode_v8(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
              scale: float, sinks: torch.Tensor | None = None, sliding_window: int | None = None,
              softcap: float | None = None, out: torch.Tensor | None = None, math: bool = True) -> torch.Tensor:
    """Decode through v8 on an NVIDIA GPU (same contract as ``ultraquant.decode_attention``; no
    fallback: the caller checks :func:`v8_supports`). Imports Triton lazily."""
    from .gluon.decode_v8 import launch_v8

    if out is None:
        out = torch.empty_like(query)
    launch_v8(plan_decode_v8(query, kv_cache, block_table, seq_lens, scale, sinks, sliding_window, softcap, out,
                             math=math))
    return out


__all__ = ["decode_v8", "V8_PROGRAMS_PER_SM", "decode_v8_spec", "plan_decode_v8", "v8_splits", "v8_supports"]
