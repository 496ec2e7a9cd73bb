"""The multi-query decode's plan, route and row mapping on the CPU (the Gluon kernel runs on the GPU only:
tests/gpu/test_spec_decode_gpu.py).

A torch model of the kernel's integer work split (M tiles of 16 (token, head) rows, each row's causal
limit and window start, the balanced schedule's pieces cut to the tiles' token range, the pieces' merge,
rows past a request's count left empty) is checked against ``reference.spec_decode_attention``, so a wrong limit,
tile range or piece bound fails here; the plan's grid, workspace, specialization and the routing rule
(``takes_multiquery``) are checked on shapes.
"""

from __future__ import annotations

import math

import pytest
import torch

import ultraquant as uq
from tests.helpers import make_paged
from ultraquant import reference as R
from ultraquant.errors import UltraQuantError
from ultraquant.kernels import catalog, plans
from ultraquant.kernels.families import decode_multiquery as mq
from ultraquant.kernels.families.decode_wholepage import wholepage_schedule

TT = 4 * 1 * 16  # tokens per stage at one tile per program (NSUB=4, 16-token runs) with WT=1 (8 kv heads); 16 at two


def _model(query, kv_cache, block_table, seq_lens, qsl, scale, max_tokens, programs, window=None, tt=TT,
           per_program=1, min_tokens=TT):
    """The kernel's work split in float64 torch: per tile group the whole-page decode's balanced schedule of
    the batch (``wholepage_schedule``, the window reach ``window + max_tokens``), each piece cut to the
    group's token range, the rows' online partials per piece merged like the last piece's program does.
    Mirrors uq_decode_multiquery's integer arithmetic (tok_first/tok_last/hi/lo of a program's
    ``per_program`` tiles, the piece bounds, row limits)."""
    n, hq, d = query.shape
    hk = kv_cache.shape[2]
    gqa = hq // hk
    rows = mq.MULTIQUERY_ROWS
    tiles = -(-mq.multiquery_tiles(gqa, max_tokens) // per_program) * per_program
    cap = block_table.shape[1] * kv_cache.shape[1]
    reach = None if window is None else min(window, cap) + max_tokens
    pieces = wholepage_schedule(seq_lens.tolist(), programs, tt, cap, reach, min_tokens)
    out = torch.zeros(n, hq, d, dtype=torch.float64)
    keys, values = R.dequant_kv(kv_cache, block_table, seq_lens)
    for b in range(seq_lens.shape[0]):
        length = int(seq_lens[b])
        q0 = int(qsl[b])
        n_new = min(max(int(qsl[b + 1]) - q0, 0), min(length, max_tokens))
        k_all, v_all = keys[b].double(), values[b].double()
        mine = [pc for pc in pieces if pc.request == b]
        assert [pc.program for pc in mine] == list(range(mine[0].first, mine[0].first + mine[0].parts))
        for tile in range(tiles):
            group = tile // per_program
            tok_first = group * per_program * rows // gqa
            tok_last = min(((group + 1) * per_program * rows - 1) // gqa, n_new - 1)
            hi = length - n_new + tok_last + 1 if tok_first < n_new else 0
            lo = 0
            if window is not None:
                lo = min(max(length - n_new + tok_first + 1 - window, 0), hi)
            lo_run = lo // tt * tt
            flat = tile * rows + torch.arange(rows)
            tok = flat // gqa
            valid = tok < n_new
            lim = torch.where(valid, length - n_new + tok + 1, 0)
            first = torch.clamp(lim - window, min=0) if window is not None else torch.zeros_like(lim)
            for h in range(hk):
                heads = h * gqa + flat % gqa
                qv = query[(q0 + tok).clamp(max=n - 1), heads].double() * valid[:, None]
                m_a = torch.full((rows,), -math.inf, dtype=torch.float64)
                l_a = torch.zeros(rows, dtype=torch.float64)
                acc = torch.zeros(rows, d, dtype=torch.float64)
                for pc in mine:
                    t_lo = max(pc.t_lo, lo_run)
                    t_hi = min(pc.t_hi, hi)
                    assert t_lo % tt == 0  # stages start on whole runs
                    if t_hi <= t_lo:
                        continue
                    ts = torch.arange(t_lo, t_hi)
                    s = qv @ k_all[t_lo:t_hi, h].T * scale
                    seen = (ts[None] < lim[:, None]) & (ts[None] >= first[:, None]) & valid[:, None]
                    s = s.masked_fill(~seen, -math.inf)
                    m = s.amax(1)
                    m_s = torch.where(m == -math.inf, 0.0, m)
                    p = torch.exp(s - m_s[:, None])
                    m_n = torch.maximum(m_a, m)
                    m_z = torch.where(m_n == -math.inf, 0.0, m_n)
                    a1, a2 = torch.exp(m_a - m_z), torch.exp(m - m_z)
                    acc = acc * a1[:, None] + (p @ v_all[t_lo:t_hi, h]) * a2[:, None]
                    l_a = l_a * a1 + p.sum(1) * a2
                    m_a = m_n
                o = torch.where(l_a[:, None] > 0, acc / l_a.clamp_min(1e-300)[:, None], 0.0)
                for r in range(rows):
                    if valid[r]:
                        out[q0 + int(tok[r]), int(heads[r])] = o[r]
    return out


def _step(lens, news, hq, hk, bs, seed):
    prob = make_paged(lens, hk, 128, bs, seed=seed, head_major=True)
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(sum(news), hq, 128, generator=gen)
    qsl = torch.tensor([0] + torch.tensor(news).cumsum(0).tolist(), dtype=torch.int32)
    return prob, query, qsl


@pytest.mark.parametrize("per_program", [1, 2])
@pytest.mark.parametrize("lens,news,hq,hk,bs,window,programs", [
    ([300, 17, 5, 64], [4, 1, 5, 16], 32, 8, 16, None, 3),        # GQA 4: 16 rows = 4 tokens per tile
    ([200, 40], [7, 16], 16, 2, 32, None, 2),                     # GQA 8: two tiles for 4+ tokens
    ([150, 33, 16], [3, 16, 16], 3, 1, 16, 20, 4),                # GQA 3: rows straddle tiles; window
    ([129, 70], [16, 2], 16, 1, 64, 7, 5),                        # GQA 16: one token per tile; tiny window
    ([90, 3], [0, 3], 4, 4, 16, None, 2),                         # an empty request
])
def test_row_mapping_model_matches_reference(lens, news, hq, hk, bs, window, programs, per_program):
    prob, query, qsl = _step(lens, news, hq, hk, bs, seed=len(lens) + hq)
    scale = 0.125
    want = R.spec_decode_attention(query, prob.kv_cache, prob.block_table, prob.seq_lens, qsl, scale,
                                   max_query_len=16, sliding_window=window)
    tt = TT if per_program == 1 else 16
    got = _model(query, prob.kv_cache, prob.block_table, prob.seq_lens, qsl, scale, 16, programs, window,
                 tt=tt, per_program=per_program, min_tokens=tt)
    assert torch.allclose(got, want.double(), atol=1e-5, rtol=1e-4), (got - want).abs().max()


def test_model_fails_on_a_wrong_limit():
    """The comparison can fail: a model whose request-0 rows sit one position later (so see one more
    token) differs from the reference."""
    prob, query, qsl = _step([100, 50], [4, 4], 8, 2, 16, seed=5)
    want = R.spec_decode_attention(query, prob.kv_cache, prob.block_table, prob.seq_lens, qsl, 0.125,
                                   max_query_len=4)
    later = prob.seq_lens.clone()
    later[0] += 1
    got = _model(query, prob.kv_cache, prob.block_table, later, qsl, 0.125, 4, 2)
    assert not torch.allclose(got[:4], want[:4].double(), atol=1e-5, rtol=1e-4)
    assert torch.allclose(got[4:], want[4:].double(), atol=1e-5, rtol=1e-4)


def test_spec_decode_equals_prefill_with_cache_rows():
    prob, query, qsl = _step([300, 17, 9], [4, 16, 2], 16, 4, 16, seed=2)
    a = uq.spec_decode_attention(query, prob.kv_cache, prob.block_table, prob.seq_lens, qsl, 0.1, max_query_len=16)
    ks, vs = R.dequant_kv(prob.kv_cache, prob.block_table, prob.seq_lens)
    news = qsl.diff().tolist()
    kk = torch.cat([k[len(k) - m:] for k, m in zip(ks, news, strict=True)])
    vv = torch.cat([v[len(v) - m:] for v, m in zip(vs, news, strict=True)])
    b = uq.prefill_attention(query, kk, vv, prob.kv_cache, prob.block_table, prob.seq_lens, qsl, 0.1)
    assert torch.allclose(a, b, atol=1e-5)


def test_spec_decode_rejects_counts_over_the_bound():
    prob, query, qsl = _step([300, 17], [4, 5], 8, 2, 16, seed=1)
    with pytest.raises(UltraQuantError, match="max_query_len"):
        uq.spec_decode_attention(query, prob.kv_cache, prob.block_table, prob.seq_lens, qsl, 0.1, max_query_len=4)
    with pytest.raises(UltraQuantError, match="max_query_len"):
        uq.spec_decode_attention(query, prob.kv_cache, prob.block_table, prob.seq_lens, qsl, 0.1, max_query_len=0)


def test_takes_multiquery_rule():
    cuda = torch.device("cuda")
    head = (16 * 8 * 136, 136, 16 * 136)  # head-major (block, token, head) byte strides at Hk 8, block 16
    tok = (16 * 8 * 136, 8 * 136, 136)
    assert plans.takes_multiquery(128, 4, 8, 16, head, cuda, 8) is True
    assert plans.takes_multiquery(128, 4, 8, 16, head, cuda, 16) is True
    assert plans.takes_multiquery(128, 4, 8, 16, head, cuda, 17) is False  # > 16 new tokens: prefill
    assert plans.takes_multiquery(128, 4, 8, 16, tok, cuda, 4) is False    # token-major: prefill
    assert plans.takes_multiquery(256, 4, 8, 16, head, cuda, 4) is False   # D=256: prefill
    assert plans.takes_multiquery(128, 17, 8, 16, head, cuda, 4) is False
    assert plans.takes_multiquery(128, 4, 3, 16, head, cuda, 4) is False
    assert plans.takes_multiquery(128, 4, 8, 8, head, cuda, 4) is False
    assert plans.takes_multiquery(128, 4, 8, 16, head, torch.device("cpu"), 4) is False
    assert plans.takes_multiquery(128, 4, 8, 16, head, cuda, 4, cache_aligned=False) is False


def test_cpu_never_takes_the_kernel():
    prob, query, _ = _step([64], [4], 32, 8, 16, seed=0)
    assert not uq.ops.spec_decode_takes_kernel(query, prob.kv_cache, 4)


@pytest.mark.parametrize("gqa,tokens,tiles", [(4, 4, 1), (4, 8, 2), (4, 2, 1), (8, 16, 8), (1, 16, 1),
                                              (3, 16, 3), (16, 1, 1), (16, 16, 16)])
def test_tiles(gqa, tokens, tiles):
    assert mq.multiquery_tiles(gqa, tokens) == tiles


def test_plan_shapes(monkeypatch):
    """Grid (tile groups, programs), one kernel per config whatever the count, the token bound an argument."""
    import ultraquant.kernels.families.decode_multiquery as fam
    import ultraquant.kernels.families.decode_wholepage as wp

    monkeypatch.setattr(wp, "num_sms", lambda device: 132)
    prob, query, qsl = _step([300, 17, 5, 64], [4, 1, 5, 8], 32, 8, 16, seed=4)
    out = torch.empty_like(query)
    p8 = fam.plan_decode_multiquery(query, prob.kv_cache, prob.block_table, prob.seq_lens, qsl, 8, 0.1, None, None,
                                    None, out)
    p4 = fam.plan_decode_multiquery(query, prob.kv_cache, prob.block_table, prob.seq_lens, qsl, 4, 0.1, None, None,
                                    None, out)
    p16 = fam.plan_decode_multiquery(query, prob.kv_cache, prob.block_table, prob.seq_lens, qsl, 16, 0.1, None,
                                     None, None, out)
    p12 = fam.plan_decode_multiquery(query, prob.kv_cache, prob.block_table, prob.seq_lens, qsl, 12, 0.1, None,
                                     None, None, out)
    # programs of 2 M tiles (each run's codes decoded once for both) from 2 tiles on; 12 tokens: 3 tiles -> 2
    assert p8.grid == (1, 132, 1) and p4.grid == (1, 132, 1) and p16.grid == (2, 132, 1) and p12.grid == (2, 132, 1)
    assert (p4.spec.constexprs["TILES"], p8.spec.constexprs["TILES"], p16.spec.constexprs["TILES"]) == (1, 2, 2)
    assert p8.spec.key() == p16.spec.key()  # the count bound is a run-time argument, not a constexpr
    assert p8.notes["tiles"] == 2 and p12.notes["tiles"] == 4
    names = list(p8.spec.signature)
    assert p8.args[names.index("max_tokens")] == 8 and p4.args[names.index("max_tokens")] == 4
    assert p8.args[names.index("qsl_ptr")] is qsl and p8.args[names.index("num_requests")] == 4
    c = p8.spec.constexprs
    assert (c["GQA"], c["HK"], c["WT"], c["D"], p8.spec.num_warps) == (4, 8, 1, 128, 8)
    assert p8.spec.kernel == "uq_decode_multiquery"
    assert catalog.BY_KERNEL["uq_decode_multiquery"].op == "spec_decode_attention"
    part, ml, counter = (p8.args[names.index(x)] for x in ("part_ptr", "ml_ptr", "counter_ptr"))
    assert part.numel() >= 2 * (132 + 4) * 8 * 16 * 128 and ml.numel() >= 2 * (132 + 4) * 8 * 2 * 16
    assert counter.numel() >= 2 * 4 * 8


def test_unsupported_words():
    assert mq.unsupported(dict(head_size=128, gqa=4, num_kv_heads=8, block_size=16, dtype="bf16")) == ""
    assert "D=128" in mq.unsupported(dict(head_size=256, gqa=4, num_kv_heads=8, block_size=16, dtype="bf16"))
    assert "fp32" in mq.unsupported(dict(head_size=128, gqa=4, num_kv_heads=8, block_size=16, dtype="fp32"))


def test_the_matrix_builds_the_plans_key(monkeypatch):
    """An sm_90 build config of the matrix row specializes to exactly the key the plan launches (so the
    runtime finds the blob), whatever the call's token count."""
    import ultraquant.kernels.families.decode_wholepage as wp
    from ultraquant.codegen import matrix

    monkeypatch.setattr(wp, "num_sms", lambda device: 132)
    sel = matrix.Selection(head_sizes=(128,), gqa=(4,), block_sizes=(16,), kv_heads=(8,),
                           ops=("spec_decode_attention",))
    points, skipped = matrix.expand(matrix.OPS, sel, "sm_90", ["triton"])
    assert len(points) == len(matrix.ATTENTION_FEATURES) * len(mq.MULTIQUERY_TILES) and not skipped
    plain = {p.config["tiles"]: catalog.specializer("spec_decode_attention")(**p.config) for p in points
             if not any(p.config[f] for f in ("has_sinks", "has_window", "has_softcap"))}
    prob, query, qsl = _step([300, 17], [4, 2], 32, 8, 16, seed=6)
    query = query.to(torch.bfloat16)
    for tokens, tiles in ((2, 1), (4, 1), (5, 2), (16, 2)):
        plan = plans.plan_spec_decode(query, prob.kv_cache, prob.block_table, prob.seq_lens, qsl, tokens, 0.1, None,
                                      None, None, torch.empty_like(query))
        assert plan.spec.key() == plain[tiles].key()
    assert matrix.expand(matrix.OPS, matrix.Selection(head_sizes=(256,), gqa=(4,), block_sizes=(16,), kv_heads=(8,),
                                                      ops=("spec_decode_attention",)), "sm_90", ["triton"])[0] == []



def test_model_specializations_plan_the_multiquery_decode(monkeypatch):
    """Warmup's planner lists the multi-query decode for a head-major cache on an NVIDIA GPU when asked
    (``spec_decode_attention`` in ``ops``), nothing where the rule does not take it."""
    from ultraquant import policy

    monkeypatch.setattr(policy, "_torch_device", lambda device: torch.device("cuda"))
    monkeypatch.setattr(plans, "target_of", lambda device: "cuda")
    head = (16 * 8 * 136, 136, 16 * 136)
    model = {"head_size": 128, "block_size": 16, "num_q_heads": 32, "num_kv_heads": 8, "has_sinks": True,
             "ops": ["spec_decode_attention"]}
    specs = policy.model_specializations({**model, "cache_strides": list(head)})
    assert [s.constexprs["TILES"] for s in specs] == [1, 2]
    for spec in specs:
        assert spec.kernel == "uq_decode_multiquery" and spec.constexprs["HAS_SINKS"] and spec.constexprs["GQA"] == 4
    assert policy.model_specializations(model) == []  # no cache strides: no rule to apply
    assert policy.model_specializations({**model, "head_size": 256, "cache_strides": [16 * 8 * 272, 272, 16 * 272]}) \
        == []


@pytest.mark.parametrize("hk,wt", [(1, 8), (2, 4), (4, 2), (8, 1), (16, 1)])
def test_row_merge_layout_loads_each_element_once(hk, wt):
    """The multi-query merge layout of [HK, 16, 128] partials tiles the tensor without repeats (no warp or lane
    loads another's elements), holds 16-byte runs of dims, and keeps a thread's row scalars (maxima, sums) to
    at most 2 rows, so two 64-value partials fit in flight at 8 kv heads."""
    pytest.importorskip("triton.experimental.gluon")
    from ultraquant.kernels.gluon.decode_multiquery import MQ_ROWS, _row_merge_layout

    nw, rows, d = hk * wt, MQ_ROWS.value, 128
    lay = _row_merge_layout(hk, rows, d, nw)
    (wh, wr, wd), (_, lr, ld), vec = lay.warps_per_cta, lay.threads_per_warp, lay.size_per_thread[2]
    assert wh * wr * wd == nw and lr * ld == 32 and lay.order == [2, 1, 0] and vec == 4
    assert wh <= hk and wr * lr <= rows and wd * ld * vec <= d  # one layout tile inside the tensor
    per_thread = hk * rows * d // (32 * nw)
    assert (hk // wh) * (rows // (wr * lr)) * (d // (wd * ld)) == per_thread
    assert rows // (wr * lr) <= 2
