"""Offline census of QK in FP8 for the sm_90 whole-page decode (issue 24), no GPU needed.

Issue 24's first remaining lever: QK as ``mma.sync.m16n8k32 e4m3`` (one 32-element scale group per MMA
K-step) instead of two fp16 ``m16n8k16`` per group, because an E2M1 nibble ``s e1 e0 m`` placed as the
e4m3 byte ``s 0 0 e1 e0 m 0 0`` is exactly its value times 2**-6 (subnormals included), so FP4 -> e4m3
is bit placement. This script measures what that buys, from sm_90 SASS (ptxas and cuobjdump that
Triton ships), and writes one JSON:

1. ``bits``: the placement identity against ``ultraquant.format.E2M1_VALUES`` (all 16 codes), the
   word-level PTX (8 codes -> two e4m3 operand words) emulated in numpy on random words, and the
   m16n8k32 fragment layout (PTX ISA "Matrix Fragments for mma.m16n8k32": A a0 row g k 4t..4t+3,
   a1 row g+8, a2 row g k 16+4t.., a3 row g+8 k 16+4t..; B b0 col g k 4t..4t+3, b1 k 16+4t..; low
   elements in low bytes) emulated for one 16-token x 32-element group against ``K @ q``.
2. ``ptx``: small PTX kernels through ptxas for sm_90 / sm_90a / sm_89: the conversion's SASS count,
   what ``mma.sync ... e4m3`` becomes on sm_90 (ptxas emulates it: F2FP unpacks to f16 + 2 HMMA; sm_89
   has QMMA), and ``wgmma ... e4m3`` with A from registers (native QGMMA on sm_90a).
3. ``kernel``: the stage loop of the real kernel (D=128 GQA 4 Hk 8 block 16 = shape A at bs 16) with
   ``_QK_ASM`` swapped for variants (the module constant patched in this process only; nothing on disk
   changes): today, FP8 mma.sync one/two query terms, the "native FP8 MMA" proxy (one HMMA per group
   standing in for one QGMMA: the count a wgmma build would have per warp, less its arrive/wait), and
   no K conversion at all (the conversion's share).
4. ``accuracy``: the query-operand precision measured before (results/query_precision.json,
   results/operand_precision_kl.json) plus, cheap on the CPU, the two variants an sm_90 FP8 QK could
   feed without per-group query scales: e4m3 with one scale per query row, one term or two terms
   (hi + lo in the same accumulator, no second scale).

    .venv/bin/python benchmarks/lab/fp8_qk_census.py --out benchmarks/results/fp8_qk_census_offline_2026-12-03.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TRITON_DISABLE_LINE_INFO", "1")
os.environ.setdefault("TRITON_ALWAYS_COMPILE", "1")

A_SHAPE = {"gqa": 4, "num_kv_heads": 8, "block_size": 16}
US_PER_STAGE = 3.57
"""Measured A-shape stage cost (NOTES, session 3 call 1a: slope 3.52-3.58 us per 70 KB stage)."""
STAGE_LOOP_TODAY = 2099
"""The stage loop it was measured with (static split / noinline piece, NOTES session 2)."""
ALU_YIELD = 0.25
"""NOTES: removing ALU instructions bought about a quarter of their count in time in an earlier try."""


# ---------------------------------------------------------------- 1. bits
def e4m3_value(byte: int) -> float:
    """OCP e4m3 (fn) value of one byte (bias 7, subnormals 2**-6 * m/8)."""
    s = -1.0 if byte & 0x80 else 1.0
    e, m = (byte >> 3) & 0xF, byte & 7
    if e == 0xF and m == 7:
        return float("nan")
    return s * (2.0**-6 * m / 8 if e == 0 else 2.0 ** (e - 7) * (1 + m / 8))


def e2m1_to_e4m3_byte(nib: int) -> int:
    return ((nib & 7) << 2) | ((nib & 8) << 4)


def word_to_e4m3(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """numpy of :func:`e4m3_word_ptx`: (lo, hi) words; byte j of lo = low nibble of byte j, of hi = high."""
    x = x.astype(np.uint32)
    lo = ((x << 2) & 0x1C1C1C1C) | ((x << 4) & 0x80808080)
    hi = ((x >> 2) & 0x1C1C1C1C) | (x & 0x80808080)
    return lo.astype(np.uint32), hi.astype(np.uint32)


def check_bits(seed: int = 0) -> dict:
    from ultraquant.format import E2M1_VALUES

    table = [(nib, E2M1_VALUES[nib & 7] * (-1 if nib & 8 else 1)) for nib in range(16)]
    placed = [e4m3_value(e2m1_to_e4m3_byte(nib)) for nib, _ in table]
    exact = all(p == v * 2.0**-6 for (_, v), p in zip(table, placed, strict=True))
    rng = np.random.default_rng(seed)
    words = rng.integers(0, 2**32, size=100000, dtype=np.uint64).astype(np.uint32)
    lo, hi = word_to_e4m3(words)
    ok_words = True
    for j in range(4):
        b = (words >> (8 * j)) & 0xFF
        want_lo = np.vectorize(e2m1_to_e4m3_byte)(b & 0xF)
        want_hi = np.vectorize(e2m1_to_e4m3_byte)(b >> 4)
        ok_words &= bool(np.all(((lo >> (8 * j)) & 0xFF) == want_lo) and np.all(((hi >> (8 * j)) & 0xFF) == want_hi))
    return {"e2m1_to_e4m3_exact_times_2^-6": exact, "word_sequence_matches_per_nibble": ok_words,
            "fragment_layout_check": check_fragments(rng)}


def check_fragments(rng) -> dict:
    """One scale group (32 elements) of 16 tokens x 8 query rows through the m16n8k32 fragments: K word
    t of token n holds elements 8t..8t+7 (element 2j in byte j's low nibble, as format.py packs them);
    a0/a2 = (lo, hi) of token n's word t, a1/a3 those of token n + 8; the query B fragment of lane
    (g, t): b0 byte j = q[g, 8t + 2j], b1 byte j = q[g, 8t + 2j + 1]."""
    from ultraquant.format import E2M1_VALUES

    val = np.array([E2M1_VALUES[n & 7] * (-1 if n & 8 else 1) for n in range(16)])
    codes = rng.integers(0, 16, size=(16, 32))
    q = rng.standard_normal((8, 32))
    kwords = np.zeros((16, 4), np.uint32)
    for n in range(16):
        for t in range(4):
            w = 0
            for i in range(8):
                w |= int(codes[n, 8 * t + i]) << (4 * i)
            kwords[n, t] = w
    a = np.zeros((16, 32))
    b = np.zeros((32, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        lo_n, hi_n = (int(v[0]) for v in word_to_e4m3(kwords[g, t:t + 1]))
        lo_m, hi_m = (int(v[0]) for v in word_to_e4m3(kwords[g + 8, t:t + 1]))
        regs = {0: (g, 4 * t, lo_n), 1: (g + 8, 4 * t, lo_m), 2: (g, 16 + 4 * t, hi_n), 3: (g + 8, 16 + 4 * t, hi_m)}
        for row, k0, word in regs.values():
            for j in range(4):
                a[row, k0 + j] = e4m3_value((word >> (8 * j)) & 0xFF)
        for reg, k0 in ((0, 4 * t), (1, 16 + 4 * t)):
            for j in range(4):
                b[k0 + j, g] = q[g, 8 * t + 2 * j + reg]
    got = a @ b * 2.0**6
    want = val[codes] @ q.T
    return {"max_abs_diff": float(np.abs(got - want).max()), "ok": bool(np.allclose(got, want, rtol=0, atol=1e-12))}


# ---------------------------------------------------------------- 2. small PTX kernels
def _bin(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def ptx_sass(ptx: str, arch: str) -> list[str]:
    """SASS opcode texts of a PTX module compiled by the bundled ptxas for ``arch``."""
    with tempfile.TemporaryDirectory() as d:
        src, out = Path(d, "k.ptx"), Path(d, "k.cubin")
        src.write_text(ptx)
        subprocess.run([_bin("ptxas"), f"-arch={arch}", str(src), "-o", str(out)], check=True)
        text = subprocess.run([_bin("cuobjdump"), "-sass", str(out)], check=True, capture_output=True,
                              text=True).stdout
    ins = [m.group(1).strip() for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", text)]
    return [t for t in ins if not t.startswith("NOP")]


def _opc(t: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", t).split()[0]


HEAD = ".version 8.4\n.target {arch}\n.address_size 64\n.visible .entry k(.param .u64 p, .param .u64 d)\n{{\n"
SETUP = ("LDC", "LDG", "STG", "ULDC", "EXIT", "BRA", "S2R", "S2UR", "IMAD.WIDE.U32", "MOV", "IMAD.MOV.U32")
"""Opcodes that load, store, move or branch (the harness, not the sequence): excluded from counts."""


def e4m3_word_ptx(lo: str, hi: str, src: str) -> str:
    """PTX: 8 E2M1 codes (``src``) -> two e4m3 operand words (byte j of ``lo`` = the low nibble of byte j,
    of ``hi`` = its high nibble), each code times 2**-6: magnitude bits to 4..2, sign to 7."""
    return (f"shl.b32 t1, {src}, 2; and.b32 t1, t1, 0x1C1C1C1C; shl.b32 t2, {src}, 4; and.b32 t2, t2, 0x80808080; "
            f"or.b32 {lo}, t1, t2; shr.b32 t3, {src}, 2; and.b32 t3, t3, 0x1C1C1C1C; and.b32 t2, {src}, 0x80808080; "
            f"or.b32 {hi}, t3, t2;")


def _alu(ins: list[str]) -> list[str]:
    return [t for t in ins if not any(_opc(t) == o or _opc(t).startswith(o + ".") and o in SETUP[:5]
                                      for o in SETUP)]


def ptx_census() -> dict:
    from ultraquant.kernels.gluon.decode_wholepage import _word_pairs

    words = 8
    tid = ("{ .reg .b32 tx; .reg .b64 tw; mov.u32 tx, %tid.x; mul.wide.u32 tw, tx, 256; add.s64 rp, rp, tw; }\n")
    regs = ".reg .b32 w<8>, o<16>, t1, t2, t3; .reg .b64 rp;\nld.param.u64 rp, [p];\n" + tid
    loads = "".join(f"ld.global.b32 w{i}, [rp+{4 * i}];\n" for i in range(words))
    stores = "".join(f"st.global.b32 [rp+{64 + 4 * i}], o{i};\n" for i in range(2 * words))
    conv = "".join(e4m3_word_ptx(f"o{2 * i}", f"o{2 * i + 1}", f"w{i}") + "\n" for i in range(words))
    e4m3 = _alu(ptx_sass(HEAD.format(arch="sm_90") + regs + loads + conv + stores + "ret;\n}\n", "sm_90"))
    regs16 = ".reg .b32 w<8>, o<32>, t1, t2, t3; .reg .b64 rp;\nld.param.u64 rp, [p];\n" + tid
    conv16 = "".join(_word_pairs([f"o{4 * i + k}" for k in range(4)], f"w{i}") + "\n" for i in range(words))
    stores16 = "".join(f"st.global.b32 [rp+{64 + 4 * i}], o{i};\n" for i in range(4 * words))
    fp16 = _alu(ptx_sass(HEAD.format(arch="sm_90") + regs16 + loads + conv16 + stores16 + "ret;\n}\n", "sm_90"))

    mma_body = (".reg .b32 a<4>, b<2>; .reg .f32 c<4>; .reg .b64 rp;\nld.param.u64 rp, [p];\n"
                "ld.global.v4.b32 {a0,a1,a2,a3}, [rp];\nld.global.v2.b32 {b0,b1}, [rp+16];\n"
                "ld.global.v4.f32 {c0,c1,c2,c3}, [rp+32];\n"
                "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {c0,c1,c2,c3}, {a0,a1,a2,a3}, {b0,b1}, "
                "{c0,c1,c2,c3};\nst.global.v4.f32 [rp+64], {c0,c1,c2,c3};\nret;\n}\n")
    mma90 = _alu(ptx_sass(HEAD.format(arch="sm_90") + mma_body, "sm_90"))
    mma89 = _alu(ptx_sass(HEAD.format(arch="sm_89") + mma_body, "sm_89"))
    # the query (B) loop-invariant: does ptxas hoist its unpacks out of a loop?
    loop_body = (".reg .b32 a<4>, b<2>, i; .reg .f32 c<4>; .reg .b64 rp, ra; .reg .pred pl;\n"
                 "ld.param.u64 rp, [p];\nld.global.v2.b32 {b0,b1}, [rp+16];\nmov.f32 c0, 0f00000000; "
                 "mov.f32 c1, c0; mov.f32 c2, c0; mov.f32 c3, c0; mov.b32 i, 0; mov.b64 ra, rp;\nL:\n"
                 "ld.global.v4.b32 {a0,a1,a2,a3}, [ra];\n"
                 "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {c0,c1,c2,c3}, {a0,a1,a2,a3}, {b0,b1}, "
                 "{c0,c1,c2,c3};\nadd.s64 ra, ra, 16; add.s32 i, i, 1; setp.lt.s32 pl, i, 64; @pl bra L;\n"
                 "st.global.v4.f32 [rp+64], {c0,c1,c2,c3};\nret;\n}\n")
    loop90 = ptx_sass(HEAD.format(arch="sm_90") + loop_body, "sm_90")
    loop_ins = _alu(loop90)
    wg = (".reg .b32 a<4>; .reg .f32 c<4>; .reg .b64 rp, desc; .reg .pred pp;\nld.param.u64 rp, [p];\n"
          "ld.param.u64 desc, [d];\nld.global.v4.b32 {a0,a1,a2,a3}, [rp];\nld.global.v4.f32 {c0,c1,c2,c3}, [rp+32];\n"
          "setp.ne.b32 pp, a0, 0;\nwgmma.fence.sync.aligned;\n"
          "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {c0,c1,c2,c3}, {a0,a1,a2,a3}, desc, pp, 1, 1;\n"
          "wgmma.commit_group.sync.aligned;\nwgmma.wait_group.sync.aligned 0;\n"
          "st.global.v4.f32 [rp+64], {c0,c1,c2,c3};\nret;\n}\n")
    wg90 = _alu(ptx_sass(HEAD.format(arch="sm_90a") + wg, "sm_90a"))
    count = lambda ins: dict(collections.Counter(_opc(t) for t in ins))  # noqa: E731
    return {
        "e4m3_conversion": {"words": words, "sass": len(e4m3), "per_word": len(e4m3) / words, "mix": count(e4m3)},
        "fp16_conversion_today": {"words": words, "sass": len(fp16), "per_word": len(fp16) / words,
                                  "mix": count(fp16)},
        "mma_sync_e4m3_sm90": {"sass": len(mma90), "mix": count(mma90),
                               "note": "ptxas emulates: F2FP.F16.E4M3.UNPACK_B of A (8) and B (4), 2 HMMA.16816, "
                                       "4 FADD of C"},
        "mma_sync_e4m3_sm89": {"sass": len(mma89), "mix": count(mma89)},
        "mma_sync_e4m3_sm90_loop_invariant_B": {"alu_instructions_whole_kernel": len(loop_ins),
                                                "mix": count(loop_ins),
                                                "note": "64-iteration loop, B loaded once before it: are B's "
                                                        "4 unpacks hoisted (then 8 F2FP per MMA in the loop)?"},
        "wgmma_e4m3_regA_sm90a": {"sass": len(wg90), "mix": count(wg90)},
    }


# ---------------------------------------------------------------- 3. the real stage loop, variants of _QK_ASM
def qk_variant_ptx(mode: str) -> str:
    """PTX of ``_qk_runs`` (one row group, D=128 half: 4 scale groups) in ``mode``: the inputs and outputs
    of today's (K words 2 x 4, scale words 4, query words 4 x 4), so the kernel around it is unchanged.
    FP8 modes read query words q, q+1 (one term) and q+2, q+3 (the second term) of each group; the
    numerics of the query words are not what the kernel passes (a count, not a kernel)."""
    from ultraquant.kernels.gluon.decode_wholepage import _qk_ptx

    if mode == "today":
        return _qk_ptx(1)
    lines = ["{ .reg .b32 t1, t2, t3, p0, p1, r0, r1, fa, fb, u<8>; .reg .b16 h0, h1; .reg .f32 e0, e1, e2, e3, z;",
             "mov.f32 z, 0f00000000;"]
    base, kw = 4, 12
    for g in range(4):
        x = base + (g % 2) + 4 * (g // 2)
        q = base + 12 + 4 * g
        acc0 = "{z, z, z, z}"
        acc = "{e0, e1, e2, e3}"
        if mode == "no_conversion":  # K words straight into two fp16 MMAs: the conversion's share
            a = f"{{${x}, ${x + 2}, ${x}, ${x + 2}}}"
            lines += [f"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {acc}, {a}, {{${q}, ${q + 1}}}, {acc0};",
                      f"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {acc}, {a}, {{${q + 2}, ${q + 3}}}, {acc};"]
        elif mode == "e4m3_f2fp_f16":  # e4m3 placement, hardware unpack to f16 (F2FP), two fp16 MMAs
            lines += [e4m3_word_ptx("p0", "p1", f"${x}"), e4m3_word_ptx("r0", "r1", f"${x + 2}")]
            for i, w in enumerate(("p0", "r0", "p1", "r1")):
                lines += [f"mov.b32 {{h0, h1}}, {w}; cvt.rn.f16x2.e4m3x2 u{2 * i}, h0; "
                          f"cvt.rn.f16x2.e4m3x2 u{2 * i + 1}, h1;"]
            for step in range(2):
                a = f"{{u{step}, u{2 + step}, u{4 + step}, u{6 + step}}}"
                lines += [f"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {acc}, {a}, "
                          f"{{${q + 2 * step}, ${q + 2 * step + 1}}}, {acc0 if step == 0 else acc};"]
        else:
            lines += [e4m3_word_ptx("p0", "p1", f"${x}"), e4m3_word_ptx("r0", "r1", f"${x + 2}")]
            a = "{p0, r0, p1, r1}"
            if mode.startswith("fp8_mma_sync"):
                op = "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32"
            elif mode.startswith("native_proxy"):  # one MMA instruction per group (the count of a QGMMA)
                op = "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
            else:
                raise ValueError(mode)
            lines += [f"{op} {acc}, {a}, {{${q}, ${q + 1}}}, {acc0};"]
            if mode.endswith("2term"):
                lines += [f"{op} {acc}, {a}, {{${q + 2}, ${q + 3}}}, {acc};"]
        shift = 23 - 8 * g
        lines += [f"shl.b32 fa, ${kw}, {shift}; shl.b32 fb, ${kw + 2}, {shift};" if shift > 0
                  else f"shr.b32 fa, ${kw}, 1; shr.b32 fb, ${kw + 2}, 1;",
                  "and.b32 fa, fa, 0x7F800000; and.b32 fb, fb, 0x7F800000;"]
        if g == 0:
            lines += ["mul.f32 $0, e0, fa; mul.f32 $1, e1, fa; mul.f32 $2, e2, fb; mul.f32 $3, e3, fb;"]
        else:
            lines += ["fma.rn.f32 $0, e0, fa, $0; fma.rn.f32 $1, e1, fa, $1; fma.rn.f32 $2, e2, fb, $2; "
                      "fma.rn.f32 $3, e3, fb, $3;"]
    return " ".join(lines + ["}"])


KERNEL_MODES = ("today", "fp8_mma_sync", "fp8_mma_sync_2term", "e4m3_f2fp_f16", "native_proxy",
                "native_proxy_2term", "no_conversion", "pv_no_scale_mul")
"""``pv_no_scale_mul``: today's QK, the V side without its relative-scale ``mul.rn.f16x2`` (the bound of
folding V scales into P, for context; QK modes leave ``_PV_ASM`` as it is)."""


def pv_no_scale_ptx() -> str:
    from ultraquant.kernels.gluon.decode_wholepage import _pv_word_ptx

    return re.sub(r"mul\.rn\.f16x2 [^;]*;\s*", "", _pv_word_ptx(1))


def qk_block_census(modes=KERNEL_MODES[:7]) -> dict:
    """SASS of one ``_qk_runs`` block (one 16-token run, 4 scale groups, per thread) in each QK mode, alone
    in a kernel (inputs loaded per thread, outputs stored): the K side of one run."""
    out = {}
    for mode in modes:
        body = re.sub(r"\$(\d+)", r"x\1", qk_variant_ptx(mode))
        ptx = (HEAD.format(arch="sm_90") + ".reg .b32 x<32>; .reg .b64 rp;\nld.param.u64 rp, [p];\n"
               "{ .reg .b32 tx; .reg .b64 tw; mov.u32 tx, %tid.x; mul.wide.u32 tw, tx, 256; add.s64 rp, rp, tw; }\n"
               + "".join(f"ld.global.b32 x{i}, [rp+{4 * i}];\n" for i in range(4, 32)) + body + "\n"
               + "".join(f"st.global.b32 [rp+{128 + 4 * i}], x{i};\n" for i in range(4)) + "ret;\n}\n")
        ins = _alu(ptx_sass(ptx, "sm_90"))
        mix = collections.Counter(_opc(t) for t in ins)
        out[mode] = {"per_run": len(ins), "per_stage_per_warp": 4 * len(ins), "mix": dict(mix.most_common())}
        print(f"qk block {mode:22s} {len(ins)} per run: " + ", ".join(f"{k} {v}" for k, v in mix.most_common(8)),
              flush=True)
    return out


def kernel_census(modes=KERNEL_MODES) -> dict:
    from triton.experimental.gluon import language as gl

    from tools.sass_loop import cuobjdump, loops, opcode, sass_lines
    from tools.wholepage_sass import compile_wholepage
    from ultraquant.kernels.gluon import decode_wholepage as dw

    saved, saved_pv = dw._QK_ASM, dw._PV_ASM
    out = {}
    try:
        for mode in modes:
            dw._QK_ASM = gl.constexpr(qk_variant_ptx("today" if mode.startswith("pv_") else mode))
            dw._PV_ASM = gl.constexpr(pv_no_scale_ptx()) if mode == "pv_no_scale_mul" else saved_pv
            cubin, md, spec = compile_wholepage(dict(A_SHAPE))
            ins = sass_lines(cubin)
            start, end = loops(ins)[0]
            body = [t for a, t in ins if start <= a <= end]
            mix = collections.Counter(opcode(t) for t in body)
            usage = re.search(r"REG:(\d+) STACK:(\d+)", cuobjdump(cubin, "-res-usage"))
            out[mode] = {"stage_loop": len(body), "registers": int(usage.group(1)), "stack": int(usage.group(2)),
                         "total": len(ins), "mix": dict(mix.most_common(14)),
                         "mma": {k: v for k, v in mix.items() if "MMA" in k or k.startswith("F2FP")}}
            print(f"{mode:22s} stage loop {len(body)} regs {usage.group(1)} "
                  + ", ".join(f"{k} {v}" for k, v in mix.most_common(8)), flush=True)
    finally:
        dw._QK_ASM, dw._PV_ASM = saved, saved_pv
    return out


def predict(kern: dict, ptx: dict) -> dict:
    today = kern["today"]["stage_loop"]
    wg_sync = sum(v for k, v in ptx["wgmma_e4m3_regA_sm90a"]["mix"].items() if k.startswith("WARPGROUP"))
    rows = {}
    for mode, r in kern.items():
        n = r["stage_loop"] + (wg_sync if mode.startswith("native_proxy") else 0)  # one arrive + wait per stage
        removed = today - n
        rows[mode] = {"stage_loop": n, "vs_today": -removed,
                      "us_per_stage_if_time_tracks_count": round(US_PER_STAGE * n / STAGE_LOOP_TODAY, 3),
                      "us_per_stage_at_quarter_yield": round(US_PER_STAGE * (1 - ALU_YIELD * removed / today), 3)}
    return {"calibration": {"us_per_stage": US_PER_STAGE, "stage_loop": STAGE_LOOP_TODAY, "alu_yield": ALU_YIELD},
            "rows": rows}


# ---------------------------------------------------------------- 4. accuracy (cheap, CPU)
def accuracy(seeds: int = 6) -> dict:
    import torch

    from benchmarks.lab.query_precision import problem
    from ultraquant import reference as ref
    from ultraquant.format import hadamard

    def e4m3(x):
        return x.to(torch.float8_e4m3fn).float()

    def row_scale(x):  # one power-of-two scale per query row (448 = e4m3's largest)
        amax = x.abs().amax(-1, keepdim=True).clamp_min(2.0**-100)
        return torch.exp2(torch.ceil(torch.log2(amax / 448.0)))

    def fp8_row_1term(x):
        s = row_scale(x)
        return e4m3(x / s) * s

    def fp8_row_2term(x):  # hi + lo at the same row scale: both MMAs into one accumulator
        s = row_scale(x)
        hi = e4m3(x / s)
        return (hi + e4m3(x / s - hi)) * s

    variants = {"fp16": lambda x: x.to(torch.float16).float(), "fp8_row_1term": fp8_row_1term,
                "fp8_row_2term": fp8_row_2term}
    d = 128
    h = hadamard(d, dtype=torch.float64)
    rows = {}
    for name, fn in variants.items():
        errs = []
        for s in range(seeds):
            q, k, v = problem(s, d)
            codes_k, sc_k = ref.quantize(k, rotate=True)
            codes_v, sc_v = ref.quantize(v, rotate=False)
            kr = ref.dequantize(codes_k, sc_k, rotate=False, dtype=torch.float64)
            vv = ref.dequantize(codes_v, sc_v, rotate=False, dtype=torch.float64)
            qr = q.double() @ h
            exact = torch.softmax(qr @ kr.T * d**-0.5, -1) @ vv
            p = torch.softmax(fn(qr.float()).double() @ kr.T * d**-0.5, -1)
            got = p.float().to(torch.float16).double() @ vv
            errs.append(((got - exact).norm() / exact.norm()).item())
        rows[f"D128_q_{name}_p_fp16"] = {"mean_rel_error": sum(errs) / len(errs), "max_rel_error": max(errs)}
        print(f"accuracy {name:16s} mean {rows[f'D128_q_{name}_p_fp16']['mean_rel_error']:.2e}", flush=True)
    prior = {}
    res = ROOT / "benchmarks" / "results"
    qp = json.loads((res / "query_precision.json").read_text())["rows"]
    prior["query_precision.json"] = {k: v for k, v in qp.items() if k.startswith("D128")}
    kl = json.loads((res / "operand_precision_kl.json").read_text())["variants"]
    prior["operand_precision_kl.json (SmolLM2 KL, whole GPL-3 text; gate +2% vs bf16 q / bf16 P)"] = {
        v["name"]: v["mean_kl"] for v in kl}
    return {"new_cpu_check": {"what": "query_precision.py's problem (Student-t(4), 4 outlier channels x20, GQA 8, "
                                      f"2048 tokens), D=128, fp16 P, seeds 0..{seeds - 1}", "rows": rows},
            "measured_before": prior}


def write_tree(mode: str, dest: Path) -> Path:
    """A copy of this tree's ``ultraquant`` and ``benchmarks`` (symlinks followed) under ``dest`` whose
    decode_wholepage.py holds ``mode``'s PTX as a literal, for timing on a device with
    ``PYTHONPATH=dest`` (benchmarks/lab/wholepage_costs.py; FP8 modes give wrong scores: timing only)."""
    import shutil

    for sub in ("ultraquant", "benchmarks"):
        shutil.rmtree(dest / sub, ignore_errors=True)
        shutil.copytree(ROOT / sub, dest / sub, symlinks=False, ignore=shutil.ignore_patterns("__pycache__"))
    f = dest / "ultraquant" / "kernels" / "gluon" / "decode_wholepage.py"
    text = f.read_text()
    if mode == "pv_no_scale_mul":
        old, new = "_PV_ASM = gl.constexpr(_pv_word_ptx())", f"_PV_ASM = gl.constexpr({pv_no_scale_ptx()!r})"
    else:
        old, new = "_QK_ASM = gl.constexpr(_qk_ptx())", f"_QK_ASM = gl.constexpr({qk_variant_ptx(mode)!r})"
    assert text.count(old) == 1, old
    f.write_text(text.replace(old, new))
    return dest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--skip-kernel", action="store_true", help="only the bit checks, small PTX and accuracy")
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--write-tree", nargs=2, metavar=("MODE", "DIR"),
                    help="only write a variant tree (KERNEL_MODES) for device timing, then exit")
    a = ap.parse_args()
    if a.write_tree:
        print(write_tree(a.write_tree[0], Path(a.write_tree[1])))
        return
    res = {"what": __doc__.split("\n")[0], "shape": {"head_size": 128, **A_SHAPE}, "bits": check_bits()}
    print(json.dumps(res["bits"]), flush=True)
    res["ptx"] = ptx_census()
    for k, v in res["ptx"].items():
        print(k, {kk: vv for kk, vv in v.items() if kk != "note"}, flush=True)
    res["qk_block"] = qk_block_census()
    if not a.skip_kernel:
        res["kernel"] = kernel_census()
        res["prediction"] = predict(res["kernel"], res["ptx"])
        for k, v in res["prediction"]["rows"].items():
            print(f"predict {k:22s} {v}", flush=True)
    res["accuracy"] = accuracy(a.seeds)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
