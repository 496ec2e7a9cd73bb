"""One FlyDSL compile in its own process: ``python -m ultraquant.codegen.flydsl.compile_kernel SPEC OUT``.

``SPEC`` is JSON: ``{"arch": "gfx942", "name": "...", "config": {DecodeConfig fields},
"query_dtype": "bf16", "out_dtype": "bf16", "mx": false, "waves": 4, "pipelined": true}``; the HSACO
is written to ``OUT``. An LLVM assertion kills only this process; the caller (:func:`run`) also fails
on ``error:`` in the output, which FlyDSL/LLVM sometimes print while returning normally.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ERROR_RE = re.compile(r"error:", re.IGNORECASE)


def main(argv: list[str]) -> int:
    spec = json.loads(argv[1])
    from .compiler import compile_decode

    blob = compile_decode(spec["arch"], spec["name"], spec["config"],
                          query_dtype=spec.get("query_dtype", "bf16"), out_dtype=spec.get("out_dtype", "bf16"),
                          mx=bool(spec.get("mx", False)), waves=int(spec.get("waves", 1)),
                          pipelined=bool(spec.get("pipelined", True)))
    Path(argv[2]).write_bytes(blob)
    return 0


def run(spec: dict[str, Any], out: Path, python: str = sys.executable, timeout: float = 900) -> bytes:
    """Compile ``spec`` in a subprocess; return the HSACO or raise with the compiler's output."""
    proc = subprocess.run([python, "-m", "ultraquant.codegen.flydsl.compile_kernel", json.dumps(spec), str(out)],
                          capture_output=True, text=True, timeout=timeout)
    text = proc.stdout + proc.stderr
    if proc.returncode != 0 or ERROR_RE.search(text):
        raise RuntimeError(f"FlyDSL compile of {spec.get('name')} failed (exit {proc.returncode}):\n"
                           f"{text[-4000:]}")
    return Path(out).read_bytes()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
