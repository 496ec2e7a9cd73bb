"""Offline SASS census of one kernel specialization on sm_90 (no GPU needed).

Compiles the kernel exactly as codegen does (the same ``tt.divisibility`` attrs: pointers and the
spec's ``divisible`` strides; ``divisible=`` with a comma list, possibly empty, overrides them, e.g. to
see what a call with odd strides runs), disassembles the
cubin with the cuobjdump Triton ships, and prints registers, shared memory and, for every loop (a
backward branch), its instruction count and opcode mix. The kernels are instruction-bound on the H200,
so the hot loop's count per token-head predicted measured decode time within ~5% last time
(benchmarks/NOTES.md). Run with the build venv, e.g.

    .build/venv/bin/python tools/sass_loop.py decode_attention head_size=128 gqa=4 block_size=64
    .build/venv/bin/python tools/sass_loop.py store_kv head_size=128

A kernel without loops (the store) gets a census of its first path instead: instruction count, opcode
mix and every memory operation with its width (STG.E.64 = 8-byte stores...).
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import os
import re
import subprocess
import sys
import tempfile

os.environ.setdefault("TRITON_DISABLE_LINE_INFO", "1")
os.environ.setdefault("TRITON_ALWAYS_COMPILE", "1")


def _value(text: str) -> object:
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def compile_cubin(op: str, config: dict) -> tuple[bytes, object, object]:
    """(cubin, metadata, spec) of ``catalog.specializer(op)(**config)`` for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ultraquant.codegen.triton_backend import compile_attrs
    from ultraquant.kernels.catalog import specializer
    from ultraquant.kernels.registry import KERNELS

    divisible = config.pop("divisible", None)
    if "target" in inspect.signature(specializer(op)).parameters:
        config.setdefault("target", "cuda")  # what codegen passes for sm_* (MatrixRow.targeted)
    spec = specializer(op)(**config)
    if divisible is not None:
        spec = dataclasses.replace(spec, divisible=tuple(n for n in str(divisible).split(",") if n))
    fn = KERNELS[spec.kernel]
    src = ASTSource(fn, dict(spec.signature), dict(spec.constexprs), compile_attrs(spec, list(fn.arg_names)))
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": spec.num_warps, "num_stages": spec.num_stages,
                                **({} if spec.maxnreg is None else {"maxnreg": spec.maxnreg})})
    return k.asm["cubin"], k.metadata, spec


def nvidia_tool(name: str, cubin: bytes, *flags: str) -> str:
    """Text of Triton's own ``name`` (``cuobjdump``, ``nvdisasm``) run with ``flags`` on the cubin."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, *flags, f.name], check=True, capture_output=True, text=True).stdout


def cuobjdump(cubin: bytes, flag: str) -> str:
    """Text of ``cuobjdump <flag>`` on the cubin (the cuobjdump Triton ships)."""
    return nvidia_tool("cuobjdump", cubin, flag)


def sass_lines(cubin: bytes) -> list[tuple[int, str]]:
    """(address, instruction text) of every SASS instruction in the cubin."""
    text = cuobjdump(cubin, "-sass")
    out = []
    for line in text.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            out.append((int(m.group(1), 16), m.group(2).strip()))
    return out


def loops(ins: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """(start, end) address ranges closed by a backward branch, largest first."""
    found = []
    for addr, text in ins:
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            found.append((int(m.group(1), 16), addr))
    return sorted(found, key=lambda r: r[0] - r[1])


def opcode(text: str) -> str:
    text = re.sub(r"^@!?U?P\w+\s+", "", text)
    return text.split()[0]


def main(argv: list[str]) -> None:
    op, *pairs = argv
    config = {k: _value(v) for k, v in (p.split("=", 1) for p in pairs)}
    cubin, md, spec = compile_cubin(op, config)
    ins = sass_lines(cubin)
    print(f"{spec.kernel} {spec.constexprs} warps={spec.num_warps} divisible={spec.divisible}")
    usage = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+).*?LOCAL:(\d+)", cuobjdump(cubin, "-res-usage"))
    regs, stack, shared, local = usage.groups() if usage else ("?", "?", "?", "?")
    print(f"registers={regs} stack={stack} local={local} shared={shared} (triton: {md.shared}) "
          f"instructions={len(ins)}")
    for start, end in loops(ins)[:3]:
        body = [t for a, t in ins if start <= a <= end]
        mix = collections.Counter(opcode(t) for t in body).most_common(14)
        print(f"loop 0x{start:x}-0x{end:x}: {len(body)} instructions; " + ", ".join(f"{o} {n}" for o, n in mix))
    if not loops(ins):
        census(ins)


MEMORY_OPS = re.compile(r"(LDG|STG|LDS|STS|LDSM|STSM|LDL|STL|BAR|SHFL)")
"""Opcodes the straight-line census lists in full (global/shared/local memory, barriers, shuffles)."""


def census(ins: list[tuple[int, str]]) -> None:
    """For a kernel without loops (the store): the instructions up to the first EXIT (the code laid out
    first: for the store the aligned-stride path) and their memory operations with widths."""
    first = next((i for i, (_, t) in enumerate(ins) if "EXIT" in t), len(ins))
    mix = collections.Counter(opcode(t) for _, t in ins[:first])
    print(f"first path (to the first EXIT): {first} instructions; "
          + ", ".join(f"{o} {n}" for o, n in mix.most_common(12)))
    print("  memory: " + ", ".join(f"{o} {n}" for o, n in sorted(mix.items()) if MEMORY_OPS.match(o)))


if __name__ == "__main__":
    main(sys.argv[1:])
