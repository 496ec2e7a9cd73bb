"""The base of every kernel family: a compiled variant (:class:`Specialization`), one launch of it
(:class:`LaunchPlan`), and the small facts every family's spec and plan share (Triton type names,
argument divisibility, slot alignment, the code-generation target).

Nothing here imports Triton or a family: the AOT runtime plans launches on machines without Triton,
and every family module (``kernels/families/``) builds on this one, never the other way round.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..format import slot_size


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
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.uint8: "u8",
}
"""Triton's type name of each tensor dtype the kernels take."""


@dataclass(frozen=True)
class LaunchPlan:
    """One launch of one specialization: its run-time arguments (signature order) and grid."""

    spec: Specialization
    args: tuple[Any, ...]
    grid: tuple[int, int, int]
    notes: dict[str, Any] = field(default_factory=dict)


def pow2_at_least(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for n <= 1)."""
    return 1 << max(0, (n - 1).bit_length())


def type_name(dtype: torch.dtype | str) -> str:
    """Triton's type name of a tensor dtype (a name passes through)."""
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


def signature_of(params: tuple[tuple[str, str], ...], **types: str) -> dict[str, str]:
    """A kernel's signature from its parameter list, its ``{query}``-style dtype slots filled in."""
    return {name: ty.format(**types) for name, ty in params}


def fit_divisible(spec: Specialization, args: Sequence[Any], alignable: tuple[str, ...]) -> Specialization:
    """``spec`` with ``divisible`` = those of its family's ``alignable`` parameters (the row strides of
    its dense tensors, :attr:`~ultraquant.kernels.catalog.Family.alignable`) whose value in ``args``
    (the launch's arguments in signature order) is a multiple of :data:`ARG_DIVISOR`."""
    names = _positions(spec.kernel, tuple(spec.signature), alignable)
    div = tuple(n for n, i in names if args[i] % ARG_DIVISOR == 0)
    return spec if div == spec.divisible else replace(spec, divisible=div)


_POSITIONS: dict[tuple[str, tuple[str, ...]], tuple[tuple[str, int], ...]] = {}


def _positions(kernel: str, params: tuple[str, ...], alignable: tuple[str, ...]) -> tuple[tuple[str, int], ...]:
    """(name, argument index) of ``kernel``'s alignable parameters (cached: the launch path)."""
    got = _POSITIONS.get((kernel, params))
    if got is None:
        got = _POSITIONS[(kernel, params)] = tuple((n, params.index(n)) for n in params if n in alignable)
    return got
