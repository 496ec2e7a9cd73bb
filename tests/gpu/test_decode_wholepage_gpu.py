"""The whole-page decode (Gluon, NVIDIA sm_90+) on a GPU against the float64 reference over the same cache bytes.

Covers what whole-page serves (D=128 with GQA 1..16, D=256 with GQA 1..8, Hk 1..8, blocks 16..128,
head-major caches: whole 16-token runs) through the routed public API (``ultraquant.decode_attention``:
the plan must pick whole-page; AOT blob or Gluon JIT by ``ULTRAQUANT_BACKEND``), tuned ring shapes through
``decode_wholepage``: ragged lengths at block/split boundaries (including an empty request), sinks, sliding
window, soft cap, V outliers 2^20 apart, NaN-poisoned outputs, several ring shapes, warp counts and
persistent grid sizes, GQA 9..16 as two 8-row groups in N (routed) and as 16 M rows, ragged serving
batches (lengths 0..131072) for the balanced schedule, CUDA graph capture + replay with new (ragged)
lengths on a side stream (both page layouts). Token-major caches (Hk > 1, ``TOKEN_MAJOR``) through
``decode_wholepage`` (:data:`CASES_TM`) and the routed API; everything else is split-KV
decode's by ``wholepage_supports`` (tests/test_decode_wholepage_plan.py, tests/test_decode_route.py, CPU).
"""

from __future__ import annotations

import pytest
import torch

import ultraquant as uq
from tests.gpu.test_kernels_gpu import _problem, check_close, check_graph_replay_and_stream
from ultraquant import reference as R
from ultraquant.errors import UltraQuantError
from ultraquant.kernels import plans
from ultraquant.kernels.families.decode_wholepage import (
    WholePageTuning,
    decode_wholepage,
    plan_decode_wholepage,
    token_runs,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.version.hip is not None
                       or torch.cuda.get_device_capability() < (9, 0), reason="needs an NVIDIA sm_90+ GPU"),
]

CASES = {
    # name: (seq_lens, Hq, Hk, block, sinks, window, softcap)   (head-major caches)
    "gqa4-hk8-b64-long": ([32768, 1, 8191, 8192, 8193, 20000, 64, 65], 32, 8, 64, False, None, None),
    "gqa4-hk8-b64-sinks": ([5000, 1, 63, 64, 65, 129], 32, 8, 64, True, None, None),
    "gqa6-hk2-b32-window-softcap": ([5000, 31, 33, 1], 12, 2, 32, False, 1000, 30.0),
    "gqa8-hk1-b128-sinks-window": ([4000, 129, 127], 8, 1, 128, True, 128, None),
    "gqa16-hk1-b16-batch64": ([(i * 977) % 2048 + 1 for i in range(64)], 16, 1, 16, True, 500, None),
    "gqa1-hk4-b16-sinks": ([1, 15, 16, 17, 300], 4, 4, 16, True, None, None),
    "gqa3-hk4-b64-softcap-sinks": ([3000, 2047, 64, 0], 12, 4, 64, True, None, 50.0),
    "gqa16-hk8-b32": ([1500, 700], 128, 8, 32, False, None, None),
    # ragged serving batches for the balanced schedule: lengths 0..131072, pieces across requests
    "ragged-hk8-b16-0-to-131072": ([0, 1, 131072, 15, 16, 17, 0] + [(i * 7919) % 9000 + 1 for i in range(40)],
                                   32, 8, 16, False, None, None),
    "ragged-gqa16-hk2-b16-sinks-window-softcap": ([(i * 3571) % 6000 for i in range(70)] + [40000],
                                                  32, 2, 16, True, 3000, 40.0),
    "ragged-gqa8-hk1-b16-sinks": ([(i * 12289) % 20000 + 1 for i in range(66)], 8, 1, 16, True, None, None),
    # more requests than the schedule reads per chunk (256): three chunks, empty and one-token requests among them
    "ragged-gqa4-hk4-b16-600-requests": ([(i * 7919) % 700 for i in range(600)], 16, 4, 16, True, None, None),
}
CASES_256 = {
    # D=256 (rows in N only): shape C's config, and the edges of the others
    "d256-gqa8-hk2-b64-long": ([32768, 1, 8191, 8192, 8193, 64, 65], 16, 2, 64, False, None, None),
    "d256-gqa4-hk1-b16-sinks-window-softcap": ([3000, 17, 1, 0], 4, 1, 16, True, 700, 30.0),
    "d256-gqa1-hk8-b32-sinks": ([2000, 33, 31], 8, 8, 32, True, None, None),
}
CASES_TM = {
    # token-major pages ((block, token, head, slot) memory order): (D, seq_lens, Hq, Hk, block, sinks, window,
    # softcap, tuning); the copy's pair padding and token order differ per (D, Hk) (_pair_pad, _tm_token_bases)
    "tm-a-gqa4-hk8-b16": (128, [32768, 1, 15, 16, 17, 8191, 8193, 0], 32, 8, 16, False, None, None, None),
    "tm-gqa4-hk8-b64-sinks": (128, [5000, 1, 63, 64, 65, 129], 32, 8, 64, True, None, None, None),
    "tm-gqa16-hk2-b16-sinks-window-softcap": (128, [(i * 3571) % 6000 for i in range(70)] + [40000], 32, 2, 16,
                                              True, 3000, 40.0, None),
    "tm-gqa3-hk4-b64-softcap-sinks": (128, [3000, 2047, 64, 0], 12, 4, 64, True, None, 50.0, None),
    "tm-gqa6-hk2-b32-window": (128, [5000, 31, 33, 1], 12, 2, 32, False, 1000, None, None),
    "tm-ragged-hk8-b16-0-to-131072": (128, [0, 1, 131072, 15, 16, 17, 0] + [(i * 7919) % 9000 + 1 for i in range(40)],
                                      32, 8, 16, False, None, None, None),
    "tm-ragged-hk8-b16-5-programs": (128, [0, 3000, 1, 17, 900, 0, 2500, 64], 32, 8, 16, True, None, None,
                                     WholePageTuning(programs=5)),
    "tm-gqa4-hk4-b16-m16": (128, [3000, 17, 1], 16, 4, 16, True, None, None, WholePageTuning(rows_in_n=False)),
    "tm-gqa4-hk8-b16-rings-1-4": (128, [4000, 65, 1], 32, 8, 16, False, None, None, WholePageTuning(nsub=1, stages=4)),
    "tm-gqa4-hk8-b16-16-warps": (128, [4000, 65, 1], 32, 8, 16, False, None, None,
                                 WholePageTuning(warps=16, nsub=1, stages=4, maxnreg=128)),
    "tm-d256-gqa8-hk2-b64-long": (256, [32768, 1, 8191, 8192, 8193, 64, 65], 16, 2, 64, False, None, None, None),
    "tm-d256-gqa4-hk8-b16": (256, [3000, 17, 1, 0], 32, 8, 16, True, 700, 30.0, None),
    "tm-d256-gqa1-hk4-b32-sinks": (256, [2000, 33, 31], 4, 4, 32, True, None, None, None),
}
RINGS = [(2, 4), (1, 4), (4, 2), (2, 2)]
"""(NSUB, STAGES) ring shapes checked on one case."""


def _run(name: str, tuning: WholePageTuning | None = None) -> None:
    """One case through whole-page: the routed public API (``ultraquant.decode_attention``: AOT blob or JIT by
    the backend policy) without ``tuning``, else ``decode_wholepage`` with it (Gluon's JIT)."""
    d = 256 if name in CASES_256 else 128
    lens, hq, hk, bs, sinks, window, softcap = {**CASES, **CASES_256}[name]
    prob, query, sk = _problem(lens, hq, hk, d, bs, True, seed=len(name), sinks=sinks)
    scale = d ** -0.5
    ref = R.decode_attention(query.float(), prob.kv_cache, prob.block_table, prob.seq_lens, scale, sinks=sk,
                             sliding_window=window, softcap=softcap)
    out = torch.full_like(query, float("nan"))
    if tuning is None:
        plan = plans.plan_decode(query, prob.kv_cache, prob.block_table, prob.seq_lens, scale, sk, window, softcap,
                                 out)
        assert plan.spec.kernel == "uq_decode_wholepage", plan.spec.key()
        uq.decode_attention(query, prob.kv_cache, prob.block_table, prob.seq_lens, scale, sinks=sk,
                            sliding_window=window, softcap=softcap, out=out)
    else:
        decode_wholepage(query, prob.kv_cache, prob.block_table, prob.seq_lens, scale, sinks=sk, sliding_window=window,
                  softcap=softcap, out=out, tuning=tuning)
    torch.cuda.synchronize()
    check_close(out, ref, f"{name} {tuning or 'routed'}")


@pytest.mark.parametrize("name", list(CASES))
def test_decode_wholepage(name):
    _run(name)


@pytest.mark.parametrize("name", list(CASES_256))
def test_decode_wholepage_d256(name):
    _run(name)


@pytest.mark.parametrize("nsub,stages", RINGS)
@pytest.mark.parametrize("programs", [1, 7, None])
def test_decode_wholepage_rings_and_programs(nsub, stages, programs):
    _run("gqa4-hk8-b64-sinks", WholePageTuning(nsub=nsub, stages=stages, programs=programs))


@pytest.mark.parametrize("programs", [1, 5, 300])
@pytest.mark.parametrize("name", ["ragged-hk8-b16-0-to-131072", "ragged-gqa16-hk2-b16-sinks-window-softcap"])
def test_decode_wholepage_ragged_grids(name, programs):
    """The balanced schedule over other persistent grids: one program (every request in turn), a few
    (each spans many requests), more programs than units (most idle)."""
    _run(name, WholePageTuning(programs=programs))


@pytest.mark.parametrize("head_major", [True, False])
def test_decode_wholepage_graph_replay_ragged_new_lengths(head_major):
    """The schedule is computed on the device from seq_lens at every call: capture once, replay with
    other ragged length mixes (long-first, all empty, one long request, many short), each right, on
    head-major and token-major pages (both routed to the whole-page decode)."""
    capacity = [9000] * 3 + [2000] * 61
    prob, query, sk = _problem(capacity, 32, 8, 128, 16, head_major, seed=41, sinks=True)
    assert plans.plan_decode(query, prob.kv_cache, prob.block_table, prob.seq_lens, 0.09, sk, None, None,
                             torch.empty_like(query)).spec.kernel == "uq_decode_wholepage"
    seq_lens = prob.seq_lens.clone()
    out = torch.full_like(query, float("nan"))

    def call() -> None:
        uq.decode_attention(query, prob.kv_cache, prob.block_table, seq_lens, 0.09, sinks=sk, out=out)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        call()
    mixes = ([9000, 1, 8999] + [(i * 37) % 2000 for i in range(61)], [0] * 64, [9000] + [0] * 63,
             [1] * 64, [17] * 3 + [2000] * 61)
    for new in mixes:
        seq_lens.copy_(torch.tensor(new, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = R.decode_attention(query.float(), prob.kv_cache, prob.block_table, seq_lens, 0.09, sinks=sk)
        check_close(out, ref, f"replay {new[:4]}...")


@pytest.mark.parametrize("name", ["gqa4-hk8-b64-long", "gqa6-hk2-b32-window-softcap", "gqa16-hk1-b16-batch64"])
def test_decode_wholepage_16_warps(name):
    """16 warps (two token groups per kv head at Hk=8) under a 128-register cap."""
    _run(name, WholePageTuning(warps=16, nsub=1, stages=4, maxnreg=128))


@pytest.mark.parametrize("name", ["gqa16-hk1-b16-batch64", "ragged-gqa16-hk2-b16-sinks-window-softcap"])
def test_decode_wholepage_gqa16_m_rows(name):
    """GQA 16 on the 16-M-row path (``rows_in_n=False``; routed GQA 9..16 runs two 8-row groups in N)."""
    _run(name, WholePageTuning(rows_in_n=False))


@pytest.mark.parametrize("name", list(CASES_TM))
def test_decode_wholepage_token_major(name):
    """Token-major pages (a plain ``torch.zeros((blocks, block_size, Hk, slot))``): the kernel streams each
    page of all kv heads whole (``TOKEN_MAJOR``) and matches the reference (the pair padding, the token
    order and the second copy's masked tail differ per (D, Hk): tests/test_decode_wholepage_token_major.py)."""
    d, lens, hq, hk, bs, sinks, window, softcap, tuning = CASES_TM[name]
    prob, query, sk = _problem(lens, hq, hk, d, bs, False, seed=len(name), sinks=sinks)
    assert token_runs(d, tuple(prob.kv_cache.stride()), hk)
    scale = d ** -0.5
    ref = R.decode_attention(query.float(), prob.kv_cache, prob.block_table, prob.seq_lens, scale, sinks=sk,
                             sliding_window=window, softcap=softcap)
    out = torch.full_like(query, float("nan"))
    plan = plan_decode_wholepage(query, prob.kv_cache, prob.block_table, prob.seq_lens, scale, sk, window,
                                       softcap, out, tuning=tuning or WholePageTuning())
    assert plan.spec.constexprs.get("TOKEN_MAJOR"), plan.spec.key()
    decode_wholepage(query, prob.kv_cache, prob.block_table, prob.seq_lens, scale, sinks=sk, sliding_window=window,
                     softcap=softcap, out=out, tuning=tuning or WholePageTuning())
    torch.cuda.synchronize()
    check_close(out, ref, f"{name} token-major")


def test_decode_wholepage_odd_strides_are_refused():
    """Neither head- nor token-major (slots 144 bytes apart): a clear error, never a wrong read."""
    prob, query, _ = _problem([100, 7], 16, 4, 128, 16, False, seed=5, sinks=False)
    odd = torch.zeros(*prob.kv_cache.shape[:3], 144, dtype=torch.uint8, device="cuda")[..., :136]
    with pytest.raises(UltraQuantError, match="whole 16-token runs"):
        decode_wholepage(query, odd, prob.block_table, prob.seq_lens, 0.1)


def test_decode_wholepage_jit_default_tuning():
    """The direct entry (Gluon JIT, default tuning) agrees with the routed one on one case."""
    _run("gqa4-hk8-b64-sinks", WholePageTuning())


@pytest.mark.parametrize("d", [128, 256])
def test_decode_wholepage_wide_dynamic_range(d):
    """V outliers 2**20 above the rest with almost no attention (the split-KV CPU/GPU case)."""
    from tests.test_kernels_attention import wide_range_problem

    query = torch.randn(3, 1, d, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    prob = wide_range_problem([3000, 64, 700], d, 32, query, device="cuda")
    query = query.cuda()
    ref = R.decode_attention(query.float(), prob.kv_cache, prob.block_table, prob.seq_lens, 0.125)
    out = torch.full_like(query, float("nan"))
    assert plans.plan_decode(query, prob.kv_cache, prob.block_table, prob.seq_lens, 0.125, None, None, None,
                             out).spec.kernel == "uq_decode_wholepage"
    uq.decode_attention(query, prob.kv_cache, prob.block_table, prob.seq_lens, 0.125, out=out)
    torch.cuda.synchronize()
    check_close(out, ref, "wide range")


def test_decode_wholepage_graph_replay_new_seq_lens_and_stream():
    """Capture once on a side stream, replay with other seq_lens (tickets reset themselves), through the
    routed public API (the case is the whole-page decode's: D=128, GQA 4, head-major)."""
    check_graph_replay_and_stream(uq.decode_attention)


@pytest.mark.parametrize("seed", [0, 1])
def test_decode_wholepage_bounds_contract(monkeypatch, seed):
    """Issue 17's contract on whole-page (one kv head: whole-page reads any layout whole): garbage block ids read as
    empty blocks, lengths clamped to the row, error bits set, guards and cache unchanged, 1 and 3
    splits (tests/bounds_cases.py's decode case through the routed API)."""
    from tests import bounds_cases

    monkeypatch.delenv("ULTRAQUANT_CHECK_VALUES", raising=False)
    p = bounds_cases.Problem("cuda", seed, hk=1, gqa=4, bs=16)
    assert plans.takes_wholepage(128, 4, 1, 16, tuple(p.cache.stride()), p.cache.device,
                          cache_aligned=p.cache.data_ptr() % 16 == 0)
    uq.check_errors()
    failures: list[str] = []
    for splits in (1, 3):
        bounds_cases.decode_case(p, failures, splits)
    assert failures == []


def test_pv_frags_transpose_the_score_layout():
    """``_pv_frags`` (the PV operand words by ``movmatrix``) on one warp against the fragment map it claims: in
    the score layout ``[1, 16 tokens, 8 rows]`` lane (g, t) holds tokens g, g + 8 x rows 2t, 2t + 1; its words
    must be the fp16 pairs (p[2t, g], p[2t + 1, g]), (p[2t + 8, g], p[2t + 9, g]) and the same of ``rel``."""
    import numpy as np
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from ultraquant.kernels.gluon.decode_wholepage import _iota3, _pv_frags

    @gluon.jit
    def frags_kernel(p_ptr, rel_ptr, out_ptr, out2_ptr):
        L: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1, 1], instr_shape=[1, 16, 8])
        off = _iota3(1, 0, L) * 128 + _iota3(16, 1, L) * 8 + _iota3(8, 2, L)
        p = gl.load(p_ptr + off)
        rel = gl.load(rel_ptr + off)
        gl.store(out_ptr + off, _pv_frags(p, rel, True))
        gl.store(out2_ptr + off, _pv_frags(p, rel, False))

    gen = torch.Generator().manual_seed(0)
    p = torch.rand(1, 16, 8, generator=gen).cuda()
    rel = (torch.randint(0, 31, (1, 16, 8), generator=gen, dtype=torch.int32) << 10).cuda()  # fp16 powers of two
    out = torch.zeros(1, 16, 8, dtype=torch.int32, device="cuda")
    out2 = torch.zeros_like(out)
    frags_kernel[(1,)](p, rel, out, out2, num_warps=1)
    words = out[0].cpu().numpy().astype(np.uint32)
    halves = np.stack([words & 0xFFFF, words >> 16], -1).astype(np.uint16)
    pf = p[0].cpu().numpy().astype(np.float16).view(np.uint16)
    rb = rel[0].cpu().numpy().astype(np.uint16)
    for g in range(8):
        for t in range(4):
            assert list(halves[g, 2 * t]) == [pf[2 * t, g], pf[2 * t + 1, g]], (g, t, "b0")
            assert list(halves[g, 2 * t + 1]) == [pf[2 * t + 8, g], pf[2 * t + 9, g]], (g, t, "b1")
            assert list(halves[g + 8, 2 * t]) == [rb[2 * t, g], rb[2 * t + 1, g]], (g, t, "rel0")
            assert list(halves[g + 8, 2 * t + 1]) == [rb[2 * t + 8, g], rb[2 * t + 9, g]], (g, t, "rel1")
    assert torch.equal(out2[0, :8], out[0, :8]) and not out2[0, 8:].any()
