"""The build survives its failures and its dry run needs no compiler (issue 28).

- One config that fails (forced through the worker's test hook) is recorded in the manifest's
  ``skipped`` list with its reason, every other blob is kept and verified, the build raises / the CLI
  exits non-zero, and the runtime names the failure when it falls back.
- ``ultraquant build --dry-run`` runs in a venv that has no triton, no flydsl and no LLVM on PATH.
- The AMD prefill tile (32 rows at D <= 128, the compile-time fix) is right in the interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.test_runtime import rt  # noqa: F401  (the fake-driver runtime fixture)
from ultraquant.codegen import matrix
from ultraquant.codegen.build import FAIL_ENV, BuildError, build
from ultraquant.codegen.verify import verify_dir

ROOT = Path(__file__).resolve().parent.parent


def _manifest(d: Path) -> dict:
    return json.loads((d / "manifest.json").read_text())


def test_one_failing_config_keeps_the_others(tmp_path):
    pytest.importorskip("triton")
    from tests.codegen_fixture import options

    opts = options(tmp_path, archs="gfx942,sm_90", selection=matrix.Selection(head_sizes=(64, 128), block_sizes=(16,)))
    opts.extra_env[FAIL_ENV] = "D=128"
    with pytest.raises(BuildError) as exc:
        build(opts)
    assert "2 of 4 blobs failed" in str(exc.value) and "forced failure" in str(exc.value)
    assert [(r.arch, r.blobs, r.failed) for r in exc.value.results] == [("gfx942", 1, 1), ("sm_90", 1, 1)]
    for arch in ("gfx942", "sm_90"):
        m = _manifest(tmp_path / arch)
        assert [b["config"]["head_size"] for b in m["blobs"]] == [64]
        failed = [s for s in m["skipped"] if s.get("build_failed")]
        assert len(failed) == 1 and failed[0]["config"]["head_size"] == 128
        assert "D=128" in failed[0]["key"] and failed[0]["reason"].startswith("build failed: ")
        assert verify_dir(tmp_path / arch).ok
    # a rebuild without the failure compiles only the failed config and clears the record
    opts.extra_env.pop(FAIL_ENV)
    opts.cache_dir = None
    results = build(opts)
    assert [(r.blobs, r.failed) for r in results] == [(2, 0), (2, 0)]
    assert not [s for s in _manifest(tmp_path / "gfx942")["skipped"] if s.get("build_failed")]


def test_runtime_names_a_failed_config(tmp_path):
    from ultraquant.runtime.manifest import Manifest, ManifestIndex

    key = "uq_dequant[D=64](u8)"
    data = {"schema_version": _schema(), "arch": "gfx942", "blobs": [],
            "skipped": [{"op": "dequant_kv", "config": {}, "key": key, "build_failed": True,
                         "reason": "build failed: local memory 8 B not allowed"},
                        {"op": "dequant_kv", "config": {}, "key": key + "x", "reason": "too big"}]}
    index = ManifestIndex([Manifest(arch="gfx942", directory=tmp_path, data=data)])
    entry, why = index.lookup("gfx942", key)
    assert entry is None and "its build failed (build failed: local memory 8 B not allowed)" in why
    assert "by design: too big" in index.lookup("gfx942", key + "x")[1]


def _schema() -> int:
    from ultraquant.kernels.abi import SCHEMA_VERSION

    return SCHEMA_VERSION


@pytest.mark.slow
def test_cli_build_with_a_failing_config_exits_nonzero(tmp_path):
    """The real dequant kernel for gfx942 at one head size and block size: 3 blobs, the fp16 one
    forced to fail; the CLI lists it, exits 1, and leaves the other two verified with a manifest."""
    pytest.importorskip("triton")
    env = {**os.environ, "PYTHONPATH": str(ROOT), FAIL_ENV: "fp16,fp16"}
    env.pop("TRITON_INTERPRET", None)
    out = tmp_path / "gen"
    res = subprocess.run([sys.executable, "-m", "ultraquant.cli", "build", "--arch", "gfx942", "--head-sizes", "64",
                          "--gqa", "1", "--block-sizes", "16", "--ops", "dequant_kv", "--out", str(out),
                          "--no-cache", "-j", "2"], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=900)
    text = res.stdout + res.stderr
    assert res.returncode == 1, text
    assert "1 of 3 blobs failed" in text and "forced failure" in text and "FAILED" in text
    assert "gfx942: 2 blobs (2 compiled, 0 cached, 0 configs skipped, 1 FAILED" in text
    m = _manifest(out / "gfx942")
    assert sorted(b["config"]["out_dtype"] for b in m["blobs"]) == ["bf16", "fp32"]
    assert [s["config"]["out_dtype"] for s in m["skipped"] if s.get("build_failed")] == ["fp16"]
    assert verify_dir(out / "gfx942").ok


BARE_PACKAGES = ("torch", "numpy", "click", "pyelftools", "msgpack")
"""What an install without the build toolchain has: the package's run-time dependencies only."""


@pytest.fixture(scope="module")
def bare_venv(tmp_path_factory) -> Path:
    """A venv with torch, numpy, click, pyelftools and msgpack only (no triton, no flydsl): a real
    ``python -m venv`` without system site-packages, filled by pip from this machine's wheels."""
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    torch_spec = f"torch=={torch.__version__.split('+')[0]}"
    res = subprocess.run([str(py), "-m", "pip", "install", "-q", torch_spec, *BARE_PACKAGES[1:]],
                         capture_output=True, text=True, timeout=900)
    if res.returncode:
        pytest.skip(f"cannot install {BARE_PACKAGES} into a fresh venv here: {res.stderr[-500:]}")
    return venv


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gfx942", "sm_90", "gfx950"])
def test_dry_run_needs_no_compiler(bare_venv, arch, tmp_path):
    py = str(bare_venv / "bin" / "python")
    for module in ("triton", "flydsl"):
        assert subprocess.run([py, "-c", f"import {module}"], capture_output=True).returncode != 0
    # PATH: the venv alone (no ld.lld, no llvm-objdump); PYTHONPATH: this checkout
    env = {"PATH": str(bare_venv / "bin"), "PYTHONPATH": str(ROOT), "HOME": str(tmp_path)}
    res = subprocess.run([py, "-m", "ultraquant.cli", "build", "--arch", arch, "--dry-run"], capture_output=True,
                         text=True, env=env, cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith(f"{arch}: "))
    expected = _dry_run_count(arch)
    assert line.startswith(f"{arch}: {expected} blobs (") and "cache not checked (no compiler here" in line
    assert "selection popular" in res.stderr


def _dry_run_count(arch: str) -> int:
    from ultraquant.codegen.models import make_selection

    usable = ["triton"] + (["flydsl"] if arch.startswith("gfx") else [])
    return len(matrix.expand(matrix.OPS, make_selection(), arch, usable)[0])


def test_dry_run_cache_hits_with_the_compiler(tmp_path):
    """Where the compilers are installed the dry run still reports cache hits (0 in an empty cache)."""
    pytest.importorskip("triton")
    from ultraquant.codegen.archs import parse_arch_list
    from ultraquant.codegen.build import BuildOptions, dry_run

    opts = BuildOptions(archs=parse_arch_list("sm_90"), selection=matrix.Selection(
        head_sizes=(64,), gqa=(1,), block_sizes=(16,), ops=("dequant_kv",)), cache_dir=tmp_path)
    (r,) = dry_run(opts)
    assert r["blobs"] == 3 and r["cached"] == 0 and r["cache_note"] == ""


@pytest.mark.parametrize("case", range(3), ids=lambda i: f"prefill{i}")
def test_amd_prefill_tile_matches_reference(monkeypatch, case):
    """The AMD prefill plan (32 rows at D <= 128, not 64: Triton 3.6 compiles the 64-row tile for
    gfx942 in > 8 CPU-minutes, the 32-row one in ~6 s) in the interpreter, against the reference."""
    from tests import test_kernels_attention as kt
    from ultraquant.kernels import plans
    from ultraquant.kernels.interpret import interpreted_registry

    interpreted_registry()
    monkeypatch.setenv("ULTRAQUANT_BACKEND", "triton")
    monkeypatch.setattr(plans, "target_of", lambda device: "hip")
    lens, q_lens, hq, hk, d, bs, *_ = kt.PREFILL_CASES[case]
    spec = plans.prefill_call_spec(d, hq // hk, bs, "bf16", "bf16", "bf16", False, False, False, None,
                                   torch.device("cpu"))
    assert spec.constexprs["ROWS"] == 32 and not spec.constexprs["FP4_PTX"]
    from ultraquant.kernels.families.prefill import prefill_spec

    assert prefill_spec(head_size=d, gqa=hq // hk, block_size=bs).constexprs["ROWS"] == 64
    kt.test_prefill_matches_reference(monkeypatch, kt.PREFILL_CASES[case], "1")


def _axis_values(row: matrix.OpRow, config: dict) -> dict:
    """A config's value per axis of ``row``, per feature key, and its feature set (by index)."""
    out = {a: config[row.rename.get(a, a)] for a in row.axes}
    feats = [i for i, f in enumerate(row.features) if all(config.get(k) == v for k, v in f.items())
             and all(config.get(k) == row.flag_defaults.get(k) for k in row.flag_defaults if k not in f)]
    out[matrix.FEATURES] = feats[0]
    out.update({k: config[k] for f in row.features for k in f})
    return out


@pytest.mark.parametrize("arch", ["gfx942", "gfx950", "sm_90"])
def test_cover_selection_covers_every_axis_value(arch):
    """Against the full product of the matrix's axes (its own expand, both dtypes): every value of
    every axis and feature set, and every value combination of COVER_INTERACTIONS, is built by MATRIX=cover."""
    from ultraquant.codegen.models import make_selection

    usable = ["triton"] + (["flydsl"] if arch.startswith("gfx") else [])
    cover = make_selection(matrix_name="cover")
    built, skipped = matrix.expand(matrix.OPS, cover, arch, usable)
    universe, _ = matrix.expand(matrix.OPS, matrix.Selection(dtypes=matrix.COVER_DTYPES), arch, usable)
    # the cover is one list for all arches: what it skips here is what SKIPS excludes on this arch
    buildable = {(p.row.op, json.dumps(p.config, sort_keys=True)) for p in universe}
    assert not [s for s in skipped if (s["op"], json.dumps(s["config"], sort_keys=True)) in buildable]
    rows = {p.row.op: p.row for p in universe}
    assert rows.keys() == {p.row.op for p in built}
    for op, row in rows.items():
        want = [_axis_values(row, p.config) for p in universe if p.row.op == op]
        got = [_axis_values(row, p.config) for p in built if p.row.op == op]
        for axis in (*row.axes, matrix.FEATURES):
            assert {v[axis] for v in got} == {v[axis] for v in want}, (op, axis)
        for combo in matrix.COVER_INTERACTIONS[op]:
            assert ({tuple(v[a] for a in combo) for v in got}
                    == {tuple(v[a] for a in combo) for v in want}), (op, combo)
    assert len(built) < len(universe) / 10  # a cover, not the product
    assert set(matrix.COVER_INTERACTIONS) == {r.op for r in matrix.OPS}


def test_cover_cli(tmp_path):
    from click.testing import CliRunner

    from ultraquant.cli import main

    res = CliRunner().invoke(main, ["build", "--arch", "gfx942", "--matrix", "cover", "--dry-run",
                                    "--cache-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    points, _ = matrix.expand(matrix.OPS, matrix.cover_selection(), "gfx942", ["triton", "flydsl"])
    assert "selection cover:" in res.output and f"gfx942: {len(points)} blobs (" in res.output
    res = CliRunner().invoke(main, ["build", "--arch", "gfx942", "--matrix", "cover", "--head-sizes", "64",
                                    "--dry-run"])
    assert res.exit_code != 0 and "only OPS narrows it" in res.output


# --- error texts: the supported head sizes and the CPU engine's block sizes ---------------------------

SERVED = ", ".join(map(str, (64, 128, 256, 512)))


@pytest.mark.parametrize("d", [96, 32, 1024])
def test_head_size_errors_name_the_served_sizes(d):
    from ultraquant.errors import UltraQuantError
    from ultraquant.format import SUPPORTED_HEAD_SIZES
    from ultraquant.vllm import kv_cache_shape, served_head_size

    assert ", ".join(map(str, SUPPORTED_HEAD_SIZES)) == SERVED
    for call in (lambda: served_head_size(d), lambda: kv_cache_shape(4, 16, 2, d)):
        with pytest.raises(UltraQuantError, match=f"serves head sizes {SERVED}, got {d}"):
            call()
    assert served_head_size(128) == 128


def test_format_head_size_error_names_the_served_sizes():
    from ultraquant.errors import UltraQuantError
    from ultraquant.format import check_head_size

    with pytest.raises(UltraQuantError, match=f"the kernels serve {SERVED}\\), got 96"):
        check_head_size(96)


def test_vllm_command_names_head_sizes_and_a_cpu_block_size(tmp_path):
    from click.testing import CliRunner

    from ultraquant.commands import vllm as cmd

    res = CliRunner().invoke(cmd.command, ["--no-register", "--head-size", "96"])
    assert res.exit_code != 0 and f"serves head sizes {SERVED}, got 96" in res.output
    phi = tmp_path / "phi3" / "config.json"
    phi.parent.mkdir()
    phi.write_text(json.dumps({"model_type": "phi3", "hidden_size": 3072, "num_attention_heads": 32,
                               "num_key_value_heads": 32, "torch_dtype": "bfloat16"}))
    res = CliRunner().invoke(cmd.command, ["--no-register", "--model", str(phi)])
    assert res.exit_code != 0 and "head size 96" in res.output and SERVED in res.output
    llama = tmp_path / "llama" / "config.json"
    llama.parent.mkdir()
    llama.write_text(json.dumps({"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32,
                                 "num_key_value_heads": 8, "torch_dtype": "bfloat16"}))
    res = CliRunner().invoke(cmd.command, ["--no-register", "--model", str(llama)])
    assert res.exit_code == 0, res.output
    lines = {ln[:14].strip(): ln[14:].strip() for ln in res.output.splitlines()}
    assert lines["serve (GPU)"].endswith("--block-size 16")  # the blobs' block size (make line: default 16)
    assert "--block-size 128" in lines["serve (CPU)"]       # CPU_ATTN takes multiples of 32
    assert "a CPU engine takes block sizes 32, 64, 128" in res.output
    res = CliRunner().invoke(cmd.command, ["--no-register", "--model", str(llama), "--block-size", "64"])
    assert "--block-size 64" in res.output.split("serve (CPU)")[1] and "a CPU engine takes" not in res.output


@pytest.mark.usefixtures("rt")
def test_a_failed_config_falls_back_and_require_aot_names_it(tmp_path, monkeypatch, caplog):
    """Through the runtime's launch path (fake driver, tests/test_runtime.py): a config the build
    recorded as failed is a miss whose reason names the failure; Triton (False) by default, an error
    under ULTRAQUANT_REQUIRE_AOT=1."""
    import logging

    from tests import test_runtime as trt
    from ultraquant.errors import UltraQuantError
    from ultraquant.runtime import launch

    good, bad = trt.spec(64), trt.spec(128)
    d = trt.write_manifest(tmp_path / "gen", specs=[good])
    m = json.loads((d / "manifest.json").read_text())
    m["skipped"] = [{"op": "test", "config": {}, "key": bad.key(), "build_failed": True,
                     "reason": "build failed: uses local memory {'local': 8}"}]
    (d / "manifest.json").write_text(json.dumps(m))
    caplog.set_level(logging.INFO, logger="ultraquant.runtime")
    assert launch.try_launch(trt.plan(good), 0) is True
    assert launch.try_launch(trt.plan(bad), 0) is False
    assert any("its build failed (build failed: uses local memory" in r.getMessage() for r in caplog.records)
    monkeypatch.setenv("ULTRAQUANT_REQUIRE_AOT", "1")
    launch.reset()
    with pytest.raises(UltraQuantError, match=r"REQUIRE_AOT=1: no usable blob.*its build failed"):
        launch.try_launch(trt.plan(bad), 0)
