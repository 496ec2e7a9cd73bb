"""The ``manifest.json`` that codegen writes beside the blobs of one arch: its schema and writer.

The manifest is the single source of truth for what was built. Top level: ``schema_version``,
``arch``, ``target`` (vendor, warp size, ELF identity), ``toolchain`` and ``source_hash`` per
backend, the ``selection`` (matrix axes built), ``blobs`` (sorted by key) and ``skipped`` (configs
the matrix table excludes, with the reason). One blob entry:

- ``op``, ``backend``, ``kernel``, ``key`` (``Specialization.key()``), ``config`` (the matrix
  config), ``constexprs``, ``divisible`` (integer parameters the plan proves multiples of 16, part of
  the key), ``arch``, ``file``, ``size``, ``sha256``, ``symbol``;
- ``launch``: ``grid`` (rule text), ``threads`` (per block), ``num_warps``, ``num_stages``,
  ``num_ctas``, ``shared`` (dynamic shared memory bytes to pass at launch);
- ``params``: every kernel parameter in order (hidden trailing ones included, ``hidden: true``) with
  ``name``, ``type`` (Triton type string), ``size``, ``offset``, ``divisibility`` (the value must
  divide by it: what the binary was compiled to assume, checked at launch) and, for scratch pointers,
  ``scratch_bytes``/``scratch_align``; ``kernarg_size`` is the whole argument block;
- ``resources``: from the binary (HSACO: ``vgpr``, ``agpr``, ``sgpr``, ``vgpr_spill``,
  ``sgpr_spill``, ``lds_static``, ``scratch``...; cubin: ``registers``, ``local``, ``min_stack``,
  ``max_stack``, ``shared_static``...) plus ``global_scratch_size``/``profile_scratch_size``;
- ``code_object_version`` (HSACO) or ``elf_abi_version`` (cubin), ``allow_spills`` (reason or
  ``""``) and ``spill_budget`` (bytes), ``build_hash`` (inputs of the compile; the incremental cache key).

Writing is deterministic: sorted keys, fixed indentation, no timestamps and no absolute paths.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ultraquant.errors import UltraQuantError
from ultraquant.kernels.abi import MANIFEST_NAME, SCHEMA_VERSION


def dumps(manifest: dict[str, Any]) -> str:
    """Canonical text of a manifest (byte-identical for equal content)."""
    return json.dumps(manifest, sort_keys=True, indent=1, ensure_ascii=True) + "\n"


def write(directory: Path, manifest: dict[str, Any]) -> Path:
    """Write ``manifest.json`` atomically into ``directory``; returns its path."""
    path = directory / MANIFEST_NAME
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(dumps(manifest))
    tmp.replace(path)
    return path


def load(directory: Path) -> dict[str, Any]:
    """Read and minimally validate ``directory/manifest.json`` (clear errors, never a traceback)."""
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        raise UltraQuantError(f"{path}: no manifest (run `make kernels ARCH=...` first)")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UltraQuantError(f"{path}: unreadable manifest ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("blobs"), list):
        raise UltraQuantError(f"{path}: not an UltraQuant manifest (no blobs list)")
    if data.get("schema_version") != SCHEMA_VERSION:
        raise UltraQuantError(f"{path}: schema_version {data.get('schema_version')!r}, this "
                              f"ultraquant reads {SCHEMA_VERSION}")
    return data


def duplicate_keys(blobs: list[dict[str, Any]]) -> list[str]:
    """Keys that occur more than once (the build and verify both refuse them)."""
    seen: set[str] = set()
    dups: list[str] = []
    for b in blobs:
        k = b.get("key")
        if k in seen and k not in dups:
            dups.append(k)
        seen.add(k)
    return dups
