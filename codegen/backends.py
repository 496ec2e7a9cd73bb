"""The backend seam of the generator: one class per compiler (Triton now, FlyDSL from codegen/flydsl/).

A backend turns a matrix config into a :class:`~ultraquant.kernels.specialization.Specialization` (in the
build process) and a Specialization into a binary (inside a worker subprocess, see
:mod:`ultraquant.codegen.worker`). Everything else (matrix, subprocesses, caching, ELF checks,
manifest, verify) is shared, so a new backend only implements :class:`Backend`.

Backends are named in :data:`BACKENDS` as ``"module:Class"`` and imported lazily, so reading
manifests and ``ultraquant verify`` never import a compiler.
"""

from __future__ import annotations

import hashlib
import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ultraquant.errors import UltraQuantError

from .archs import Arch

if TYPE_CHECKING:  # verify imports this module in installs that may lack the kernels package
    from ultraquant.kernels.specialization import Specialization

BACKENDS: dict[str, str] = {
    "triton": "ultraquant.codegen.triton_backend:TritonBackend",
    "flydsl": "ultraquant.codegen.flydsl.backend:FlyDSLBackend",
}
"""Backend name -> ``"module:Class"``. The class is built with the job's ``backend_options``."""

VERIFY_HOOKS: dict[str, str] = {"flydsl": "ultraquant.codegen.flydsl.isa:check_blob"}
"""Backend name -> ``"module:function"`` run by ``ultraquant verify`` on each blob of that backend
(extra ISA checks, e.g. MFMA present): ``function(entry: dict, data: bytes, arch: Arch) -> list[str]``
returning problems. Must not need the backend's compiler (verify runs in plain installs)."""


class Backend:
    """Base class of a compiler backend. Subclasses set :attr:`name` and override the methods."""

    name: str = ""
    hidden_params: tuple[str, ...] = ()
    """Names of the trailing parameters the compiler adds after the user's (Triton: two scratch ptrs)."""

    def __init__(self, **options: Any) -> None:
        self.options = dict(options)

    def targets(self, arch: Arch) -> bool:
        """Whether this backend can compile for ``arch``."""
        raise NotImplementedError

    def toolchain(self, arch: Arch) -> dict[str, str]:
        """Versions of everything that shapes the bytes for ``arch`` (recorded, and hashed)."""
        raise NotImplementedError

    def source_files(self) -> list[tuple[str, Path]]:
        """(stable name, path) of every source file the blobs depend on (hashed)."""
        raise NotImplementedError

    def specialize(self, op: str, config: dict[str, Any]) -> Specialization:
        """The Specialization for one matrix config of ``op`` (runs in the build process)."""
        raise NotImplementedError

    def compile(self, spec: Specialization, arch: Arch) -> tuple[bytes, dict[str, Any]]:
        """Compile one Specialization (runs in a worker subprocess). Returns the binary and info:
        ``symbol``, ``threads``, ``shared`` (dynamic bytes), ``num_ctas``, ``hidden`` (one dict per
        hidden trailing parameter: ``name``, ``type``, ``scratch_bytes``, ``scratch_align``) and
        anything else worth recording under ``compiler``."""
        raise NotImplementedError

    def worker_env(self, arch: Arch) -> dict[str, str]:
        """Environment variables the worker needs (hermetic caches, no line info, ...)."""
        return {}

    def requirements(self) -> list[str]:
        """pip requirement specs the build venv needs for this backend (pinned)."""
        return []

    def system_packages(self) -> list[str]:
        """Debian packages this backend needs (installed by ``make kernels`` when missing)."""
        return []

    def source_hash(self) -> str:
        """sha256 over the names and bytes of :meth:`source_files`, in a stable order."""
        h = hashlib.sha256()
        for name, path in sorted(self.source_files()):
            h.update(name.encode() + b"\0" + Path(path).read_bytes() + b"\0")
        return h.hexdigest()


def load_backend(name: str, options: dict[str, Any] | None = None) -> Backend:
    """Instantiate the backend called ``name`` (import errors say which toolchain is missing)."""
    try:
        target = BACKENDS[name]
    except KeyError:
        raise UltraQuantError(f"backend: unknown {name!r}; known: {', '.join(BACKENDS)}") from None
    module, _, cls = target.partition(":")
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise UltraQuantError(f"backend {name}: cannot import {module} ({exc}); run `make kernels`, "
                              "which sets up the build environment") from exc
    return getattr(mod, cls)(**(options or {}))


def verify_hook(name: str):
    """The extra verify check registered for backend ``name``, or None."""
    target = VERIFY_HOOKS.get(name)
    if not target:
        return None
    module, _, fn = target.partition(":")
    return getattr(importlib.import_module(module), fn)
