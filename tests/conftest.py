"""Session-wide test setup.

On a machine without a GPU the Triton kernels run through Triton's interpreter. ``TRITON_INTERPRET``
is read when a ``@triton.jit`` function is defined, so it must be set before any test module imports
a kernel; setting it here, once, keeps every test in one process on the same side (mixing interpreted
and compiled kernels in one process breaks both). Codegen compiles in subprocesses that drop it.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
