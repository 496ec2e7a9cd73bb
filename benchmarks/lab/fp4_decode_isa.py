"""VALU count of FP4 decode formulas as LLVM's AMDGPU backend compiles them (issue 26), no GPU.

Writes a tiny LLVM IR kernel per formula (each lane loads 8 code words = one 16-token tile's K and
V codes at D=128, decodes them, stores the operand words), compiles it with ``llc-22 -mcpu=gfx942``
(the backend FlyDSL lowers through) and counts the VALU instructions between the loads and the
stores. Formulas: today's per-code bf16 build (``layout.fp4_bf16_bits``, scale folded into the
exponent, three selects) and the bit placements of ``ultraquant/kernels/flydsl/fp4_bits.py``.

    python benchmarks/lab/fp4_decode_isa.py [--llc llc-22] [--mcpu gfx942] [--out FILE]
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import tempfile
from pathlib import Path

WORDS = 8
"""Code words per lane per 16-token tile at D=128 (64 K+V codes)."""


class _IR:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.n = 0

    def op(self, text: str) -> str:
        self.n += 1
        name = f"%t{self.n}"
        self.lines.append(f"  {name} = {text}")
        return name

    def bin(self, kind: str, a: str, b: str | int) -> str:
        return self.op(f"{kind} i32 {a}, {b}")


def _fp16(ir: _IR, w: str, scale: str = "") -> list[str]:
    hi = 0x80808080 - 2**32
    x = ir.bin("or", ir.bin("and", ir.bin("shl", w, 1), 0x0E0E0E0E), ir.bin("and", ir.bin("shl", w, 4), hi))
    y = ir.bin("or", ir.bin("and", ir.bin("lshr", w, 3), 0x0E0E0E0E), ir.bin("and", w, 0x80808080 - 2**32))
    m = 0xFF00FF00 - 2**32
    return [ir.bin("and", x, m), ir.bin("and", ir.bin("shl", x, 8), m), ir.bin("and", y, m),
            ir.bin("and", ir.bin("shl", y, 8), m)]


def _fp16_perm(ir: _IR, w: str, scale: str = "") -> list[str]:
    """:func:`_fp16` with the byte moves as ``v_perm_b32`` (bytes 0, 2 of X/Y up one byte, zeros between)."""
    hi = 0x80808080 - 2**32
    x = ir.bin("or", ir.bin("and", ir.bin("shl", w, 1), 0x0E0E0E0E), ir.bin("and", ir.bin("shl", w, 4), hi))
    y = ir.bin("or", ir.bin("and", ir.bin("lshr", w, 3), 0x0E0E0E0E), ir.bin("and", w, hi))
    m = 0xFF00FF00 - 2**32
    sel = 0x060C040C

    def perm(v: str) -> str:
        return ir.op(f"call i32 @llvm.amdgcn.perm(i32 {v}, i32 0, i32 {sel})")

    return [ir.bin("and", x, m), perm(x), ir.bin("and", y, m), perm(y)]


def _fp8(ir: _IR, w: str, fnuz: bool) -> list[str]:
    sign = w
    if fnuz:
        nz = ir.bin("and", ir.bin("add", ir.bin("and", w, 0x77777777), 0x77777777), 0x88888888 - 2**32)
        sign = ir.bin("and", w, nz)
    hi = 0x80808080 - 2**32
    x = ir.bin("or", ir.bin("and", ir.bin("shl", w, 2), 0x1C1C1C1C), ir.bin("and", ir.bin("shl", sign, 4), hi))
    y = ir.bin("or", ir.bin("and", ir.bin("lshr", w, 2), 0x1C1C1C1C), ir.bin("and", sign, 0x80808080 - 2**32))
    return [x, y]


def _bf16_code(ir: _IR, nib: str, scale: str) -> str:
    """layout.fp4_bf16_bits for one code (int32), as the kernel writes it."""
    mag = ir.bin("and", nib, 7)
    bits = ir.bin("add", ir.bin("shl", mag, 6), ir.bin("shl", ir.bin("add", scale, -1), 7))
    is1 = ir.op(f"icmp eq i32 {mag}, 1")
    bits = ir.op(f"select i1 {is1}, i32 {ir.bin('add', bits, -64)}, i32 {bits}")
    is0 = ir.op(f"icmp eq i32 {mag}, 0")
    bits = ir.op(f"select i1 {is0}, i32 0, i32 {bits}")
    z = ir.op(f"icmp eq i32 {scale}, 0")
    bits = ir.op(f"select i1 {z}, i32 0, i32 {bits}")
    return ir.bin("or", bits, ir.bin("shl", ir.bin("and", nib, 8), 12))


def _bf16(ir: _IR, w: str, scale: str) -> list[str]:
    codes = [_bf16_code(ir, ir.bin("and", ir.bin("lshr", w, 4 * i), 15), scale) for i in range(8)]
    return [ir.bin("or", ir.bin("and", codes[2 * i], 0xFFFF), ir.bin("shl", codes[2 * i + 1], 16)) for i in range(4)]


FORMULAS = {"bf16_today": _bf16, "fp16_bits": _fp16, "fp16_bits_perm": _fp16_perm,
            "e4m3_bits": lambda ir, w, s: _fp8(ir, w, False),
            "e4m3fnuz_bits": lambda ir, w, s: _fp8(ir, w, True)}


def kernel_ir(formula: str) -> str:
    ir = _IR()
    ir.lines.append("  %tid = call i32 @llvm.amdgcn.workitem.id.x()")
    ir.lines.append(f"  %base = mul i32 %tid, {WORDS + 1}")
    words = []
    for i in range(WORDS + 1):
        idx = ir.bin("add", "%base", i)
        p = ir.op(f"getelementptr i32, ptr addrspace(1) %in, i32 {idx}")
        words.append(ir.op(f"load i32, ptr addrspace(1) {p}, align 4"))
    scale = ir.bin("and", words[-1], 255)
    outs = []
    for w in words[:WORDS]:
        outs += FORMULAS[formula](ir, w, scale)
    obase = ir.bin("mul", "%tid", len(outs))
    for i, v in enumerate(outs):
        p = ir.op(f"getelementptr i32, ptr addrspace(1) %out, i32 {ir.bin('add', obase, i)}")
        ir.lines.append(f"  store i32 {v}, ptr addrspace(1) {p}, align 4")
    body = "\n".join(ir.lines)
    return ("declare i32 @llvm.amdgcn.workitem.id.x()\ndeclare i32 @llvm.amdgcn.perm(i32, i32, i32)\n"
            "define amdgpu_kernel void @k(ptr addrspace(1) %in, ptr addrspace(1) %out) {\n"
            f"{body}\n  ret void\n}}\n")


def count(formula: str, llc: str, mcpu: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ll"
        src.write_text(kernel_ir(formula))
        asm = subprocess.run([llc, "-O3", "-mtriple=amdgcn-amd-amdhsa", f"-mcpu={mcpu}", str(src), "-o", "-"],
                             check=True, capture_output=True, text=True).stdout
    ins = [ln.split()[0] for ln in asm.splitlines() if re.match(r"^\s+[vs]_\w+", ln)]
    first = max(i for i, o in enumerate(ins) if o.startswith("global_load") or "load" in o) if ins else 0
    valu = [o for o in ins if o.startswith("v_") and not o.startswith(("v_mov", "v_readfirstlane"))]
    mix = collections.Counter(valu)
    return {"formula": formula, "valu": len(valu), "valu_per_word": len(valu) / WORDS, "mix": dict(mix.most_common()),
            "first_load_index": first}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llc", default="llc-22")
    ap.add_argument("--mcpu", default="gfx942")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    lines = []
    for f in FORMULAS:
        r = count(f, a.llc, a.mcpu)
        line = (f"{a.mcpu} {f}: {r['valu']} VALU for {WORDS} words = {r['valu_per_word']:.1f} per word of 8 codes; "
                f"{r['mix']}")
        print(line)
        lines.append(line)
    if a.out:
        a.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
