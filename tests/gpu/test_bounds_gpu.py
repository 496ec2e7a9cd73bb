"""Garbage slot_mapping / block_table / seq_lens on the GPU (issue 17): negative, past the end,
2**31-1, -2**31 (2**32+5 in an int64 slot_mapping) through store, decode (1 and 3 splits), prefill
and dequant with value checks off. Guard bytes around the cache and the outputs unchanged, cache
bytes unchanged but the valid slots a store wrote, outputs equal to attention over the surviving
tokens, error bits set (tests/bounds_cases.py). The same cases run under compute-sanitizer memcheck
with ``python3 tests/gpu/sanitize.py --memcheck``."""

from __future__ import annotations

import pytest
import torch

from tests import bounds_cases

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/HIP GPU"),
]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_garbage_indices_stay_inside_the_cache(monkeypatch, seed):
    monkeypatch.delenv("ULTRAQUANT_CHECK_VALUES", raising=False)
    assert bounds_cases.run_all("cuda", seed) == []


def test_list_dequant_checks_values_it_reads_anyway(monkeypatch):
    """dequant_kv reads seq_lens on the host (its result's shapes): a garbage length or block id is an
    UltraQuantError there even with value checks off, not a huge allocation."""
    import ultraquant as uq

    monkeypatch.delenv("ULTRAQUANT_CHECK_VALUES", raising=False)
    cache = torch.zeros(4, 16, 1, uq.slot_size(64), dtype=torch.uint8, device="cuda")
    bt = torch.zeros(1, 2, dtype=torch.int32, device="cuda")
    with pytest.raises(uq.UltraQuantError, match="seq_lens"):
        uq.dequant_kv(cache, bt, torch.tensor([2**31 - 1], dtype=torch.int32, device="cuda"))
    with pytest.raises(uq.UltraQuantError, match="block_table"):
        uq.dequant_kv(cache, bt.fill_(7), torch.tensor([20], dtype=torch.int32, device="cuda"))
