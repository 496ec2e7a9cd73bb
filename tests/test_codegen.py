"""AOT generator on a fixture kernel set (tests/codegen_fixture): builds for gfx942, gfx950 and sm_90
on the CPU, checks the manifest against independent readers (llvm-readobj, cuobjdump),
determinism, incremental rebuilds, and that every kind of compiler failure fails the build."""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from ultraquant.codegen import matrix
from ultraquant.codegen.archs import get_arch, parse_arch_list
from ultraquant.codegen.build import BuildError, build
from ultraquant.codegen.elf import ElfError, read_code_object
from ultraquant.codegen.verify import verify_dir
from ultraquant.errors import UltraQuantError
from ultraquant.kernels.abi import SCHEMA_VERSION

triton = pytest.importorskip("triton")
from tests.codegen_fixture import options as _opts  # noqa: E402
from tests.codegen_fixture import plans as fixture  # noqa: E402
from tests.codegen_fixture import shared_build  # noqa: E402


@pytest.fixture(scope="module")
def built() -> Path:
    out = shared_build()
    assert [len(list((out / a).glob("*.cubin"))) for a in ("sm_90",)] == [4]
    return out


def _manifest(d: Path) -> dict:
    return json.loads((d / "manifest.json").read_text())


def test_manifest_fields(built):
    m = _manifest(built / "gfx942")
    assert m["schema_version"] == SCHEMA_VERSION and m["arch"] == "gfx942"
    assert m["toolchain"]["triton"]["triton"] == "3.6.0"
    assert set(m["source_hash"]) == {"triton"}
    keys = [b["key"] for b in m["blobs"]]
    assert keys == sorted(keys) and len(set(keys)) == 4
    b = m["blobs"][0]
    assert b["launch"]["threads"] == 2 * 64 and b["launch"]["grid"] == "(cdiv(n, BLOCK), 1, 1)"
    names = [p["name"] for p in b["params"]]
    assert names == [*fixture.AXPY_SIG, "global_scratch", "profile_scratch"]
    sizes = [p["size"] for p in b["params"]]
    assert sizes == [8, 8, 8, 4, 4, 8, 8, 8]
    assert [p["offset"] for p in b["params"]] == [0, 8, 16, 24, 28, 32, 40, 48]
    assert [p["hidden"] for p in b["params"]][-2:] == [True, True]
    assert b["params"][0]["divisibility"] == 16 and b["params"][3]["divisibility"] == 1
    assert b["code_object_version"] == 5 and b["target"] == "amdgcn-amd-amdhsa--gfx942"
    assert b["resources"]["scratch"] == 0 and b["resources"]["vgpr"] > 0
    sm = _manifest(built / "sm_90")["blobs"][0]
    assert sm["launch"]["threads"] == 64 and sm["elf_abi_version"] == 7
    assert sm["resources"]["registers"] > 0 and sm["kernarg_size"] == 56


def test_keys_are_the_specializers(built):
    for blob in _manifest(built / "sm_90")["blobs"]:
        assert fixture.SPECIALIZERS[blob["op"]](**blob["config"]).key() == blob["key"]


def test_reader_agrees_with_llvm_readobj(built):
    """HSACO header, kernel resources and argument layout as LLVM's own reader prints them."""
    tool = shutil.which("llvm-readobj-22") or shutil.which("llvm-readobj")
    if tool is None:
        pytest.skip("no llvm-readobj")
    names = {"vgpr_count": "vgpr", "sgpr_count": "sgpr", "agpr_count": "agpr", "wavefront_size": "wavefront_size",
             "group_segment_fixed_size": "lds_static", "private_segment_fixed_size": "scratch",
             "kernarg_segment_size": "kernarg_size"}
    for arch in ("gfx942", "gfx950"):
        for blob in _manifest(built / arch)["blobs"]:
            path = built / arch / blob["file"]
            text = subprocess.run([tool, "--file-headers", "--notes", str(path)], capture_output=True, text=True,
                                  check=True).stdout
            obj = read_code_object(path.read_bytes())
            kernel = obj.kernels[blob["symbol"]]
            assert "Machine: EM_AMDGPU" in text
            assert int(re.search(r"Flags \[ \((0x[0-9A-Fa-f]+)\)", text).group(1), 16) == obj.flags
            fields = dict(re.findall(r"^(?:    |  - )\.(\w+):\s+(\S+)$", text, re.M))  # kernel-level keys
            for field, key in names.items():
                assert int(fields[field]) == kernel.resources[key] == blob["resources"][key], field
            args = re.findall(r"\.offset:\s+(\d+)\n\s+\.size:\s+(\d+)\n\s+\.value_kind:\s+(\w+)", text)
            assert [(p.offset, p.size, p.kind) for p in kernel.params] == [(int(o), int(z), k) for o, z, k in args]


def test_reader_agrees_with_cuobjdump(built):
    tool = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    if not tool.exists():
        pytest.skip("no cuobjdump in this triton wheel")
    for blob in _manifest(built / "sm_90")["blobs"]:
        text = subprocess.run([str(tool), "--dump-resource-usage", str(built / "sm_90" / blob["file"])],
                              capture_output=True, text=True, check=True).stdout
        assert f"REG:{blob['resources']['registers']} " in text
        assert f"STACK:{blob['resources']['max_stack']} " in text


def test_elf_reader_rejects_garbage():
    for data in (b"", b"\x7fELF" + b"\0" * 10, b"\x7fELF\x01\x01" + b"\0" * 80):
        with pytest.raises(ElfError):
            read_code_object(data)


def test_elf_reader_fails_cleanly_on_damaged_blobs(built):
    """Truncated or overwritten code objects parse or raise ElfError, never another exception."""
    rng = random.Random(0)
    blobs = [(built / a / b["file"]).read_bytes() for a in ("gfx942", "sm_90") for b in _manifest(built / a)["blobs"]]
    with pytest.raises(ElfError, match="MessagePack"):  # an HSACO whose metadata note is damaged
        data = bytearray(blobs[0])
        start = data.index(b"amdhsa.")
        data[start - 1:start + 64] = b"\xc1" * 65  # from the first key's length byte on
        read_code_object(bytes(data))
    for _ in range(300):
        data = bytearray(rng.choice(blobs))
        if rng.random() < 0.3:
            data = data[:rng.randrange(len(data))]
        else:
            for _ in range(rng.randrange(1, 6)):
                pos = rng.randrange(64) if rng.random() < 0.5 else rng.randrange(len(data))
                data[pos] = rng.randrange(256)
        try:
            read_code_object(bytes(data))
        except ElfError:
            pass


def test_verify_passes(built):
    for arch in ("gfx942", "gfx950", "sm_90"):
        report = verify_dir(built / arch)
        assert report.ok, report.problems
        assert report.blobs == 4


def test_deterministic_and_incremental(built, tmp_path):
    again = tmp_path / "again"
    timings = tmp_path / "new-dir" / "timings.jsonl"
    build(_opts(again, cache=None, timings=timings))
    lines = [json.loads(x) for x in timings.read_text().splitlines()]
    assert len(lines) == 12 and all(x["ok"] and x["seconds"] > 0 for x in lines)
    for arch in ("gfx942", "gfx950", "sm_90"):
        a = sorted(p.name for p in (built / arch).iterdir())
        b = sorted(p.name for p in (again / arch).iterdir())
        assert a == b
        for name in a:
            assert (built / arch / name).read_bytes() == (again / arch / name).read_bytes(), name
    # incremental: the module build's cache serves every blob, nothing recompiles
    inc = tmp_path / "inc"
    results = build(_opts(inc, cache=built.parent / "cache"))
    assert [(r.compiled, r.cached) for r in results] == [(0, 4)] * 3
    assert (inc / "sm_90" / "manifest.json").read_bytes() == (built / "sm_90" / "manifest.json").read_bytes()


def test_narrower_rebuild_removes_stale_blobs(built, tmp_path):
    out = tmp_path / "g"
    shutil.copytree(built / "gfx942", out / "gfx942")
    build(_opts(out, archs="gfx942", cache=built.parent / "cache",
                selection=matrix.Selection(head_sizes=(64,), block_sizes=(16,))))
    assert len(list((out / "gfx942").glob("*.hsaco"))) == 1
    assert verify_dir(out / "gfx942").ok


@pytest.mark.parametrize("op, needle", [("broken", "undefined_name"), ("noisy", "error: simulated"),
                                        ("abort", "worker died")])
def test_compiler_failures_fail_the_build(tmp_path, op, needle):
    with pytest.raises(BuildError) as exc:
        build(_opts(tmp_path, archs="gfx942", rows=fixture.BAD_ROWS[op],
                    selection=matrix.Selection(head_sizes=(64,))))
    assert needle in str(exc.value)
    # the failed config is recorded (no blob), the manifest written (tests/test_build_robustness.py)
    manifest = _manifest(tmp_path / "gfx942")
    assert manifest["blobs"] == [] and [s["build_failed"] for s in manifest["skipped"]] == [True]


def test_duplicate_keys_fail_the_build(tmp_path):
    with pytest.raises(BuildError, match="duplicate key"):
        build(_opts(tmp_path, archs="sm_90", rows=fixture.DUP_ROWS))


def test_matrix_expansion_and_skips():
    sel = matrix.Selection(head_sizes=(96, 128), gqa=(4,), block_sizes=(16, 24))
    points, skipped = matrix.expand(matrix.OPS, sel, "sm_90", ["triton"])
    assert all(p.config["head_size"] == 128 for p in points)
    reasons = {s["reason"] for s in skipped}
    assert any("power of two" in r for r in reasons)
    decode = [p for p in points if p.row.op == "decode_attention"]
    assert len(decode) == len(matrix.ATTENTION_FEATURES)  # one head size, gqa, block size
    assert decode[0].config["query_dtype"] == "bf16" and decode[0].config["has_sinks"] is False
    # a backend that does not target the arch contributes nothing
    assert matrix.expand(matrix.OPS, sel, "sm_90", [])[0] == []


def test_default_matrix_has_unique_keys():
    from ultraquant.codegen.backends import load_backend

    backend = load_backend("triton")
    points, skipped = matrix.expand(matrix.OPS, matrix.Selection(), "gfx942", ["triton"])
    keys = [backend.specialize(p.row.op, p.config).key() for p in points]
    assert len(keys) == len(set(keys)) > 1000
    assert not skipped


def test_selection_parsing_errors():
    with pytest.raises(UltraQuantError, match="HEAD_SIZES"):
        matrix.parse_int_list("64,abc", "HEAD_SIZES", ())
    assert matrix.parse_int_list(" 64, 128,64", "HEAD_SIZES", ()) == (64, 128)
    assert matrix.parse_int_list("", "GQA", (1,)) == (1,)
    with pytest.raises(UltraQuantError, match="OPS"):
        matrix.expand(matrix.OPS, matrix.Selection(ops=("nope",)), "sm_90", ["triton"])
    with pytest.raises(UltraQuantError, match="arch"):
        parse_arch_list("gfx90a")
    assert [a.name for a in parse_arch_list("sm_90, gfx942,sm_90")] == ["sm_90", "gfx942"]
    assert get_arch("sm_90").ext == "cubin"


def test_build_cli_errors_are_clear(tmp_path):
    from click.testing import CliRunner

    from ultraquant.cli import main

    res = CliRunner().invoke(main, ["build", "--arch", "gfx90a", "--out", str(tmp_path)])
    assert res.exit_code != 0 and "unknown 'gfx90a'" in res.output
    res = CliRunner().invoke(main, ["build", "--arch", "sm_90", "--head-sizes", "64,x", "--out", str(tmp_path)])
    assert res.exit_code != 0 and "HEAD_SIZES" in res.output
    res = CliRunner().invoke(main, ["build", "--arch", "sm_90", "--ops", "nope", "--out", str(tmp_path)])
    assert res.exit_code != 0 and "OPS: unknown op" in res.output
    assert not any(tmp_path.iterdir())


def test_spill_budget_from_the_table(monkeypatch):
    point = matrix.MatrixPoint(matrix.OPS[2], {"head_size": 512, "gqa": 8}, "gfx942")
    monkeypatch.setattr(matrix, "SPILLS_ALLOWED", (matrix.SpillAllowance(
        ("decode_attention",), lambda c, a: c["head_size"] == 512, "test", 256),))
    assert point.allows_spills() == ("test", 256)
    monkeypatch.setattr(matrix, "SPILLS_ALLOWED", ())
    assert point.allows_spills() == ("", 0)


def test_manifest_divisibility_is_what_the_compiler_was_told():
    """An integer named in ``Specialization.divisible`` reaches Triton as ``tt.divisibility = 16`` (as
    the JIT specializes a multiple of 16), and the backend reports exactly the attrs it compiled with
    (the manifest's per-parameter ``divisibility``). Compiles in a subprocess: tests run the kernels
    under Triton's interpreter, which cannot compile."""
    import os
    import sys

    from tests.codegen_fixture import ROOT

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    code = "import json; from tests.test_codegen import divisibility_probe as p; print(json.dumps(p()))"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    for told, reported in seen.values():
        assert told == reported
    assert seen["stride"][0] == {**seen[""][0], "stride": 16} and "stride" not in seen[""][0]


def divisibility_probe() -> dict[str, list[dict[str, int]]]:
    """Per ``divisible`` of the fixture axpy (none, ``stride``): [the TTIR's tt.divisibility per
    parameter, the backend's reported divisibility]. Also checks a pointer cannot be named."""
    import dataclasses
    import re

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tests.codegen_fixture import BACKEND_OPTIONS
    from tests.codegen_fixture.kernels import get_kernel
    from ultraquant.codegen.triton_backend import TritonBackend, compile_attrs

    backend = TritonBackend(**BACKEND_OPTIONS["triton"])
    fn = get_kernel("fx_axpy")
    base = fixture.axpy(head_size=64, block_size=16)
    seen = {}
    for s in (base, dataclasses.replace(base, divisible=("stride",))):
        _, info = backend.compile(s, get_arch("sm_90"))
        src = ASTSource(fn, dict(s.signature), dict(s.constexprs), compile_attrs(s, list(fn.arg_names)))
        ttir = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": s.num_warps}).asm["ttir"]
        args = re.search(r"tt\.func public @fx_axpy\((.*?)\) attributes", ttir, re.S).group(1)
        told = {n: int(v) for n, v in re.findall(r"%(\w+): [^{,]+\{tt\.divisibility = (\d+)", args)}
        seen[",".join(s.divisible)] = [told, info["divisibility"]]
    try:
        backend.compile(dataclasses.replace(base, divisible=("x_ptr",)), get_arch("sm_90"))
    except UltraQuantError as exc:
        assert "not integer parameters" in str(exc)
    else:
        raise AssertionError("a pointer named in divisible was accepted")
    return seen
