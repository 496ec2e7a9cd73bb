"""Bit-placement decode of FP4 E2M1 code words for a cheaper CDNA decode (issue 26), as data + formulas.

The FlyDSL decode's first version built each bf16 operand from its code and the group scale with
~10 VALU instructions per code (shifts, an add and three selects). The formulas here (the fp16 one is
the kernel's since issue 26) decode a whole 32-bit word of eight codes (element ``2i`` in the low
nibble of byte ``i``, docs/format.md) by placing the E2M1 bits where a smaller float keeps its exponent
and mantissa, so zeros, the subnormal 0.5 and the signs need no selects:

- :func:`fp16_pairs`: four words of two fp16 each, value = code x ``2**-14`` (fp16's exponent bias 15
  against E2M1's 1; E2M1's subnormal 0.5 lands on fp16's subnormal 2**-15), 11 VALU per word
  (:data:`FP16_VALU_PER_WORD`);
- :func:`fp8_bytes`: two words of four FP8 e4m3 (OCP, gfx950) each, value = code x ``2**-6``
  (bias 7), 7 VALU per word; ``fnuz=True``: e4m3fnuz (gfx942, bias 8, value = code x ``2**-7``),
  whose 0x80 is NaN, so the sign of a zero code is cleared (4 more VALU).

The group scale is not in the operand: UE8M0 byte ``b`` is the float32 with exponent field ``b``
(:func:`scale_f32_bits`: ``b << 23``; byte 0 is 0.0, the zero group, for free), applied after the K
MFMA of one group (one 16x16x32 FP8 MFMA is exactly one group) or folded into P for V; the constant
``2**14`` (fp16) / ``2**6`` (e4m3) / ``2**7`` (fnuz) goes into the softmax scale and the epilogue.
The element order inside the words (:data:`FP16_ORDER`, :data:`FP8_ORDER`) is data: the query
operand is loaded in the same order once per split, so no byte shuffle is needed per code.
Integer-only, shared by a kernel (``where``/shift/and/or) and the emulation (:func:`decode_words_torch`).
Instruction counts assume CDNA3 VOP3 ``v_and_or_b32`` / ``v_lshl_or_b32`` and one SGPR constant per
instruction (AMD CDNA3 ISA guide, VOP3 opcodes; constant-bus limit 1 on GFX9).
"""

from __future__ import annotations

import torch

FP16_OFFSET_LOG2 = -14
FP8_OFFSET_LOG2 = {False: -6, True: -7}
"""log2 of (decoded operand / E2M1 value): multiply the result back by ``2**-offset`` once."""

FP16_ORDER = ((2, 6), (0, 4), (3, 7), (1, 5))
"""Codes (element index within the word) in the (low, high) fp16 halves of :func:`fp16_pairs`' outputs."""

FP8_ORDER = ((0, 2, 4, 6), (1, 3, 5, 7))
"""Codes in bytes 0..3 of :func:`fp8_bytes`' two outputs (low nibbles, then high nibbles)."""

FP16_VALU_PER_WORD = 11
"""X: lshl, and, lshl, and_or (4); Y: lshr, and, and_or (3); halves: and, perm, and, perm (4). llc-22
compiles the formula below to 13.6 per word on gfx942 (a shift and an and where a ``v_perm_b32``
would do; ``benchmarks/lab/fp4_decode_isa.py``)."""

FP8_VALU_PER_WORD = {False: 7, True: 11}
"""OCP e4m3: X 4 + Y 3; fnuz: + nonzero mask (and, add, and) and the masked sign (1); llc-22: 7.6 and
10.6 per word."""

M32 = 0xFFFFFFFF


def _int(v: int) -> int:
    return v


def _byte_up(x, const=_int):
    """Bytes 0 and 2 of ``x`` moved up one byte, zeros below: ``(x << 8) & 0xFF00FF00``."""
    return (x << 8) & const(0xFF00FF00)


def fp16_pairs(w, const=_int, byte_up=_byte_up):
    """Four 32-bit words of two fp16 bit patterns each from one word of eight E2M1 codes (ints or int
    tensors holding 0..2**32-1); value = code x 2**-14, order :data:`FP16_ORDER`.

    ``const`` makes the mask constants (a kernel passes its signed int32 constructor) and ``byte_up``
    does the byte move of :func:`_byte_up` (a kernel: one ``v_perm_b32``)."""
    sign = const(0x80808080)
    x = ((w << 1) & 0x0E0E0E0E) | ((w << 4) & sign)  # low nibbles: byte = s000 e e m 0
    y = ((w >> 3) & 0x0E0E0E0E) | (w & sign)  # high nibbles (an arithmetic >> is masked off)
    high = const(0xFF00FF00)
    return (x & high, byte_up(x, const), y & high, byte_up(y, const))


def fp8_bytes(w, fnuz: bool = False):
    """Two 32-bit words of four FP8 e4m3 (``fnuz``: e4m3fnuz) from one word of eight E2M1 codes;
    order :data:`FP8_ORDER`."""
    sign = w
    if fnuz:  # bit 3 of each nibble: set where the magnitude is nonzero (no carry: 7 + 7 < 16)
        nonzero = ((w & 0x77777777) + 0x77777777) & 0x88888888
        sign = w & nonzero
    x = ((w << 2) & 0x1C1C1C1C) | ((sign << 4) & 0x80808080)  # byte = s 0 0 e e m 0 0
    y = ((w >> 2) & 0x1C1C1C1C) | (sign & 0x80808080)
    return x & M32, y & M32  # fnuz (bias 8): the same bits are half the value (FP8_OFFSET_LOG2)


def scale_f32_bits(scale_byte):
    """float32 bits of ``2**(b - 127)`` for UE8M0 byte ``b``; byte 0 gives 0.0 (the zero group)."""
    return scale_byte << 23


def fp16_value(bits: torch.Tensor) -> torch.Tensor:
    """float64 value of fp16 bit patterns 0..65535 (int64 tensor)."""
    b = bits.to(torch.int64) & 0xFFFF
    return torch.where(b >= 0x8000, b - 0x10000, b).to(torch.int16).view(torch.float16).to(torch.float64)


def _fp8_value(bits: torch.Tensor, fnuz: bool) -> torch.Tensor:
    """float64 value of FP8 e4m3 (``fnuz``: e4m3fnuz) bit patterns 0..255 (computed, not a torch dtype)."""
    b = bits.to(torch.int64) & 0xFF
    s = torch.where(b & 0x80 > 0, -1.0, 1.0).to(torch.float64)
    e = (b >> 3) & 0xF
    m = (b & 7).to(torch.float64)
    bias = 8 if fnuz else 7
    val = torch.where(e == 0, m / 8 * 2.0 ** (1 - bias), (1 + m / 8) * torch.pow(2.0, (e - bias).to(torch.float64)))
    if fnuz:
        val = torch.where(b == 0x80, torch.full_like(val, float("nan")), val)
    return s * val


def decode_words_torch(words: torch.Tensor, kind: str) -> torch.Tensor:
    """Emulation: (N,) int64 code words -> (N, 8) float64 operand values in element order, through the
    kernel formulas (``kind``: ``fp16``, ``fp8``, ``fp8_fnuz``), scaled back by the offset: equals the
    E2M1 values of the codes when the formulas are right."""
    w = words.to(torch.int64) & M32
    out = torch.zeros(w.shape[0], 8, dtype=torch.float64)
    if kind == "fp16":
        for word, (lo, hi) in zip(fp16_pairs(w), FP16_ORDER, strict=True):
            out[:, lo] = fp16_value(word & 0xFFFF)
            out[:, hi] = fp16_value((word >> 16) & 0xFFFF)
        return out * 2.0 ** -FP16_OFFSET_LOG2
    fnuz = kind == "fp8_fnuz"
    for word, order in zip(fp8_bytes(w, fnuz), FP8_ORDER, strict=True):
        for byte, elem in enumerate(order):
            out[:, elem] = _fp8_value((word >> (8 * byte)) & 0xFF, fnuz)
    return out * 2.0 ** -FP8_OFFSET_LOG2[fnuz]


def qk_scores_fp16(query: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Emulation of the fp16 QK path for (T,) tokens of one head: ``query`` (D,) already fp16-exact
    (float32), ``codes`` (T, D/2) uint8 (element 2i in the low nibble), ``scales`` (T, D/32) uint8.

    As the kernel would: each code word -> :func:`fp16_pairs`, the query read in the same element
    order (:data:`FP16_ORDER`), products summed in float32 per 32-element group (one group = two
    16x16x16 MFMAs), times the group scale :func:`scale_f32_bits` after the group, and the constant
    ``2**14`` once at the end (the softmax scale's job in the kernel). Returns (T,) float32 scores."""
    t, half = codes.shape
    d = 2 * half
    b = codes.to(torch.int64)
    words = (b[:, 0::4] | b[:, 1::4] << 8 | b[:, 2::4] << 16 | b[:, 3::4] << 24)  # (T, D/8)
    vals = torch.zeros(t, d // 8, 8, dtype=torch.float32)
    for word, (lo, hi) in zip(fp16_pairs(words), FP16_ORDER, strict=True):
        vals[:, :, lo] = fp16_value(word & 0xFFFF).float()
        vals[:, :, hi] = fp16_value((word >> 16) & 0xFFFF).float()
    prod = (vals.reshape(t, d) * query[None, :]).reshape(t, d // 32, 32)
    raw = prod.sum(-1, dtype=torch.float32)  # (T, groups): one group's MFMA result
    scale = scale_f32_bits(scales.to(torch.int32)).view(torch.float32)  # byte 0 -> 0.0: the zero group
    return (raw * scale).sum(-1) * 2.0 ** -FP16_OFFSET_LOG2


__all__ = ["FP16_ORDER", "FP16_VALU_PER_WORD", "FP8_ORDER", "FP8_VALU_PER_WORD", "decode_words_torch",
           "fp16_pairs", "fp16_value", "fp8_bytes", "qk_scores_fp16", "scale_f32_bits"]
