"""Offline sm_90 SASS evidence for token-major pages in the whole-page decode (issue 24; no GPU).

For each configuration (``decode_wholepage_spec`` keywords, ``token_major=True`` for token-major pages)
compiles ``uq_decode_wholepage`` for sm_90 (tools/wholepage_sass.py's ``compile_wholepage_kernel``),
and writes under OUTDIR: ``<name>.sass`` (every instruction, addresses and branch targets masked:
two head-major dumps are equal iff the code is), and one summary line per config (registers, spills,
shared memory, instruction count, the stage loop's size and opcode mix, and shared loads/cp.async in it).

    .venv/bin/python benchmarks/lab/wholepage_token_major_sass.py OUTDIR [name ...]
    .venv/bin/python benchmarks/lab/wholepage_token_major_sass.py --probe

Used before/after the token-major change to prove head-major's SASS unchanged (diff the .sass files;
benchmarks/NOTES.md, "Token-major pages in the whole-page decode").
``--probe``: the PTX of a tiny Gluon load from a 3-interval padded layout at a run-time ``.index``, checked
against the rule tests/test_decode_wholepage_token_major.py models (every padding summed over the whole
buffer's unpadded offset), the rule the token-major views rely on.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tools.sass_loop import cuobjdump, loops, opcode, sass_lines  # noqa: E402
from tools.wholepage_sass import compile_wholepage_kernel  # noqa: E402

CONFIGS: dict[str, dict] = {
    "d128_gqa4_hk8_bs16": {"head_size": 128, "gqa": 4, "num_kv_heads": 8, "block_size": 16},
    "d128_gqa16_hk2_bs16": {"head_size": 128, "gqa": 16, "num_kv_heads": 2, "block_size": 16},
    "d128_gqa4_hk4_bs16": {"head_size": 128, "gqa": 4, "num_kv_heads": 4, "block_size": 16},
    "d128_gqa4_hk8_bs16_m16": {"head_size": 128, "gqa": 4, "num_kv_heads": 8, "block_size": 16, "rows_in_n": False},
    "d256_gqa4_hk8_bs16": {"head_size": 256, "gqa": 4, "num_kv_heads": 8, "block_size": 16},
    "d128_gqa4_hk8_bs64": {"head_size": 128, "gqa": 4, "num_kv_heads": 8, "block_size": 64},
    "d256_gqa8_hk2_bs16": {"head_size": 256, "gqa": 8, "num_kv_heads": 2, "block_size": 16},
    "d256_gqa8_hk2_bs64": {"head_size": 256, "gqa": 8, "num_kv_heads": 2, "block_size": 64},
    "d128_gqa8_hk1_bs16": {"head_size": 128, "gqa": 8, "num_kv_heads": 1, "block_size": 16},
    "d128_gqa16_hk2_bs64": {"head_size": 128, "gqa": 16, "num_kv_heads": 2, "block_size": 64},
    "d128_gqa4_hk8_bs16_w16": {"head_size": 128, "gqa": 4, "num_kv_heads": 8, "block_size": 16, "warps": 16,
                               "nsub": 1, "stages": 4, "maxnreg": 128},
    "d128_gqa16_hk4_bs16_sinks_window_softcap": {"head_size": 128, "gqa": 16, "num_kv_heads": 4, "block_size": 16,
                                                 "has_sinks": True, "has_window": True, "has_softcap": True},
}
for _name in list(CONFIGS):
    CONFIGS[_name + "_tm"] = {**CONFIGS[_name], "token_major": True}

_TARGET = re.compile(r"0x[0-9a-f]+")


_BRANCH = re.compile(r"\b(BRA|CALL|BSSY|JMP|JMX|BRX|RET)\b")


def masked(ins: list[tuple[int, str]]) -> str:
    """The instructions without their addresses (and branch/call targets, which are addresses)."""
    return "\n".join((_TARGET.sub("0x?", t) if _BRANCH.search(t) else t).strip() for _, t in ins)


def census(name: str, config: dict, outdir: str) -> dict:
    k, spec = compile_wholepage_kernel(dict(config))
    cubin = k.asm["cubin"]
    ins = sass_lines(cubin)
    text = masked(ins)
    with open(os.path.join(outdir, name + ".raw.sass"), "w") as f:
        f.write("\n".join(f"{a:05x} {t}" for a, t in ins) + "\n")
    with open(os.path.join(outdir, name + ".sass"), "w") as f:
        f.write(text + "\n")
    usage = re.search(r"REG:(\d+) STACK:(\d+)", cuobjdump(cubin, "-res-usage"))
    row = {"name": name, "registers": int(usage.group(1)), "stack": int(usage.group(2)),
           "shared": k.metadata.shared, "instructions": len(ins),
           "sha": hashlib.sha256(text.encode()).hexdigest()[:16]}
    lp = sorted(loops(ins), key=lambda se: -(se[1] - se[0]))
    if lp:  # the largest loop: the stage loop
        start, end = lp[0]
        body = [t for a, t in ins if start <= a <= end]
        ops = collections.Counter(opcode(t) for t in body)
        row["loop"] = len(body)
        row["loop_lds"] = sum(n for o, n in ops.items() if o.startswith("LDS"))
        row["loop_ldgsts"] = sum(n for o, n in ops.items() if o.startswith("LDGSTS"))
        row["loop_mix"] = dict(ops.most_common(12))
        row["loop_ops"] = dict(ops)
    return row


def probe_padded_index() -> None:
    """Compile a load of ``[8, 32]`` int32 from entry ``idx`` of a ``[4, 8, 32]`` view padded ``[[32, 2], [64, 4],
    [256, 16]]``; check the PTX's per-row offsets and the entry base against the summed-padding rule."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    @gluon.jit
    def probe(out_ptr, idx):
        FLAT: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        L: gl.constexpr = gl.PaddedSharedLayout([[32, 2], [64, 4], [256, 16]], [[0, 1], [0, 2], [0, 4], [0, 8], [0, 16],
                                                [1, 0], [2, 0], [4, 0]], [], [8, 32])
        v = gl.allocate_shared_memory(gl.int32, [8192], FLAT)._reinterpret(gl.int32, [4, 8, 32], L).index(idx)
        BL: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, 1], [1, 0])
        r = gl.expand_dims(gl.arange(0, 8, gl.SliceLayout(1, BL)), 1)
        c = gl.expand_dims(gl.arange(0, 32, gl.SliceLayout(0, BL)), 0)
        gl.store(out_ptr + r * 32 + c, v.load(BL))

    src = GluonASTSource(probe, {"out_ptr": "*i32", "idx": "i32"}, {}, {})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1}).asm["ptx"]
    offs = [int(m or 0) for m in re.findall(r"ld\.shared\.b32\s+%r\d+, \[%r\d+(?:\+(\d+))?\]", ptx)]

    def pad(u):
        return u + 2 * (u >> 5) + 4 * (u >> 6) + 16 * (u >> 8)

    want = [4 * pad(32 * r) for r in range(8)]
    adds = len(re.findall(r"add\.s32\s+%r\d+, %r\d+, %r(\d+);", ptx))
    print(f"row offsets (bytes) {offs} want {want}; the entry base (idx * 256 words) gets its own padding, "
          f"pad(idx * 256) - idx * 256 = idx * {pad(256) - 256} words ({adds} register adds in the base)")
    assert offs == want, "padded-layout lowering differs from the summed-padding rule"


def main(argv: list[str]) -> None:
    if argv == ["--probe"]:
        probe_padded_index()
        return
    outdir = argv[0]
    os.makedirs(outdir, exist_ok=True)
    names = argv[1:] or list(CONFIGS)
    with open(os.path.join(outdir, "summary.jsonl"), "a") as f:
        for n in names:
            row = census(n, CONFIGS[n], outdir)
            print(json.dumps(row), flush=True)
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
