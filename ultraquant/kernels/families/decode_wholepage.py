"""The whole-page decode family (``gluon/decode_wholepage.py``, NVIDIA sm_90): tuning, spec, coverage
rule and launch plan, without importing Triton.

The kernel is a Gluon kernel: one program owns all
kv heads of a token range and streams them through a ``cp.async`` shared-memory ring of whole 16-token
runs. It covers D = 128, GQA <= 16, 1 <= Hk <= 8 (a power of two), blocks that are a multiple of 16
tokens, head-major caches whose 16-token runs are contiguous and 16-byte aligned (:func:`whole_runs`)
or token-major pages whose block of all kv heads is one contiguous run (:func:`token_runs`, the kernel's
``TOKEN_MAJOR``: the copy streams the page as it lies, the views separate heads in shared memory);
:func:`wholepage_supports` is the rule, everything else is split-KV decode's.
Split-KV decode's run-time arguments with the batch size in the split count's slot
(:data:`WHOLEPAGE_PARAMS`, the bounds contract's included) and the same per-device workspace; a
persistent grid (:func:`wholepage_programs`) whose work the kernel balances from ``seq_lens`` on the device
(:func:`wholepage_schedule` models it). The production plan (``ultraquant.kernels.plans.plan_decode``)
routes every decode that :func:`wholepage_call` accepts here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...errors import UltraQuantError
from ...format import check_head_size, slot_size
from ..catalog import alignable
from ..flags import error_words
from ..heuristics import cdiv, num_sms
from ..specialization import LaunchPlan, Specialization, fit_divisible, pow2_at_least, signature_of, type_name
from ..workspace import decode_workspace, dummy_f32
from .decode_splitkv import DECODE_PARAMS, decode_args

WHOLEPAGE_PROGRAMS_PER_SM = 1
"""Programs per multiprocessor of the persistent grid (181 registers x 8 warps and the ring's shared
memory leave room for one)."""

WHOLEPAGE_MIN_SPLIT_TOKENS = 512
"""The schedule never deals a program fewer tokens than this at the batch's average (fewer, larger
pieces won in every prototype): ``active = min(programs, cdiv(total, MIN_UNITS))``."""

WHOLEPAGE_PIECE_UNITS = 2
"""What one piece costs beyond its stages, in stages (the query's rotation, the ring's fill, the partial's
write): the schedule counts it once per request, so a program that serves many short requests gets fewer
stages. Fitted on the H100 (benchmarks/NOTES.md, "Session of 2026-12-06"): 256 x 1k against A, and the
96-request ragged batch, both match ``max over programs of (stages + 2 x pieces)``."""

WHOLEPAGE_PARAMS: tuple[tuple[str, str], ...] = tuple(
    ("num_requests", t) if n == "num_splits" else (n, t) for n, t in DECODE_PARAMS
)
"""The kernel's run-time parameters: split-KV decode's (:data:`DECODE_PARAMS`), the split count's slot
holding the batch size (the kernel derives its pieces from ``seq_lens``; its grid is persistent)."""


@dataclass(frozen=True)
class WholePageTuning:
    """Launch shape of the whole-page decode: ``warps`` (Hk kv heads x warps/Hk token groups), a ring of ``stages`` x
    ``nsub`` sub-tiles of ``tw`` tokens per warp (16: one run; ``None``: 4 at D=128, 2 at D=256, so the
    ring stays ~140 KB), an optional register cap, an optional persistent grid size (``programs``;
    default :func:`wholepage_programs`); ``rows_in_n``: query rows in the MMA N dimension (8 rows per MMA;
    GQA 9..16 at D=128 as two 8-row groups; False: 16 M rows). Defaults: the fastest timed on the H200
    (benchmarks/NOTES.md, "Whole-page decode")."""

    warps: int = 8
    rows_in_n: bool = True
    nsub: int | None = None
    stages: int = 2
    tw: int = 16
    maxnreg: int | None = None
    programs: int | None = None


def whole_runs(head_size: int, strides: tuple[int, ...], num_kv_heads: int) -> bool:
    """True when the cache's ``(block, token, head)`` byte strides make every 16-token run of one kv
    head one contiguous, 16-byte aligned piece (head-major pages, or one kv head): the kernel copies runs
    whole."""
    sb, st, sh = (int(x) for x in strides[:3])
    return st == slot_size(head_size) and sb % 16 == 0 and (sh % 16 == 0 or num_kv_heads == 1)


def token_runs(head_size: int, strides: tuple[int, ...], num_kv_heads: int) -> bool:
    """True when the cache's ``(block, token, head)`` byte strides are token-major pages with more than one
    kv head (``(block, token, head, slot)`` memory order: a plain ``torch.zeros((blocks, block_size, Hk,
    slot))``, upstream vLLM's order), blocks 16-byte aligned: every block's page of all kv heads is one
    contiguous run the kernel copies whole (``TOKEN_MAJOR``)."""
    sb, st, sh = (int(x) for x in strides[:3])
    s = slot_size(head_size)
    return num_kv_heads > 1 and sh == s and st == num_kv_heads * s and sb % 16 == 0


def page_runs(head_size: int, strides: tuple[int, ...], num_kv_heads: int, *, token_major: bool) -> bool:
    """True when the kernel can copy the cache's pages as whole runs: head-major (:func:`whole_runs`) or, with
    ``token_major``, token-major pages too (:func:`token_runs`); the one layout rule of the call and the plan."""
    return whole_runs(head_size, strides, num_kv_heads) or (
        token_major and token_runs(head_size, strides, num_kv_heads))


def dense_strides(head_size: int, num_kv_heads: int, block_size: int) -> tuple[int, int, int]:
    """The ``(block, token, head)`` byte strides of a dense ``(blocks, block_size, Hk, slot)`` cache (a
    plain ``torch.zeros``: token-major pages), the layout a config without ``cache_strides`` means."""
    s = slot_size(head_size)
    return (block_size * num_kv_heads * s, num_kv_heads * s, s)


def wholepage_supports(
    *, head_size: int, gqa: int, num_kv_heads: int, block_size: int, runs: bool, target: str
) -> bool:
    """The coverage rule: True where the whole-page decode can serve the decode, False where split-KV
    decode must (``runs``:
    :func:`whole_runs` of the cache). D=256 only with the query rows in the MMA N dimension (GQA <= 8)."""
    return (
        target == "cuda"
        and (head_size == 128 and 1 <= gqa <= 16 or head_size == 256 and 1 <= gqa <= 8)
        and num_kv_heads in (1, 2, 4, 8)
        and block_size % 16 == 0
        and runs
    )


def wholepage_call(
    head_size: int,
    gqa: int,
    num_kv_heads: int,
    block_size: int,
    cache_strides: tuple[int, ...],
    target: str,
    cache_aligned: bool = True,
    token_major: bool = True,
) -> bool:
    """The plan's rule for one call: :func:`wholepage_supports` over the cache's strides (``cache_aligned``:
    its base address is a multiple of 16 bytes; ``token_major``: token-major pages count too,
    :func:`token_runs`; the multi-query decode, head-major only, passes False)."""
    runs = page_runs(head_size, cache_strides, num_kv_heads, token_major=token_major)
    return cache_aligned and wholepage_supports(
        head_size=head_size,
        gqa=gqa,
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        target=target,
        runs=runs,
    )


def is_token_major(head_size: int, cache_strides: tuple[int, ...] | None, num_kv_heads: int,
                   block_size: int) -> bool:
    """True when a cache the whole-page decode serves is token-major (its kernel takes ``TOKEN_MAJOR``);
    ``cache_strides`` None: the dense layout (:func:`dense_strides` of ``block_size``, so no default)."""
    if cache_strides is None:
        cache_strides = dense_strides(head_size, num_kv_heads, block_size)
    return not whole_runs(head_size, cache_strides, num_kv_heads) and token_runs(head_size, cache_strides,
                                                                                  num_kv_heads)


KV_HEADS: tuple[int, ...] = (1, 2, 4, 8)
"""Kv-head counts the kernel serves; a blob is per count (a program holds all kv heads of a page)."""


def unsupported(config: dict[str, Any]) -> str:
    """Why the whole-page decode does not serve ``config`` (matrix keys), or ``""``: :func:`wholepage_supports`
    for a build config (``token_major``: a token-major blob, built for Hk > 1 only)."""
    dtype = config.get("query_dtype", config.get("dtype", "bf16"))
    if str(dtype) not in ("bf16", "fp16"):
        return f"the whole-page decode reads bf16/fp16 queries, not {dtype}"
    if config.get("token_major") and config.get("num_kv_heads") == 1:
        return "one kv head: token-major and head-major pages are the same bytes (the head-major blob serves)"
    if not wholepage_supports(head_size=config.get("head_size", 0), gqa=config.get("gqa", 0),
                              num_kv_heads=config.get("num_kv_heads", 0), block_size=config.get("block_size", 0),
                              runs=True, target="cuda"):
        return ("the whole-page decode serves D=128 with GQA 1-16 and D=256 with GQA 1-8, 1/2/4/8 kv heads, "
                "blocks of a multiple of 16 tokens (wholepage_supports); split-KV decode serves the rest")
    return ""


def decode_wholepage_spec(
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
    tuning: WholePageTuning = WholePageTuning(),
    token_major: bool = False,
    **_: Any,
) -> Specialization:
    """The whole-page decode kernel for one config (``token_major``: token-major pages, :func:`token_runs`;
    at one kv head the layouts are the same bytes and the head-major kernel serves)."""
    d = check_head_size(head_size)
    hk = int(num_kv_heads)
    wt = max(1, tuning.warps // hk)
    nsub = tuning.nsub or (4 if d == 128 else 2)
    pow2 = [tuning.warps, nsub, tuning.stages]
    if tuning.tw != 16 or tuning.stages < 2 or any(x & (x - 1) for x in pow2):
        raise UltraQuantError(
            f"whole-page decode tuning {tuning}: needs 16-token runs per warp (tw=16) and power-of-two "
            "warps, nsub and stages >= 2 (the ring's padded shared views)"
        )
    # rows in N: 8 query rows per MMA tile; GQA 9..16 at D=128 as two 8-row groups over the same decoded
    # K/V fragments (benchmarks/NOTES.md, "Serving decode")
    rows_in_n = tuning.rows_in_n and (int(gqa) <= 8 or d == 128)
    return Specialization(
        kernel="uq_decode_wholepage",
        signature=signature_of(WHOLEPAGE_PARAMS, query=type_name(query_dtype),
                               out=type_name(out_dtype or query_dtype)),
        constexprs={
            "D": d,
            "LOG2D": d.bit_length() - 1,
            "GQA": int(gqa),
            "ROWS": 8 if rows_in_n and int(gqa) <= 8 else 16,
            "GQA_PAD": pow2_at_least(int(gqa)),
            "HK": hk,
            "WT": wt,
            "NSUB": nsub,
            "STAGES": tuning.stages,
            "TW": tuning.tw,
            "BLOCK_SIZE": int(block_size),
            "HAS_SINKS": bool(has_sinks),
            "HAS_WINDOW": bool(has_window),
            "HAS_SOFTCAP": bool(has_softcap),
            "ROWS_IN_N": rows_in_n,
            "MIN_TOKENS": WHOLEPAGE_MIN_SPLIT_TOKENS,
            "PIECE_UNITS": WHOLEPAGE_PIECE_UNITS,
            # only where set, so head-major keys (and blobs) stay what they were
            **({"TOKEN_MAJOR": True} if token_major and hk > 1 else {}),
        },
        num_warps=hk * wt,
        num_stages=1,
        maxnreg=tuning.maxnreg,
        divisible=alignable("uq_decode_wholepage"),
    )


def wholepage_programs(device: torch.device, forced: int | None = None) -> int:
    """The persistent grid: ``WHOLEPAGE_PROGRAMS_PER_SM`` programs per SM, fixed per device (so a
    captured graph replays for any lengths); ``forced`` overrides (tuning, tests)."""
    return int(forced) if forced else num_sms(device) * WHOLEPAGE_PROGRAMS_PER_SM


def stage_tokens(head_size: int, num_kv_heads: int, tuning: WholePageTuning = WholePageTuning()) -> int:
    """Tokens of one ring stage (``TT = NSUB * WT * 16``): the schedule's unit of work."""
    spec = decode_wholepage_spec(head_size=head_size, gqa=1, num_kv_heads=num_kv_heads, block_size=16, tuning=tuning)
    c = spec.constexprs
    return c["NSUB"] * c["WT"] * c["TW"]


@dataclass(frozen=True)
class Piece:
    """One program's share of one request in the schedule: tokens ``[t_lo, t_hi)``, its workspace slot,
    and the programs ``first .. first + parts - 1`` that hold the request's pieces."""

    program: int
    request: int
    t_lo: int
    t_hi: int
    slot: int
    first: int
    parts: int


def wholepage_schedule(seq_lens: list[int], programs: int, stage: int, cap: int, window: int | None = None,
                       min_tokens: int = WHOLEPAGE_MIN_SPLIT_TOKENS,
                       piece_units: int = WHOLEPAGE_PIECE_UNITS) -> list[Piece]:
    """A pure-Python model of the kernel's balanced schedule (``_schedule``/``_units``/``_owner`` in
    gluon/decode_wholepage.py), for tests: every request has ``max(1, cdiv(len - lo_run, stage))``
    units (``lo_run``: the window's first token rounded down to a stage) and costs ``piece_units`` more
    (its piece's overhead); the batch's ``total`` cost goes in equal contiguous shares to ``active =
    min(programs, cdiv(total, min_units))`` programs, request b's units lying at ``[C_b + piece_units,
    C_b + piece_units + units_b)`` of that cost line (equal requests, at most ``programs`` of them: no
    overhead, ``k = min(programs // B, cdiv(units, min_units))`` whole programs each, the static split of
    a uniform batch). A request's piece on program p has workspace slot ``p + request`` (unique: the
    pieces form a staircase). Lengths are clamped to ``[0, cap]`` as the kernel does."""
    min_units = max(1, min_tokens // stage)
    units, lows = [], []
    for n in seq_lens:
        n = min(max(int(n), 0), cap)
        lo = max(n - window, 0) if window is not None else 0
        lo_run = lo // stage * stage
        units.append(max(cdiv(n - lo_run, stage), 1))
        lows.append((lo_run, n))
    equal = bool(units) and min(units) == max(units) and len(units) <= programs
    pc = 0 if equal else piece_units
    total = max(sum(units) + pc * len(units), 1)
    active = min(programs, cdiv(total, min_units))
    if equal:  # equal requests: whole programs each
        active = len(units) * max(1, min(programs // len(units), cdiv(units[0], min_units)))

    def owner(u: int) -> int:
        return ((u + 1) * active - 1) // total

    pieces = []
    cs = pc
    for b, u in enumerate(units):
        ce = cs + u
        first, last = owner(cs), owner(ce - 1)
        lo_run, n = lows[b]
        for p in range(first, last + 1):
            w0, w1 = min(p * total // active, total), min((p + 1) * total // active, total)
            t_lo = lo_run + (max(cs, w0) - cs) * stage
            t_hi = min(lo_run + (min(ce, w1) - cs) * stage, n)
            pieces.append(Piece(p, b, t_lo, t_hi, p + b, first, last - first + 1))
        cs = ce + pc
    return pieces


def plan_decode_wholepage(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None,
    sliding_window: int | None,
    softcap: float | None,
    out: torch.Tensor,
    tuning: WholePageTuning = WholePageTuning(),
) -> LaunchPlan:
    """Launch of the whole-page decode (callers check :func:`wholepage_supports` first): a persistent grid
    ``(programs, 1, 1)`` that balances the batch's work from ``seq_lens`` on the device (no host sync)."""
    b, hq, d = query.shape
    hk, bs = kv_cache.shape[2], kv_cache.shape[1]
    strides = tuple(kv_cache.stride())
    if not page_runs(d, strides, hk, token_major=True) or kv_cache.data_ptr() % 16:
        raise UltraQuantError(
            f"the whole-page decode reads whole 16-token runs: needs a head-major (or token-major) cache with "
            f"16-byte aligned pages (strides {strides}); use decode_attention (split-KV decode)"
        )
    spec = decode_wholepage_spec(
        head_size=d,
        gqa=hq // hk,
        num_kv_heads=hk,
        block_size=bs,
        query_dtype=query.dtype,
        out_dtype=out.dtype,
        has_sinks=sinks is not None,
        has_window=sliding_window is not None,
        has_softcap=softcap is not None,
        tuning=tuning,
        token_major=is_token_major(d, strides, hk, bs),
    )
    c = spec.constexprs
    programs = wholepage_programs(query.device, tuning.programs)
    parts = (programs + b) * hk  # slots program + request (wholepage_schedule)
    part, ml, counter = decode_workspace(query.device, parts * c["ROWS"] * d, parts * 2 * c["ROWS"], b * hk)
    args = decode_args(
        query,
        kv_cache,
        block_table,
        seq_lens,
        sinks if sinks is not None else dummy_f32(query.device),
        out,
        (part, ml, counter),
        error_words(query.device),
        scale,
        softcap,
        sliding_window,
        b,
    )
    return LaunchPlan(
        fit_divisible(spec, args, alignable(spec.kernel)), args, (programs, 1, 1), notes={"programs": programs}
    )


def decode_wholepage(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
    tuning: WholePageTuning = WholePageTuning(),
) -> torch.Tensor:
    """Decode through the whole-page kernel on an NVIDIA GPU (same contract as ``ultraquant.decode_attention``; no
    fallback: the caller checks :func:`wholepage_supports`; Gluon's JIT, any ``tuning``). Imports Triton lazily."""
    from ..registry import jit_launch

    if out is None:
        out = torch.empty_like(query)
    jit_launch(
        plan_decode_wholepage(
            query, kv_cache, block_table, seq_lens, scale, sinks, sliding_window, softcap, out, tuning=tuning
        )
    )
    return out


__all__ = [
    "Piece",
    "WHOLEPAGE_PARAMS",
    "WholePageTuning",
    "WHOLEPAGE_PROGRAMS_PER_SM",
    "dense_strides",
    "is_token_major",
    "page_runs",
    "token_runs",
    "decode_wholepage",
    "decode_wholepage_spec",
    "plan_decode_wholepage",
    "wholepage_call",
    "stage_tokens",
    "wholepage_programs",
    "wholepage_schedule",
    "wholepage_supports",
    "whole_runs",
]
