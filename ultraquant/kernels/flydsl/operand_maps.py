"""MFMA operand maps of the CDNA instructions the FlyDSL decode kernels use, as data, one per format.

A map says which matrix entry each (lane, element) of one operand holds. It is written as linear
bases, the form ROCm's Triton uses for its AMD layouts: lane bit ``b`` adds ``lane_bases[b]`` and
element bit ``b`` adds ``elem_bases[b]`` to the coordinates (the bases are distinct powers of two, so
adding is the same as XOR). Coordinates are ``(mn, k)`` for A and B (mn = row of A, column of B),
``(row, col)`` for D and ``(mn, k // 32)`` for the E8M0 scale operand of the scaled MFMA.

Every map names the public AMD sources it was read from (docs/flydsl.md, "MFMA operand maps", has
the reasoning); ``tests/test_mfma_operand_maps.py`` checks each against tables derived from those
sources (the AMD Matrix Instruction Calculator's output, the sources' own address arithmetic), not
from these bases. The emulation, the MLIR interpreter and the kernel all take their operand layouts
from here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

WAVE = 64


@dataclass(frozen=True)
class OperandMap:
    """(lane, element) -> matrix coordinates of one MFMA operand, as linear bases (see module doc)."""

    instruction: str
    operand: str
    fmt: str
    lane_bases: tuple[tuple[int, int], ...]
    elem_bases: tuple[tuple[int, int], ...]
    source: str

    @property
    def elements(self) -> int:
        """Elements per lane (bf16 halves, FP8 bytes, FP4 nibbles, ...)."""
        return 1 << len(self.elem_bases)

    def coord(self, lane, elem, axis: int):
        """Coordinate ``axis`` (0 = mn/row, 1 = k/col) of (lane, elem); ints, torch or FlyDSL values."""
        out = lane * 0
        for b, basis in enumerate(self.lane_bases):
            if basis[axis]:
                out = out + ((lane >> b) & 1) * basis[axis]
        for b, basis in enumerate(self.elem_bases):
            if basis[axis]:
                out = out + ((elem >> b) & 1) * basis[axis]
        return out

    def table(self) -> torch.Tensor:
        """(64, elements, 2) int64: the coordinates of every (lane, element)."""
        lane = torch.arange(WAVE)[:, None]
        elem = torch.arange(self.elements)[None, :]
        return torch.stack([self.coord(lane, elem, 0).expand(WAVE, self.elements),
                            self.coord(lane, elem, 1).expand(WAVE, self.elements)], dim=-1)


ROWS16 = ((1, 0), (2, 0), (4, 0), (8, 0))  # lanes 0..15: the 16 rows (columns of B)
_CALCULATOR = ("AMD Matrix Instruction Calculator (ROCm/amd_matrix_instruction_calculator 1.3.2, "
               "-a CDNA3 -i v_mfma_f32_16x16x16_bf16 --register-layout); the same instruction and "
               "layout on CDNA4 (ROCm/rocm-blogs matrix-cores-cdna lists 16x16x16 bf16 for both)")

BF16_A = OperandMap("v_mfma_f32_16x16x16_bf16", "A", "bf16", ROWS16 + ((0, 4), (0, 8)),
                    ((0, 1), (0, 2)), _CALCULATOR)
"""Lane (r, g) holds A[r][4g + i], i = 0..3."""

BF16_B = OperandMap("v_mfma_f32_16x16x16_bf16", "B", "bf16", ROWS16 + ((0, 4), (0, 8)),
                    ((0, 1), (0, 2)), _CALCULATOR)
"""Lane (r, g) holds B[4g + i][r] (coordinates (col, k))."""

_CALCULATOR_F16 = ("AMD Matrix Instruction Calculator (ROCm/amd_matrix_instruction_calculator 1.3.2, "
                   "-a CDNA3 -i v_mfma_f32_16x16x16_f16 --register-layout; its A, B and D tables are entry "
                   "for entry those of v_mfma_f32_16x16x16_bf16); the same instruction on CDNA4 "
                   "(ROCm/rocm-blogs matrix-cores-cdna lists 16x16x16 f16 for both)")

F16_A = OperandMap("v_mfma_f32_16x16x16_f16", "A", "fp16", ROWS16 + ((0, 4), (0, 8)), ((0, 1), (0, 2)),
                   _CALCULATOR_F16)
"""Lane (r, g) holds A[r][4g + i], i = 0..3 (the fp16 path's K rows and V^T rows)."""

F16_B = OperandMap("v_mfma_f32_16x16x16_f16", "B", "fp16", ROWS16 + ((0, 4), (0, 8)), ((0, 1), (0, 2)),
                   _CALCULATOR_F16)
"""Lane (r, g) holds B[4g + i][r] (coordinates (col, k)): the query columns and P^T."""

F32_D = OperandMap("v_mfma_f32_16x16x16_bf16 / _f16 / v_mfma_scale_f32_16x16x128_f8f6f4", "D", "f32",
                   ((0, 1), (0, 2), (0, 4), (0, 8), (4, 0), (8, 0)), ((1, 0), (2, 0)),
                   _CALCULATOR + "; scaled MFMA: ROCm/aiter op_tests/opus/device/test_mfma_scale.cu "
                   "(16x16x128 result stored as C[4 (lane/16) + i][lane % 16]), ROCm/rocm-blogs "
                   "matrix-cores-cdna ('the data layout for the output matrix remains the same')")
"""Lane (r, g) returns D[4g + i][r]."""

SCALED = "v_mfma_scale_f32_16x16x128_f8f6f4"

FP4 = OperandMap(SCALED, "A/B", "fp4 e2m1", ROWS16 + ((0, 32), (0, 64)),
                 ((0, 1), (0, 2), (0, 4), (0, 8), (0, 16)),
                 "ROCm/triton lib/Dialect/TritonGPU/IR/LinearLayoutConversions.cpp "
                 "(chooseScaledMfmaScaleLayout: 'for mxfp4, these 32 elements are consecutive'; 16x16x128: "
                 "'the first 16 lanes collectively handle A[0:16][0:32], and another 16 lanes A[0:16][32:64]'); "
                 "ROCm/aiter op_tests/opus/device/test_mfma_scale.cu (16x16x128 FP4: 16 contiguous bytes of "
                 "row lane%16 at byte 16 (lane/16); B packed low nibble = even K); ROCm/rocm-blogs "
                 "matrix-cores-cdna (32x32x64 FP4, same per-lane run)")
"""Lane (r, g) holds the contiguous run K = 32g + v (v = 0..31) of row r: element v is nibble v % 2
(low nibble = even element) of byte v // 2 of the first four dwords; dwords 4..7 are unused."""

FP8 = OperandMap(SCALED, "A/B", "fp8 e4m3", ROWS16 + ((0, 16), (0, 32)),
                 ((0, 1), (0, 2), (0, 4), (0, 8), (0, 64)),
                 "ROCm/FlyDSL kernels/gemm/mxfp4_preshuffle.py (a8w4 GEMM, FP8 x FP4 with per-block scales: "
                 "'fp8 128-K operand (v8i32) = two 16 B halves 64 B apart in the row (f8f6f4 ABI), packed "
                 "lo++hi', lo at byte 16 (lane/16)); ROCm/triton LinearLayoutConversions.cpp ('for "
                 "mxfp6/mxfp8, there are 2 16-consecutive elements blocks, so 2 scale elements are "
                 "required'); ROCm/rocm-blogs matrix-cores-cdna (32x32x64 FP8: two 16-element halves per "
                 "lane, lane groups 16 apart: the same structure at K = 64)")
"""Lane (r, g) holds two 16-element halves of row r: byte v < 16 is K = 16g + v, byte v >= 16 is
K = 64 + 16g + (v - 16). NOT the FP4 layout: each lane's bytes span two 32-element scale blocks
(g // 2 and 2 + g // 2)."""

SCALE = OperandMap(SCALED, "scale A/B (opsel 0)", "e8m0", ROWS16 + ((0, 1), (0, 2)), (),
                   "ROCm/triton LinearLayoutConversions.cpp chooseScaledMfmaScaleLayout (16x16: lane bits "
                   "0-3 -> row, lane bits 4-5 -> K/32 block; the function takes no element type, so it "
                   "holds for FP4 and FP8 alike)")
"""Byte 0 (opsel 0) of lane (r, g)'s scale operand scales block g (K = 32g .. 32g + 31) of row r,
whatever lanes hold that block's elements (for FP8: lanes (r, 2 (g % 2)) and (r, 2 (g % 2) + 1))."""

SCALED_MAPS = {4: FP4, 0: FP8}
"""The scaled MFMA's operand map by its format code (cbsz for A, blgp for B: 0 = e4m3, 4 = e2m1)."""

E8M0_BIAS = 127
E8M0_NAN = 255


def e8m0_value(byte) -> torch.Tensor:
    """Scale an E8M0 byte stands for: ``2**(byte - 127)``; byte 0 is 2**-127 (not zero), 255 is NaN.

    Source: the OCP MX specification as quoted by ROCm/rocm-blogs matrix-cores-cdna ("E = 255 is
    reserved for NaN ... range [2^-127 ... 2^127]"). The hardware therefore never scales by 0: an
    all-zero group stays zero only because its codes are zero."""
    b = torch.as_tensor(byte, dtype=torch.float64)
    return torch.where(b == E8M0_NAN, torch.full_like(b, float("nan")), torch.exp2(b - E8M0_BIAS))
