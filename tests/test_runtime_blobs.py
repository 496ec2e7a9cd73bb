"""The runtime against real generated blobs (CPU only): every manifest entry parses, its key is the
one the plans produce for its config, and the loader's argument packing puts each value exactly where
the binary's own parameter table (cubin ``EIATTR_KPARAM_INFO`` / HSACO kernarg metadata) expects it.

Uses the blobs ``make kernels`` left under generated/ when there are any; otherwise builds a tiny
sm_90 set (dequant, D=64, block 16) with codegen into a temporary folder.
"""

from __future__ import annotations

import ctypes
import struct
from pathlib import Path

import pytest

from ultraquant import config
from ultraquant.codegen.elf import read_code_object
from ultraquant.kernels import catalog
from ultraquant.runtime.manifest import ManifestIndex, find_manifests
from ultraquant.runtime.packing import SCALAR_TYPES, ArgPacker


@pytest.fixture(scope="module")
def index(tmp_path_factory) -> ManifestIndex:
    manifests = find_manifests()
    if not any(m.blobs for m in manifests):
        pytest.importorskip("triton")
        from ultraquant.codegen.archs import get_arch
        from ultraquant.codegen.build import BuildOptions, build
        from ultraquant.codegen.matrix import Selection

        out = tmp_path_factory.mktemp("gen")
        sel = Selection(head_sizes=(64,), gqa=(1,), block_sizes=(16,), ops=("dequant_kv",))
        # Compile for real even if an interpreter test set TRITON_INTERPRET=1 in this process.
        build(BuildOptions(archs=[get_arch("sm_90")], selection=sel, out_dir=out, cache_dir=None, jobs=1,
                           extra_env={"TRITON_INTERPRET": "0"}))
        import os

        old = os.environ.get("ULTRAQUANT_GENERATED")
        os.environ["ULTRAQUANT_GENERATED"] = str(out)
        config.reload()
        try:
            manifests = find_manifests()
        finally:
            if old is None:
                del os.environ["ULTRAQUANT_GENERATED"]
            else:
                os.environ["ULTRAQUANT_GENERATED"] = old
            config.reload()
    idx = ManifestIndex(manifests)
    assert not idx.errors, idx.errors
    assert any(idx.entries.values())
    return idx


def _entries(index: ManifestIndex):
    return [e for table in index.entries.values() for e in table.values()]


def test_keys_match_what_the_plans_produce(index):
    for m in index._manifests:
        for raw in m.blobs:
            spec = catalog.specializer(raw["op"])(**raw["config"])
            e = index.entries[m.arch][spec.key()]
            assert e.signature == dict(spec.signature), e.key
            assert e.symbol and e.threads == e.num_warps * (64 if m.arch.startswith("gfx") else 32)


def _value(ty: str, i: int, divisibility: int = 1):
    if ty.startswith("*"):
        return 0x7F00_0000_0000 + 0x100 * (i + 1)
    if ty in ("fp32", "f32", "fp64", "fp16", "bf16"):
        return 0.5 + i
    code = SCALAR_TYPES[ty][0]
    return (i + 3) * divisibility if code not in "bB" else 1


def test_packing_matches_the_binary_parameter_table(index):
    checked = 0
    for e in _entries(index):
        image = Path(e.path).read_bytes()
        kernel = read_code_object(image).kernels[e.symbol]
        binary = [p for p in kernel.params if not p.kind.startswith("hidden_")]
        assert [(p.offset, p.size) for p in binary] == [(p.offset, p.size) for p in e.params], e.key
        packer = ArgPacker(e.params, e.key)
        args = [_value(p.type, i, p.divisibility) for i, p in enumerate(packer.visible)]
        ptrs = packer.pack(args)
        base = ctypes.addressof(packer.buffers()[0])
        for i, (p, b) in enumerate(zip(e.params, binary, strict=True)):
            assert ptrs[i] - base == b.offset
            raw = ctypes.string_at(ptrs[i], b.size)
            if p.hidden:
                assert raw == bytes(b.size)
                continue
            want = args[packer.visible.index(p)]
            code = "Q" if p.type.startswith("*") else SCALAR_TYPES[p.type][0]
            got = struct.unpack("<" + code, raw)[0]
            assert got == (want if p.type != "bf16" else got), (e.key, p.name)
        checked += 1
    assert checked
