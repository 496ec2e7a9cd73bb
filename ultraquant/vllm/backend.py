"""The vLLM 0.33 attention backend over :class:`ultraquant.attention.UltraQuantAttention`.

Importing this module imports vLLM. vLLM resolves it through :func:`ultraquant.vllm.register`. The
pieces, each implementing one of vLLM's abstract interfaces from ``vllm.v1.attention.backend``:

- :class:`UltraQuantBackend` (``AttentionBackend``): the ``ultraquant_4bit`` cache dtype, a page of
  ``Hk * block_size * slot_size(D)`` bytes (``customize_spec``), block sizes 16/32/64/128, head sizes
  64..512, sinks and sliding windows, decoder attention only.
- :class:`UltraQuantMetadataBuilder` (``AttentionMetadataBuilder``): decodes reordered to the front
  (threshold 1; 1 + the speculative tokens under speculative decoding, served as decodes by the
  multi-query decode), CUDA graphs for uniform decode batches (single-token, or up to 1 + k tokens
  per request under speculative decoding: counts from ``query_start_loc`` on the device); ``build`` maps
  ``CommonAttentionMetadata`` with :func:`ultraquant.vllm.spec.layer_metadata` (host data only).
- :class:`UltraQuantImpl` (``AttentionImpl``): ``do_kv_cache_update`` stores (vLLM calls it before
  ``forward``, and skips it for layers that share another layer's cache); ``forward`` serves the
  mixed batch into vLLM's output buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backend import AttentionMetadata as VllmAttentionMetadata
from vllm.v1.kv_cache_layout import KVCacheLayout

from ..attention import AttentionMetadata, UltraQuantAttention
from ..format import SUPPORTED_HEAD_SIZES, slot_size
from .spec import (
    BACKEND_NAME,
    KV_CACHE_DTYPE,
    SUPPORTED_BLOCK_SIZES,
    decode_query_len_of,
    kv_cache_shape,
    layer_metadata,
    ops_cache_view,
    served_head_size,
)

__all__ = ["UltraQuantBackend", "UltraQuantImpl", "UltraQuantMetadataBuilder", "UltraQuantVllmMetadata"]


@dataclass
class UltraQuantVllmMetadata(AttentionMetadata, VllmAttentionMetadata):
    """The layer's metadata, typed as a vLLM ``AttentionMetadata`` as the builder contract wants."""


class UltraQuantMetadataBuilder(AttentionMetadataBuilder[UltraQuantVllmMetadata]):
    """Per-batch metadata for UltraQuant layers: a view-only mapping of vLLM's common metadata."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # Decodes first: the layer serves them with one launch (one-token decodes, or speculative-decoding
        # steps of up to 1 + k tokens each through the multi-query decode).
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)
        self._decode_query_len = max(1, int(self.reorder_batch_threshold or 1))

    @classmethod
    def get_cudagraph_support(cls, vllm_config: Any, kv_cache_spec: Any) -> AttentionCGSupport:
        """Uniform single-token decode batches; uniform decode batches of 1 + k tokens under speculative
        decoding (the multi-query decode's grid depends on the bound only)."""
        if decode_query_len_of(vllm_config) > 1:
            return AttentionCGSupport.UNIFORM_BATCH
        return cls._cudagraph_support

    @classmethod
    def get_varlen_cudagraph_max_query_len(cls, vllm_config: Any, kv_cache_spec: Any) -> int | None:
        """Under speculative decoding a captured decode graph replays any counts 1..1 + k per request
        (padding requests 0): the multi-query decode reads them from ``query_start_loc`` on the device."""
        n = decode_query_len_of(vllm_config)
        return n if n > 1 else None

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> UltraQuantVllmMetadata:
        """Map the batch (no device work: slices and host reads only)."""
        md = layer_metadata(common_attn_metadata, UltraQuantVllmMetadata, self._decode_query_len)
        assert isinstance(md, UltraQuantVllmMetadata)
        return md


class UltraQuantImpl(AttentionImpl[UltraQuantVllmMetadata]):
    """One vLLM attention layer served by :class:`UltraQuantAttention`."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: list[float] | None = None, sliding_window: int | None = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: str | None = None,
                 **kwargs: Any) -> None:
        if alibi_slopes is not None:
            raise NotImplementedError("UltraQuant attention: ALiBi is not supported")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"UltraQuant attention: only decoder attention, got {attn_type}")
        if kv_sharing_target_layer_name is not None:
            # Prefill chunks attend to their raw K/V, which a layer reading another layer's cache
            # does not have; serving it would need the chunk dequantized from the shared cache.
            raise NotImplementedError("UltraQuant attention: cross-layer KV sharing is not supported")
        if kv_cache_dtype != KV_CACHE_DTYPE:
            raise ValueError(f"kv_cache_dtype: UltraQuant serves {KV_CACHE_DTYPE!r}, got {kv_cache_dtype!r}")
        served_head_size(head_size)
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads if num_kv_heads is not None else num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.sliding_window = sliding_window if sliding_window and sliding_window > 0 else None
        self.logits_soft_cap = logits_soft_cap if logits_soft_cap else None
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.attn = UltraQuantAttention(num_heads, self.num_kv_heads, head_size, self.scale,
                                        sinks=kwargs.get("sinks"), sliding_window=self.sliding_window,
                                        softcap=self.logits_soft_cap)
        self._max_num_reqs, self._max_model_len = _serving_limits()
        self._warmed = False

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        """Sinks are a model weight: take the loaded values at the next setup."""
        self.attn.reset()

    def do_kv_cache_update(self, layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        """Store the new tokens (vLLM passes ``slot_mapping`` already cut to the real tokens)."""
        self.attn.store(key, value, ops_cache_view(kv_cache), slot_mapping)

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: UltraQuantVllmMetadata, output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of the batch into ``output`` (the cache was updated by do_kv_cache_update)."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("UltraQuant attention: fused output quantization is not supported")
        if attn_metadata is None:  # vLLM's profiling run: no batch. Reserve the dense prefill
            # workspace now, so the free memory vLLM measures after this run already excludes it.
            self.attn.setup(query.device, max_num_reqs=max(256, self._max_num_reqs), dtype=query.dtype,
                            max_model_len=self._max_model_len or None)
            return output.fill_(0)
        cache = ops_cache_view(kv_cache)
        if not self._warmed and not (query.is_cuda and torch.cuda.is_current_stream_capturing()):
            # Before the first capture (vLLM captures after eager warm-up runs): size the decode
            # workspaces for every batch size the graphs may use.
            self.attn.warmup_decode(cache, max_num_reqs=self._max_num_reqs, max_seq_len=self._max_model_len,
                                    dtype=query.dtype, decode_query_len=attn_metadata.decode_query_len)
            self._warmed = True
        self.attn.forward(query, key, value, cache, attn_metadata, output, store=False)
        return output


def _serving_limits() -> tuple[int, int]:
    """(max_num_seqs, max_model_len) of the vLLM config being built, or (0, 0) outside one."""
    try:
        from vllm.config import get_current_vllm_config_or_none

        cfg = get_current_vllm_config_or_none()
        return int(cfg.scheduler_config.max_num_seqs), int(cfg.model_config.max_model_len)
    except (ImportError, AttributeError, TypeError):
        return 0, 0


class UltraQuantBackend(AttentionBackend):
    """vLLM attention backend for ``--kv-cache-dtype ultraquant_4bit`` (see the module docstring)."""

    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = [KV_CACHE_DTYPE]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[UltraQuantImpl]:
        return UltraQuantImpl

    @staticmethod
    def get_builder_cls() -> type[UltraQuantMetadataBuilder]:
        return UltraQuantMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[int]:
        return list(SUPPORTED_BLOCK_SIZES)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(SUPPORTED_HEAD_SIZES)

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype: Any) -> bool:
        return kv_cache_dtype == KV_CACHE_DTYPE

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_compute_capability(cls, capability: Any) -> bool:
        """The Triton kernels use bf16/fp16 tensor-core dots: sm_80 and newer (AMD CDNA reports 9.x)."""
        return capability is None or getattr(capability, "major", 0) >= 8

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        """Head-major pages first (one kv head's slots of a block are contiguous: the kernels'
        bandwidth prefers it: benchmarks/NOTES.md, v1 head- vs token-major), token-major (upstream's order)
        second."""
        return (KVCacheLayout.LBHNC, KVCacheLayout.LBNHC)

    @classmethod
    def customize_spec(cls, spec: Any) -> Any:
        """One slot of ``slot_size(D)`` bytes per (token, kv head) holds K and V together."""
        mode = getattr(spec, "kv_quant_mode", None)
        if spec.state_content_bytes is not None or not getattr(mode, "is_ultraquant", False):
            return spec
        return replace(spec, state_content_bytes=slot_size(served_head_size(spec.head_size)))

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = KV_CACHE_DTYPE) -> tuple[int, ...]:
        """The ops' view of one layer's cache, ``(num_blocks, block_size, Hk, slot_size(D))`` uint8
        (vLLM 0.33 sizes pages through :meth:`customize_spec`; kept for engines that ask)."""
        return kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
