"""``ultraquant verify`` catches what can go wrong with shipped blobs: a corrupted file, a manifest whose
parameter layout disagrees with the binary, a blob for another arch, a missing file, undeclared spills,
duplicate keys, resource limits; exit status 1 and a message naming the blob."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from ultraquant.cli import main
from ultraquant.codegen.verify import verify_dir
from ultraquant.kernels.abi import SCHEMA_VERSION

pytest.importorskip("triton")
from tests.codegen_fixture import shared_build  # noqa: E402


@pytest.fixture
def copy(tmp_path) -> Path:
    """A private copy of the fixture build (gfx942 and sm_90 folders)."""
    src = shared_build()
    for arch in ("gfx942", "sm_90"):
        shutil.copytree(src / arch, tmp_path / arch)
    return tmp_path


def _edit(d: Path, fn) -> dict:
    m = json.loads((d / "manifest.json").read_text())
    fn(m)
    (d / "manifest.json").write_text(json.dumps(m))
    return m


def _verify(d: Path) -> tuple[int, str]:
    res = CliRunner().invoke(main, ["verify", str(d)])
    return res.exit_code, res.output


def test_clean_build_passes(copy):
    for arch in ("gfx942", "sm_90"):
        code, out = _verify(copy / arch)
        assert code == 0 and "OK" in out and "4 blobs" in out


def test_corrupted_blob(copy):
    d = copy / "gfx942"
    blob = json.loads((d / "manifest.json").read_text())["blobs"][1]
    data = bytearray((d / blob["file"]).read_bytes())
    data[len(data) // 2] ^= 0x40
    (d / blob["file"]).write_bytes(bytes(data))
    code, out = _verify(d)
    assert code == 1
    assert "sha256" in out and blob["file"] in out and blob["key"] in out


def test_wrong_arg_size_in_manifest(copy):
    d = copy / "sm_90"

    def shrink(m):
        m["blobs"][0]["params"][4]["size"] = 8  # n is an i32
    m = _edit(d, shrink)
    code, out = _verify(d)
    assert code == 1
    assert "param 4 (n)" in out and "size 4" in out and m["blobs"][0]["key"] in out


def test_wrong_offset_and_count(copy):
    d = copy / "gfx942"

    def edit(m):
        m["blobs"][0]["params"][5]["offset"] = 36
        del m["blobs"][1]["params"][-1]
    _edit(d, edit)
    report = verify_dir(d)
    assert any("param 5 (stride)" in p for p in report.problems)
    assert any("binary has 8 parameters, the manifest lists 7" in p for p in report.problems)


def test_blob_for_another_arch(copy):
    """An sm_90 cubin (with a matching sha256) under the gfx942 manifest: wrong machine."""
    g, s = copy / "gfx942", copy / "sm_90"
    cubin = json.loads((s / "manifest.json").read_text())["blobs"][0]
    shutil.copy(s / cubin["file"], g / cubin["file"])

    def swap(m):
        m["blobs"][0]["file"] = cubin["file"]
        m["blobs"][0]["sha256"] = hashlib.sha256((g / cubin["file"]).read_bytes()).hexdigest()
    _edit(g, swap)
    report = verify_dir(g)
    assert any("ELF machine 190, expected 224" in p for p in report.problems)


def test_gfx950_blob_under_gfx942(copy, tmp_path):
    src = shared_build() / "gfx950"
    g = copy / "gfx942"
    other = json.loads((src / "manifest.json").read_text())["blobs"][0]
    target = json.loads((g / "manifest.json").read_text())["blobs"][0]
    shutil.copy(src / other["file"], g / target["file"])

    def fix_sha(m):
        m["blobs"][0]["sha256"] = other["sha256"]
    _edit(g, fix_sha)
    report = verify_dir(g)
    assert any("ELF processor 0x4f, expected 0x4c" in p for p in report.problems)


def test_missing_file_symbol_and_duplicates(copy):
    d = copy / "sm_90"
    m = json.loads((d / "manifest.json").read_text())
    (d / m["blobs"][0]["file"]).unlink()

    def edit(m):
        m["blobs"][1]["symbol"] = "nope"
        m["blobs"].append(dict(m["blobs"][2]))
    _edit(d, edit)
    problems = verify_dir(d).problems
    assert any("missing file" in p for p in problems)
    assert any("kernel symbol 'nope' not found" in p for p in problems)
    assert any("duplicate key" in p for p in problems)


def test_undeclared_spills_and_limits(copy):
    d = copy / "gfx942"

    def edit(m):
        m["blobs"][0]["resources"]["global_scratch_size"] = 64   # declared scratch, not allowed
        m["blobs"][1]["launch"]["shared"] = 70000                # > 64 KiB LDS
        m["blobs"][2]["launch"]["threads"] = 2048
    _edit(d, edit)
    problems = verify_dir(d).problems
    assert any("does not allow" in p and "global_scratch_size" in p for p in problems)
    assert any("exceeds 65536 on gfx942" in p for p in problems)
    assert any("threads per block 2048" in p for p in problems)

    def allow_too_little(m):
        m["blobs"][0]["allow_spills"] = "accepted for the test"
        m["blobs"][0]["spill_budget"] = 32
    _edit(d, allow_too_little)
    assert any("over the allowed 32 bytes" in p for p in verify_dir(d).problems)

    def allow(m):
        m["blobs"][0]["spill_budget"] = 64
        m["blobs"][1]["launch"]["shared"] = 0
        m["blobs"][2]["launch"]["threads"] = 128
    _edit(d, allow)
    assert verify_dir(d).ok


def test_resource_tampering(copy):
    d = copy / "sm_90"

    def edit(m):
        m["blobs"][0]["resources"]["registers"] += 1
    _edit(d, edit)
    assert any("resource registers" in p for p in verify_dir(d).problems)


def test_bad_manifest_files(tmp_path):
    assert "no manifest" in verify_dir(tmp_path).problems[0]
    (tmp_path / "manifest.json").write_text("{not json")
    assert "unreadable manifest" in verify_dir(tmp_path).problems[0]
    (tmp_path / "manifest.json").write_text(json.dumps({"schema_version": 99, "blobs": []}))
    assert "schema_version 99" in verify_dir(tmp_path).problems[0]
    (tmp_path / "manifest.json").write_text(json.dumps({"schema_version": SCHEMA_VERSION, "arch": "gfx1", "blobs": []}))
    assert "unknown arch" in verify_dir(tmp_path).problems[0]
    code, out = _verify(tmp_path)
    assert code == 1 and "FAIL" in out


@pytest.mark.parametrize("prefix", ["../sm_90/", "sub/../"])
def test_path_escape_is_refused(copy, prefix):
    """Only plain names (the runtime's rule, kernels.abi.blob_name_problem), even when the path would
    resolve inside the folder."""
    d = copy / "gfx942"

    def edit(m):
        m["blobs"][0]["file"] = prefix + m["blobs"][0]["file"]
    _edit(d, edit)
    assert any("plain name" in p for p in verify_dir(d).problems)
