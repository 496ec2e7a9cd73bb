"""On-device self-test of a blob: a small problem launched through the loader, checked against the
PyTorch reference, once per (manifest key, blob, self-test version, GPU, driver); the verdict is cached on disk
(:mod:`.verdicts`).

Why: a blob built on a CPU machine was never run before it reaches the user's GPU. A blob that
computes garbage there (a toolchain bug, a driver quirk, a corrupted-but-consistent file) is disabled
with a warning and the Triton JIT path takes over, instead of silently serving wrong attention.

Problems are registered per kernel name (:data:`.problems.PROBLEMS`); each builds inputs that match the blob's
constexprs, gets the launch from the same plan functions the ops use, launches *this* blob, and
compares with :mod:`ultraquant.reference`. A kernel with no registered problem passes with a note.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from ultraquant.kernels.specialization import Specialization

from . import problems
from .driver import DeviceInfo
from .loader import Kernel
from .manifest import Entry
from .verdicts import Verdict, VerdictCache

CACHE = VerdictCache()
"""The process-wide verdict cache (its file follows ``ULTRAQUANT_CACHE_DIR`` when it changes)."""

_TLS = threading.local()


def running() -> bool:
    """Whether this thread is inside a self-test (nested launches must not start their own)."""
    return getattr(_TLS, "depth", 0) > 0


@contextlib.contextmanager
def _running() -> Iterator[None]:
    _TLS.depth = getattr(_TLS, "depth", 0) + 1
    try:
        yield
    finally:
        _TLS.depth -= 1


def run(kernel: Kernel, spec: Specialization, dev: DeviceInfo, *, record: bool = True) -> Verdict:
    """Self-test ``kernel`` on ``dev`` now and (by default) record the verdict in :data:`CACHE`."""
    # a stand-in kernel (manifest ``alternate_of``) takes its original's plan, hence its problem
    problem = problems.PROBLEMS.get(kernel.entry.alternate_of or kernel.entry.kernel)
    t0 = time.perf_counter()
    if problem is None:
        ok, detail = True, f"no self-test problem for kernel {kernel.entry.kernel}"
    else:
        with _running():
            try:
                ok, detail = problem(kernel, spec, dev.index)
            except Exception as exc:  # any failure of the blob's run is a failed self-test
                ok, detail = False, f"{type(exc).__name__}: {exc}"
    verdict = Verdict(ok=ok, detail=detail, seconds=time.perf_counter() - t0, when=time.time())
    if record:
        CACHE.put(kernel.entry.key, kernel.entry.sha256, problems.SELFTEST_VERSION, dev, verdict)
    return verdict


def cached(entry: Entry, dev: DeviceInfo) -> Verdict | None:
    """The recorded verdict of ``entry``'s blob tested as ``entry.key`` with the current self-test
    version on ``dev``, if any."""
    return CACHE.get(entry.key, entry.sha256, problems.SELFTEST_VERSION, dev)
