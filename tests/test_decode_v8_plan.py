"""Decode v8's plan rule, specialization and launch plan on the CPU (the Gluon kernel itself needs an
NVIDIA sm_90 GPU: tests/gpu/test_decode_v8_gpu.py; Triton's CPU interpreter does not run Gluon)."""

from __future__ import annotations

import pytest
import torch

from ultraquant.kernels.decode_v8_plan import V8Tuning, decode_v8_spec, plan_decode_v8, v8_splits, v8_supports


@pytest.mark.parametrize("d,gqa,hk,bs,align,target,want", [
    (128, 4, 8, 64, 8, "cuda", True),
    (128, 16, 1, 16, 8, "cuda", True),
    (128, 1, 4, 128, 16, "cuda", True),
    (256, 8, 2, 64, 16, "cuda", False),   # D != 128 -> v7
    (64, 4, 8, 64, 4, "cuda", False),
    (128, 32, 1, 64, 8, "cuda", False),   # GQA > 16
    (128, 4, 16, 64, 8, "cuda", False),   # Hk = 16
    (128, 4, 3, 64, 8, "cuda", False),    # Hk not a power of two
    (128, 4, 8, 8, 8, "cuda", False),     # block smaller than a 16-token group
    (128, 4, 8, 64, 4, "cuda", False),    # slots only 4-byte aligned
    (128, 4, 8, 64, 8, "hip", False),     # AMD -> v7
    (128, 4, 8, 64, 8, "portable", False),
])
def test_rule(d, gqa, hk, bs, align, target, want):
    assert v8_supports(head_size=d, gqa=gqa, num_kv_heads=hk, block_size=bs, align=align, target=target) is want


def test_spec_warps_and_ring():
    for hk in (1, 2, 4, 8):
        spec = decode_v8_spec(head_size=128, gqa=2, num_kv_heads=hk, block_size=64)
        assert spec.num_warps == 8 and spec.constexprs["HK"] * spec.constexprs["WT"] == 8
        assert spec.maxnreg is None and spec.constexprs["TW"] == 16 and spec.constexprs["MATH"]
    spec = decode_v8_spec(head_size=128, gqa=4, num_kv_heads=8, block_size=64, math=False,
                          tuning=V8Tuning(warps=16, nsub=1, stages=3, tw=32, maxnreg=128))
    c = spec.constexprs
    assert (spec.num_warps, spec.maxnreg, c["NSUB"], c["STAGES"], c["TW"], c["MATH"]) == (16, 128, 1, 3, 32, False)
    assert spec.constexprs["GQA_PAD"] == 4 and spec.constexprs["ROWS"] == 16


def test_plan_grid_and_workspace():
    b, hq, hk, d, bs = 3, 12, 4, 128, 32
    q = torch.randn(b, hq, d)
    cache = torch.zeros(40, hk, bs, 136, dtype=torch.uint8).permute(0, 2, 1, 3)
    bt = torch.zeros(b, 10, dtype=torch.int32)
    plan = plan_decode_v8(q, cache, bt, torch.ones(b, dtype=torch.int32), 0.1, None, None, None, torch.empty_like(q))
    splits = plan.notes["num_splits"]
    assert plan.grid == (b, 1, splits) and splits == v8_splits(b, 10 * bs, q.device)
    wt = plan.spec.constexprs["WT"]
    part, ml, counter = plan.args[6], plan.args[7], plan.args[8]
    assert part.numel() >= b * hk * splits * wt * 16 * d and ml.numel() >= b * hk * splits * wt * 32
    assert counter.numel() >= b * hk and plan.spec.constexprs["ALIGN"] == 8
    forced = plan_decode_v8(q, cache, bt, torch.ones(b, dtype=torch.int32), 0.1, None, None, None,
                            torch.empty_like(q), tuning=V8Tuning(splits=5))
    assert forced.grid == (b, 1, 5)
