"""THE specialization matrix: which kernel variants ``make kernels`` compiles, and why some are skipped.

This file is the one table of the AOT build (op x head size x GQA x block size x features). Each
:class:`OpRow` names an op of ``ultraquant.kernels.catalog.OPS`` (or of a
backend's own specializers), the axes its config depends on, the feature sets it is compiled for and
the launch rule text copied into the manifest. :data:`SKIPS` lists every config that is not built,
with the reason; skipped configs are recorded in the manifest too, so the runtime can tell "this
config is unsupported" from "this arch was not built".

What is built comes from a :class:`Selection`: by default the exact attention configs of the
``popular`` models or of given config.json files (codegen/models.py, ``Selection.attention``), or
with ``MATRIX=full`` every combination of the axes below (head sizes 64/128/256/512, GQA
1/4/5/6/8/16, block sizes 16/32/64/128), which ``HEAD_SIZES=... GQA=... BLOCK_SIZES=... DTYPES=...
OPS=...`` narrow or extend (any value may be given: out-of-range ones are skipped with their reason).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ultraquant.errors import UltraQuantError
from ultraquant.format import SUPPORTED_HEAD_SIZES
from ultraquant.kernels.families import decode_flydsl as flydsl_family
from ultraquant.kernels.families import decode_multiquery as multiquery_family
from ultraquant.kernels.families import decode_wholepage as wholepage_family

DEFAULT_HEAD_SIZES: tuple[int, ...] = SUPPORTED_HEAD_SIZES
DEFAULT_GQA: tuple[int, ...] = (1, 4, 5, 6, 8, 16)
DEFAULT_BLOCK_SIZES: tuple[int, ...] = (16, 32, 64, 128)
DEFAULT_DTYPES: tuple[str, ...] = ("bf16",)
"""Query/key/value/output dtype; fp16 is available (``DTYPES=bf16,fp16``) but not built by default."""

AXES: tuple[str, ...] = ("head_size", "gqa", "block_size", "dtype", "num_kv_heads")
"""The matrix axes, in the order configs are enumerated (and their names in a config dict); only the whole-page
decode and the multi-query decode (its speculative-decoding sibling) have a ``num_kv_heads`` axis (``KV_HEADS=``,
default :data:`WHOLEPAGE_KV_HEADS`)."""

Config = dict[str, Any]

# Attention feature sets compiled by default: each is one model family's need.
PLAIN: Config = {}
GPT_OSS_FULL: Config = {"has_sinks": True}                       # gpt-oss full-attention layers
GPT_OSS_SLIDING: Config = {"has_sinks": True, "has_window": True}  # gpt-oss sliding layers
SLIDING: Config = {"has_window": True}                           # Mistral/Gemma-3 local layers
SOFTCAP: Config = {"has_softcap": True}                          # Gemma-2 global layers
SOFTCAP_SLIDING: Config = {"has_softcap": True, "has_window": True}  # Gemma-2 local layers
ATTENTION_FEATURES: tuple[Config, ...] = (PLAIN, GPT_OSS_FULL, GPT_OSS_SLIDING, SLIDING, SOFTCAP,
                                          SOFTCAP_SLIDING)
ATTENTION_FLAGS: Config = {"has_sinks": False, "has_window": False, "has_softcap": False}
WHOLEPAGE_KV_HEADS: tuple[int, ...] = wholepage_family.KV_HEADS
"""Kv-head counts the whole-page decode serves; one blob per count."""
"""Every feature flag defaults to off; a feature set only names the ones it turns on."""


@dataclass(frozen=True)
class OpRow:
    """One op of the matrix: which axes enter its config, which feature sets, how it launches."""

    op: str
    axes: tuple[str, ...]
    features: tuple[Config, ...] = (PLAIN,)
    flag_defaults: Config = field(default_factory=dict)
    backend: str = "triton"
    archs: tuple[str, ...] | None = None
    """Arch names this row is built for; ``None``: every arch the backend supports."""
    rename: dict[str, str] = field(default_factory=dict)
    """Axis -> the specializer's keyword for it (e.g. ``dtype`` -> ``query_dtype``)."""
    grid: str = ""
    """Launch rule: the grid as a function of the call's sizes (copied into the manifest)."""
    alternate_of: str = ""
    """Kernel whose LaunchPlan this row's blobs take (same parameters, constexprs and grid); the
    runtime prefers such blobs over that kernel's own, highest ``priority`` first."""
    priority: int = 0
    targeted: bool = False
    """The specializer takes ``target`` (``"cuda"`` on sm_*, ``"hip"`` on gfx*), as the run-time plan
    does from the device (``ultraquant.kernels.plans.target_of``): arch-specific code such as inline PTX."""


@dataclass(frozen=True)
class Skip:
    """A config that is not built: ``when(config, arch)`` is true -> skipped with ``reason`` (or with
    the string ``when`` returned, for rules whose reason depends on the config)."""

    ops: tuple[str, ...]
    when: Callable[[Config, str], bool | str]
    reason: str


@dataclass(frozen=True)
class SpillAllowance:
    """Configs allowed to use scratch / spills / local memory up to ``max_bytes`` per thread (HSACO:
    scratch + VGPR spills; cubin: local frame + stack); every other blob must use none."""

    ops: tuple[str, ...]
    when: Callable[[Config, str], bool]
    reason: str
    max_bytes: int


OPS: tuple[OpRow, ...] = (
    OpRow("store_kv", ("head_size", "dtype"), rename={"dtype": "key_dtype"},
          # slot_mapping is int64 in vLLM, the only slot dtype built by default (an int32 variant has
          # its own key: keys carry the pointer parameters' types).
          # few_rows: the layout of small stores (a decode step's tokens), chosen by plan_store at run time.
          features=tuple({"encoder": e, "slot_dtype": "i64", "few_rows": f}
                         for e in ("rne", "upstream", "mse") for f in (False, True)),
          targeted=True,  # the launch shape per target (ultraquant.kernels.families.store.store_spec)
          grid="(cdiv(num_tokens * num_kv_heads, BLOCK_R), 1, 1)"),
    OpRow("dequant_kv", ("head_size", "block_size"),
          # fp32 for ultraquant.dequant_kv; bf16/fp16 for the dense prefill route (dequant + SDPA in the
          # query dtype), so an AOT-only install serves large continuations without Triton.
          features=tuple({"out_dtype": t, "original_space": True} for t in ("fp32", "bf16", "fp16")),
          grid="(cdiv(max_blocks * block_size, TILE), num_seqs, num_kv_heads)"),
    OpRow("decode_attention", ("head_size", "gqa", "block_size", "dtype"), rename={"dtype": "query_dtype"},
          features=ATTENTION_FEATURES, flag_defaults=ATTENTION_FLAGS, targeted=True,
          grid="(num_seqs, num_kv_heads, num_splits); num_splits fixed from static shapes "
               "(ultraquant.kernels.plans.decode_splits), so graphs replay for any seq_lens"),
    # The whole-page decode (Gluon, sm_90): its own kernel, LaunchPlan and grid (ultraquant.kernels.plans.plan_decode
    # picks it by takes_wholepage); one blob per kv-head count (the program holds all kv heads of a page).
    OpRow("decode_attention_wholepage", ("head_size", "gqa", "block_size", "dtype", "num_kv_heads"),
          # both page layouts: head-major (empty_kv_cache) and token-major (a plain torch.zeros, upstream
          # vLLM's order; TOKEN_MAJOR, Hk > 1 only: at one kv head the layouts are the same bytes)
          rename={"dtype": "query_dtype"},
          features=ATTENTION_FEATURES + tuple({**f, "token_major": True} for f in ATTENTION_FEATURES),
          flag_defaults={**ATTENTION_FLAGS, "token_major": False}, archs=("sm_90",),
          grid="(programs, 1, 1): a persistent grid per device "
               "(ultraquant.kernels.families.decode_wholepage.wholepage_programs), the work balanced from "
               "seq_lens on the device; head-major or token-major caches (takes_wholepage)"),
    # The multi-query decode (Gluon, sm_90): speculative-decoding steps of up to 16 new tokens per request
    # (ultraquant.spec_decode_attention, routed by ultraquant.kernels.plans.takes_multiquery); one blob per kv-head
    # count and M tiles per program (1, or 2 where a request has two or more: multiquery_program_tiles); the
    # count bound is a run-time argument, not a constexpr.
    OpRow("spec_decode_attention", ("head_size", "gqa", "block_size", "dtype", "num_kv_heads"),
          rename={"dtype": "query_dtype"},
          features=tuple({**f, "tiles": t} for f in ATTENTION_FEATURES for t in multiquery_family.MULTIQUERY_TILES),
          flag_defaults=ATTENTION_FLAGS, archs=("sm_90",),
          grid="(cdiv(cdiv(max_query_len * GQA, 16), TILES), num_seqs, num_splits); num_splits fixed from static "
               "shapes (multiquery_splits of num_seqs x programs), so graphs replay any per-request counts up to "
               "max_query_len; head-major caches only (takes_multiquery)"),
    OpRow("prefill_attention", ("head_size", "gqa", "block_size", "dtype"), rename={"dtype": "query_dtype"},
          features=ATTENTION_FEATURES, flag_defaults=ATTENTION_FLAGS, targeted=True,
          grid="(cdiv(num_tokens, ROWS // GQA_PAD) + num_seqs, num_kv_heads, 1)"),
    # FlyDSL decode (codegen/flydsl): launched exactly like decode_attention (same LaunchPlan args,
    # grid and workspace), one 64-lane wave per block; key = the Triton key with uq_decode_flydsl.
    OpRow("decode_attention_flydsl", ("head_size", "gqa", "block_size", "dtype"),
          rename={"dtype": "query_dtype"}, features=ATTENTION_FEATURES, flag_defaults=ATTENTION_FLAGS,
          backend="flydsl", archs=("gfx942", "gfx950"), alternate_of="uq_decode_splitkv", priority=1,
          grid="(num_seqs, num_kv_heads, num_splits) as decode_attention; 64 threads"),
    # gfx950 variant: QK by the scaled FP4 x FP8 MFMA, V by the FP4 -> bf16 conversion instruction.
    OpRow("decode_attention_flydsl_mx", ("head_size", "gqa", "block_size", "dtype"),
          rename={"dtype": "query_dtype"}, features=ATTENTION_FEATURES, flag_defaults=ATTENTION_FLAGS,
          backend="flydsl", archs=("gfx950",), alternate_of="uq_decode_splitkv", priority=2,
          grid="(num_seqs, num_kv_heads, num_splits) as decode_attention; 64 threads"),
)
"""The op rows. A row's ``axes`` must be exactly the non-feature keywords its specializer takes."""


ATTENTION_OPS = ("decode_attention", "prefill_attention")
ALL_OPS = ("store_kv", "dequant_kv", *ATTENTION_OPS)


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _bad_head_size(c: Config, arch: str) -> bool:
    d = c.get("head_size", 32)
    return d < 32 or not _pow2(d)


SKIPS: tuple[Skip, ...] = (
    Skip(ALL_OPS, _bad_head_size,
         "head size must be a power of two and a multiple of 32 (the format's group size)"),
    Skip(ATTENTION_OPS, lambda c, a: c.get("gqa", 1) < 1,
         "GQA ratio must be at least 1"),
    Skip(("dequant_kv", *ATTENTION_OPS), lambda c, a: not _pow2(c.get("block_size", 1)),
         "block size must be a power of two (Triton tiles are powers of two)"),
    Skip(("decode_attention_wholepage",), lambda c, a: wholepage_family.unsupported(c),
         "outside the whole-page decode's rule (its family's unsupported() gives the exact reason)"),
    Skip(("decode_attention_flydsl_mx",), lambda c, a: c.get("head_size") == 512,
         "on gfx950 at D=512 the fp16 FlyDSL decode (decode_attention_flydsl, V through LDS) serves instead: ISA "
         "cost model 3.88-3.95 TB/s (2.82-2.85 where its pipelined build spills and falls back) vs 1.82-3.45 for "
         "the mx blob, fp16 >= mx in 32 of 36 GQA x feature configs (results/isa_cost_gfx950_d512_2026-12-03.json)"),
    Skip(("decode_attention_flydsl_mx",), lambda c, a: c.get("head_size", 128) < flydsl_family.MX_MIN_HEAD_SIZE,
         "the scaled MFMA of the mx FlyDSL decode contracts 128 head-dim elements per instruction; below 128 "
         "the fp16 FlyDSL decode (decode_attention_flydsl) serves"),
    Skip(("spec_decode_attention",), lambda c, a: multiquery_family.unsupported(c),
         "outside the multi-query decode's rule (its family's unsupported() gives the exact reason)"),
    Skip(("decode_attention_flydsl", "decode_attention_flydsl_mx"), lambda c, a: flydsl_family.unsupported(c),
         "outside the FlyDSL decode's limits (its family's unsupported() gives the exact reason)"),
)
"""Every config that is deliberately not built, with why. Nothing else may drop a config."""

def _gfx(arch: str) -> bool:
    return arch.startswith("gfx")


SPILLS_ALLOWED: tuple[SpillAllowance, ...] = (
    # Measured 2026-11-29 on the kernels of that day (Triton 3.6, no AGPR use on CDNA): these are
    # kernel debt, recorded so `make kernels` ships them and verify still catches anything worse.
    SpillAllowance(("decode_attention",), lambda c, a: _gfx(a) and c["head_size"] >= 256,
                   "CDNA decode at D>=256 exceeds 256 arch VGPRs: 0-140 B (D=256), 736-892 B (D=512) "
                   "scratch per lane measured", 1536),
    SpillAllowance(("prefill_attention",), lambda c, a: _gfx(a) and c["head_size"] >= 256,
                   "CDNA prefill at D>=256 exceeds 256 arch VGPRs: 364-684 B (D=256) / 1204-1408 B (D=512) "
                   "scratch per lane measured", 2560),
    # Found by MATRIX=cover (2026-12-02, benchmarks/NOTES.md "Build robustness"): D=512 on sm_90.
    SpillAllowance(("store_kv",), lambda c, a: a == "sm_90" and c["head_size"] >= 512,
                   "ptxas local frame of the store kernel on sm_90 at D=512: rne 440-632 B, upstream 1712-1800 B, "
                   "mse 3264 B measured", 4096),
    SpillAllowance(("decode_attention",), lambda c, a: a == "sm_90" and c["head_size"] >= 512,
                   "ptxas local frame of the split-KV decode on sm_90 at D=512: 432-456 B (GQA 1), 592-752 B "
                   "(GQA 8-16) measured", 1024),
    SpillAllowance(("store_kv",), lambda c, a: a == "sm_90",
                   "ptxas local frame of the store kernel on sm_90: 8-16 B measured", 1024),
    SpillAllowance(("decode_attention",), lambda c, a: a == "sm_90",
                   "ptxas local frame of decode on sm_90: 8 B measured", 256),
    SpillAllowance(("prefill_attention",), lambda c, a: a == "sm_90",
                   "ptxas spills of prefill on sm_90 at 255 registers: 64-256 B per thread measured", 1024),
    SpillAllowance(("decode_attention_wholepage",),
                   lambda c, a: True,
                   "the whole-page decode with 1-2 kv heads and GQA 5-16: 8-80 B measured, outside the hot loop; "
                   "the 16-row (m16) path at GQA 9-16 with 4 kv heads: 32 B, 4-5 local loads in a 3333-instruction "
                   "loop (tools/wholepage_sass.py); GQA 9-16 as two 8-row groups in N (the routed path): 0-40 B at "
                   "block 16; at 255 registers also 8 B at 1 kv head GQA 4 and 48 B at 4 kv heads GQA 5 with "
                   "sinks + window (MATRIX=cover, 2026-12-02)", 512),
    SpillAllowance(("spec_decode_attention",),
                   lambda c, a: True,
                   "the multi-query decode (16-row path at 255 registers), one M tile per program: 0-48 B measured "
                   "(48 B at 4 kv heads GQA 2); two M tiles per program (the second tile's accumulators): "
                   "392-544 B, outside the hot loop except at 1 kv head GQA 16 with sinks + window (86 local "
                   "accesses in the loop) (offline sm_90 SASS census 2026-12-02, benchmarks/NOTES.md "
                   "'Speculative-decoding steps')", 1024),
)
"""Configs whose scratch/spills/local memory are accepted, each with the measured figures and a byte
budget; every other blob must use none (the build and ``ultraquant verify`` enforce both)."""


@dataclass(frozen=True)
class MatrixPoint:
    """One config to build: the op row, the config passed to the specializer, the arch."""

    row: OpRow
    config: Config
    arch: str

    def allows_spills(self) -> tuple[str, int]:
        """(reason, byte budget) when this point may spill, ``("", 0)`` when it must not."""
        for a in SPILLS_ALLOWED:
            if self.row.op in a.ops and a.when(self.config, self.arch):
                return a.reason, a.max_bytes
        return "", 0


@dataclass(frozen=True)
class Selection:
    """The narrowed axes: the values of each axis to build (from the command line or the defaults)."""

    head_sizes: tuple[int, ...] = DEFAULT_HEAD_SIZES
    gqa: tuple[int, ...] = DEFAULT_GQA
    block_sizes: tuple[int, ...] = DEFAULT_BLOCK_SIZES
    dtypes: tuple[str, ...] = DEFAULT_DTYPES
    ops: tuple[str, ...] | None = None
    kv_heads: tuple[int, ...] = WHOLEPAGE_KV_HEADS
    """Kv-head counts of the whole-page decode blobs (its only per-count axis)."""
    attention: tuple[Config, ...] | None = None
    """Model builds (codegen/models.py): the exact attention configs to build, each ``{head_size, gqa,
    block_size, dtype, has_sinks, has_window, has_softcap}``; rows with a ``gqa`` axis build only these.
    ``None``: every combination of the axes and the row's feature sets."""
    preset: str = "custom"
    """What the selection was made from: ``popular``, ``models`` (config files), ``full`` or ``custom``."""
    models: tuple[str, ...] = ()
    tp: tuple[int, ...] = ()
    notes: tuple[str, ...] = field(default=(), compare=False)
    """What the derivation left out (a model at a TP degree vLLM cannot shard it to); not recorded."""
    cover: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] | None = None
    """``MATRIX=cover`` (:func:`cover_selection`): the exact (op, config items) pairs to build, every
    row; ``None``: no such list."""

    def values(self, axis: str) -> tuple[Any, ...]:
        return {"head_size": self.head_sizes, "gqa": self.gqa, "block_size": self.block_sizes,
                "dtype": self.dtypes, "num_kv_heads": self.kv_heads}[axis]

    def admits(self, row: OpRow, config: Config) -> bool:
        """Whether ``config`` of ``row`` is one of the selected attention configs (always, without a list)."""
        if self.cover is not None:
            return (row.op, tuple(sorted(config.items()))) in self._cover_set
        if self.attention is None or "gqa" not in row.axes:
            return True
        return attention_key(config) in {attention_key(c) for c in self.attention}

    def as_dict(self) -> dict[str, Any]:
        """JSON form recorded in the manifest."""
        out = {"head_sizes": list(self.head_sizes), "gqa": list(self.gqa),
               "block_sizes": list(self.block_sizes), "dtypes": list(self.dtypes),
               "ops": list(self.ops) if self.ops is not None else None, "preset": self.preset}
        if self.kv_heads != WHOLEPAGE_KV_HEADS:
            out["kv_heads"] = list(self.kv_heads)
        if self.attention is not None:
            out.update(models=list(self.models), tp=list(self.tp),
                       attention=[dict(sorted(c.items())) for c in self.attention])
        if self.cover is not None:
            out["cover"] = [[op, dict(items)] for op, items in self.cover]
        return out

    @functools.cached_property
    def _cover_set(self) -> frozenset:
        return frozenset(self.cover or ())


def attention_key(config: Config) -> tuple[Any, ...]:
    """The identity of an attention config across the matrix's spelling (``query_dtype``) and a model's (``dtype``)."""
    dtype = config.get("query_dtype", config.get("dtype"))
    return (config["head_size"], config["gqa"], config["block_size"], dtype, bool(config.get("has_sinks")),
            bool(config.get("has_window")), bool(config.get("has_softcap")))


def parse_int_list(text: str | None, name: str, default: tuple[int, ...]) -> tuple[int, ...]:
    """``"64,128"`` -> ``(64, 128)``; empty or None -> ``default``; bad items name ``name``."""
    if text is None or not text.strip():
        return default
    out = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            out.append(int(item))
        except ValueError:
            raise UltraQuantError(f"{name}: expected comma-separated integers, got {item!r}") from None
    return tuple(dict.fromkeys(out))


def parse_str_list(text: str | None, name: str, default: tuple[str, ...] | None) -> tuple[str, ...] | None:
    """``"a,b"`` -> ``("a", "b")``; empty or None -> ``default``."""
    if text is None or not text.strip():
        return default
    return tuple(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))


def _skip_reason(skips: Sequence[Skip], op: str, config: Config, arch: str) -> str:
    """The first matching skip's reason (a ``when`` returning a non-empty str gives its own reason)."""
    for s in skips:
        if op in s.ops:
            hit = s.when(config, arch)
            if hit:
                return hit if isinstance(hit, str) else s.reason
    return ""


def expand(rows: Sequence[OpRow], selection: Selection, arch: str, backends_for_arch: Iterable[str],
           skips: Sequence[Skip] = SKIPS) -> tuple[list[MatrixPoint], list[dict[str, Any]]]:
    """Every config of ``rows`` for ``arch`` under ``selection``: (to build, skipped with reasons).

    Rows whose backend does not target ``arch`` are left out silently (a FlyDSL row has nothing to
    do with sm_90); an unknown op in ``selection.ops`` is an error.
    """
    known = {r.op for r in rows}
    if selection.ops is not None:
        unknown = [o for o in selection.ops if o not in known]
        if unknown:
            raise UltraQuantError(f"OPS: unknown op(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    usable = set(backends_for_arch)
    points: list[MatrixPoint] = []
    skipped: list[dict[str, Any]] = []
    for row in rows:
        if selection.ops is not None and row.op not in selection.ops:
            continue
        if row.backend not in usable or (row.archs is not None and arch not in row.archs):
            continue
        for values in itertools.product(*(selection.values(a) for a in row.axes)):
            for feats in row.features:
                axes = {row.rename.get(a, a): v for a, v in zip(row.axes, values, strict=True)}
                config = {**axes, **row.flag_defaults, **feats}
                if not selection.admits(row, config):
                    continue
                if row.targeted:
                    config["target"] = "cuda" if arch.startswith("sm_") else "hip"
                reason = _skip_reason(skips, row.op, config, arch)
                if reason:
                    skipped.append({"op": row.op, "backend": row.backend, "config": config,
                                    "reason": reason})
                else:
                    points.append(MatrixPoint(row, config, arch))
    return points, skipped


# --- The covering selection (MATRIX=cover): every axis value of every kernel, in few blobs ---------
#
# CI cannot build MATRIX=full (thousands of blobs), yet a spill, a compiler error or a verify failure
# can hide in any corner of it. The cover builds, per op row, a small set of configs such that every
# value of every axis (and every feature set) is built at least once, and every value combination of
# the axes that interact in the kernels (COVER_INTERACTIONS: pairs, or a triple) is built at least
# once. It is derived from the table above (OPS, SKIPS and the axes' values), so a new axis value or
# feature set joins it.

COVER_DTYPES: tuple[str, ...] = ("bf16", "fp16")
"""Dtype values the cover builds: both the matrix accepts (``DEFAULT_DTYPES`` is bf16 only)."""

FEATURES = "features"
"""The pseudo-axis of a row's feature sets (each feature set of ``OpRow.features`` is one value);
each key of a feature set (``few_rows``, ``has_window``...) is a pseudo-axis of its own for the
interactions."""

_ATTENTION_PAIRS = (("head_size", "gqa"), ("head_size", FEATURES))
COVER_INTERACTIONS: dict[str, tuple[tuple[str, ...], ...]] = {
    # Tile shapes (ROWS, GQA_PAD, warps) and register pressure follow head size x GQA; the feature
    # code (sinks, window, soft cap) adds registers and every spill allowance is per head size.
    "decode_attention": _ATTENTION_PAIRS,
    "prefill_attention": _ATTENTION_PAIRS,
    "decode_attention_flydsl": _ATTENTION_PAIRS,
    "decode_attention_flydsl_mx": _ATTENTION_PAIRS,
    # Whole-page decode: its row split (m16 path at GQA >= 9) and its spill allowance follow GQA x kv heads.
    # Token-major pages: pair padding and token order per (D, Hk).
    "decode_attention_wholepage": (("head_size", "gqa"), ("gqa", "num_kv_heads"), ("head_size", "token_major"),
                                   ("num_kv_heads", "token_major")),
    # The multi-query decode: the whole-page ring and rows, so the same interactions.
    "spec_decode_attention": (("head_size", "gqa"), ("gqa", "num_kv_heads")),
    # Dequant: every combination (48 blobs of ~1-2 s): the D=64 spill on sm_90 needed all three of
    # head size 64, a block of >= 32 tokens and a 16-bit output.
    "dequant_kv": (("head_size", "block_size", FEATURES),),
    # The store's launch shape (LANES, the few-rows layout) and its spills follow head size; the
    # encoders are arithmetic on the same layout (each built once).
    "store_kv": (("head_size", "few_rows"),),
}
"""Per op: the axis combinations (pairs, or a triple) whose value combinations the cover builds, each
at least once."""


def cover_universe(row: OpRow, arch: str, skips: Sequence[Skip] = SKIPS) -> list[tuple[Config, dict[str, Any]]]:
    """Every buildable config of ``row`` on ``arch`` over the matrix's axis values (``DEFAULT_*``,
    :data:`COVER_DTYPES`, :data:`WHOLEPAGE_KV_HEADS`), each with its value per axis, per feature key and
    per :data:`FEATURES` (the feature set's index): what the cover must represent."""
    sel = Selection(dtypes=COVER_DTYPES)
    out = []
    for values in itertools.product(*(sel.values(a) for a in row.axes)):
        for index, feats in enumerate(row.features):
            config = {**{row.rename.get(a, a): v for a, v in zip(row.axes, values, strict=True)},
                      **row.flag_defaults, **feats}
            probe = {**config, "target": "cuda" if arch.startswith("sm_") else "hip"} if row.targeted else config
            if not _skip_reason(skips, row.op, probe, arch):
                out.append((config, {**feats, **dict(zip(row.axes, values, strict=True)), FEATURES: index}))
    return out


def cover_requirements(row: OpRow, axis_values: Iterable[dict[str, Any]]) -> set[tuple[Any, ...]]:
    """What a set of configs (their axis values) represents: each ``((axis, value),)`` and each value
    combination ``((axis, value), ...)`` of the row's :data:`COVER_INTERACTIONS`."""
    reqs: set[tuple[Any, ...]] = set()
    combos = COVER_INTERACTIONS.get(row.op, ())
    for v in axis_values:
        reqs.update(((a, v[a]),) for a in (*row.axes, FEATURES))
        reqs.update(tuple((a, v[a]) for a in c) for c in combos if all(a in v for a in c))
    return reqs


def cover_configs(row: OpRow, archs: Iterable[str], skips: Sequence[Skip] = SKIPS) -> list[Config]:
    """A small set of ``row``'s configs meeting every requirement of its universe on each arch
    (greedy set cover: each step takes the first config that meets the most unmet requirements)."""
    chosen: list[Config] = []
    for arch in archs:
        universe = cover_universe(row, arch, skips)
        have = cover_requirements(row, [v for c, v in universe if c in chosen])
        todo = cover_requirements(row, [v for _, v in universe]) - have
        while todo:
            gains = [len(cover_requirements(row, [v]) & todo) for _, v in universe]
            best = max(range(len(universe)), key=lambda i: (gains[i], -i))
            chosen.append(universe[best][0])
            todo -= cover_requirements(row, [universe[best][1]])
    return chosen


def cover_selection(rows: Sequence[OpRow] = OPS, ops: tuple[str, ...] | None = None,
                    skips: Sequence[Skip] = SKIPS) -> Selection:
    """``MATRIX=cover``: the union over arches of each row's :func:`cover_configs`, as a Selection."""
    from .archs import ARCHS

    cover = []
    for row in rows:
        if ops is not None and row.op not in ops:
            continue
        archs = [a for a in ARCHS if row.archs is None or a in row.archs]
        cover += [(row.op, tuple(sorted(c.items()))) for c in cover_configs(row, archs, skips)]
    return Selection(dtypes=COVER_DTYPES, ops=ops, preset="cover", cover=tuple(cover))

