"""Offline sm_90 SASS of a decode kernel's stage loop by source line or opcode (no GPU; issue 24/25 census).

Compiles the whole-page decode (``tools/wholepage_sass.py``'s compile) or the multi-query decode
(``multiquery_sass_census.py``'s) with line info, disassembles with the ``nvdisasm -g`` Triton ships, takes the
largest loop (a backward branch) and its **interior path**: the loop minus the block its largest forward branch
skips (the masked scores, which an interior stage jumps over). Prints the loop's and the path's instruction
counts and the path's instructions per source line (innermost, as ptxas records it) or per opcode; ``--outside``
counts the instructions outside the loop instead (run once per piece). The counts are static: each
instruction of the path runs once per stage and warp. Results: benchmarks/NOTES.md.

    .venv/bin/python benchmarks/lab/sass_lines.py wholepage gqa=4 num_kv_heads=8 block_size=16 [--ops] [--outside]
    .venv/bin/python benchmarks/lab/sass_lines.py multiquery gqa=4 num_kv_heads=8 tiles=1
"""

from __future__ import annotations

import collections
import os
import re
import sys

os.environ["TRITON_DISABLE_LINE_INFO"] = "0"
os.environ.setdefault("TRITON_ALWAYS_COMPILE", "1")
sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tools.sass_loop import _value, loops, nvidia_tool, opcode  # noqa: E402

Instr = tuple[int, str, tuple[str, int] | None]


def disassemble(cubin: bytes) -> list[Instr]:
    """(address, instruction, (file, line) or None) of every instruction, branch targets resolved to addresses
    in the text (``.L_x_N`` labels replaced by ``0x...``)."""
    text = nvidia_tool("nvdisasm", cubin, "-g", "-c")
    out: list[Instr] = []
    labels: dict[str, int] = {}
    pending: list[str] = []
    where = None
    for line in text.splitlines():
        m = re.match(r"^\s*(\.L_x_\d+):", line)
        if m:
            pending.append(m.group(1))
            continue
        m = re.search(r'//## File "([^"]+)", line (\d+)', line)
        if m:
            where = (os.path.basename(m.group(1)), int(m.group(2)))
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            addr = int(m.group(1), 16)
            labels.update({p: addr for p in pending})
            pending = []
            out.append((addr, m.group(2).strip(), where))
    return [(a, re.sub(r"`\((\.L_x_\d+)\)", lambda m: hex(labels.get(m.group(1), -1)), t), w) for a, t, w in out]


def _target(text: str) -> int | None:
    m = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", text)
    return int(m.group(1), 16) if m else None


def stage_loop(ins: list[Instr]) -> tuple[list[Instr], list[Instr]]:
    """(the largest loop's instructions, its interior path) without NOPs."""
    lo, hi = loops([(a, u) for a, u, _ in ins])[0]
    body = [x for x in ins if lo <= x[0] <= hi and opcode(x[1]) != "NOP"]
    skip = (0, 0)
    for a, u, _ in body:
        t = _target(u)
        if t is not None and a != hi and a < t <= hi and t - a > skip[1] - skip[0]:
            skip = (a, t)
    return body, [x for x in body if not skip[0] < x[0] < skip[1]]


def compile_kernel(kind: str, config: dict) -> bytes:
    """The cubin of ``kind`` (``wholepage`` / ``multiquery``) for ``config``."""
    if kind == "wholepage":
        from tools.wholepage_sass import compile_wholepage

        return compile_wholepage(config)[0]
    from multiquery_sass_census import compile_multiquery

    return compile_multiquery(config)[0].asm["cubin"]


def main(argv: list[str]) -> None:
    kind, flags = argv[0], {a for a in argv[1:] if a.startswith("--")}
    config = {k: _value(v) for k, v in (a.split("=", 1) for a in argv[1:] if not a.startswith("--"))}
    ins = disassemble(compile_kernel(kind, config))
    body, path = stage_loop(ins)
    print(f"{kind} {config}: stage loop {len(body)} instructions, interior path {len(path)}")
    if "--outside" in flags:
        inside = {a for a, _, _ in body}
        path = [x for x in ins if x[0] not in inside and opcode(x[1]) != "NOP"]
        print(f"outside the loop: {len(path)}")
    key = (lambda x: opcode(x[1])) if "--ops" in flags else (lambda x: x[2])
    for k, n in collections.Counter(map(key, path)).most_common(30):
        print(f"{n:6d}  {k}")


if __name__ == "__main__":
    main(sys.argv[1:])
