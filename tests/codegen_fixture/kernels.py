"""Fixture Triton kernels and their registry (name -> JITFunction)."""

from __future__ import annotations

import os

import triton
import triton.language as tl


@triton.jit
def fx_axpy(x_ptr, y_ptr, out_ptr, a, n, stride, BLOCK: tl.constexpr, D: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs * stride, mask=m)
    y = tl.load(y_ptr + offs, mask=m).to(tl.float32)
    tl.store(out_ptr + offs, a * x + y + D, mask=m)


@triton.jit
def fx_broken(x_ptr, D: tl.constexpr):
    tl.store(x_ptr, undefined_name)  # noqa: F821


@triton.jit
def fx_noisy(x_ptr, D: tl.constexpr):
    tl.static_print("error: simulated compiler complaint")
    tl.store(x_ptr, D)


_KERNELS = {"fx_axpy": fx_axpy, "fx_broken": fx_broken, "fx_noisy": fx_noisy}


def get_kernel(name: str):
    """Registry lookup; ``fx_abort`` kills the process like an LLVM assertion failure."""
    if name == "fx_abort":
        os.abort()
    return _KERNELS[name]
