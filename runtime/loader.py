"""Blob loading: sha256 check, one module per (device, blob) loaded once and never unloaded, launch.

A :class:`Kernel` is one blob loaded on one device. Its ``launch`` packs the arguments per the
manifest, reads the caller's current stream for that device and enqueues the launch: no
synchronization, no device allocation, nothing that graph capture forbids.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from typing import Any

from .driver import Driver, get_driver
from .manifest import Entry
from .packing import ArgPacker


class BlobError(RuntimeError):
    """A blob cannot be used (unreadable, wrong sha256, unsupported launch feature, load failure)."""


_IMAGES: dict[str, bytes] = {}
_MODULES: dict[tuple[int, str], tuple[int, int]] = {}
"""(device, blob sha256) -> (module, function): one module per device and blob, never unloaded."""
_KERNELS: dict[tuple[int, str, str], Kernel] = {}
"""(device, config key, blob sha256) -> Kernel (two keys may share identical blob bytes)."""
_LOCK = threading.RLock()


def read_blob(entry: Entry) -> bytes:
    """The blob's bytes, checked against the manifest's sha256 (once per process per blob)."""
    image = _IMAGES.get(entry.sha256)
    if image is not None:
        return image
    try:
        real = entry.path.resolve()
        inside = real.parent == entry.path.parent.resolve()
    except (OSError, RuntimeError) as exc:  # RuntimeError: a link loop (Python < 3.13)
        raise BlobError(f"{entry.key}: cannot resolve {entry.path}: {exc}") from None
    if not inside:  # a link out of the blob folder
        raise BlobError(f"{entry.key}: {entry.path.name} resolves to {real}, outside the blob folder "
                        f"{entry.path.parent}")
    try:
        image = entry.path.read_bytes()
    except OSError as exc:
        raise BlobError(f"{entry.key}: cannot read {entry.path}: {exc}") from None
    digest = hashlib.sha256(image).hexdigest()
    if digest != entry.sha256:
        raise BlobError(f"{entry.key}: {entry.path.name} has sha256 {digest[:16]}..., the manifest "
                        f"says {entry.sha256[:16]}... (corrupted or stale blob)")
    _IMAGES[entry.sha256] = image
    return image


def _raw_stream_getter():
    import torch

    fast = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if fast is not None:
        return fast
    return lambda device: torch.cuda.current_stream(device).cuda_stream


class Kernel:
    """One manifest blob loaded on one device, ready to launch."""

    def __init__(self, entry: Entry, device: int, driver: Driver | None = None) -> None:
        if entry.global_scratch:
            raise BlobError(f"{entry.key}: needs {entry.global_scratch} B of global scratch per launch, "
                            "which the ctypes launcher does not allocate")
        if entry.num_ctas != 1:
            raise BlobError(f"{entry.key}: uses thread-block clusters (num_ctas={entry.num_ctas}), "
                            "which the ctypes launcher does not set up")
        self.entry = entry
        self.device = device
        self.driver = driver if driver is not None else get_driver()
        self.packer = ArgPacker(entry.params, entry.key)
        self.threads = entry.threads
        self.shared = entry.shared
        self.module, self.function = _module(entry, device, self.driver)
        self._stream = _raw_stream_getter()

    def launch(self, args: Sequence[Any], grid: tuple[int, int, int], stream: int | None = None) -> None:
        """Enqueue one launch with the plan's ``args`` on ``stream`` (default: torch's current stream
        of this kernel's device)."""
        ptrs = self.packer.pack(args)
        if grid[0] * grid[1] * grid[2] == 0:
            return
        if stream is None:
            stream = self._stream(self.device)
        self.driver.launch(self.device, self.function, grid, self.threads, self.shared, stream, ptrs)

    def __repr__(self) -> str:
        return f"Kernel({self.entry.key} on device {self.device}, module {self.module:#x})"


def _module(entry: Entry, device: int, driver: Driver) -> tuple[int, int]:
    """Load ``entry``'s blob on ``device`` once (sha256-checked); its (module, function) handles."""
    with _LOCK:
        got = _MODULES.get((device, entry.sha256))
        if got is None:
            image = read_blob(entry)
            try:
                module = driver.load_module(device, image)
                function = driver.get_function(device, module, entry.symbol)
                driver.prepare_function(device, function, entry.shared)
            except RuntimeError as exc:
                raise BlobError(f"{entry.key}: loading on device {device} failed: {exc}") from None
            got = _MODULES[(device, entry.sha256)] = (module, function)
        return got


def get_kernel(entry: Entry, device: int) -> Kernel:
    """The kernel of ``entry`` on ``device``, loading its module on first use (thread safe)."""
    k = _KERNELS.get((device, entry.key, entry.sha256))
    if k is None:
        with _LOCK:
            k = _KERNELS.get((device, entry.key, entry.sha256))
            if k is None:
                k = _KERNELS[(device, entry.key, entry.sha256)] = Kernel(entry, device)
    return k


def loaded_modules() -> dict[tuple[int, str], tuple[int, int]]:
    """Snapshot of (device, blob sha256) -> (module, function) handles (tests, diagnostics)."""
    return dict(_MODULES)


def forget() -> None:
    """Drop every cached image, module handle and kernel, as a new process would start (tests).

    The driver modules themselves stay loaded (a captured graph may still launch them)."""
    with _LOCK:
        _IMAGES.clear()
        _MODULES.clear()
        _KERNELS.clear()
