"""The FlyDSL decode family (AMD CDNA: ``kernels/flydsl/decode.py``, compiled by ``codegen/flydsl``).

Its blobs stand in for the split-KV decode: same parameter list (:data:`.decode_splitkv.DECODE_PARAMS`:
pointers, then fp32/i32 scalars, no hidden parameters), same constexprs, same grid ``(B, Hk,
num_splits)`` and workspace/ticket protocol, so the runtime launches them with the very LaunchPlan it
builds for ``uq_decode_splitkv``; the key differs only in the kernel name. ``uq_decode_flydsl_mx``
(gfx950 only) takes QK through the scaled FP4 x FP8 MFMA and V through the FP4 -> bf16 conversion
instruction. This module holds the family's limits (:func:`unsupported`), its waves per workgroup and
its specs; no FlyDSL import.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ...errors import UltraQuantError
from ..specialization import Specialization
from .decode_splitkv import decode_splitkv_spec

KERNEL = "uq_decode_flydsl"
KERNEL_MX = "uq_decode_flydsl_mx"
HEAD_SIZES = (64, 128, 256, 512)
"""Head sizes of the fp16 path (the mx path needs >= 128: :data:`MX_MIN_HEAD_SIZE`)."""
MX_MIN_HEAD_SIZE = 128
"""The scaled MFMA of :data:`KERNEL_MX` contracts 128 head-dim elements per instruction."""
MAX_GQA = 16
"""Query heads per kv head: one 16-column MFMA tile."""
DTYPES = ("bf16", "fp16")

WAVES_BY_HEAD_SIZE = {64: 4, 128: 4, 256: 4, 512: 1}
"""Preferred waves per workgroup: they share a split's tiles round robin and fold their states through
LDS, so the split-KV plan's grid (programs of 4 warps) yields as many waves with either blob. D=512
keeps one: its 128-float accumulator leaves no registers for the fold (and registers allow only one
wave per SIMD anyway). A preferred count whose blob would spill falls back to one wave (none of the
D=128/256 blobs built since the loop's scheduling fences do; before them 5 of the 6 gfx950 D=128
GQA-8 configs did); the manifest's ``launch`` threads record what was built."""


def waves_for(head_size: int) -> int:
    """Preferred waves per workgroup of the blob for ``head_size``."""
    return WAVES_BY_HEAD_SIZE.get(head_size, 1)


def unsupported(config: dict[str, Any]) -> str:
    """Why the FlyDSL decode does not serve ``config`` (matrix keys), or ``""``: its coverage rule."""
    d, g, bs = config.get("head_size"), config.get("gqa", 1), config.get("block_size", 16)
    dtype = config.get("query_dtype", config.get("dtype", "bf16"))
    if d not in HEAD_SIZES:
        return f"FlyDSL decode is built for head sizes {HEAD_SIZES}"
    if not 1 <= g <= MAX_GQA:
        return f"FlyDSL decode serves 1..{MAX_GQA} query heads per kv head (one 16-column MFMA tile)"
    if bs < 16 or bs % 16:
        return "FlyDSL decode tiles are 16 tokens inside one page: block size must be a multiple of 16"
    if str(dtype) not in DTYPES:
        return f"FlyDSL decode reads bf16/fp16 queries, not {dtype}"
    return ""


def decode_flydsl_spec(*, kernel: str = KERNEL, **config: Any) -> Specialization:
    """The FlyDSL decode Specialization for one matrix config (the split-KV spec, renamed)."""
    why = unsupported(config)
    if why:
        raise UltraQuantError(f"config {config}: {why}")
    base = decode_splitkv_spec(**config)
    return replace(base, kernel=kernel, num_warps=waves_for(int(config["head_size"])), num_stages=1, maxnreg=None)


def decode_flydsl_mx_spec(**config: Any) -> Specialization:
    """The gfx950 scaled-MFMA variant (:data:`KERNEL_MX`) of :func:`decode_flydsl_spec`."""
    if config.get("head_size", MX_MIN_HEAD_SIZE) < MX_MIN_HEAD_SIZE:
        raise UltraQuantError(f"config {config}: the mx FlyDSL decode needs head_size >= {MX_MIN_HEAD_SIZE} "
                              "(128 K per scaled MFMA)")
    return decode_flydsl_spec(kernel=KERNEL_MX, **config)


def flydsl_key(splitkv_spec: Specialization, kernel: str = KERNEL) -> str:
    """Manifest key of the FlyDSL blob (``kernel``: KERNEL or KERNEL_MX) that can replace the split-KV
    decode ``splitkv_spec`` (same LaunchPlan)."""
    return splitkv_spec.runnable_as(kernel)[0].key()
