"""Read what the offline checks need from AMDGPU code objects (HSACO) and NVIDIA cubins.

Standard library only, so ``ultraquant verify`` works in an install without the build toolchain.
What is read, and from where:

- both: the ELF header (machine, flags, OS ABI and ABI version) and the symbol tables;
- HSACO: the ``NT_AMDGPU_METADATA`` note (MessagePack): per kernel the argument list (offset, size,
  value kind), VGPR/AGPR/SGPR counts and spills, static LDS, scratch, wavefront size;
- cubin: the ``.nv.info`` attribute tables: register count, frame/stack sizes (local memory, where
  spills go), the parameter list (``EIATTR_KPARAM_INFO``: ordinal, offset, size), the parameter bank
  size and the maximum threads per block, plus ``.nv.shared.<kernel>`` (static shared memory).

Tests cross-check this reader against pyelftools + msgpack and against ``cuobjdump``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

from .msgpack_lite import unpackb

EM_CUDA = 190
EM_AMDGPU = 224
NT_AMDGPU_METADATA = 32
SHT_SYMTAB, SHT_NOTE, SHT_DYNSYM = 2, 7, 11

# EIATTR codes of the cubin .nv.info tables (values as cuobjdump names them).
EIATTR_PARAM_CBANK = 0x0A
EIATTR_MAXNTID = 0x10
EIATTR_FRAME_SIZE = 0x11
EIATTR_MIN_STACK_SIZE = 0x12
EIATTR_KPARAM_INFO = 0x17
EIATTR_CBANK_PARAM_SIZE = 0x19
EIATTR_MAX_STACK_SIZE = 0x23
EIATTR_REGCOUNT = 0x2F
EIATTR_CUDA_API_VERSION = 0x37
# .nv.info entry formats: no value, byte value, half-word value, sized value.
EIFMT_NVAL, EIFMT_BVAL, EIFMT_HVAL, EIFMT_SVAL = 1, 2, 3, 4


class ElfError(ValueError):
    """The bytes are not a code object this reader understands (truncated, wrong class, ...)."""


@dataclass(frozen=True)
class KernelParam:
    """One entry of a kernel's argument block, as the binary describes it."""

    offset: int
    size: int
    kind: str


@dataclass
class KernelInfo:
    """One kernel of a code object: its parameters and resource usage."""

    name: str
    params: list[KernelParam]
    resources: dict[str, int]
    max_threads: int | None = None


@dataclass
class CodeObject:
    """The parts of a HSACO or cubin that the manifest and ``verify`` compare."""

    machine: int
    flags: int
    osabi: int
    abi_version: int
    symbols: dict[str, str] = field(default_factory=dict)
    kernels: dict[str, KernelInfo] = field(default_factory=dict)
    target: str = ""
    metadata: dict[str, Any] = field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class _Section:
    name: str
    type: int
    offset: int
    size: int
    link: int
    info: int
    entsize: int


def _cstr(data: bytes, offset: int) -> str:
    end = data.find(b"\0", offset)
    if end < 0:
        raise ElfError(f"unterminated string at byte {offset}")
    return data[offset:end].decode("utf-8", "replace")


def _sections(data: bytes) -> list[_Section]:
    if len(data) < 64 or data[:4] != b"\x7fELF":
        raise ElfError("not an ELF file (bad magic or shorter than an ELF header)")
    if data[4] != 2 or data[5] != 1:
        raise ElfError("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    if shentsize != 64 or shoff + shnum * 64 > len(data) or shstrndx >= max(shnum, 1):
        raise ElfError("section header table out of bounds")
    raw = []
    for i in range(shnum):
        name, typ, _flags, _addr, off, size, link, info, _align, entsize = struct.unpack_from(
            "<IIQQQQIIQQ", data, shoff + 64 * i)
        if typ != 8 and off + size > len(data):  # SHT_NOBITS occupies no file bytes
            raise ElfError(f"section {i} lies past the end of the file")
        raw.append((name, typ, off, size, link, info, entsize))
    strtab = raw[shstrndx]
    names = data[strtab[2]:strtab[2] + strtab[3]]
    return [_Section(_cstr(names, r[0]), r[1], r[2], r[3], r[4], r[5], r[6]) for r in raw]


def _symbols(data: bytes, secs: list[_Section]) -> tuple[dict[str, str], list[str]]:
    """Symbol name -> type (``func``/``object``/...) over .symtab and .dynsym, and .symtab by index."""
    kinds = {0: "notype", 1: "object", 2: "func", 3: "section", 4: "file"}
    out: dict[str, str] = {}
    symtab_names: list[str] = []
    for sec in secs:
        if sec.type not in (SHT_SYMTAB, SHT_DYNSYM) or sec.entsize != 24:
            continue
        strsec = secs[sec.link]
        strs = data[strsec.offset:strsec.offset + strsec.size]
        names = []
        for i in range(sec.size // 24):
            st_name, st_info = struct.unpack_from("<IB", data, sec.offset + 24 * i)
            name = _cstr(strs, st_name)
            names.append(name)
            if name and (st_info & 0xF) in (1, 2):
                out[name] = kinds[st_info & 0xF]
        if sec.type == SHT_SYMTAB:
            symtab_names = names
    return out, symtab_names


def _notes(data: bytes, sec: _Section) -> list[tuple[str, int, bytes]]:
    notes = []
    pos, end = sec.offset, sec.offset + sec.size
    while pos + 12 <= end:
        namesz, descsz, ntype = struct.unpack_from("<III", data, pos)
        pos += 12
        name = data[pos:pos + namesz].rstrip(b"\0").decode("ascii", "replace")
        pos += (namesz + 3) & ~3
        desc = data[pos:pos + descsz]
        pos += (descsz + 3) & ~3
        if pos > end:
            raise ElfError("note runs past the end of its section")
        notes.append((name, ntype, desc))
    return notes


def _amdgpu(data: bytes, secs: list[_Section], obj: CodeObject) -> None:
    meta = None
    for sec in secs:
        if sec.type != SHT_NOTE:
            continue
        for name, ntype, desc in _notes(data, sec):
            if name == "AMDGPU" and ntype == NT_AMDGPU_METADATA:
                meta = unpackb(desc)
    if meta is None:
        raise ElfError("no NT_AMDGPU_METADATA note")
    obj.metadata = meta
    obj.target = str(meta.get("amdhsa.target", ""))
    for k in meta.get("amdhsa.kernels", []):
        params = [KernelParam(int(a[".offset"]), int(a[".size"]), str(a[".value_kind"]))
                  for a in k.get(".args", [])]
        res = {
            "vgpr": int(k.get(".vgpr_count", 0)),
            "agpr": int(k.get(".agpr_count", 0)),
            "sgpr": int(k.get(".sgpr_count", 0)),
            "vgpr_spill": int(k.get(".vgpr_spill_count", 0)),
            "sgpr_spill": int(k.get(".sgpr_spill_count", 0)),
            "lds_static": int(k.get(".group_segment_fixed_size", 0)),
            "scratch": int(k.get(".private_segment_fixed_size", 0)),
            "kernarg_size": int(k.get(".kernarg_segment_size", 0)),
            "wavefront_size": int(k.get(".wavefront_size", 0)),
            "dynamic_stack": int(bool(k.get(".uses_dynamic_stack", False))),
        }
        name = str(k.get(".name", ""))
        obj.kernels[name] = KernelInfo(name, params, res, k.get(".max_flat_workgroup_size"))


def _nv_info(data: bytes, sec: _Section) -> list[tuple[int, bytes | int | None]]:
    """The (attribute, value) entries of one .nv.info table; SVAL values are raw bytes."""
    out: list[tuple[int, bytes | int | None]] = []
    pos, end = sec.offset, sec.offset + sec.size
    while pos + 2 <= end:
        fmt, attr = data[pos], data[pos + 1]
        pos += 2
        if fmt == EIFMT_NVAL:
            out.append((attr, None))
            pos += 2
        elif fmt == EIFMT_BVAL:
            out.append((attr, data[pos]))
            pos += 2
        elif fmt == EIFMT_HVAL:
            out.append((attr, struct.unpack_from("<H", data, pos)[0]))
            pos += 2
        elif fmt == EIFMT_SVAL:
            size, = struct.unpack_from("<H", data, pos)
            pos += 2
            out.append((attr, data[pos:pos + size]))
            pos += size
        else:
            raise ElfError(f"unknown .nv.info entry format {fmt} in {sec.name}")
        if pos > end:
            raise ElfError(f"{sec.name} entry runs past the end of its section")
    return out


def _cuda(data: bytes, secs: list[_Section], symtab: list[str], obj: CodeObject) -> None:
    per_fn: dict[str, dict[str, int]] = {}
    for sec in secs:
        if sec.name != ".nv.info":
            continue
        keys = {EIATTR_REGCOUNT: "registers", EIATTR_FRAME_SIZE: "local",
                EIATTR_MIN_STACK_SIZE: "min_stack", EIATTR_MAX_STACK_SIZE: "max_stack"}
        for attr, val in _nv_info(data, sec):
            if attr in keys and isinstance(val, bytes) and len(val) == 8:
                sym, value = struct.unpack("<II", val)
                if sym < len(symtab):
                    per_fn.setdefault(symtab[sym], {})[keys[attr]] = value
    for sec in secs:
        if not sec.name.startswith(".nv.info."):
            continue
        name = sec.name[len(".nv.info."):]
        by_ordinal: dict[int, KernelParam] = {}
        res = {"registers": 0, "local": 0, "min_stack": 0, "max_stack": 0, "shared_static": 0,
               "param_bytes": 0}
        res.update(per_fn.get(name, {}))
        max_threads = None
        for attr, val in _nv_info(data, sec):
            if attr == EIATTR_KPARAM_INFO and isinstance(val, bytes) and len(val) == 12:
                _index, ordinal, offset, flags = struct.unpack("<IHHI", val)
                by_ordinal[ordinal] = KernelParam(offset, (flags >> 18) & 0x3FFF, "param")
            elif attr == EIATTR_CBANK_PARAM_SIZE and isinstance(val, int):
                res["param_bytes"] = val
            elif attr == EIATTR_MAXNTID and isinstance(val, bytes) and len(val) == 12:
                x, y, z = struct.unpack("<III", val)
                max_threads = x * y * z
        for s in secs:
            if s.name == f".nv.shared.{name}":
                res["shared_static"] = s.size
        params = [by_ordinal[i] for i in sorted(by_ordinal)]
        obj.kernels[name] = KernelInfo(name, params, res, max_threads)


def read_code_object(data: bytes) -> CodeObject:
    """Parse a HSACO or cubin; raise :class:`ElfError` for anything malformed or unknown."""
    try:
        secs = _sections(data)
        machine, = struct.unpack_from("<H", data, 0x12)
        flags, = struct.unpack_from("<I", data, 0x30)
        obj = CodeObject(machine=machine, flags=flags, osabi=data[7], abi_version=data[8])
        obj.symbols, symtab = _symbols(data, secs)
        if machine == EM_AMDGPU:
            _amdgpu(data, secs, obj)
        elif machine == EM_CUDA:
            _cuda(data, secs, symtab, obj)
        else:
            raise ElfError(f"unsupported ELF machine {machine} (expected {EM_AMDGPU} AMDGPU or {EM_CUDA} CUDA)")
    except (struct.error, IndexError, UnicodeDecodeError) as exc:
        raise ElfError(f"malformed ELF: {exc}") from exc
    return obj
