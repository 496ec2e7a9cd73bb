"""Bit-placement FP4 decode formulas (ultraquant/kernels/flydsl/fp4_bits.py) against the E2M1 table."""

from __future__ import annotations

import pytest
import torch

from ultraquant.format import E2M1_VALUES
from ultraquant.kernels.flydsl import fp4_bits as fb


def _words() -> torch.Tensor:
    """Every code at every element position (the others random), plus random words and edge words."""
    gen = torch.Generator().manual_seed(0)
    base = torch.randint(0, 2**32, (16 * 8 * 8,), generator=gen, dtype=torch.int64)
    rows = []
    for i, w in enumerate(base.tolist()):
        code, pos = (i // 8) % 16, i % 8
        rows.append((w & ~(0xF << (4 * pos))) | (code << (4 * pos)))
    edge = [0, 0xFFFFFFFF, 0x88888888, 0x77777777, 0x11111111, 0x99999999, 0x08080808, 0x80808080]
    return torch.tensor(rows + edge, dtype=torch.int64)


def _expected(words: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    codes = torch.stack([(words >> (4 * e)) & 0xF for e in range(8)], dim=1)
    return table[codes]


@pytest.mark.parametrize("kind", ["fp16", "fp8", "fp8_fnuz"])
def test_decode_words_match_e2m1(kind: str) -> None:
    words = _words()
    got = fb.decode_words_torch(words, kind)
    assert not torch.isnan(got).any(), "a code decoded to NaN (e4m3fnuz 0x80 is NaN: sign of zero)"
    torch.testing.assert_close(got, _expected(words), rtol=0, atol=0)


def test_negative_zero_is_not_fnuz_nan() -> None:
    x, y = fb.fp8_bytes(0x88888888, fnuz=True)
    assert x == 0 and y == 0
    x, y = fb.fp8_bytes(0x88888888, fnuz=False)
    assert x == 0x80808080 and y == 0x80808080  # OCP e4m3 keeps -0


def test_orders_are_permutations() -> None:
    assert sorted(c for pair in fb.FP16_ORDER for c in pair) == list(range(8))
    assert sorted(c for grp in fb.FP8_ORDER for c in grp) == list(range(8))


def test_scale_bits() -> None:
    for b in (0, 1, 2, 115, 127, 139, 252):
        v = torch.tensor([fb.scale_f32_bits(b)], dtype=torch.int32).view(torch.float32).item()
        assert v == (0.0 if b == 0 else 2.0 ** (b - 127))


@pytest.mark.parametrize("head_size", [128, 256])
def test_fp16_qk_path_matches_reference(head_size: int) -> None:
    """The fp16 QK path (bit-placed K words, scale after each group, 2**14 at the end) equals float64
    q.k over the reference dequantization, for scales 2**-12..2**12, zero groups and -0 codes."""
    from ultraquant.reference import dequantize

    gen = torch.Generator().manual_seed(1)
    t = 64
    codes = torch.randint(0, 256, (t, head_size // 2), generator=gen, dtype=torch.int64).to(torch.uint8)
    codes[0] = 0x88  # every code -0
    scales = torch.randint(115, 140, (t, head_size // 32), generator=gen, dtype=torch.int64).to(torch.uint8)
    scales[1, 0] = 0  # a zero group
    q = (torch.randn(head_size, generator=gen) * 3).to(torch.float16).float()
    got = fb.qk_scores_fp16(q, codes, scales).double()
    k = dequantize(codes, scales, rotate=False, dtype=torch.float64)
    want = k @ q.double()
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6 * want.abs().max().item())
