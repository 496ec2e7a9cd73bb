"""Find and read the ``manifest.json`` files that ``make kernels`` writes under generated/<arch>/.

Where: when ``$ULTRAQUANT_GENERATED`` is set, only its folders (``os.pathsep`` separated, first wins
per arch), so an explicit blob set never mixes with what the install holds; otherwise the blobs shipped
inside an installed wheel (``ultraquant/_generated``), then the source tree's ``generated/`` (editable
installs and checkouts).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ultraquant import config
from ultraquant.errors import UltraQuantError
from ultraquant.kernels.abi import MANIFEST_NAME, SCHEMA_VERSION, blob_name_problem

from .packing import Param, check_layout

log = logging.getLogger("ultraquant.runtime")


@dataclass
class Manifest:
    """One arch's manifest: its folder, the parsed JSON and its blob entries (``error``: why the file
    could not be read as a manifest at all; such a manifest has no entries)."""

    arch: str
    directory: Path
    data: dict[str, Any] = field(repr=False)
    error: str = ""

    @property
    def blobs(self) -> list[Any]:
        blobs = self.data.get("blobs", [])
        return list(blobs) if isinstance(blobs, list) else []


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


def read_manifest(path: Path) -> Manifest:
    """Read one ``<arch>/manifest.json``; never raises: an unreadable file, truncated or malformed JSON,
    or a top level that is not an object gives a :class:`Manifest` whose ``error`` says so."""
    folder_arch = path.parent.name
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        return Manifest(folder_arch, path.parent, {}, f"manifest {path}: cannot read: {exc}")
    except ValueError as exc:  # json.JSONDecodeError: truncated or not JSON
        return Manifest(folder_arch, path.parent, {}, f"manifest {path}: not valid JSON ({exc})")
    if not isinstance(data, dict):
        return Manifest(folder_arch, path.parent, {},
                        f"manifest {path}: expected a JSON object, got {type(data).__name__}")
    arch = data.get("arch", folder_arch)
    if not isinstance(arch, str) or not arch:
        return Manifest(folder_arch, path.parent, {}, f"manifest {path}: field 'arch' is {arch!r}, not a name")
    return Manifest(arch, path.parent, data)


def find_manifests() -> list[Manifest]:
    """Every manifest under the search roots (unreadable ones carry their ``error``); the first root
    that has an arch wins."""
    found: dict[str, Manifest] = {}
    for root in search_roots():
        if not root.is_dir():
            continue
        for path in sorted(root.glob(f"*/{MANIFEST_NAME}")):
            m = read_manifest(path)
            found.setdefault(m.arch, m)
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
    """Kernel whose LaunchPlan this blob takes in its stead (e.g. a FlyDSL decode for ``uq_decode_splitkv``)."""
    priority: int = 0

    @property
    def signature(self) -> dict[str, str]:
        """Visible parameters name -> Triton type, as in :class:`~ultraquant.kernels.specialization.Specialization`."""
        return {p.name: p.type for p in self.params if not p.hidden}

    @property
    def divisible(self) -> tuple[str, ...]:
        """Integer parameters the binary assumes are multiples of 16 (for a Triton blob, its
        ``Specialization.divisible``; the manifest's ``divisible`` field says the same)."""
        return tuple(p.name for p in self.params
                     if not p.hidden and not p.type.startswith("*") and p.divisibility > 1)


def _first(d: dict[str, Any], *names: str, default: Any = None) -> Any:
    for n in names:
        if n in d:
            return d[n]
    return default


def _int(value: Any) -> int:
    """An integer field (JSON numbers only: a bool, a string or a float with a fraction is refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise ValueError(f"expected an integer, got {value!r}")
    return int(value)


def _str(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"expected a non-empty string, got {value!r}")
    return value


def _dict(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"expected an object, got {value!r}")
    return value


def _param(p: Any) -> Param:
    p = _dict(p)
    hidden = p.get("hidden", False)
    if not isinstance(hidden, bool):
        raise ValueError(f"parameter {p.get('name')!r}: 'hidden' is {hidden!r}, not true/false")
    return Param(name=_str(p["name"]), type=_str(p["type"]), size=_int(p["size"]), offset=_int(p["offset"]),
                 hidden=hidden, divisibility=_int(p.get("divisibility", 1)))


def parse_entry(raw: dict[str, Any], arch: str, directory: Path) -> Entry:
    """Normalize one manifest blob entry; raises :class:`UltraQuantError` naming what is missing or of
    the wrong type, or a file name that is not a plain name inside ``directory``."""
    name = (raw.get("key") or raw.get("file") or "?") if isinstance(raw, dict) else "?"
    try:
        raw = _dict(raw)
        kernel = _str(raw["kernel"])
        launch = _dict(raw.get("launch", {}))
        num_warps = _int(_first(raw, "num_warps", default=_first(launch, "num_warps", default=4)))
        raw_params = _first(raw, "params", "parameters")
        if not isinstance(raw_params, list):
            raise ValueError(f"'params' is {raw_params!r}, not a list")
        params = tuple(_param(p) for p in raw_params)
        constexprs = _dict(raw.get("constexprs", {}))
        key = raw.get("key") or _spec_key(kernel, constexprs, {p.name: p.type for p in params if not p.hidden})
        file_name = raw["file"]
        problem = blob_name_problem(file_name)
        if problem:
            raise ValueError(problem)
        sha = _str(raw["sha256"])
        if len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
            raise ValueError(f"sha256 {sha!r} is not 64 lowercase hex digits")
        warp = 64 if arch.startswith("gfx") else 32
        scratch = _dict(raw.get("resources", {}))
        entry = Entry(
            arch=_str(raw.get("arch", arch)),
            op=_str(raw.get("op", kernel)),
            kernel=kernel,
            key=_str(key),
            path=directory / file_name,
            sha256=sha,
            symbol=_str(_first(raw, "symbol", "name")),
            num_warps=num_warps,
            threads=_int(_first(raw, "threads", default=_first(launch, "threads", "block",
                                                                 default=num_warps * warp))),
            shared=_int(_first(raw, "shared", default=_first(launch, "shared", "dynamic_shared", default=0))),
            params=params,
            constexprs=dict(constexprs),
            global_scratch=max([_int(_first(raw, "global_scratch_size", default=_first(
                scratch, "global_scratch_size", default=0)))]
                + [_int(p.get("scratch_bytes", 0)) for p in raw_params]),
            num_ctas=_int(_first(raw, "num_ctas", default=_first(launch, "num_ctas", default=1))),
            alternate_of=str(raw.get("alternate_of") or ""),
            priority=_int(raw.get("priority", 0)),
        )
        if entry.num_warps < 1 or entry.threads < 1 or entry.shared < 0 or entry.num_ctas < 1:
            raise ValueError(f"launch geometry num_warps={entry.num_warps} threads={entry.threads} "
                             f"shared={entry.shared} num_ctas={entry.num_ctas}")
        check_layout(entry.params, entry.key)
        return entry
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise UltraQuantError(f"manifest {directory / MANIFEST_NAME}: blob {name}: bad or missing "
                              f"field {exc}") from None


def _skipped_key(row: dict[str, Any]) -> str | None:
    """Config key of a manifest ``skipped`` row (op + matrix config), or None if it has none."""
    try:
        from ultraquant.kernels.catalog import specializer

        return specializer(row["op"])(**row.get("config", {})).key()
    except Exception:  # an invalid config (the reason it was skipped) has no key
        return None


def _spec_key(kernel: str, constexprs: dict[str, Any], signature: dict[str, str]) -> str:
    from ultraquant.kernels.specialization import Specialization

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
                if m.error:
                    raise UltraQuantError(m.error)
                self.entries[m.arch] = self._read(m)
            except UltraQuantError as exc:
                self.errors[m.arch] = str(exc)
                log.warning("AOT blobs for %s not used: %s", m.arch, exc)

    @staticmethod
    def _read(m: Manifest) -> dict[str, Entry]:
        schema = m.data.get("schema_version")
        if schema != SCHEMA_VERSION:
            raise UltraQuantError(f"manifest {m.directory / MANIFEST_NAME}: schema_version {schema!r}, this "
                                  f"runtime reads {SCHEMA_VERSION} (rebuild with `make kernels`)")
        if not isinstance(m.data.get("blobs", []), list):
            raise UltraQuantError(f"manifest {m.directory / MANIFEST_NAME}: 'blobs' is not a list")
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
                skipped = m.data.get("skipped", [])
                for s in skipped if isinstance(skipped, list) else ():
                    if not isinstance(s, dict):
                        continue
                    k = s.get("key") or _skipped_key(s)
                    if isinstance(k, str) and k:
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
