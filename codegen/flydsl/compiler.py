"""Compile one FlyDSL kernel to an AMDGPU code object (HSACO) without a GPU.

FlyDSL reads its target and toolchain from the environment on every compile, so :func:`compile_decode`
sets them first: ``ARCH``/``FLYDSL_GPU_ARCH`` (the target), ``ROCM_PATH`` (a folder whose
``llvm/bin/ld.lld`` is the linker ``codegen/toolchain.py`` finds; FlyDSL's own LLVM has no linker), and
``FLYDSL_RUNTIME_ENABLE_CACHE=0`` (hermetic: nothing stale is reused). ``flyc.compile`` with
null-pointer placeholders lowers without touching HIP; the HSACO is the ``#gpu.object`` of the lowered
module's ``gpu.binary``. Errors LLVM only prints (``error: ...`` on stderr while "succeeding") are
caught by the caller scanning the output (the generator's worker does; so does
:mod:`.compile_kernel`).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from ultraquant import config

KERNEL_KINDS = ("decode",)


def find_lld() -> str:
    """Path of an ld.lld FlyDSL can use (:func:`ultraquant.codegen.toolchain.find_lld`: no root needed)."""
    from ..toolchain import find_lld as find

    return find().path


def rocm_root(build_dir: str | os.PathLike | None = None) -> str:
    """A folder laid out like a ROCm install as far as FlyDSL looks (``llvm/bin/ld.lld``)."""
    default = Path(tempfile.gettempdir()) / f"ultraquant-flydsl-rocm-{os.getuid()}"
    root = Path(build_dir or config.tool_path("ULTRAQUANT_FLYDSL_ROCM") or default).resolve()
    link = root / "llvm" / "bin" / "ld.lld"
    target = find_lld()
    if not (link.is_symlink() and os.readlink(link) == target):
        link.parent.mkdir(parents=True, exist_ok=True)
        tmp = link.with_name(f"ld.lld.{os.getpid()}.tmp")
        if tmp.is_symlink() or tmp.exists():
            tmp.unlink()
        tmp.symlink_to(target)
        tmp.replace(link)
    return str(root)


def set_environment(arch: str, *, need_linker: bool = True) -> None:
    """Point FlyDSL at ``arch`` and the lld-19 root, with its disk cache off. Without
    ``need_linker`` a missing lld is tolerated (lowering to IR works; only the final link fails)."""
    os.environ["ARCH"] = arch
    os.environ["FLYDSL_GPU_ARCH"] = arch
    os.environ["FLYDSL_RUNTIME_ENABLE_CACHE"] = "0"
    try:
        os.environ["ROCM_PATH"] = rocm_root()
    except RuntimeError:
        if need_linker:
            raise


def _placeholders(kind: str) -> list[Any]:
    import flydsl.compiler as flyc
    import flydsl.expr as fx

    def null(t):
        return flyc.from_c_void_p(t, None)

    if kind == "decode":  # byte pointers: the kernel addresses everything in bytes; one per parameter
        from ultraquant.kernels.flydsl.decode import PARAMS

        values = {"ptr": lambda: null(fx.Uint8), "f32": lambda: 1.0, "i32": lambda: 0}
        return [1 if name == "num_splits" else values[ty]() for name, ty in PARAMS]
    raise ValueError(f"unknown kernel kind {kind!r} (known: {', '.join(KERNEL_KINDS)})")


def extract_hsaco(compiled) -> bytes:
    """The code object inside a ``flyc.compile`` result (its single ``gpu.binary``)."""
    from flydsl._mlir import ir
    from flydsl._mlir.dialects import gpu
    from flydsl.compiler.jit_function import _create_mlir_context

    found: list[bytes] = []

    def visit(op):
        if op.name == "gpu.binary":
            found.append(gpu.ObjectAttr(ir.ArrayAttr(op.attributes["objects"])[0]).object)
        return ir.WalkResult.ADVANCE

    with _create_mlir_context():
        ir.Module.parse(compiled._keepalive._ir_text).operation.walk(visit)
    if len(found) != 1:
        raise RuntimeError(f"expected one gpu.binary in the lowered module, found {len(found)}")
    return bytes(found[0])


def compile_decode(arch: str, name: str, config: dict[str, Any], *, query_dtype: str = "bf16",
                   out_dtype: str = "bf16", mx: bool = False, need_linker: bool = True,
                   waves: int = 1, pipelined: bool = True, mx_query_map=None) -> bytes:
    """HSACO of the decode kernel for ``config`` (DecodeConfig fields) on ``arch``. ``mx_query_map``:
    an operand map other than the hardware's FP8 one for the mx query (interpreter tests only)."""
    set_environment(arch, need_linker=need_linker)
    import flydsl.compiler as flyc
    from flydsl.compiler.kernel_function import CompilationContext

    from ultraquant.kernels.flydsl import decode
    from ultraquant.kernels.flydsl.layout import DecodeConfig

    from .isa import DESIGN_WAVES

    launcher = decode.build_decode(DecodeConfig(**config), arch, name=name, query_dtype=query_dtype,
                                   out_dtype=out_dtype, mx=mx, waves=waves, pipelined=pipelined,
                                   **({} if mx_query_map is None else {"mx_query_map": mx_query_map}))
    # waves_per_eu: the register budget LLVM must fit (the occupancy the design assumes)
    with CompilationContext.compile_hints({"waves_per_eu": DESIGN_WAVES.get(config["head_size"], 1)}):
        return extract_hsaco(flyc.compile(launcher, *_placeholders("decode")))


def flydsl_version() -> str:
    """Installed flydsl version (without importing it)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("flydsl")
    except PackageNotFoundError:
        return "not installed"
