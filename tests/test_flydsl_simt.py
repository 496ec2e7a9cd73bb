"""Run the FlyDSL decode kernels' own lowered IR on the CPU (tests/flydsl_sim/simt.py) and compare
with the reference and with the lane-layout emulation.

Needs flydsl (the build venv of ``make kernels``; no linker); skipped where it is not installed. Each case
compiles one kernel (about 10 s here) and interprets every workgroup of the launch.
"""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from tests.test_flydsl_layout import _cache
from ultraquant import reference as ref
from ultraquant.kernels.flydsl import layout as lay

if importlib.util.find_spec("flydsl") is None:
    pytest.skip("flydsl is not installed (make kernels installs it in the build venv)", allow_module_level=True)

from tests.flydsl_sim import simt  # noqa: E402

# No linker needed: the interpreter takes the IR FlyDSL dumps before the final link.

W = 4  # waves per workgroup, as the backend builds the blobs


def _check(got: torch.Tensor, expect: torch.Tensor, emu: torch.Tensor) -> None:
    assert torch.isfinite(got).all(), "unwritten (NaN-poisoned) or non-finite output"
    got, expect, emu = got.float(), expect.float(), emu.float()
    cos = torch.nn.functional.cosine_similarity(got.flatten().double(), expect.flatten().double(), dim=0)
    assert cos > 0.9999
    assert (got - expect).abs().max() <= 1e-2 * max(1.0, expect.abs().max().item())
    # the kernel and the emulation agree up to the output's bf16 rounding
    torch.testing.assert_close(got, emu.to(torch.bfloat16).float(), rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("pipelined", [True, False])
def test_gfx942_kernel_runs_like_the_reference(pipelined):
    """Also memory safety: block-table entries past each sequence are poisoned (-1, 2**30); the
    interpreter raises on any read outside a buffer, so touching them would fail the test. Both loop
    structures (the unpipelined one is the build's fallback when the pipelined one spills)."""
    d, g, hk, bs, lens, splits = 128, 8, 2, 16, [37, 0, 100], 3
    q, cache, bt, seq = _cache(d, g, hk, bs, lens, seed=1)
    bt[0, 3:] = -1
    bt[1, :] = 2**30
    got = simt.run_decode({"head_size": d, "gqa": g, "block_size": bs}, "gfx942", q, cache, bt, seq,
                          d**-0.5, num_splits=splits, waves=W, pipelined=pipelined)
    expect = ref.decode_attention(q.float(), cache, bt, seq, d**-0.5)
    emu = lay.emulate_decode(lay.DecodeConfig(d, g, bs), q, cache, bt, seq, d**-0.5, num_splits=splits,
                             waves=W)
    _check(got, expect, emu)


@pytest.mark.parametrize("pipelined", [True, False])
def test_gfx942_d512_staged_v_runs_like_the_reference(pipelined):
    """D=512 takes V's code bytes through LDS (``layout.V_STAGE_HEAD_SIZES``): one wave per workgroup,
    as built; a request of length 0, two splits, block-table entries past each sequence poisoned."""
    d, g, hk, bs, lens, splits = 512, 4, 1, 16, [40, 0, 70], 2
    assert d in lay.V_STAGE_HEAD_SIZES
    q, cache, bt, seq = _cache(d, g, hk, bs, lens, seed=3)
    bt[0, 3:] = -1
    bt[1, :] = 2**30
    got = simt.run_decode({"head_size": d, "gqa": g, "block_size": bs}, "gfx942", q, cache, bt, seq,
                          d**-0.5, num_splits=splits, waves=1, pipelined=pipelined)
    expect = ref.decode_attention(q.float(), cache, bt, seq, d**-0.5)
    emu = lay.emulate_decode(lay.DecodeConfig(d, g, bs), q, cache, bt, seq, d**-0.5, num_splits=splits, waves=1)
    _check(got, expect, emu)


@pytest.mark.parametrize("arch, pipelined", [("gfx942", False), ("gfx942", True), ("gfx950", False)])
def test_d64_kernel_runs_like_the_reference(arch, pipelined):
    """Head size 64 (half a 128-element query chunk per lane, six butterflies, half-word scale loads):
    a request of length 0, three splits, block-table entries past each sequence poisoned; as built (4
    waves, unpipelined) on both arches, and the pipelined loop."""
    d, g, hk, bs, lens, splits = 64, 8, 2, 16, [37, 0, 100], 3
    q, cache, bt, seq = _cache(d, g, hk, bs, lens, seed=1)
    bt[0, 3:] = -1
    bt[1, :] = 2**30
    got = simt.run_decode({"head_size": d, "gqa": g, "block_size": bs}, arch, q, cache, bt, seq,
                          d**-0.5, num_splits=splits, waves=W, pipelined=pipelined)
    expect = ref.decode_attention(q.float(), cache, bt, seq, d**-0.5)
    emu = lay.emulate_decode(lay.DecodeConfig(d, g, bs), q, cache, bt, seq, d**-0.5, num_splits=splits, waves=W)
    _check(got, expect, emu)


@pytest.mark.parametrize("d, g, bs, lens, window", [(64, 8, 16, [300, 5, 140], 128), (128, 6, 32, [90, 5], 40),
                                                    (64, 1, 16, [90, 33], 40), (64, 4, 32, [90, 5], 40)],
                         ids=["d64-gptoss", "d128", "d64-g1", "d64-g4"])
def test_gfx942_features_head_major_cache_any_workgroup_order(d, g, bs, lens, window):
    """Sinks + window + soft cap, a permuted (head-major) cache view, workgroups in random order (the
    last-arriving split merges), one kernel run with one split (direct write) and one with four; at
    D=64 also gpt-oss' shape (GQA 8, sinks, a 128-token window) with ragged lengths."""
    hk = 1
    q, cache, bt, seq = _cache(d, g, hk, bs, lens, head_major=True, seed=7)
    sinks, softcap = torch.randn(hk * g), 7.0
    cfg = {"head_size": d, "gqa": g, "block_size": bs, "has_sinks": True, "has_window": True,
           "has_softcap": True}
    from ultraquant.codegen.flydsl.compiler import compile_decode

    kernel = simt.Kernel(simt.lowered_ir(lambda: compile_decode("gfx942", "k", cfg, need_linker=False, waves=W)),
                         lanes=64 * W)
    expect = ref.decode_attention(q.float(), cache, bt, seq, d**-0.5, sinks=sinks, sliding_window=window,
                                  softcap=softcap)
    for splits in (1, 4):
        order = [(x, y, z) for z in range(splits) for y in range(hk) for x in range(len(lens))]
        random.Random(splits).shuffle(order)
        got = simt.run_decode(cfg, "gfx942", q, cache, bt, seq, d**-0.5, num_splits=splits, sinks=sinks,
                              window=window, softcap=softcap, order=order, kernel=kernel)
        emu = lay.emulate_decode(lay.DecodeConfig(d, g, bs, has_sinks=True, has_window=True, has_softcap=True),
                                 q, cache, bt, seq, d**-0.5, num_splits=splits, sinks=sinks, window=window,
                                 softcap=softcap, waves=W)
        _check(got, expect, emu)


def test_gfx950_mx_kernel_matches_its_emulation():
    d, g, hk, bs, lens, splits = 128, 4, 1, 16, [70], 2
    q, cache, bt, seq = _cache(d, g, hk, bs, lens, seed=3)
    got = simt.run_decode({"head_size": d, "gqa": g, "block_size": bs}, "gfx950", q, cache, bt, seq,
                          d**-0.5, num_splits=splits, mx=True, waves=W).float()
    emu = lay.emulate_decode(lay.DecodeConfig(d, g, bs), q, cache, bt, seq, d**-0.5, num_splits=splits, mx=True,
                             waves=W)
    expect = ref.decode_attention(q.float(), cache, bt, seq, d**-0.5).float()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, emu.to(torch.bfloat16).float(), rtol=2**-7, atol=1e-3)
    cos = torch.nn.functional.cosine_similarity(got.flatten().double(), expect.flatten().double(), dim=0)
    assert cos > 0.9999


def test_gfx942_bad_block_ids_and_lengths_stay_inside_the_cache():
    """Block ids outside the cache (-1, num_blocks, 2**31-1) are empty tiles and a length past the
    block-table row is clamped to it: the interpreter raises on any read outside a buffer; the
    output equals attention over the remaining tokens and both error words are set."""
    d, g, hk, bs, lens, splits = 128, 4, 1, 16, [48, 40], 2
    q, cache, bt, seq = _cache(d, g, hk, bs, lens, seed=3)
    nb = cache.shape[0]
    good = bt.clone()
    bt[0, 1] = -1
    bt[1, 1] = 2**31 - 1
    bt[1, 2] = nb
    seq_bad = torch.tensor([48, 3 * bs + 7], dtype=torch.int32)  # request 1: longer than its row
    errors = [0] * 4
    got = simt.run_decode({"head_size": d, "gqa": g, "block_size": bs}, "gfx942", q, cache, bt, seq_bad,
                          d**-0.5, num_splits=splits, waves=W, errors=errors)
    # what remains: request 0 blocks 0 and 2; request 1 block 0 only
    kept_bt = torch.stack([torch.stack([good[0, 0], good[0, 2], good[0, 2]]), good[1]]).to(torch.int32)
    expect = ref.decode_attention(q.float(), cache, kept_bt, torch.tensor([32, bs], dtype=torch.int32), d**-0.5)
    emu = lay.emulate_decode(lay.DecodeConfig(d, g, bs), q, cache, bt, seq_bad, d**-0.5, num_splits=splits,
                             waves=W)
    _check(got, expect, emu)
    assert errors[:3] == [0, 1, 1]


class _InterpretedBlob:
    """Looks like a loaded FlyDSL mx blob (a stand-in of ``uq_decode_splitkv``) to the runtime self-test, but
    runs the kernel's IR here."""

    def __init__(self, kernel: simt.Kernel, key: str, name: str) -> None:
        self.kernel = kernel
        self.entry = type("Entry", (), {"key": key, "kernel": name, "alternate_of": "uq_decode_splitkv"})()

    def launch(self, args, grid) -> None:
        self.kernel.launch_tensors(tuple(grid), list(args))


def test_self_test_problem_fails_the_old_mx_kernel_and_passes_the_fixed_one():
    """Issue 15: the first-use self-test is the gate on hardware. Its decode problem (block-scaled
    query, keys weighted at K positions 16-63), run through the interpreter with the scaled MFMA's
    operand maps from AMD's sources, fails the old mx kernel (FP8 query packed like FP4) and passes
    the fixed one."""
    from ultraquant.codegen.flydsl.compiler import compile_decode
    from ultraquant.kernels.families import decode_flydsl as fam
    from ultraquant.kernels.families import decode_splitkv as splitkv_family
    from ultraquant.kernels.flydsl import operand_maps as om
    from ultraquant.runtime import problems

    cfg = {"head_size": 128, "gqa": 4, "block_size": 16}
    spec = splitkv_family.decode_splitkv_spec(**cfg, query_dtype="bf16")
    key = fam.flydsl_key(spec, fam.KERNEL_MX)
    verdicts = {}
    for name, qmap in (("fixed", om.FP8), ("old", om.FP4)):
        ir = simt.lowered_ir(lambda qmap=qmap: compile_decode("gfx950", "k", cfg, mx=True, need_linker=False,
                                                              waves=W, mx_query_map=qmap))
        blob = _InterpretedBlob(simt.Kernel(ir, lanes=64 * W), key, fam.KERNEL_MX)
        verdicts[name] = problems.decode_problem(blob, spec, "cpu")
    print(verdicts)
    assert verdicts["fixed"][0], verdicts
    assert not verdicts["old"][0], verdicts


@pytest.mark.parametrize("d", [128, 64])
def test_self_test_problem_passes_the_fp16_kernel_and_fails_a_wrong_group_scale(monkeypatch, d):
    """Issue 26: the decode problem's K and V groups span 2**-12..2**12 per token (outliers, a zero
    group, -0 codes). The fp16 kernel (K scale after each group's MFMAs, V's folded into P) passes it
    in the interpreter; the same kernel built to take each scale from the neighbouring group fails
    (at D=64 the scale bytes are half words: the V scales the high half of the slot's last word)."""
    from ultraquant.codegen.flydsl.compiler import compile_decode
    from ultraquant.kernels.families import decode_flydsl as fam
    from ultraquant.kernels.families import decode_splitkv as splitkv_family
    from ultraquant.runtime import problems

    cfg = {"head_size": d, "gqa": 4, "block_size": 16}
    spec = splitkv_family.decode_splitkv_spec(**cfg, query_dtype="bf16")
    key = fam.flydsl_key(spec, fam.KERNEL)
    verdicts = {}
    right = lay.scale_byte
    for name, pick in (("right", right), ("neighbour", lambda words, q: right(words, q ^ 1))):
        monkeypatch.setattr(lay, "scale_byte", pick)  # read by the kernel source while it is traced
        ir = simt.lowered_ir(lambda: compile_decode("gfx942", "k", cfg, need_linker=False, waves=W, pipelined=False))
        blob = _InterpretedBlob(simt.Kernel(ir, lanes=64 * W), key, fam.KERNEL)
        verdicts[name] = problems.decode_problem(blob, spec, "cpu")
    monkeypatch.setattr(lay, "scale_byte", right)
    print(verdicts)
    assert verdicts["right"][0], verdicts
    assert not verdicts["neighbour"][0], verdicts


def test_self_test_problem_passes_the_d512_kernel_with_staged_v():
    """The runtime self-test's decode problem (K/V groups 2**-12..2**12, outliers, a zero group, -0)
    through the D=512 fp16 kernel as built (V bytes staged through LDS, pipelined, one wave)."""
    from ultraquant.codegen.flydsl.compiler import compile_decode
    from ultraquant.kernels.families import decode_flydsl as fam
    from ultraquant.kernels.families import decode_splitkv as splitkv_family
    from ultraquant.runtime import problems

    cfg = {"head_size": 512, "gqa": 4, "block_size": 16}
    spec = splitkv_family.decode_splitkv_spec(**cfg, query_dtype="bf16")
    ir = simt.lowered_ir(lambda: compile_decode("gfx942", "k", cfg, need_linker=False, waves=1, pipelined=True))
    blob = _InterpretedBlob(simt.Kernel(ir, lanes=64), fam.flydsl_key(spec, fam.KERNEL), fam.KERNEL)
    ok, why = problems.decode_problem(blob, spec, "cpu")
    assert ok, why


@pytest.mark.parametrize("sel, folded", [(0x060C040C, 0x22004400), (0x06040200, 0x22446688),
                                         (0x0D0C0701, 0xFF001177)])
def test_the_interpreters_v_perm_b32_is_llvms(sel, folded):
    """The interpreter's ``v_perm_b32`` (the kernel's byte moves) against LLVM's own reading of the
    instruction: ``opt-22 -passes=instcombine -mcpu=gfx942`` constant-folds
    ``llvm.amdgcn.perm(0x11223344, 0x55667788, sel)`` to these values (AMDGPU InstCombine, LLVM 22)."""
    import numpy as np

    got = simt._perm_b32(np.array([0x11223344]), np.array([0x55667788]), np.array([sel]))
    assert int(got[0]) & 0xFFFFFFFF == folded
