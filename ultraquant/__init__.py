"""UltraQuant: 4.25-bit paged KV-cache attention (FP4 E2M1 codes + UE8M0 scales, rotated K).

The public API: the format helpers (:func:`slot_size`, :func:`hadamard`, :func:`empty_kv_cache`: a
head-major paged cache), the ops
(:func:`store_kv`, :func:`decode_attention`, :func:`dequant_kv`, :func:`prefill_attention`,
:func:`spec_decode_attention`, which
pick an AOT blob, the Triton JIT kernel or the PyTorch reference per call), :func:`check_errors`
(out-of-range values the kernels met), :func:`warmup` (load and
self-test a model's blobs before CUDA graph capture), and
:mod:`ultraquant.reference`, the plain-PyTorch definition every kernel is tested against.
"""

from . import reference
from .errors import UltraQuantError
from .format import empty_kv_cache, hadamard, slot_size
from .ops import (
    KernelError,
    check_errors,
    decode_attention,
    dequant_kv,
    prefill_attention,
    spec_decode_attention,
    store_kv,
)
from .policy import warmup

__version__ = "0.1.0"

__all__ = [
    "KernelError",
    "UltraQuantError",
    "check_errors",
    "decode_attention",
    "dequant_kv",
    "empty_kv_cache",
    "hadamard",
    "prefill_attention",
    "reference",
    "slot_size",
    "spec_decode_attention",
    "store_kv",
    "warmup",
]
