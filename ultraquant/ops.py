"""Public ops (placeholder until the Triton kernels land): every call runs the reference."""

from .reference import decode_attention, dequant_kv, prefill_attention, store_kv

__all__ = ["store_kv", "decode_attention", "dequant_kv", "prefill_attention"]
