"""Find and read the ``manifest.json`` files that ``make kernels`` writes under generated/<arch>/.

Search order: the folders in ``$ULTRAQUANT_GENERATED`` (``os.pathsep`` separated), the blobs shipped
inside an installed wheel (``ultraquant/_generated``), then the source tree's ``generated/`` (editable
installs and checkouts).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MANIFEST_NAME = "manifest.json"


@dataclass
class Manifest:
    """One arch's manifest: its folder, the parsed JSON and its blob entries."""

    arch: str
    directory: Path
    data: dict[str, Any] = field(repr=False)

    @property
    def blobs(self) -> list[dict[str, Any]]:
        return list(self.data.get("blobs", []))


def search_roots() -> list[Path]:
    """Folders that may hold ``<arch>/manifest.json``, in priority order."""
    roots = [Path(p) for p in os.environ.get("ULTRAQUANT_GENERATED", "").split(os.pathsep) if p]
    # Installed from a wheel this file is ultraquant/runtime/manifest.py; in a checkout (or an
    # editable install) it is runtime/manifest.py beside generated/.
    parent = Path(__file__).resolve().parent.parent
    roots.append(parent / "_generated")
    roots.append(parent / "generated")
    return roots


def find_manifests() -> list[Manifest]:
    """Every readable manifest under the search roots; the first root that has an arch wins."""
    found: dict[str, Manifest] = {}
    for root in search_roots():
        if not root.is_dir():
            continue
        for path in sorted(root.glob(f"*/{MANIFEST_NAME}")):
            data = json.loads(path.read_text())
            arch = data.get("arch", path.parent.name)
            found.setdefault(arch, Manifest(arch=arch, directory=path.parent, data=data))
    return list(found.values())
