"""Fixture specializers (the shape of ultraquant.kernels.catalog, without importing Triton)."""

from __future__ import annotations

from ultraquant.codegen.matrix import OpRow
from ultraquant.kernels.specialization import Specialization

AXPY_SIG = {"x_ptr": "*fp32", "y_ptr": "*bf16", "out_ptr": "*fp32", "a": "fp32", "n": "i32",
            "stride": "i64"}


def axpy(*, head_size: int, block_size: int, dtype: str = "bf16") -> Specialization:
    """y = a*x + y over BLOCK-sized tiles (the constexprs mimic the real kernels')."""
    return Specialization("fx_axpy", dict(AXPY_SIG), {"BLOCK": block_size, "D": head_size}, num_warps=2)


def broken(*, head_size: int) -> Specialization:
    """A kernel whose source fails to compile (undefined name)."""
    return Specialization("fx_broken", {"x_ptr": "*fp32"}, {"D": head_size}, num_warps=1)


def noisy(*, head_size: int) -> Specialization:
    """Compiles, but prints ``error:`` while compiling (as FlyDSL/LLVM sometimes do)."""
    return Specialization("fx_noisy", {"x_ptr": "*fp32"}, {"D": head_size}, num_warps=1)


def abort(*, head_size: int) -> Specialization:
    """Kills its compile worker (as an LLVM assertion does)."""
    return Specialization("fx_abort", {"x_ptr": "*fp32"}, {"D": head_size}, num_warps=1)


def dup(*, head_size: int, block_size: int) -> Specialization:
    """Ignores block_size: two configs give one key (the build must refuse)."""
    return Specialization("fx_axpy", dict(AXPY_SIG), {"BLOCK": 64, "D": head_size}, num_warps=2)


SPECIALIZERS = {"axpy": axpy, "broken": broken, "noisy": noisy, "abort": abort, "dup": dup}


def specializer(op: str):
    """The contract of ``ultraquant.kernels.catalog.specializer``: op -> spec function (KeyError if none)."""
    return SPECIALIZERS[op]

ROWS = (OpRow("axpy", ("head_size", "block_size"), grid="(cdiv(n, BLOCK), 1, 1)"),)
BAD_ROWS = {name: (OpRow(name, ("head_size",)),) for name in ("broken", "noisy", "abort")}
DUP_ROWS = (OpRow("dup", ("head_size", "block_size")),)
