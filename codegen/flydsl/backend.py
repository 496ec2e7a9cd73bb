"""The FlyDSL backend of the generator: UltraQuant decode blobs for gfx942 and gfx950.

Contract with the rest of the system (why it looks like this):

- Same launch as the split-KV decode: the family (``ultraquant.kernels.families.decode_flydsl``:
  limits, waves, specs) renames the split-KV Specialization, so the runtime launches these blobs with
  the LaunchPlan it builds for ``uq_decode_splitkv`` (256 threads per block at D=128 and 256: 4 waves
  share each split and fold their states through 8-16 KB of static LDS; 64 threads at D=512).
- Alignment the kernel assumes (vector loads): pointers 16-byte aligned; query and output strides
  multiples of 8 elements; cache strides multiples of 8 bytes (slot sizes 136/272/544 are).
- Compiles run inside the generator's worker subprocess (an LLVM abort kills the worker, not the
  build; the worker's output is scanned for ``error:``). For a stand-alone subprocess compile use
  :mod:`.compile_kernel`.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from ultraquant.errors import UltraQuantError
from ultraquant.kernels.families import decode_flydsl as flydsl_family
from ultraquant.kernels.families.decode_flydsl import KERNEL, KERNEL_MX, decode_flydsl_spec, waves_for
from ultraquant.kernels.specialization import Specialization

from ..archs import Arch
from ..backends import Backend
from . import isa

OP = "decode_attention_flydsl"
OP_MX = "decode_attention_flydsl_mx"
ARCHS = ("gfx942", "gfx950")
OPS = {OP: KERNEL, OP_MX: KERNEL_MX}
FLYDSL_REQUIREMENT = "flydsl==0.5.0"


def pipelined_for(head_size: int, mx: bool) -> bool:
    """Whether the blob is built with the software-pipelined loop (the next tile's loads and the entry
    of the tile after it issued before this tile's math): where the ISA cost model says it pays
    (docs/flydsl.md, issue 26): the mx kernel at D=128 (gfx950: 6.62 vs 5.80 TB/s at 1 us, same 114
    VGPRs) and D=512 (7 round trips per tile otherwise); the fp16 kernel at D=512, whose V bytes go
    through LDS (gfx942: 4.22 vs 3.15 unpipelined, one wave per SIMD either way). Not at mx D=256
    (4.16 vs 5.36) nor on the fp16 path below D=512 (gfx942 D=128: 2.77 vs 3.66 at 4 waves: LLVM
    still waits on the carried loads)."""
    return head_size == 512 or (mx and head_size == 128)


def _dtype(ty: str) -> str:
    return ty.lstrip("*")


class FlyDSLBackend(Backend):
    """Compiles :mod:`.decode` with FlyDSL (``flyc.compile`` offline) for CDNA3/CDNA4."""

    name = "flydsl"
    hidden_params = ()

    def targets(self, arch: Arch) -> bool:
        return arch.name in ARCHS

    def toolchain(self, arch: Arch) -> dict[str, str]:
        from .compiler import find_lld, flydsl_version

        try:
            lld = subprocess.run([find_lld(), "--version"], capture_output=True, text=True).stdout.strip()
        except (OSError, RuntimeError) as exc:
            lld = f"unavailable ({exc})"
        return {"flydsl": flydsl_version(), "lld": lld.splitlines()[0] if lld else "unknown"}

    def source_files(self) -> list[tuple[str, Path]]:
        import ultraquant.kernels.flydsl as kernel_src
        from ultraquant.kernels import families, specialization

        here = Path(__file__).resolve().parent
        files = [(f"codegen/flydsl/{p.name}", p) for p in sorted(here.glob("*.py"))]
        src = Path(kernel_src.__file__).resolve().parent
        files += [(f"ultraquant/kernels/flydsl/{p.name}", p) for p in sorted(src.glob("*.py"))]
        fams = Path(families.__file__).resolve().parent
        files += [(f"ultraquant/kernels/families/{p.name}", p) for p in sorted(fams.glob("*.py"))]
        files.append(("ultraquant/kernels/specialization.py", Path(specialization.__file__).resolve()))
        return files

    def specialize(self, op: str, config: dict[str, Any]) -> Specialization:
        if op not in OPS:
            raise UltraQuantError(f"flydsl backend: only ops {', '.join(OPS)} are built, not {op!r}")
        return decode_flydsl_spec(kernel=OPS[op], **config)

    def compile(self, spec: Specialization, arch: Arch) -> tuple[bytes, dict[str, Any]]:
        from .compiler import compile_decode
        from .elf_resources import resources_of

        c = spec.constexprs
        config = {"head_size": int(c["D"]), "gqa": int(c["GQA"]), "block_size": int(c["BLOCK_SIZE"]),
                  "has_sinks": bool(c["HAS_SINKS"]), "has_window": bool(c["HAS_WINDOW"]),
                  "has_softcap": bool(c["HAS_SOFTCAP"])}
        why = flydsl_family.unsupported({**config, "query_dtype": _dtype(spec.signature["q_ptr"])})
        if why:
            raise UltraQuantError(why)
        mx = spec.kernel == KERNEL_MX
        if mx and arch.name != "gfx950":
            raise UltraQuantError(f"{KERNEL_MX} needs gfx950 (scaled FP4 MFMA), not {arch.name}")
        # preferred first; a build that spills falls back to one wave per workgroup (the fold's
        # registers), then to the loop without software pipelining (the next tile's registers)
        pipe = pipelined_for(config["head_size"], mx)
        tries = dict.fromkeys([(waves_for(config["head_size"]), pipe), (1, pipe), (1, False)])
        for waves, pipelined in tries:
            binary = compile_decode(arch.name, spec.kernel, config, query_dtype=_dtype(spec.signature["q_ptr"]),
                                    out_dtype=_dtype(spec.signature["out_ptr"]), mx=mx, waves=waves,
                                    pipelined=pipelined)
            res = resources_of(binary, spec.kernel)
            if not (res.get("scratch") or res.get("vgpr_spill")):
                break
        record = isa.describe(binary, arch.name, config["head_size"], res, mx=mx)
        record["waves_per_block"] = waves
        record["pipelined"] = pipelined
        problems = isa.check_record(record, record["mfma"], res, arch.max_shared)
        if problems:
            raise UltraQuantError("FlyDSL blob fails its ISA checks: " + "; ".join(problems))
        info = {
            "symbol": spec.kernel, "threads": 64 * waves, "num_warps": waves,
            "num_stages": 1, "num_ctas": 1, "shared": 0,
            "hidden": [],
            "divisibility": {n: 16 for n, ty in spec.signature.items() if ty.startswith("*")},
            "isa": record,
        }
        return binary, info

    def worker_env(self, arch: Arch) -> dict[str, str]:
        return {"FLYDSL_RUNTIME_ENABLE_CACHE": "0"}

    def requirements(self) -> list[str]:
        return [FLYDSL_REQUIREMENT]

    def system_packages(self) -> list[str]:
        # lld-19: FlyDSL's linker; llvm-22: llvm-objdump for the ISA checks (19 cannot read gfx950)
        return ["lld-19", "llvm-22"]
