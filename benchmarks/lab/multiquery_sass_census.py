"""Offline sm_90 SASS census of the multi-query decode (issue 25), for the merge-layout / stage-barrier study.

Why: the 8-token step sits on its gate (2.50x, benchmarks/NOTES.md "Merged main of 2026-12-03") and the
NOTES name two open items in ``uq_decode_multiquery``: the merge's replicating layout and the 3 block-wide
barriers per stage. This compiles the kernel exactly as codegen builds its blobs (``GluonASTSource``, the
spec's ``tt.divisibility`` attrs, sm_90, CPU only) and counts, in the noinline ``_serve_piece`` function: the
stage loop's instructions, ``BAR.SYNC`` and local-memory accesses, the instructions outside it, the merge
loop's global loads (per loop iteration and per partial, per thread), registers, stack and local memory; plus
``bar.sync`` in the PTX. Run it on the tree whose kernel you want to measure (cwd = that worktree):

    /work/main/.venv/bin/python benchmarks/lab/multiquery_sass_census.py --label before --json out.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys

sys.path.insert(0, os.getcwd())
from tools.sass_loop import cuobjdump, loops, opcode, sass_lines  # noqa: E402

CONFIGS = (  # the routed configs (block 16): GQA 4 Hk 8 (A geometry) and GQA 8 Hk 1, one and two tiles
    {"gqa": 4, "num_kv_heads": 8, "tiles": 1, "steps": "2/4 tokens"},
    {"gqa": 4, "num_kv_heads": 8, "tiles": 2, "steps": "8 tokens"},
    {"gqa": 8, "num_kv_heads": 1, "tiles": 1, "steps": "2 tokens"},
    {"gqa": 8, "num_kv_heads": 1, "tiles": 2, "steps": "4/8 tokens"},
)


def compile_multiquery(config: dict) -> tuple[object, object]:
    """(compiled kernel, spec) of the multi-query decode for ``config`` (decode_multiquery_spec keywords)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from codegen.triton_backend import compile_attrs
    from ultraquant.kernels.families.decode_multiquery import decode_multiquery_spec
    from ultraquant.kernels.gluon.decode_multiquery import uq_decode_multiquery

    spec = decode_multiquery_spec(head_size=128, block_size=16, **config)
    names = list(uq_decode_multiquery.arg_names)
    src = GluonASTSource(uq_decode_multiquery, dict(spec.signature), dict(spec.constexprs),
                         compile_attrs(spec, names))
    options = {"num_warps": spec.num_warps, "num_stages": spec.num_stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options), spec


def piece_function(ins: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """The instructions of the noinline ``_serve_piece`` (ptxas keeps it a subroutine of the entry's listing):
    the largest span from a ``CALL.REL`` target to the first ``RET`` after it."""
    spans = []
    for _, t in ins:
        m = re.search(r"\bCALL\.REL\S*\s+0x([0-9a-f]+)", t)
        if m:
            start = int(m.group(1), 16)
            end = next(a for a, u in ins if a >= start and opcode(u) == "RET.REL.NODEC")
            spans.append((start, end))
    start, end = max(spans, key=lambda r: r[1] - r[0])
    return [(a, t) for a, t in ins if start <= a <= end]


def census(config: dict) -> dict:
    k, spec = compile_multiquery(dict(config))
    cubin = k.asm["cubin"]
    every = [(a, t) for a, t in sass_lines(cubin) if opcode(t) != "NOP"]
    ins = piece_function(every)
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", cuobjdump(cubin, "-res-usage"))
    res = dict(zip(("regs", "stack", "shared_static", "local"), map(int, m.groups()), strict=True))
    res["shared_triton"] = int(k.metadata.shared)
    found = loops(ins)
    # the stage loop: the loop holding the HMMAs; the merge loop: the loop with the most LDG.E (partials)
    body = {r: [t for a, t in ins if r[0] <= a <= r[1]] for r in found}
    stage = max(found, key=lambda r: sum(opcode(t).startswith("HMMA") for t in body[r]))
    merge_loops = [r for r in found if not (stage[0] <= r[0] <= stage[1])
                   and any(opcode(t).startswith("LDG") for t in body[r])]
    merge = max(merge_loops, key=lambda r: sum(opcode(t).startswith("LDG") for t in body[r])) if merge_loops else None
    sb = body[stage]
    mix = collections.Counter(opcode(t) for t in sb)
    c = spec.constexprs
    tokens = c["NSUB"] * c["TW"]  # tokens of one kv head per warp per iteration
    out = {
        "config": {**config, "NSUB": c["NSUB"], "STAGES": c["STAGES"], "WT": c["WT"], "num_warps": spec.num_warps},
        "resources": res,
        "ptx_bar_sync": len(re.findall(r"\bbar\.sync\b|\bbarrier\.sync\b", k.asm["ptx"])),
        "kernel_instructions": len(every),
        "piece_instructions": len(ins),
        "stage_loop": {
            "instructions": len(sb),
            "per_token_head": round(len(sb) / tokens, 1),
            "bar_sync": sum(opcode(t).startswith("BAR") for t in sb),
            "local": sum(opcode(t).startswith(("LDL", "STL")) for t in sb),
            "ldgsts": sum(opcode(t).startswith("LDGSTS") for t in sb),
            "hmma": sum(opcode(t).startswith("HMMA") for t in sb),
            "top": mix.most_common(8),
        },
        "outside_stage_loop": len(ins) - len(sb),
        "piece_bar_sync": sum(opcode(t).startswith("BAR") for _, t in ins),
        "piece_local": sum(opcode(t).startswith(("LDL", "STL")) for _, t in ins),
    }
    if merge:
        mb = body[merge]
        ldg = collections.Counter(opcode(t) for t in mb if opcode(t).startswith("LDG"))
        per_step = re.search(r"MERGE: gl.constexpr = ([^\n]*)", open(
            "ultraquant/kernels/gluon/decode_multiquery.py").read())
        out["merge_loop"] = {"instructions": len(mb), "ldg": dict(ldg), "ldg_total": sum(ldg.values()),
                             "local": sum(opcode(t).startswith(("LDL", "STL")) for t in mb),
                             "merge_step_expr": per_step.group(1) if per_step else None}
    return out


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", default="tree")
    ap.add_argument("--json")
    ap.add_argument("--only", type=int, nargs="*", help="indices into CONFIGS")
    a = ap.parse_args(argv)
    rows = []
    for i, cfg in enumerate(CONFIGS):
        if a.only is not None and i not in a.only:
            continue
        cfg = {k: v for k, v in cfg.items() if k != "steps"}
        r = census(cfg)
        r["steps"] = CONFIGS[i]["steps"]
        rows.append(r)
        print(json.dumps(r), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"label": a.label, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
