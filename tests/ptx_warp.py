"""A tiny PTX interpreter for one warp, for the kernels' inline-asm blocks (tests only, CPU).

Runs the straight-line PTX that the Gluon kernels pass to ``inline_asm_elementwise`` for all 32 lanes in
lockstep (numpy arrays of 32 values per register, 32 or 64 bits; predicates 0 / 1), with the warp-collective
instructions they use (``mma.sync...m16n8k16`` f16 -> f32, ``movmatrix...m8n8.trans.b16``) gathered and scattered
by the fragment layouts of the PTX ISA ("Matrix Fragments for mma.m16n8k16", "movmatrix"). ``cp.async`` is not
performed but recorded (``copies``: per instruction the lanes' shared and global addresses, sizes and whether the
lane's guard let it copy; ``groups``: the copy count at each ``commit_group``); shared-memory symbols take the
values given in ``symbols``. Only the
instructions the kernels emit are implemented; anything else raises. The tests check the kernels' PTX against a
float64 reference of what the asm block claims to compute, so an index or fragment-map mistake fails on the CPU.
"""

from __future__ import annotations

import re

import numpy as np

LANES = 32


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.uint16).view(np.float16)


def _lo(x: np.ndarray) -> np.ndarray:
    return _f16(x & 0xFFFF).astype(np.float32)


def _hi(x: np.ndarray) -> np.ndarray:
    return _f16(x >> 16).astype(np.float32)


def _pack(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Two float arrays as fp16 pairs (round to nearest even), low half first."""
    b_lo = lo.astype(np.float16).view(np.uint16).astype(np.uint32)
    b_hi = hi.astype(np.float16).view(np.uint16).astype(np.uint32)
    return b_lo | (b_hi << 16)


def _as_f32(x: np.ndarray) -> np.ndarray:
    return x.astype(np.uint32).view(np.float32).astype(np.float64)


def _from_f32(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32).view(np.uint32).astype(np.uint32)


def mma_a_index(lane: int, reg: int, half: int) -> tuple[int, int]:
    """(row, k) of A element ``half`` of register ``reg`` (0..3) of ``lane`` in ``m16n8k16`` (f16)."""
    g, t = lane // 4, lane % 4
    return g + 8 * (reg % 2), 2 * t + half + 8 * (reg // 2)


def mma_b_index(lane: int, reg: int, half: int) -> tuple[int, int]:
    """(k, n) of B element ``half`` of register ``reg`` (0..1) of ``lane``."""
    g, t = lane // 4, lane % 4
    return 2 * t + half + 8 * reg, g


def mma_c_index(lane: int, reg: int) -> tuple[int, int]:
    """(row, n) of C / D element ``reg`` (0..3) of ``lane``."""
    g, t = lane // 4, lane % 4
    return g + 8 * (reg // 2), 2 * t + reg % 2


class Warp:
    """Registers of one warp: ``regs[name]`` is a uint32 array of 32 lanes."""

    def __init__(self, operands: list[np.ndarray], symbols: dict[str, int] | None = None):
        self.regs: dict[str, np.ndarray] = {f"${i}": np.asarray(v, dtype=np.uint64).copy()
                                            for i, v in enumerate(operands)}
        self.symbols = symbols or {}
        self.copies: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        self.groups: list[int] = []

    def value(self, tok: str) -> np.ndarray:
        tok = tok.strip()
        if tok in self.regs:
            return self.regs[tok]
        if tok in self.symbols:
            return np.full(LANES, self.symbols[tok], dtype=np.uint64)
        if re.fullmatch(r"0f[0-9A-Fa-f]{8}", tok):
            return np.full(LANES, int(tok[2:], 16), dtype=np.uint32)
        if re.fullmatch(r"-?(0x[0-9A-Fa-f]+|\d+)", tok):
            return np.full(LANES, int(tok, 0) & 0xFFFFFFFF, dtype=np.uint32)
        raise KeyError(f"unknown operand {tok!r}")

    def set(self, name: str, v: np.ndarray, bits: int = 32) -> None:
        self.regs[name.strip()] = np.asarray(v, dtype=np.uint64) & np.uint64((1 << bits) - 1)

    def address(self, tok: str) -> np.ndarray:
        """``[reg]`` or ``[reg+imm]`` (imm signed) as 64-bit addresses."""
        m = re.fullmatch(r"\[\s*([^\]+]+?)\s*(?:\+\s*(-?\d+))?\s*\]", tok.strip())
        if not m:
            raise ValueError(f"bad address {tok!r}")
        return self.value(m.group(1)) + np.uint64(int(m.group(2) or 0) % (1 << 64))

    def run(self, ptx: str) -> None:
        body = ptx.strip()
        if body.startswith("{") and body.endswith("}"):  # the asm block's own scope, not an operand group
            body = body[1:-1]
        for stmt in body.split(";"):
            stmt = stmt.strip()
            if not stmt or stmt.startswith(".reg"):
                continue
            guard = np.ones(LANES, dtype=bool)
            if stmt.startswith("@"):  # a guard predicate: only cp.async takes one here
                pred, _, stmt = stmt[1:].partition(" ")
                guard = self.value(pred) != 0
            op, _, rest = stmt.partition(" ")
            self.step(op, rest, guard)

    def step(self, op: str, rest: str, guard: np.ndarray | None = None) -> None:
        if op.startswith("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"):
            groups = [[t.strip() for t in g.split(",")] for g in re.findall(r"\{([^}]*)\}", rest)]
            self.mma(*groups)
            return
        args = [a.strip() for a in rest.split(",")]
        if op.startswith("cp.async"):
            self.copy(op, args, np.ones(LANES, dtype=bool) if guard is None else guard)
            return
        if guard is not None and not guard.all():
            raise NotImplementedError(f"guarded {op}")
        if op in ("add.s64", "add.u64"):  # the immediate may be negative: two's complement, mod 2**64
            self.set(args[0], self.value(args[1]) + np.uint64(self.imm64(args[2])), bits=64)
            return
        v = [self.value(a) for a in args[1:]]
        if op == "prmt.b32":
            self.set(args[0], prmt(v[0], v[1], v[2]))
        elif op == "shl.b32":
            self.set(args[0], (v[0].astype(np.uint64) << v[1].astype(np.uint64)) & np.uint64(0xFFFFFFFF))
        elif op == "shr.b32":
            self.set(args[0], v[0] >> v[1])
        elif op == "and.b32":
            self.set(args[0], v[0] & v[1])
        elif op == "or.b32":
            self.set(args[0], v[0] | v[1])
        elif op in ("mov.b32", "mov.f32", "mov.u32"):
            self.set(args[0], v[0])
        elif op in ("add.u32", "add.s32"):
            self.set(args[0], v[0] + v[1])
        elif op == "setp.lt.u32":
            self.set(args[0], (v[0] & 0xFFFFFFFF) < (v[1] & 0xFFFFFFFF))
        elif op == "selp.b32":
            self.set(args[0], np.where(v[2] != 0, v[0], v[1]))
        elif op == "selp.b64":
            self.set(args[0], np.where(v[2] != 0, v[0], v[1]), bits=64)
        elif op == "bar.warp.sync":
            pass
        elif op == "mul.rn.f16x2":
            self.set(args[0], _pack(_lo(v[0]) * _lo(v[1]), _hi(v[0]) * _hi(v[1])))
        elif op == "cvt.rn.f16x2.f32":  # d = {a -> upper half, b -> lower half}
            self.set(args[0], _pack(_as_f32(v[1]), _as_f32(v[0])))
        elif op == "mul.f32":
            self.set(args[0], _from_f32(_as_f32(v[0]) * _as_f32(v[1])))
        elif op == "fma.rn.f32":
            self.set(args[0], _from_f32(_as_f32(v[0]) * _as_f32(v[1]) + _as_f32(v[2])))
        elif op == "movmatrix.sync.aligned.m8n8.trans.b16":
            self.set(args[0], movmatrix_trans(v[0]))
        else:
            raise NotImplementedError(op)

    def imm64(self, tok: str) -> int:
        """The signed immediate second operand of a 64-bit ``add``, mod 2**64 (a register there is not emitted)."""
        tok = tok.strip()
        if re.fullmatch(r"-?\d+", tok):
            return int(tok) % (1 << 64)
        raise ValueError(f"add.s64 with a register second operand: {tok!r}")

    def copy(self, op: str, args: list[str], guard: np.ndarray) -> None:
        if op == "cp.async.commit_group":
            self.groups.append(len(self.copies))
        elif op.startswith("cp.async.wait_group"):
            pass
        elif op == "cp.async.cg.shared.global":
            dst, src, cp_size, src_size = args
            if int(cp_size) != 16:
                raise ValueError("cp.async.cg copies 16 bytes")
            self.copies.append((self.address(dst) & np.uint64(0xFFFFFFFF), self.address(src), self.value(src_size),
                                guard))
        else:
            raise NotImplementedError(op)

    def mma(self, d: list[str], a: list[str], b: list[str], c: list[str]) -> None:
        ah = [(_lo(x), _hi(x)) for x in map(self.value, a)]  # each register's two fp16 halves
        bh = [(_lo(x), _hi(x)) for x in map(self.value, b)]
        cv = [_as_f32(self.value(x)) for x in c]
        A = np.zeros((16, 16))
        B = np.zeros((16, 8))
        C = np.zeros((16, 8))
        for lane in range(LANES):
            for r in range(4):
                for h in range(2):
                    A[mma_a_index(lane, r, h)] = ah[r][h][lane]
                C[mma_c_index(lane, r)] = cv[r][lane]
            for r in range(2):
                for h in range(2):
                    B[mma_b_index(lane, r, h)] = bh[r][h][lane]
        D = A @ B + C
        for r in range(4):
            self.set(d[r], _from_f32(np.array([D[mma_c_index(lane, r)] for lane in range(LANES)])))


def prmt(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """``prmt.b32`` default mode: byte k of the result is byte ``c[4k+2:4k]`` of ``{b, a}`` (b high), replicated
    sign of that byte if bit ``4k + 3`` is set."""
    src = (b.astype(np.uint64) << 32) | a.astype(np.uint64)
    out = np.zeros(LANES, dtype=np.uint64)
    for k in range(4):
        sel = (c.astype(np.uint64) >> (4 * k)) & 0xF
        byte = (src >> ((sel & 7) * 8)) & 0xFF
        byte = np.where(sel & 8, np.where(byte & 0x80, 0xFF, 0), byte).astype(np.uint64)
        out |= byte << np.uint64(8 * k)
    return out.astype(np.uint32)


def movmatrix_trans(a: np.ndarray) -> np.ndarray:
    """``movmatrix.sync.aligned.m8n8.trans.b16``: lane ``4r + q`` holds row r, columns 2q, 2q + 1 (low half
    first) of the 8 x 8 matrix; the result holds the transpose in the same fragment layout."""
    m = np.zeros((8, 8), dtype=np.uint32)
    for lane in range(LANES):
        r, q = lane // 4, lane % 4
        m[r, 2 * q], m[r, 2 * q + 1] = a[lane] & 0xFFFF, a[lane] >> 16
    t = m.T
    out = np.zeros(LANES, dtype=np.uint32)
    for lane in range(LANES):
        r, q = lane // 4, lane % 4
        out[lane] = t[r, 2 * q] | (t[r, 2 * q + 1] << 16)
    return out


def layout_lanes(matrix: np.ndarray, elements: list) -> list[np.ndarray]:
    """Per-lane registers of a Gluon tensor tile: ``elements[e](lane)`` is the (row, col) that packed element
    ``e`` of ``lane`` holds; returns one uint32 array (32 lanes) per element."""
    return [np.array([matrix[elements[e](lane)] for lane in range(LANES)], dtype=np.uint32)
            for e in range(len(elements))]


def mma_layout(cols_reps: int = 1) -> list:
    """The element map of the ``[16, 8 * cols_reps]`` MMA accumulator layout (Gluon's NVMMA v2, instr [16, 8]):
    registers (g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1), then the same 8 columns further."""
    out = []
    for rep in range(cols_reps):
        for reg in range(4):
            out.append(lambda lane, reg=reg, rep=rep: (mma_c_index(lane, reg)[0], mma_c_index(lane, reg)[1] + 8 * rep))
    return out
