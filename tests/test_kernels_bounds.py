"""Out-of-range slot_mapping / block_table / seq_lens values reach the Triton kernels (interpreter)
and never make them read or write outside the cache (issue 17).

The cache is carved out of a larger buffer whose guard bytes around it are poison (0xF7: scale byte
2**120, codes +-6): a write past either end changes a guard byte, and a read of one turns the
attention output into inf/NaN or far from the expected values. Value checks run on CPU tensors, so
these tests launch the plans directly (what a GPU call with ULTRAQUANT_CHECK_VALUES unset does).
The first tests use ids just outside the cache (a faulty kernel then fails on poison instead of
crashing the interpreter); the last runs tests/bounds_cases.py, the GPU test's random garbage with the
int32 extremes, here under the interpreter.
"""

from __future__ import annotations

import pytest
import torch

import ultraquant as uq
from tests.helpers import fill_cache, guarded, guards_intact
from tests.test_kernels_store import assert_store_matches
from ultraquant import reference as R
from ultraquant.kernels import plans
from ultraquant.kernels.flags import KernelError
from ultraquant.kernels.interpret import interpreted_registry

D, HK, HQ, BS, NB = 64, 1, 2, 16, 4
POISON = 0xF7


@pytest.fixture(scope="module")
def registry():
    return interpreted_registry()


@pytest.fixture(autouse=True)
def _clean_flags(registry):
    uq.check_errors()
    yield
    uq.check_errors()


def guarded_cache(seed: int = 0):
    """A (NB, BS, HK, slot) cache full of valid random K/V with two blocks of poison on each side."""
    cache, whole = guarded((NB, BS, HK, uq.slot_size(D)), torch.uint8, POISON, 2 * BS * HK * uq.slot_size(D))
    fill_cache(cache, D, seed)
    return cache, whole


def close(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert torch.isfinite(got).all(), "a poison byte was read"
    rel = float((got.double() - ref.double()).norm() / ref.double().norm())
    assert rel < 1e-2, f"rel {rel:.2e}"


def test_store_skips_slots_outside_the_cache(registry):
    cache, whole = guarded_cache()
    n_slots = NB * BS
    slots = torch.tensor([3, n_slots, n_slots + 20, -1, 17, -5, n_slots + BS], dtype=torch.int64)
    gen = torch.Generator().manual_seed(1)
    key = torch.randn(len(slots), HK, D, generator=gen).to(torch.bfloat16)
    value = torch.randn(len(slots), HK, D, generator=gen).to(torch.bfloat16)
    ref = cache.clone()
    R.store_kv(key[[0, 4]], value[[0, 4]], ref, slots[[0, 4]])
    registry.jit_launch(plans.plan_store(key, value, cache, slots))
    assert guards_intact(whole, cache, POISON), "the store wrote outside the cache"
    assert_store_matches(cache, ref, D)  # slots 3 and 17 written, every other byte unchanged
    assert uq.check_errors() == KernelError.SLOT_OUT_OF_RANGE
    assert uq.check_errors() == 0  # reading resets


def _decode_problem():
    cache, whole = guarded_cache(seed=2)
    # wider table than its view: column 3 lies past every row (seq_lens beyond the row must not reach it)
    full = torch.tensor([[0, -1, 2, NB], [1, NB, 3, NB + 1], [3, 1, 0, NB]], dtype=torch.int32)
    bt = full[:, :3]
    seq = torch.tensor([48, 40, 3 * BS + 10], dtype=torch.int32)
    # what the kernels must compute: bad blocks are empty, the third length is clamped to the row
    ok_bt = torch.tensor([[0, 2, 0], [1, 3, 0], [3, 1, 0]], dtype=torch.int32)
    ok_seq = torch.tensor([32, 24, 48], dtype=torch.int32)
    return cache, whole, bt, seq, ok_bt, ok_seq


@pytest.mark.parametrize("splits", [1, 2])
def test_decode_reads_nothing_outside_the_cache(registry, splits):
    cache, whole, bt, seq, ok_bt, ok_seq = _decode_problem()
    query = torch.randn(3, HQ, D, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    out = torch.full_like(query, float("nan"))
    plan = plans.plan_decode(query, cache, bt, seq, D**-0.5, None, None, None, out,
                             plans.Tuning(decode_splits=splits))
    registry.jit_launch(plan)
    close(out, R.decode_attention(query, cache, ok_bt, ok_seq, D**-0.5))
    assert guards_intact(whole, cache, POISON)
    assert uq.check_errors() == KernelError.BLOCK_OUT_OF_RANGE | KernelError.SEQ_LEN_OUT_OF_RANGE


def test_valid_inputs_raise_no_flag(registry, monkeypatch):
    """The public ops on valid input (the Triton kernels, not the reference) leave every word at 0."""
    monkeypatch.setenv("ULTRAQUANT_BACKEND", "triton")
    cache, _, _, _, ok_bt, ok_seq = _decode_problem()
    query = torch.randn(3, HQ, D, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    out = torch.full_like(query, float("nan"))
    uq.decode_attention(query, cache, ok_bt, ok_seq, D**-0.5, out=out)
    close(out, R.decode_attention(query, cache, ok_bt, ok_seq, D**-0.5))
    key = torch.randn(2, HK, D, dtype=torch.bfloat16)
    uq.store_kv(key, key, cache, torch.tensor([5, -1]))
    k, _ = uq.dequant_kv(cache, ok_bt, ok_seq)
    assert all(torch.isfinite(t).all() for t in k)
    assert uq.check_errors() == 0


def test_prefill_reads_nothing_outside_the_cache(registry):
    cache, whole = guarded_cache(seed=5)
    gen = torch.Generator().manual_seed(6)
    q_len = 3
    query = torch.randn(q_len, HQ, D, generator=gen).to(torch.bfloat16)
    key = torch.randn(q_len, HK, D, generator=gen).to(torch.bfloat16)
    value = torch.randn(q_len, HK, D, generator=gen).to(torch.bfloat16)
    qsl = torch.tensor([0, q_len], dtype=torch.int32)
    bt = torch.tensor([[0, NB, 2, 3]], dtype=torch.int32)  # the second block is outside the cache
    seq = torch.tensor([40 + q_len], dtype=torch.int32)
    out = torch.full_like(query, float("nan"))
    registry.jit_launch(plans.plan_prefill(query, key, value, cache, bt, seq, qsl, D**-0.5, None, None, None, out))
    ok_bt = torch.tensor([[0, 2, 3, 0]], dtype=torch.int32)
    close(out, R.prefill_attention(query, key, value, cache, ok_bt, seq - BS, qsl, D**-0.5))
    assert uq.check_errors() == KernelError.BLOCK_OUT_OF_RANGE
    # a length past the row: clamped, the row's tail never read, the flag says so
    bt2 = torch.tensor([[0, 1, 2, 3, NB]], dtype=torch.int32)[:, :4]
    seq2 = torch.tensor([4 * BS + 9], dtype=torch.int32)
    out2 = torch.full_like(query, float("nan"))
    registry.jit_launch(plans.plan_prefill(query, key, value, cache, bt2, seq2, qsl, D**-0.5, None, None, None,
                                           out2))
    assert torch.isfinite(out2).all()
    assert uq.check_errors() == KernelError.SEQ_LEN_OUT_OF_RANGE
    assert guards_intact(whole, cache, POISON)


def test_dequant_reads_and_writes_nothing_outside(registry):
    cache, whole = guarded_cache(seed=7)
    bt = torch.tensor([[0, -1, 2], [3, NB, 1]], dtype=torch.int32)
    seq = torch.tensor([40, 40], dtype=torch.int32)
    rows = 70  # request 1 starts at row 40: its rows 70..79 would be past the outputs
    cu = torch.tensor([0, 40, 80], dtype=torch.int32)
    k_out, k_whole = guarded((rows, HK, D), torch.float32, 1234.0, 256)
    v_out, v_whole = guarded((rows, HK, D), torch.float32, 1234.0, 256)
    registry.jit_launch(plans.plan_dequant(cache, bt, seq, cu, k_out, v_out, D))
    assert guards_intact(k_whole, k_out, 1234.0), "dequant wrote past its outputs"
    assert guards_intact(v_whole, v_out, 1234.0), "dequant wrote past its outputs"
    assert guards_intact(whole, cache, POISON)
    keys, values = R.dequant_kv(cache, torch.tensor([[0, 0, 2], [3, 0, 1]], dtype=torch.int32), seq)
    for k_got, k_ref in ((k_out, keys), (v_out, values)):
        assert torch.isfinite(k_got).all()
        assert torch.allclose(k_got[:16], k_ref[0][:16], atol=1e-5)
        assert bool((k_got[16:32] == 0).all())  # the bad block reads as empty
        assert torch.allclose(k_got[32:40], k_ref[0][32:40], atol=1e-5)
        assert bool((k_got[40:70] == 1234.0).all())  # request 1's tile reaches past the end: not written
    assert uq.check_errors() == KernelError.BLOCK_OUT_OF_RANGE | KernelError.SEQ_LEN_OUT_OF_RANGE


def test_garbage_cases_of_the_gpu_suite_hold_under_the_interpreter(registry, monkeypatch):
    """tests/bounds_cases.py (the GPU test's and the sanitizer's cases, int32 extremes included)."""
    monkeypatch.setenv("ULTRAQUANT_BACKEND", "triton")
    from tests import bounds_cases

    assert bounds_cases.run_all("cpu") == []
