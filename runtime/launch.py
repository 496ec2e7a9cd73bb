"""The seam between the backend policy and the AOT blobs: :func:`try_launch` and :func:`warmup`.

Per call, :mod:`ultraquant.policy` builds a :class:`~ultraquant.kernels.plans.LaunchPlan` and calls
``try_launch(plan)``. An exact manifest match on ``(device arch, plan.spec.key())`` (or a stand-in
blob whose manifest entry says ``alternate_of`` that kernel) launches the blob and returns ``True``;
anything else returns ``False`` (the policy then runs the Triton JIT kernel) with the reason logged
once per config. The first use of a config on a device does
the slow work once: manifest lookup, signature check, sha256 check, module load, self-test (verdict
cached on disk). Later calls are a dict lookup, an argument pack and one driver call.

Switches (:mod:`ultraquant.config`, parsed once; ``config.reload()`` after changing one):

* ``ULTRAQUANT_BACKEND=auto`` (default): blob if there is one, else Triton, else (CPU tensors) the
  reference. ``aot``: blobs only, never the Triton JIT; a miss raises (saying why).
  ``triton``: never use blobs. ``reference``: neither blobs nor Triton.
* ``ULTRAQUANT_REQUIRE_AOT=1``: in ``auto`` mode too, a miss (or a refused blob) raises instead of
  falling back, for CI of deployments that must never JIT.
* ``ULTRAQUANT_SELFTEST=0``: trust blobs without testing them on this GPU (not recommended).

Graph capture: loading a module or self-testing during CUDA graph capture would break the capture,
so a first use while capturing raises and tells the user to call :func:`warmup` first.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from ultraquant import config
from ultraquant.errors import UltraQuantError
from ultraquant.kernels.catalog import alignable
from ultraquant.kernels.plans import LaunchPlan
from ultraquant.kernels.specialization import ARG_DIVISOR, Specialization

from . import selftest
from .driver import DeviceInfo, device_info
from .loader import BlobError, Kernel, get_kernel
from .manifest import Entry, ManifestIndex
from .packing import MisalignedArgument

log = logging.getLogger("ultraquant.runtime")

@dataclass(frozen=True)
class Miss:
    """Why a config has no usable blob on a device (cached so the reason is computed once)."""

    reason: str


StateKey = tuple[int, str, tuple, tuple, tuple]
_STATE: dict[StateKey, Kernel | Miss] = {}
"""(device, kernel, constexpr items, parameter types, divisible) -> resolution: cheaper to build per call than
the key string (which names the same things)."""
_KEYS: dict[StateKey, str] = {}
_DEVICES: dict[int, DeviceInfo] = {}
_INDEX: ManifestIndex | None = None
_LOGGED: set[tuple[int, str]] = set()
_LOCK = threading.RLock()
_EPOCH = [0]
"""Bumped by :func:`reset`: a :class:`Prepared` launcher holding a kernel from an older epoch resolves again."""


def index() -> ManifestIndex:
    """The manifest index, built on first use from :func:`~.manifest.search_roots`."""
    global _INDEX
    if _INDEX is None:
        with _LOCK:
            if _INDEX is None:
                _INDEX = ManifestIndex.discover()
    return _INDEX


def reset(manifest_index: ManifestIndex | None = None) -> None:
    """Forget resolved configs and the manifest index (tests; after installing new blobs).

    Loaded modules stay loaded (never unloaded: a captured graph may still point at them)."""
    global _INDEX
    with _LOCK:
        _EPOCH[0] += 1
        _STATE.clear()
        _KEYS.clear()
        _LOGGED.clear()
        _INDEX = manifest_index


def device_of(device: Any) -> int:
    """Torch device index of ``device`` (a ``torch.device``, an index, or ``None`` for current)."""
    if isinstance(device, int):
        return device
    idx = getattr(device, "index", None)
    if idx is not None:
        return idx
    import torch

    return torch.cuda.current_device()


def info(dev: int) -> DeviceInfo:
    """Cached :class:`~.driver.DeviceInfo` of device ``dev``."""
    d = _DEVICES.get(dev)
    if d is None:
        d = _DEVICES[dev] = device_info(dev)
    return d


def _note_miss(dev: int, key: str, reason: str, warn: bool) -> Miss:
    miss = Miss(reason)
    if (dev, key) not in _LOGGED:
        _LOGGED.add((dev, key))
        (log.warning if warn else log.info)("AOT miss on cuda:%d for %s: %s", dev, key, reason)
    return miss


def _capturing() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def state_key(spec: Specialization, dev: int) -> StateKey:
    """The per-call lookup key of ``spec`` on ``dev`` (see ``_STATE``)."""
    return dev, spec.kernel, tuple(spec.constexprs.items()), tuple(spec.signature.values()), spec.divisible


def resolve(spec: Specialization, dev: int, *, allow_selftest: bool = True) -> Kernel | Miss:
    """The loaded, self-tested kernel for ``spec`` on device ``dev``, or why there is none.

    First use per (device, config) only; the result is cached. Raises :class:`UltraQuantError`
    if it would have to load a module during CUDA graph capture."""
    skey = state_key(spec, dev)
    st = _STATE.get(skey)
    if st is not None:
        return st
    key = spec.key()
    with _LOCK:
        st = _STATE.get(skey)
        if st is not None:
            return st
        d = info(dev)
        reasons: list[str] = []
        st = None
        for kernel in (*index().alternates(d.arch, spec.kernel), spec.kernel):
            entry, reason, cand = None, "", spec
            for cand in spec.runnable_as(kernel):
                entry, why = index().lookup(d.arch, cand.key())
                if entry is not None:
                    break
                reason = reason or why
            if entry is None:
                if kernel == spec.kernel:  # an alternate that was not built is no news
                    reasons.append(reason + _divisibility_hint(spec, d.arch))
                continue
            if entry.signature != dict(spec.signature):
                ours = [f"{n}:{t}" for n, t in spec.signature.items()]
                theirs = [f"{n}:{t}" for n, t in entry.signature.items()]
                reasons.append(_note_miss(dev, entry.key, f"blob {entry.path.name} takes parameters {theirs}, "
                                          f"this call needs {ours} (other dtypes than were built, or stale "
                                          "blobs)", warn=True).reason)
                continue
            got = _load_and_test(entry, cand, d, allow_selftest)
            if isinstance(got, Kernel):
                st = got
                break
            reasons.append(got.reason)
        if st is None:
            st = _note_miss(dev, key, "; ".join(reasons), warn=False)
        if not selftest.running():  # nested lookups inside a self-test are not final verdicts
            _STATE[skey] = st
            _KEYS[skey] = key
        return st


def _divisibility_hint(spec: Specialization, arch: str) -> str:
    """Why a call missed a blob that exists for the usual strides (the family's ``alignable`` strides), or ``""``."""
    usual = replace(spec, divisible=tuple(n for n in spec.signature if n in alignable(spec.kernel)))
    if usual.divisible == spec.divisible or index().lookup(arch, usual.key())[0] is None:
        return ""
    odd = [n for n in usual.divisible if n not in spec.divisible]
    return (f"; a blob exists for strides that are multiples of {ARG_DIVISOR}, and this call's "
            f"{', '.join(odd)} are not (the Triton JIT serves it)")


def _load_and_test(entry: Entry, spec: Specialization, d: DeviceInfo, allow_selftest: bool) -> Kernel | Miss:
    dev, key = d.index, entry.key
    if _capturing():
        raise UltraQuantError(
            f"UltraQuant kernel {key} is not loaded on cuda:{dev} and the current stream is capturing a "
            "CUDA graph; call ultraquant.warmup(...) for this model's configs (or run one eager step) "
            "before capture")
    cached = selftest.cached(entry, d)
    if cached is not None and not cached.ok:
        return _note_miss(dev, key, f"blob disabled: its self-test failed on this GPU earlier "
                          f"({cached.detail}); delete {selftest.CACHE.path} to retest", warn=True)
    try:
        kernel = get_kernel(entry, dev)
    except BlobError as exc:
        return _note_miss(dev, key, f"blob refused: {exc}", warn=True)
    if cached is None and allow_selftest and config.get().selftest and not selftest.running():
        verdict = selftest.run(kernel, spec, d)
        if not verdict.ok:
            return _note_miss(dev, key, f"blob disabled: self-test failed on {d.name}: {verdict.detail}",
                              warn=True)
    return kernel


def plan_device(plan: LaunchPlan) -> int | None:
    """CUDA/HIP device index of the plan's first tensor argument (``None``: not on a GPU)."""
    for a in plan.args:
        d = getattr(a, "device", None)
        if d is not None:
            return d.index if d.type == "cuda" else None
    return None


def try_launch(plan: LaunchPlan, device: Any = None) -> bool:
    """Launch ``plan`` from an AOT blob if the manifest has exactly this config for the device's arch.

    ``device`` defaults to the device of the plan's first tensor. Returns ``True`` when launched (on
    torch's current stream of that device), ``False`` when the caller must use another path (Triton
    JIT, or the reference); under ``ULTRAQUANT_BACKEND=aot`` or ``ULTRAQUANT_REQUIRE_AOT=1`` a miss
    raises instead. Never synchronizes."""
    dev = device_of(device) if device is not None else plan_device(plan)
    return launch_prepared(plan.spec, None if dev is None else state_key(plan.spec, dev), dev, plan.args, plan.grid)


def launch_prepared(spec: Specialization, skey: StateKey | None, dev: int | None, args: tuple[Any, ...],
                    grid: tuple[int, int, int]) -> bool:
    """:func:`try_launch` of a plan whose device and :func:`state_key` the caller already knows (the
    ops cache both per call signature): the per-call work is one dict lookup and the launch."""
    cfg = config.get()
    if not cfg.uses_blobs:
        return False
    if dev is None:
        if cfg.strict:
            raise UltraQuantError(f"ULTRAQUANT_BACKEND={cfg.backend}/REQUIRE_AOT: {spec.kernel} was called "
                                  "with tensors that are not on a GPU; blobs run on GPUs only")
        return False
    st = _STATE.get(skey)
    if st is None:
        st = resolve(spec, dev)
    if st.__class__ is not Miss:
        try:
            st.launch(args, grid)
            return True
        except MisalignedArgument as exc:
            st = _note_miss(dev, f"{spec.key()} (alignment)", str(exc), warn=False)
    if cfg.strict:
        raise UltraQuantError(f"ULTRAQUANT_BACKEND={cfg.backend}, REQUIRE_AOT={int(cfg.require_aot)}: no usable blob "
                              f"on cuda:{dev}: {st.reason}")
    return False


class Prepared:
    """The AOT launch of one specialization on one device, for a caller that plans once and launches
    many times (the ops' per-signature cache): after the first launch it holds the loaded kernel, so a
    call is the kernel's launch alone, while :func:`reset` or a config change sends it through
    :func:`launch_prepared` (resolution, misses, strict mode) again."""

    __slots__ = ("spec", "skey", "dev", "kernel", "epoch", "config")

    def __init__(self, spec: Specialization, dev: int | None) -> None:
        self.spec, self.dev = spec, dev
        self.skey = None if dev is None else state_key(spec, dev)
        self.kernel: Kernel | None = None
        self.epoch, self.config = -1, None

    def __call__(self, args: tuple[Any, ...], grid: tuple[int, int, int]) -> bool:
        """Launch from the blob (True) or report a miss (False; raises when strict), as :func:`try_launch`."""
        k = self.kernel
        if k is not None and self.epoch == _EPOCH[0] and self.config is config.get():
            try:
                k.launch(args, grid)
                return True
            except MisalignedArgument:  # this call's pointers: launch_prepared words the miss
                pass
        self.epoch, self.config = _EPOCH[0], config.get()
        launched = launch_prepared(self.spec, self.skey, self.dev, args, grid)
        st = _STATE.get(self.skey) if launched else None
        self.kernel = st if isinstance(st, Kernel) else None
        return launched


def warmup(configs: Iterable[Any], device: Any = None) -> dict[str, str]:
    """Load (and self-test) the blobs of ``configs`` on ``device`` before CUDA graph capture.

    ``configs`` holds :class:`~ultraquant.kernels.specialization.Specialization` or
    :class:`~ultraquant.kernels.specialization.LaunchPlan` objects (``ultraquant.warmup`` also takes
    model-config dicts: :func:`ultraquant.policy.warmup`). Returns config key -> ``"aot"`` or the miss
    reason. Under ``ULTRAQUANT_REQUIRE_AOT=1`` a miss raises."""
    dev = device_of(device)
    report: dict[str, str] = {}
    for spec in _specs(configs):
        st = resolve(spec, dev)
        report[spec.key()] = "aot" if isinstance(st, Kernel) else st.reason
        cfg = config.get()
        if cfg.strict and isinstance(st, Miss):
            raise UltraQuantError(f"ULTRAQUANT_BACKEND={cfg.backend}, REQUIRE_AOT={int(cfg.require_aot)}: no "
                                  f"usable blob on cuda:{dev}: {st.reason}")
    return report


def _specs(configs: Iterable[Any]) -> Iterable[Specialization]:
    for c in configs:
        if isinstance(c, Specialization):
            yield c
        elif isinstance(c, LaunchPlan):
            yield c.spec
        else:
            raise UltraQuantError("configs: expected Specialization, LaunchPlan or dict, got "
                                  f"{type(c).__name__}")


def state() -> dict[tuple[int, str], Kernel | Miss]:
    """Snapshot of the resolved (device, config key) -> kernel or miss (tests, ``verify``); where
    calls of one key differ in dtypes, one of them."""
    return {(k[0], _KEYS[k]): st for k, st in _STATE.items()}
