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
from dataclasses import dataclass
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

    def key(self) -> str:
        """Canonical config string, identical in codegen, manifest and runtime: the kernel, its
        constexprs and the element types of its pointer parameters in order (a bf16 and an fp16 build of
        one config are two blobs; scalar parameters never vary)."""
        parts = ",".join(f"{k}={self.constexprs[k]}" for k in sorted(self.constexprs))
        types = ",".join(t.lstrip("*") for t in self.signature.values() if t.startswith("*"))
        return f"{self.kernel}[{parts}]({types})"


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


def _signature(params: tuple[tuple[str, str], ...], **types: str) -> dict[str, str]:
    return {name: ty.format(**types) for name, ty in params}


def store_spec(*, head_size: int, key_dtype: torch.dtype | str = "bf16",
               value_dtype: torch.dtype | str | None = None, slot_dtype: torch.dtype | str = "i64",
               encoder: str = "rne", few_rows: bool = False, **_: Any) -> Specialization:
    """The store kernel for one head size, input dtypes, slot_mapping dtype and encoder; ``few_rows``
    for calls with too few (token, kv head) rows to fill the GPU at one row per thread."""
    d = check_head_size(head_size)
    # One row per thread keeps the butterfly, absmax and packing in registers; fewer rows where a whole
    # row per thread would spill; few_rows (a decode step's store) spreads a row over 8 threads so small
    # stores fill the GPU. Measurements: benchmarks/NOTES.md, "Store v2".
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
        num_warps=warps, num_stages=stages, maxnreg=maxnreg)


def prefill_spec(*, head_size: int, gqa: int, block_size: int, query_dtype: torch.dtype | str = "bf16",
                 key_dtype: torch.dtype | str | None = None, out_dtype: torch.dtype | str | None = None,
                 has_sinks: bool = False, has_window: bool = False, has_softcap: bool = False,
                 align: int | None = None, target: str = "portable", **_: Any) -> Specialization:
    """The chunked-prefill kernel (cached prefix + causal chunk) for one config (``target``: see
    :func:`decode_spec`)."""
    d = check_head_size(head_size)
    gpad = pow2_at_least(int(gqa))
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



