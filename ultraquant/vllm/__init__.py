"""UltraQuant as a vLLM plugin: an attention backend for ``--kv-cache-dtype ultraquant_4bit``.

Targets vLLM ``0.33.0`` (:data:`VLLM_VERSION`), whose attention backend API this adapter implements
(``AttentionBackend`` / ``AttentionImpl`` / ``AttentionMetadataBuilder`` in
``vllm.v1.attention.backend``). vLLM 0.33 already knows the ``ultraquant_4bit`` cache dtype and an
``ULTRAQUANT`` backend name; :func:`register` (the ``vllm.general_plugins`` entry point declared in
pyproject.toml, run by vLLM in every process it starts) points that name at
:class:`ultraquant.vllm.backend.UltraQuantBackend`, so vLLM serves the format with this package's
kernels.

vLLM is optional: importing ``ultraquant`` (or this subpackage) never imports vLLM; only
:func:`register` and :mod:`ultraquant.vllm.backend` do. The vLLM-free pieces (cache shape, metadata
mapping) live in :mod:`ultraquant.vllm.spec`.
"""

from __future__ import annotations

import logging

from .spec import (
    BACKEND_NAME,
    KV_CACHE_DTYPE,
    SUPPORTED_BLOCK_SIZES,
    SUPPORTED_HEAD_SIZES,
    VLLM_VERSION,
    kv_cache_shape,
)

__all__ = [
    "BACKEND_CLASS",
    "BACKEND_NAME",
    "KV_CACHE_DTYPE",
    "SUPPORTED_BLOCK_SIZES",
    "SUPPORTED_HEAD_SIZES",
    "VLLM_VERSION",
    "kv_cache_shape",
    "register",
]

BACKEND_CLASS = "ultraquant.vllm.backend.UltraQuantBackend"
"""Qualified name vLLM resolves the ``ULTRAQUANT`` backend to after :func:`register`."""

_log = logging.getLogger(__name__)


def register() -> bool:
    """vLLM plugin entry point: route vLLM's ``ULTRAQUANT`` attention backend to this package.

    Idempotent and cheap (vLLM calls it in every process). Returns False, with a warning, when vLLM
    is missing or lacks the backend registry this adapter was written against; a vLLM version other
    than :data:`VLLM_VERSION` gets a warning but is still registered.
    """
    try:
        import vllm
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    except ImportError as exc:  # no vLLM, or a vLLM without the v1 backend registry
        _log.warning("ultraquant: vLLM attention backend not registered (%s)", exc)
        return False
    version = getattr(vllm, "__version__", "unknown")
    if not str(version).startswith(VLLM_VERSION):
        _log.warning("ultraquant: the vLLM adapter targets vllm==%s, found %s", VLLM_VERSION, version)
    member = getattr(AttentionBackendEnum, BACKEND_NAME, None)
    if member is None:  # a vLLM without the in-tree name: add it as a new backend
        register_backend(BACKEND_NAME, BACKEND_CLASS)
    else:
        register_backend(member, BACKEND_CLASS)
    _log.info("ultraquant: vLLM attention backend %s -> %s", BACKEND_NAME, BACKEND_CLASS)
    return True
