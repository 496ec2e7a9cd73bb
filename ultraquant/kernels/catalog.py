"""The one table of kernel families: op name, kernel name, source, family module, alignable strides.

Every other list of kernels derives from :data:`FAMILIES`: the Triton registry (``registry.KERNELS``),
the interpreter's modules, codegen's specializers (:func:`specializer`), the runtime's divisibility
hint. A family module (``kernels/families/<name>.py``) holds the family's parameter list, spec
function, coverage rule and launch plan; its source lives under ``kernels/triton``, ``kernels/gluon``
or ``kernels/flydsl``. References are strings resolved on use, so this module imports nothing (the
family modules import it for their ``alignable`` tuple) and never imports Triton.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_DENSE_QO = ("stride_qb", "stride_qh", "stride_ob", "stride_oh")
_DENSE_KV = ("stride_kn", "stride_kh", "stride_vn", "stride_vh")


@dataclass(frozen=True)
class Family:
    """One kernel family.

    ``source``: ``module:function`` of the kernel under ``ultraquant.kernels`` (Triton/Gluon sources
    are imported by the JIT path and codegen only; ``None``: a FlyDSL source compiled by its codegen
    backend). ``family``: the module under ``ultraquant.kernels.families`` with ``spec`` (the function
    config -> Specialization). ``alignable``: in signature order, the row strides of its dense tensors
    (query, key, value, output), which blobs assume are multiples of ``ARG_DIVISOR`` (true for rows of
    D >= 32 elements, fused QKV slices included), so Triton vectorizes those rows as its JIT does; a
    call whose strides are not gets a key without them. ``stands_in_for``: the kernel whose LaunchPlan
    this one also runs (the FlyDSL decodes serve split-KV decode plans)."""

    op: str
    kernel: str
    source: str | None
    family: str
    spec: str
    alignable: tuple[str, ...]
    stands_in_for: str | None = None


FAMILIES: tuple[Family, ...] = (
    Family("store_kv", "uq_store_kv", "triton.store:uq_store_kv", "store", "store_spec", _DENSE_KV),
    Family("dequant_kv", "uq_dequant_kv", "triton.dequant:uq_dequant_kv", "dequant", "dequant_spec", _DENSE_KV),
    Family("decode_attention", "uq_decode_splitkv", "triton.attention:uq_decode_splitkv", "decode_splitkv",
           "decode_splitkv_spec", _DENSE_QO),
    Family("decode_attention_wholepage", "uq_decode_wholepage", "gluon.decode_wholepage:uq_decode_wholepage",
           "decode_wholepage", "decode_wholepage_spec", _DENSE_QO),
    Family("spec_decode_attention", "uq_decode_multiquery", "gluon.decode_multiquery:uq_decode_multiquery",
           "decode_multiquery", "decode_multiquery_spec", ("stride_qn", "stride_qh", "stride_on", "stride_oh")),
    Family("prefill_attention", "uq_prefill", "triton.attention:uq_prefill", "prefill", "prefill_spec",
           ("stride_qn", "stride_qh", "stride_kn", "stride_kh", "stride_vn", "stride_vh", "stride_on", "stride_oh")),
    Family("decode_attention_flydsl", "uq_decode_flydsl", None, "decode_flydsl", "decode_flydsl_spec", _DENSE_QO,
           stands_in_for="uq_decode_splitkv"),
    Family("decode_attention_flydsl_mx", "uq_decode_flydsl_mx", None, "decode_flydsl", "decode_flydsl_mx_spec",
           _DENSE_QO, stands_in_for="uq_decode_splitkv"),
)

BY_KERNEL: dict[str, Family] = {f.kernel: f for f in FAMILIES}
BY_OP: dict[str, Family] = {f.op: f for f in FAMILIES}
OPS: tuple[str, ...] = tuple(BY_OP)
"""Every op codegen can build, in table order."""


def alignable(kernel: str) -> tuple[str, ...]:
    """The alignable row strides of ``kernel`` (``()`` for a name outside the table)."""
    fam = BY_KERNEL.get(kernel)
    return fam.alignable if fam else ()


def family_module(op: str) -> Any:
    """The family module of ``op`` (imports no Triton)."""
    return importlib.import_module(f"ultraquant.kernels.families.{BY_OP[op].family}")


def specializer(op: str) -> Callable[..., Any]:
    """``op``'s spec function (``**config -> Specialization``)."""
    return getattr(family_module(op), BY_OP[op].spec)


def source_modules() -> tuple[str, ...]:
    """Every Triton/Gluon source module under ``ultraquant.kernels``, in table order, once each."""
    mods: list[str] = []
    for f in FAMILIES:
        if f.source and f.source.split(":")[0] not in mods:
            mods.append(f.source.split(":")[0])
    return tuple(mods)


def source_function(kernel: str) -> Any:
    """The Triton/Gluon function of ``kernel`` (imports its source module, hence Triton)."""
    mod, name = BY_KERNEL[kernel].source.split(":")
    return getattr(importlib.import_module(f"ultraquant.kernels.{mod}"), name)
