"""The GPU architectures codegen can target, with what ``verify`` expects of their binaries.

One row per arch name accepted by ``make kernels ARCH=...``: how Triton names the target, the file
extension, the ELF identity every blob must carry, and the per-kernel hardware limits a blob must fit.
"""

from __future__ import annotations

from dataclasses import dataclass

from ultraquant.errors import UltraQuantError

from .elf import EM_AMDGPU, EM_CUDA


@dataclass(frozen=True)
class Arch:
    """One target architecture."""

    name: str
    vendor: str
    """``"hip"`` or ``"cuda"`` (Triton's backend name)."""
    triton_arch: str | int
    """What ``triton.backends.compiler.GPUTarget`` takes as ``arch``."""
    warp_size: int
    ext: str
    elf_machine: int
    elf_processor: int
    """HSACO: ``e_flags & 0xff`` (EF_AMDGPU_MACH); cubin: the SM number in ``e_flags & 0xff``."""
    code_object_versions: tuple[int, ...]
    """HSACO: accepted AMDGPU code object versions (ELF ABI version + 2); cubin: ELF ABI versions."""
    max_threads: int
    max_shared: int
    """Bytes of LDS / shared memory one workgroup may use (static + dynamic)."""
    max_registers: int
    """Per thread: VGPRs (arch + acc, unified file) on CDNA, registers on NVIDIA."""
    max_sgpr: int = 0
    max_agpr: int = 0
    arch_specific: bool = False
    """cubin: needs the ``a`` (arch-specific feature set) flag, as in ``sm_90a``."""

    @property
    def is_amd(self) -> bool:
        return self.vendor == "hip"


# cubin e_flags: SM number in bits 0-7 (and again in 16-23); bit 11 marks an "a" target (sm_90a).
CUDA_ARCH_SPECIFIC_FLAG = 0x800
# HSACO e_flags: EF_AMDGPU_MACH in bits 0-7.
AMDGPU_MACH_MASK = 0xFF

ARCHS: dict[str, Arch] = {
    a.name: a
    for a in (
        # CDNA3 (MI300X/MI325X): 64 KiB LDS per workgroup; 512 unified VGPRs (256 arch + 256 acc)
        # per lane in wave64; 102 addressable SGPRs + VCC/FLAT_SCRATCH/XNACK = 108 counted.
        Arch("gfx942", "hip", "gfx942", 64, "hsaco", EM_AMDGPU, 0x4C, (5, 6), 1024, 65536, 512,
             max_sgpr=108, max_agpr=256),
        # CDNA4 (MI350X/MI355X): 160 KiB LDS per workgroup, same register files as CDNA3.
        Arch("gfx950", "hip", "gfx950", 64, "hsaco", EM_AMDGPU, 0x4F, (5, 6), 1024, 163840, 512,
             max_sgpr=108, max_agpr=256),
        # Hopper (H100/H200): 227 KiB opt-in shared memory per block, 255 registers per thread.
        # Triton targets sm_90a (wgmma/setmaxnreg need the arch-specific feature set).
        Arch("sm_90", "cuda", 90, 32, "cubin", EM_CUDA, 90, (7,), 1024, 232448, 255,
             arch_specific=True),
    )
}


def get_arch(name: str) -> Arch:
    """The :class:`Arch` named ``name``; a clear error listing the known ones otherwise."""
    try:
        return ARCHS[name]
    except KeyError:
        raise UltraQuantError(f"arch: unknown {name!r}; known: {', '.join(ARCHS)}") from None


def parse_arch_list(text: str) -> list[Arch]:
    """``"gfx942,sm_90"`` -> the arches, in the given order, duplicates dropped."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise UltraQuantError("arch: expected a comma-separated list such as gfx942,gfx950,sm_90")
    return [get_arch(n) for n in dict.fromkeys(names)]
