"""Offline sm_90 SASS census of the whole-page decode (Gluon) for one configuration (no GPU needed).

Compiles ``uq_decode_wholepage`` as
:func:`ultraquant.kernels.families.decode_wholepage.decode_wholepage_spec` specializes it
(with a blob's divisibility assumptions: 16-byte aligned pointers and the query/output row strides), then
prints registers, shared memory and the hot loop's instruction count and opcode mix (``tools/sass_loop.py``'s
census), plus warp instructions per token-head (the loop handles ``NSUB * 16`` tokens of one kv head per warp
per iteration).

    .venv/bin/python tools/wholepage_sass.py gqa=4 num_kv_heads=8 block_size=64 [nsub=2 stages=4]
"""

from __future__ import annotations

import collections
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools.sass_loop import _value, cuobjdump, loops, opcode, sass_lines  # noqa: E402

TUNING_KEYS = ("warps", "rows_in_n", "nsub", "stages", "tw", "maxnreg")


def compile_wholepage(config: dict) -> tuple[bytes, object, object]:
    """(cubin, metadata, spec) of the whole-page decode for ``config`` (decode_wholepage_spec keywords +
    tuning keys)."""
    k, spec = compile_wholepage_kernel(config)
    return k.asm["cubin"], k.metadata, spec


def compile_wholepage_kernel(config: dict) -> tuple[object, object]:
    """(compiled kernel: ``.asm`` holds ttgir/ptx/cubin, spec) of the whole-page decode for ``config``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from codegen.triton_backend import compile_attrs
    from ultraquant.kernels.families.decode_wholepage import WholePageTuning, decode_wholepage_spec
    from ultraquant.kernels.gluon.decode_wholepage import uq_decode_wholepage

    tuning = WholePageTuning(**{k: config.pop(k) for k in TUNING_KEYS if k in config})
    spec = decode_wholepage_spec(**{"head_size": 128, **config}, tuning=tuning)
    attrs = compile_attrs(spec, list(uq_decode_wholepage.arg_names))
    src = GluonASTSource(uq_decode_wholepage, dict(spec.signature), dict(spec.constexprs), attrs)
    options = {"num_warps": spec.num_warps, "num_stages": spec.num_stages}
    if spec.maxnreg:
        options["maxnreg"] = spec.maxnreg
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options), spec


def main(argv: list[str]) -> None:
    config = {k: _value(v) for k, v in (p.split("=", 1) for p in argv)}
    cubin, md, spec = compile_wholepage(dict(config))
    ins = sass_lines(cubin)
    c = spec.constexprs
    print(f"{spec.kernel} {c} warps={spec.num_warps}")
    usage = re.search(r"REG:(\d+) STACK:(\d+)", cuobjdump(cubin, "-res-usage"))
    regs, stack = usage.groups() if usage else ("?", "?")
    print(f"registers={regs} stack (spills)={stack} B shared={md.shared} B instructions={len(ins)}")
    tokens = c["NSUB"] * c["TW"]
    for start, end in loops(ins)[:2]:
        body = [t for a, t in ins if start <= a <= end]
        mix = collections.Counter(opcode(t) for t in body).most_common(int(os.environ.get("WHOLEPAGE_MIX", "16")))
        print(f"loop 0x{start:x}-0x{end:x}: {len(body)} instructions = {len(body) / tokens:.1f} per token-head; "
              + ", ".join(f"{o} {n}" for o, n in mix))


if __name__ == "__main__":
    main(sys.argv[1:])
