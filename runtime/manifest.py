"""Find and read the ``manifest.json`` files that ``make kernels`` writes under generated/<arch>/.

Where: when ``$ULTRAQUANT_GENERATED`` is set, only its folders (``os.pathsep`` separated, first wins
per arch), so an explicit blob set never mixes with what the install holds; otherwise the blobs shipped
inside an installed wheel (``ultraquant/_generated``), then the source tree's ``generated/`` (editable
installs and checkouts).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ultraquant import config
from ultraquant.errors import UltraQuantError
from ultraquant.kernels.abi import MANIFEST_NAME, SCHEMA_VERSION

from .packing import Param


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
    explicit = [Path(p) for p in config.get().generated]
    if explicit:  # an explicit blob set (a deployment, a test) never mixes with what the install holds
        return explicit
    roots = []
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


# --- Entries and the (arch, key) index --------------------------------------------------------------

@dataclass(frozen=True)
class Entry:
    """One blob of a manifest, normalized: everything the loader needs to launch it."""

    arch: str
    op: str
    kernel: str
    key: str
    path: Path
    sha256: str
    symbol: str
    num_warps: int
    threads: int
    shared: int
    params: tuple[Param, ...]
    constexprs: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    global_scratch: int = 0
    num_ctas: int = 1
    alternate_of: str = ""
    """Kernel whose LaunchPlan this blob takes in its stead (e.g. a FlyDSL decode for ``uq_decode``)."""
    priority: int = 0

    @property
    def signature(self) -> dict[str, str]:
        """Visible parameters name -> Triton type, as in :class:`~ultraquant.kernels.specs.Specialization`."""
        return {p.name: p.type for p in self.params if not p.hidden}


def _first(d: dict[str, Any], *names: str, default: Any = None) -> Any:
    for n in names:
        if n in d:
            return d[n]
    return default


def parse_entry(raw: dict[str, Any], arch: str, directory: Path) -> Entry:
    """Normalize one manifest blob entry; raises :class:`UltraQuantError` naming what is missing."""
    try:
        kernel = raw["kernel"]
        launch = raw.get("launch", {})
        num_warps = int(_first(raw, "num_warps", default=_first(launch, "num_warps", default=4)))
        params = tuple(
            Param(name=p["name"], type=p["type"], size=int(p["size"]), offset=int(p["offset"]),
                  hidden=bool(p.get("hidden", False)), divisibility=int(p.get("divisibility", 1)))
            for p in _first(raw, "params", "parameters"))
        key = raw.get("key") or _spec_key(kernel, raw.get("constexprs", {}),
                                          {p.name: p.type for p in params if not p.hidden})
        warp = 64 if arch.startswith("gfx") else 32
        return Entry(
            arch=raw.get("arch", arch),
            op=raw.get("op", kernel),
            kernel=kernel,
            key=key,
            path=directory / raw["file"],
            sha256=raw["sha256"],
            symbol=_first(raw, "symbol", "name"),
            num_warps=num_warps,
            threads=int(_first(raw, "threads", default=_first(launch, "threads", "block",
                                                                default=num_warps * warp))),
            shared=int(_first(raw, "shared", default=_first(launch, "shared", "dynamic_shared", default=0))),
            params=params,
            constexprs=dict(raw.get("constexprs", {})),
            global_scratch=max([int(_first(raw, "global_scratch_size", default=_first(
                raw.get("resources", {}), "global_scratch_size", default=0)))]
                + [int(p.get("scratch_bytes", 0)) for p in _first(raw, "params", "parameters")]),
            num_ctas=int(_first(raw, "num_ctas", default=_first(launch, "num_ctas", default=1))),
            alternate_of=str(raw.get("alternate_of") or ""),
            priority=int(raw.get("priority", 0)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        name = raw.get("key") or raw.get("file") or "?"
        raise UltraQuantError(f"manifest {directory / MANIFEST_NAME}: blob {name}: bad or missing "
                              f"field {exc}") from None


def _skipped_key(row: dict[str, Any]) -> str | None:
    """Config key of a manifest ``skipped`` row (op + matrix config), or None if it has none."""
    try:
        from ultraquant.kernels.specs import SPECIALIZERS

        return SPECIALIZERS[row["op"]](**row.get("config", {})).key()
    except Exception:  # an invalid config (the reason it was skipped) has no key
        return None


def _spec_key(kernel: str, constexprs: dict[str, Any], signature: dict[str, str]) -> str:
    from ultraquant.kernels.specs import Specialization

    return Specialization(kernel=kernel, signature=signature, constexprs=constexprs).key()


class ManifestIndex:
    """Every blob the search roots hold, indexed by ``(arch, key)``: the only source of truth for
    "is there a blob for this config" (no separate capability table to drift from it)."""

    def __init__(self, manifests: list[Manifest]) -> None:
        self._manifests = list(manifests)
        self._skipped: dict[str, dict[str, str]] = {}
        self.entries: dict[str, dict[str, Entry]] = {}
        self.errors: dict[str, str] = {}
        """Arch -> why its manifest was rejected (read errors, duplicates, unknown schema)."""
        for m in manifests:
            try:
                self.entries[m.arch] = self._read(m)
            except UltraQuantError as exc:
                self.errors[m.arch] = str(exc)

    @staticmethod
    def _read(m: Manifest) -> dict[str, Entry]:
        schema = m.data.get("schema_version")
        if schema != SCHEMA_VERSION:
            raise UltraQuantError(f"manifest {m.directory / MANIFEST_NAME}: schema_version {schema!r}, this "
                                  f"runtime reads {SCHEMA_VERSION} (rebuild with `make kernels`)")
        out: dict[str, Entry] = {}
        for raw in m.blobs:
            e = parse_entry(raw, m.arch, m.directory)
            if e.arch != m.arch:
                raise UltraQuantError(f"manifest {m.directory / MANIFEST_NAME}: blob {e.key} says arch "
                                      f"{e.arch}, the manifest is for {m.arch}")
            if e.key in out:
                raise UltraQuantError(f"manifest {m.directory / MANIFEST_NAME}: duplicate key {e.key}")
            out[e.key] = e
        return out

    def alternates(self, arch: str, kernel: str) -> tuple[str, ...]:
        """Kernels whose blobs for ``arch`` take ``kernel``'s LaunchPlan, preferred first."""
        found = {(e.priority, e.kernel) for e in self.entries.get(arch, {}).values() if e.alternate_of == kernel}
        return tuple(k for _, k in sorted(found, reverse=True))

    def skipped_reason(self, arch: str, key: str) -> str | None:
        """Why the build deliberately skipped ``key`` for ``arch`` (manifest ``skipped``), if it did.

        Skipped rows carry the op and matrix config; their keys come from the same specializers the
        plans use (computed once per arch, only when a miss asks)."""
        if arch not in self._skipped:
            table: dict[str, str] = {}
            for m in self._manifests:
                if m.arch != arch:
                    continue
                for s in m.data.get("skipped", []):
                    if not isinstance(s, dict):
                        continue
                    k = s.get("key") or _skipped_key(s)
                    if k:
                        table.setdefault(k, str(s.get("reason", "skipped by the build matrix")))
            self._skipped[arch] = table
        return self._skipped[arch].get(key)

    def lookup(self, arch: str, key: str) -> tuple[Entry | None, str]:
        """The entry for exactly ``(arch, key)``, or ``None`` and why not (arch vs config miss)."""
        if arch in self.errors:
            return None, f"the {arch} manifest was rejected: {self.errors[arch]}"
        table = self.entries.get(arch)
        if table is None:
            have = ", ".join(sorted(self.entries)) or "none"
            return None, f"no blobs built for arch {arch} (found: {have})"
        e = table.get(key)
        if e is None:
            skipped = self.skipped_reason(arch, key)
            if skipped:
                return None, f"config {key} is not built for {arch} by design: {skipped}"
            return None, f"no {arch} blob for config {key} ({len(table)} blobs for this arch)"
        return e, ""

    @classmethod
    def discover(cls) -> ManifestIndex:
        """Index of every manifest under :func:`search_roots`."""
        return cls(find_manifests())
