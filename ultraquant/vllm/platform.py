"""vLLM's platform side of the plugin: a CPU platform that picks UltraQuant, and the no-silent-garbage guard.

Importing this module imports vLLM. Two pieces:

- :class:`UltraQuantCpuPlatform`: vLLM's own ``CpuPlatform`` except that layers whose cache dtype is
  ``ultraquant_4bit`` get UltraQuant's backend (vLLM's CPU platform always answers with its
  ``CPU_ATTN`` backend, which would read the uint8 cache as bf16 garbage without an error). vLLM
  loads it through the ``vllm.platform_plugins`` entry point ``ultraquant_cpu``
  (:func:`ultraquant.vllm.cpu_platform_plugin`); every other layer and every other cache dtype is
  served exactly as by ``CpuPlatform``. On CPU tensors the ops run ``ultraquant.reference``.
- :func:`install_backend_guard`: wraps the active platform's ``get_attn_backend_cls`` so that a
  layer asking for ``ultraquant_4bit`` and handed any backend but ours stops the engine at model
  construction with :func:`wrong_backend_message`.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.platforms.cpu import CpuPlatform

from ..errors import UltraQuantError
from .spec import BACKEND_CLASS, BACKEND_NAME, CPU_PLATFORM_ENV, CPU_PLATFORM_PLUGIN, KV_CACHE_DTYPE

__all__ = ["UltraQuantCpuPlatform", "install_backend_guard", "wrong_backend_message"]

_log = logging.getLogger(__name__)


class UltraQuantCpuPlatform(CpuPlatform):
    """vLLM's CPU platform, with UltraQuant's backend for ``ultraquant_4bit`` layers."""

    @classmethod
    def get_attn_backend_cls(cls, selected_backend: Any, attn_selector_config: Any,
                             num_heads: int | None = None) -> str:
        """Our backend for an ``ultraquant_4bit`` decoder layer, ``CpuPlatform``'s answer otherwise."""
        if attn_selector_config.kv_cache_dtype == KV_CACHE_DTYPE and not attn_selector_config.use_mla:
            _log.info("ultraquant: CPU platform serves kv_cache_dtype=%s with %s", KV_CACHE_DTYPE, BACKEND_CLASS)
            return BACKEND_CLASS
        return super().get_attn_backend_cls(selected_backend, attn_selector_config, num_heads)


def wrong_backend_message(platform: str, backend: str) -> str:
    """What went wrong and what to do, for an ``ultraquant_4bit`` layer handed another backend."""
    return (
        f"ultraquant: --kv-cache-dtype {KV_CACHE_DTYPE} needs UltraQuant's attention backend, but vLLM's "
        f"{platform} platform selected {backend}, which cannot read the 4-bit cache (the model would "
        f"print garbage). On CPU: let the '{CPU_PLATFORM_PLUGIN}' platform plugin load (unset "
        f"VLLM_TARGET_DEVICE=cpu and {CPU_PLATFORM_ENV}=0; if VLLM_PLUGINS is set, it must list "
        f"'ultraquant' and '{CPU_PLATFORM_PLUGIN}'). On a GPU: add --attention-backend {BACKEND_NAME}. "
        f"Or serve without --kv-cache-dtype {KV_CACHE_DTYPE}.")


def install_backend_guard() -> None:
    """Make the active platform refuse to hand an ``ultraquant_4bit`` layer any backend but ours.

    Idempotent (vLLM runs the general plugins in every process, possibly more than once).
    """
    from vllm.platforms import current_platform

    cls = type(current_platform)
    original = cls.get_attn_backend_cls
    if getattr(original, "_ultraquant_guard", False):
        return

    def get_attn_backend_cls(klass: type, selected_backend: Any, attn_selector_config: Any,
                             *args: Any, **kwargs: Any) -> str:
        path = original(selected_backend, attn_selector_config, *args, **kwargs)
        if getattr(attn_selector_config, "kv_cache_dtype", None) == KV_CACHE_DTYPE and path != BACKEND_CLASS:
            raise UltraQuantError(wrong_backend_message(klass.__name__, str(path)))
        return path

    get_attn_backend_cls._ultraquant_guard = True  # type: ignore[attr-defined]
    cls.get_attn_backend_cls = classmethod(get_attn_backend_cls)  # type: ignore[method-assign,assignment]
