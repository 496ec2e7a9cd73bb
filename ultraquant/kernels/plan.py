"""What a kernel launch needs, described without importing Triton.

A *plan* function (one per op, in ``ultraquant.kernels.plans``) turns the arguments of a public op
into a :class:`LaunchPlan`. The Triton JIT path runs it as ``fn[plan.grid](*plan.args,
**plan.constexprs, num_warps=..., num_stages=...)``; the AOT runtime looks up the blob whose manifest
entry has the same ``(arch, kernel, constexprs)`` and launches it with the same ``args`` and ``grid``.
Codegen builds the blobs from :class:`Specialization` rows, whose constexprs come from the same
function the plans use, so the two paths cannot disagree about a config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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


@dataclass(frozen=True)
class LaunchPlan:
    """One launch of one specialization: its run-time arguments and grid."""

    spec: Specialization
    args: tuple[Any, ...]
    grid: tuple[int, int, int]
    notes: dict[str, Any] = field(default_factory=dict)
