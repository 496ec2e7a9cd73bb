"""Kernel specializations: each kernel's parameter list and the constexprs a config compiles to.

A :class:`Specialization` is one compiled variant of one kernel and the manifest key of its blob.
The ``*_spec`` functions turn a keyword config (head size, GQA, block size, dtypes, features) into
one; the run-time plans (:mod:`.plans`) and codegen (``codegen/matrix.py`` enumerates
:data:`SPECIALIZERS`) call the same functions, so the JIT path, the blobs and the runtime cannot
disagree about a config. Tuning values arrive only as explicit arguments. No Triton import here: the
AOT runtime plans launches on machines without Triton.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..format import check_head_size, slot_size


@dataclass(frozen=True)
class Specialization:
    """One compiled variant of one kernel: the AOT unit and the manifest key.

    ``signature`` maps every non-constexpr parameter of the Triton function, in order, to Triton's
    type string (``"*u8"``, ``"*bf16"``, ``"i32"``, ``"i64"``, ``"fp32"``...); ``constexprs`` holds
    the compile-time values (head size, GQA, block size, feature flags...).
    """

    kernel: str
    signature: dict[str, str]
    constexprs: dict[str, Any]
    num_warps: int = 4
    num_stages: int = 2
    maxnreg: int | None = None
    """Register cap per thread (Triton's NVIDIA ``maxnreg`` option; ignored on AMD); None: ptxas decides."""
    divisible: tuple[str, ...] = ()
    """Integer parameters whose values are multiples of :data:`ARG_DIVISOR` (signature order): the blob
    is compiled with ``tt.divisibility`` on them, as Triton's JIT specializes such values."""

    def __post_init__(self) -> None:
        if not isinstance(self.divisible, tuple):  # a spec rebuilt from JSON carries a list
            object.__setattr__(self, "divisible", tuple(self.divisible))

    def key(self) -> str:
        """Canonical config string, identical in codegen, manifest and runtime: the kernel, its
        constexprs, the element types of its pointer parameters in order (a bf16 and an fp16 build of
        one config are two blobs) and the integer parameters it assumes divisible (``|div16=...``)."""
        parts = ",".join(f"{k}={self.constexprs[k]}" for k in sorted(self.constexprs))
        types = ",".join(t.lstrip("*") for t in self.signature.values() if t.startswith("*"))
        div = f"|div{ARG_DIVISOR}={','.join(self.divisible)}" if self.divisible else ""
        return f"{self.kernel}[{parts}]({types}){div}"

    def runnable_as(self, kernel: str | None = None) -> tuple[Specialization, ...]:
        """The specs whose blobs may run this call, best first: itself (renamed to ``kernel``, a
        stand-in of the same LaunchPlan), then the same without ``divisible`` (a blob that assumes less
        is correct for any values: manifests built before the assumption entered the key)."""
        own = self if kernel is None or kernel == self.kernel else replace(self, kernel=kernel)
        return (own, replace(own, divisible=())) if own.divisible else (own,)


ARG_DIVISOR = 16
"""The divisibility Triton's JIT specializes integer (and pointer) arguments on (``tt.divisibility``)."""


DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
    torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8",
}
"""Triton's type name of each tensor dtype the kernels take."""

ENCODER_IDS: dict[str, int] = {"rne": 0, "upstream": 1, "mse": 2}
"""Constexpr ``ENCODER`` of each encoder name."""

STORE_PARAMS: tuple[tuple[str, str], ...] = (
    ("key_ptr", "*{key}"), ("value_ptr", "*{value}"), ("cache_ptr", "*u8"), ("slot_ptr", "*{slot}"),
    ("err_ptr", "*i32"),
    ("n_rows", "i32"), ("num_kv_heads", "i32"), ("block_size", "i32"), ("num_slots", "i64"),
    ("stride_kn", "i32"), ("stride_kh", "i32"), ("stride_vn", "i32"), ("stride_vh", "i32"),
    ("stride_cb", "i32"), ("stride_ct", "i32"), ("stride_ch", "i32"),
)
DEQUANT_PARAMS: tuple[tuple[str, str], ...] = (
    ("cache_ptr", "*u8"), ("bt_ptr", "*i32"), ("seqlen_ptr", "*i32"), ("cu_ptr", "*i32"),
    ("k_out_ptr", "*{out}"), ("v_out_ptr", "*{out}"), ("err_ptr", "*i32"),
    ("num_blocks", "i32"), ("bt_cols", "i32"), ("out_rows", "i32"),
    ("stride_cb", "i32"), ("stride_ct", "i32"), ("stride_ch", "i32"), ("stride_btb", "i32"),
    ("stride_kn", "i32"), ("stride_kh", "i32"), ("stride_vn", "i32"), ("stride_vh", "i32"),
)
DECODE_PARAMS: tuple[tuple[str, str], ...] = (
    ("q_ptr", "*{query}"), ("cache_ptr", "*u8"), ("bt_ptr", "*i32"), ("seqlen_ptr", "*i32"),
    ("sinks_ptr", "*fp32"), ("out_ptr", "*{out}"), ("part_ptr", "*fp32"), ("ml_ptr", "*fp32"),
    ("counter_ptr", "*i32"), ("err_ptr", "*i32"),
    ("scale", "fp32"), ("softcap", "fp32"), ("window", "i32"), ("num_splits", "i32"),
    ("num_blocks", "i32"), ("bt_cols", "i32"),
    ("stride_qb", "i32"), ("stride_qh", "i32"), ("stride_ob", "i32"), ("stride_oh", "i32"),
    ("stride_cb", "i32"), ("stride_ct", "i32"), ("stride_ch", "i32"), ("stride_btb", "i32"),
)


def decode_args(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                sinks: torch.Tensor, out: torch.Tensor, workspace: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                err: torch.Tensor, scale: float, softcap: float | None, window: int | None,
                splits: int) -> tuple[Any, ...]:
    """The run-time arguments of every decode kernel (v7, v8, the FlyDSL decodes), in DECODE_PARAMS order."""
    return (query, kv_cache, block_table, seq_lens, sinks, out, *workspace, err,
            float(scale), float(softcap or 0.0), int(window or 0), splits,
            kv_cache.shape[0], block_table.shape[1],
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), block_table.stride(0))


PREFILL_PARAMS: tuple[tuple[str, str], ...] = (
    ("q_ptr", "*{query}"), ("k_ptr", "*{key}"), ("v_ptr", "*{key}"), ("cache_ptr", "*u8"),
    ("bt_ptr", "*i32"), ("seqlen_ptr", "*i32"), ("qsl_ptr", "*i32"), ("sinks_ptr", "*fp32"),
    ("out_ptr", "*{out}"), ("part_ptr", "*fp32"), ("ml_ptr", "*fp32"), ("counter_ptr", "*i32"),
    ("err_ptr", "*i32"),
    ("scale", "fp32"), ("softcap", "fp32"), ("window", "i32"), ("num_reqs", "i32"), ("num_splits", "i32"),
    ("num_blocks", "i32"), ("bt_cols", "i32"),
    ("stride_qn", "i32"), ("stride_qh", "i32"), ("stride_kn", "i32"), ("stride_kh", "i32"),
    ("stride_vn", "i32"), ("stride_vh", "i32"), ("stride_on", "i32"), ("stride_oh", "i32"),
    ("stride_cb", "i32"), ("stride_ct", "i32"), ("stride_ch", "i32"), ("stride_btb", "i32"),
)
"""Every kernel receives the cache's size (the store ``num_slots`` = blocks x block size, i64; the
readers ``num_blocks``) and, where it reads a block table, the table's row length (``bt_cols``), plus
``err_ptr``, the per-device error words (:mod:`.flags`): the bounds contract of docs/kernels.md,
"Bounds". A new kernel follows it."""


def pow2_at_least(n: int) -> int:
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


ALIGNABLE: dict[str, tuple[str, ...]] = {
    "uq_store_kv": ("stride_kn", "stride_kh", "stride_vn", "stride_vh"),
    "uq_dequant_kv": ("stride_kn", "stride_kh", "stride_vn", "stride_vh"),
    "uq_decode": ("stride_qb", "stride_qh", "stride_ob", "stride_oh"),
    "uq_decode_v8": ("stride_qb", "stride_qh", "stride_ob", "stride_oh"),
    "uq_prefill": ("stride_qn", "stride_qh", "stride_kn", "stride_kh", "stride_vn", "stride_vh",
                   "stride_on", "stride_oh"),
}
"""Per kernel, in signature order, the row strides of its dense tensors (query, key, value, output).
The ``*_spec`` functions (hence the blobs) assume each is a multiple of :data:`ARG_DIVISOR` (true for
rows of D >= 32 elements, fused QKV slices included), so Triton vectorizes those rows' loads and
stores as its JIT does; a call whose strides are not gets a key without them (:func:`fit_divisible`).
Cache strides are covered by the ``ALIGN`` constexpr (benchmarks/NOTES.md, "AOT vs JIT")."""


def fit_divisible(spec: Specialization, args: Sequence[Any]) -> Specialization:
    """``spec`` with ``divisible`` = its :data:`ALIGNABLE` parameters whose value in ``args`` (the
    launch's arguments in signature order) is a multiple of :data:`ARG_DIVISOR`."""
    names = _positions(spec.kernel, tuple(spec.signature))
    div = tuple(n for n, i in names if args[i] % ARG_DIVISOR == 0)
    return spec if div == spec.divisible else replace(spec, divisible=div)


_POSITIONS: dict[tuple[str, tuple[str, ...]], tuple[tuple[str, int], ...]] = {}


def _positions(kernel: str, params: tuple[str, ...]) -> tuple[tuple[str, int], ...]:
    """(name, argument index) of ``kernel``'s :data:`ALIGNABLE` parameters (cached: the launch path)."""
    got = _POSITIONS.get((kernel, params))
    if got is None:
        got = _POSITIONS[(kernel, params)] = tuple((n, params.index(n)) for n in params
                                                   if n in ALIGNABLE.get(kernel, ()))
    return got


def _signature(params: tuple[tuple[str, str], ...], **types: str) -> dict[str, str]:
    return {name: ty.format(**types) for name, ty in params}


def store_spec(*, head_size: int, key_dtype: torch.dtype | str = "bf16",
               value_dtype: torch.dtype | str | None = None, slot_dtype: torch.dtype | str = "i64",
               encoder: str = "rne", few_rows: bool = False, align: int | None = None,
               target: str = "portable", **_: Any) -> Specialization:
    """The store kernel for one head size, input dtypes, slot_mapping dtype and encoder; ``few_rows``
    for calls with too few (token, kv head) rows to fill the GPU at one row per thread; ``align``
    (constexpr ``ALIGN``) the bytes every slot address is a multiple of (default: the dense layout's,
    :func:`slot_alignment`; the plan passes the call's, cache base included); ``target`` (see
    :func:`target_of`) the launch shape: on NVIDIA rows over 4 lanes (``LANES``) from D=128 on."""
    d = check_head_size(head_size)
    # On NVIDIA from D=128 on: each row spread over 4 lanes (LANES=4: its 32-element runs over 4 lanes,
    # 8 elements per lane and load), 32 rows of 4 warps per program (8 rows of 1 warp for few rows):
    # loads and stores that cover whole sectors, at ~1.4x the instructions of one row per thread. One row per thread
    # (below) made every load and store instruction touch 32 lines, and that pattern alone took the
    # 63 us the store took (benchmarks/NOTES.md, "Store v4"). Elsewhere one row per thread keeps the
    # butterfly, absmax and packing in registers: on NVIDIA at D=64 one warp of 32 rows per program
    # (WHOLE_ROWS: the slot words shifted in registers); 128 rows of 4 warps on AMD/CPU (a 64-lane
    # wave splits rows over 2 lanes); fewer rows where a whole row per thread would spill; few_rows
    # (a decode step's store) spreads a row over 8 threads so small stores fill the GPU.
    lanes = 4 if target == "cuda" and d >= 128 else 0
    row_per_thread = d <= 64 or (d == 128 and encoder != "mse")
    whole = target == "cuda" and row_per_thread and not few_rows and not lanes
    if lanes:
        block_r = 8 if few_rows else 32
    elif few_rows:
        block_r = 16 if d <= 128 else 4
    elif row_per_thread:
        block_r = 32 if whole else 128
    else:
        block_r = 32 if d == 128 else 8
    return Specialization(
        kernel="uq_store_kv",
        signature=_signature(STORE_PARAMS, key=_tname(key_dtype), value=_tname(value_dtype or key_dtype),
                             slot=_tname(slot_dtype)),
        constexprs={"D": d, "LOG2D": d.bit_length() - 1, "ENCODER": ENCODER_IDS[encoder], "BLOCK_R": block_r,
                    "ALIGN": int(align or slot_alignment(d)), "WHOLE_ROWS": whole, "LANES": lanes},
        num_warps=1 if whole or (lanes and few_rows) else 4, num_stages=1,
        maxnreg=144 if whole and d == 128 and encoder == "rne" else None,
        divisible=ALIGNABLE["uq_store_kv"])


def dequant_spec(*, head_size: int, block_size: int, out_dtype: torch.dtype | str = "bf16",
                 original_space: bool = True, **_: Any) -> Specialization:
    """The dequant kernel: cache -> packed K (original or rotated space) and V of ``out_dtype``."""
    d = check_head_size(head_size)
    return Specialization(
        kernel="uq_dequant_kv",
        signature=_signature(DEQUANT_PARAMS, out=_tname(out_dtype)),
        constexprs={"D": d, "LOG2D": d.bit_length() - 1, "BLOCK_SIZE": int(block_size),
                    "TILE": 32 if d <= 256 else 16, "ORIGINAL_SPACE": bool(original_space)},
        num_warps=4, num_stages=1, divisible=ALIGNABLE["uq_dequant_kv"])


def decode_spec(*, head_size: int, gqa: int, block_size: int, query_dtype: torch.dtype | str = "bf16",
                out_dtype: torch.dtype | str | None = None, has_sinks: bool = False,
                has_window: bool = False, has_softcap: bool = False, align: int | None = None,
                target: str = "portable", tile: int | None = None, warps: int | None = None,
                stages: int | None = None, maxnreg: int | None = None, **_: Any) -> Specialization:
    """The split-KV decode kernel for one head size, GQA group, block size and feature set.

    ``target`` ``"cuda"`` selects the inline-PTX FP4 decode (constexpr ``FP4_PTX``); anything else
    (``"hip"``, ``"portable"``: AMD, the CPU interpreter) the plain-Triton one. See :func:`target_of`.
    ``tile``/``warps``/``stages``/``maxnreg`` override the tuned defaults (sweeps only).
    """
    d = check_head_size(head_size)
    # Defaults from the H200 sweeps (benchmarks/NOTES.md, "Decode v7").
    tile = tile or (64 if d <= 256 else 32)
    warps = warps or (4 if d <= 128 else 8)
    stages = stages or 2
    return Specialization(
        kernel="uq_decode",
        signature=_signature(DECODE_PARAMS, query=_tname(query_dtype), out=_tname(out_dtype or query_dtype)),
        constexprs={"D": d, "LOG2D": d.bit_length() - 1, "GQA": int(gqa),
                    "ROWS": max(16, pow2_at_least(int(gqa))), "BLOCK_SIZE": int(block_size),
                    "TILE": tile, "HAS_SINKS": bool(has_sinks), "HAS_WINDOW": bool(has_window),
                    "HAS_SOFTCAP": bool(has_softcap), "ALIGN": int(align or slot_alignment(d)),
                    "FP4_PTX": target == "cuda", "V_IN_LOAD_LAYOUT": d >= 256},
        num_warps=warps, num_stages=stages, maxnreg=maxnreg, divisible=ALIGNABLE["uq_decode"])


def prefill_spec(*, head_size: int, gqa: int, block_size: int, query_dtype: torch.dtype | str = "bf16",
                 key_dtype: torch.dtype | str | None = None, out_dtype: torch.dtype | str | None = None,
                 has_sinks: bool = False, has_window: bool = False, has_softcap: bool = False,
                 align: int | None = None, target: str = "portable", **_: Any) -> Specialization:
    """The chunked-prefill kernel (cached prefix + causal chunk) for one config (``target``: see
    :func:`decode_spec`)."""
    d = check_head_size(head_size)
    gpad = pow2_at_least(int(gqa))
    # AMD: at most 32 rows at D <= 128. Triton 3.6's AMD lowering (ConvertBuiltinFuncToLLVM, whose
    # aggressive block merging upstream later turned off) spends > 10 minutes per config on the
    # 64-row tile's IR and ~1 s on 32 rows (benchmarks/NOTES.md, "Build robustness").
    wide = 32 if target == "hip" else 64
    rows = max(16, gpad, wide if d <= 128 else (32 if d <= 256 else 16))
    return Specialization(
        kernel="uq_prefill",
        signature=_signature(PREFILL_PARAMS, query=_tname(query_dtype), key=_tname(key_dtype or query_dtype),
                             out=_tname(out_dtype or query_dtype)),
        constexprs={"D": d, "LOG2D": d.bit_length() - 1, "GQA": int(gqa), "GQA_PAD": gpad, "ROWS": rows,
                    "BLOCK_SIZE": int(block_size), "TILE": 32, "HAS_SINKS": bool(has_sinks),
                    "HAS_WINDOW": bool(has_window), "HAS_SOFTCAP": bool(has_softcap),
                    "ALIGN": int(align or slot_alignment(d)), "FP4_PTX": target == "cuda",
                    "V_IN_LOAD_LAYOUT": d >= 256},
        num_warps=4 if d <= 128 else 8, num_stages=2, divisible=ALIGNABLE["uq_prefill"])


def decode_v8_spec(**config: Any) -> Specialization:
    """The Gluon decode v8 (:func:`ultraquant.kernels.decode_v8_plan.decode_v8_spec`; imported on use:
    that module builds on the plans, which build on this one)."""
    from .decode_v8_plan import decode_v8_spec as spec

    return spec(**config)


SPECIALIZERS = {
    "store_kv": store_spec,
    "dequant_kv": dequant_spec,
    "decode_attention": decode_spec,
    "decode_attention_v8": decode_v8_spec,
    "prefill_attention": prefill_spec,
}
"""Op name -> function(**config) -> Specialization (what codegen enumerates)."""



