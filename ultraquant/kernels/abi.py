"""The blob ABI shared by codegen (writer) and the runtime (reader): manifest schema and parameter sizes.

A manifest (``generated/<arch>/manifest.json``, described in docs/codegen.md) is written by
``codegen/manifest.py`` and read by ``runtime/manifest.py``; both take the version, the file name and
the byte size of every parameter type from here, so they cannot drift apart.
"""

from __future__ import annotations

from pathlib import PurePosixPath, PureWindowsPath

from ..errors import UltraQuantError

SCHEMA_VERSION = 2
"""Version of the manifest layout (field ``schema_version``). 2: blob entries carry ``alternate_of``
and ``priority`` (kernels launched with another kernel's plan and preferred over it)."""

MANIFEST_NAME = "manifest.json"

SCALAR_TYPES: dict[str, tuple[str, int]] = {
    "i1": ("b", 1), "i8": ("b", 1), "i16": ("h", 2), "i32": ("i", 4), "i64": ("q", 8),
    "u1": ("B", 1), "u8": ("B", 1), "u16": ("H", 2), "u32": ("I", 4), "u64": ("Q", 8),
    "fp16": ("e", 2), "bf16": ("H", 2), "fp32": ("f", 4), "f32": ("f", 4), "fp64": ("d", 8),
}
"""Triton signature type -> (``struct`` code, size in bytes). Floats travel at their own width, as
Triton's launcher packs them (fp32 in 4 bytes, fp16/bf16 in 2)."""

POINTER_SIZE = 8


def type_size(ty: str) -> int:
    """Bytes one kernel parameter of Triton type ``ty`` occupies in the argument block."""
    if ty.startswith("*"):
        return POINTER_SIZE
    if ty in SCALAR_TYPES:
        return SCALAR_TYPES[ty][1]
    raise UltraQuantError(f"parameter type {ty!r} is not supported by the blob ABI")


def blob_name_problem(name: object) -> str | None:
    """Why ``name`` is not a plain blob file name inside its manifest's folder (None: it is one).

    A plain name has no directory part on any OS (no ``/`` or ``\\``, no drive), is not ``.``/``..``
    and has no NUL: codegen writes such names, ``ultraquant verify`` and the runtime refuse others,
    so a manifest can never make the runtime read a file outside the blob folder."""
    if not isinstance(name, str) or not name:
        return f"file name {name!r} is not a non-empty string"
    if (name in (".", "..") or "\0" in name or PurePosixPath(name).name != name
            or PureWindowsPath(name).name != name):
        return f"file name {name!r} must be a plain file name inside the blob folder"
    return None
