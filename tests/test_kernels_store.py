"""The Triton store and dequant kernels under TRITON_INTERPRET=1 against ultraquant.reference.

Store must write the reference's bytes: V exactly; K exactly too except where the butterfly and the
reference's matmul round a near-tie rotated element differently (at most a handful, each one code
step apart, see docs/kernels.md). Dequant must give the reference's K (both spaces) and V.
"""

from __future__ import annotations

import pytest
import torch

import ultraquant as uq
from tests.helpers import carved_cache, make_paged
from ultraquant import reference as R
from ultraquant.bench.decode import STORE_VARIANTS, store_variant_launch
from ultraquant.format import SlotLayout
from ultraquant.kernels import plans
from ultraquant.kernels.families import store as store_family
from ultraquant.kernels.interpret import interpreted_registry


@pytest.fixture(scope="module")
def registry():
    return interpreted_registry()


@pytest.fixture
def triton_backend(monkeypatch, registry):
    monkeypatch.setenv("ULTRAQUANT_BACKEND", "triton")
    return registry


ALIGNMENT_CASES = [
    (128, 0, 0, 8), (128, 4, 0, 4), (128, 2, 0, 2), (128, 1, 0, 1), (128, 0, 2, 2), (128, 0, 4, 4),
    (128, 8, 8, 8), (128, 0, 8, 16), (64, 0, 0, 4), (64, 2, 0, 2), (256, 0, 0, 16), (256, 4, 0, 4),
]
"""(head size, cache base offset from a 16-byte boundary, extra bytes per slot, the slot alignment the
plan must find): the store's ALIGN cases, dense and not (tests/gpu/test_kernels_gpu.py runs them too)."""


def assert_store_matches(got: torch.Tensor, ref: torch.Tensor, head_size: int, max_near_ties: int = 2) -> None:
    """Bytes equal, except rare K near-tie codes that may be one magnitude step apart."""
    lay = SlotLayout(head_size)
    assert torch.equal(got[..., lay.k_scales:], ref[..., lay.k_scales:]), "V bytes or K scales differ"
    kg = R.unpack_nibbles(got[..., : lay.k_scales]).to(torch.int32)
    kr = R.unpack_nibbles(ref[..., : lay.k_scales]).to(torch.int32)
    diff = kg != kr
    assert int(diff.sum()) <= max_near_ties, f"{int(diff.sum())} K codes differ"
    if diff.any():
        step = ((kg[diff] & 7) - (kr[diff] & 7)).abs()
        assert bool((step == 1).all()), "a differing K code is more than one step away"


def _random_kv(n: int, hk: int, d: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    key = (torch.randn(n, hk, d, generator=gen) * 2).to(dtype)
    value = torch.randn(n, hk, d, generator=gen).to(dtype)
    value[0, 0, :32] = 0  # an all-zero group -> byte 0, zero codes
    if n > 1:
        value[1, -1, 7] = float("nan")  # a non-finite group -> byte 0, zero codes
        key[1, 0, 3] = 1e-30  # tiny values next to normal ones
    return key, value


@pytest.mark.parametrize("encoder", ["rne", "upstream", "mse"])
@pytest.mark.parametrize("head_size", [64, 128])
def test_store_matches_reference(triton_backend, encoder, head_size):
    n, hk, bs = 19, 2, 16
    key, value = _random_kv(n, hk, head_size, torch.bfloat16, seed=head_size)
    poison = torch.randint(0, 256, (3, bs, hk, uq.slot_size(head_size)), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(1))
    slots = torch.randperm(3 * bs, generator=torch.Generator().manual_seed(2))[:n].long()
    slots[4] = -1  # padding: its slot must stay untouched
    got, ref = poison.clone(), poison.clone()
    uq.store_kv(key, value, got, slots, encoder=encoder)
    R.store_kv(key, value, ref, slots, encoder=encoder)
    assert_store_matches(got, ref, head_size)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_store_dtypes_int32_slots_head_major(triton_backend, dtype):
    n, hk, d, bs = 9, 3, 64, 16
    key, value = _random_kv(n, hk, d, dtype, seed=7)
    raw = torch.zeros(2, hk, bs, uq.slot_size(d), dtype=torch.uint8)
    got = raw.permute(0, 2, 1, 3)  # head-major physical layout, API shape
    ref = torch.zeros(2, bs, hk, uq.slot_size(d), dtype=torch.uint8)
    slots = torch.arange(3, 3 + n, dtype=torch.int32)
    uq.store_kv(key, value, got, slots)
    R.store_kv(key, value, ref, slots)
    assert_store_matches(got, ref, d)


def test_store_wider_slots_keep_padding(triton_backend):
    """slot_bytes > slot_size(D): the trailing bytes of each slot are never written."""
    n, hk, d = 5, 1, 64
    key, value = _random_kv(n, hk, d, torch.bfloat16, seed=3)
    got = torch.full((1, 16, hk, uq.slot_size(d) + 12), 0xAB, dtype=torch.uint8)
    ref = got.clone()
    slots = torch.arange(n)
    uq.store_kv(key, value, got, slots)
    R.store_kv(key, value, ref, slots)
    assert torch.equal(got[..., uq.slot_size(d):], ref[..., uq.slot_size(d):])
    assert_store_matches(got[..., : uq.slot_size(d)], ref[..., : uq.slot_size(d)], d)


@pytest.mark.parametrize("original_space", [True, False])
@pytest.mark.parametrize("head_major", [False, True])
def test_dequant_matches_reference(registry, original_space, head_major):
    d, hk, bs = 64, 2, 16
    prob = make_paged([0, 5, 40], hk, d, bs, seed=5, head_major=head_major)
    ref_k, ref_v = R.dequant_kv(prob.kv_cache, prob.block_table, prob.seq_lens)
    total = int(prob.seq_lens.sum())
    cu = torch.zeros(4, dtype=torch.int32)
    cu[1:] = torch.cumsum(prob.seq_lens, 0)
    k = torch.full((total, hk, d), float("nan"))
    v = torch.full((total, hk, d), float("nan"))
    uq.ops.dequant_kv_packed(prob.kv_cache, prob.block_table, prob.seq_lens, cu, k, v,
                             original_space=original_space)
    ref_k = torch.cat(ref_k).double()
    if not original_space:
        ref_k = ref_k @ uq.hadamard(d, dtype=torch.float64)
    torch.testing.assert_close(k.double(), ref_k, rtol=1e-6, atol=1e-6)
    assert torch.equal(v, torch.cat(ref_v))


def test_dequant_lists_through_public_op(triton_backend):
    prob = make_paged([3, 33], 1, 128, 32, seed=9)
    got_k, got_v = uq.dequant_kv(prob.kv_cache, prob.block_table, prob.seq_lens)
    ref_k, ref_v = R.dequant_kv(prob.kv_cache, prob.block_table, prob.seq_lens)
    assert [t.shape for t in got_k] == [t.shape for t in ref_k]
    for a, b in zip(got_k + got_v, ref_k + ref_v, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_store_plan_is_static(registry):
    """The plan's grid and constexprs depend on shapes and dtypes only."""
    key = torch.zeros(37, 4, 128, dtype=torch.bfloat16)
    cache = torch.zeros(4, 16, 4, uq.slot_size(128), dtype=torch.uint8)
    p = plans.plan_store(key, key, cache, torch.zeros(37, dtype=torch.int64), "upstream")
    assert p.grid == (-(-37 * 4 // p.spec.constexprs["BLOCK_R"]), 1, 1)
    assert p.spec.constexprs["ENCODER"] == 1
    assert p.spec.signature["key_ptr"] == "*bf16"


@pytest.mark.parametrize(("head_size", "encoder"), [(256, "rne"), (256, "mse"), (512, "upstream")])
def test_store_large_heads(triton_backend, head_size, encoder):
    """D=256/512 run with fewer rows per program (their register budget): same bytes."""
    n, hk, bs = 5, 2, 16
    key, value = _random_kv(n, hk, head_size, torch.bfloat16, seed=head_size + 1)
    got = torch.zeros(1, bs, hk, uq.slot_size(head_size), dtype=torch.uint8)
    ref = got.clone()
    slots = torch.randperm(bs, generator=torch.Generator().manual_seed(5))[:n].long()
    uq.store_kv(key, value, got, slots, encoder=encoder)
    R.store_kv(key, value, ref, slots, encoder=encoder)
    assert_store_matches(got, ref, head_size)


@pytest.mark.parametrize(("encoder", "d", "target"), [("rne", 64, "portable"), ("mse", 64, "portable"),
                                                     ("rne", 128, "cuda"), ("upstream", 256, "cuda")])
def test_store_many_programs_and_unaligned_strides(triton_backend, monkeypatch, encoder, d, target):
    """More rows than one program holds, and K/V row strides that are not multiples of 8 elements
    (views into wider tensors): the kernel's scalar-load branch must write the same bytes (also
    through NVIDIA's rows-over-lanes layout)."""
    monkeypatch.setattr(plans, "target_of", lambda device: target)
    n, hk, bs = 70, 2, 16
    key, value = _random_kv(n, hk, d, torch.float32, seed=11)
    wide_k = torch.zeros(n, hk, d + 3)
    wide_v = torch.zeros(n, hk, d + 5)
    wide_k[..., :d], wide_v[..., 1 : d + 1] = key, value
    key, value = wide_k[..., :d], wide_v[..., 1 : d + 1]
    assert key.stride(1) % 8 and value.stride(1) % 8
    nblocks = -(-n // bs) + 1
    got = torch.randint(0, 256, (nblocks, bs, hk, uq.slot_size(d)), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(3))
    ref = got.clone()
    slots = torch.randperm(nblocks * bs, generator=torch.Generator().manual_seed(4))[:n].long()
    plan = plans.plan_store(key, value, got, slots, encoder)
    assert plan.spec.constexprs["LANES"] == (4 if target == "cuda" else 0)
    triton_backend.jit_launch(plan)
    R.store_kv(key, value, ref, slots, encoder=encoder)
    assert_store_matches(got, ref, d)


LAUNCHES = [("portable", False), ("cuda", False), ("portable", True), ("cuda", True)]
"""(plans.target_of's answer, few_rows): the store's launch shapes (128 rows of 4 warps elsewhere, rows
over 4 lanes (LANES) or whole rows per thread at D=64 on NVIDIA, the few-rows layouts)."""


@pytest.mark.parametrize(("target", "few_rows"), LAUNCHES)
@pytest.mark.parametrize(("head_size", "offset", "extra", "align"), ALIGNMENT_CASES)
def test_store_alignment_fallback(registry, monkeypatch, head_size, offset, extra, align, target, few_rows):
    """The plan bakes the slot alignment of the call's cache (base address and strides) into ALIGN;
    a cache aligned less than the dense layout plans another specialization, whose narrower stores
    write the same bytes (and nothing past each slot's own bytes)."""
    monkeypatch.setattr(plans, "target_of", lambda device: target)
    n, hk, bs, nblocks = 37, 4, 16, 12
    key, value = _random_kv(n, hk, head_size, torch.bfloat16, seed=head_size + offset)
    got = carved_cache(nblocks, bs, hk, uq.slot_size(head_size) + extra, offset, seed=offset + extra)
    assert got.data_ptr() % 16 == offset % 16
    ref = got.clone()
    slots = torch.randperm(nblocks * bs, generator=torch.Generator().manual_seed(6))[:n].long()
    slots[5] = -1
    plan = plans.plan_store(key, value, got, slots, few_rows=few_rows)
    assert plan.spec.constexprs["ALIGN"] == align
    dense = store_family.store_spec(head_size=head_size, few_rows=few_rows, target=target)
    assert (plan.spec.key() == dense.key()) == (align == dense.constexprs["ALIGN"])
    registry.jit_launch(plan)
    R.store_kv(key, value, ref, slots)
    assert torch.equal(got[..., uq.slot_size(head_size):], ref[..., uq.slot_size(head_size):])
    assert_store_matches(got, ref, head_size)


@pytest.mark.parametrize("variant", STORE_VARIANTS)
def test_store_bench_variants_write_the_reference_bytes(registry, variant):
    """Every launch shape ``ultraquant bench --store-variants`` times is a correct store."""
    n, hk, d, bs, nblocks = 45, 8, 128, 16, 30
    key, value = _random_kv(n, hk, d, torch.bfloat16, seed=21)
    got = torch.randint(0, 256, (nblocks, bs, hk, uq.slot_size(d)), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(8))
    ref = got.clone()
    slots = torch.randperm(nblocks * bs, generator=torch.Generator().manual_seed(9))[:n].long()
    slots[2] = -1
    registry.jit_launch(store_variant_launch(key, value, got, slots, variant))
    R.store_kv(key, value, ref, slots)
    assert_store_matches(got, ref, d)


@pytest.mark.parametrize(("target", "few_rows"), LAUNCHES)
@pytest.mark.parametrize("encoder", ["rne", "upstream", "mse"])
def test_store_decision_points_exact(registry, monkeypatch, encoder, target, few_rows):
    """V groups whose absmax is 6 x 2**e (scale exactly 2**e) filled with every E2M1 decision point
    times 2**e, the float32 neighbours of each, zeros of both signs and subnormals, e from -126 to 120:
    the encoder's grid arithmetic must give the reference's V bytes exactly."""
    monkeypatch.setattr(plans, "target_of", lambda device: target)
    gen = torch.Generator().manual_seed(17)
    n, hk, d = 40, 4, 128
    points = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.5, 1.0, 4.0, 3.0])
    vals = torch.cat([points, torch.nextafter(points, torch.full_like(points, 9.0)),
                      torch.nextafter(points, torch.zeros_like(points)), torch.tensor([0.0, -0.0, 0.1, 5.9])])
    exps = torch.tensor([-126, -125, -120, -60, -1, 0, 1, 30, 100, 120])
    groups = vals[torch.randint(0, len(vals), (n * hk * d // 32, 32), generator=gen)]
    groups[:, 0] = 6.0
    signs = torch.where(torch.rand(groups.shape, generator=gen) < 0.5, -1.0, 1.0)
    scale = torch.ldexp(torch.ones(len(groups)), exps[torch.randint(0, len(exps), (len(groups),), generator=gen)])
    value = (groups * signs * scale[:, None]).reshape(n, hk, d)
    key = torch.randn(n, hk, d, generator=gen)
    got = torch.zeros(4, 16, hk, uq.slot_size(d), dtype=torch.uint8)
    ref = got.clone()
    slots = torch.randperm(64, generator=gen)[:n]
    registry.jit_launch(plans.plan_store(key, value, got, slots, encoder, few_rows=few_rows))
    R.store_kv(key, value, ref, slots, encoder=encoder)
    assert_store_matches(got, ref, d)
