"""Specialization, coverage rule and launch plan of decode v8 (issue 14), without importing Triton.

v8 (``ultraquant/kernels/gluon/decode_v8.py``) is an NVIDIA sm_90+ Gluon kernel: one program owns all
kv heads of a token range and streams them through a ``cp.async`` shared-memory ring of whole 16-token
runs. It covers D = 128, GQA <= 16, 1 <= Hk <= 8 (a power of two), blocks that are a multiple of 16
tokens, head-major caches whose 16-token runs are contiguous and 16-byte aligned
(:func:`whole_runs`); :func:`v8_supports` is the rule, everything else is v7's. Same run-time
arguments as v7 (``DECODE_PARAMS``, the bounds contract's included) and the same per-device
workspace. The production plan (``ultraquant.kernels.plans.plan_decode``) routes every decode that
:func:`v8_call` accepts here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..errors import UltraQuantError
from ..format import check_head_size, slot_size
from .flags import error_words
from .heuristics import cdiv, num_sms
from .specs import (
    ALIGNABLE,
    DECODE_PARAMS,
    Specialization,
    _signature,
    _tname,
    decode_args,
    fit_divisible,
    pow2_at_least,
)
from .workspace import _dummy_f32, decode_workspace

if TYPE_CHECKING:
    from .plans import LaunchPlan

V8_PROGRAMS_PER_SM = 1
"""Programs per multiprocessor the v8 split count aims for (181 registers x 8 warps and the ring's
shared memory leave room for one)."""

V8_MIN_SPLIT_TOKENS = 512
"""A v8 split never gets fewer tokens than this at the static ``max_seq_len`` bound (fewer, larger
splits won in every prototype)."""


@dataclass(frozen=True)
class V8Tuning:
    """Launch shape of v8: ``warps`` (Hk kv heads x warps/Hk token groups), a ring of ``stages`` x
    ``nsub`` sub-tiles of ``tw`` tokens per warp (16: one run; ``None``: 4 at D=128, 2 at D=256, so the
    ring stays ~140 KB), an optional register cap, an optional split count; ``rows_in_n``: query rows in
    the MMA N dimension (8 rows, used where GQA <= 8). Defaults: the fastest timed on the H200
    (benchmarks/NOTES.md, "Decode v8 round 4")."""

    warps: int = 8
    rows_in_n: bool = True
    nsub: int | None = None
    stages: int = 2
    tw: int = 16
    maxnreg: int | None = None
    splits: int | None = None


def whole_runs(head_size: int, strides: tuple[int, ...], num_kv_heads: int) -> bool:
    """True when the cache's ``(block, token, head)`` byte strides make every 16-token run of one kv
    head one contiguous, 16-byte aligned piece (head-major pages, or one kv head): v8 copies runs
    whole."""
    sb, st, sh = (int(x) for x in strides[:3])
    return st == slot_size(head_size) and sb % 16 == 0 and (sh % 16 == 0 or num_kv_heads == 1)


def v8_supports(*, head_size: int, gqa: int, num_kv_heads: int, block_size: int, runs: bool,
                target: str) -> bool:
    """The coverage rule: True where v8 can serve the decode, False where v7 must (``runs``:
    :func:`whole_runs` of the cache). D=256 only with the query rows in the MMA N dimension (GQA <= 8)."""
    return (target == "cuda" and (head_size == 128 and 1 <= gqa <= 16 or head_size == 256 and 1 <= gqa <= 8)
            and num_kv_heads in (1, 2, 4, 8) and block_size % 16 == 0 and runs)


def v8_call(head_size: int, gqa: int, num_kv_heads: int, block_size: int, cache_strides: tuple[int, ...],
            target: str, cache_aligned: bool = True) -> bool:
    """The plan's rule for one call: :func:`v8_supports` over the cache's strides (``cache_aligned``:
    its base address is a multiple of 16 bytes)."""
    return cache_aligned and v8_supports(head_size=head_size, gqa=gqa, num_kv_heads=num_kv_heads,
                                         block_size=block_size, target=target,
                                         runs=whole_runs(head_size, cache_strides, num_kv_heads))


def decode_v8_spec(*, head_size: int, gqa: int, num_kv_heads: int, block_size: int,
                   query_dtype: torch.dtype | str = "bf16", out_dtype: torch.dtype | str | None = None,
                   has_sinks: bool = False, has_window: bool = False, has_softcap: bool = False,
                   math: bool = True, tuning: V8Tuning = V8Tuning(),
                   **_: Any) -> Specialization:
    """The v8 kernel for one config (``math=False``: the no-math stream of the same grid and ring)."""
    d = check_head_size(head_size)
    hk = int(num_kv_heads)
    wt = max(1, tuning.warps // hk)
    nsub = tuning.nsub or (4 if d == 128 else 2)
    pow2 = [tuning.warps, nsub, tuning.stages]
    if tuning.tw != 16 or tuning.stages < 2 or any(x & (x - 1) for x in pow2):
        raise UltraQuantError(f"decode v8 tuning {tuning}: needs 16-token runs per warp (tw=16) and power-of-two "
                              "warps, nsub and stages >= 2 (the ring's padded shared views)")
    rows_in_n = tuning.rows_in_n and int(gqa) <= 8
    return Specialization(
        kernel="uq_decode_v8",
        signature=_signature(DECODE_PARAMS, query=_tname(query_dtype), out=_tname(out_dtype or query_dtype)),
        constexprs={"D": d, "LOG2D": d.bit_length() - 1, "GQA": int(gqa), "ROWS": 8 if rows_in_n else 16,
                    "GQA_PAD": pow2_at_least(int(gqa)), "HK": hk, "WT": wt, "NSUB": nsub,
                    "STAGES": tuning.stages, "TW": tuning.tw, "BLOCK_SIZE": int(block_size),
                    "HAS_SINKS": bool(has_sinks), "HAS_WINDOW": bool(has_window),
                    "HAS_SOFTCAP": bool(has_softcap), "MATH": bool(math), "ROWS_IN_N": rows_in_n},
        num_warps=hk * wt, num_stages=1, maxnreg=tuning.maxnreg, divisible=ALIGNABLE["uq_decode_v8"])


def v8_splits(batch: int, max_tokens: int, device: torch.device, forced: int | None = None) -> int:
    """Split count from static shapes: one wave of ``V8_PROGRAMS_PER_SM`` programs per SM, never
    splits shorter than ``V8_MIN_SPLIT_TOKENS``; ``forced`` overrides (tuning)."""
    if forced:
        return forced
    want = (num_sms(device) * V8_PROGRAMS_PER_SM) // max(1, batch)
    return max(1, min(want, cdiv(max_tokens, V8_MIN_SPLIT_TOKENS)))


def plan_decode_v8(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                   seq_lens: torch.Tensor, scale: float, sinks: torch.Tensor | None,
                   sliding_window: int | None, softcap: float | None, out: torch.Tensor,
                   math: bool = True, tuning: V8Tuning = V8Tuning()) -> LaunchPlan:
    """Launch of decode v8 (callers check :func:`v8_supports` first); grid ``(B, 1, splits)``."""
    from .plans import LaunchPlan

    b, hq, d = query.shape
    hk, bs = kv_cache.shape[2], kv_cache.shape[1]
    if not whole_runs(d, tuple(kv_cache.stride()), hk) or kv_cache.data_ptr() % 16:
        raise UltraQuantError(f"decode v8 reads whole 16-token runs: needs a head-major cache with 16-byte aligned "
                              f"pages (strides {tuple(kv_cache.stride())}); use decode_attention (v7)")
    spec = decode_v8_spec(head_size=d, gqa=hq // hk, num_kv_heads=hk, block_size=bs, query_dtype=query.dtype,
                          out_dtype=out.dtype, has_sinks=sinks is not None,
                          has_window=sliding_window is not None, has_softcap=softcap is not None,
                          math=math, tuning=tuning)
    c = spec.constexprs
    splits = v8_splits(b, block_table.shape[1] * bs, query.device, tuning.splits)
    parts = b * hk * splits * c["WT"]
    stream_out = b * splits * spec.num_warps * c["TW"]  # the no-math stream's per-program words
    part, ml, counter = decode_workspace(query.device, max(parts * c["ROWS"] * d, stream_out),
                                         parts * 2 * c["ROWS"], b * hk)
    args = decode_args(query, kv_cache, block_table, seq_lens,
                       sinks if sinks is not None else _dummy_f32(query.device), out, (part, ml, counter),
                       error_words(query.device), scale, softcap, sliding_window, splits)
    return LaunchPlan(fit_divisible(spec, args), args, (b, 1, splits), notes={"num_splits": splits})


def decode_v8(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
              scale: float, sinks: torch.Tensor | None = None, sliding_window: int | None = None,
              softcap: float | None = None, out: torch.Tensor | None = None, math: bool = True,
              tuning: V8Tuning = V8Tuning()) -> torch.Tensor:
    """Decode through v8 on an NVIDIA GPU (same contract as ``ultraquant.decode_attention``; no
    fallback: the caller checks :func:`v8_supports`; Gluon's JIT, any ``tuning``). Imports Triton lazily."""
    from .registry import jit_launch

    if out is None:
        out = torch.empty_like(query)
    jit_launch(plan_decode_v8(query, kv_cache, block_table, seq_lens, scale, sinks, sliding_window, softcap, out,
                             math=math, tuning=tuning))
    return out


__all__ = ["V8Tuning", "V8_PROGRAMS_PER_SM", "decode_v8", "decode_v8_spec", "plan_decode_v8", "v8_call",
           "v8_splits", "v8_supports", "whole_runs"]
