"""The MFMA operand maps (ultraquant/kernels/flydsl/operand_maps.py) against tables derived from AMD's
own public sources, not from the maps' bases.

- ``tests/data/amd_mfma/calculator_cdna3_v_mfma_f32_16x16x16_{bf16,f16}_{A,B,D}.csv``: the verbatim output of
  ``matrix_calculator.py -a CDNA3 -i v_mfma_f32_16x16x16_{bf16,f16} -{A,B,D} --matrix-layout --csv``,
  ROCm/amd_matrix_instruction_calculator 1.3.2 (commit 2ef9189). The calculator has no CDNA4 tables.
- The scaled MFMA's FP4/FP8 operands: the address arithmetic the sources state, re-expressed here in
  their own terms (byte offsets inside a row of A) - ROCm/aiter op_tests/opus/device/test_mfma_scale.cu
  (FP4 16x16x128), ROCm/FlyDSL kernels/gemm/mxfp4_preshuffle.py (FP8 16x16x128 in an FP8 x FP4 GEMM),
  ROCm/triton LinearLayoutConversions.cpp (the scale operand's lane bases).
"""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest
import torch

from ultraquant.kernels.flydsl import operand_maps as om

DATA = Path(__file__).parent / "data" / "amd_mfma"
_ENTRY = re.compile(r"^([ABD])\[(\d+)\]\[(\d+)\]$")


def _calculator(matrix: str, fmt: str = "bf16") -> torch.Tensor:
    """(64, elements, 2) [i, j] indices of ``matrix[i][j]`` per (lane, register slice), as printed."""
    path = DATA / f"calculator_cdna3_v_mfma_f32_16x16x16_{fmt}_{matrix}.csv"
    assert f"V_MFMA_F32_16X16X16_{fmt.upper()}" in path.read_text().splitlines()[1]
    rows = [r for r in csv.reader(path.read_text().splitlines()) if r and r[0].isdigit()]
    assert [int(r[0]) for r in rows] == list(range(64))
    out = []
    for r in rows:
        cells = [_ENTRY.match(c) for c in r[1:]]
        assert all(m and m.group(1) == matrix for m in cells), r
        out.append([(int(m.group(2)), int(m.group(3))) for m in cells])
    return torch.tensor(out)


def test_bf16_a_matches_the_calculator():
    # calculator A[i][k] = (row, k): the map's (mn, k) directly
    assert torch.equal(om.BF16_A.table(), _calculator("A"))


def test_bf16_b_matches_the_calculator():
    # calculator B[k][j]; the map stores (col, k)
    assert torch.equal(om.BF16_B.table(), _calculator("B").flip(-1))


def test_f32_d_matches_the_calculator():
    assert torch.equal(om.F32_D.table(), _calculator("D"))


def test_f16_maps_match_the_calculator():
    """v_mfma_f32_16x16x16_f16 (the fp16 path's QK and PV): its own calculator tables."""
    assert torch.equal(om.F16_A.table(), _calculator("A", "f16"))
    assert torch.equal(om.F16_B.table(), _calculator("B", "f16").flip(-1))
    assert torch.equal(om.F32_D.table(), _calculator("D", "f16"))


def test_scaled_d_is_the_store_loop_of_aiter():
    """aiter's 16x16x128 test stores c_reg[i] to C[(lane/16)*4 + i][lane % 16]."""
    want = torch.tensor([[[(lane // 16) * 4 + i, lane % 16] for i in range(4)] for lane in range(64)])
    assert torch.equal(om.F32_D.table(), want)


def _fp4_from_aiter() -> torch.Tensor:
    """aiter's FP4 16x16x128 A loader: lane reads the 16 bytes at ``row lane%16, byte (lane/16)*16 + i``
    of a row of K/2 = 64 bytes; a byte holds element 2*byte in its low nibble (fp4_extract idx 0)."""
    out = []
    for lane in range(64):
        row, first_byte = lane % 16, (lane // 16) * 16
        elems = []
        for i in range(16):
            byte_in_row = first_byte + i
            elems += [(row, 2 * byte_in_row), (row, 2 * byte_in_row + 1)]  # low nibble, high nibble
        out.append(elems)
    return torch.tensor(out)


def _fp4_b_from_aiter() -> torch.Tensor:
    """aiter's FP4 16x16x128 B loader: lane (col lane%16) byte i packs rows 32*(lane/16) + 2i (low) and
    + 2i + 1 (high). Coordinates (col, k)."""
    return torch.tensor([[(lane % 16, 32 * (lane // 16) + 2 * i + h) for i in range(16) for h in (0, 1)]
                         for lane in range(64)])


def test_fp4_matches_aiter_a_and_b_loaders():
    assert torch.equal(om.FP4.table(), _fp4_from_aiter())
    assert torch.equal(om.FP4.table(), _fp4_b_from_aiter())


def _fp8_from_flydsl() -> torch.Tensor:
    """FlyDSL's a8w4 GEMM builds the FP8 128-K operand of lane (row lane%16) from two 16-byte LDS
    reads of the row, ``lo_col = (lane/16)*16`` and ``hi_col = lo_col + 64``, packed lo then hi."""
    out = []
    for lane in range(64):
        lo_col = (lane // 16) * 16
        hi_col = lo_col + 64
        out.append([(lane % 16, lo_col + b) for b in range(16)] + [(lane % 16, hi_col + b) for b in range(16)])
    return torch.tensor(out)


def test_fp8_matches_flydsl_gemm_and_is_not_the_fp4_layout():
    assert torch.equal(om.FP8.table(), _fp8_from_flydsl())
    # 96 of the 128 (lane group, byte) slots of a row hold another K than the contiguous FP4 layout
    fp4_k, fp8_k = om.FP4.table()[::16, :, 1], om.FP8.table()[::16, :, 1]  # row 0: lanes 0, 16, 32, 48
    assert int((fp4_k != fp8_k).sum()) == 96


def test_fp8_halves_span_two_scale_blocks_each():
    """Triton: 'for mxfp6/mxfp8, there are 2 16-consecutive elements blocks, so 2 scale elements are
    required' per lane."""
    t = om.FP8.table()
    for lane in range(64):
        ks = t[lane, :, 1]
        assert torch.equal(ks[1:16] - ks[:15], torch.ones(15, dtype=ks.dtype))
        assert torch.equal(ks[17:] - ks[16:31], torch.ones(15, dtype=ks.dtype))
        assert len(set((ks // 32).tolist())) == 2


def test_scale_lane_bases_are_tritons():
    """chooseScaledMfmaScaleLayout, 16x16: laneBase {{0,1},{0,2},{0,4},{0,8},{1,0},{2,0}} over
    (K/32 block, row) - transcribed, then read as (row, block)."""
    triton_lane_base = ((0, 1), (0, 2), (0, 4), (0, 8), (1, 0), (2, 0))
    want = torch.tensor([[[sum(((lane >> b) & 1) * triton_lane_base[b][1] for b in range(6)),
                           sum(((lane >> b) & 1) * triton_lane_base[b][0] for b in range(6))]]
                         for lane in range(64)])
    assert torch.equal(om.SCALE.table(), want)


@pytest.mark.parametrize("m", [om.BF16_A, om.BF16_B, om.F32_D, om.FP4, om.FP8, om.SCALE],
                         ids=lambda m: f"{m.operand}-{m.fmt}")
def test_every_map_is_a_bijection_and_names_its_source(m):
    t = m.table().reshape(-1, 2)
    assert len({tuple(x) for x in t.tolist()}) == t.shape[0]
    assert "ROCm/" in m.source


def test_same_layout_uniform_scale_tests_cannot_tell_fp8_layouts_apart():
    """Why aiter's FP8 x FP8 16x16x128 test (4 stripes of 8, 32 apart) does not contradict FlyDSL's
    layout: with one layout on both operands and one scale, any K permutation gives the same product.
    A mixed FP4 x FP8 product, as the decode kernel computes, does tell them apart."""
    aiter_fp8 = torch.tensor([[(lane % 16, (lane // 16) * 8 + 32 * (v // 8) + v % 8) for v in range(32)]
                              for lane in range(64)])
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 32, generator=g, dtype=torch.float64), torch.randn(64, 32, generator=g,
                                                                             dtype=torch.float64)

    def product(map_a, map_b):
        A, B = torch.zeros(16, 128, dtype=torch.float64), torch.zeros(16, 128, dtype=torch.float64)
        A[map_a[..., 0], map_a[..., 1]] = a
        B[map_b[..., 0], map_b[..., 1]] = b
        return A @ B.T

    # same registers, each layout used on both operands: identical results
    assert torch.allclose(product(aiter_fp8, aiter_fp8), product(om.FP8.table(), om.FP8.table()))
    # FP4 keys against an FP8 query: the layouts disagree
    assert not torch.allclose(product(om.FP4.table(), om.FP8.table()), product(om.FP4.table(), om.FP4.table()))


def test_e8m0_byte_zero_is_two_to_minus_127_not_zero():
    assert om.e8m0_value(0).item() == 2.0**-127
    assert om.e8m0_value(127).item() == 1.0
    assert torch.isnan(om.e8m0_value(255))
