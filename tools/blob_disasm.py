"""Hash the disassembly of every blob of a generated/<arch>/ folder, per manifest key.

For refactors that must leave the machine code unchanged: build the same selection before and after,
run this on both folders and compare (``--compare OTHER``). File paths and line tables in debug info
may differ; the listings (``cuobjdump -sass`` for cubins, ``llvm-objdump -d`` for HSACO, with the
file-name header line dropped) may not.

    python tools/blob_disasm.py generated/sm_90 --compare /elsewhere/generated/sm_90
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path


def _listing(path: Path, arch: str) -> str:
    if arch.startswith("sm_"):
        import triton

        tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        cmd = [str(tool), "-sass", str(path)]
    else:
        from ultraquant.codegen.flydsl.isa import find_objdump

        cmd = [find_objdump(arch), "-d", f"--mcpu={arch}", str(path)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return "\n".join(line for line in out.splitlines() if str(path) not in line and "Fatbin" not in line)


def hashes(folder: Path) -> dict[str, str]:
    """Manifest key -> sha256 of the blob's disassembly listing."""
    manifest = json.loads((folder / "manifest.json").read_text())
    arch = manifest["arch"]
    return {blob["key"]: hashlib.sha256(_listing(folder / blob["file"], arch).encode()).hexdigest()
            for blob in manifest["blobs"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--compare", type=Path, help="another generated/<arch>/ folder of the same selection")
    args = ap.parse_args()
    mine = hashes(args.folder)
    if args.compare is None:
        json.dump(mine, sys.stdout, indent=1, sort_keys=True)
        return 0
    theirs = hashes(args.compare)
    only = sorted(set(mine) ^ set(theirs))
    differ = sorted(k for k in set(mine) & set(theirs) if mine[k] != theirs[k])
    same = len(set(mine) & set(theirs)) - len(differ)
    print(f"{args.folder}: {same} identical listings, {len(differ)} differ, {len(only)} keys in one folder only")
    for k in differ + only:
        print("  ", "DIFFERS" if k in differ else "ONLY-ONE-SIDE", k)
    return 1 if differ or only else 0


if __name__ == "__main__":
    sys.exit(main())
