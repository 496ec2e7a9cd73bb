"""The click CLI: `ultraquant info` and the command registry."""

from __future__ import annotations

import json

from click.testing import CliRunner

import ultraquant
from ultraquant.cli import COMMANDS, main


def test_info_reports_versions_and_no_gpu(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("ULTRAQUANT_GENERATED", str(tmp_path))
    result = CliRunner().invoke(main, ["info"])
    assert result.exit_code == 0, result.output
    assert f"ultraquant {ultraquant.__version__}" in result.output
    assert "torch" in result.output and "triton" in result.output and "flydsl" in result.output


def test_info_lists_blobs_of_a_manifest(tmp_path, monkeypatch) -> None:
    arch = tmp_path / "gfx942"
    arch.mkdir()
    (arch / "manifest.json").write_text(json.dumps({"arch": "gfx942", "blobs": [{"key": "a"}, {"key": "b"}]}))
    monkeypatch.setenv("ULTRAQUANT_GENERATED", str(tmp_path))
    result = CliRunner().invoke(main, ["info"])
    assert result.exit_code == 0, result.output
    assert "gfx942: 2 in" in result.output


def test_every_registered_command_imports() -> None:
    runner = CliRunner()
    for name in COMMANDS:
        result = runner.invoke(main, [name, "--help"])
        assert result.exit_code == 0, (name, result.output)
