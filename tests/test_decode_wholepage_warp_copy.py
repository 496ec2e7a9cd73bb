"""The decodes' warp copies (``_issue_stage``, head-major pages; the whole-page and the multi-query decode):
each warp copies the runs it reads by inline-PTX ``cp.async`` into the ring at ``global_smem`` + its offset.

- The copy PTX (``_warp_copy_ptx``) run by the one-warp PTX interpreter (tests/ptx_warp.py) writes every byte of
  the warp's runs of the stage exactly once, from the run's own block (or zero-fills a masked run), with 512
  contiguous bytes per instruction except where a run ends, and commits one group.
- The ring is the piece's first allocation, at shared offset 0 (what the PTX's ``global_smem`` base assumes), in
  the whole-page and the multi-query decode; and no CTA barrier is left in either stage loop.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests import ptx_warp as W

K = pytest.importorskip("ultraquant.kernels.gluon.decode_wholepage")

SMEM = 0x40000  # where the test puts global_smem


def _run_copy(nsub: int, slot: int, nw: int, warp: int, stage: int, sizes: list[int]) -> W.Warp:
    """The copy PTX of one warp with the kernel's operands: ``off`` = (stage NR + w) 16 slot + 16 lane, run j's
    pointer = its run base + 16 lane (bases 2**33 apart, each ending in 16 * 7 to catch a wrong immediate)."""
    lane = np.arange(W.LANES, dtype=np.uint64)
    off = (stage * nsub * nw + warp) * 16 * slot + 16 * lane
    bases = [(j + 1) * 2 ** 33 + 16 * 7 for j in range(nsub)]
    ops = [np.zeros(W.LANES), off, lane] + [b + 16 * lane for b in bases] + [np.full(W.LANES, z) for z in sizes]
    warp_ = W.Warp(ops, symbols={"global_smem": SMEM})
    warp_.run(K._warp_copy_ptx(nsub, slot, nw))
    warp_.bases = bases
    return warp_


@pytest.mark.parametrize("nsub,slot,nw", [(4, 136, 8), (2, 272, 8), (4, 136, 4), (1, 136, 8)])
@pytest.mark.parametrize("warp,stage", [(0, 0), (3, 1)])
def test_copy_ptx_writes_each_run_once_from_its_block(nsub, slot, nw, warp, stage):
    sizes = [16 if j % 2 == 0 else 0 for j in range(nsub)]  # odd runs masked: zero-filled
    w = _run_copy(nsub, slot, nw, warp, stage, sizes)
    run_bytes = 16 * slot
    got = {}
    for dst, src, size, guard in w.copies:
        for lane in np.flatnonzero(guard):
            key = int(dst[lane]) - SMEM
            assert key not in got, f"shared byte {key} written twice"
            got[key] = (int(src[lane]), int(size[lane]))
    want = {}
    for j in range(nsub):
        for i in range(slot):  # chunk i of run j (the ring's run j nw + w of the stage)
            key = (stage * nsub * nw + j * nw + warp) * run_bytes + 16 * i
            want[key] = (w.bases[j] + 16 * i, sizes[j])
    assert got == want
    assert w.groups == [len(w.copies)], "one commit group, after every copy"


@pytest.mark.parametrize("nsub,slot,nw", [(4, 136, 8), (2, 272, 8), (1, 136, 8)])
def test_copy_ptx_instructions_read_contiguous_bytes(nsub, slot, nw):
    """Each copy instruction reads consecutive 16-byte chunks (32 lanes: 512 bytes) of one run, or of two at a
    run's end: the coalescing the flat-row copy had."""
    w = _run_copy(nsub, slot, nw, 1, 0, [16] * nsub)
    assert len(w.copies) == -(-nsub * slot // 32)
    for _, src, _, guard in w.copies:
        steps = np.diff(src[guard].astype(np.int64))
        assert np.count_nonzero(steps != 16) <= 1


FACTS = r"""
import json, re, sys, tempfile
from triton._C.libtriton import ir, nvidia, passes
from tools.sass_loop import loops, opcode, sass_lines
from tools.wholepage_sass import compile_wholepage_kernel


def compile_multiquery(config):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from codegen.triton_backend import compile_attrs
    from ultraquant.kernels.families.decode_multiquery import decode_multiquery_spec
    from ultraquant.kernels.gluon.decode_multiquery import uq_decode_multiquery

    spec = decode_multiquery_spec(head_size=128, block_size=16, **config)
    src = GluonASTSource(uq_decode_multiquery, dict(spec.signature), dict(spec.constexprs),
                         compile_attrs(spec, list(uq_decode_multiquery.arg_names)))
    options = {"num_warps": spec.num_warps, "num_stages": spec.num_stages}
    if spec.maxnreg:
        options["maxnreg"] = spec.maxnreg
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options), spec


out = []
for kind, config in json.loads(sys.argv[1]):
    kernel, spec = (compile_wholepage_kernel if kind == "wholepage" else compile_multiquery)(dict(config))
    c = spec.constexprs
    ring = c["STAGES"] * c["NSUB"] * spec.num_warps * 4 * (c["D"] + c["D"] // 16)  # runs of 16 x SLOT bytes
    ctx = ir.context()
    ir.load_dialects(ctx)
    nvidia.load_dialects(ctx)
    with tempfile.NamedTemporaryFile("w", suffix=".ttgir") as f:
        f.write(kernel.asm["ttgir"])
        f.flush()
        mod = ir.parse_mlir_module(f.name, ctx)
    mod.context = ctx
    pm = ir.pass_manager(ctx)
    passes.convert.add_scf_to_cf(pm)
    passes.gluon.add_inliner(pm)
    nvidia.passes.ttgpuir.add_allocate_shared_memory_nv(pm, 90, 87)
    pm.run(mod, "allocation")
    allocs = re.findall(r"ttg\.local_alloc \{allocation\.offset = (\d+) : i32\} : \(\) -> !ttg\.memdesc<(\d+)xi32",
                        str(mod))
    ins = sass_lines(kernel.asm["cubin"])
    lo, hi = loops(ins)[0]
    ops = [opcode(t) for a, t in ins if lo <= a <= hi]
    out.append({"ring": ring, "allocs": [[int(o), int(n)] for o, n in allocs], "nsub": c["NSUB"],
                "slot": 2 * (c["D"] // 2 + c["D"] // 32),
                "copies": ops.count("LDGSTS.E.BYPASS.128"), "barriers": [o for o in ops if o.startswith("BAR.")]})
print(json.dumps(out))
"""

CONFIGS = [("wholepage", dict(gqa=4, num_kv_heads=8, block_size=16)),
           ("wholepage", dict(gqa=16, num_kv_heads=1, block_size=16)),
           ("wholepage", dict(head_size=256, gqa=8, num_kv_heads=2, block_size=64)),
           ("multiquery", dict(gqa=4, num_kv_heads=8, tiles=1)), ("multiquery", dict(gqa=8, num_kv_heads=1, tiles=2))]


@pytest.fixture(scope="module")
def facts() -> list[dict]:
    """Per config of ``CONFIGS``: the ring's words, the allocations (offset, words) after Triton's shared-memory
    allocation, and the stage loop's copy and barrier instructions (sm_90 SASS). Compiled in a subprocess: the
    tests run Triton's interpreter, which cannot compile."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-c", FACTS, json.dumps(CONFIGS)], cwd=root, env=env, capture_output=True,
                         text=True, timeout=600)
    if run.returncode != 0 and "ptxas" in run.stderr:
        pytest.skip("no sm_90 compiler in this triton wheel")
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


@pytest.mark.parametrize("i", range(len(CONFIGS)))
def test_ring_is_the_first_allocation_at_offset_0(facts, i):
    """The copy PTX addresses the ring as ``global_smem`` + offset: Triton's shared-memory allocation must place
    the ring (the piece's ``STAGES x NR`` runs) at 0."""
    assert [0, facts[i]["ring"]] in facts[i]["allocs"], facts[i]["allocs"]


@pytest.mark.parametrize("i", range(len(CONFIGS)))
def test_stage_loop_copies_without_a_cta_barrier(facts, i):
    """``ceil(NSUB * SLOT / 32)`` copies a thread and stage (D=128: 4 runs x 136 chunks / 32 lanes = 17; D=256:
    2 x 272 / 32; the two-tile multi-query step's NSUB 1: 5) and no CTA barrier left in the stage loop (the
    multi-query decode syncs its query fragments' shared memory once, before the loop)."""
    assert facts[i]["copies"] == -(-facts[i]["nsub"] * facts[i]["slot"] // 32)
    assert facts[i]["barriers"] == []
