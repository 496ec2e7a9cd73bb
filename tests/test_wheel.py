"""``make kernels`` + ``make wheel`` on a fresh build venv, then the wheel in a clean venv that has
neither Triton nor FlyDSL: ``ultraquant info`` lists the shipped blobs and ``ultraquant verify`` passes.

Slow (creates two venvs; the CPU torch wheel is on local disk): about 3-5 minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYTHON = shutil.which("python3") or "python3"
# A reduced matrix: one real kernel (dequant, D=64, block 16: fp32/bf16/fp16 outputs, 3 blobs) keeps the
# compile part short.
MATRIX = ["ARCH=gfx942", "HEAD_SIZES=64", "GQA=1", "BLOCK_SIZES=16", "OPS=dequant_kv", "JOBS=1"]

pytestmark = pytest.mark.slow


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("ULTRAQUANT_GENERATED", "VIRTUAL_ENV")}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, **kw)
    assert res.returncode == 0, f"{' '.join(cmd)} failed:\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
    return res


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> tuple[Path, Path]:
    if shutil.which("make") is None:
        pytest.skip("no make")
    tmp = tmp_path_factory.mktemp("wheel")
    gen, dist = tmp / "gen", tmp / "dist"
    _run(["make", "-s", "wheel", f"PYTHON={PYTHON}", *MATRIX, f"GENERATED={gen}", f"DIST={dist}"], cwd=ROOT)
    wheels = list(dist.glob("ultraquant-*.whl"))
    assert len(wheels) == 1
    return wheels[0], gen


def test_make_kernels_output(wheel):
    _, gen = wheel
    m = json.loads((gen / "gfx942" / "manifest.json").read_text())
    assert m["arch"] == "gfx942" and m["toolchain"]["triton"]["triton"] == "3.6.0"
    assert [b["op"] for b in m["blobs"]] == ["dequant_kv"] * 3
    assert (gen / "gfx942" / m["blobs"][0]["file"]).read_bytes()[:4] == b"\x7fELF"


def test_wheel_contains_the_blobs(wheel):
    whl, gen = wheel
    # the version names the arch and the (hand-picked, so hashed) selection it was built for
    assert re.fullmatch(r"ultraquant-0\.1\.0\+gfx942\.custom[0-9a-f]{8}-py3-none-any\.whl", whl.name), whl.name
    names = zipfile.ZipFile(whl).namelist()
    assert "ultraquant/codegen/popular_models.json" in names
    for f in (gen / "gfx942").iterdir():
        assert f"ultraquant/_generated/gfx942/{f.name}" in names
    assert "ultraquant/codegen/verify.py" in names and "ultraquant/runtime/manifest.py" in names


def test_clean_venv_without_toolchains(wheel, tmp_path):
    whl, gen = wheel
    venv = tmp_path / "venv"
    _run([PYTHON, "-m", "venv", str(venv)])
    py = venv / "bin" / "python"
    _run([str(py), "-m", "pip", "install", "-q", "torch==2.13.0", str(whl)])
    for module in ("triton", "flydsl"):
        probe = subprocess.run([str(py), "-c", f"import {module}"], capture_output=True)
        assert probe.returncode != 0, f"{module} is importable in the clean venv"
    cli = str(venv / "bin" / "ultraquant")
    info = _run([cli, "info"], cwd=tmp_path).stdout
    assert "triton     not installed" in info
    assert "gfx942: 3 in" in info and "_generated" in info and "built for  custom" in info
    assert "(distribution 0.1.0+gfx942.custom" in info
    # what a wheel user without build tools can reach: errors that say what to do, no traceback
    dry = _run([cli, "build", "--arch", "gfx942", "--dry-run"], cwd=tmp_path)  # reads the selection only
    assert "gfx942: 102 blobs" in dry.stdout + dry.stderr
    for args, says in ((["build", "--arch", "gfx942", "--out", str(tmp_path / "blobs")], "needs Triton 3.6.0"),
                       (["accuracy"], "pip install 'ultraquant[accuracy]'")):
        res = subprocess.run([cli, *args], cwd=tmp_path, capture_output=True, text=True)
        assert res.returncode == 1 and says in res.stderr and "Traceback" not in res.stderr, res.stderr
    out = _run([cli, "verify"], cwd=tmp_path).stdout
    assert "OK    gfx942: 3 blobs" in out
    # the installed verify still catches a corrupted blob
    installed = Path(_run([str(py), "-c", "import ultraquant, pathlib; "
                           "print(pathlib.Path(ultraquant.__file__).parent / '_generated' / 'gfx942')"],
                          cwd=tmp_path).stdout.strip())
    blob = next(installed.glob("*.hsaco"))
    data = bytearray(blob.read_bytes())
    data[100] ^= 1
    blob.write_bytes(bytes(data))
    bad = subprocess.run([cli, "verify"], cwd=tmp_path, capture_output=True, text=True)
    assert bad.returncode == 1 and "sha256" in bad.stderr
