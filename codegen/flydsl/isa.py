"""ISA checks of the FlyDSL blobs (run by ``ultraquant verify`` and at build time); no flydsl needed.

Per blob: the MFMA instructions the kernel is designed around are in the disassembly (Debian's
``llvm-objdump-19``/``-22 --mcpu=<arch>``), with exactly the counts the manifest records (one tile
of the main loop: D/16 for QK, D/16 for PV on the fp16 path); no scratch; the VGPR/AGPR count
leaves at least the occupancy the design assumes (recorded in the manifest as
``isa.min_waves_per_simd``); LDS within the arch's limit.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

MFMA_RE = re.compile(r"^\s*(v_mfma\w*|v_cvt_scalef32\w*)", re.MULTILINE)
"""The instructions counted: every MFMA, and gfx950's scaled FP4 conversions."""

BF16_MFMA = "v_mfma_f32_16x16x16_bf16"
"""The PV MFMA of the gfx950 mx path: 16x16 tile, K = 16 bf16."""

F16_MFMA = "v_mfma_f32_16x16x16_f16"
"""The MFMA of the fp16 path (gfx942 and gfx950): K and V bit-placed to fp16, fp16 query and P."""

SCALED_MFMA = "v_mfma_scale_f32_16x16x128_f8f6f4"
"""gfx950 QK of the mx path: FP4 K codes x FP8 query, UE8M0 scales consumed by the instruction."""

FP4_CVT = "v_cvt_scalef32_pk_bf16_fp4"
"""gfx950 V decode of the mx path: two FP4 codes times an f32 scale to two bf16."""

DESIGN_WAVES = {64: 4, 128: 4, 256: 2, 512: 1}
"""Waves per SIMD the decode design assumes, by head size (enough to overlap the KV stream)."""

UNIFIED_REGS = 512
"""CDNA3/CDNA4 wave64: arch + acc VGPRs share 512 registers per SIMD lane."""

MAX_WAVES = 8


def find_objdump(arch: str = "gfx942") -> str:
    """An llvm-objdump that disassembles ``arch`` (:func:`ultraquant.codegen.toolchain.find_objdump`)."""
    from ..toolchain import find_objdump as find

    return find(arch).path


def disassemble(data: bytes, arch: str) -> str:
    """Disassembly text of an HSACO for ``arch``."""
    with tempfile.NamedTemporaryFile(suffix=".hsaco") as f:
        f.write(data)
        f.flush()
        proc = subprocess.run([find_objdump(arch), "-d", f"--mcpu={arch}", f.name], capture_output=True,
                              text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"llvm-objdump failed: {proc.stderr.strip()[:500]}")
    return proc.stdout


def mfma_counts(text: str) -> dict[str, int]:
    """How many times each MFMA mnemonic appears in a disassembly."""
    return dict(sorted(Counter(MFMA_RE.findall(text)).items()))


def expected_mfma(arch: str, head_size: int, mx: bool = False) -> dict[str, int]:
    """Counted instructions of one tile of the decode loop (the loop itself is not unrolled).

    fp16 path: D/16 QK MFMAs (two per 32-element scale group) + D/16 PV MFMAs. mx path (gfx950): two scaled
    QK MFMAs per 128 elements (query hi and lo terms), D/16 PV MFMAs, and D/8 FP4 conversions
    (4 tokens x D/32 bytes).
    """
    if mx:  # two scaled MFMAs (query hi and lo FP8 terms) per 128 head-dim elements
        return {FP4_CVT: head_size // 8, BF16_MFMA: head_size // 16, SCALED_MFMA: 2 * (head_size // 128)}
    return {F16_MFMA: head_size // 8}


def waves_per_simd(vgpr: int, agpr: int = 0) -> int:
    """Occupancy limit from registers on CDNA3/CDNA4. The code object's ``.vgpr_count`` is already
    the unified total (arch VGPRs aligned to 4, plus AGPRs); it allocates in granules of 8 out of
    512 per SIMD lane, at most 8 waves. ``agpr`` only guards a total smaller than the AGPRs."""
    total = max(8, vgpr, agpr)
    total = -(-total // 8) * 8
    return min(MAX_WAVES, UNIFIED_REGS // total)


def describe(data: bytes, arch: str, head_size: int, resources: dict[str, Any],
             mx: bool = False) -> dict[str, Any]:
    """The ``isa`` record of a freshly built blob (written into its manifest entry)."""
    found = mfma_counts(disassemble(data, arch))
    return {
        "mfma": found,
        "mfma_per_tile": expected_mfma(arch, head_size, mx),
        "min_waves_per_simd": DESIGN_WAVES.get(head_size, 1),
        "waves_per_simd": waves_per_simd(int(resources.get("vgpr", 0)), int(resources.get("agpr", 0))),
        "objdump": Path(find_objdump(arch)).name,
    }


def check_record(isa: dict[str, Any], found: dict[str, int], resources: dict[str, Any],
                 lds_limit: int) -> list[str]:
    """Problems of one blob given its manifest ``isa`` record and the MFMAs counted in its code."""
    out = []
    per_tile = isa.get("mfma_per_tile") or {}
    if not per_tile:
        out.append("manifest entry has no isa.mfma_per_tile")
    for name, n in per_tile.items():
        got = found.get(name, 0)
        if got == 0:
            out.append(f"{name} missing from the disassembly")
        elif got % int(n):
            out.append(f"{got} x {name} is not a whole number of tiles of {n}")
    if found != isa.get("mfma"):
        out.append(f"MFMA counts {found} differ from the manifest's {isa.get('mfma')}")
    waves = waves_per_simd(int(resources.get("vgpr", 0)), int(resources.get("agpr", 0)))
    need = int(isa.get("min_waves_per_simd", 1))
    if waves < need:
        out.append(f"{resources.get('vgpr')} VGPRs + {resources.get('agpr', 0)} AGPRs allow {waves} waves "
                   f"per SIMD, the design needs {need}")
    # SGPR spills land in VGPR lanes (no memory traffic); scratch or VGPR spills are memory traffic
    if int(resources.get("scratch", 0)) or int(resources.get("vgpr_spill", 0)):
        out.append(f"uses scratch ({resources.get('scratch', 0)} bytes, {resources.get('vgpr_spill', 0)} "
                   "VGPR spills)")
    if int(resources.get("lds_static", 0)) > lds_limit:
        out.append(f"LDS {resources.get('lds_static')} bytes exceeds {lds_limit}")
    return out


def check_blob(entry: dict[str, Any], data: bytes, arch) -> list[str]:
    """``ultraquant verify`` hook for backend ``flydsl``: problems of one blob (empty: it passes)."""
    isa = entry.get("isa", entry.get("compiler", {}).get("isa"))
    if not isinstance(isa, dict):
        return ["FlyDSL blob without an isa record in the manifest"]
    try:
        found = mfma_counts(disassemble(data, arch.name))
    except (FileNotFoundError, RuntimeError) as exc:
        return [f"cannot check the ISA: {exc}"]
    return check_record(isa, found, entry.get("resources", {}), arch.max_shared)
