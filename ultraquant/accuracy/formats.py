"""The KV-cache formats being compared: what each does to a layer's bf16 keys and values.

Every UltraQuant variant goes through the real cache path of :mod:`ultraquant.reference`:
``store_kv`` writes the bytes into a paged cache (head-major physical order, seen through the
permuted view the ops take) and ``dequant_kv`` reads them back in the original space, so the model
attends to exactly what a decode kernel would read (``tests/test_accuracy.py`` checks this against
``reference.decode_attention``). Attending with the dequantized cache at every position is what
decoding the text one token at a time from the cache would compute.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import reference
from ..errors import UltraQuantError
from ..format import ENCODERS, slot_size

BLOCK_SIZE = 16
"""Tokens per cache page in the accuracy runs (vLLM's default)."""

FP8_MAX = 448.0
"""Largest finite float8 e4m3fn value: the per-tensor scale maps the tensor's absmax onto it."""


@dataclass(frozen=True)
class Variant:
    """One row of the comparison: a name, a one-line description, and the K/V transform."""

    name: str
    description: str
    transform: Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def bf16_cache(layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The baseline: the cache holds the bf16 keys/values unchanged."""
    return key.float(), value.float()


def _fp8_per_tensor(x: torch.Tensor) -> torch.Tensor:
    amax = x.float().abs().amax()
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (x.float() / scale).to(torch.float8_e4m3fn).float() * scale


def fp8_cache(layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 e4m3 with one float32 scale per tensor (this layer's K, resp. V: absmax / 448)."""
    return _fp8_per_tensor(key), _fp8_per_tensor(value)


def paged_store(key: torch.Tensor, value: torch.Tensor, encoder: str
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Write (N, Hk, D) K/V of one sequence into a fresh paged cache with ``reference.store_kv``.

    The cache is allocated head-major ``(blocks, Hk, block_size, slot)`` and handed to the ops as the
    ``(blocks, block_size, Hk, slot)`` view; pages are used in reverse order so that a wrong block
    table lookup could not go unnoticed. Returns (kv_cache view, block_table (1, blocks) int32,
    seq_lens (1,) int32).
    """
    n, hk, d = key.shape
    num_blocks = -(-n // BLOCK_SIZE)
    physical = torch.zeros(num_blocks, hk, BLOCK_SIZE, slot_size(d), dtype=torch.uint8)
    kv_cache = physical.permute(0, 2, 1, 3)
    pages = torch.arange(num_blocks - 1, -1, -1, dtype=torch.int32)
    positions = torch.arange(n)
    slot_mapping = pages[positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
    reference.store_kv(key, value, kv_cache, slot_mapping, encoder=encoder)
    return kv_cache, pages[None, :], torch.tensor([n], dtype=torch.int32)


def paged_store_and_read(key: torch.Tensor, value: torch.Tensor, encoder: str
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`paged_store`, then ``reference.dequant_kv``: float32 K (original space) and V."""
    kv_cache, block_table, seq_lens = paged_store(key, value, encoder)
    keys, values = reference.dequant_kv(kv_cache, block_table, seq_lens)
    return keys[0], values[0]


def ultraquant_cache(encoder: str) -> Callable[[int, torch.Tensor, torch.Tensor],
                                               tuple[torch.Tensor, torch.Tensor]]:
    """The UltraQuant format written by ``encoder`` (K rotated), through the paged cache."""
    if encoder not in ENCODERS:
        raise UltraQuantError(f"encoder: expected one of {ENCODERS}, got {encoder!r}")

    def transform(layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return paged_store_and_read(key, value, encoder)

    return transform


def unrotated_cache(encoder: str) -> Callable[[int, torch.Tensor, torch.Tensor],
                                              tuple[torch.Tensor, torch.Tensor]]:
    """Ablation: the same codes and scales but K quantized without the Hadamard rotation.

    ``store_kv`` always rotates K (that is the format), so this variant calls the reference's
    ``quantize``/``dequantize`` with ``rotate=False`` for K; V is quantized exactly as in the cache.
    """
    if encoder not in ENCODERS:
        raise UltraQuantError(f"encoder: expected one of {ENCODERS}, got {encoder!r}")

    def transform(layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = reference.dequantize(*reference.quantize(key, rotate=False, encoder=encoder), rotate=False)
        v = reference.dequantize(*reference.quantize(value, rotate=False, encoder=encoder), rotate=False)
        return k, v

    return transform


def default_variants() -> list[Variant]:
    """The comparison the issue asks for: bf16, fp8, UltraQuant per encoder, and the rotation ablation."""
    variants = [
        Variant("bf16", "bf16 cache (the baseline)", bf16_cache),
        Variant("fp8-e4m3", "FP8 e4m3, one scale per layer tensor", fp8_cache),
    ]
    # upstream first (the starting point), then the default rne, then any further encoders
    for enc in sorted(ENCODERS, key=lambda e: (e != "upstream", e != "rne")):
        variants.append(Variant(f"uq-{enc}", f"UltraQuant, encoder={enc}", ultraquant_cache(enc)))
    variants.append(Variant("uq-rne-norot", "UltraQuant rne, K not rotated (ablation)", unrotated_cache("rne")))
    return variants


def select_variants(names: list[str] | None) -> list[Variant]:
    """The default variants, or those named (in the given order); bf16 is always first."""
    all_variants = {v.name: v for v in default_variants()}
    if not names:
        return list(all_variants.values())
    unknown = [n for n in names if n not in all_variants]
    if unknown:
        raise UltraQuantError(f"variants: unknown {unknown}; choose from {sorted(all_variants)}")
    return [all_variants["bf16"]] + [all_variants[n] for n in names if n != "bf16"]
