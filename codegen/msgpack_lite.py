"""A small MessagePack decoder, enough for the AMDGPU ``NT_AMDGPU_METADATA`` note.

Why not the ``msgpack`` package: ``ultraquant verify`` must run in an install that has neither the
build toolchain nor optional extras (a wheel in a clean venv), so the offline checks use only the
standard library. The test suite cross-checks this decoder against ``msgpack`` on real code objects.
"""

from __future__ import annotations

import struct
from typing import Any


class MsgpackError(ValueError):
    """The bytes are not a MessagePack value this decoder understands."""


def unpackb(data: bytes) -> Any:
    """Decode one MessagePack value (maps become dicts, arrays lists, str/bin as str/bytes)."""
    value, end = _decode(memoryview(data), 0)
    if end != len(data):
        raise MsgpackError(f"{len(data) - end} trailing bytes after the value")
    return value


def _need(buf: memoryview, pos: int, n: int) -> None:
    if pos + n > len(buf):
        raise MsgpackError(f"truncated at byte {pos} (wanted {n} more)")


def _unpack(fmt: str, buf: memoryview, pos: int) -> tuple[Any, int]:
    size = struct.calcsize(fmt)
    _need(buf, pos, size)
    return struct.unpack_from(fmt, buf, pos)[0], pos + size


def _raw(buf: memoryview, pos: int, n: int) -> tuple[bytes, int]:
    _need(buf, pos, n)
    return bytes(buf[pos:pos + n]), pos + n


def _seq(buf: memoryview, pos: int, n: int) -> tuple[list[Any], int]:
    out = []
    for _ in range(n):
        item, pos = _decode(buf, pos)
        out.append(item)
    return out, pos


def _map(buf: memoryview, pos: int, n: int) -> tuple[dict[Any, Any], int]:
    out: dict[Any, Any] = {}
    for _ in range(n):
        key, pos = _decode(buf, pos)
        val, pos = _decode(buf, pos)
        out[key] = val
    return out, pos


# Fixed-width scalars: type byte -> struct format.
_SCALARS = {0xCA: ">f", 0xCB: ">d", 0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q",
            0xD0: ">b", 0xD1: ">h", 0xD2: ">i", 0xD3: ">q"}
# Length-prefixed types: type byte -> (length format, kind).
_SIZED = {0xC4: (">B", "bin"), 0xC5: (">H", "bin"), 0xC6: (">I", "bin"),
          0xD9: (">B", "str"), 0xDA: (">H", "str"), 0xDB: (">I", "str"),
          0xDC: (">H", "array"), 0xDD: (">I", "array"), 0xDE: (">H", "map"), 0xDF: (">I", "map")}


def _sized(kind: str, buf: memoryview, pos: int, n: int) -> tuple[Any, int]:
    if kind == "array":
        return _seq(buf, pos, n)
    if kind == "map":
        return _map(buf, pos, n)
    raw, pos = _raw(buf, pos, n)
    return (raw.decode("utf-8") if kind == "str" else raw), pos


def _decode(buf: memoryview, pos: int) -> tuple[Any, int]:
    _need(buf, pos, 1)
    t = buf[pos]
    pos += 1
    if t <= 0x7F:
        return t, pos
    if t >= 0xE0:
        return t - 0x100, pos
    if 0x80 <= t <= 0x8F:
        return _map(buf, pos, t & 0x0F)
    if 0x90 <= t <= 0x9F:
        return _seq(buf, pos, t & 0x0F)
    if 0xA0 <= t <= 0xBF:
        return _sized("str", buf, pos, t & 0x1F)
    if t in (0xC0, 0xC2, 0xC3):
        return {0xC0: None, 0xC2: False, 0xC3: True}[t], pos
    if t in _SCALARS:
        return _unpack(_SCALARS[t], buf, pos)
    if t in _SIZED:
        fmt, kind = _SIZED[t]
        n, pos = _unpack(fmt, buf, pos)
        return _sized(kind, buf, pos, n)
    raise MsgpackError(f"unsupported type byte 0x{t:02x} at byte {pos - 1}")
