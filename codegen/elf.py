"""What the offline checks need from AMDGPU code objects (HSACO) and NVIDIA cubins.

ELF structure comes from pyelftools and the HSACO ``NT_AMDGPU_METADATA`` note is MessagePack
(``msgpack``); only the cubin ``.nv.info`` attribute tables (NVIDIA-specific, no library reads them)
are decoded here. Tests cross-check the cubin figures against ``cuobjdump``.
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass, field
from typing import Any

import msgpack
from elftools.common.exceptions import ELFError
from elftools.construct import ConstructError
from elftools.elf.elffile import ELFFile
from elftools.elf.enums import ENUM_E_MACHINE
from elftools.elf.sections import Section, SymbolTableSection

EM_AMDGPU = ENUM_E_MACHINE["EM_AMDGPU"]
EM_CUDA = ENUM_E_MACHINE["EM_CUDA"]
NT_AMDGPU_METADATA = 32

# EIATTR codes of the cubin .nv.info tables (values as cuobjdump names them).
EIATTR_MAXNTID = 0x10
EIATTR_FRAME_SIZE = 0x11
EIATTR_MIN_STACK_SIZE = 0x12
EIATTR_KPARAM_INFO = 0x17
EIATTR_CBANK_PARAM_SIZE = 0x19
EIATTR_MAX_STACK_SIZE = 0x23
EIATTR_REGCOUNT = 0x2F
# .nv.info entry formats: no value, byte value, half-word value, sized value.
EIFMT_NVAL, EIFMT_BVAL, EIFMT_HVAL, EIFMT_SVAL = 1, 2, 3, 4
# Per-function .nv.info attributes (sym index, value) -> resource name.
_PER_FUNCTION = {EIATTR_REGCOUNT: "registers", EIATTR_FRAME_SIZE: "local",
                 EIATTR_MIN_STACK_SIZE: "min_stack", EIATTR_MAX_STACK_SIZE: "max_stack"}
_SYMBOL_KINDS = {"STT_FUNC": "func", "STT_OBJECT": "object"}


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
    """Function and object symbols (``.symtab`` and ``.dynsym``): name -> ``func`` / ``object``."""
    kernels: dict[str, KernelInfo] = field(default_factory=dict)
    target: str = ""
    metadata: dict[str, Any] = field(default_factory=dict, repr=False)


def _symbols(elf: ELFFile) -> tuple[dict[str, str], list[str]]:
    """Function/object symbols by name, and the ``.symtab`` names by index (what .nv.info refers to)."""
    out: dict[str, str] = {}
    by_index: list[str] = []
    for sec in elf.iter_sections():
        if not isinstance(sec, SymbolTableSection):
            continue
        names = []
        for sym in sec.iter_symbols():
            names.append(sym.name)
            kind = _SYMBOL_KINDS.get(sym["st_info"]["type"])
            if sym.name and kind:
                out[sym.name] = kind
        if sec["sh_type"] == "SHT_SYMTAB":
            by_index = names
    return out, by_index


def _amdgpu(elf: ELFFile, obj: CodeObject) -> None:
    meta = None
    for sec in elf.iter_sections():
        if sec["sh_type"] != "SHT_NOTE":
            continue
        for note in sec.iter_notes():
            if note["n_name"] == "AMDGPU" and note["n_type"] == NT_AMDGPU_METADATA:
                try:
                    meta = msgpack.unpackb(note["n_descdata"])
                except (msgpack.UnpackException, ValueError) as exc:
                    raise ElfError(f"NT_AMDGPU_METADATA note is not valid MessagePack: {exc}") from exc
    if not isinstance(meta, dict):
        raise ElfError("no NT_AMDGPU_METADATA note (or it is not a map)")
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


def _nv_info(sec: Section) -> list[tuple[int, bytes | int | None]]:
    """The (attribute, value) entries of one .nv.info table; SVAL values are raw bytes."""
    data = sec.data()
    out: list[tuple[int, bytes | int | None]] = []
    pos = 0
    while pos + 2 <= len(data):
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
        if pos > len(data):
            raise ElfError(f"{sec.name} entry runs past the end of its section")
    return out


def _cuda(elf: ELFFile, symtab: list[str], obj: CodeObject) -> None:
    sections = {sec.name: sec for sec in elf.iter_sections()}
    per_fn: dict[str, dict[str, int]] = {}
    if ".nv.info" in sections:
        for attr, val in _nv_info(sections[".nv.info"]):
            if attr in _PER_FUNCTION and isinstance(val, bytes) and len(val) == 8:
                sym, value = struct.unpack("<II", val)
                if sym < len(symtab):
                    per_fn.setdefault(symtab[sym], {})[_PER_FUNCTION[attr]] = value
    for sec_name, sec in sections.items():
        if not sec_name.startswith(".nv.info."):
            continue
        name = sec_name[len(".nv.info."):]
        by_ordinal: dict[int, KernelParam] = {}
        res = {"registers": 0, "local": 0, "min_stack": 0, "max_stack": 0, "shared_static": 0,
               "param_bytes": 0}
        res.update(per_fn.get(name, {}))
        max_threads = None
        for attr, val in _nv_info(sec):
            if attr == EIATTR_KPARAM_INFO and isinstance(val, bytes) and len(val) == 12:
                _index, ordinal, offset, flags = struct.unpack("<IHHI", val)
                by_ordinal[ordinal] = KernelParam(offset, (flags >> 18) & 0x3FFF, "param")
            elif attr == EIATTR_CBANK_PARAM_SIZE and isinstance(val, int):
                res["param_bytes"] = val
            elif attr == EIATTR_MAXNTID and isinstance(val, bytes) and len(val) == 12:
                x, y, z = struct.unpack("<III", val)
                max_threads = x * y * z
        shared = sections.get(f".nv.shared.{name}")
        if shared is not None:
            res["shared_static"] = shared["sh_size"]
        params = [by_ordinal[i] for i in sorted(by_ordinal)]
        obj.kernels[name] = KernelInfo(name, params, res, max_threads)


def read_code_object(data: bytes) -> CodeObject:
    """Parse a HSACO or cubin; raise :class:`ElfError` for anything malformed or unknown."""
    try:
        elf = ELFFile(io.BytesIO(data))
        if elf.elfclass != 64 or not elf.little_endian:
            raise ElfError("not a 64-bit little-endian ELF file")
        machine = ENUM_E_MACHINE.get(elf["e_machine"], elf["e_machine"])
        obj = CodeObject(machine=machine, flags=elf["e_flags"], osabi=elf.e_ident_raw[7],
                         abi_version=elf["e_ident"]["EI_ABIVERSION"])
        obj.symbols, symtab = _symbols(elf)
        if machine == EM_AMDGPU:
            _amdgpu(elf, obj)
        elif machine == EM_CUDA:
            _cuda(elf, symtab, obj)
        else:
            raise ElfError(f"unsupported ELF machine {machine} (expected {EM_AMDGPU} AMDGPU or {EM_CUDA} CUDA)")
    except ElfError:
        raise
    except (ELFError, ConstructError, ValueError, struct.error, IndexError, KeyError, TypeError, AttributeError,
            OverflowError) as exc:  # pyelftools' and the metadata's failure modes on damaged input
        raise ElfError(f"malformed ELF: {exc}") from exc
    return obj
