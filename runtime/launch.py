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
from dataclasses import dataclass
from typing import Any

from ultraquant import config
from ultraquant.errors import UltraQuantError
from ultraquant.kernels.plans import LaunchPlan
from ultraquant.kernels.specs import Specialization

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


StateKey = tuple[int, str, tuple, tuple]
_STATE: dict[StateKey, Kernel | Miss] = {}
"""(device, kernel, constexpr items, parameter types) -> resolution: cheaper to build per call than
the key string (which names the same things)."""
_KEYS: dict[StateKey, str] = {}
_DEVICES: dict[int, DeviceInfo] = {}
_INDEX: ManifestIndex | None = None
_LOGGED: set[tuple[int, str]] = set()
_LOCK = threading.RLock()


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
    return dev, spec.kernel, tuple(spec.constexprs.items()), tuple(spec.signature.values())


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
            cand = spec if kernel == spec.kernel else Specialization(
                kernel=kernel, signature=dict(spec.signature), constexprs=dict(spec.constexprs))
            entry, reason = index().lookup(d.arch, cand.key())
            if entry is None:
                if kernel == spec.kernel:  # an alternate that was not built is no news
                    reasons.append(reason)
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


def _load_and_test(entry: Entry, spec: Specialization, d: DeviceInfo, allow_selftest: bool) -> Kernel | Miss:
    dev, key = d.index, entry.key
    if _capturing():
        raise UltraQuantError(
            f"UltraQuant kernel {key} is not loaded on cuda:{dev} and the current stream is capturing a "
            "CUDA graph; call ultraquant.warmup(...) for this model's configs (or run one eager step) "
            "before capture")
    cached = selftest.CACHE.get(entry.sha256, d)
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


def _strict(cfg: config.Config) -> bool:
    return cfg.backend == "aot" or cfg.require_aot


def try_launch(plan: LaunchPlan, device: Any = None) -> bool:
    """Launch ``plan`` from an AOT blob if the manifest has exactly this config for the device's arch.

    ``device`` defaults to the device of the plan's first tensor. Returns ``True`` when launched (on
    torch's current stream of that device), ``False`` when the caller must use another path (Triton
    JIT, or the reference); under ``ULTRAQUANT_BACKEND=aot`` or ``ULTRAQUANT_REQUIRE_AOT=1`` a miss
    raises instead. Never synchronizes."""
    cfg = config.get()
    if cfg.backend == "triton" or cfg.backend == "reference":
        return False
    dev = device_of(device) if device is not None else plan_device(plan)
    if dev is None:
        if _strict(cfg):
            raise UltraQuantError(f"ULTRAQUANT_BACKEND={cfg.backend}/REQUIRE_AOT: {plan.spec.kernel} was called "
                                  "with tensors that are not on a GPU; blobs run on GPUs only")
        return False
    st = _STATE.get(state_key(plan.spec, dev))
    if st is None:
        st = resolve(plan.spec, dev)
    if isinstance(st, Kernel):
        try:
            st.launch(plan.args, plan.grid)
            return True
        except MisalignedArgument as exc:
            st = _note_miss(dev, f"{plan.spec.key()} (alignment)", str(exc), warn=False)
    if _strict(cfg):
        raise UltraQuantError(f"ULTRAQUANT_BACKEND={cfg.backend}, REQUIRE_AOT={int(cfg.require_aot)}: no usable blob "
                              f"on cuda:{dev}: {st.reason}")
    return False


def warmup(configs: Iterable[Any], device: Any = None) -> dict[str, str]:
    """Load (and self-test) every blob a model needs on ``device`` before CUDA graph capture.

    ``configs`` holds :class:`~ultraquant.kernels.specs.Specialization` or
    :class:`~ultraquant.kernels.plans.LaunchPlan` objects, or dicts of model parameters that
    :func:`model_specializations` turns into them. Returns config key ->
    ``"aot"`` or the miss reason. Under ``ULTRAQUANT_REQUIRE_AOT=1`` a miss raises."""
    dev = device_of(device)
    report: dict[str, str] = {}
    for spec in _specs(configs):
        st = resolve(spec, dev)
        report[spec.key()] = "aot" if isinstance(st, Kernel) else st.reason
        cfg = config.get()
        if _strict(cfg) and isinstance(st, Miss):
            raise UltraQuantError(f"ULTRAQUANT_BACKEND={cfg.backend}, REQUIRE_AOT={int(cfg.require_aot)}: no "
                                  f"usable blob on cuda:{dev}: {st.reason}")
    return report


def _specs(configs: Iterable[Any]) -> Iterable[Specialization]:
    for c in configs:
        if isinstance(c, Specialization):
            yield c
        elif isinstance(c, LaunchPlan):
            yield c.spec
        elif isinstance(c, dict):
            yield from model_specializations(c)
        else:
            raise UltraQuantError("configs: expected Specialization, LaunchPlan or dict, got "
                                  f"{type(c).__name__}")


def model_specializations(config: dict[str, Any]) -> list[Specialization]:
    """Every kernel variant a model config needs: ``head_size``, ``block_size``, ``gqa`` (or
    ``num_q_heads`` and ``num_kv_heads``), optional ``dtype`` (for all tensors) or per-tensor dtypes,
    ``has_sinks``/``has_window``/``has_softcap``, ``encoder``, and ``ops`` (default: all four)."""
    from ultraquant.kernels.specs import SPECIALIZERS

    cfg = dict(config)
    dtype = cfg.pop("dtype", None)
    if dtype is not None:
        for name in ("key_dtype", "query_dtype", "out_dtype"):
            cfg.setdefault(name, dtype)
    if "gqa" not in cfg and "num_q_heads" in cfg and "num_kv_heads" in cfg:
        cfg["gqa"] = int(cfg["num_q_heads"]) // int(cfg["num_kv_heads"])
    ops = cfg.pop("ops", tuple(SPECIALIZERS))
    out = []
    for op in ops:
        if op not in SPECIALIZERS:
            raise UltraQuantError(f"configs: unknown op {op!r} (ops are {', '.join(SPECIALIZERS)})")
        try:
            out.append(SPECIALIZERS[op](**cfg))
        except TypeError as exc:
            raise UltraQuantError(f"configs: {op} needs more of the model config ({exc})") from None
    return out


def state() -> dict[tuple[int, str], Kernel | Miss]:
    """Snapshot of the resolved (device, config key) -> kernel or miss (tests, ``verify``); where
    calls of one key differ in dtypes, one of them."""
    return {(k[0], _KEYS[k]): st for k, st in _STATE.items()}
