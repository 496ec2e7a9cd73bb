"""Garbage slot_mapping / block_table / seq_lens on the GPU (issue 17): negative, past the end,
2**31-1, -2**31 (2**32+5 in an int64 slot_mapping) through store, decode (1 and 3 splits), prefill
and dequant with value checks off. Guard bytes around the cache and the outputs unchanged, cache
bytes unchanged but the valid slots a store wrote, outputs equal to attention over the surviving
tokens, error bits set (tests/bounds_cases.py). The same cases run under compute-sanitizer memcheck
with ``python3 tools/h200_sanitize.py --memcheck``."""

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
