"""Offline checks of generated blobs against their manifest (``ultraquant verify``; also run by the
build on every fresh blob, so a build never writes what verify would reject).

Per blob: sha256 and size; ELF machine and processor flags match the arch (cubin: ``sm_90a``); code
object / ELF ABI version; the kernel symbol (and HSACO kernel descriptor) exists; every parameter's
offset and size in the binary's own metadata matches the manifest, and the argument block size; no
scratch / spills / local memory unless the manifest allows them; LDS (static + dynamic) and registers
within the arch's limits; threads per block as declared. Reads the binaries with ``codegen/elf.py``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ultraquant.errors import UltraQuantError
from ultraquant.kernels.abi import blob_name_problem

from . import manifest as mf
from .archs import AMDGPU_MACH_MASK, ARCHS, CUDA_ARCH_SPECIFIC_FLAG, Arch
from .backends import verify_hook
from .elf import CodeObject, ElfError, read_code_object


@dataclass
class VerifyReport:
    """Result of verifying one directory."""

    directory: Path
    arch: str = "?"
    blobs: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def spill_figures(arch: Arch, res: dict[str, int]) -> dict[str, int]:
    """The nonzero scratch/spill/local-memory figures of one kernel (empty: none used)."""
    # AMD SGPR spills go to VGPR lanes (no memory traffic); spills to memory show as scratch.
    names = (("scratch", "vgpr_spill", "dynamic_stack") if arch.is_amd else ("local", "max_stack"))
    names += ("global_scratch_size",)
    return {n: int(res.get(n, 0)) for n in names if int(res.get(n, 0))}


def spill_bytes(arch: Arch, res: dict[str, int]) -> int:
    """Bytes of memory one kernel uses for spills/scratch (the unit of a spill budget): HSACO private
    segment per lane, cubin local frame + stack per thread, plus Triton's global scratch."""
    names = ("scratch",) if arch.is_amd else ("local", "max_stack")
    return sum(int(res.get(n, 0)) for n in (*names, "global_scratch_size"))


def _check_identity(obj: CodeObject, arch: Arch, entry: dict[str, Any]) -> list[str]:
    out = []
    if obj.machine != arch.elf_machine:
        out.append(f"ELF machine {obj.machine}, expected {arch.elf_machine} for {arch.name}")
    if arch.is_amd:
        mach = obj.flags & AMDGPU_MACH_MASK
        if mach != arch.elf_processor:
            out.append(f"ELF processor 0x{mach:02x}, expected 0x{arch.elf_processor:02x} ({arch.name})")
        cov = obj.abi_version + 2
        if cov not in arch.code_object_versions:
            out.append(f"code object v{cov}, {arch.name} accepts {arch.code_object_versions}")
        if entry.get("code_object_version") != cov:
            out.append(f"code object v{cov}, the manifest says {entry.get('code_object_version')}")
        if not obj.target.endswith(arch.name) and f"--{arch.name}" not in obj.target:
            out.append(f"target string {obj.target!r} is not for {arch.name}")
    else:
        sm, virt = obj.flags & 0xFF, (obj.flags >> 16) & 0xFF
        if sm != arch.elf_processor or virt != arch.elf_processor:
            out.append(f"cubin for sm_{sm} (ptx {virt}), expected sm_{arch.elf_processor}")
        if arch.arch_specific and not obj.flags & CUDA_ARCH_SPECIFIC_FLAG:
            out.append(f"cubin lacks the arch-specific flag (expected sm_{arch.elf_processor}a)")
        if obj.abi_version not in arch.code_object_versions:
            out.append(f"cubin ELF ABI version {obj.abi_version}, expected {arch.code_object_versions}")
        if entry.get("elf_abi_version") != obj.abi_version:
            out.append(f"cubin ELF ABI version {obj.abi_version}, the manifest says "
                       f"{entry.get('elf_abi_version')}")
    return out


def _check_params(kernel, entry: dict[str, Any]) -> list[str]:
    out = []
    params = entry.get("params", [])
    actual = [p for p in kernel.params if not p.kind.startswith("hidden_")]
    if len(actual) != len(params):
        out.append(f"binary has {len(actual)} parameters, the manifest lists {len(params)}")
    for i, (p, m) in enumerate(zip(actual, params, strict=False)):
        if (p.offset, p.size) != (m.get("offset"), m.get("size")):
            out.append(f"param {i} ({m.get('name')}): binary offset {p.offset} size {p.size}, manifest "
                       f"offset {m.get('offset')} size {m.get('size')}")
        if p.kind == "global_buffer" and not str(m.get("type", "")).startswith("*"):
            out.append(f"param {i} ({m.get('name')}): a pointer in the binary, {m.get('type')} in the manifest")
        if p.kind == "by_value" and str(m.get("type", "")).startswith("*"):
            out.append(f"param {i} ({m.get('name')}): by value in the binary, a pointer in the manifest")
    end = max((p.offset + p.size for p in actual), default=0)
    declared = entry.get("kernarg_size")
    binary_size = kernel.resources.get("kernarg_size") or kernel.resources.get("param_bytes") or end
    if declared != binary_size:
        out.append(f"argument block {binary_size} bytes in the binary, {declared} in the manifest")
    return out


def _check_resources(kernel, arch: Arch, entry: dict[str, Any]) -> list[str]:
    out = []
    res = dict(kernel.resources)
    declared = entry.get("resources", {})
    for k, v in res.items():
        if declared.get(k) != v:
            out.append(f"resource {k} = {v} in the binary, {declared.get(k)} in the manifest")
    res["global_scratch_size"] = int(declared.get("global_scratch_size", 0))
    spills = spill_figures(arch, res)
    if spills and not entry.get("allow_spills"):
        out.append(f"uses scratch/spills/local memory {spills} and the manifest does not allow it "
                   "(fix the kernel, or add a SpillAllowance with the reason in codegen/matrix.py)")
    elif spills and spill_bytes(arch, res) > int(entry.get("spill_budget", 0)):
        out.append(f"uses {spill_bytes(arch, res)} bytes of scratch/local memory {spills}, over the allowed "
                   f"{entry.get('spill_budget', 0)} bytes ({entry.get('allow_spills')})")
    launch = entry.get("launch", {})
    threads = int(launch.get("threads", 0))
    shared = int(launch.get("shared", 0))
    if not 0 < threads <= arch.max_threads:
        out.append(f"threads per block {threads} outside 1..{arch.max_threads}")
    if kernel.max_threads is not None and threads > kernel.max_threads:
        out.append(f"launch uses {threads} threads, the binary allows at most {kernel.max_threads}")
    static = res.get("lds_static", res.get("shared_static", 0))
    if static + shared > arch.max_shared:
        out.append(f"shared memory {static}+{shared} bytes exceeds {arch.max_shared} on {arch.name}")
    if arch.is_amd:
        if res.get("vgpr", 0) > arch.max_registers:
            out.append(f"{res['vgpr']} VGPRs exceed {arch.max_registers}")
        if res.get("agpr", 0) > arch.max_agpr:
            out.append(f"{res['agpr']} AGPRs exceed {arch.max_agpr}")
        if res.get("sgpr", 0) > arch.max_sgpr:
            out.append(f"{res['sgpr']} SGPRs exceed {arch.max_sgpr}")
        if res.get("wavefront_size") not in (0, arch.warp_size):
            out.append(f"wavefront size {res.get('wavefront_size')}, expected {arch.warp_size}")
    else:
        regs = res.get("registers", 0)
        if regs > arch.max_registers:
            out.append(f"{regs} registers per thread exceed {arch.max_registers}")
        if regs * threads > 65536:
            out.append(f"{regs} registers x {threads} threads exceed the 64K register file")
    return out


def check_blob(entry: dict[str, Any], data: bytes, arch: Arch) -> list[str]:
    """Every problem of one blob (``data``) against its manifest ``entry``; empty when it passes."""
    out = []
    digest = hashlib.sha256(data).hexdigest()
    if digest != entry.get("sha256"):
        return [f"sha256 {digest[:16]}... does not match the manifest's {str(entry.get('sha256'))[:16]}..."]
    if entry.get("arch") != arch.name:
        out.append(f"entry arch {entry.get('arch')!r} in a {arch.name} manifest")
    try:
        obj = read_code_object(data)
    except ElfError as exc:
        return out + [f"not a valid code object: {exc}"]
    out += _check_identity(obj, arch, entry)
    symbol = entry.get("symbol", "")
    if obj.symbols.get(symbol) != "func":
        out.append(f"kernel symbol {symbol!r} not found")
    if arch.is_amd and obj.symbols.get(f"{symbol}.kd") != "object":
        out.append(f"kernel descriptor {symbol}.kd not found")
    kernel = obj.kernels.get(symbol)
    if kernel is None:
        return out + [f"no kernel metadata for {symbol!r} (have: {', '.join(obj.kernels) or 'none'})"]
    out += _check_params(kernel, entry)
    out += _check_resources(kernel, arch, entry)
    hook = verify_hook(str(entry.get("backend", "")))
    if hook is not None:
        out += list(hook(entry, data, arch))
    return out


def verify_dir(directory: Path) -> VerifyReport:
    """Verify every blob listed in ``directory/manifest.json``."""
    directory = Path(directory)
    report = VerifyReport(directory)
    try:
        data = mf.load(directory)
    except UltraQuantError as exc:
        report.problems.append(str(exc))
        return report
    report.arch = str(data.get("arch"))
    arch = ARCHS.get(report.arch)
    if arch is None:
        report.problems.append(f"{directory}: unknown arch {report.arch!r} (known: {', '.join(ARCHS)})")
        return report
    for key in mf.duplicate_keys(data["blobs"]):
        report.problems.append(f"duplicate key {key}")
    root = directory.resolve()
    for entry in data["blobs"]:
        report.blobs += 1
        name = str(entry.get("file", ""))
        path = (directory / name).resolve()
        label = f"{entry.get('key', name)} ({name})"
        if blob_name_problem(name) or path.parent != root:  # the runtime's rule, and no link out
            report.problems.append(f"{label}: file name must be a plain name inside {directory}")
            continue
        if not path.is_file():
            report.problems.append(f"{label}: missing file")
            continue
        report.problems += [f"{label}: {p}" for p in check_blob(entry, path.read_bytes(), arch)]
    return report
