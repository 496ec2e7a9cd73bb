"""The AOT build: matrix -> Specializations -> parallel compiles in subprocesses -> checked blobs +
``manifest.json`` per arch under ``generated/<arch>/``.

- Incremental: each compile's inputs (backend, toolchain versions, kernel source hash, arch,
  Specialization) hash to a ``build_hash``; the binary and the compiler's info are cached under
  ``.build/cache/<arch>/<build_hash>.*`` and reused when nothing changed. Failed builds keep the
  successful compiles in the cache.
- Deterministic: blob names derive from the config key, the manifest is canonical JSON, binaries
  carry no paths (see the backends), and the output folder is assembled from the cache in key order.
- Strict: a worker that dies, a compile that raises, any ``error:`` in a compiler's output, a
  duplicate key, a parameter layout the binary does not confirm, or a blob ``verify`` would reject
  fails the build (every failure listed, the output folder left as it was).
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import re
import select
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ultraquant.errors import UltraQuantError
from ultraquant.kernels.abi import type_size
from ultraquant.kernels.specialization import Specialization

from . import manifest as mf
from .archs import Arch
from .backends import Backend, load_backend
from .elf import read_code_object
from .matrix import OPS, SKIPS, Config, MatrixPoint, OpRow, Selection, Skip, expand
from .verify import check_blob
from .worker import RESULT_FD_ENV

ERROR_RE = re.compile(r"error:", re.IGNORECASE)
"""Any match in a compiler's output fails that compile (FlyDSL/LLVM print errors and go on)."""

_INFO_KEYS = {"symbol", "threads", "num_warps", "num_stages", "num_ctas", "shared", "hidden", "divisibility",
              "isa"}


class BuildError(UltraQuantError):
    """The build failed; the message lists every failing config."""


@dataclass
class BuildOptions:
    """What to build and where."""

    archs: Sequence[Arch]
    selection: Selection = field(default_factory=Selection)
    out_dir: Path = Path("generated")
    cache_dir: Path | None = Path(".build/cache")
    jobs: int = 0
    """Parallel compile workers; 0 = one per CPU core."""
    rows: Sequence[OpRow] = OPS
    skips: Sequence[Skip] = SKIPS
    backend_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    python: str = sys.executable
    timeout_s: float = 1800.0
    """Per compile; a worker past it is killed and the config fails."""
    extra_env: dict[str, str] = field(default_factory=dict)
    timings: Path | None = None
    """If set, one JSON line per compile (arch, op, key, seconds, ok) is appended to this file."""
    progress: Callable[[int, str], Any] | None = None
    """Called with (total, label) once, then returns an update(n) callable; None = silent."""


@dataclass
class ArchResult:
    """What one arch's build produced."""

    arch: str
    directory: Path
    blobs: int
    compiled: int
    cached: int
    skipped: int
    bytes: int


@dataclass
class _Job:
    arch: Arch
    point: MatrixPoint
    spec: Specialization
    backend: Backend
    build_hash: str
    info: dict[str, Any] | None = None
    binary: bytes | None = None
    error: str = ""
    seconds: float = 0.0


def blob_file_name(spec: Specialization, arch: Arch) -> str:
    """Stable, short file name of one blob: kernel name + a hash of the config key."""
    digest = hashlib.sha256(spec.key().encode()).hexdigest()[:16]
    return f"{spec.kernel}-{digest}.{arch.ext}"


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def _spec_dict(spec: Specialization) -> dict[str, Any]:
    return {"kernel": spec.kernel, "signature": dict(spec.signature), "constexprs": dict(spec.constexprs),
            "num_warps": spec.num_warps, "num_stages": spec.num_stages,
            **({} if spec.maxnreg is None else {"maxnreg": spec.maxnreg}),
            **({"divisible": list(spec.divisible)} if spec.divisible else {})}


# --- worker pool ------------------------------------------------------------------------------------

class _Worker:
    """One compile subprocess; restarted after a crash or a timeout."""

    def __init__(self, python: str, env: dict[str, str], tmp: Path, index: int) -> None:
        self.python, self.env, self.tmp, self.index = python, env, tmp, index
        self.proc: subprocess.Popen | None = None
        self.results = None
        self.starts = 0

    def _start(self) -> None:
        self.starts += 1
        read_fd, write_fd = os.pipe()
        cache = self.tmp / f"triton-cache-{self.index}-{self.starts}"
        # Blobs are compiled for real even when the caller runs kernels in Triton's interpreter.
        inherited = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env = {**inherited, **self.env, RESULT_FD_ENV: str(write_fd), "TRITON_CACHE_DIR": str(cache),
               "PYTHONUNBUFFERED": "1"}
        self.log_path = self.tmp / f"worker-{self.index}-{self.starts}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([self.python, "-m", "ultraquant.codegen.worker"],
                                         stdin=subprocess.PIPE, stdout=log, stderr=log, env=env,
                                         pass_fds=(write_fd,), text=True)
        os.close(write_fd)
        self.results = os.fdopen(read_fd, "r")

    def stop(self) -> None:
        if self.proc is not None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
            self.results.close()
            self.proc = None

    def _kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.results.close()
            self.proc = None

    def run(self, job: dict[str, Any], timeout: float) -> tuple[dict[str, Any] | None, str]:
        """Send one job; (result or None if the worker died/hung, why)."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        try:
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
        except OSError:
            self._kill()
            return None, f"worker did not accept the job; its log: {_tail(self.log_path)}"
        ready, _, _ = select.select([self.results], [], [], timeout)
        line = self.results.readline() if ready else ""
        if not line:
            why = "timed out" if not ready else f"died (exit {self.proc.poll()})"
            self._kill()
            return None, f"compile worker {why}; worker log: {_tail(self.log_path)}"
        return json.loads(line), ""


def _tail(path: Path, n: int = 1500) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return "(no log)"
    return text[-n:].strip() or "(empty)"


# --- entries ----------------------------------------------------------------------------------------

def make_entry(job: _Job, file_name: str) -> dict[str, Any]:
    """The manifest entry of one compiled blob, cross-checked against the binary's own metadata."""
    spec, info, arch, binary = job.spec, job.info or {}, job.arch, job.binary or b""
    obj = read_code_object(binary)
    kernel = obj.kernels.get(info["symbol"])
    if kernel is None:
        raise UltraQuantError(f"binary has no kernel {info['symbol']!r} (has {', '.join(obj.kernels)})")
    declared = [(n, t, False, {}) for n, t in spec.signature.items()]
    declared += [(h["name"], h["type"], True, h) for h in info.get("hidden", [])]
    actual = [p for p in kernel.params if not p.kind.startswith("hidden_")]
    if len(actual) != len(declared):
        raise UltraQuantError(f"the binary has {len(actual)} parameters, the signature + hidden "
                              f"parameters give {len(declared)}: {[d[0] for d in declared]}")
    params = []
    offset = 0
    divisibility = info.get("divisibility", {})
    for (name, ty, hidden, extra), p in zip(declared, actual, strict=True):
        size = type_size(ty)
        offset = (offset + size - 1) // size * size
        if (p.offset, p.size) != (offset, size):
            raise UltraQuantError(f"parameter {name} ({ty}): expected offset {offset} size {size}, "
                                  f"the binary says offset {p.offset} size {p.size}")
        entry = {"name": name, "type": ty, "size": size, "offset": offset, "hidden": hidden,
                 "divisibility": int(divisibility.get(name, 1))}
        if hidden:
            entry["scratch_bytes"] = int(extra.get("scratch_bytes", 0))
            entry["scratch_align"] = int(extra.get("scratch_align", 1))
        params.append(entry)
        offset += size
    resources = dict(kernel.resources)
    for h in info.get("hidden", []):
        resources[f"{h['name']}_size"] = int(h.get("scratch_bytes", 0))
    resources.setdefault("global_scratch_size", 0)
    kernarg = kernel.resources.get("kernarg_size") or kernel.resources.get("param_bytes") or offset
    entry = {
        "op": job.point.row.op,
        "backend": job.backend.name,
        "kernel": spec.kernel,
        "key": spec.key(),
        "alternate_of": job.point.row.alternate_of,
        "priority": job.point.row.priority,
        "config": job.point.config,
        "constexprs": dict(spec.constexprs),
        "divisible": list(spec.divisible),
        "arch": arch.name,
        "file": file_name,
        "size": len(binary),
        "sha256": hashlib.sha256(binary).hexdigest(),
        "symbol": info["symbol"],
        "launch": {"grid": job.point.row.grid, "threads": int(info["threads"]),
                   "num_warps": int(info.get("num_warps", spec.num_warps)),
                   "num_stages": int(info.get("num_stages", spec.num_stages)),
                   "num_ctas": int(info.get("num_ctas", 1)), "shared": int(info.get("shared", 0))},
        "params": params,
        "kernarg_size": int(kernarg),
        "resources": resources,
        "allow_spills": job.point.allows_spills()[0],
        "spill_budget": job.point.allows_spills()[1],
        "build_hash": job.build_hash,
        **({"isa": info["isa"]} if "isa" in info else {}),  # backend ISA record (FlyDSL: MFMA, waves)
    }
    extra = {k: v for k, v in info.items() if k not in _INFO_KEYS}
    if extra:
        entry["compiler"] = extra  # backend-specific records (e.g. FlyDSL's ISA summary)
    if arch.is_amd:
        entry["code_object_version"] = obj.abi_version + 2
        entry["target"] = obj.target
    else:
        entry["elf_abi_version"] = obj.abi_version
    problems = check_blob(entry, binary, arch)
    if problems:
        raise UltraQuantError("; ".join(problems))
    return entry


# --- the build --------------------------------------------------------------------------------------

def _plan_arch(opts: BuildOptions, arch: Arch, backends: dict[str, Backend],
               errors: list[str]) -> tuple[list[_Job], list[dict[str, Any]], dict[str, Any]]:
    usable = [n for n, b in backends.items() if b.targets(arch)]
    points, skipped = expand(opts.rows, opts.selection, arch.name, usable, opts.skips)
    toolchain = {n: backends[n].toolchain(arch) for n in sorted({p.row.backend for p in points})}
    sources = {n: backends[n].source_hash() for n in toolchain}
    jobs: list[_Job] = []
    seen: dict[str, Config] = {}
    for point in points:
        backend = backends[point.row.backend]
        try:
            spec = backend.specialize(point.row.op, dict(point.config))
        except UltraQuantError as exc:
            errors.append(f"{arch.name} {point.row.op} {point.config}: {exc}")
            continue
        key = spec.key()
        if key in seen:
            errors.append(f"{arch.name}: duplicate key {key} from configs {seen[key]} and {point.config}")
            continue
        seen[key] = point.config
        build_hash = hashlib.sha256(_canonical({
            "schema": mf.SCHEMA_VERSION, "backend": backend.name, "options": backend.options,
            "toolchain": toolchain[backend.name], "source": sources[backend.name], "arch": arch.name,
            "spec": _spec_dict(spec)}).encode()).hexdigest()
        jobs.append(_Job(arch, point, spec, backend, build_hash))
    header = {"toolchain": toolchain, "source_hash": sources}
    return jobs, skipped, header



def _cache_paths(opts: BuildOptions, job: _Job) -> tuple[Path, Path] | None:
    if opts.cache_dir is None:
        return None
    d = Path(opts.cache_dir) / job.arch.name
    return d / f"{job.build_hash}.bin", d / f"{job.build_hash}.json"


def _load_cached(opts: BuildOptions, job: _Job) -> bool:
    paths = _cache_paths(opts, job)
    if paths is None or not (paths[0].is_file() and paths[1].is_file()):
        return False
    try:
        info = json.loads(paths[1].read_text())
        binary = paths[0].read_bytes()
    except (OSError, json.JSONDecodeError):
        return False
    if hashlib.sha256(binary).hexdigest() != info.pop("_sha256", None):
        return False  # a torn or tampered cache entry: recompile
    job.info, job.binary = info, binary
    return True


def _store_cached(opts: BuildOptions, job: _Job) -> None:
    paths = _cache_paths(opts, job)
    if paths is None:
        return
    paths[0].parent.mkdir(parents=True, exist_ok=True)
    info = dict(job.info or {}, _sha256=hashlib.sha256(job.binary or b"").hexdigest())
    for path, data in ((paths[0], job.binary or b""), (paths[1], mf.dumps(info).encode())):
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        tmp.write_bytes(data)
        tmp.replace(path)


def _compile_all(opts: BuildOptions, jobs: list[_Job], tmp: Path) -> None:
    """Run ``jobs`` on a pool of worker subprocesses, filling each job's binary/info or error."""
    if not jobs:
        return
    env = dict(opts.extra_env)
    for job in jobs:
        env.update(job.backend.worker_env(job.arch))
    n_workers = max(1, min(opts.jobs or os.cpu_count() or 1, len(jobs)))
    todo: queue.Queue = queue.Queue()
    for i, job in enumerate(jobs):
        todo.put((i, job))
    done: queue.Queue = queue.Queue()

    def serve(index: int) -> None:
        worker = _Worker(opts.python, env, tmp, index)
        try:
            while True:
                try:
                    i, job = todo.get_nowait()
                except queue.Empty:
                    return
                out = tmp / f"job-{i}.bin"
                log = tmp / f"job-{i}.log"
                payload = {"backend": job.backend.name, "backend_options": job.backend.options,
                           "arch": job.arch.name, "spec": _spec_dict(job.spec), "out": str(out),
                           "log": str(log)}
                res, why = worker.run(payload, opts.timeout_s)
                text = _tail(log, 4000) if log.exists() else ""
                job.seconds = float((res or {}).get("seconds", 0.0))
                if res is None:
                    job.error = f"{why}\n{text}".strip()
                elif not res.get("ok"):
                    job.error = f"{res.get('error')}\n{text}".strip()
                elif ERROR_RE.search(text):
                    job.error = f"the compiler printed an error:\n{text}"
                else:
                    job.info = res["info"]
                    job.binary = out.read_bytes()
                    _store_cached(opts, job)  # as it lands: an interrupted build keeps its work
                done.put(i)
        finally:
            worker.stop()

    timings = None
    if opts.timings is not None:
        Path(opts.timings).parent.mkdir(parents=True, exist_ok=True)
        timings = open(opts.timings, "a")  # noqa: SIM115  (closed below, after the last result)
    threads = [threading.Thread(target=serve, args=(k,), daemon=True) for k in range(n_workers)]
    for t in threads:
        t.start()
    update = opts.progress(len(jobs), "compiling") if opts.progress else None
    try:
        for _ in range(len(jobs)):
            j = jobs[done.get()]
            if timings:
                timings.write(json.dumps({"arch": j.arch.name, "op": j.point.row.op, "key": j.spec.key(),
                                          "seconds": j.seconds, "ok": not j.error,
                                          "bytes": len(j.binary or b"")}) + "\n")
                timings.flush()
            if update:
                update(1)
    finally:
        if timings:
            timings.close()
    for t in threads:
        t.join()


def _assemble(opts: BuildOptions, arch: Arch, jobs: list[_Job], skipped: list[dict[str, Any]],
              header: dict[str, Any]) -> ArchResult:
    out = Path(opts.out_dir) / arch.name
    out.mkdir(parents=True, exist_ok=True)
    entries = []
    files = set()
    total = 0
    for job in sorted(jobs, key=lambda j: j.spec.key()):
        name = blob_file_name(job.spec, arch)
        entries.append(make_entry(job, name))
        files.add(name)
        path = out / name
        if not path.is_file() or path.read_bytes() != job.binary:
            tmp = path.with_name(name + ".tmp")
            tmp.write_bytes(job.binary or b"")
            tmp.replace(path)
        total += len(job.binary or b"")
    for stale in out.iterdir():
        if stale.is_file() and stale.suffix == f".{arch.ext}" and stale.name not in files:
            stale.unlink()
    manifest = {
        "schema_version": mf.SCHEMA_VERSION,
        "generator": "ultraquant.codegen",
        "arch": arch.name,
        "target": {"vendor": arch.vendor, "warp_size": arch.warp_size, "elf_machine": arch.elf_machine,
                   "elf_processor": arch.elf_processor},
        **header,
        "selection": opts.selection.as_dict(),
        "blobs": entries,
        "skipped": sorted(skipped, key=_canonical),
    }
    mf.write(out, manifest)
    return ArchResult(arch.name, out, len(entries), 0, 0, len(skipped), total)


def _load_backends(opts: BuildOptions) -> dict[str, Backend]:
    backends: dict[str, Backend] = {}
    for r in opts.rows:
        if r.backend not in backends and any(r.archs is None or a.name in r.archs for a in opts.archs):
            backends[r.backend] = load_backend(r.backend, opts.backend_options.get(r.backend, {}))
    return backends


def dry_run(opts: BuildOptions) -> list[dict[str, Any]]:
    """What :func:`build` would do, without compiling: per arch the configs per op, how many the
    cache already holds, and the skipped configs grouped by reason."""
    backends = _load_backends(opts)
    errors: list[str] = []
    out = []
    for arch in opts.archs:
        jobs, skipped, _header = _plan_arch(opts, arch, backends, errors)
        per_op: dict[str, int] = {}
        for j in jobs:
            per_op[j.point.row.op] = per_op.get(j.point.row.op, 0) + 1
        reasons: dict[str, int] = {}
        for s in skipped:
            reasons[s["reason"]] = reasons.get(s["reason"], 0) + 1
        cached = sum(1 for j in jobs if _load_cached(opts, j))
        out.append({"arch": arch.name, "blobs": len(jobs), "per_op": per_op, "cached": cached,
                    "skipped": reasons})
    if errors:
        raise BuildError("matrix errors:\n  " + "\n  ".join(errors))
    return out


def build(opts: BuildOptions) -> list[ArchResult]:
    """Build every arch of ``opts``; raises :class:`BuildError` listing all failures."""
    backends = _load_backends(opts)
    errors: list[str] = []
    plans = [(arch, *_plan_arch(opts, arch, backends, errors)) for arch in opts.archs]
    if errors:
        raise BuildError("matrix errors:\n  " + "\n  ".join(errors))
    to_compile: list[_Job] = []
    cached: dict[str, int] = {}
    for arch, jobs, _skipped, _header in plans:
        for job in jobs:
            if _load_cached(opts, job):
                cached[arch.name] = cached.get(arch.name, 0) + 1
            else:
                to_compile.append(job)
    with tempfile.TemporaryDirectory(prefix="uq-codegen-") as tmp:
        _compile_all(opts, to_compile, Path(tmp))
    for _arch, jobs, _skipped, _header in plans:
        for job in jobs:
            if not job.error:
                try:
                    make_entry(job, blob_file_name(job.spec, job.arch))
                except UltraQuantError as exc:
                    job.error = str(exc)
    failed = [j for _a, jobs, _s, _h in plans for j in jobs if j.error]
    if failed:
        lines = [f"{j.arch.name} {j.spec.key()}:\n    " + j.error.replace("\n", "\n    ") for j in failed]
        total = sum(len(p[1]) for p in plans)
        raise BuildError(f"{len(failed)} of {total} blobs failed:\n" + "\n".join(lines))
    results = []
    for arch, jobs, skipped, header in plans:
        r = _assemble(opts, arch, jobs, skipped, header)
        r.cached = cached.get(arch.name, 0)
        r.compiled = len(jobs) - r.cached
        results.append(r)
    return results


def clean_cache(cache_dir: Path) -> None:
    """Drop the incremental cache (the next build recompiles everything)."""
    shutil.rmtree(cache_dir, ignore_errors=True)
