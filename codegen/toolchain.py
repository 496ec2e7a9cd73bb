"""The FlyDSL rows' system tools, found without root: an ``ld.lld`` (LLVM >= 19) and an ``llvm-objdump``.

FlyDSL links each kernel with ``<ROCM_PATH>/llvm/bin/ld.lld -shared in.o -o out.hsaco``, and the ISA
checks disassemble the blob with ``llvm-objdump``. :func:`find_lld` looks, in order, at
``$ULTRAQUANT_LLD`` (``triton`` forces the last option), ``ld.lld-NN``/``ld.lld`` on ``PATH``,
Debian's ``/usr/lib/llvm-NN``, a ROCm install (``$ROCM_PATH``, ``/opt/rocm``), the Python
environment's own ``bin/`` (a pip-installed linker), and last Triton's in-process linker
(``triton._C.libtriton.amd.link_hsaco``, the LLD 22 that Triton links its own HSACO with) behind a
small ``ld.lld`` wrapper script. Measured: FlyDSL decode blobs for gfx942 and gfx950 linked by that
wrapper are byte-identical to Debian lld-19's except the ``.comment`` linker string
(benchmarks/NOTES.md). Nothing here installs anything: apt is ``ultraquant build
--install-system-deps`` (``make kernels APT=1``), and a miss raises
:class:`ToolchainError` with one paragraph saying what to install and how.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ultraquant import config
from ultraquant.errors import UltraQuantError

MIN_LLD = 19
"""Debian's default lld 14 rejects FlyDSL's code object v6 ("unknown abi version")."""

LLD_VERSIONS = (19, 20, 21, 22)
"""Versioned linkers looked for, the pinned lld-19 first: the linker's name lands in the blob's
``.comment``, so the same machine keeps producing the same bytes."""

OBJDUMP_VERSIONS = (22, 21, 20, 19)
"""Versioned disassemblers looked for, newest first (output only read, never shipped)."""

OBJDUMP_MIN = {"gfx942": 19, "gfx950": 22}
"""Oldest llvm-objdump that disassembles each arch (19 prints "not yet supported" for gfx950)."""

SYSTEM_PACKAGES = ("lld-19", "llvm-22")
"""What ``--install-system-deps`` installs with apt: the linker and the gfx950-capable objdump."""

TRITON_LLD = "triton"
"""``Tool.origin`` of the wrapper over Triton's in-process linker."""

_VERSION_RE = re.compile(r"(?:LLD|LLVM version)\s+(\d+)\.")


class ToolchainError(UltraQuantError, RuntimeError):
    """A tool the selected rows need is missing; the message says what to install and how (also a
    RuntimeError, what the FlyDSL compile path catches when it can go on without a linker)."""


@dataclass(frozen=True)
class Tool:
    """A found tool: its path, LLVM major version (0 if unknown) and where it came from."""

    path: str
    version: int
    origin: str


def tool_version(path: str) -> int:
    """LLVM major version printed by ``path --version``, 0 if it cannot be told."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    m = _VERSION_RE.search(out.stdout + out.stderr)
    return int(m.group(1)) if m else 0


def _rocm_roots() -> list[Path]:
    roots = [os.environ.get("ROCM_PATH"), "/opt/rocm"]
    return [Path(r) for r in roots if r]


def _candidates(name: str, versions: tuple[int, ...]) -> Iterable[tuple[str, str]]:
    """(path, origin) candidates of an LLVM tool, in search order (may not exist)."""
    for n in (*(f"{name}-{v}" for v in versions), name):
        found = shutil.which(n)
        if found:
            yield found, "PATH"
    for v in versions:
        yield f"/usr/lib/llvm-{v}/bin/{name}", f"/usr/lib/llvm-{v}"
    for root in _rocm_roots():
        yield str(root / "llvm" / "bin" / name), f"ROCm {root}"
    yield str(Path(sysconfig.get_path("scripts")) / name), "this Python environment"


def _first(name: str, min_version: int, env_var: str,
           versions: tuple[int, ...]) -> tuple[Tool | None, list[str]]:
    """The first candidate of ``name`` at least ``min_version``; also what was rejected and why."""
    rejected: list[str] = []
    explicit = config.tool_path(env_var)
    cands = ([(explicit, f"${env_var}")] if explicit else []) + list(_candidates(name, versions))
    seen: set[str] = set()
    for path, origin in cands:
        real = os.path.realpath(path)
        if real in seen or not os.path.isfile(real) or not os.access(real, os.X_OK):
            continue
        seen.add(real)
        v = tool_version(path)
        if v >= min_version:
            return Tool(path, v, origin), rejected
        rejected.append(f"{path} (LLVM {v or '?'}, need >= {min_version})")
    return None, rejected


def _triton_linker(python: str) -> bool:
    """Whether ``python``'s Triton has the in-process AMD linker."""
    code = "from triton._C.libtriton import amd; assert callable(amd.link_hsaco)"
    try:
        return subprocess.run([python, "-c", code], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


WRAPPER = '''#!{python}
"""ld.lld for FlyDSL over Triton's in-process LLD (written by ultraquant.codegen.toolchain)."""
import sys

args = sys.argv[1:]
if "--version" in args or "-v" in args:
    import triton
    print(f"LLD (Triton {{triton.__version__}} in-process amd.link_hsaco) compatible with GNU linkers")
    sys.exit(0)
out = args[args.index("-o") + 1] if "-o" in args else None
inputs = [a for i, a in enumerate(args) if not a.startswith("-") and (i == 0 or args[i - 1] not in ("-o", "-flavor"))]
if out is None or len(inputs) != 1 or not set(a for a in args if a.startswith("-")) <= {{"-o", "-shared", "-flavor"}}:
    sys.exit(f"ld.lld (Triton wrapper): only 'ld.lld -shared IN -o OUT' is supported, got {{args}}")
from triton._C.libtriton import amd

amd.link_hsaco(inputs[0], out)
'''


def triton_lld_wrapper(python: str = sys.executable, folder: str | os.PathLike | None = None) -> str:
    """Write (if needed) the ``ld.lld`` wrapper script over ``python``'s Triton linker; its path."""
    d = Path(folder or Path(tempfile.gettempdir()) / f"ultraquant-triton-lld-{os.getuid()}")
    path = d / "ld.lld"
    text = WRAPPER.format(python=python)
    if not (path.is_file() and path.read_text() == text):
        d.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"ld.lld.{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.chmod(0o755)
        tmp.replace(path)
    return str(path)


def install_hint(what: str, rejected: Iterable[str] = ()) -> str:
    """The one-paragraph error: what is missing, what was tried, how to get it (with and without root)."""
    seen = "; rejected: " + ", ".join(rejected) if rejected else ""
    return (f"The FlyDSL rows (gfx942/gfx950 decode) need {what}, and none was found on PATH, in "
            f"/usr/lib/llvm-NN, $ROCM_PATH/llvm/bin, /opt/rocm/llvm/bin or this Python environment{seen}. "
            f"Either install it as root (Debian/Ubuntu: `apt-get install {' '.join(SYSTEM_PACKAGES)}`, or let "
            "the build do it: `make kernels ... APT=1` / `ultraquant build --install-system-deps`), or point "
            "at one you have with ULTRAQUANT_LLD=/path/to/ld.lld or ULTRAQUANT_OBJDUMP=/path/to/llvm-objdump "
            "(e.g. from a ROCm install), or build without the FlyDSL rows: the Triton blobs cover every "
            "config (`OPS=store_kv,dequant_kv,decode_attention,prefill_attention`).")


def find_lld(python: str = sys.executable, *, allow_triton: bool = True) -> Tool:
    """An ``ld.lld`` FlyDSL can use (LLVM >= 19), else Triton's linker behind a wrapper, else raise."""
    if config.tool_path("ULTRAQUANT_LLD") == TRITON_LLD:  # forced: Triton's linker even when another exists
        if not _triton_linker(python):
            raise ToolchainError(install_hint("Triton's in-process linker (ULTRAQUANT_LLD=triton), which "
                                              f"{python} lacks"))
        return Tool(triton_lld_wrapper(python), 0, TRITON_LLD)
    tool, rejected = _first("ld.lld", MIN_LLD, "ULTRAQUANT_LLD", LLD_VERSIONS)
    if tool is not None:
        return tool
    if allow_triton and _triton_linker(python):
        return Tool(triton_lld_wrapper(python), 0, TRITON_LLD)
    raise ToolchainError(install_hint(f"an ld.lld from LLVM >= {MIN_LLD} (or Triton 3.6 for its in-process "
                                      "linker)", rejected))


def find_objdump(arch: str) -> Tool:
    """An ``llvm-objdump`` that disassembles ``arch`` (LLVM >= 22 for gfx950, >= 19 for gfx942), else raise."""
    need = OBJDUMP_MIN.get(arch, max(OBJDUMP_MIN.values()))
    tool, rejected = _first("llvm-objdump", need, "ULTRAQUANT_OBJDUMP", OBJDUMP_VERSIONS)
    if tool is None:
        raise ToolchainError(install_hint(f"an llvm-objdump from LLVM >= {need} for the {arch} ISA checks",
                                          rejected))
    return tool


def check_flydsl_tools(archs: Iterable[str], python: str = sys.executable) -> list[str]:
    """Problems (one paragraph each) of the FlyDSL tools for ``archs``; empty when all are found."""
    problems: list[str] = []
    try:
        find_lld(python)
    except ToolchainError as exc:
        problems.append(str(exc))
    for arch in archs:
        try:
            find_objdump(arch)
        except ToolchainError as exc:
            problems.append(str(exc))
            break
    return problems
