"""The UltraQuant byte format: constants and the small pure functions every layer shares.

One slot holds one token of one kv head, K and V together:
``[K codes: D/2][K scales: D/32][V codes: D/2][V scales: D/32]`` (defined in docs/format.md).
Codes are FP4 E2M1 (element 2i in the low nibble), scales UE8M0 (``2**(byte-127)``, byte 0 = zero
group), K is rotated by the normalized Sylvester Hadamard matrix before quantization.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .errors import UltraQuantError

GROUP = 32
"""Elements per UE8M0 scale."""

SCALE_BIAS = 127
"""UE8M0 byte ``e`` means ``2**(e - SCALE_BIAS)``."""

MIN_EXP, MAX_EXP = -126, 127
"""Clamp of the scale exponent: bytes 1..254 are written; 0 is the zero group, 255 never."""

SCALE_FACTOR = 0.156
"""Upstream's scale rule: ``exp = round_log2(0.156 * absmax)`` (float32 product)."""

SQRT2_MANTISSA = 0x3504F4
"""Smallest float32 mantissa field m with ``1.m >= sqrt(2)``: the exact half-way point in log2."""

E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                                  -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""Value of each 4-bit code (sign in bit 3)."""

E2M1_THRESHOLDS: tuple[float, ...] = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
"""Decision points between consecutive magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6."""

RNE_TIES_UP: tuple[bool, ...] = (False, True, False, True, False, True, False)
"""Round half to even: at each decision point, does a tie go to the larger magnitude?"""

ENCODERS = ("rne", "upstream", "mse")
"""Scale/tie rules that all write the same bytes (see ultraquant.reference.quantize)."""

SERVING_ENCODER = "mse"
"""The encoder the attention layer and the vLLM backend store with. It won on SmolLM2-135M over 7658
tokens of real text (docs/accuracy.md): mean KL vs a bf16 cache 0.148 against 0.235 (upstream) and
0.236 (rne), perplexity 19.8 against 21.4. The op-level default stays ``"rne"`` (the pinned API)."""


@dataclass(frozen=True)
class SlotLayout:
    """Byte offsets of the four parts of one slot for head size ``head_size``."""

    head_size: int

    @property
    def k_codes(self) -> int:
        return 0

    @property
    def k_scales(self) -> int:
        return self.head_size // 2

    @property
    def v_codes(self) -> int:
        return self.head_size // 2 + self.head_size // GROUP

    @property
    def v_scales(self) -> int:
        return self.head_size + self.head_size // GROUP

    @property
    def size(self) -> int:
        return self.head_size + self.head_size // 16


SUPPORTED_HEAD_SIZES: tuple[int, ...] = (64, 128, 256, 512)
"""Head sizes D the kernels are built and tested for (the format itself takes any power of two >= 32:
:func:`check_head_size`). The one list: codegen's matrix, model planning and the vLLM backend read it."""


def check_head_size(head_size: int, name: str = "head_size") -> int:
    """Raise unless ``head_size`` is a power of two and a multiple of 32."""
    if not isinstance(head_size, int) or head_size < GROUP or head_size & (head_size - 1):
        raise UltraQuantError(f"{name}: expected a power of two multiple of {GROUP} (the kernels serve "
                              f"{', '.join(map(str, SUPPORTED_HEAD_SIZES))}), got {head_size!r}")
    return head_size


def slot_size(head_size: int) -> int:
    """Bytes one (token, kv head) slot needs: ``D/2 + D/32`` for K and the same for V."""
    return SlotLayout(check_head_size(head_size)).size


@functools.lru_cache(maxsize=16)
def empty_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, *,
                   device: torch.device | str | None = None) -> torch.Tensor:
    """A zeroed paged cache as the ops take it, ``(num_blocks, block_size, Hk, slot_size(D))`` uint8, whose
    memory is head-major (each kv head's slots of a block contiguous: a view of ``(blocks, Hk, tokens,
    slot)``). That is the layout the fast NVIDIA decode streams whole (docs/kernels.md, "Which decode
    runs"); a plain ``torch.zeros`` of the same shape (token-major pages) works everywhere and streams too,
    about 10% slower than head-major at Hk > 1 (benchmarks/results/serving_decode_h200_20261204_final.json)."""
    check_head_size(head_size)
    raw = torch.zeros(num_blocks, num_kv_heads, block_size, slot_size(head_size), dtype=torch.uint8, device=device)
    return raw.permute(0, 2, 1, 3)


def _hadamard_f64(head_size: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < head_size:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / head_size**0.5


def hadamard(head_size: int, *, device: torch.device | str | None = None,
             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The normalized Sylvester Hadamard matrix of size ``head_size``: symmetric and orthonormal."""
    check_head_size(head_size)
    return _hadamard_f64(head_size).to(device=device, dtype=dtype)
