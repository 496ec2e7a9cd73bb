"""Triton backend: compiles the JIT path's own ``@triton.jit`` sources to HSACO / cubin, offline.

Specializations come from ``ultraquant.kernels.catalog.specializer`` (no Triton import) and kernels
from ``ultraquant.kernels.registry.get_kernel`` (kernel name -> JITFunction), so the AOT blobs and the JIT
path cannot disagree about a config. Both module names are options (the tests point them at a fixture
with the same two names).

Choices that shape the bytes:
- ``triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget(...))`` with the
  Specialization's ``num_warps``/``num_stages``; every other option at Triton's default (as the JIT).
  Gluon kernels (``fn.is_gluon()``: the whole-page decode) go through ``GluonASTSource``, as Gluon's JIT does;
  they take the same two hidden scratch pointers.
- Pointer parameters carry ``tt.divisibility=16`` (what the JIT assumes for a 16-byte aligned tensor,
  the usual case), and so do the integer parameters the Specialization names in ``divisible`` (the
  row strides its plan proved multiples of 16: what the JIT specializes; without them Triton cannot
  vectorize those rows, and the decode needed more registers and lost occupancy); the manifest records
  ``divisibility: 16`` on each, and the runtime's packer refuses a launch whose values break one.
  Other integers get no divisibility assumption (correct for any value).
- No AMD ``tt.pointer_range=32`` (buffer ops): a KV cache may exceed 2 GiB.
- ``TRITON_DISABLE_LINE_INFO=1`` (no source paths in the binaries: path-independent, reproducible)
  and a private, empty Triton cache per worker (nothing stale is reused).
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any

from ultraquant.errors import UltraQuantError
from ultraquant.kernels.specialization import ARG_DIVISOR, Specialization

from .archs import Arch
from .backends import Backend

POINTER_DIVISIBILITY = ARG_DIVISOR
HIDDEN = ("global_scratch", "profile_scratch")


def _module_files(module_name: str) -> list[tuple[str, Path]]:
    """Every .py file of the package that holds ``module_name`` (kernels import their siblings)."""
    spec = importlib.util.find_spec(module_name)
    if spec is None or spec.origin is None:
        raise UltraQuantError(f"triton backend: cannot find module {module_name}")
    folder = Path(spec.origin).parent
    prefix = module_name.rsplit(".", 1)[0] if "." in module_name else module_name
    return [(f"{prefix}/{p.relative_to(folder).as_posix()}", p) for p in sorted(folder.rglob("*.py"))]


def divisibility(spec: Specialization) -> dict[str, int]:
    """Parameter -> the divisibility a blob of ``spec`` is compiled to assume (pointers and
    ``spec.divisible``): the ``tt.divisibility`` attrs and the manifest's ``divisibility`` fields."""
    return {n: POINTER_DIVISIBILITY for n, ty in spec.signature.items()
            if ty.startswith("*") or n in spec.divisible}


def compile_attrs(spec: Specialization, arg_names: list[str]) -> dict[tuple[int], list[list[Any]]]:
    """``ASTSource`` attrs of ``spec`` for a kernel with parameters ``arg_names``."""
    return {(arg_names.index(n),): [["tt.divisibility", d]] for n, d in divisibility(spec).items()}


class TritonBackend(Backend):
    """Compiles Triton kernels; options ``plans`` and ``registry`` name the two contract modules."""

    name = "triton"
    hidden_params = HIDDEN

    def __init__(self, plans: str = "ultraquant.kernels.catalog",
                 registry: str = "ultraquant.kernels.registry", **options: Any) -> None:
        super().__init__(plans=plans, registry=registry, **options)
        self.plans_module = plans
        self.registry_module = registry

    def targets(self, arch: Arch) -> bool:
        return arch.vendor in ("hip", "cuda")

    def toolchain(self, arch: Arch) -> dict[str, str]:
        import triton

        out = {"triton": triton.__version__}
        if arch.vendor == "cuda":
            from triton.backends.nvidia.compiler import get_ptxas_version

            text = get_ptxas_version(int(arch.triton_arch))
            out["ptxas"] = text.strip().splitlines()[-1] if text.strip() else "unknown"
        return out

    def source_files(self) -> list[tuple[str, Path]]:
        files = dict(_module_files(self.plans_module))
        files.update(_module_files(self.registry_module))
        here = Path(__file__).resolve().parent
        # The compile path itself shapes the bytes (options, attrs): hash it too.
        for name in ("triton_backend.py", "worker.py"):
            files[f"codegen/{name}"] = here / name
        return sorted(files.items())

    def specialize(self, op: str, config: dict[str, Any]) -> Specialization:
        try:
            fn = importlib.import_module(self.plans_module).specializer(op)
        except KeyError:
            raise UltraQuantError(f"op {op!r}: no specializer in {self.plans_module}") from None
        try:
            return fn(**config)
        except TypeError as exc:
            raise UltraQuantError(f"op {op!r}: the matrix config {config} does not fit its specializer "
                                  f"({exc}); fix the row in codegen/matrix.py") from exc

    def _kernel(self, name: str):
        return importlib.import_module(self.registry_module).get_kernel(name)

    def compile(self, spec: Specialization, arch: Arch) -> tuple[bytes, dict[str, Any]]:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        fn = self._kernel(spec.kernel)
        names = list(fn.arg_names)
        missing = [n for n in spec.signature if n not in names]
        if missing:
            raise UltraQuantError(f"{spec.kernel}: signature names {missing} are not parameters")
        bad = [n for n in spec.divisible if not spec.signature.get(n, "").startswith(("i", "u"))]
        if bad:
            raise UltraQuantError(f"{spec.kernel}: divisible names {bad}, which are not integer parameters")
        source = ASTSource
        if fn.is_gluon():  # a Gluon kernel (the whole-page decode): Gluon's front end, the same compile after it
            from triton.experimental.gluon._runtime import GluonASTSource as source
        src = source(fn, dict(spec.signature), dict(spec.constexprs), compile_attrs(spec, names))
        target = GPUTarget(arch.vendor, arch.triton_arch, arch.warp_size)
        options = {"num_warps": spec.num_warps, "num_stages": spec.num_stages}
        if spec.maxnreg is not None and arch.vendor != "hip":
            options["maxnreg"] = spec.maxnreg
        compiled = triton.compile(src, target=target, options=options)
        binary = compiled.asm["hsaco" if arch.vendor == "hip" else "cubin"]
        md = compiled.metadata
        num_warps = int(md.num_warps)
        hidden = [
            {"name": "global_scratch", "type": "*i8",
             "scratch_bytes": int(getattr(md, "global_scratch_size", 0) or 0),
             "scratch_align": int(getattr(md, "global_scratch_align", 1) or 1)},
            {"name": "profile_scratch", "type": "*i8",
             "scratch_bytes": int(getattr(md, "profile_scratch_size", 0) or 0),
             "scratch_align": int(getattr(md, "profile_scratch_align", 1) or 1)},
        ]
        info = {
            "symbol": str(md.name),
            "threads": num_warps * arch.warp_size,
            "num_warps": num_warps,
            "num_stages": int(md.num_stages),
            "num_ctas": int(getattr(md, "num_ctas", 1) or 1),
            "shared": int(md.shared),
            "hidden": hidden,
            "divisibility": divisibility(spec),
        }
        return bytes(binary), info

    def worker_env(self, arch: Arch) -> dict[str, str]:
        return {"TRITON_DISABLE_LINE_INFO": "1", "TRITON_ALWAYS_COMPILE": "1",
                "TRITON_STORE_BINARY_ONLY": "1"}

    def requirements(self) -> list[str]:
        return ["triton==3.6.0"]

