"""codegen/toolchain.py: finding ld.lld / llvm-objdump without root, with fake tools on a fake PATH."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ultraquant.codegen import toolchain as tc


def _fake(folder: Path, name: str, version_line: str) -> Path:
    p = folder / name
    p.write_text(f"#!/bin/sh\necho '{version_line}'\n")
    p.chmod(0o755)
    return p


@pytest.fixture
def bare(tmp_path, monkeypatch):
    """A PATH with only our fakes, no ROCm, no Debian LLVM folders, no pip-installed tools."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    for var in ("ULTRAQUANT_LLD", "ULTRAQUANT_OBJDUMP", "ROCM_PATH"):
        monkeypatch.delenv(var, raising=False)
    real = tc._candidates
    monkeypatch.setattr(tc, "_candidates",
                        lambda name, versions: [c for c in real(name, versions) if c[0].startswith(str(bin_dir))])
    return bin_dir


def test_version_filter_and_order(bare) -> None:
    _fake(bare, "ld.lld", "Debian LLD 14.0.6 (compatible with GNU linkers)")
    _fake(bare, "ld.lld-22", "Debian LLD 22.1.0 (compatible with GNU linkers)")
    t = tc.find_lld(allow_triton=False)
    assert (Path(t.path).name, t.version, t.origin) == ("ld.lld-22", 22, "PATH")
    _fake(bare, "ld.lld-19", "Debian LLD 19.1.7 (compatible with GNU linkers)")
    assert Path(tc.find_lld(allow_triton=False).path).name == "ld.lld-19"  # the pinned linker first
    _fake(bare, "llvm-objdump-19", "Debian LLVM version 19.1.7")
    assert tc.find_objdump("gfx942").version == 19
    with pytest.raises(tc.ToolchainError, match=r"LLVM >= 22 for the gfx950.*rejected: .*llvm-objdump-19"):
        tc.find_objdump("gfx950")


def test_explicit_override(bare, tmp_path, monkeypatch) -> None:
    mine = _fake(tmp_path, "my-lld", "LLD 20.1.0")
    monkeypatch.setenv("ULTRAQUANT_LLD", str(mine))
    assert tc.find_lld(allow_triton=False) == tc.Tool(str(mine), 20, "$ULTRAQUANT_LLD")


def test_nothing_found_is_one_paragraph(bare) -> None:
    _fake(bare, "ld.lld", "Debian LLD 14.0.6")
    with pytest.raises(tc.ToolchainError) as err:
        tc.find_lld(python="/nonexistent/python")
    text = str(err.value)
    assert "\n" not in text and "apt-get install lld-19 llvm-22" in text and "APT=1" in text
    assert "ULTRAQUANT_LLD" in text and "OPS=store_kv,dequant_kv,decode_attention,prefill_attention" in text
    assert "LLVM 14, need >= 19" in text
    assert len(tc.check_flydsl_tools(["gfx942"], python="/nonexistent/python")) == 2


def test_triton_wrapper(bare, tmp_path) -> None:
    pytest.importorskip("triton")
    if not tc._triton_linker(sys.executable):
        pytest.skip("this triton has no in-process AMD linker")
    t = tc.find_lld()
    assert t.origin == tc.TRITON_LLD
    out = subprocess.run([t.path, "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and "Triton" in out.stdout
    bad = subprocess.run([t.path, "-r", "x.o", "-o", "y"], capture_output=True, text=True)
    assert bad.returncode != 0 and "only 'ld.lld -shared IN -o OUT'" in bad.stderr
    garbage = tmp_path / "in.o"
    garbage.write_bytes(b"not an object")
    failed = subprocess.run([t.path, "-shared", str(garbage), "-o", str(tmp_path / "out")], capture_output=True,
                            text=True)
    assert failed.returncode != 0


def test_triton_forced_even_with_lld_present(bare, monkeypatch) -> None:
    _fake(bare, "ld.lld-19", "Debian LLD 19.1.7")
    monkeypatch.setenv("ULTRAQUANT_LLD", tc.TRITON_LLD)
    with pytest.raises(tc.ToolchainError, match="ULTRAQUANT_LLD=triton"):
        tc.find_lld(python="/nonexistent/python")
    pytest.importorskip("triton")
    if tc._triton_linker(sys.executable):
        assert tc.find_lld().origin == tc.TRITON_LLD
