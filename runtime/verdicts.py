"""The on-disk cache of blob self-test verdicts, in the user's cache directory.

A verdict is keyed by (manifest key, blob sha256, self-test version, device name, driver version,
device uuid): the key names the config the blob was tested *as* (the same bytes listed under another
key are tested again under that key: a blob built for one encoder under another encoder's key fails
there), the sha256 the bytes, the version the problems they were tested with (bumped whenever
``runtime/problems.py`` changes), and a new driver, another GPU model or each physical GPU (a faulty
card gets its own verdict) gets tested again. The file is JSON, rewritten atomically (temp file +
rename) so concurrent processes never read half a file; the last writer wins per key.

Location: ``$ULTRAQUANT_CACHE_DIR``, else ``$XDG_CACHE_HOME/ultraquant``, else ``~/.cache/ultraquant``.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ultraquant import config

from .driver import DeviceInfo

FILE_NAME = "selftest-v2.json"
"""v2: keys bind the manifest key and the self-test version too (v1 keys named the sha256 only)."""


@dataclass(frozen=True)
class Verdict:
    """Outcome of one blob's self-test on one device."""

    ok: bool
    detail: str
    seconds: float = 0.0
    when: float = 0.0


def cache_dir() -> Path:
    """The folder holding UltraQuant's per-user caches (not created here)."""
    explicit = config.get().cache_dir
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "ultraquant"


def verdict_key(key: str, sha256: str, version: int, dev: DeviceInfo) -> str:
    """Cache key of one blob tested as manifest ``key`` with self-test ``version`` on a device."""
    return f"{key}|{sha256}|v{version}|{dev.name}|{dev.driver_version}|{dev.uuid}"


class VerdictCache:
    """Read-through, write-through cache of self-test verdicts (thread safe)."""

    def __init__(self, path: Path | None = None) -> None:
        self._explicit = path
        self._lock = threading.Lock()
        self._data: dict[str, dict] | None = None
        self._loaded_from: Path | None = None

    @property
    def path(self) -> Path:
        """The JSON file: the one given, else ``cache_dir()/selftest-v1.json`` (env read each time)."""
        return self._explicit if self._explicit is not None else cache_dir() / FILE_NAME

    def _load(self) -> dict[str, dict]:
        if self._data is None or self._loaded_from != self.path:
            self._loaded_from = self.path
            try:
                data = json.loads(self.path.read_text())
                self._data = data if isinstance(data, dict) else {}
            except (OSError, ValueError):
                self._data = {}
        return self._data

    def get(self, key: str, sha256: str, version: int, dev: DeviceInfo) -> Verdict | None:
        """The cached verdict, or ``None`` when this blob was never tested as ``key`` with self-test
        ``version`` on this device."""
        with self._lock:
            raw = self._load().get(verdict_key(key, sha256, version, dev))
        if not isinstance(raw, dict):
            return None
        try:
            return Verdict(ok=bool(raw["ok"]), detail=str(raw.get("detail", "")),
                           seconds=float(raw.get("seconds", 0.0)), when=float(raw.get("when", 0.0)))
        except (KeyError, TypeError, ValueError):
            return None

    def put(self, key: str, sha256: str, version: int, dev: DeviceInfo, verdict: Verdict) -> None:
        """Record ``verdict``; merges with what other processes wrote meanwhile. A read-only or
        missing cache dir is not an error: the verdict then lives for this process only."""
        record = asdict(verdict)
        record["when"] = record["when"] or time.time()
        with self._lock:
            data = dict(self._load())
            try:
                on_disk = json.loads(self.path.read_text())
                if isinstance(on_disk, dict):
                    data.update(on_disk)
            except (OSError, ValueError):
                pass
            data[verdict_key(key, sha256, version, dev)] = record
            self._data = data
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(prefix=".selftest-", dir=self.path.parent)
                with os.fdopen(fd, "w") as f:
                    json.dump(data, f, indent=1, sort_keys=True)
                os.replace(tmp, self.path)
            except OSError:
                pass

    def clear(self) -> None:
        """Forget every verdict (memory and disk)."""
        with self._lock:
            self._data = {}
            try:
                self.path.unlink()
            except OSError:
                pass
