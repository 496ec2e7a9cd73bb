"""Compile worker: a subprocess that compiles jobs one at a time for the build process.

Why a subprocess: LLVM assertion failures abort the whole process, and a compiler may print
``error:`` yet return normally; the build process must survive the first and see the second. Why a
long-lived one: importing torch + Triton costs seconds, more than most compiles.

Protocol: one JSON job per line on stdin (``backend``, ``backend_options``, ``arch``, ``spec``,
``out`` (binary path), ``log`` (path)); one JSON result per line on the file descriptor named by
``ULTRAQUANT_CODEGEN_RESULT_FD``. During a job, file descriptors 1 and 2 point at the job's log file,
so everything the compiler prints (Python or native) lands there for the build to scan.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

RESULT_FD_ENV = "ULTRAQUANT_CODEGEN_RESULT_FD"


def _run_job(job: dict[str, Any], backends: dict[str, Any]) -> dict[str, Any]:
    from ultraquant.kernels.specialization import Specialization

    from .archs import get_arch
    from .backends import load_backend

    key = json.dumps([job["backend"], job.get("backend_options", {})], sort_keys=True)
    if key not in backends:
        backends[key] = load_backend(job["backend"], job.get("backend_options", {}))
    spec = Specialization(**job["spec"])
    binary, info = backends[key].compile(spec, get_arch(job["arch"]))
    tmp = job["out"] + ".tmp"
    with open(tmp, "wb") as f:
        f.write(binary)
    os.replace(tmp, job["out"])
    return {"ok": True, "info": info}


def main() -> int:
    """Serve jobs from stdin until EOF."""
    results = os.fdopen(int(os.environ[RESULT_FD_ENV]), "w", buffering=1)
    saved_out, saved_err = os.dup(1), os.dup(2)
    backends: dict[str, Any] = {}
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        with open(job["log"], "wb") as log:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            start = time.monotonic()
            try:
                res = _run_job(job, backends)
            except BaseException as exc:  # report every failure; the build decides what it means
                traceback.print_exc()
                res = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved_out, 1)
                os.dup2(saved_err, 2)
        res["seconds"] = round(time.monotonic() - start, 3)  # reported, never written to the manifest
        results.write(json.dumps(res, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
