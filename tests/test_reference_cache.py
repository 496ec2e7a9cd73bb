"""store_kv / dequant_kv through a paged cache: round trip, shuffled blocks, skipped slots, layouts."""

from __future__ import annotations

import pytest
import torch

import ultraquant as uq
from tests.helpers import make_paged
from ultraquant import reference as R


@pytest.mark.parametrize("head_major", [False, True])
@pytest.mark.parametrize(("head_size", "block_size"), [(32, 16), (64, 16), (128, 32)])
def test_round_trip_matches_quantize_dequantize(head_size: int, block_size: int, head_major: bool) -> None:
    lens = [1, block_size - 1, block_size + 1, 2 * block_size + 3]
    p = make_paged(lens, 2, head_size, block_size, seed=head_size + block_size, head_major=head_major)
    keys, values = R.dequant_kv(p.kv_cache, p.block_table, p.seq_lens)
    for i, n in enumerate(lens):
        k_expected = R.dequantize(*R.quantize(p.keys[i], rotate=True), rotate=True)
        v_expected = R.dequantize(*R.quantize(p.values[i], rotate=False), rotate=False)
        assert keys[i].shape == (n, 2, head_size)
        assert torch.allclose(keys[i], k_expected, atol=1e-6)
        assert torch.equal(values[i], v_expected)
        # 4-bit quantization keeps roughly 10-15% relative error on Gaussian data
        rel = (keys[i] - p.keys[i]).norm() / p.keys[i].norm()
        assert 0.05 < rel < 0.2


def test_slot_bytes_land_where_slot_mapping_says() -> None:
    d, hk, bs = 64, 3, 8
    cache = torch.zeros(5, bs, hk, uq.slot_size(d) + 4, dtype=torch.uint8)  # padded slots
    key, value = torch.randn(3, hk, d), torch.randn(3, hk, d)
    R.store_kv(key, value, cache, torch.tensor([17, -1, 0]))
    expected = R.encode_slots(key, value)
    assert torch.equal(cache[2, 1, :, : uq.slot_size(d)], expected[0])
    assert torch.equal(cache[0, 0, :, : uq.slot_size(d)], expected[2])
    touched = torch.zeros(5, bs, dtype=torch.bool)
    touched[2, 1] = touched[0, 0] = True
    assert int(cache[~touched].count_nonzero()) == 0  # skipped token and all other slots untouched
    assert int(cache[..., uq.slot_size(d):].count_nonzero()) == 0  # padding bytes untouched


def test_skipped_slots_keep_their_poison() -> None:
    d, hk, bs = 32, 1, 4
    cache = torch.randint(0, 256, (2, bs, hk, uq.slot_size(d)), dtype=torch.uint8)
    before = cache.clone()
    R.store_kv(torch.randn(4, hk, d), torch.randn(4, hk, d), cache, torch.tensor([-1, -5, -1, -100]))
    assert torch.equal(cache, before)


@pytest.mark.parametrize("encoder", ["rne", "upstream", "mse"])
def test_store_bf16_and_fp16_inputs(encoder: str) -> None:
    for dtype in (torch.bfloat16, torch.float16):
        p = make_paged([5, 9], 2, 64, 4, dtype=dtype, encoder=encoder)
        _, values = R.dequant_kv(p.kv_cache, p.block_table, p.seq_lens)
        c, s = R.quantize(p.values[1], rotate=False, encoder=encoder)
        assert torch.equal(values[1], R.dequantize(c, s, rotate=False))


def test_zero_length_request() -> None:
    p = make_paged([0, 3], 1, 32, 4)
    keys, values = R.dequant_kv(p.kv_cache, p.block_table, p.seq_lens)
    assert keys[0].shape == (0, 1, 32) and values[1].shape == (3, 1, 32)
