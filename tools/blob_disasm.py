"""Hash the disassembly of every blob of a generated/<arch>/ folder, per manifest key.

For refactors that must leave the machine code unchanged: build the same selection before and after,
run this on both folders and compare (``--compare OTHER``). File paths and line tables in debug info
may differ; the listings (``cuobjdump -sass`` for cubins, ``llvm-objdump -d`` for HSACO, with the
file-name header line dropped) may not.

    python tools/blob_disasm.py generated/sm_90 --compare /elsewhere/generated/sm_90

A refactor that renames kernels or drops a constexpr compares with ``--rename OLD=NEW`` (applied to the
other folder's keys and listings: symbol names) and ``--drop-constexpr NAME=VALUE`` (removed from the
other folder's keys), e.g. ``--rename uq_decode_v8=uq_decode_wholepage --drop-constexpr MATH=True``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
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


def _renamed(text: str, renames: list[tuple[str, str]]) -> str:
    for old, new in renames:
        text = re.sub(rf"\b{re.escape(old)}\b", new, text)
    return text


def _dropped(key: str, drops: list[str]) -> str:
    for item in drops:
        key = re.sub(rf"(?<=[\[,]){re.escape(item)}(,|(?=\]))", "", key).replace(",]", "]")
    return key


def hashes(folder: Path, renames: list[tuple[str, str]] = (), drops: list[str] = ()) -> dict[str, str]:
    """Manifest key -> sha256 of the blob's disassembly listing (keys and listings renamed, keys'
    ``drops`` constexprs removed)."""
    manifest = json.loads((folder / "manifest.json").read_text())
    arch = manifest["arch"]
    return {_dropped(_renamed(blob["key"], renames), drops):
            hashlib.sha256(_renamed(_listing(folder / blob["file"], arch), renames).encode()).hexdigest()
            for blob in manifest["blobs"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--compare", type=Path, help="another generated/<arch>/ folder of the same selection")
    ap.add_argument("--rename", action="append", default=[], metavar="OLD=NEW",
                    help="a kernel renamed since the other folder was built (repeatable)")
    ap.add_argument("--drop-constexpr", action="append", default=[], metavar="NAME=VALUE",
                    help="a constexpr the other folder's keys have and this one's do not (repeatable)")
    args = ap.parse_args()
    mine = hashes(args.folder)
    if args.compare is None:
        json.dump(mine, sys.stdout, indent=1, sort_keys=True)
        return 0
    renames = sorted((tuple(r.split("=", 1)) for r in args.rename), key=lambda r: -len(r[0]))
    theirs = hashes(args.compare, renames, args.drop_constexpr)
    only = sorted(set(mine) ^ set(theirs))
    differ = sorted(k for k in set(mine) & set(theirs) if mine[k] != theirs[k])
    same = len(set(mine) & set(theirs)) - len(differ)
    print(f"{args.folder}: {same} identical listings, {len(differ)} differ, {len(only)} keys in one folder only")
    for k in differ + only:
        print("  ", "DIFFERS" if k in differ else "ONLY-ONE-SIDE", k)
    return 1 if differ or only else 0


if __name__ == "__main__":
    sys.exit(main())
