"""Kernel argument packing, exactly as a blob's manifest lays the parameters out.

Both vendors take an array of pointers, one per kernel parameter, each pointing at that
parameter's value stored at its true size (what Triton's own launchers pass; the driver copies the
values at enqueue time and at graph capture). We keep one buffer holding every value at the manifest's
offset plus the pointer array into it, per thread and per kernel, so a launch is one
``struct.pack_into`` and no allocation.

Triton adds two hidden trailing pointers (global and profile scratch); the manifest lists them and
they stay null here (a blob that needs global scratch is refused when its entry is read).
"""

from __future__ import annotations

import ctypes
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ultraquant.errors import UltraQuantError
from ultraquant.kernels.abi import SCALAR_TYPES, type_size


class MisalignedArgument(UltraQuantError):
    """An argument breaks an assumption the blob was compiled with (e.g. a pointer not 16-byte
    aligned): not a user error, the call just cannot use this blob (the JIT specializes for it)."""


@dataclass(frozen=True)
class Param:
    """One kernel parameter as the manifest describes it."""

    name: str
    type: str
    size: int
    offset: int
    hidden: bool = False
    divisibility: int = 1
    """The blob was compiled assuming the value (pointer address or integer) divides by this."""


def check_layout(params: Sequence[Param], kernel: str = "kernel") -> int:
    """Check a manifest's parameter layout (known types at their true size, aligned, in order, not
    overlapping; divisibility positive); returns the argument block's size. Raises UltraQuantError."""
    end = 0
    for p in params:
        want = type_size(p.type)
        if p.size != want:
            raise UltraQuantError(f"manifest: {kernel}: parameter {p.name!r} of type {p.type} "
                                  f"has size {p.size}, expected {want}")
        if p.offset < 0 or p.offset % p.size:
            raise UltraQuantError(f"manifest: {kernel}: parameter {p.name!r} at offset {p.offset} "
                                  f"is not aligned to its size {p.size}")
        if p.offset < end:
            raise UltraQuantError(f"manifest: {kernel}: parameter {p.name!r} at offset {p.offset} "
                                  f"overlaps the previous one (ends at {end})")
        if p.divisibility < 1:
            raise UltraQuantError(f"manifest: {kernel}: parameter {p.name!r} has divisibility "
                                  f"{p.divisibility}, expected >= 1")
        end = p.offset + p.size
    return max(end, 8)


def _bf16_bits(x: float) -> int:
    """Round-to-nearest-even bf16 bit pattern of ``x`` (what Triton's launcher passes for bf16)."""
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    if (bits & 0x7F800000) == 0x7F800000 and bits & 0x7FFFFF:
        return 0x7FC0
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


def _tensor_type() -> type:
    import torch

    return torch.Tensor


def _pointer(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    return value.data_ptr()


class ArgPacker:
    """Packs one launch's arguments for a kernel with the given parameter list.

    ``params`` is every parameter in order, hidden ones included; ``pack`` takes the visible ones
    (the LaunchPlan's ``args``) and returns a ready ``void**`` array valid until the same thread packs
    again for this kernel.
    """

    def __init__(self, params: Sequence[Param], kernel: str = "kernel") -> None:
        self.kernel = kernel
        self.params = tuple(params)
        self.visible = tuple(p for p in self.params if not p.hidden)
        self.size = check_layout(self.params, kernel)
        fmt, pos = ["<"], 0
        for p in self.visible:
            if p.offset > pos:
                fmt.append(f"{p.offset - pos}x")
            fmt.append("Q" if p.type.startswith("*") else SCALAR_TYPES[p.type][0])
            pos = p.offset + p.size
        self.struct = struct.Struct("".join(fmt))
        self._convert = tuple(_pointer if p.type.startswith("*") else
                              (_bf16_bits if p.type == "bf16" else None) for p in self.visible)
        self._checks = tuple((i, p.name, p.divisibility) for i, p in enumerate(self.visible)
                             if p.divisibility > 1)
        self._tls = threading.local()
        self.pack = self._compile_pack()
        """Write ``args`` into this thread's buffer; return the pointer array for the launch.
        (Anything unusual, an error included, goes through :meth:`pack_slow`.)"""

    def buffers(self) -> tuple[ctypes.Array, ctypes.Array]:
        """This thread's (value buffer, pointer array) pair, created on first use."""
        tls = self._tls
        try:
            return tls.buf, tls.ptrs
        except AttributeError:
            buf = ctypes.create_string_buffer(self.size)
            base = ctypes.addressof(buf)
            ptrs = (ctypes.c_void_p * len(self.params))(*(base + p.offset for p in self.params))
            tls.buf, tls.ptrs = buf, ptrs
            return buf, ptrs

    def values(self, args: Sequence[Any]) -> list[Any]:
        """The raw values (pointers as integers) that ``pack`` writes, in visible-parameter order."""
        if len(args) != len(self.visible):
            raise UltraQuantError(f"{self.kernel}: got {len(args)} arguments, the blob takes "
                                  f"{len(self.visible)} ({', '.join(p.name for p in self.visible)})")
        vals = [a if c is None else c(a) for c, a in zip(self._convert, args, strict=True)]
        for i, name, div in self._checks:
            if vals[i] % div:
                raise MisalignedArgument(f"{self.kernel}: argument {name!r} = {vals[i]:#x} is not a "
                                      f"multiple of {div}, which the blob was compiled to assume")
        return vals

    def pack_slow(self, args: Sequence[Any]) -> ctypes.Array:
        """Reference implementation of :meth:`pack` (and the path that words its errors)."""
        buf, ptrs = self.buffers()
        try:
            self.struct.pack_into(buf, 0, *self.values(args))
        except struct.error as exc:
            raise UltraQuantError(f"{self.kernel}: an argument does not fit its parameter type: {exc}") \
                from None
        return ptrs

    def _compile_pack(self) -> Callable[[Sequence[Any]], ctypes.Array]:
        """A ``pack`` specialized to this parameter list (the launch hot path: one unpack, one
        ``data_ptr()`` per tensor, one alignment test, one ``pack_into``). Generated code uses only
        parameter indices, never names from the manifest."""
        n = len(self.visible)
        names = [f"a{i}" for i in range(n)]
        vals = []
        body = [f"    {', '.join(names)}{',' if n == 1 else ''} = args"] if n else []
        aligned: dict[int, list[str]] = {}
        for i, p in enumerate(self.visible):
            if p.type.startswith("*"):
                body.append(f"    v{i} = a{i}.data_ptr() if a{i}.__class__ is Tensor else pointer(a{i})")
            elif p.type == "bf16":
                body.append(f"    v{i} = bf16(a{i})")
            else:
                body.append(f"    v{i} = a{i}")
            vals.append(f"v{i}")
            if p.divisibility > 1:
                aligned.setdefault(p.divisibility, []).append(f"v{i}")
        for div, vs in aligned.items():
            test = f"({' | '.join(vs)}) & {div - 1}" if div & (div - 1) == 0 else \
                " or ".join(f"{v} % {div}" for v in vs)
            body.append(f"    if {test}:\n        return slow(args)")
        src = "\n".join([
            "def pack(args):",
            f"    if len(args) != {n}:",
            "        return slow(args)",
            "    buf, ptrs = buffers()",
            *body,
            "    try:",
            f"        pack_into(buf, 0{''.join(', ' + v for v in vals)})",
            "    except struct_error:",
            "        return slow(args)",
            "    return ptrs",
        ])
        scope = {"Tensor": _tensor_type(), "pointer": _pointer, "bf16": _bf16_bits, "slow": self.pack_slow,
                 "buffers": self.buffers, "pack_into": self.struct.pack_into, "struct_error": struct.error}
        exec(compile(src, f"<ultraquant pack {self.kernel}>", "exec"), scope)  # noqa: S102
        return scope["pack"]
