"""Specializations and launch plans of the UltraQuant kernels, without importing Triton.

This module is the single source of truth for each kernel's parameter list (``*_PARAMS``, the
non-constexpr parameters in order with Triton type strings), its constexprs (from a keyword config),
its launch grid and its run-time arguments. The Triton JIT path (:mod:`ultraquant.kernels.registry`)
and the AOT runtime both consume the :class:`LaunchPlan` a ``plan_*`` function returns, and codegen
enumerates :data:`SPECIALIZERS` to compile the same variants ahead of time.

Why no Triton here: the AOT runtime must plan launches on machines where Triton is not installed.
"""

from __future__ import annotations

import math
import os
import threading
from typing import Any

import torch

from ..format import check_head_size, slot_size
from .plan import LaunchPlan, Specialization

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
    torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8",
}
"""Triton's type name of each tensor dtype the kernels take."""

ENCODER_IDS: dict[str, int] = {"rne": 0, "upstream": 1, "mse": 2}
"""Constexpr ``ENCODER`` of each encoder name."""

DEFAULT_NUM_SMS = 132
"""Multiprocessor count assumed when planning for a device torch cannot describe (H200/H100: 132)."""

MIN_SPLIT_TOKENS = 256
"""A decode split never gets fewer tokens than this (at the static ``max_seq_len`` bound)."""

DECODE_BLOCKS_PER_SM = {128: 8, 512: 2}
"""Programs per multiprocessor the decode split count aims for, by head size bound (D <= key). Timed
on the H200 (v7, benchmarks/NOTES.md): D=128 (64-token tiles, 136 registers, 3 resident blocks) ran
shape D 141 us with 2 splits (~2 programs per SM-slot) against 184 with 1, and shape A 263-270 us with
8-16; D=256 (8 warps, 64-token tiles) ran shape C 159 us with 16 splits against 173 with 33."""

PREFILL_BLOCKS_PER_SM = 4
"""Programs per multiprocessor the prefill split count aims for (its programs hold more rows)."""

STORE_FEW_ROWS_PER_SM = 128
"""A store with fewer (token, kv head) rows than this per multiprocessor uses the few-rows layout
(:func:`store_spec`): at one row per thread it would leave SMs idle and run one long chain each."""

CONTINUATION_THRESHOLD = 16
"""Chunks of at most this many new tokens (with a cached prefix) are small continuations, served by
the prefill kernel; larger ones go to dequant + SDPA (ultraquant.dense). Measured on the H200
(``ultraquant bench --prefill``, Hq=32 Hk=8 D=128 bf16, CUDA-graph device time, benchmarks/NOTES.md):
the kernel wins up to 16 new tokens at a 16k prefix and up to 32 at 4k, SDPA from there on (ctx 16384,
q 128: 431 vs 174 us); upstream's guess was 128."""

STORE_PARAMS: tuple[tuple[str, str], ...] = (
    ("key_ptr", "*{key}"), ("value_ptr", "*{value}"), ("cache_ptr", "*u8"), ("slot_ptr", "*{slot}"),
    ("n_rows", "i32"), ("num_kv_heads", "i32"), ("block_size", "i32"),
    ("stride_kn", "i32"), ("stride_kh", "i32"), ("stride_vn", "i32"), ("stride_vh", "i32"),
    ("stride_cb", "i32"), ("stride_ct", "i32"), ("stride_ch", "i32"),
)
DEQUANT_PARAMS: tuple[tuple[str, str], ...] = (
    ("cache_ptr", "*u8"), ("bt_ptr", "*i32"), ("seqlen_ptr", "*i32"), ("cu_ptr", "*i32"),
    ("k_out_ptr", "*{out}"), ("v_out_ptr", "*{out}"),
    ("stride_cb", "i32"), ("stride_ct", "i32"), ("stride_ch", "i32"), ("stride_btb", "i32"),
    ("stride_kn", "i32"), ("stride_kh", "i32"), ("stride_vn", "i32"), ("stride_vh", "i32"),
)
DECODE_PARAMS: tuple[tuple[str, str], ...] = (
    ("q_ptr", "*{query}"), ("cache_ptr", "*u8"), ("bt_ptr", "*i32"), ("seqlen_ptr", "*i32"),
    ("sinks_ptr", "*fp32"), ("out_ptr", "*{out}"), ("part_ptr", "*fp32"), ("ml_ptr", "*fp32"),
    ("counter_ptr", "*i32"),
    ("scale", "fp32"), ("softcap", "fp32"), ("window", "i32"), ("num_splits", "i32"),
    ("stride_qb", "i32"), ("stride_qh", "i32"), ("stride_ob", "i32"), ("stride_oh", "i32"),
    ("stride_cb", "i32"), ("stride_ct", "i32"), ("stride_ch", "i32"), ("stride_btb", "i32"),
)
PREFILL_PARAMS: tuple[tuple[str, str], ...] = (
    ("q_ptr", "*{query}"), ("k_ptr", "*{key}"), ("v_ptr", "*{key}"), ("cache_ptr", "*u8"),
    ("bt_ptr", "*i32"), ("seqlen_ptr", "*i32"), ("qsl_ptr", "*i32"), ("sinks_ptr", "*fp32"),
    ("out_ptr", "*{out}"), ("part_ptr", "*fp32"), ("ml_ptr", "*fp32"), ("counter_ptr", "*i32"),
    ("scale", "fp32"), ("softcap", "fp32"), ("window", "i32"), ("num_reqs", "i32"), ("num_splits", "i32"),
    ("stride_qn", "i32"), ("stride_qh", "i32"), ("stride_kn", "i32"), ("stride_kh", "i32"),
    ("stride_vn", "i32"), ("stride_vh", "i32"), ("stride_on", "i32"), ("stride_oh", "i32"),
    ("stride_cb", "i32"), ("stride_ct", "i32"), ("stride_ch", "i32"), ("stride_btb", "i32"),
)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _tname(dtype: torch.dtype | str) -> str:
    if isinstance(dtype, str):
        return dtype
    return DTYPE_NAMES[dtype]


def slot_alignment(head_size: int, strides: tuple[int, ...] | None = None) -> int:
    """Bytes every slot start is a multiple of: gcd(16, cache strides); without strides, the dense
    layout's gcd(16, slot_size(D)) (D=64: 4, D=128: 8, D>=256: 16). A constexpr of the attention
    kernels (the compiler vectorizes slot loads with it)."""
    g = 16
    for s in strides if strides is not None else (slot_size(head_size),):
        g = math.gcd(g, int(s))
    return max(1, g)


def target_of(device: torch.device) -> str:
    """Code-generation target of a device: ``"cuda"`` (NVIDIA: inline PTX allowed), ``"hip"`` (AMD)
    or ``"portable"`` (CPU: the Triton interpreter). Codegen passes the same names per arch."""
    if device.type != "cuda":
        return "portable"
    return "hip" if torch.version.hip else "cuda"


def _signature(params: tuple[tuple[str, str], ...], **types: str) -> dict[str, str]:
    return {name: ty.format(**types) for name, ty in params}


# ---------------------------------------------------------------- specializations (config -> spec)


def store_spec(*, head_size: int, key_dtype: torch.dtype | str = "bf16",
               value_dtype: torch.dtype | str | None = None, slot_dtype: torch.dtype | str = "i64",
               encoder: str = "rne", few_rows: bool = False, **_: Any) -> Specialization:
    """The store kernel for one head size, input dtypes, slot_mapping dtype and encoder; ``few_rows``
    for calls with too few (token, kv head) rows to fill the GPU at one row per thread."""
    d = check_head_size(head_size)
    # One row per thread (32 rows per warp, 4 warps): the butterfly, group absmax and nibble packing
    # stay in registers. Offline sm_90 SASS at D=128 (rne): 221 warp instructions per row against 749
    # for the 16-row layout timed at 154 us (benchmarks/NOTES.md); H200: 64 us. Where a whole row per
    # thread spills past the build's local-memory budget (mse at D=128: 1648 B; D>=256) fewer rows are
    # used. Few rows (a decode step's store): 16 rows per program, 8 threads per row, because one row
    # per thread is a long serial chain per program (H200, 64 tokens x 8 heads: 11.5 us vs 7.4).
    if few_rows:
        block_r = 16 if d <= 128 else 4
    elif d <= 64 or (d == 128 and encoder != "mse"):
        block_r = 128
    else:
        block_r = 32 if d == 128 else 8
    return Specialization(
        kernel="uq_store_kv",
        signature=_signature(STORE_PARAMS, key=_tname(key_dtype), value=_tname(value_dtype or key_dtype),
                             slot=_tname(slot_dtype)),
        constexprs={"D": d, "LOG2D": d.bit_length() - 1, "ENCODER": ENCODER_IDS[encoder], "BLOCK_R": block_r},
        num_warps=4, num_stages=1)


def dequant_spec(*, head_size: int, block_size: int, out_dtype: torch.dtype | str = "bf16",
                 original_space: bool = True, **_: Any) -> Specialization:
    """The dequant kernel: cache -> packed K (original or rotated space) and V of ``out_dtype``."""
    d = check_head_size(head_size)
    return Specialization(
        kernel="uq_dequant_kv",
        signature=_signature(DEQUANT_PARAMS, out=_tname(out_dtype)),
        constexprs={"D": d, "LOG2D": d.bit_length() - 1, "BLOCK_SIZE": int(block_size),
                    "TILE": 32 if d <= 256 else 16, "ORIGINAL_SPACE": bool(original_space)},
        num_warps=4, num_stages=1)


def decode_spec(*, head_size: int, gqa: int, block_size: int, query_dtype: torch.dtype | str = "bf16",
                out_dtype: torch.dtype | str | None = None, has_sinks: bool = False,
                has_window: bool = False, has_softcap: bool = False, align: int | None = None,
                target: str = "portable", **_: Any) -> Specialization:
    """The split-KV decode kernel for one head size, GQA group, block size and feature set.

    ``target`` ``"cuda"`` selects the inline-PTX FP4 decode (constexpr ``FP4_PTX``); anything else
    (``"hip"``, ``"portable"``: AMD, the CPU interpreter) the plain-Triton one. See :func:`target_of`.
    """
    d = check_head_size(head_size)
    # Tuning knobs (tools/h200_sweep.py), not API. H200 sweeps v7/v7b (benchmarks/NOTES.md): D<=128 is
    # fastest with 64-token tiles on 4 warps (shape A 263 us vs 320 with 32), D=256 with 64 on 8 and V
    # decoded in its load layout (shape C 159 us vs 196 on 4 warps x 32); D=512 keeps 32 on 8.
    tile = int(os.environ.get("ULTRAQUANT_DECODE_TILE", 64 if d <= 256 else 32))
    warps = int(os.environ.get("ULTRAQUANT_DECODE_WARPS", 4 if d <= 128 else 8))
    stages = int(os.environ.get("ULTRAQUANT_DECODE_STAGES", 2))
    maxnreg = os.environ.get("ULTRAQUANT_DECODE_MAXNREG")
    return Specialization(
        kernel="uq_decode",
        signature=_signature(DECODE_PARAMS, query=_tname(query_dtype), out=_tname(out_dtype or query_dtype)),
        constexprs={"D": d, "LOG2D": d.bit_length() - 1, "GQA": int(gqa),
                    "ROWS": max(16, _pow2_at_least(int(gqa))), "BLOCK_SIZE": int(block_size),
                    "TILE": tile, "HAS_SINKS": bool(has_sinks), "HAS_WINDOW": bool(has_window),
                    "HAS_SOFTCAP": bool(has_softcap), "ALIGN": int(align or slot_alignment(d)),
                    "FP4_PTX": target == "cuda", "V_IN_LOAD_LAYOUT": d >= 256},
        num_warps=warps, num_stages=stages, maxnreg=int(maxnreg) if maxnreg else None)


def prefill_spec(*, head_size: int, gqa: int, block_size: int, query_dtype: torch.dtype | str = "bf16",
                 key_dtype: torch.dtype | str | None = None, out_dtype: torch.dtype | str | None = None,
                 has_sinks: bool = False, has_window: bool = False, has_softcap: bool = False,
                 align: int | None = None, target: str = "portable", **_: Any) -> Specialization:
    """The chunked-prefill kernel (cached prefix + causal chunk) for one config (``target``: see
    :func:`decode_spec`)."""
    d = check_head_size(head_size)
    gpad = _pow2_at_least(int(gqa))
    rows = max(16, gpad, 64 if d <= 128 else (32 if d <= 256 else 16))
    return Specialization(
        kernel="uq_prefill",
        signature=_signature(PREFILL_PARAMS, query=_tname(query_dtype), key=_tname(key_dtype or query_dtype),
                             out=_tname(out_dtype or query_dtype)),
        constexprs={"D": d, "LOG2D": d.bit_length() - 1, "GQA": int(gqa), "GQA_PAD": gpad, "ROWS": rows,
                    "BLOCK_SIZE": int(block_size), "TILE": 32, "HAS_SINKS": bool(has_sinks),
                    "HAS_WINDOW": bool(has_window), "HAS_SOFTCAP": bool(has_softcap),
                    "ALIGN": int(align or slot_alignment(d)), "FP4_PTX": target == "cuda",
                    "V_IN_LOAD_LAYOUT": d >= 256},
        num_warps=4 if d <= 128 else 8, num_stages=2)


SPECIALIZERS = {
    "store_kv": store_spec,
    "dequant_kv": dequant_spec,
    "decode_attention": decode_spec,
    "prefill_attention": prefill_spec,
}
"""Op name -> function(**config) -> Specialization (what codegen enumerates)."""


# ---------------------------------------------------------------- device facts and workspaces


_lock = threading.Lock()
_num_sms: dict[str, int] = {}
_workspaces: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
_retired: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
"""Workspaces replaced by larger ones: kept alive forever, because a CUDA graph captured earlier
still holds their addresses (freeing them would let a replay write into reused memory)."""
_dummies: dict[str, torch.Tensor] = {}


def num_sms(device: torch.device) -> int:
    """Multiprocessor count of ``device`` (cached; a host query, no device sync)."""
    key = str(device)
    if key not in _num_sms:
        n = DEFAULT_NUM_SMS
        if device.type == "cuda" and torch.cuda.is_available():
            n = torch.cuda.get_device_properties(device).multi_processor_count
        _num_sms[key] = n
    return _num_sms[key]


def decode_workspace(device: torch.device, part_elems: int, ml_elems: int,
                     counters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 partials, fp32 (m, l) rows and zeroed int32 tickets for split-KV decode and prefill,
    cached per device (the two ops run one after the other on a stream, never concurrently).

    Grows (reallocates) only when a call needs more than any earlier one; the smaller buffers stay
    allocated (graphs captured with them keep working). Warm up with the largest batch before
    capturing a CUDA graph, so that no allocation happens during capture. The kernel resets each
    ticket to 0 after use, so the counters stay valid across calls and graph replays. One workspace
    per device: concurrent launches on different streams of one device would race on it.
    """
    key = str(device)
    with _lock:
        ws = _workspaces.get(key)
        if ws is None or ws[0].numel() < part_elems or ws[1].numel() < ml_elems or ws[2].numel() < counters:
            if ws is not None:
                _retired.append(ws)
            old = ws or (torch.empty(0), torch.empty(0), torch.empty(0))
            ws = (torch.empty(max(part_elems, old[0].numel(), 1), dtype=torch.float32, device=device),
                  torch.empty(max(ml_elems, old[1].numel(), 1), dtype=torch.float32, device=device),
                  torch.zeros(max(counters, old[2].numel(), 1), dtype=torch.int32, device=device))
            _workspaces[key] = ws
        return ws


def _dummy_f32(device: torch.device) -> torch.Tensor:
    """A 1-element fp32 tensor standing in for an absent optional pointer (never read)."""
    key = str(device)
    if key not in _dummies:
        _dummies[key] = torch.zeros(1, dtype=torch.float32, device=device)
    return _dummies[key]


def prefill_splits(programs: int, max_tokens: int, device: torch.device) -> int:
    """Split count of the cached prefix for prefill, from static shapes (``programs`` = tile bound
    x Hk): a few short chunks over a long prefix fill one wave of programs; large chunks get 1.
    ``ULTRAQUANT_PREFILL_SPLITS`` overrides (tests, tuning)."""
    forced = os.environ.get("ULTRAQUANT_PREFILL_SPLITS")
    if forced:
        return max(1, int(forced))
    want = (num_sms(device) * PREFILL_BLOCKS_PER_SM) // max(1, programs)
    return max(1, min(want, _cdiv(max_tokens, MIN_SPLIT_TOKENS)))


def _dummy_i32(device: torch.device) -> torch.Tensor:
    """A 1-element int32 tensor standing in for an unused ticket buffer (never touched)."""
    key = f"i32:{device}"
    if key not in _dummies:
        _dummies[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return _dummies[key]


def decode_splits(batch: int, num_kv_heads: int, max_tokens: int, device: torch.device,
                  head_size: int = 128) -> int:
    """Fixed split count from static shapes only (so a captured graph replays for any seq_lens).

    ``num_sms * DECODE_BLOCKS_PER_SM[D]`` programs in all (see there for the timings behind it).
    Never splits shorter than MIN_SPLIT_TOKENS at the ``max_tokens`` bound.
    ``ULTRAQUANT_DECODE_SPLITS`` overrides (tuning).
    """
    forced = os.environ.get("ULTRAQUANT_DECODE_SPLITS")
    if forced:
        return max(1, int(forced))
    per_sm = next(v for bound, v in sorted(DECODE_BLOCKS_PER_SM.items()) if head_size <= bound)
    want = (num_sms(device) * per_sm) // max(1, batch * num_kv_heads)
    return max(1, min(want, _cdiv(max_tokens, MIN_SPLIT_TOKENS)))


# ---------------------------------------------------------------- plans (op call -> launch)


def plan_store(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
               encoder: str = "rne", few_rows: bool | None = None) -> LaunchPlan:
    """Launch of the store kernel for validated arguments (key/value last dim contiguous).
    ``few_rows`` picks the layout (see :func:`store_spec`); None: from the row count."""
    n, hk, d = key.shape
    rows = n * hk
    if few_rows is None:
        few_rows = rows < STORE_FEW_ROWS_PER_SM * num_sms(key.device)
    spec = store_spec(head_size=d, key_dtype=key.dtype, value_dtype=value.dtype, slot_dtype=slot_mapping.dtype,
                      encoder=encoder, few_rows=few_rows)
    args = (key, value, kv_cache, slot_mapping, rows, hk, kv_cache.shape[1],
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2))
    return LaunchPlan(spec, args, (max(1, _cdiv(rows, spec.constexprs["BLOCK_R"])), 1, 1))


def plan_dequant(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                 cu_seqlens: torch.Tensor, k_out: torch.Tensor, v_out: torch.Tensor, head_size: int,
                 original_space: bool = True) -> LaunchPlan:
    """Launch of the dequant kernel: request b's tokens go to rows ``cu_seqlens[b]:`` of the outputs."""
    spec = dequant_spec(head_size=head_size, block_size=kv_cache.shape[1], out_dtype=k_out.dtype,
                        original_space=original_space)
    tile = spec.constexprs["TILE"]
    max_tokens = block_table.shape[1] * kv_cache.shape[1]
    args = (kv_cache, block_table, seq_lens, cu_seqlens, k_out, v_out,
            kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), block_table.stride(0),
            k_out.stride(0), k_out.stride(1), v_out.stride(0), v_out.stride(1))
    grid = (max(1, _cdiv(max_tokens, tile)), block_table.shape[0], kv_cache.shape[2])
    return LaunchPlan(spec, args, grid)


def plan_decode(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                seq_lens: torch.Tensor, scale: float, sinks: torch.Tensor | None,
                sliding_window: int | None, softcap: float | None, out: torch.Tensor) -> LaunchPlan:
    """Launch of split-KV decode; the split count depends on static shapes only."""
    b, hq, d = query.shape
    hk, bs = kv_cache.shape[2], kv_cache.shape[1]
    spec = decode_spec(head_size=d, gqa=hq // hk, block_size=bs, query_dtype=query.dtype,
                       out_dtype=out.dtype, has_sinks=sinks is not None,
                       has_window=sliding_window is not None, has_softcap=softcap is not None,
                       align=slot_alignment(d, tuple(kv_cache.stride()[:3])), target=target_of(query.device))
    rows = spec.constexprs["ROWS"]
    splits = decode_splits(b, hk, block_table.shape[1] * bs, query.device, d)
    part, ml, counter = decode_workspace(query.device, b * hk * splits * rows * d, b * hk * splits * 2 * rows,
                                         b * hk)
    args = (query, kv_cache, block_table, seq_lens, sinks if sinks is not None else _dummy_f32(query.device),
            out, part, ml, counter,
            float(scale), float(softcap or 0.0), int(sliding_window or 0), splits,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), block_table.stride(0))
    return LaunchPlan(spec, args, (b, hk, splits), notes={"num_splits": splits})


def plan_prefill(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                 scale: float, sinks: torch.Tensor | None, sliding_window: int | None,
                 softcap: float | None, out: torch.Tensor) -> LaunchPlan:
    """Launch of the chunked-prefill kernel; the grid bounds the tiles from N and B (no host sync)."""
    n, hq, d = query.shape
    hk, bs = kv_cache.shape[2], kv_cache.shape[1]
    spec = prefill_spec(head_size=d, gqa=hq // hk, block_size=bs, query_dtype=query.dtype,
                        key_dtype=key.dtype, out_dtype=out.dtype, has_sinks=sinks is not None,
                        has_window=sliding_window is not None, has_softcap=softcap is not None,
                        align=slot_alignment(d, tuple(kv_cache.stride()[:3])), target=target_of(query.device))
    rows = spec.constexprs["ROWS"]
    qt = rows // spec.constexprs["GQA_PAD"]
    nreq = seq_lens.shape[0]
    tiles = max(1, _cdiv(n, qt) + nreq)
    splits = prefill_splits(tiles * hk, block_table.shape[1] * bs, query.device)
    if splits > 1:
        part, ml, counter = decode_workspace(query.device, tiles * hk * splits * rows * d,
                                             tiles * hk * splits * 2 * rows, tiles * hk)
    else:
        part = ml = _dummy_f32(query.device)
        counter = _dummy_i32(query.device)
    args = (query, key, value, kv_cache, block_table, seq_lens, query_start_loc,
            sinks if sinks is not None else _dummy_f32(query.device), out, part, ml, counter,
            float(scale), float(softcap or 0.0), int(sliding_window or 0), nreq, splits,
            query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            out.stride(0), out.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
            block_table.stride(0))
    return LaunchPlan(spec, args, (tiles, hk, splits), notes={"num_splits": splits})


__all__ = [
    "CONTINUATION_THRESHOLD", "SPECIALIZERS", "decode_spec", "dequant_spec", "prefill_spec", "store_spec",
    "plan_store", "plan_dequant", "plan_decode", "plan_prefill", "decode_splits", "decode_workspace",
    "prefill_splits", "slot_alignment", "target_of",
]
