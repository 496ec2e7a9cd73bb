"""A tiny Triton kernel set that exercises the AOT generator independently of the real kernels.

Test fixture only (not shipped): ``plans`` (no Triton import) gives the Specializations, ``kernels``
(imports Triton) the JIT functions, ``ROWS`` the fixture's matrix table.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
BACKEND_OPTIONS = {"triton": {"plans": "tests.codegen_fixture.plans",
                              "registry": "tests.codegen_fixture.kernels"}}
ARCHS = "gfx942,gfx950,sm_90"


def options(out: Path, archs: str = ARCHS, rows=None, cache: Path | None = None, selection=None, **kw):
    """BuildOptions for the fixture kernels (workers find ``tests`` through PYTHONPATH)."""
    from ultraquant.codegen.archs import parse_arch_list
    from ultraquant.codegen.build import BuildOptions
    from ultraquant.codegen.matrix import Selection

    from . import plans

    selection = selection or Selection(head_sizes=(64, 128), block_sizes=(16, 32))
    return BuildOptions(archs=parse_arch_list(archs), selection=selection, out_dir=out, cache_dir=cache,
                        jobs=2, rows=plans.ROWS if rows is None else rows,
                        backend_options=BACKEND_OPTIONS, extra_env={"PYTHONPATH": str(ROOT)}, **kw)


@functools.lru_cache(maxsize=1)
def shared_build() -> Path:
    """One fixture build per test session (4 blobs per arch), shared by the codegen/verify tests.

    Returns the output root (``<root>/<arch>/``); its compile cache is ``<root>/../cache``.
    Treat it as read-only: copy before corrupting.
    """
    from ultraquant.codegen.build import build

    base = Path(tempfile.mkdtemp(prefix="uq-codegen-fixture-"))
    atexit.register(shutil.rmtree, base, True)
    out = base / "gen"
    build(options(out, cache=base / "cache"))
    return out
