"""Launch heuristics: split counts and layout thresholds from static shapes and the device.

Every choice depends on static shapes only (never on ``seq_lens`` values), so a captured CUDA graph
replays for any sequence lengths. The numbers behind each constant are in benchmarks/NOTES.md.
"""

from __future__ import annotations

import torch


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers."""
    return -(-a // b)


DEFAULT_NUM_SMS = 132
"""Multiprocessor count assumed when planning for a device torch cannot describe (H200/H100: 132)."""

MIN_SPLIT_TOKENS = 256
"""A decode split never gets fewer tokens than this (at the static ``max_seq_len`` bound)."""

DECODE_BLOCKS_PER_SM = {128: 8, 512: 2}
"""Programs per multiprocessor the decode split count aims for, by head size bound (D <= key); from
the H200 split sweeps of decode split-KV (benchmarks/NOTES.md)."""

PREFILL_BLOCKS_PER_SM = 4
"""Programs per multiprocessor the prefill split count aims for (its programs hold more rows)."""

STORE_FEW_ROWS_PER_SM = 128
"""A store with fewer (token, kv head) rows than this per multiprocessor uses the few-rows layout
(:func:`store_spec`): at one row per thread it would leave SMs idle and run one long chain each."""

CONTINUATION_THRESHOLD = 16
"""Chunks of at most this many new tokens (with a cached prefix) are small continuations, served by
the prefill kernel; larger ones go to dequant + SDPA (ultraquant.dense). The crossover measured by
``ultraquant bench --prefill`` on the H200 (benchmarks/NOTES.md)."""


_num_sms: dict[str, int] = {}


def num_sms(device: torch.device) -> int:
    """Multiprocessor count of ``device`` (cached; a host query, no device sync)."""
    key = str(device)
    if key not in _num_sms:
        n = DEFAULT_NUM_SMS
        if device.type == "cuda" and torch.cuda.is_available():
            n = torch.cuda.get_device_properties(device).multi_processor_count
        _num_sms[key] = n
    return _num_sms[key]


def prefill_splits(programs: int, max_tokens: int, device: torch.device, forced: int | None = None) -> int:
    """Split count of the cached prefix for prefill, from static shapes (``programs`` = tile bound
    x Hk): a few short chunks over a long prefix fill one wave of programs; large chunks get 1.
    ``forced`` (``ULTRAQUANT_PREFILL_SPLITS``) overrides (tests, tuning)."""
    if forced:
        return forced
    want = (num_sms(device) * PREFILL_BLOCKS_PER_SM) // max(1, programs)
    return max(1, min(want, cdiv(max_tokens, MIN_SPLIT_TOKENS)))


def decode_splits(batch: int, num_kv_heads: int, max_tokens: int, device: torch.device,
                  head_size: int = 128, forced: int | None = None) -> int:
    """Fixed split count from static shapes only (so a captured graph replays for any seq_lens).

    ``num_sms * DECODE_BLOCKS_PER_SM[D]`` programs in all (see there for the timings behind it).
    Never splits shorter than MIN_SPLIT_TOKENS at the ``max_tokens`` bound.
    ``forced`` (``ULTRAQUANT_DECODE_SPLITS``) overrides (tuning).
    """
    if forced:
        return forced
    per_sm = next(v for bound, v in sorted(DECODE_BLOCKS_PER_SM.items()) if head_size <= bound)
    want = (num_sms(device) * per_sm) // max(1, batch * num_kv_heads)
    return max(1, min(want, cdiv(max_tokens, MIN_SPLIT_TOKENS)))


