"""Run the FlyDSL decode kernel itself on the CPU: a 64-lane SIMT interpreter of its lowered MLIR.

The lane-layout emulation (:mod:`ultraquant.kernels.flydsl.layout`) re-implements the kernel; this
module executes the kernel's *own* code, as FlyDSL lowered it (the ``canonicalize`` stage just before
``scf`` becomes ``cf``: arith/vector/scf/gpu/llvm/rocdl ops on ``!llvm.ptr`` arguments), one wave at
a time, lanes in lockstep with execution masks for divergent ``scf.if``. Workgroups run one after
the other, so the split tickets and the last-split merge run as on a GPU whose waves happen to finish
in that order.

What it cannot tell: the hardware semantics of the few target ops. Those are modelled here with the
same assumptions the emulation documents (MFMA operand maps, FP4 nibble order, E8M0 scale bytes in
byte 0, ``src_sel`` picking a byte of the FP4 conversion), and ``v_exp_f32``/``v_log_f32``/
``v_rcp_f32`` are exact float32 here. Needs flydsl (its MLIR bindings parse the IR).
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import tempfile
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ultraquant.kernels.flags import ERROR_WORDS
from ultraquant.kernels.flydsl import layout as lay
from ultraquant.kernels.flydsl import operand_maps as om

LANES = 64
LDS_BYTES = 160 * 1024  # per workgroup and allocation (gfx950's limit; bounds-checked like memory)
_PTR_SHIFT = 40
_DISPATCH_BUF = 1  # buffer id of the HSA dispatch packet

_INT_RE = re.compile(r"^i(\d+)$")
_VEC_RE = re.compile(r"^vector<(\d+)x(\w+)>$")
_FP4 = torch.tensor(lay_vals := [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0,
                                  -3.0, -4.0, -6.0], dtype=torch.float32).numpy()
del lay_vals
_FORMAT_CODES = {"fp8_e4m3": 0, "bf8_e5m2": 1, "fp6_e2m3": 2, "bf6_e3m2": 3, "fp4_e2m1": 4}
"""cbsz/blgp codes of the scaled MFMA's matrix formats (the ROCDL enum prints names)."""


@dataclass(frozen=True)
class Ty:
    """A scalar or vector MLIR type: kind 'int'/'float'/'ptr'/'index', width or name, vector length."""

    kind: str
    elem: str
    width: int
    n: int = 0  # 0: scalar

    @property
    def nbytes(self) -> int:
        return max(1, self.width // 8) * max(1, self.n)


def parse_type(text: str) -> Ty:
    m = _VEC_RE.match(text)
    if m:
        e = parse_type(m.group(2))
        return Ty(e.kind, e.elem, e.width, int(m.group(1)))
    if text == "index":
        return Ty("int", "index", 64)
    m = _INT_RE.match(text)
    if m:
        return Ty("int", text, int(m.group(1)))
    if text.startswith("!llvm.ptr"):
        return Ty("ptr", text, 64)
    widths = {"f32": 32, "bf16": 16, "f16": 16, "f64": 64, "f8E4M3FN": 8}
    if text in widths:
        return Ty("float", text, widths[text])
    raise NotImplementedError(f"type {text}")


def _wrap(x: np.ndarray, width: int) -> np.ndarray:
    """Signed two's-complement value of the low ``width`` bits (i1 stays 0/1)."""
    if width == 1:
        return x & 1
    if width >= 64:
        return x.astype(np.int64)
    m = np.int64(1) << width
    x = x & (m - 1)
    return np.where(x >= (m >> 1), x - m, x)


def _unsigned(x: np.ndarray, width: int) -> np.ndarray:
    if width >= 64:
        return x.astype(np.uint64)
    return (x & ((np.int64(1) << width) - 1)).astype(np.int64)


def _round_float(x: np.ndarray, elem: str) -> np.ndarray:
    x = x.astype(np.float32)
    if elem == "bf16":
        return torch.from_numpy(np.ascontiguousarray(x)).to(torch.bfloat16).float().numpy()
    if elem == "f16":
        return x.astype(np.float16).astype(np.float32)
    return x


def _bits_of(x: np.ndarray, ty: Ty) -> np.ndarray:
    """Integer bit patterns (int64) of float values of type ``ty``."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if ty.elem == "f32":
        return x.view(np.int32).astype(np.int64)
    if ty.elem == "bf16":
        return (x.view(np.int32).astype(np.int64) >> 16) & 0xFFFF
    if ty.elem == "f16":
        return x.astype(np.float16).view(np.int16).astype(np.int64) & 0xFFFF
    raise NotImplementedError(ty)


def _float_of(bits: np.ndarray, ty: Ty) -> np.ndarray:
    bits = np.asarray(bits, dtype=np.int64)
    if ty.elem == "f32":
        return (bits & 0xFFFFFFFF).astype(np.uint32).view(np.float32)
    if ty.elem == "bf16":
        return ((bits & 0xFFFF) << 16).astype(np.uint32).view(np.float32)
    if ty.elem == "f16":
        return (bits & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float32)
    raise NotImplementedError(ty)


def _perm_b32(hi: np.ndarray, lo: np.ndarray, sel: np.ndarray) -> np.ndarray:
    """``v_perm_b32`` (``llvm.amdgcn.perm(src_hi, src_lo, sel)``): byte k of the result is byte
    ``sel_k`` of the 64-bit ``src_hi:src_lo`` for ``sel_k`` < 8, 0x00 for 0x0c, 0xff for 0x0d and above
    (AMD CDNA3 ISA, V_PERM_B32; FlyDSL's ``rocdl.perm_b32`` names the operands). The sign-replicating
    selectors 8..11 are not modelled (the kernel uses none)."""
    both = ((hi.astype(np.int64) & 0xFFFFFFFF) << 32) | (lo.astype(np.int64) & 0xFFFFFFFF)
    out = np.zeros_like(both)
    for k in range(4):
        s = (sel.astype(np.int64) >> (8 * k)) & 0xFF
        if np.any((s >= 8) & (s < 12)):
            raise NotImplementedError("v_perm_b32 sign-replicating selector")
        byte = np.where(s < 8, (both >> (8 * np.minimum(s, 7))) & 0xFF, np.where(s == 12, 0, 0xFF))
        out |= byte << (8 * k)
    return _wrap(out, 32)


@dataclass
class Memory:
    """Byte buffers addressed as ``(buffer_id << 40) | offset``."""

    buffers: dict[int, np.ndarray] = field(default_factory=dict)

    def add(self, data: np.ndarray) -> int:
        bid = max(max(self.buffers, default=1), _DISPATCH_BUF) + 1
        self.buffers[bid] = data
        return bid << _PTR_SHIFT

    def _split(self, addr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return addr >> _PTR_SHIFT, addr & ((np.int64(1) << _PTR_SHIFT) - 1)

    def read(self, addr: np.ndarray, nbytes: int, active: np.ndarray) -> np.ndarray:
        """(lanes, nbytes) uint8 (inactive lanes read zeros)."""
        out = np.zeros((addr.shape[0], nbytes), dtype=np.uint8)
        bid, off = self._split(addr)
        for lane in np.nonzero(active)[0]:
            buf = self.buffers[int(bid[lane])]
            o = int(off[lane])
            if o < 0 or o + nbytes > buf.shape[0]:
                raise IndexError(f"lane {lane}: read of {nbytes} bytes at {o} outside buffer {bid[lane]}"
                                 f" of {buf.shape[0]} bytes")
            out[lane] = buf[o : o + nbytes]
        return out

    def write(self, addr: np.ndarray, data: np.ndarray, active: np.ndarray) -> None:
        bid, off = self._split(addr)
        for lane in np.nonzero(active)[0]:
            buf = self.buffers[int(bid[lane])]
            o = int(off[lane])
            if o < 0 or o + data.shape[1] > buf.shape[0]:
                raise IndexError(f"lane {lane}: write at {o} outside buffer {bid[lane]}")
            buf[o : o + data.shape[1]] = data[lane]


def _to_bytes(value: np.ndarray, ty: Ty) -> np.ndarray:
    """(lanes, [n]) values -> (lanes, nbytes) uint8, little endian."""
    n = max(1, ty.n)
    lanes = value.shape[0]
    v = value.reshape(lanes, n)
    if ty.kind == "float":
        bits = _bits_of(v, Ty(ty.kind, ty.elem, ty.width))
    else:
        bits = v.astype(np.int64)
    nb = ty.width // 8
    out = np.zeros((lanes, n * nb), dtype=np.uint8)
    for k in range(nb):
        out[:, k::nb] = (bits >> (8 * k)) & 0xFF
    return out


def _from_bytes(raw: np.ndarray, ty: Ty) -> np.ndarray:
    n = max(1, ty.n)
    nb = ty.width // 8
    bits = np.zeros((raw.shape[0], n), dtype=np.int64)
    for k in range(nb):
        bits |= raw[:, k::nb].astype(np.int64) << (8 * k)
    if ty.kind == "float":
        val = _float_of(bits, Ty(ty.kind, ty.elem, ty.width))
    else:
        val = _wrap(bits, ty.width) if ty.kind == "int" else bits
    return val if ty.n else val[:, 0]


@dataclass
class Instr:
    """One operation, translated once: ids of its operands/results, parsed types and attributes."""

    name: str
    ins: list[int]
    outs: list[int]
    out_tys: list[Ty]
    in_tys: list[Ty]
    attrs: dict[str, Any]
    regions: list[tuple[list[int], list[Ty], list[Instr]]]


def _attr_int(text: str) -> int:
    return int(text.split(":")[0].strip())


class _Translator:
    def __init__(self, lanes: int):
        self.ids: dict[Any, int] = {}
        self.lanes = lanes

    def vid(self, v) -> int:
        if v not in self.ids:
            self.ids[v] = len(self.ids)
        return self.ids[v]

    def block(self, block) -> tuple[list[int], list[Ty], list[Instr]]:
        args = list(block.arguments)
        return ([self.vid(a) for a in args], [parse_type(str(a.type)) for a in args],
                [self.op(op.operation) for op in block.operations])

    def op(self, o) -> Instr:
        name = o.name
        attrs = {a: str(o.attributes[a]) for a in list(o.attributes)}
        out_tys = [parse_type(str(r.type)) for r in o.results]
        parsed: dict[str, Any] = {}
        if name == "arith.constant":
            parsed["value"] = _constant(attrs["value"], out_tys[0], self.lanes)
        if name == "llvm.mlir.addressof":
            parsed["sym"] = attrs["global_name"].lstrip("@")
        for key in ("predicate", "bin_op", "srcSelIndex", "src_sel_index"):
            if key in attrs:
                parsed[key] = _attr_int(attrs[key])
        if name == "vector.extract":
            parsed["pos"] = int(re.findall(r"-?\d+", attrs["static_position"].split(":")[1])[0])
        if name == "llvm.getelementptr":
            parsed["elem"] = parse_type(attrs["elem_type"])
            parsed["raw"] = [int(x) for x in re.findall(r"-?\d+", attrs["rawConstantIndices"].split(":", 1)[1])]
        if name == "gpu.block_id":
            parsed["dim"] = "xyz".index(attrs["dimension"][-2])
        if name == "gpu.shuffle" and "xor" not in attrs["mode"]:
            raise NotImplementedError(attrs["mode"])
        if name == "llvm.call_intrinsic":
            parsed["intrin"] = attrs["intrin"].strip('"')
        if name in ("rocdl.cvt.pk.fp8.f32", "rocdl.cvt.pk.f32.fp8"):
            parsed["word"] = attrs.get("wordSel", "false").strip().lower() in ("true", "1")
        if name == "rocdl.mfma.scale.f32.16x16x128.f8f6f4":
            parsed["fmt"] = (attrs.get("cbsz", ""), attrs.get("blgp", ""))  # A, B matrix formats
            if _attr_int(attrs.get("opselA", "0")) or _attr_int(attrs.get("opselB", "0")):
                raise NotImplementedError("scaled MFMA with a nonzero scale byte select")
        ins = [self.vid(x) for x in o.operands]
        in_tys = [parse_type(str(x.type)) for x in o.operands]
        regions = [self.block(r.blocks[0]) if len(r.blocks) else ([], [], []) for r in o.regions]
        return Instr(name, ins, [self.vid(r) for r in o.results], out_tys, in_tys, parsed, regions)


def _constant(text: str, ty: Ty, lanes: int = LANES) -> np.ndarray:
    body = text.rsplit(" : ", 1)[0].strip()
    if body.startswith("dense<"):
        body = body[len("dense<"):-1]
        if body.startswith("["):
            raise NotImplementedError(f"non-splat constant {text}")
    if body in ("true", "false"):
        val: float | int = int(body == "true")
    elif body.startswith("0x"):
        bits = int(body, 16)
        val = float(_float_of(np.array([bits]), Ty("float", ty.elem, ty.width))[0]) if ty.kind == "float" else bits
    elif ty.kind == "float":
        val = float(body)
    else:
        val = int(body)
    dtype = np.float32 if ty.kind == "float" else np.int64
    return np.full((lanes, ty.n) if ty.n else (lanes,), val, dtype=dtype)


def _norm(value: np.ndarray, ty: Ty) -> np.ndarray:
    if ty.kind == "int":
        return _wrap(np.asarray(value, dtype=np.int64), ty.width)
    if ty.kind == "float":
        return _round_float(np.asarray(value), ty.elem)
    return np.asarray(value, dtype=np.int64)


def _cmpi(p: int, a, b, width: int):
    if p >= 6:
        a, b = _unsigned(a, width), _unsigned(b, width)
    return [a == b, a != b, a < b, a <= b, a > b, a >= b, a < b, a <= b, a > b, a >= b][p]


def _cmpf(p: int, a, b):
    nan = np.isnan(a) | np.isnan(b)
    o = ~nan
    with np.errstate(invalid="ignore"):
        return {0: np.zeros_like(nan), 1: o & (a == b), 2: o & (a > b), 3: o & (a >= b), 4: o & (a < b),
                5: o & (a <= b), 6: o & (a != b), 7: o, 8: nan | (a == b), 9: nan | (a > b),
                10: nan | (a >= b), 11: nan | (a < b), 12: nan | (a <= b), 13: nan | (a != b), 14: nan,
                15: np.ones_like(nan)}[p]


_BIN = {"arith.addi": np.add, "llvm.add": np.add, "arith.subi": np.subtract, "arith.muli": np.multiply,
        "arith.andi": np.bitwise_and, "arith.ori": np.bitwise_or, "arith.xori": np.bitwise_xor,
        "arith.minsi": np.minimum, "arith.maxsi": np.maximum, "arith.maxnumf": np.fmax,
        "arith.minnumf": np.fmin}
_FBIN = {"arith.addf": np.add, "arith.subf": np.subtract, "arith.mulf": np.multiply, "arith.divf": np.divide}
_PASS = {"arith.extsi", "arith.index_cast", "arith.trunci", "arith.extf", "arith.truncf", "llvm.ptrtoint",
         "llvm.inttoptr"}


class Wave:
    """Executes one workgroup (one wave) of a translated kernel."""

    def __init__(self, mem: Memory, block_id: tuple[int, int, int], lanes: int = LANES,
                 shared: dict[str, int] | None = None):
        self.mem = mem
        self.block_id = block_id
        self.n = lanes
        self.shared = shared or {}
        self.env: dict[int, np.ndarray] = {}

    def _per_wave(self, fn, *arrays):
        """Apply a 64-lane operation to each wave of the workgroup and stack the results."""
        outs = [fn(*(x[w * LANES : (w + 1) * LANES] for x in arrays)) for w in range(self.n // LANES)]
        return np.concatenate(outs, axis=0)

    def run(self, body: list[Instr], active: np.ndarray) -> list[np.ndarray] | None:
        env = self.env
        for ins in body:
            if ins.name in ("scf.yield", "gpu.return"):
                return [env[i] for i in ins.ins]
            self.exec(ins, active)
        return None

    def exec(self, ins: Instr, active: np.ndarray) -> None:  # noqa: C901 (one dispatch table)
        env, name = self.env, ins.name
        a = [env[i] for i in ins.ins] if name not in ("scf.for", "scf.if") else []
        out = ins.outs[0] if ins.outs else None
        ty0 = ins.out_tys[0] if ins.outs else None
        at = ins.attrs
        if name == "arith.constant":
            env[out] = at["value"]
        elif name in _BIN:
            env[out] = _norm(_BIN[name](a[0], a[1]), ty0)
        elif name in _FBIN:
            with np.errstate(all="ignore"):
                env[out] = _norm(_FBIN[name](a[0].astype(np.float32), a[1].astype(np.float32)), ty0)
        elif name in _PASS:
            env[out] = _norm(a[0], ty0)
        elif name == "arith.shli":
            env[out] = _norm(a[0] << np.clip(a[1], 0, 63), ty0)
        elif name == "arith.shrsi":
            env[out] = _norm(a[0] >> np.clip(a[1], 0, 63), ty0)
        elif name == "arith.shrui":
            env[out] = _norm(_unsigned(a[0], ty0.width) >> np.clip(a[1], 0, 63), ty0)
        elif name == "arith.floordivsi":
            env[out] = _norm(np.floor_divide(a[0], np.where(a[1] == 0, 1, a[1])), ty0)
        elif name == "arith.divsi":
            env[out] = _norm(np.trunc(a[0] / np.where(a[1] == 0, 1, a[1])).astype(np.int64), ty0)
        elif name == "arith.remsi":
            env[out] = _norm(np.fmod(a[0], np.where(a[1] == 0, 1, a[1])), ty0)
        elif name == "arith.cmpi":
            env[out] = _cmpi(at["predicate"], a[0], a[1], ins.in_tys[0].width).astype(np.int64)
        elif name == "arith.cmpf":
            env[out] = _cmpf(at["predicate"], a[0], a[1]).astype(np.int64)
        elif name == "arith.select":
            c = a[0].astype(bool)
            if a[1].ndim > c.ndim:
                c = c.reshape(c.shape + (1,) * (a[1].ndim - c.ndim))
            env[out] = np.where(c, a[1], a[2])
        elif name == "math.fma":  # one rounding: the product and sum in float64, then to float32
            env[out] = _norm(a[0].astype(np.float64) * a[1] + a[2], ty0)
        elif name == "arith.sitofp":
            env[out] = _norm(a[0].astype(np.float32), ty0)
        elif name == "arith.extui":
            env[out] = _norm(_unsigned(a[0], ins.in_tys[0].width), ty0)
        elif name == "arith.negf":
            env[out] = -a[0]
        elif name == "math.absf":
            env[out] = np.abs(a[0])
        elif name in ("arith.bitcast", "vector.bitcast", "llvm.bitcast"):
            env[out] = _from_bytes(_to_bytes(a[0], ins.in_tys[0]), ty0)
        elif name == "vector.extract":
            env[out] = a[0][:, at["pos"]]
        elif name == "vector.from_elements":
            env[out] = np.stack(a, axis=1)
        elif name in ("vector.broadcast", "vector.splat"):
            env[out] = np.repeat(a[0][:, None], ty0.n, axis=1)
        elif name == "gpu.thread_id":
            env[out] = np.arange(self.n, dtype=np.int64)
        elif name == "gpu.block_id":
            env[out] = np.full(self.n, self.block_id[at["dim"]], dtype=np.int64)
        elif name == "gpu.shuffle":
            if np.any(a[1] >= LANES):
                raise NotImplementedError("shuffle across waves")
            env[out] = a[0][np.arange(self.n) ^ a[1]]
            env[ins.outs[1]] = np.ones(self.n, dtype=np.int64)
        elif name == "gpu.barrier":
            pass  # the workgroup's lanes run in lockstep: every barrier is already satisfied
        elif name == "rocdl.sched.barrier":
            pass  # an instruction-scheduling fence: no effect on values
        elif name == "llvm.mlir.addressof":
            env[out] = np.full(self.n, self.shared[at["sym"]], dtype=np.int64)
        elif name == "rocdl.readfirstlane":
            def first(x, act):
                idx = np.nonzero(act)[0]
                return np.full(LANES, x[idx[0]] if len(idx) else 0)
            env[out] = self._per_wave(first, a[0], active)
        elif name == "rocdl.cvt.pkrtz":  # two f32 -> two f16 toward zero
            pair = np.stack([a[0], a[1]], axis=1).astype(np.float32)
            env[out] = lay.to_fp16_rtz(torch.from_numpy(pair)).numpy()
        elif name == "rocdl.mbcnt.lo":  # src + set bits of the mask's low 32 below this lane
            lane = np.arange(self.n) % LANES
            below = (np.int64(1) << np.minimum(lane, 32)) - 1
            bits = (a[0].astype(np.int64) & 0xFFFFFFFF) & below
            env[out] = _norm(a[1] + np.array([bin(int(x)).count("1") for x in bits], dtype=np.int64), ty0)
        elif name == "rocdl.rcp":
            with np.errstate(all="ignore"):
                env[out] = np.float32(1.0) / a[0].astype(np.float32)
        elif name == "llvm.call_intrinsic":
            env[out] = self._intrinsic(at["intrin"], a)
        elif name == "llvm.getelementptr":
            off = np.zeros(self.n, dtype=np.int64)
            dyn = iter(a[1:])
            for idx in at["raw"]:
                step = next(dyn) if idx == -2147483648 else idx
                off = off + np.asarray(step, dtype=np.int64) * at["elem"].nbytes
            env[out] = a[0] + off
        elif name == "llvm.load":
            env[out] = _from_bytes(self.mem.read(a[0], ty0.nbytes, active), ty0)
        elif name == "llvm.store":
            self.mem.write(a[1], _to_bytes(a[0], ins.in_tys[0]), active)
        elif name == "llvm.atomicrmw":
            env[out] = self._atomic(at["bin_op"], a, ty0, active)
        elif name.startswith("rocdl.mfma.f32.16x16x16bf16"):
            fa = _float_of(a[0], Ty("float", "bf16", 16))
            fb = _float_of(a[1], Ty("float", "bf16", 16))
            env[out] = self._per_wave(lambda x, y, z: lay.mfma_16x16x16(
                torch.from_numpy(x.copy()), torch.from_numpy(y.copy()),
                torch.from_numpy(z.astype(np.float32).copy())).numpy(), fa, fb, a[2])
        elif name.startswith("rocdl.mfma.f32.16x16x16f16"):  # operands are f16 values already
            env[out] = self._per_wave(lambda x, y, z: lay.mfma_16x16x16(
                torch.from_numpy(x.astype(np.float32)), torch.from_numpy(y.astype(np.float32)),
                torch.from_numpy(z.astype(np.float32).copy()), "f16").numpy(), a[0], a[1], a[2])
        elif name == "rocdl.mfma.scale.f32.16x16x128.f8f6f4":
            env[out] = self._per_wave(lambda *x: self._scaled_mfma(at["fmt"], list(x)), *a)
        elif name == "rocdl.cvt.pk.fp8.f32":
            pair = torch.from_numpy(np.stack([a[0], a[1]], axis=1).astype(np.float32))
            b = pair.to(torch.float8_e4m3fn).view(torch.uint8).numpy().astype(np.int64)
            packed = b[:, 0] | (b[:, 1] << 8)
            old = a[2] & 0xFFFFFFFF
            env[out] = _norm((old & 0x0000FFFF) | (packed << 16) if at["word"] else (old & ~0xFFFF) | packed,
                             ty0)
        elif name == "rocdl.cvt.pk.f32.fp8":
            word = (a[0] >> (16 if at["word"] else 0)) & 0xFFFF
            pair = np.stack([word & 0xFF, word >> 8], axis=1).astype(np.uint8)
            env[out] = torch.from_numpy(pair).view(torch.float8_e4m3fn).float().numpy()
        elif name == "rocdl.cvt.scalef32.pk.bf16.fp4":
            sel = at.get("srcSelIndex", at.get("src_sel_index", 0))
            byte = (a[0] >> (8 * sel)) & 0xFF
            # the hardware takes the scale's exponent field: 2**(field - 127), so +0.0 scales by 2**-127
            field = (np.ascontiguousarray(a[1], dtype=np.float32).view(np.int32) >> 23) & 0xFF
            sc = om.e8m0_value(torch.from_numpy(field.astype(np.int64))).numpy()
            env[out] = _round_float(np.stack([_FP4[byte & 0xF], _FP4[byte >> 4]], axis=1) * sc[:, None], "bf16")
        elif name == "scf.for":
            self._for(ins, active)
        elif name == "scf.if":
            self._if(ins, active)
        else:
            raise NotImplementedError(f"op {name}")

    def _intrinsic(self, name: str, a) -> np.ndarray:
        if name == "llvm.amdgcn.dispatch.ptr":
            return np.full(self.n, _DISPATCH_BUF << _PTR_SHIFT, dtype=np.int64)
        with np.errstate(all="ignore"):
            if name == "llvm.amdgcn.exp2.f32":
                return np.exp2(a[0].astype(np.float32))
            if name == "llvm.amdgcn.log.f32":
                return np.log2(a[0].astype(np.float32))
        if name == "llvm.amdgcn.perm":
            return _perm_b32(a[0], a[1], a[2])
        raise NotImplementedError(f"intrinsic {name}")

    def _atomic(self, bin_op: int, a, ty: Ty, active) -> np.ndarray:
        old = np.zeros(self.n, dtype=np.int64)
        for lane in np.nonzero(active)[0]:
            mask = np.zeros(self.n, dtype=bool)
            mask[lane] = True
            cur = _from_bytes(self.mem.read(a[0], ty.nbytes, mask), ty)[lane]
            old[lane] = cur
            new = {0: a[1][lane], 1: cur + a[1][lane]}[bin_op]
            self.mem.write(a[0], _to_bytes(np.full(self.n, new, dtype=np.int64), ty), mask)
        return old

    def _scaled_mfma(self, fmt: tuple[str, str], a) -> np.ndarray:
        """The scaled MFMA with each operand decoded and placed by its format's operand map and
        scaled by K block through the scale map (:mod:`ultraquant.kernels.flydsl.operand_maps`)."""
        vals, maps = [], []
        for code_text, regs in zip(fmt, a[:2], strict=True):
            m = re.search(r"matrix_format (\w+)", code_text)
            code = _FORMAT_CODES.get(m.group(1), -1) if m else _attr_int(code_text)
            if code not in om.SCALED_MAPS:
                raise NotImplementedError(f"scaled MFMA format code {code}")
            raw = np.stack([(regs >> (8 * k)) & 0xFF for k in range(4)], axis=2).reshape(LANES, 32)
            if code == 4:  # E2M1: element v = nibble v % 2 (low first) of byte v // 2, dwords 0..3
                vals.append(_FP4[np.stack([raw[:, :16] & 0xF, raw[:, :16] >> 4], axis=2).reshape(LANES, 32)])
            else:  # E4M3 (OCP): element v = byte v
                vals.append(torch.from_numpy(raw.astype(np.uint8)).view(torch.float8_e4m3fn).float().numpy())
            maps.append(om.SCALED_MAPS[code])
        # opsel 0: byte 0 of each scale operand; E8M0 byte 0 means 2**-127 (not 0)
        sa, sb = (om.e8m0_value(torch.from_numpy(s & 0xFF)) for s in (a[3], a[4]))
        return lay.mfma_scale_16x16x128(torch.from_numpy(vals[0]), torch.from_numpy(vals[1]),
                                        torch.from_numpy(a[2].astype(np.float32).copy()), a_map=maps[0],
                                        b_map=maps[1], a_scale=sa, b_scale=sb).numpy()

    def _for(self, ins: Instr, active) -> None:
        env = self.env
        lb, ub, step = (env[i] for i in ins.ins[:3])
        first = int(np.nonzero(active)[0][0])
        for bound in (lb, ub, step):
            if np.any(bound[active] != bound[first]):
                raise RuntimeError("scf.for bounds differ across active lanes")
        state = [env[i] for i in ins.ins[3:]]
        args, _tys, body = ins.regions[0]
        for i in range(int(lb[first]), int(ub[first]), int(step[first])):
            env[args[0]] = np.full(self.n, i, dtype=np.int64)
            for aid, v in zip(args[1:], state, strict=True):
                env[aid] = v
            state = self.run(body, active)
        for rid, v in zip(ins.outs, state, strict=True):
            env[rid] = v

    def _if(self, ins: Instr, active) -> None:
        cond = self.env[ins.ins[0]].astype(bool)
        outs = []
        for (_args, _tys, body), mask in zip(ins.regions, (active & cond, active & ~cond), strict=False):
            outs.append(self.run(body, mask) if mask.any() and body else None)
        while len(outs) < 2:
            outs.append(None)
        for k, rid in enumerate(ins.outs):
            t = outs[0][k] if outs[0] is not None else None
            e = outs[1][k] if outs[1] is not None else None
            if t is None or e is None:
                self.env[rid] = e if t is None else t
            else:
                self.env[rid] = np.where(cond.reshape((self.n,) + (1,) * (t.ndim - 1)), t, e)


def lowered_ir(compile_fn) -> str:
    """Run ``compile_fn()`` (a FlyDSL compile) with IR dumps on; return the kernel's IR at the last
    stage that still has ``scf`` (the ``canonicalize`` before scf -> cf)."""
    with tempfile.TemporaryDirectory(prefix="uq-flydsl-ir-") as tmp:
        old = {k: os.environ.get(k) for k in ("FLYDSL_DUMP_IR", "FLYDSL_DUMP_DIR")}
        os.environ["FLYDSL_DUMP_IR"] = "1"
        os.environ["FLYDSL_DUMP_DIR"] = tmp
        failure: Exception | None = None
        try:
            with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
                compile_fn()
        except Exception as exc:  # noqa: BLE001 - a missing linker only breaks the final stage
            failure = exc
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        stages = sorted(glob.glob(os.path.join(tmp, "*", "*.mlir")))
        keep = None
        for path in stages:
            base = os.path.basename(path)
            if "scf_to_cf" in base:
                break
            keep = path
        if keep is None or (failure is not None and not any("scf_to_cf" in p for p in stages)):
            raise RuntimeError(f"no FlyDSL IR stage before scf -> cf was dumped ({failure})") from failure
        with open(keep) as f:
            return f.read()


class Kernel:
    """A kernel (first ``gpu.func`` of the module), translated once, run workgroup by workgroup."""

    def __init__(self, ir_text: str, lanes: int = LANES):
        from flydsl._mlir import ir
        from flydsl.compiler.jit_function import _create_mlir_context

        with _create_mlir_context():
            module = ir.Module.parse(ir_text)
            func = None
            for op in module.body.operations:
                if op.operation.name == "gpu.module":
                    for inner in op.operation.regions[0].blocks[0].operations:
                        if inner.operation.name == "gpu.func":
                            func = inner.operation
                            break
            if func is None:
                raise RuntimeError("no gpu.func in the module")
            self.lanes = lanes
            self.args, self.arg_tys, self.body = _Translator(lanes).block(func.regions[0].blocks[0])
            self.shared_syms = sorted(set(re.findall(r"llvm\.mlir\.addressof @(\w+)", ir_text)))

    def launch(self, grid: tuple[int, int, int], args: list[Any], mem: Memory,
               order: list[tuple[int, int, int]] | None = None) -> None:
        """Run every workgroup of ``grid`` (x fastest unless ``order`` is given); ``args`` are ints
        (pointers as Memory addresses, i32) or floats, in the kernel's parameter order."""
        packet = np.zeros(64, dtype=np.uint8)
        for k, n in enumerate(grid):
            packet[12 + 4 * k : 16 + 4 * k] = np.frombuffer(np.int32(n).tobytes(), dtype=np.uint8)
        mem.buffers[_DISPATCH_BUF] = packet
        if order is None:
            order = [(x, y, z) for z in range(grid[2]) for y in range(grid[1]) for x in range(grid[0])]
        for bid in order:
            shared = {sym: mem.add(np.zeros(LDS_BYTES, dtype=np.uint8)) for sym in self.shared_syms}
            wave = Wave(mem, bid, self.lanes, shared)
            for aid, ty, val in zip(self.args, self.arg_tys, args, strict=True):
                wave.env[aid] = (np.full(self.lanes, val, dtype=np.float32) if ty.kind == "float"
                                 else np.full(self.lanes, int(val), dtype=np.int64))
            wave.run(self.body, np.ones(self.lanes, dtype=bool))
            for sym in shared:  # LDS dies with the workgroup
                mem.buffers.pop(shared[sym] >> _PTR_SHIFT)


    def launch_tensors(self, grid: tuple[int, int, int], args: list[Any],
                       order: list[tuple[int, int, int]] | None = None) -> None:
        """Run with a LaunchPlan's arguments (CPU tensors and numbers, in parameter order): every
        tensor's storage is copied in and written back afterwards, as a GPU launch would leave it."""
        mem = Memory()
        addrs: list[Any] = []
        tensors = []
        for a in args:
            if isinstance(a, torch.Tensor):
                base = mem.add(_buffer(a))
                addrs.append(base + a.storage_offset() * a.element_size())
                tensors.append((a, base >> _PTR_SHIFT))
            else:
                addrs.append(a)
        self.launch(grid, addrs, mem, order=order)
        for t, bid in tensors:
            torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).copy_(torch.from_numpy(mem.buffers[bid]))


def _buffer(t: torch.Tensor) -> np.ndarray:
    """The bytes of a tensor's storage (so any strided view keeps its strides)."""
    return np.frombuffer(bytes(t.untyped_storage()), dtype=np.uint8).copy()


def run_decode(config: dict[str, Any], arch: str, query: torch.Tensor, kv_cache: torch.Tensor,
               block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, *, num_splits: int,
               sinks: torch.Tensor | None = None, window: int | None = None, softcap: float | None = None,
               mx: bool = False, order: list[tuple[int, int, int]] | None = None,
               kernel: Kernel | None = None, waves: int = 1, mx_query_map=None,
               pipelined: bool = True, errors: list[int] | None = None) -> torch.Tensor:
    """Compile the decode kernel for ``config`` (DecodeConfig fields) and run it here, with the very
    arguments and workspace ``ultraquant.kernels.plans.plan_decode`` would pass. Returns ``out``;
    the error words the kernel stored (``ultraquant.kernels.flags``) go into ``errors`` when given."""
    from ultraquant.codegen.flydsl.compiler import compile_decode

    qdt = {torch.bfloat16: "bf16", torch.float16: "fp16"}[query.dtype]
    if kernel is None:
        kernel = Kernel(lowered_ir(lambda: compile_decode(arch, "uq_decode_sim", config, query_dtype=qdt,
                                                            out_dtype=qdt, mx=mx, need_linker=False,
                                                            waves=waves, mx_query_map=mx_query_map,
                                                            pipelined=pipelined)),
                        lanes=LANES * waves)
    b, hq, d = query.shape
    hk = kv_cache.shape[2]
    out = torch.full_like(query, float("nan"))  # poisoned: every row must be written
    part = torch.full((b * hk * num_splits * 16 * d,), float("nan"), dtype=torch.float32)
    ml = torch.full((b * hk * num_splits * 32,), float("nan"), dtype=torch.float32)
    counter = torch.zeros(b * hk, dtype=torch.int32)
    sink_t = sinks.float().contiguous() if sinks is not None else torch.zeros(1)
    err = torch.zeros(ERROR_WORDS, dtype=torch.int32)
    args = [query, kv_cache, block_table.int(), seq_lens.int(), sink_t, out, part, ml, counter, err,
            float(scale), float(softcap or 0.0), int(window or 0), num_splits,
            kv_cache.shape[0], block_table.shape[1],
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), block_table.stride(0)]
    kernel.launch_tensors((b, hk, num_splits), args, order=order)
    if errors is not None:
        errors[:] = err.tolist()
    if torch.any(counter != 0):
        raise RuntimeError(f"tickets not reset after the launch: {counter.tolist()}")
    return out
