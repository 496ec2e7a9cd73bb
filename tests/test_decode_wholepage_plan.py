"""the whole-page decode's plan rule, specialization and launch plan on the CPU (the Gluon kernel itself needs an
NVIDIA sm_90 GPU: tests/gpu/test_decode_wholepage_gpu.py; Triton's CPU interpreter does not run Gluon)."""

from __future__ import annotations

import pytest
import torch

from ultraquant.errors import UltraQuantError
from ultraquant.kernels.families.decode_wholepage import (
    WholePageTuning,
    decode_wholepage_spec,
    plan_decode_wholepage,
    whole_runs,
    wholepage_programs,
    wholepage_supports,
)


@pytest.mark.parametrize("d,gqa,hk,bs,runs,target,want", [
    (128, 4, 8, 64, True, "cuda", True),
    (128, 16, 1, 16, True, "cuda", True),
    (128, 1, 4, 128, True, "cuda", True),
    (256, 8, 2, 64, True, "cuda", True),    # D=256 with the rows in N
    (256, 16, 1, 64, True, "cuda", False),  # D=256, GQA > 8 -> split-KV
    (512, 4, 8, 64, True, "cuda", False),
    (64, 4, 8, 64, True, "cuda", False),
    (128, 32, 1, 64, True, "cuda", False),   # GQA > 16
    (128, 4, 16, 64, True, "cuda", False),   # Hk = 16
    (128, 4, 3, 64, True, "cuda", False),    # Hk not a power of two
    (128, 4, 8, 8, True, "cuda", False),     # block smaller than a 16-token run
    (128, 4, 8, 64, False, "cuda", False),   # token-major (runs not contiguous)
    (128, 4, 8, 64, True, "hip", False),     # AMD -> split-KV
    (128, 4, 8, 64, True, "portable", False),
])
def test_rule(d, gqa, hk, bs, runs, target, want):
    assert wholepage_supports(head_size=d, gqa=gqa, num_kv_heads=hk, block_size=bs, runs=runs, target=target) is want


def test_whole_runs():
    """Head-major pages: 16-token runs contiguous and 16-byte aligned; token-major or odd strides: not."""
    head_major = torch.zeros(4, 8, 64, 136, dtype=torch.uint8).permute(0, 2, 1, 3)
    token_major = torch.zeros(4, 64, 8, 136, dtype=torch.uint8)
    assert whole_runs(128, head_major.stride(), 8) and not whole_runs(128, token_major.stride(), 8)
    one_head = torch.zeros(4, 64, 1, 136, dtype=torch.uint8)
    assert whole_runs(128, one_head.stride(), 1)                        # one kv head: its runs are contiguous
    assert not whole_runs(128, (8 * 64 * 136 + 8, 136, 64 * 136), 8)   # blocks 8-byte aligned only
    assert not whole_runs(64, head_major.stride(), 8)                   # 136-byte slots are D=128's


def test_plan_rejects_odd_strides_and_bad_tuning():
    q = torch.randn(2, 8, 128)
    bt = torch.zeros(2, 4, dtype=torch.int32)
    odd = torch.zeros(10, 64, 2, 144, dtype=torch.uint8)[..., :136]  # slots 144 bytes apart: neither layout
    with pytest.raises(UltraQuantError, match="whole 16-token runs"):
        plan_decode_wholepage(q, odd, bt, torch.ones(2, dtype=torch.int32), 0.1, None, None, None, q.clone())
    for bad in (WholePageTuning(tw=32), WholePageTuning(stages=3), WholePageTuning(stages=1), WholePageTuning(nsub=3)):
        with pytest.raises(UltraQuantError, match="power-of-two"):
            decode_wholepage_spec(head_size=128, gqa=4, num_kv_heads=2, block_size=64, tuning=bad)


def test_spec_warps_and_ring():
    for hk in (1, 2, 4, 8):
        spec = decode_wholepage_spec(head_size=128, gqa=2, num_kv_heads=hk, block_size=64)
        assert spec.num_warps == 8 and spec.constexprs["HK"] * spec.constexprs["WT"] == 8
        assert spec.maxnreg is None and spec.constexprs["TW"] == 16 and "MATH" not in spec.constexprs
    spec = decode_wholepage_spec(head_size=128, gqa=4, num_kv_heads=8, block_size=64,
                          tuning=WholePageTuning(warps=16, nsub=1, stages=2, maxnreg=128))
    c = spec.constexprs
    assert (spec.num_warps, spec.maxnreg, c["NSUB"], c["STAGES"], c["TW"]) == (16, 128, 1, 2, 16)
    assert "ALIGN" not in c
    assert c["GQA_PAD"] == 4 and (c["ROWS"], c["ROWS_IN_N"]) == (8, True)


@pytest.mark.parametrize("d,gqa,rows_in_n,want", [
    (128, 1, True, (8, True)), (128, 8, True, (8, True)),  # query rows in the MMA N dimension: 8 of them
    (128, 9, True, (16, True)), (128, 16, True, (16, True)),  # more than 8 at D=128: two 8-row groups in N
    (128, 16, False, (16, False)), (128, 4, False, (16, False)),  # 16 M rows
    (256, 8, True, (8, True)),
])
def test_spec_rows(d, gqa, rows_in_n, want):
    c = decode_wholepage_spec(head_size=d, gqa=gqa, num_kv_heads=1, block_size=64,
                       tuning=WholePageTuning(rows_in_n=rows_in_n)).constexprs
    assert (c["ROWS"], c["ROWS_IN_N"]) == want


def test_plan_grid_and_workspace():
    b, hq, hk, d, bs = 3, 12, 4, 128, 32
    q = torch.randn(b, hq, d)
    cache = torch.zeros(40, hk, bs, 136, dtype=torch.uint8).permute(0, 2, 1, 3)
    bt = torch.zeros(b, 10, dtype=torch.int32)
    plan = plan_decode_wholepage(q, cache, bt, torch.ones(b, dtype=torch.int32), 0.1, None, None, None,
                                 torch.empty_like(q))
    programs = plan.notes["programs"]
    assert plan.grid == (programs, 1, 1) and programs == wholepage_programs(q.device)
    assert plan.args[13] == b  # num_requests, in the split count's slot
    part, ml, counter = plan.args[6], plan.args[7], plan.args[8]
    rows = plan.spec.constexprs["ROWS"]
    parts = (programs + b) * hk
    assert rows == 8 and part.numel() >= parts * rows * d and ml.numel() >= parts * 2 * rows
    assert counter.numel() >= b * hk
    forced = plan_decode_wholepage(q, cache, bt, torch.ones(b, dtype=torch.int32), 0.1, None, None, None,
                                   torch.empty_like(q), tuning=WholePageTuning(programs=5))
    assert forced.grid == (5, 1, 1)


def test_empty_kv_cache_is_head_major_and_whole_page():
    import ultraquant as uq
    from ultraquant.kernels.families.decode_wholepage import whole_runs

    cache = uq.empty_kv_cache(3, 16, 4, 128)
    assert cache.shape == (3, 16, 4, 136) and cache.dtype == torch.uint8 and int(cache.abs().sum()) == 0
    assert cache.stride() == (4 * 16 * 136, 136, 16 * 136, 1) and whole_runs(128, cache.stride(), 4)
    assert not whole_runs(128, torch.zeros(3, 16, 4, 136, dtype=torch.uint8).stride(), 4)


def test_slow_layout_warns_once(caplog):
    """Pages neither head- nor token-major (padded slots) at Hk > 1 on NVIDIA: one warning per stride
    pattern; head-major, token-major, one kv head, configs split-KV serves anyway, AMD: none."""
    from ultraquant.kernels import plans

    cuda = torch.device("cuda")
    padded = torch.zeros(5, 16, 4, 144, dtype=torch.uint8)[..., :136].stride()
    with caplog.at_level("WARNING", logger="ultraquant"):
        assert plans.warn_slow_layout(128, 4, 4, 16, padded, cuda)
        assert not plans.warn_slow_layout(128, 4, 4, 16, padded, cuda)  # once
    assert sum("empty_kv_cache" in r.getMessage() for r in caplog.records) == 1
    head_major = torch.zeros(5, 4, 16, 136, dtype=torch.uint8).permute(0, 2, 1, 3).stride()
    assert not plans.warn_slow_layout(128, 4, 4, 16, head_major, cuda)
    assert not plans.warn_slow_layout(128, 4, 4, 16, torch.zeros(5, 16, 4, 136, dtype=torch.uint8).stride(), cuda)
    assert not plans.warn_slow_layout(128, 4, 1, 16, torch.zeros(5, 16, 1, 136, dtype=torch.uint8).stride(), cuda)
    assert not plans.warn_slow_layout(64, 4, 4, 16, torch.zeros(5, 16, 4, 68, dtype=torch.uint8).stride(), cuda)
    assert not plans.warn_slow_layout(128, 4, 4, 16, padded, torch.device("cpu"))


@pytest.mark.parametrize("hk", [1, 2, 4, 8])
@pytest.mark.parametrize("rows", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("d,nw", [(128, 8), (256, 8), (128, 16)])
def test_merge_layout_loads_each_element_once(hk, rows, d, nw):
    """The last program's merge layout of [HK, rows, D] partials: every thread's elements are its own (no
    warp or lane repeats another's loads) whenever the tensor has at least 2 elements per thread, and one
    layout tile covers exactly the tensor (replicated loads went through L2 up to 8 times: ~20 us at GQA 16)."""
    pytest.importorskip("triton.experimental.gluon")
    from ultraquant.kernels.gluon.decode_wholepage import _merge_layout

    lay = _merge_layout(hk, rows, d, nw)
    wh, wr, wd = lay.warps_per_cta
    assert wh * wr * wd == nw and lay.threads_per_warp == [1, 1, 32] and lay.order == [2, 1, 0]
    covered = (wh, wr, wd * 32 * lay.size_per_thread[2])  # one tile of the layout
    if hk * rows * d >= 2 * 32 * nw:
        assert covered[0] <= hk and covered[1] <= rows and covered[2] <= d
        assert lay.size_per_thread[2] in (1, 2, 4)
