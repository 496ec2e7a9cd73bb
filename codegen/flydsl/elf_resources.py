"""Resource figures of one kernel of an HSACO, read with ``codegen/elf.py`` (as verify reads them)."""

from __future__ import annotations

from typing import Any

from ..elf import read_code_object


def resources_of(binary: bytes, symbol: str) -> dict[str, Any]:
    """``vgpr``, ``agpr``, ``sgpr``, spills, ``lds_static``, ``scratch``... of kernel ``symbol``."""
    kernel = read_code_object(binary).kernels.get(symbol)
    if kernel is None:
        raise ValueError(f"no kernel {symbol!r} in the code object")
    return dict(kernel.resources)
