"""CPU tests of the AOT runtime: manifest selection, argument packing, verdict cache, fallback rules.

A fake driver stands in for libcuda (it records loads and launches, reading back the packed
argument bytes through the pointer array exactly as the real driver would).
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import json
import logging
import struct

import pytest
import torch

from ultraquant import policy
from ultraquant.errors import UltraQuantError
from ultraquant.kernels import catalog, specialization
from ultraquant.kernels.abi import SCHEMA_VERSION
from ultraquant.kernels.families import decode_splitkv as splitkv_family
from ultraquant.kernels.families import decode_wholepage as wholepage_family
from ultraquant.kernels.plans import LaunchPlan
from ultraquant.kernels.specialization import Specialization
from ultraquant.runtime import driver as drv
from ultraquant.runtime import launch, loader, problems
from ultraquant.runtime.manifest import ManifestIndex, find_manifests
from ultraquant.runtime.packing import ArgPacker, Param
from ultraquant.runtime.verdicts import Verdict, VerdictCache

assert problems.decode_problem is problems.PROBLEMS["uq_decode_splitkv"]  # built-ins registered before tests override
SIG = {"x_ptr": "*bf16", "out_ptr": "*fp32", "n": "i32", "stride": "i64", "scale": "fp32", "flag": "i1"}
HIDDEN = [("global_scratch", "*i8"), ("profile_scratch", "*i8")]


def layout(sig: dict[str, str]) -> list[dict]:
    """Natural-alignment kernarg layout of ``sig`` plus Triton's two hidden scratch pointers."""
    out, off = [], 0
    for name, ty in [*sig.items(), *HIDDEN]:
        size = 8 if ty.startswith("*") else {"i1": 1, "i32": 4, "i64": 8, "fp32": 4, "bf16": 2}[ty]
        off = (off + size - 1) // size * size
        out.append({"name": name, "type": ty, "size": size, "offset": off,
                    "hidden": name in dict(HIDDEN)})
        off += size
    return out


def spec(block: int = 64, sig: dict[str, str] | None = None) -> Specialization:
    return Specialization(kernel="uq_test", signature=dict(sig or SIG), constexprs={"BLOCK": block, "D": 128})


def write_manifest(root, arch="sm_90", specs=None, blob=b"\x7fELF fake cubin", **extra):
    """A manifest of real structure (fake bytes) under ``root/arch``; returns the folder."""
    d = root / arch
    d.mkdir(parents=True, exist_ok=True)
    blobs = []
    for i, s in enumerate(specs or [spec()]):
        name = f"{s.kernel}_{i}.cubin"
        data = blob + bytes([i])
        (d / name).write_bytes(data)
        blobs.append({"op": "test", "kernel": s.kernel, "key": s.key(), "constexprs": s.constexprs,
                      "arch": arch, "file": name, "sha256": hashlib.sha256(data).hexdigest(),
                      "symbol": s.kernel, "num_warps": 4, "threads": 128, "shared": 1024,
                      "params": layout(s.signature), **extra})
    (d / "manifest.json").write_text(json.dumps({"schema_version": SCHEMA_VERSION, "arch": arch, "blobs": blobs}))
    return d


class FakeDriver(drv.Driver):
    vendor = "fake"
    driver_version = 12080

    def __init__(self):
        self.loads, self.launches, self._next = [], [], 0x1000

    def load_module(self, device, image):
        self._next += 0x10
        self.loads.append((device, image))
        return self._next

    def get_function(self, device, module, symbol):
        return module + 1

    def launch(self, device, function, grid, block, shared, stream, params):
        self.launches.append({"device": device, "function": function, "grid": grid, "block": block,
                              "shared": shared, "stream": stream,
                              "ptrs": [params[i] for i in range(len(params))]})


class FakeTensor:
    def __init__(self, ptr):
        self.ptr = ptr

    def data_ptr(self):
        return self.ptr


@pytest.fixture
def rt(tmp_path, monkeypatch):
    """A runtime wired to a fake driver, two fake sm_90 devices and a tmp cache dir."""
    fake = FakeDriver()
    monkeypatch.setattr(drv, "_DRIVER", fake)
    monkeypatch.setenv("ULTRAQUANT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("ULTRAQUANT_BACKEND", raising=False)
    monkeypatch.delenv("ULTRAQUANT_REQUIRE_AOT", raising=False)
    monkeypatch.setenv("ULTRAQUANT_GENERATED", str(tmp_path / "gen"))
    for i in (0, 1):
        launch._DEVICES[i] = drv.DeviceInfo(index=i, arch="sm_90", name="NVIDIA H200", uuid=f"GPU-{i}",
                                            driver_version=fake.driver_version)
    monkeypatch.setattr(loader, "_raw_stream_getter", lambda: (lambda dev: 0xABC0 + dev))
    monkeypatch.setattr(loader, "_KERNELS", {})
    monkeypatch.setattr(loader, "_MODULES", {})
    monkeypatch.setattr(loader, "_IMAGES", {})
    monkeypatch.setattr(launch, "_capturing", lambda: False)
    launch.reset()
    yield fake
    launch.reset()
    launch._DEVICES.clear()
    problems.PROBLEMS.pop("uq_test", None)


def args(n=1000):
    return (FakeTensor(0x7F0000001000), FakeTensor(0x7F0000002000), n, 1 << 40, 0.125, True)


def plan(s=None, grid=(16, 2, 1), a=None):
    return LaunchPlan(spec=s or spec(), args=a or args(), grid=grid)


# --- packing ------------------------------------------------------------------------------------------

def _params(sig=SIG):
    return [Param(p["name"], p["type"], p["size"], p["offset"], p["hidden"]) for p in layout(sig)]


def test_pack_places_each_value_at_its_offset_and_hidden_pointers_null():
    packer = ArgPacker(_params(), "k")
    ptrs = packer.pack(args(77))
    buf, _ = packer.buffers()
    base = ctypes.addressof(buf)
    assert [ptrs[i] - base for i in range(len(ptrs))] == [p.offset for p in packer.params]
    got = {p.name: ctypes.string_at(ptrs[i], p.size) for i, p in enumerate(packer.params)}
    assert struct.unpack("<Q", got["x_ptr"])[0] == 0x7F0000001000
    assert struct.unpack("<Q", got["out_ptr"])[0] == 0x7F0000002000
    assert struct.unpack("<i", got["n"])[0] == 77
    assert struct.unpack("<q", got["stride"])[0] == 1 << 40
    assert struct.unpack("<f", got["scale"])[0] == 0.125
    assert got["flag"] == b"\x01"
    assert got["global_scratch"] == got["profile_scratch"] == bytes(8)


def test_pack_reuses_the_thread_buffer_and_overwrites_values():
    packer = ArgPacker(_params(), "k")
    p1 = packer.pack(args(1))
    p2 = packer.pack(args(2))
    assert ctypes.addressof(p1) == ctypes.addressof(p2)
    assert struct.unpack("<i", ctypes.string_at(p2[2], 4))[0] == 2


def test_pack_bf16_and_none_pointer():
    sig = {"p": "*u8", "s": "bf16"}
    packer = ArgPacker(_params(sig), "k")
    ptrs = packer.pack((None, 1.0 + 2 ** -8 + 2 ** -12))  # rounds up to the next bf16
    assert ctypes.string_at(ptrs[0], 8) == bytes(8)
    assert struct.unpack("<H", ctypes.string_at(ptrs[1], 2))[0] == 0x3F81
    assert struct.unpack("<H", ctypes.string_at(packer.pack((0, 1.0 + 2 ** -8))[1], 2))[0] == 0x3F80


@pytest.mark.parametrize("mutate, message", [
    (lambda ps: ps.__setitem__(2, Param("n", "i32", 8, ps[2].offset)), "has size 8, expected 4"),
    (lambda ps: ps.__setitem__(3, Param("stride", "i64", 8, 12)), "not aligned"),
    (lambda ps: ps.__setitem__(1, Param("out_ptr", "*fp32", 8, 0)), "overlaps"),
    (lambda ps: ps.__setitem__(2, Param("n", "tensordesc", 4, ps[2].offset)), "not supported"),
])
def test_bad_layouts_are_refused(mutate, message):
    ps = _params()
    mutate(ps)
    with pytest.raises(UltraQuantError, match=message):
        ArgPacker(ps, "k")


def test_pack_checks_arity_range_and_divisibility():
    ps = _params()
    ps[0] = Param("x_ptr", "*bf16", 8, 0, divisibility=16)
    packer = ArgPacker(ps, "k")
    with pytest.raises(UltraQuantError, match="got 2 arguments, the blob takes 6"):
        packer.pack(args()[:2])
    with pytest.raises(UltraQuantError, match="'x_ptr'.*multiple of 16"):
        packer.pack((FakeTensor(0x1008), *args()[1:]))
    with pytest.raises(UltraQuantError, match="does not fit"):
        packer.pack((*args()[:2], 1 << 33, *args()[3:]))


# --- manifest selection ------------------------------------------------------------------------------

def test_index_exact_hit_and_config_miss(tmp_path, monkeypatch):
    monkeypatch.setenv("ULTRAQUANT_GENERATED", str(tmp_path))
    write_manifest(tmp_path, specs=[spec(64), spec(32)])
    idx = ManifestIndex.discover()
    e, why = idx.lookup("sm_90", spec(32).key())
    assert e is not None and why == "" and e.key == spec(32).key() and e.constexprs["BLOCK"] == 32
    assert e.signature == SIG and e.threads == 128 and e.shared == 1024
    e, why = idx.lookup("sm_90", spec(128).key())
    assert e is None and "no sm_90 blob for config uq_test[BLOCK=128,D=128]" in why


def test_index_arch_mismatch_names_what_exists(tmp_path, monkeypatch):
    monkeypatch.setenv("ULTRAQUANT_GENERATED", str(tmp_path))
    write_manifest(tmp_path, arch="gfx942")
    e, why = ManifestIndex.discover().lookup("sm_90", spec().key())
    assert e is None and "no blobs built for arch sm_90 (found: gfx942)" in why


def test_index_rejects_duplicates_and_foreign_arch_entries(tmp_path, monkeypatch):
    monkeypatch.setenv("ULTRAQUANT_GENERATED", str(tmp_path))
    write_manifest(tmp_path, specs=[spec(64), spec(64)])
    write_manifest(tmp_path, arch="gfx950")
    m = json.loads((tmp_path / "gfx950/manifest.json").read_text())
    m["blobs"][0]["arch"] = "gfx942"
    (tmp_path / "gfx950/manifest.json").write_text(json.dumps(m))
    idx = ManifestIndex.discover()
    e, why = idx.lookup("sm_90", spec(64).key())
    assert e is None and "duplicate key uq_test[BLOCK=64,D=128]" in why
    e, why = idx.lookup("gfx950", spec(64).key())
    assert e is None and "says arch gfx942" in why


def test_index_rejects_unknown_schema_and_missing_fields(tmp_path, monkeypatch):
    monkeypatch.setenv("ULTRAQUANT_GENERATED", str(tmp_path))
    write_manifest(tmp_path)
    m = json.loads((tmp_path / "sm_90/manifest.json").read_text())
    m["schema_version"] = 99
    (tmp_path / "sm_90/manifest.json").write_text(json.dumps(m))
    assert "schema_version 99" in ManifestIndex.discover().lookup("sm_90", spec().key())[1]
    m["schema_version"] = SCHEMA_VERSION
    del m["blobs"][0]["sha256"]
    (tmp_path / "sm_90/manifest.json").write_text(json.dumps(m))
    assert "missing field 'sha256'" in ManifestIndex.discover().lookup("sm_90", spec().key())[1]


def test_first_search_root_wins(tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    write_manifest(a, specs=[spec(64)])
    write_manifest(b, specs=[spec(32)])
    monkeypatch.setenv("ULTRAQUANT_GENERATED", f"{a}:{b}")
    ms = [m for m in find_manifests() if m.arch == "sm_90"]
    assert len(ms) == 1 and ms[0].directory == a / "sm_90"


@pytest.mark.parametrize("name", ["../outside.cubin", "/etc/passwd", "sub/x.cubin", "..", ".", "",
                                  "a\\b.cubin", "C:x.cubin", 7])
def test_manifest_file_names_must_be_plain_names_inside_the_folder(rt, tmp_path, monkeypatch, caplog, name):
    """Issue 17, item 3: the runtime refuses what `ultraquant verify` refuses, before reading anything."""
    d = write_manifest(tmp_path / "gen")
    (tmp_path / "outside.cubin").write_bytes(b"\x7fELF fake cubin\x00")
    m = json.loads((d / "manifest.json").read_text())
    m["blobs"][0]["file"] = name
    (d / "manifest.json").write_text(json.dumps(m))
    caplog.set_level(logging.WARNING, logger="ultraquant.runtime")
    assert launch.try_launch(plan(), 0) is False and not rt.loads and not loader._IMAGES
    assert "plain file name" in launch.state()[(0, spec().key())].reason or "non-empty string" in \
        launch.state()[(0, spec().key())].reason
    monkeypatch.setenv("ULTRAQUANT_REQUIRE_AOT", "1")
    launch.reset()
    with pytest.raises(UltraQuantError, match="manifest.*(plain file name|non-empty string)"):
        launch.try_launch(plan(), 0)


def test_a_blob_that_is_a_link_loop_is_refused(rt, tmp_path):
    d = write_manifest(tmp_path / "gen")
    (d / "uq_test_0.cubin").unlink()
    (d / "uq_test_0.cubin").symlink_to(d / "uq_test_0.cubin")
    assert launch.try_launch(plan(), 0) is False and not rt.loads
    assert "uq_test_0.cubin" in launch.state()[(0, spec().key())].reason


def test_a_blob_linked_out_of_the_folder_is_refused(rt, tmp_path):
    d = write_manifest(tmp_path / "gen")
    outside = tmp_path / "outside.cubin"
    outside.write_bytes((d / "uq_test_0.cubin").read_bytes())
    (d / "uq_test_0.cubin").unlink()
    (d / "uq_test_0.cubin").symlink_to(outside)
    assert launch.try_launch(plan(), 0) is False and not rt.loads
    assert "outside the blob folder" in launch.state()[(0, spec().key())].reason


def _break(d, how):
    path = d / "manifest.json"
    text = path.read_text()
    m = json.loads(text)
    b = m["blobs"][0]
    if how == "truncated":
        path.write_text(text[: len(text) // 2])
        return
    if how == "top-level list":
        m = [m]
    elif how == "blobs not a list":
        m["blobs"] = {"x": b}
    elif how == "entry a string":
        m["blobs"][0] = "uq_test_0.cubin"
    elif how == "params not a list":
        b["params"] = 3
    elif how == "param not an object":
        b["params"][0] = "x_ptr"
    elif how == "size a string":
        b["params"][0]["size"] = "8"
    elif how == "num_warps null":
        b["num_warps"] = None
    elif how == "sha256 a number":
        b["sha256"] = 12
    elif how == "unknown param type":
        b["params"][0]["type"] = "*complex128"
        b["params"][0]["size"] = 8
        b["params"][1]["type"] = "q8"
    elif how == "constexprs a list":
        b["constexprs"] = [1, 2]
    elif how == "arch a number":
        m["arch"] = 90
    elif how == "negative threads":
        b["threads"] = -128
    elif how == "skipped garbage":
        m["skipped"] = 5
        m["blobs"] = []
    path.write_text(json.dumps(m))


BROKEN = ["truncated", "top-level list", "blobs not a list", "entry a string", "params not a list",
          "param not an object", "size a string", "num_warps null", "sha256 a number", "unknown param type",
          "constexprs a list", "arch a number", "negative threads", "skipped garbage"]


@pytest.mark.parametrize("how", BROKEN)
def test_any_manifest_problem_is_one_warning_and_a_fallback(rt, tmp_path, monkeypatch, caplog, how):
    """Issue 17, item 4: never a JSONDecodeError/AttributeError out of try_launch; a warning once,
    the Triton path (False), and a clear UltraQuantError under REQUIRE_AOT=1 or BACKEND=aot."""
    _break(write_manifest(tmp_path / "gen"), how)
    caplog.set_level(logging.INFO, logger="ultraquant.runtime")
    for _ in range(3):
        assert launch.try_launch(plan(), 0) is False
    assert not rt.loads
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    if how != "skipped garbage":  # an empty manifest with a garbage 'skipped' row is just "not built"
        assert len(warnings) == 1 and "sm_90" in warnings[0].getMessage(), [r.getMessage() for r in warnings]
    for name, value in (("ULTRAQUANT_REQUIRE_AOT", "1"), ("ULTRAQUANT_BACKEND", "aot")):
        monkeypatch.setenv(name, value)
        launch.reset()
        with pytest.raises(UltraQuantError, match="no usable blob"):
            launch.try_launch(plan(), 0)
        with pytest.raises(UltraQuantError, match="no usable blob"):
            launch.warmup([spec()], 0)
        monkeypatch.delenv(name)


def test_verify_device_reports_a_broken_manifest(rt, tmp_path):
    from ultraquant.runtime import devcheck

    _break(write_manifest(tmp_path / "gen"), "truncated")
    arch, rows = devcheck.verify_device(0)
    assert [(r.status, r.file) for r in rows] == [("REFUSED", "manifest.json")] and "not valid JSON" in rows[0].detail


# --- verdict cache ------------------------------------------------------------------------------------

def _dev(uuid="GPU-0", driver=12080, name="NVIDIA H200"):
    return drv.DeviceInfo(index=0, arch="sm_90", name=name, uuid=uuid, driver_version=driver)


K = "uq_test[BLOCK=64,D=128](bf16,fp32)"


def test_verdicts_roundtrip_and_are_per_key_version_device_driver_and_model(tmp_path):
    c = VerdictCache(tmp_path / "v.json")
    c.put(K, "ab" * 32, 2, _dev(), Verdict(ok=False, detail="max err 3.0"))
    fresh = VerdictCache(tmp_path / "v.json")
    v = fresh.get(K, "ab" * 32, 2, _dev())
    assert v is not None and not v.ok and v.detail == "max err 3.0" and v.when > 0
    assert fresh.get(K, "ab" * 32, 2, _dev(uuid="GPU-1")) is None
    assert fresh.get(K, "ab" * 32, 2, _dev(driver=13000)) is None
    assert fresh.get(K, "ab" * 32, 2, _dev(name="NVIDIA H100")) is None
    assert fresh.get(K, "cd" * 32, 2, _dev()) is None
    assert fresh.get("uq_test[BLOCK=32,D=128](bf16,fp32)", "ab" * 32, 2, _dev()) is None  # same bytes, other key
    assert fresh.get(K, "ab" * 32, 3, _dev()) is None  # problems changed since


def test_verdicts_merge_concurrent_writers_and_survive_garbage(tmp_path):
    p = tmp_path / "v.json"
    a, b = VerdictCache(p), VerdictCache(p)
    a.get(K, "00", 1, _dev())
    b.put(K, "11", 1, _dev(), Verdict(ok=True, detail=""))
    a.put(K, "22", 1, _dev(), Verdict(ok=True, detail=""))
    fresh = VerdictCache(p)
    assert fresh.get(K, "11", 1, _dev()).ok and fresh.get(K, "22", 1, _dev()).ok
    p.write_text("{not json")
    assert VerdictCache(p).get(K, "11", 1, _dev()) is None


def test_verdict_cache_follows_env(tmp_path, monkeypatch):
    monkeypatch.setenv("ULTRAQUANT_CACHE_DIR", str(tmp_path / "x"))
    c = VerdictCache()
    c.put(K, "11", 1, _dev(), Verdict(ok=True, detail=""))
    assert (tmp_path / "x/selftest-v2.json").exists()
    monkeypatch.setenv("ULTRAQUANT_CACHE_DIR", str(tmp_path / "y"))
    assert c.get(K, "11", 1, _dev()) is None


def test_selftest_version_is_bumped_with_the_problems():
    """runtime/problems.py changed without updating PROBLEMS_SOURCE_SHA256 (and so, presumably,
    without bumping SELFTEST_VERSION): bump the version if what a self-test launches or accepts
    changed, then record ``problems.source_hash()`` beside it."""
    assert problems.source_hash() == problems.PROBLEMS_SOURCE_SHA256, (
        f"runtime/problems.py changed: bump SELFTEST_VERSION (now {problems.SELFTEST_VERSION}) if the "
        f"problems changed, and set PROBLEMS_SOURCE_SHA256 = {problems.source_hash()!r}")


def test_selftest_version_is_part_of_the_verdict(rt, tmp_path, monkeypatch):
    write_manifest(tmp_path / "gen")
    calls = []
    problems.PROBLEMS["uq_test"] = lambda kernel, s, dev: (calls.append(dev) or True, "")
    assert launch.try_launch(plan(), 0) and calls == [0]
    launch.reset()
    assert launch.try_launch(plan(), 0) and calls == [0]  # cached
    monkeypatch.setattr(problems, "SELFTEST_VERSION", problems.SELFTEST_VERSION + 1)
    launch.reset()
    assert launch.try_launch(plan(), 0) and calls == [0, 0]  # new problems: tested again


# --- try_launch: hit, miss, switches, refusal, self-test, capture, devices --------------------------

def test_hit_launches_with_manifest_geometry_on_current_stream(rt, tmp_path):
    write_manifest(tmp_path / "gen")
    assert launch.try_launch(plan(), 1) is True
    (call,) = rt.launches
    assert call["device"] == 1 and call["grid"] == (16, 2, 1) and call["block"] == 128
    assert call["shared"] == 1024 and call["stream"] == 0xABC1
    assert struct.unpack("<i", ctypes.string_at(call["ptrs"][2], 4))[0] == 1000
    assert len(rt.loads) == 1
    launch.try_launch(plan(a=args(5)), 1)
    assert len(rt.loads) == 1 and len(rt.launches) == 2  # loaded once


def test_identical_blobs_under_two_keys_share_one_module_but_not_a_verdict(rt, tmp_path):
    d = write_manifest(tmp_path / "gen", specs=[spec(16), spec(32)])
    m = json.loads((d / "manifest.json").read_text())
    m["blobs"][1]["file"], m["blobs"][1]["sha256"] = m["blobs"][0]["file"], m["blobs"][0]["sha256"]
    (d / "manifest.json").write_text(json.dumps(m))
    seen = []
    problems.PROBLEMS["uq_test"] = lambda kernel, s, dev: (seen.append(kernel.entry.key) or True, "")
    assert launch.try_launch(plan(spec(16)), 0) and launch.try_launch(plan(spec(32)), 0)
    # one module; the verdict belongs to (key, bytes): the second key is tested as itself
    assert len(rt.loads) == 1 and seen == [spec(16).key(), spec(32).key()]
    k16, k32 = (launch.state()[(0, s.key())] for s in (spec(16), spec(32)))
    assert k16.entry.key != k32.entry.key and k16.function == k32.function


def test_a_key_pointing_at_a_blob_that_passed_under_another_key_is_tested_as_itself(rt, tmp_path):
    """Issue 17, item 5: the rne store key pointing at the upstream-encoder blob must not inherit the
    upstream key's cached pass."""
    d = write_manifest(tmp_path / "gen", specs=[spec(16), spec(32)])
    problems.PROBLEMS["uq_test"] = lambda kernel, s, dev: (
        kernel.entry.sha256 == json.loads((d / "manifest.json").read_text())["blobs"][0]["sha256"]
        and s.constexprs["BLOCK"] == 16, "wrong kernel for this key")
    assert launch.try_launch(plan(spec(16)), 0) is True  # a pass recorded for blob 0 as BLOCK=16
    m = json.loads((d / "manifest.json").read_text())
    m["blobs"][1]["file"], m["blobs"][1]["sha256"] = m["blobs"][0]["file"], m["blobs"][0]["sha256"]
    (d / "manifest.json").write_text(json.dumps(m))
    launch.reset()
    assert launch.try_launch(plan(spec(32)), 0) is False
    assert "self-test failed" in launch.state()[(0, spec(32).key())].reason


def test_modules_are_per_device(rt, tmp_path):
    write_manifest(tmp_path / "gen")
    launch.try_launch(plan(), 0)
    launch.try_launch(plan(), 1)
    launch.try_launch(plan(), 0)
    assert [d for d, _ in rt.loads] == [0, 1]
    k0 = launch.state()[(0, spec().key())]
    k1 = launch.state()[(1, spec().key())]
    assert k0.module != k1.module and k0.device == 0 and k1.device == 1
    assert [c["function"] for c in rt.launches] == [k0.function, k1.function, k0.function]
    assert [c["device"] for c in rt.launches] == [0, 1, 0]


def test_miss_falls_back_and_logs_once(rt, tmp_path, caplog):
    write_manifest(tmp_path / "gen")
    caplog.set_level(logging.INFO, logger="ultraquant.runtime")
    for _ in range(3):
        assert launch.try_launch(plan(spec(32)), 0) is False
    msgs = [r.getMessage() for r in caplog.records if "AOT miss" in r.getMessage()]
    assert len(msgs) == 1 and "uq_test[BLOCK=32,D=128]" in msgs[0] and not rt.launches


def test_require_aot_turns_a_miss_into_an_error(rt, tmp_path, monkeypatch):
    write_manifest(tmp_path / "gen", arch="gfx942")
    monkeypatch.setenv("ULTRAQUANT_REQUIRE_AOT", "1")
    with pytest.raises(UltraQuantError, match="REQUIRE_AOT=1: no usable blob.*no blobs built for arch sm_90"):
        launch.try_launch(plan(), 0)
    with pytest.raises(UltraQuantError, match="REQUIRE_AOT"):
        launch.warmup([spec()], 0)


@pytest.mark.parametrize("mode", ["triton", "reference"])
def test_backend_switch_skips_blobs(rt, tmp_path, monkeypatch, mode):
    write_manifest(tmp_path / "gen")
    monkeypatch.setenv("ULTRAQUANT_BACKEND", mode)
    assert launch.try_launch(plan(), 0) is False and not rt.loads
    monkeypatch.setenv("ULTRAQUANT_REQUIRE_AOT", "1")
    with pytest.raises(UltraQuantError, match="contradicts"):
        launch.try_launch(plan(), 0)


def test_bad_backend_name_is_an_error(rt, monkeypatch):
    monkeypatch.setenv("ULTRAQUANT_BACKEND", "cuda")
    with pytest.raises(UltraQuantError, match="ULTRAQUANT_BACKEND"):
        launch.try_launch(plan(), 0)


def test_aot_backend_uses_blobs_and_a_miss_raises(rt, tmp_path, monkeypatch):
    write_manifest(tmp_path / "gen")
    monkeypatch.setenv("ULTRAQUANT_BACKEND", "aot")
    assert launch.try_launch(plan(), 0) is True
    with pytest.raises(UltraQuantError, match="BACKEND=aot.*no sm_90 blob for config"):
        launch.try_launch(plan(spec(32)), 0)


class _Dev:
    def __init__(self, type_, index):
        self.type, self.index = type_, index


class DevTensor(FakeTensor):
    def __init__(self, ptr, device):
        super().__init__(ptr)
        self.device = device


def test_device_comes_from_the_plan_tensors(rt, tmp_path, monkeypatch):
    write_manifest(tmp_path / "gen")
    a = args()
    on1 = (DevTensor(0x7F0000001000, _Dev("cuda", 1)), *a[1:])
    assert launch.try_launch(plan(a=on1)) is True and rt.launches[-1]["device"] == 1
    on_cpu = (DevTensor(0x7F0000001000, _Dev("cpu", None)), *a[1:])
    assert launch.try_launch(plan(a=on_cpu)) is False
    monkeypatch.setenv("ULTRAQUANT_BACKEND", "aot")
    with pytest.raises(UltraQuantError, match="not on a GPU"):
        launch.try_launch(plan(a=on_cpu))


def test_corrupted_blob_is_refused_with_a_warning(rt, tmp_path, caplog):
    d = write_manifest(tmp_path / "gen")
    (d / "uq_test_0.cubin").write_bytes(b"tampered")
    caplog.set_level(logging.WARNING, logger="ultraquant.runtime")
    assert launch.try_launch(plan(), 0) is False and not rt.loads
    assert any("sha256" in r.getMessage() and "corrupted" in r.getMessage() for r in caplog.records)


def test_stale_signature_is_a_miss(rt, tmp_path):
    write_manifest(tmp_path / "gen")
    new_sig = {**SIG, "extra": "i32"}
    s = Specialization(kernel="uq_test", signature=new_sig, constexprs=spec().constexprs)
    assert launch.try_launch(plan(s, a=(*args(), 3)), 0) is False
    assert "stale blobs" in launch.state()[(0, s.key())].reason


def test_dtype_variants_of_one_key_resolve_separately(rt, tmp_path):
    write_manifest(tmp_path / "gen")  # built for x_ptr: *bf16
    fp16 = Specialization(kernel="uq_test", signature={**SIG, "x_ptr": "*fp16"}, constexprs=spec().constexprs)
    assert fp16.key() != spec().key()  # the key names the pointer dtypes: an fp16 blob may sit beside
    assert launch.try_launch(plan(fp16), 0) is False  # ...and this manifest has none
    assert launch.try_launch(plan(), 0) is True  # and the bf16 call still gets its blob
    assert launch.try_launch(plan(fp16), 0) is False


def test_scratch_or_cluster_blobs_are_refused(rt, tmp_path):
    write_manifest(tmp_path / "gen", global_scratch_size=256)
    assert launch.try_launch(plan(), 0) is False
    assert "global scratch" in launch.state()[(0, spec().key())].reason


def test_failing_selftest_disables_blob_and_verdict_is_cached_per_device(rt, tmp_path):
    write_manifest(tmp_path / "gen")
    calls = []

    def problem(kernel, s, dev):
        calls.append(dev)
        kernel.launch(args(), (1, 1, 1))
        return dev != 1, f"device {dev}"

    problems.PROBLEMS["uq_test"] = problem
    assert launch.try_launch(plan(), 0) is True
    assert launch.try_launch(plan(), 1) is False
    assert "self-test failed" in launch.state()[(1, spec().key())].reason
    assert calls == [0, 1]
    # A new process (reset) trusts the cache: no rerun; device 1 is not even loaded again.
    launch.reset()
    loader.forget()
    rt.loads.clear()
    assert launch.try_launch(plan(), 0) is True and launch.try_launch(plan(), 1) is False
    assert calls == [0, 1] and [d for d, _ in rt.loads] == [0]
    assert "failed on this GPU earlier" in launch.state()[(1, spec().key())].reason


def test_selftest_exception_is_a_failed_verdict(rt, tmp_path):
    write_manifest(tmp_path / "gen")

    def problem(kernel, s, dev):
        raise RuntimeError("illegal value")

    problems.PROBLEMS["uq_test"] = problem
    assert launch.try_launch(plan(), 0) is False
    assert "RuntimeError: illegal value" in launch.state()[(0, spec().key())].reason


def test_first_use_during_capture_raises_and_warmup_fixes_it(rt, tmp_path, monkeypatch):
    write_manifest(tmp_path / "gen")
    monkeypatch.setattr(launch, "_capturing", lambda: True)
    with pytest.raises(UltraQuantError, match=r"warmup"):
        launch.try_launch(plan(), 0)
    monkeypatch.setattr(launch, "_capturing", lambda: False)
    report = launch.warmup([spec(), plan(spec(32))], 0)
    assert report == {spec().key(): "aot", spec(32).key(): launch.state()[(0, spec(32).key())].reason}
    monkeypatch.setattr(launch, "_capturing", lambda: True)
    assert launch.try_launch(plan(), 0) is True  # loaded: no driver work besides the launch
    assert launch.try_launch(plan(spec(32)), 0) is False  # a known miss is fine during capture


def test_warmup_rejects_unknown_config_types(rt):
    with pytest.raises(UltraQuantError, match="configs"):
        launch.warmup([42], 0)


def test_misaligned_pointer_falls_back_instead_of_failing(rt, tmp_path, monkeypatch):
    d = write_manifest(tmp_path / "gen")
    m = json.loads((d / "manifest.json").read_text())
    m["blobs"][0]["params"][0]["divisibility"] = 16
    (d / "manifest.json").write_text(json.dumps(m))
    odd = (FakeTensor(0x7F0000001002), *args()[1:])
    assert launch.try_launch(plan(a=odd), 0) is False and not rt.launches
    assert launch.try_launch(plan(), 0) is True  # aligned calls still use the blob
    monkeypatch.setenv("ULTRAQUANT_REQUIRE_AOT", "1")
    with pytest.raises(UltraQuantError, match="multiple of 16"):
        launch.try_launch(plan(a=odd), 0)


def test_skipped_configs_say_so(rt, tmp_path, monkeypatch):
    from ultraquant.kernels.families import decode_splitkv as splitkv_family

    d = write_manifest(tmp_path / "gen")
    m = json.loads((d / "manifest.json").read_text())
    cfg = {"head_size": 128, "gqa": 4, "block_size": 16}
    m["skipped"] = [{"op": "decode_attention", "config": cfg, "reason": "too many registers"}]
    (d / "manifest.json").write_text(json.dumps(m))
    s = splitkv_family.decode_splitkv_spec(**cfg)
    e, why = ManifestIndex.discover().lookup("sm_90", s.key())
    assert e is None and "not built for sm_90 by design: too many registers" in why


def test_verify_device_table(rt, tmp_path):
    from ultraquant.runtime import devcheck

    d = write_manifest(tmp_path / "gen", specs=[spec(16), spec(32), spec(64)])
    (d / "uq_test_0.cubin").write_bytes(b"tampered")
    problems.PROBLEMS["uq_test"] = lambda kernel, s, dev: (s.constexprs["BLOCK"] != 32, "checked")
    # A cached failure must not stop verify from retesting (and re-enabling) a blob.
    launch.try_launch(plan(spec(32)), 0)
    arch, rows = devcheck.verify_device(0)
    assert arch == "sm_90"
    assert [(r.key, r.status) for r in rows] == [
        (spec(16).key(), "REFUSED"), (spec(32).key(), "FAIL"), (spec(64).key(), "pass")]
    assert "sha256" in rows[0].detail
    text = devcheck.format_table(arch, "NVIDIA H200", rows)
    assert "3 blobs for sm_90 on NVIDIA H200: 1 pass, 2 failed or refused" in text
    problems.PROBLEMS["uq_test"] = lambda kernel, s, dev: (True, "fixed")
    _, rows = devcheck.verify_device(0)
    assert [r.status for r in rows] == ["REFUSED", "pass", "pass"]
    assert launch.try_launch(plan(spec(32)), 0) is True  # re-enabled by the fresh verdict


def test_cli_verify_device(rt, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from ultraquant.cli import main

    d = write_manifest(tmp_path / "elsewhere", specs=[spec(16), spec(64)])
    problems.PROBLEMS["uq_test"] = lambda kernel, s, dev: (True, "ok")
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    r = CliRunner().invoke(main, ["verify", "--device", "1", str(d)])
    assert r.exit_code == 0, r.output
    assert "2 blobs for sm_90 on cuda:1 NVIDIA H200: 2 pass, 0 failed or refused" in r.output
    assert {dev for dev, _ in rt.loads} == {1}
    problems.PROBLEMS["uq_test"] = lambda kernel, s, dev: (s.constexprs["BLOCK"] == 16, "max err 9")
    r = CliRunner().invoke(main, ["verify", "--device", "cuda:1", str(d)])
    assert r.exit_code == 1 and "FAIL" in r.output and "max err 9" in r.output
    r = CliRunner().invoke(main, ["verify", "--device", "gpu-one", str(d)])
    assert r.exit_code == 2


def test_cli_verify_device_without_gpu(monkeypatch):
    from click.testing import CliRunner

    from ultraquant.cli import main

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    r = CliRunner().invoke(main, ["verify", "--device"])
    assert r.exit_code == 2 and "no GPU" in r.output


def test_fast_pack_equals_slow_pack_for_tensors_ints_none_and_subclasses():
    import torch

    sig = {"a": "*fp32", "b": "*u8", "c": "*i32", "n": "i32", "x": "fp32", "h": "bf16", "q": "i64"}
    ps = [Param(p.name, p.type, p.size, p.offset, p.hidden, 16 if p.type.startswith("*") else 1)
          for p in _params(sig)]
    packer = ArgPacker(ps, "k")
    t = torch.zeros(8)
    args_ = (t, torch.nn.Parameter(torch.zeros(4)), None, -5, 1.5, 3.25, -(1 << 40))
    fast = bytes(ctypes.string_at(ctypes.addressof(packer.buffers()[0]), packer.size)) if packer.pack(args_) \
        else None
    packer.buffers()[0][:] = bytes(packer.size)
    packer.pack_slow(args_)
    slow = bytes(ctypes.string_at(ctypes.addressof(packer.buffers()[0]), packer.size))
    assert fast == slow and struct.unpack_from("<Q", fast, 0)[0] == t.data_ptr()
    with pytest.raises(UltraQuantError, match="'c'.*multiple of 16"):
        packer.pack((t, t, 0x1004, -5, 1.5, 3.25, 0))


def test_warmup_accepts_a_model_config(rt, tmp_path):
    cfg = {"head_size": 128, "num_q_heads": 32, "num_kv_heads": 8, "block_size": 16, "dtype": "bf16",
           "has_sinks": True}
    need = policy.model_specializations(cfg, 0)
    kinds = [s.kernel for s in need]
    assert kinds[:3] + kinds[4:] == ["uq_store_kv", "uq_store_kv", "uq_dequant_kv", "uq_prefill"]
    if specialization.target_of(torch.device("cuda", 0)) == "cuda":  # the dense (token-major) cache: whole-page
        assert need[3].key() == wholepage_family.decode_wholepage_spec(
            head_size=128, gqa=4, num_kv_heads=8, block_size=16, has_sinks=True, token_major=True).key()
    else:
        assert need[3].key() == splitkv_family.decode_splitkv_spec(
            head_size=128, gqa=4, block_size=16, has_sinks=True,
            target=specialization.target_of(torch.device("cuda", 0))).key()
    write_manifest(tmp_path / "gen")  # none of these are built: every entry is a reason
    report = policy.warmup([cfg], 0)
    assert set(report) == {s.key() for s in need} and all(v != "aot" for v in report.values())


def test_policy_consults_the_runtime_first(monkeypatch):
    """The public ops reach try_launch through ultraquant.policy (here: CPU tensors under
    ULTRAQUANT_BACKEND=aot, which the runtime refuses with its own message)."""
    import torch

    import ultraquant as uq

    monkeypatch.setenv("ULTRAQUANT_BACKEND", "aot")
    key = torch.randn(3, 2, 64)
    cache = torch.zeros(2, 16, 2, uq.slot_size(64), dtype=torch.uint8)
    with pytest.raises(UltraQuantError, match="uq_store_kv was called with tensors that are not on a GPU"):
        uq.store_kv(key, key, cache, torch.arange(3))


def _decode_like(kernel="uq_decode_splitkv"):
    return Specialization(kernel=kernel, signature=dict(SIG), constexprs={"BLOCK": 64, "D": 128})


def test_flydsl_alternate_is_preferred_and_a_failing_one_falls_back(rt, tmp_path, monkeypatch):
    for i in (0, 1):
        launch._DEVICES[i] = drv.DeviceInfo(index=i, arch="gfx942", name="AMD Instinct MI300X",
                                            uuid=f"GPU-{i}", driver_version=60342)
    d = write_manifest(tmp_path / "gen", arch="gfx942",
                       specs=[_decode_like(), _decode_like("uq_decode_flydsl")])
    m = json.loads((d / "manifest.json").read_text())
    m["blobs"][1].update(threads=64, alternate_of="uq_decode_splitkv", priority=1)
    (d / "manifest.json").write_text(json.dumps(m))
    tested = []
    # a stand-in takes its original's problem: here it fails for the FlyDSL blob on device 1 only
    monkeypatch.setitem(problems.PROBLEMS, "uq_decode_splitkv", lambda kernel, s, dev: (
        tested.append((kernel.entry.kernel, dev)) or dev == 0 or kernel.entry.kernel == "uq_decode_splitkv", "check"))
    assert launch.try_launch(plan(_decode_like()), 0) is True
    assert rt.launches[-1]["block"] == 64  # the FlyDSL blob, with its own block size
    assert launch.try_launch(plan(_decode_like()), 1) is True
    assert rt.launches[-1]["block"] == 128  # its self-test failed on device 1: the Triton blob
    assert tested == [("uq_decode_flydsl", 0), ("uq_decode_flydsl", 1), ("uq_decode_splitkv", 1)]


# --- alignment facts in the key (issue 14, gate 0) -----------------------------------------------------

def _aligned(s: Specialization, names=("stride",)) -> Specialization:
    return dataclasses.replace(s, divisible=tuple(names))


@pytest.fixture
def alignable(monkeypatch):
    """Make uq_test's ``stride`` one of the row strides plans prove divisible by 16."""
    monkeypatch.setattr(specialization, "_POSITIONS", {})
    monkeypatch.setattr(launch, "alignable", lambda k: ("stride",) if k == "uq_test" else catalog.alignable(k))
    return ("stride",)


def test_fit_divisible_keeps_only_the_strides_the_values_prove(alignable):
    fit_divisible = specialization.fit_divisible
    assert fit_divisible(spec(), args(), alignable).divisible == ("stride",)
    odd = (*args()[:3], (1 << 40) + 8, *args()[4:])
    assert fit_divisible(spec(), odd, alignable).divisible == ()
    assert fit_divisible(spec(), args(), alignable).key() == spec().key() + "|div16=stride"


def test_decode_plan_key_carries_the_query_and_output_strides():
    from ultraquant.format import slot_size
    from ultraquant.kernels import plans

    b, hq, hk, d, bs = 2, 8, 2, 128, 16
    cache = torch.zeros(5, bs, hk, slot_size(d), dtype=torch.uint8)
    table = torch.zeros(b, 2, dtype=torch.int32)
    lens = torch.full((b,), 20, dtype=torch.int32)
    q = torch.zeros(b, hq, d, dtype=torch.bfloat16)
    p = plans.plan_decode(q, cache, table, lens, 0.1, None, None, None, torch.empty_like(q))
    assert p.spec.divisible == catalog.alignable("uq_decode_splitkv")
    assert p.spec.key() == splitkv_family.decode_splitkv_spec(head_size=d, gqa=hq // hk, block_size=bs, align=8).key()
    padded = torch.zeros(b, hq, d + 8, dtype=torch.bfloat16)[..., :d]  # rows of 136 elements: 8 mod 16
    p2 = plans.plan_decode(padded, cache, table, lens, 0.1, None, None, None, torch.empty_like(q))
    assert p2.spec.divisible == ("stride_qb", "stride_ob", "stride_oh")
    assert p2.spec.key() != p.spec.key() and p2.spec.constexprs == p.spec.constexprs


def _divisible_manifest(root, s: Specialization):
    d = write_manifest(root, specs=[s])
    m = json.loads((d / "manifest.json").read_text())
    for prm in m["blobs"][0]["params"]:
        if prm["name"] in s.divisible:
            prm["divisibility"] = 16
    m["blobs"][0]["divisible"] = list(s.divisible)
    (d / "manifest.json").write_text(json.dumps(m))


def test_odd_strides_miss_the_aligned_blob_with_a_reason(rt, tmp_path, alignable, monkeypatch):
    def fit_divisible(s, a):
        return specialization.fit_divisible(s, a, alignable)

    _divisible_manifest(tmp_path / "gen", _aligned(spec()))
    assert launch.try_launch(plan(s=fit_divisible(spec(), args())), 0) is True
    odd = (*args()[:3], (1 << 40) + 8, *args()[4:])
    st = launch.resolve(fit_divisible(spec(), odd), 0)
    assert isinstance(st, launch.Miss) and "this call's stride are not" in st.reason
    assert launch.try_launch(plan(s=fit_divisible(spec(), odd), a=odd), 0) is False
    assert len(rt.launches) == 1
    # A plan that claims what its values break is caught at launch (the packer), never run.
    assert launch.try_launch(plan(s=_aligned(spec()), a=odd), 0) is False and len(rt.launches) == 1
    monkeypatch.setenv("ULTRAQUANT_REQUIRE_AOT", "1")
    with pytest.raises(UltraQuantError, match="'stride' = .* not a multiple of 16"):
        launch.try_launch(plan(s=_aligned(spec()), a=odd), 0)


def test_a_blob_without_alignment_assumptions_serves_aligned_calls(rt, tmp_path, alignable):
    write_manifest(tmp_path / "gen")  # built before the alignment entered the key
    assert launch.try_launch(plan(s=_aligned(spec())), 0) is True and len(rt.launches) == 1
