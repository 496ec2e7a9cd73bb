"""Known vectors worked out by hand from docs/format.md (not produced by the code under test).

A group whose absmax is 6.0 has t = 0.156 * 6 = 0.936, log2(t) = -0.095, so exp = 0, scale byte 127
and s = 1: every other element is encoded as itself. Groups are padded with zeros to 32 elements.
"""

from __future__ import annotations

import math

import pytest
import torch

import ultraquant as uq
from ultraquant import reference as R


def one_group(values: list[float], anchor: float = 6.0) -> torch.Tensor:
    """A 32-element group: ``anchor`` first (fixes the scale), then ``values``, then zeros."""
    g = [anchor] + list(values)
    return torch.tensor(g + [0.0] * (32 - len(g)), dtype=torch.float32)


def codes_of(x: torch.Tensor, encoder: str = "rne") -> list[int]:
    packed, _ = R.quantize(x, rotate=False, encoder=encoder)
    out = []
    for byte in packed.tolist():
        out += [byte & 0xF, byte >> 4]
    return out


def test_slot_sizes_and_offsets() -> None:
    assert [uq.slot_size(d) for d in (32, 64, 128, 256, 512)] == [34, 68, 136, 272, 544]
    lay = uq.format.SlotLayout(256)
    assert (lay.k_codes, lay.k_scales, lay.v_codes, lay.v_scales, lay.size) == (0, 128, 136, 264, 272)


@pytest.mark.parametrize("bad", [0, 16, 48, 96, 100, -64, 64.0])
def test_slot_size_rejects_bad_head_sizes(bad: object) -> None:
    with pytest.raises(uq.UltraQuantError, match="head_size"):
        uq.slot_size(bad)


def test_every_code_and_nibble_order() -> None:
    levels = [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    x = one_group(levels)
    expected = [7, 1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 14, 15] + [0] * 17
    for enc in ("rne", "upstream"):
        assert codes_of(x, enc) == expected
    packed, scales = R.quantize(x, rotate=False)
    assert scales.tolist() == [127]
    assert packed[0].item() == 0x17  # element 0 (code 7) low nibble, element 1 (code 1) high nibble
    assert packed[1].item() == 0x32
    # -0.0 and values rounding to zero are code 0, never 8
    assert codes_of(one_group([-0.0, -0.1, 0.1]))[:4] == [7, 0, 0, 0]


# (value, rne code, upstream code): ties at every decision point, both signs.
TIES = [
    (0.25, 0, 0), (-0.25, 0, 9),
    (0.75, 2, 1), (-0.75, 10, 10),
    (1.25, 2, 2), (-1.25, 10, 11),
    (1.75, 4, 3), (-1.75, 12, 12),
    (2.5, 4, 4), (-2.5, 12, 13),
    (3.5, 6, 5), (-3.5, 14, 14),
    (5.0, 6, 6), (-5.0, 14, 15),
]


@pytest.mark.parametrize(("value", "rne", "upstream"), TIES)
def test_tie_points(value: float, rne: int, upstream: int) -> None:
    x = one_group([value])
    assert codes_of(x, "rne")[1] == rne
    assert codes_of(x, "upstream")[1] == upstream


def test_just_off_ties_round_to_nearest() -> None:
    eps = 2.0**-20
    x = one_group([0.25 + eps, 0.75 - eps, 5.0 + eps, -(5.0 + eps), -(0.25 + eps)])
    for enc in ("rne", "upstream"):
        assert codes_of(x, enc)[1:6] == [1, 1, 7, 15, 9]


def test_saturation() -> None:
    # absmax 9: t = 1.404, log2 = 0.49, exp = floor(0.99) = 0 -> s = 1; 7 and 9 saturate to 6.
    x = one_group([7.0, -9.0, 5.5], anchor=9.0)
    _, scales = R.quantize(x, rotate=False)
    assert scales.tolist() == [127]
    assert codes_of(x)[:4] == [7, 7, 15, 7]


def test_scale_steps_with_magnitude() -> None:
    # absmax 12: t = 1.872, log2 = 0.904, exp = floor(1.404) = 1 -> byte 128, s = 2.
    x = one_group([3.0, -1.0], anchor=12.0)
    packed, scales = R.quantize(x, rotate=False)
    assert scales.tolist() == [128]
    assert codes_of(x)[:3] == [7, 3, 9]  # 12/2 = 6, 3/2 = 1.5, -1/2 = -0.5


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_groups_are_zero_groups(poison: float) -> None:
    x = torch.cat([one_group([1.0, poison]), one_group([1.0])])
    packed, scales = R.quantize(x, rotate=False)
    assert scales.tolist() == [0, 127]
    assert packed[:16].tolist() == [0] * 16
    assert R.dequantize(packed, scales, rotate=False)[:32].tolist() == [0.0] * 32


def test_zero_group() -> None:
    packed, scales = R.quantize(torch.zeros(64), rotate=False)
    assert scales.tolist() == [0, 0] and packed.tolist() == [0] * 32
    assert R.dequantize(packed, scales, rotate=False).tolist() == [0.0] * 64


def test_exponent_clamp_low_end_and_tiny_values() -> None:
    # absmax 1e-38: t = 1.56e-39 is a float32 subnormal -> exp clamps to -126, byte 1.
    x = one_group([5e-39], anchor=1e-38)
    packed, scales = R.quantize(x, rotate=False)
    assert scales.tolist() == [1]
    # y = 1e-38 * 2**126 = 0.8507 -> code 2 (1.0); 5e-39 * 2**126 = 0.425 -> code 1 (0.5)
    assert codes_of(x)[:2] == [2, 1]
    # absmax 2**-120: log2(t) = -122.68, exp = floor(-122.18) = -123 -> byte 4
    _, scales = R.quantize(one_group([], anchor=2.0**-120), rotate=False)
    assert scales.tolist() == [4]


def test_exponent_high_end() -> None:
    # The largest float32 gives log2(t) = 125.32 -> exp 125 -> byte 252: the clamp at 127 cannot be
    # reached from finite float32 input, and byte 255 is never written.
    big = torch.finfo(torch.float32).max
    _, scales = R.quantize(one_group([], anchor=big), rotate=False)
    assert scales.tolist() == [252]
    assert R.upstream_exponent(torch.tensor([big])).item() == 125


def test_scale_exponent_matches_float64_log2_rule() -> None:
    gen = torch.Generator().manual_seed(0)
    amax = torch.exp2(torch.empty(200_000).uniform_(-120, 120, generator=gen)).float()
    t = (amax * torch.tensor(0.156, dtype=torch.float32)).double()
    expected = torch.floor(torch.log2(t) + 0.5).clamp(-126, 127).to(torch.int32)
    assert torch.equal(R.upstream_exponent(amax), expected)


def test_sqrt2_boundary_is_exact() -> None:
    # t just below / at the float32 values around 2**0.5: the mantissa rule decides exactly.
    below = torch.tensor(math.sqrt(2) - 2e-7, dtype=torch.float32)  # 1.4142134
    above = torch.nextafter(torch.tensor(math.sqrt(2), dtype=torch.float32), torch.tensor(2.0))
    for t, exp in ((below, 0), (above, 1)):
        amax = t / torch.tensor(0.156, dtype=torch.float32)
        t_real = (amax * torch.tensor(0.156, dtype=torch.float32)).double().item()
        assert R.upstream_exponent(amax.reshape(1)).item() == math.floor(math.log2(t_real) + 0.5)
        assert (math.floor(math.log2(t_real) + 0.5) == exp) or abs(t_real - math.sqrt(2)) < 1e-6


def test_dequantize_values_by_hand() -> None:
    # byte 0x21 = codes 1 (0.5) then 2 (1.0); scale byte 129 -> s = 4
    packed = torch.tensor([0x21] + [0] * 15, dtype=torch.uint8)
    scales = torch.tensor([129], dtype=torch.uint8)
    assert R.dequantize(packed, scales, rotate=False)[:3].tolist() == [2.0, 4.0, 0.0]


def test_hadamard() -> None:
    for d in (32, 64, 128, 256, 512):
        h = uq.hadamard(d)
        assert h.dtype == torch.float32 and h.shape == (d, d)
        assert torch.allclose(h, h.T, atol=0, rtol=0)
        assert torch.allclose(h @ h, torch.eye(d), atol=1e-6)
        assert torch.all((h.abs() - 1 / math.sqrt(d)).abs() < 1e-7)
    h4 = uq.hadamard(32, dtype=torch.float64)[:4, :4] * math.sqrt(32)
    assert h4.tolist() == [[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]]
    with pytest.raises(uq.UltraQuantError):
        uq.hadamard(48)


def test_rotation_is_applied_to_k() -> None:
    # 8 * e_0 rotates to H's first row times 8/sqrt(64): a flat vector of 1.0. Its groups have
    # absmax 1: log2(0.156) = -2.68, exp = floor(-2.18) = -3, s = 1/8, y = 8 saturates to 6, so
    # every element dequantizes to 0.75 (upstream's clipped top), and un-rotating gives 6 e_0.
    x = torch.zeros(64)
    x[0] = 8.0
    packed, scales = R.quantize(x, rotate=True)
    assert scales.tolist() == [124, 124]
    assert R.dequantize(packed, scales, rotate=False).tolist() == [0.75] * 64
    back = R.dequantize(packed, scales, rotate=True)
    assert torch.allclose(back, 6.0 * torch.nn.functional.one_hot(torch.tensor(0), 64).float(), atol=1e-6)
