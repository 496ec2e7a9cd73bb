"""The FlyDSL backend: its contract with the Triton decode plan, the ISA checks of ``verify``, and
(when flydsl, lld-19 and llvm-objdump are installed) an offline compile of real gfx942/gfx950 blobs.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from ultraquant.codegen.flydsl import backend as fb
from ultraquant.codegen.flydsl import isa
from ultraquant.errors import UltraQuantError
from ultraquant.kernels.families import decode_flydsl as fam
from ultraquant.kernels.families.decode_splitkv import DECODE_PARAMS
from ultraquant.kernels.families.decode_splitkv import decode_splitkv_spec as decode_spec

CONFIG = {"head_size": 128, "gqa": 8, "block_size": 16, "query_dtype": "bf16"}


def test_spec_is_the_triton_decode_renamed():
    tri = decode_spec(**CONFIG, has_window=True)
    fly = fam.decode_flydsl_spec(**CONFIG, has_window=True)
    assert fly.kernel == "uq_decode_flydsl" and tri.kernel == "uq_decode_splitkv"
    assert list(fly.signature) == [name for name, _ in DECODE_PARAMS]  # same LaunchPlan args
    assert fly.signature == tri.signature and fly.constexprs == tri.constexprs
    assert fam.flydsl_key(tri) == fly.key() != tri.key()


@pytest.mark.parametrize("bad, why", [
    ({"head_size": 32}, "head sizes"), ({"head_size": 1024}, "head sizes"), ({"gqa": 17}, "query heads"),
    ({"block_size": 8}, "multiple of 16"), ({"block_size": 24}, "multiple of 16"),
    ({"query_dtype": "fp32"}, "bf16/fp16"),
])
def test_unsupported_configs_say_why(bad, why):
    cfg = {**CONFIG, **bad}
    assert why in fam.unsupported(cfg)
    with pytest.raises(UltraQuantError, match="config"):
        fam.decode_flydsl_spec(**cfg)
    assert fam.unsupported({**CONFIG, "block_size": 48, "gqa": 6}) == ""


def test_head_size_64_is_built_on_the_fp16_path_only():
    """D=64 (gpt-oss, SmolLM2): the fp16 decode serves it (D/8 MFMAs per tile, 4 waves); the mx
    decode's scaled MFMA contracts 128 K, so its row skips D=64 with that reason."""
    from ultraquant.codegen import matrix

    cfg = {**CONFIG, "head_size": 64}
    assert fam.unsupported(cfg) == "" and fam.decode_flydsl_spec(**cfg).num_warps == 4
    with pytest.raises(UltraQuantError, match="head_size >= 128"):
        fam.decode_flydsl_mx_spec(**cfg)
    assert isa.expected_mfma("gfx942", 64) == {isa.F16_MFMA: 8}
    assert isa.expected_mfma("gfx942", 128) == {isa.F16_MFMA: 16}
    sel = matrix.Selection(head_sizes=(64,), gqa=(8,), block_sizes=(16,))
    rows = [r for r in matrix.OPS if r.op in (fb.OP, fb.OP_MX)]
    built, skipped = matrix.expand(rows, sel, "gfx950", ["flydsl"])
    assert {p.row.op for p in built} == {fb.OP} and len(built) == 6
    assert {s["op"] for s in skipped} == {fb.OP_MX} and all("128 head-dim elements" in s["reason"] for s in skipped)


def test_mx_variant_is_its_own_key_with_the_same_launch():
    tri = decode_spec(**CONFIG)
    mx = fb.FlyDSLBackend().specialize(fb.OP_MX, CONFIG)
    assert mx.kernel == fam.KERNEL_MX and mx.signature == tri.signature and mx.constexprs == tri.constexprs
    assert fam.flydsl_key(tri, fam.KERNEL_MX) == mx.key() != fam.flydsl_key(tri)
    assert isa.expected_mfma("gfx950", 256, mx=True) == {isa.FP4_CVT: 32, isa.BF16_MFMA: 16, isa.SCALED_MFMA: 4}


def test_backend_only_builds_its_op_for_cdna():
    b = fb.FlyDSLBackend()
    with pytest.raises(UltraQuantError, match="only ops"):
        b.specialize("decode_attention", CONFIG)
    from ultraquant.codegen.archs import get_arch

    assert b.targets(get_arch("gfx942")) and b.targets(get_arch("gfx950"))
    assert not b.targets(get_arch("sm_90"))
    assert b.hidden_params == ()


@pytest.mark.parametrize("vgpr, agpr, waves", [(64, 0, 8), (127, 0, 4), (128, 0, 4), (129, 0, 3),
                                              (200, 0, 2), (256, 0, 2), (257, 0, 1), (368, 112, 1), (8, 64, 8)])
def test_waves_per_simd(vgpr, agpr, waves):
    assert isa.waves_per_simd(vgpr, agpr) == waves


def _record(found, waves_needed=3):
    return {"mfma": found, "mfma_per_tile": isa.expected_mfma("gfx942", 128), "min_waves_per_simd": waves_needed}


def test_isa_record_checks():
    good = {isa.F16_MFMA: 16}
    res = {"vgpr": 120, "agpr": 0, "scratch": 0, "vgpr_spill": 0, "lds_static": 0}
    assert isa.check_record(_record(good), good, res, 65536) == []
    assert any("missing" in p for p in isa.check_record(_record({}), {}, res, 65536))
    assert any("whole number" in p for p in isa.check_record(_record({isa.F16_MFMA: 17}),
                                                             {isa.F16_MFMA: 17}, res, 65536))
    assert any("differ" in p for p in isa.check_record(_record(good), {isa.F16_MFMA: 32}, res, 65536))
    assert any("waves" in p for p in isa.check_record(_record(good, 4), good, {**res, "vgpr": 129}, 65536))
    assert any("scratch" in p for p in isa.check_record(_record(good), good, {**res, "scratch": 16}, 65536))
    assert any("LDS" in p for p in isa.check_record(_record(good), good, {**res, "lds_static": 70000}, 65536))


def test_mfma_counting_reads_objdump_text():
    text = ("\tv_mfma_f32_16x16x16_bf16 v[0:3], v[4:5], v[6:7], v[0:3]\n"
            "\ts_nop 1\n\tv_mfma_f32_16x16x16_bf16 a[0:3], v[4:5], v[6:7], 0\n"
            "\tv_mfma_scale_f32_16x16x128_f8f6f4 v[0:3], v[4:11], v[12:19], v[0:3]\n")
    assert isa.mfma_counts(text) == {isa.BF16_MFMA: 2, "v_mfma_scale_f32_16x16x128_f8f6f4": 1}


def test_verify_hook_is_registered():
    from ultraquant.codegen.backends import verify_hook

    hook = verify_hook("flydsl")
    if hook is None:
        pytest.skip("codegen.backends.VERIFY_HOOKS has no flydsl entry in this checkout")
    assert hook is isa.check_blob
    assert isa.check_blob({}, b"", None) == ["FlyDSL blob without an isa record in the manifest"]


def _toolchain_or_skip(arch: str) -> None:
    if importlib.util.find_spec("flydsl") is None:
        pytest.skip("flydsl is not installed (make kernels installs it in the build venv)")
    from ultraquant.codegen.flydsl.compiler import find_lld

    try:
        find_lld()
        isa.find_objdump(arch)
    except (RuntimeError, FileNotFoundError) as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("arch, cfg, mx", [
    ("gfx942", {"head_size": 128, "gqa": 8, "block_size": 16}, False),
    ("gfx950", {"head_size": 256, "gqa": 16, "block_size": 64, "has_sinks": True, "has_window": True,
                "has_softcap": True}, False),
    ("gfx950", {"head_size": 128, "gqa": 4, "block_size": 32, "has_window": True}, True),
    ("gfx942", {"head_size": 64, "gqa": 8, "block_size": 16, "has_sinks": True, "has_window": True}, False),
])
def test_offline_compile_in_a_subprocess(arch, cfg, mx, tmp_path: Path):
    _toolchain_or_skip(arch)
    from ultraquant.codegen.elf import read_code_object
    from ultraquant.codegen.flydsl.compile_kernel import run

    waves = fam.waves_for(cfg["head_size"])
    from ultraquant.codegen.flydsl.backend import pipelined_for

    data = run({"arch": arch, "name": "uq_decode_flydsl", "config": cfg, "mx": mx, "waves": waves,
                "pipelined": pipelined_for(cfg["head_size"], mx)}, tmp_path / "k.hsaco", python=sys.executable)
    obj = read_code_object(data)
    assert obj.machine == 224 and obj.flags & 0xFF == {"gfx942": 0x4C, "gfx950": 0x4F}[arch]
    kernel = obj.kernels["uq_decode_flydsl"]
    assert len(kernel.params) == len(DECODE_PARAMS)
    assert kernel.resources["kernarg_size"] == sum(8 if ty.startswith("*") else 4 for _, ty in DECODE_PARAMS)
    assert kernel.resources["scratch"] == 0 and kernel.resources["vgpr_spill"] == 0
    assert kernel.resources["lds_static"] == (16 * cfg["head_size"] * 4 + 32 * 4 if waves > 1 else 0)
    assert kernel.max_threads in (None, 64 * waves)
    d = cfg["head_size"]
    assert isa.waves_per_simd(kernel.resources["vgpr"], kernel.resources["agpr"]) >= isa.DESIGN_WAVES[d]
    found = isa.mfma_counts(isa.disassemble(data, arch))
    assert found == isa.expected_mfma(arch, d, mx)
