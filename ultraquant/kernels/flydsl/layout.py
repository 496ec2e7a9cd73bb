"""Pure-PyTorch emulation of the FlyDSL decode kernels' exact lane/data layout (no GPU needed).

No AMD GPU is reachable by this project, so the FlyDSL decode kernels (codegen/flydsl/) cannot be run.
What *can* be checked on a CPU is the part most likely to be wrong: which lane loads which bytes, how
the FP4 codes become MFMA operands, and whether the MFMA operand/result permutations put every score
and every output element where the next step expects it. This module does that, step by step, with
one torch tensor row per lane, and the kernel builds its addresses from the *same* formula functions
below (they work on Python ints, torch tensors and FlyDSL values alike), so the two cannot drift.

Layout summary (derivation in docs/flydsl.md). Lane ``l`` of a 64-lane wave: ``r = l % 16``,
``g = l // 16``. The CDNA MFMAs ``v_mfma_f32_16x16x16_{f16,bf16}`` (gfx942 and gfx950) take, per lane,
four 16-bit elements of A at ``A[r][4g+i]``, four of B at ``B[4g+i][r]`` and return four f32 of D at
``D[4g+i][r]`` (:mod:`operand_maps`).

fp16 path (``uq_decode_flydsl``, both arches):
- QK: A = K (rows = 16 tokens of a tile), B = Q^T (columns = the GQA query heads, padded to 16). Per
  scale group q, lane group g decodes the code word at ``k_word_offset(q, g)`` (d = 32q + 8g + e) by
  bit placement into two fp16 operands (:func:`fp4_bits.fp16_pairs`, code x 2**-14); the group's two
  MFMAs contract only its 32 d, and their result is multiplied by each row's K scale. The query is
  held in :data:`QUERY_MAP`, packed in the decoded words' code order (:data:`F16_STEP_CODES`).
- The QK result ``S^T[4g+i][r]`` is already the B operand layout the PV MFMA needs (P^T, tokens x
  heads): no shuffle between the two MFMAs; softmax statistics of head r live in lanes ``r, r+16,
  r+32, r+48`` (two xor shuffles).
- PV: MFMA ``2q + h`` has rows ``d = 32q + 2m + h`` (one V scale group): lane (r, g) reads byte
  ``16q + r`` of each of its tokens 4g+i, the four bytes make one code word, nibble h feeds MFMA
  2q + h; V's group scale is folded into P (fp16, :data:`PV_TOKENS` order). Lane (r, g) ends up with
  ``O[r][out_dim(q, h, g, i)]``: runs of 8 d at 32q + 8g.
- D=64: the same with two scale groups; a lane holds half a query chunk
  (:attr:`DecodeConfig.chunk_elems`) and a token's scale bytes are half words (:func:`scale_words`).
gfx950 mx path (``uq_decode_flydsl_mx``): K as the scaled MFMA's FP4 operand (lane g's contiguous
32-run of chunk c, :func:`k_code_offset`), the query in the FP8 map; PV rows ``d = (D/16) m + nb``
(:func:`v_dim`), V through the hardware FP4 -> bf16 conversion, bf16 P.
The query is rotated (fast Walsh-Hadamard) in its lane layout: each bit of d is a butterfly inside
the lane or across lanes (:func:`fwht_stages`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...errors import UltraQuantError
from ...format import GROUP, SlotLayout, check_head_size
from . import fp4_bits
from . import operand_maps as om

WAVE = 64
"""Lanes per wavefront (CDNA)."""

TILE = 16
"""Tokens per MFMA tile (the M of the QK MFMA, the K of the PV MFMA)."""

MFMA_K = 4
"""bf16 elements per lane per operand of the 16x16x16 MFMA."""

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

# ---------------------------------------------------------------- shared formulas (kernel + emulation)
# Every function below uses only + - * // % & | << >> on its arguments, so it evaluates the same on
# Python ints, torch integer tensors and FlyDSL Int32 values. The kernel imports these.


QUERY_MAP = om.OperandMap(
    "v_mfma_f32_16x16x16_f16 (QK, B operand source)", "query", "fp16", om.ROWS16 + ((0, 8), (0, 16)),
    ((0, 1), (0, 2), (0, 4), (0, 32), (0, 64)),
    "this kernel's K order: lane group g decodes bytes 4g..4g+3 of every 16-byte scale group "
    "(k_word_offset), so element 8q + e of chunk c is d = 128c + 32q + 8g + e")
"""Query lane layout of the fp16 path: lane (r, g) holds, for each chunk c and group q of it, the
eight d ``128c + 32q + 8g + e`` its K code word covers, in code order e (one 16-byte load each)."""

F16_STEP_CODES = tuple(fp4_bits.FP16_ORDER[2 * p] + fp4_bits.FP16_ORDER[2 * p + 1] for p in range(2))
"""Codes (element index inside a code word) of the four fp16 operand elements of MFMA step p of a
group: the decoded words ``2p`` and ``2p + 1`` of :func:`fp4_bits.fp16_pairs`, low half first."""

PV_TOKENS = tuple(e // 2 for e in F16_STEP_CODES[0])
"""Token (0..3 of the lane's four, = byte of the assembled V word) behind each PV operand element:
step h of a group decodes nibble h of those bytes (:data:`F16_STEP_CODES`), so P is packed in this
order."""

assert PV_TOKENS == tuple(e // 2 for e in F16_STEP_CODES[1])
assert all(e % 2 == h for h in range(2) for e in F16_STEP_CODES[h])


def query_dim(qmap: om.OperandMap, c, lane, e):
    """Head-dim index d the query element ``e`` (0..31) of ``lane`` holds in chunk ``c`` under ``qmap``."""
    return 128 * c + qmap.coord(lane, e, 1)


def fwht_stages(qmap: om.OperandMap, head_size: int) -> list[tuple[str, int]]:
    """The FWHT butterflies over bits 0..6 of d (0..log2(D)-1 below D=128) in bit order, in the lane
    layout of ``qmap``: ``("elem", s)`` pairs elements e and e + s of a lane, ``("lane", m)`` pairs
    lanes l and l ^ m."""
    stages = []
    for bit in range(min(7, head_size.bit_length() - 1)):
        lane = [1 << b for b, basis in enumerate(qmap.lane_bases) if basis[1] == 1 << bit]
        elem = [1 << b for b, basis in enumerate(qmap.elem_bases) if basis[1] == 1 << bit]
        stages.append(("lane", lane[0]) if lane else ("elem", elem[0]))
    return stages


def fp8_block_plan(qmap: om.OperandMap) -> tuple[list[list[int]], list[int], list[tuple[int, int, int]]]:
    """How the kernel finds each query block's FP8 exponent in the lane layout of ``qmap``.

    Returns the element classes (elements of a lane in one 32-element K block), the lane xor masks
    whose lanes share those blocks (max-reduced), and the (xor mask, class, lane group) triples: lane
    group g takes the exponent of class ``cls`` from lane ``l ^ mask`` when that is K block g (the
    scale operand of lane (r, g) scales block g: :data:`operand_maps.SCALE`)."""
    elem_block = [qmap.coord(0, e, 1) >> 5 for e in range(32)]
    classes = [[e for e in range(32) if elem_block[e] == blk] for blk in sorted(set(elem_block))]
    share = [1 << b for b, basis in enumerate(qmap.lane_bases) if basis[0] == 0 and 0 < basis[1] < 32]
    picks = []
    for mask in (0, 16, 32, 48):
        for ci, cls in enumerate(classes):
            for g in range(4):
                if (qmap.coord((16 * g) ^ mask, cls[0], 1) >> 5) == g:
                    picks.append((mask, ci, g))
    return classes, share, picks


def k_code_offset(c, g):
    """mx path: byte offset (inside the slot) of the 16 K-code bytes (the FP4 operand's 32-run) lane
    group ``g`` holds for chunk ``c``."""
    return 16 * (4 * c + g)


def k_scale_offset(head_size: int, c, g):
    """Byte offset (inside the slot) of the UE8M0 scale of those 16 K-code bytes."""
    return SlotLayout(head_size).k_scales + 4 * c + g


def v_dim(head_size: int, nb, m):
    """Head-dim index d of PV output row ``m`` in MFMA ``nb`` (``nb < D/16``)."""
    return (head_size // 16) * m + nb


def v_code_offset(head_size: int, r):
    """Byte offset of the D/32 V-code bytes lane row ``r`` decodes for each of its tokens."""
    return SlotLayout(head_size).v_codes + (head_size // 32) * r


def v_scale_offset(head_size: int, r):
    """Byte offset of the scale of those V-code bytes (one scale group: (D/16) r // 32)."""
    return SlotLayout(head_size).v_scales + ((head_size // 16) * r) // GROUP


def k_word_offset(q, g):
    """fp16 path: byte offset (inside the slot) of the K code word lane group ``g`` decodes for scale
    group ``q`` (head-dim ``32q + 8g .. 32q + 8g + 7``)."""
    return 16 * q + 4 * g


def k_scales_offset(head_size: int):
    """fp16 path: byte offset of a token's D/32 K scale bytes (lane (r, g) reads those of its PV tokens
    4g + i: the QK result rows it scales)."""
    return SlotLayout(head_size).k_scales


def v_byte_offset(head_size: int, q, r):
    """fp16 path: byte offset of the V code byte lane row ``r`` reads for scale group ``q`` of each of
    its tokens: head-dim ``32q + 2r`` (low nibble, PV MFMA 2q) and ``32q + 2r + 1`` (MFMA 2q + 1)."""
    return SlotLayout(head_size).v_codes + 16 * q + r


V_STAGE_HEAD_SIZES = (512,)
"""fp16 path: head sizes whose V code bytes go through LDS (:func:`v_stage_dword`) instead of one
single-byte load per (token, scale group): at D=512 the 64 byte loads per tile and lane do not fit in
registers next to the 128-float accumulator, so LLVM serializes them (docs/flydsl.md, issue 26)."""

V_STAGE_PAD = 4
"""Dwords after each LDS row of :func:`v_stage_dword` (keeps rows 16-byte aligned, shifts banks)."""


def v_stage_dword(head_size: int, g, m, q):
    """fp16 path, staged V: LDS dword (per wave) holding V code byte ``16q + m`` of lane group ``g``'s
    four tokens (byte i = token 4g + i): the word lane (m, g) decodes for scale group q. Lane (r, g)
    loads its tokens' D/32 bytes at :func:`v_code_offset` (byte j = ``(D/32) r + j``) and writes
    each to its word here; lane (m, g) then reads its D/32 words as one contiguous run."""
    row = head_size // 32 + V_STAGE_PAD
    return g * (16 * row + 16) + m * row + q


def v_stage_bytes(head_size: int) -> int:
    """LDS bytes of one wave's staged V (:func:`v_stage_dword` of the four lane groups)."""
    return 4 * 4 * (16 * (head_size // 32 + V_STAGE_PAD) + 16)


def v_scales_offset(head_size: int):
    """fp16 path: byte offset of a token's D/32 V scale bytes (folded into P, one group per PV MFMA pair)."""
    return SlotLayout(head_size).v_scales


def pv_dim(q, h, m):
    """fp16 path: head-dim index of row ``m`` of PV MFMA ``2q + h`` (all 16 rows in scale group q)."""
    return 32 * q + 2 * m + h


def out_dim(q, h, g, i):
    """fp16 path: head-dim index of PV result element i of MFMA ``2q + h`` in lane group g (row 4g + i)."""
    return pv_dim(q, h, 4 * g + i)


P16_MAX_LOG2 = 15
"""fp16 path: P x V scale stays below ``2**15`` (fp16 holds up to 65504)."""

V_SCALE_FLOOR = 87
"""fp16 path: V scale bytes below this count as ``2**(87 - 127)`` in the softmax reference point, so
``P = 2**(s - m)`` stays a finite float32 (at most ``2**55``) for tokens whose V is (almost) zero."""


def v_scale_headroom(max_byte, maximum):
    """fp16 path: what a lane adds to its tile's score maximum for the running reference point ``m``:
    log2 of the largest V scale of its four tokens minus :data:`P16_MAX_LOG2` (bytes below
    :data:`V_SCALE_FLOOR` count as the floor).

    With ``m`` >= max over tokens of (score + this), every ``P = 2**(score - m)`` times a V scale of
    the token is at most ``2**15``: V's group scale can be folded into the fp16 P without overflow,
    and P x scale loses precision only relative to the largest such product (not absolutely, as a P
    in [0, 1] times a small scale would: measured +1-3% SmolLM2 KL per 2048-token window).
    ``maximum`` is the caller's max (torch.maximum, arith.maxsi); returns an int (log2 units)."""
    return maximum(max_byte, max_byte * 0 + V_SCALE_FLOOR) - (127 + P16_MAX_LOG2)


def scale_byte(words, q):
    """UE8M0 byte ``q`` of a token's scale bytes loaded as 32-bit words (a list): scale group
    ``q - first`` for words loaded by :func:`scale_words` (``first`` its third value)."""
    return (words[q // 4] >> (8 * (q % 4))) & 0xFF


def scale_words(head_size: int, field: int) -> tuple[int, int, int]:
    """fp16 path: how a lane loads a token's D/32 scale bytes at slot offset ``field`` as aligned
    32-bit words: (byte offset of the first word, number of words, index of the field's first byte in
    them). At D >= 128 the field is word aligned and whole words (D/128). At D=64 its 2 bytes are half
    a word: the K scales (offset 32) are the low half of the word at 32 (the first two V code bytes
    above them), the V scales (offset 66, the slot's last bytes) the high half of the word at 64, so
    the load stays aligned and inside the slot (68 bytes, a multiple of 4)."""
    first = field % 4
    return field - first, (first + head_size // GROUP + 3) // 4, first


def query_range_exponent(amax_bits, where):
    """fp16 path: exponent field ``ef`` of the power of two ``2**(ef - 127)`` a query head is multiplied
    by before the fp16 cast, from the float32 bits of its absmax: it brings the absmax into
    [2**14, 2**15) (fp16 holds up to 65504), clamped to the float32 normals (a zero head gets 2**126:
    zero stays zero). The inverse ``2**(127 - ef)`` joins the softmax scale."""
    ef = 268 - (amax_bits >> 23)
    ef = where(ef < 1, ef * 0 + 1, ef)
    return where(ef > 253, ef * 0 + 253, ef)


def fp4_bf16_bits(nib, scale_byte, where):
    """bf16 bit pattern (int) of FP4 code ``nib`` (0..15) times ``2**(scale_byte - 127)``.

    Integer-only (no table, no float denormals): for magnitude index m >= 2 the E2M1 exponent and
    mantissa bits shifted left by 6 *are* the bf16 exponent/mantissa, so the result is
    ``(m << 6) + ((scale_byte - 1) << 7)``; m == 1 (0.5) is that minus 64, m == 0 is 0; the sign is
    bit 15. Scale byte 0 (zero group) gives 0. Exact for scale bytes 2..252 (all the encoder writes
    for finite bf16/fp16/fp32 input); byte 1 flushes 0.5 * 2^-126 to zero. ``where(cond, a, b)`` is
    the caller's select (torch.where, or the kernel's arith.select).
    """
    mag = nib & 7
    bits = (mag << 6) + ((scale_byte - 1) << 7)
    bits = where(mag == 1, bits - 64, bits)
    bits = where(mag == 0, bits * 0, bits)
    bits = where(scale_byte == 0, bits * 0, bits)
    return bits | ((nib & 8) << 12)


def fp4_bf16_bits_torch(nib: torch.Tensor, scale_byte: torch.Tensor) -> torch.Tensor:
    """:func:`fp4_bf16_bits` on int32 tensors (broadcasting); returns int32 bit patterns."""
    nib, se = torch.broadcast_tensors(nib.to(torch.int32), scale_byte.to(torch.int32))
    return fp4_bf16_bits(nib, se, torch.where)


FP8_MAX = 448.0
"""Largest finite FP8 e4m3 (OCP, gfx950) magnitude."""


def fp8_group_exponent(amax_bits, where):
    """Exponent e of the power of two a query group is divided by before the FP8 e4m3 cast.

    ``amax_bits``: float32 bits of the group's absmax (>= 0). The smallest e with
    ``amax * 2**-e <= 448 = 1.75 * 2**8``: with ``amax = 1.m * 2**E``, ``e = E - 8`` if ``1.m <= 1.75``
    else ``E - 7``; clamped to [-126, 126] so 2**e and 2**-e are normal floats (an all-zero group
    gets -126 and stays zero). Integer-only, shared by the kernel and the emulation.
    """
    field = (amax_bits >> 23) & 0xFF
    e = field - 135 + where((amax_bits & 0x7FFFFF) > 0x600000, field * 0 + 1, field * 0)
    e = where(e < -126, e * 0 - 126, e)
    return where(e > 126, e * 0 + 126, e)


def fp8_quantize_group(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., 32) float32 -> (FP8 e4m3 values as float32 (..., 32), exponent e (...,)) with
    ``x ~= values * 2**e``: what the gfx950 kernel feeds the scaled MFMA (RNE, no overflow)."""
    amax = x.abs().amax(dim=-1)
    e = fp8_group_exponent(amax.view(torch.int32), torch.where)
    q = (x * ((127 - e) << 23).view(torch.float32)[..., None]).to(torch.float8_e4m3fn).float()
    return q, e


def fp8_terms(x: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(..., 32) float32 -> the hi and lo FP8 terms as (FP8 values, exponent): hi = FP8(x), lo =
    FP8(x - hi), each with its own group exponent (what the gfx950 kernel feeds two scaled MFMAs)."""
    q8, e = fp8_quantize_group(x)
    return [(q8, e), fp8_quantize_group(x - q8 * torch.exp2(e.float())[..., None])]


def fp8_two_term(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., 32) float32 -> the hi and lo terms of :func:`fp8_terms` as values times their scales."""
    (q8, e), (q8l, el) = fp8_terms(x)
    return q8 * torch.exp2(e.float())[..., None], q8l * torch.exp2(el.float())[..., None]


def bf16_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """float32 value of int bf16 bit patterns."""
    return ((bits.to(torch.int32) & 0xFFFF) << 16).view(torch.float32)


def to_bf16(x: torch.Tensor) -> torch.Tensor:
    """Round float32 to bf16 (round to nearest even, as LLVM's fptrunc lowering does) and back."""
    return x.to(torch.bfloat16).to(torch.float32)


def to_fp16(x: torch.Tensor) -> torch.Tensor:
    """Round float32 to fp16 (round to nearest even: fptrunc / ``v_cvt_f16_f32``) and back."""
    return x.to(torch.float16).to(torch.float32)


def to_fp16_rtz(x: torch.Tensor) -> torch.Tensor:
    """Round float32 to fp16 toward zero (``v_cvt_pkrtz_f16_f32``) and back: the mantissa truncated to
    10 bits, subnormals to multiples of 2**-24; beyond 65504 the largest finite fp16."""
    x = x.float()
    bits = x.view(torch.int32) & ~0x1FFF
    normal = bits.view(torch.float32)
    sub = torch.trunc(x * 2.0**24) * 2.0**-24
    y = torch.where(x.abs() >= 2.0**-14, normal, sub)
    return torch.clamp(y, -65504.0, 65504.0)


def f16_pair_values(word: torch.Tensor) -> torch.Tensor:
    """(..., 2) float32 values of the low and high fp16 halves of 32-bit words (int64 tensor)."""
    w = word.to(torch.int64) & 0xFFFFFFFF
    return torch.stack([fp4_bits.fp16_value(w & 0xFFFF), fp4_bits.fp16_value(w >> 16)], dim=-1).float()


def f16_step_operands(word: torch.Tensor) -> list[torch.Tensor]:
    """The two fp16 MFMA operands (..., 4) one code word decodes to (:func:`fp4_bits.fp16_pairs`), as
    values times ``2**-14``: step p holds the codes :data:`F16_STEP_CODES` [p]."""
    outs = fp4_bits.fp16_pairs(word.to(torch.int64) & 0xFFFFFFFF)
    return [torch.cat([f16_pair_values(outs[2 * p]), f16_pair_values(outs[2 * p + 1])], dim=-1) for p in range(2)]


def scale_value(byte: torch.Tensor) -> torch.Tensor:
    """float32 ``2**(b - 127)`` from UE8M0 bytes as the fp16 path builds it (``b << 23``: byte 0 = 0.0)."""
    return fp4_bits.scale_f32_bits(byte.to(torch.int32)).view(torch.float32)


# ---------------------------------------------------------------- configuration


@dataclass(frozen=True)
class DecodeConfig:
    """Compile-time parameters of one FlyDSL decode kernel."""

    head_size: int = 128
    gqa: int = 8
    block_size: int = 16
    has_sinks: bool = False
    has_window: bool = False
    has_softcap: bool = False

    def __post_init__(self) -> None:
        check_head_size(self.head_size)
        if self.head_size < 64:
            raise UltraQuantError(f"head_size: the FlyDSL decode needs >= 64, got {self.head_size}")
        if not 1 <= self.gqa <= 16:
            raise UltraQuantError(f"gqa: the FlyDSL decode serves 1..16 query heads per kv head, got {self.gqa}")
        if self.block_size % TILE:
            raise UltraQuantError(f"block_size: must be a multiple of {TILE}, got {self.block_size}")

    @property
    def chunks(self) -> int:
        """128-element chunks of the head dim (QK steps come in groups of 8 per chunk); one (half
        filled) at D=64."""
        return max(1, self.head_size // 128)

    @property
    def chunk_elems(self) -> int:
        """Query elements a lane holds per chunk: 32 (four scale groups of 8) from D=128, 16 at D=64
        (elements 8q + e of groups q = 0, 1: :data:`QUERY_MAP`'s element bit 4 is d bit 6)."""
        return min(32, self.head_size // 4)

    @property
    def pv_mfmas(self) -> int:
        """PV MFMAs per tile (= D/16 = output elements per lane per token row)."""
        return self.head_size // 16


def split_tiles(seq_len, num_splits: int, split, window=None):
    """Token range ``[lo, hi)`` a split attends to and its tile range ``[t_begin, t_end)``.

    Visible keys are ``[max(0, L - w), L)`` (all of ``[0, L)`` without a window). Tiles are 16-token
    aligned in absolute position; the visible tiles are dealt to ``num_splits`` splits in equal
    contiguous runs of ``ceil(n_tiles / num_splits)``. Works on ints and torch tensors.
    """
    if window is None:
        lo = seq_len * 0
    else:
        lo = seq_len - window
        lo = lo * (lo > 0)
    first = lo // TILE
    n_tiles = (seq_len + TILE - 1) // TILE - first
    per = (n_tiles + num_splits - 1) // num_splits
    t_begin = first + split * per
    t_end = first + (split + 1) * per
    last = first + n_tiles
    t_end = t_end * (t_end < last) + last * (t_end >= last)
    return lo, seq_len, t_begin, t_end


# ---------------------------------------------------------------- lane-level emulation

_LANES = torch.arange(WAVE)
_R = _LANES % 16
_G = _LANES // 16
_I = torch.arange(MFMA_K)
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                     dtype=torch.float64)


def _scatter(m: om.OperandMap, vals: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Place lane registers ``vals`` (64, elements) into a float64 matrix by operand map ``m``."""
    t = m.table()
    out = torch.zeros(shape, dtype=torch.float64)
    out[t[..., 0], t[..., 1]] = vals.double()
    return out


def _gather_d(d: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    t = om.F32_D.table()
    return (c.double() + d[t[..., 0], t[..., 1]]).float()


def mfma_16x16x16(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, fmt: str = "bf16") -> torch.Tensor:
    """Emulate ``v_mfma_f32_16x16x16_bf16`` (``fmt="f16"``: ``_f16``) on lane registers: a, b (64, 4),
    c (64, 4) f32.

    Scatters the registers into A (row, k) and B (col, k) by the format's operand maps
    (:data:`operand_maps.BF16_A`/``BF16_B``, ``F16_A``/``F16_B``), multiplies in float64 (the
    hardware's products of 16-bit floats are exact and its f32 sums are close to that) and gathers D
    back by :data:`operand_maps.F32_D`.
    """
    ma, mb = (om.F16_A, om.F16_B) if fmt == "f16" else (om.BF16_A, om.BF16_B)
    return _gather_d(_scatter(ma, a, (16, 16)) @ _scatter(mb, b, (16, 16)).T, c)


def mfma_scale_16x16x128(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, *, a_map: om.OperandMap,
                         b_map: om.OperandMap, a_scale: torch.Tensor, b_scale: torch.Tensor) -> torch.Tensor:
    """Emulate ``v_mfma_scale_f32_16x16x128_f8f6f4``: a, b (64, 32) element values (FP4/FP8 as numbers),
    placed by their formats' operand maps; ``a_scale``/``b_scale`` (64,) the value of each lane's scale
    byte, applied to K block g of row r for lane (r, g) (:data:`operand_maps.SCALE`), whichever lanes
    hold that block's elements."""
    sa = _scatter(om.SCALE, a_scale[:, None], (16, 4)).repeat_interleave(32, dim=1)
    sb = _scatter(om.SCALE, b_scale[:, None], (16, 4)).repeat_interleave(32, dim=1)
    A = _scatter(a_map, a, (16, 128)) * sa
    B = _scatter(b_map, b, (16, 128)) * sb
    return _gather_d(A @ B.T, c)


def _xor_shuffle(x: torch.Tensor, mask: int) -> torch.Tensor:
    """Value of lane ``l ^ mask`` for every lane (ds_bpermute / DPP), x of shape (64, ...)."""
    return x[_LANES ^ mask]


def rotate_query_lanes(q_lanes: torch.Tensor, head_size: int, qmap: om.OperandMap = QUERY_MAP) -> torch.Tensor:
    """Fast Walsh-Hadamard transform of the query in its lane layout.

    ``q_lanes`` (64, chunks, E) float32 (E = 32, or 16 at D=64): lane l holds
    ``q[l % 16][query_dim(qmap, c, l, e)]``. Bits 0-6 of d are butterflies inside a lane or across
    lanes (:func:`fwht_stages`), in bit order; bits 7+ pair the lane's chunks. Returns the rotated
    values (times 1/sqrt(D)) in the same layout.
    """
    x = q_lanes.clone()
    chunks, elems = x.shape[1], x.shape[2]
    for kind, s in fwht_stages(qmap, head_size):
        if kind == "elem":
            y = x.reshape(WAVE, chunks, elems // (2 * s), 2, s)
            a, b = y[:, :, :, 0], y[:, :, :, 1]
            x = torch.stack([a + b, a - b], dim=3).reshape(WAVE, chunks, elems)
        else:
            other = _xor_shuffle(x, s)
            upper = ((_LANES & s) != 0)[:, None, None]
            x = torch.where(upper, other - x, x + other)
    s = 1
    while s < chunks:  # bits 7+: across chunks inside a lane
        y = x.reshape(WAVE, chunks // (2 * s), 2, s, elems)
        a, b = y[:, :, 0], y[:, :, 1]
        x = torch.stack([a + b, a - b], dim=2).reshape(WAVE, chunks, elems)
        s *= 2
    return x * (1.0 / math.sqrt(head_size))


def fp8_query_operands(q_rot: torch.Tensor, qmap: om.OperandMap) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The mx path's two FP8 query terms as the kernel builds them: per term, the B registers (64,
    chunks, 32) (FP8 values, unscaled) and each lane's scale exponent (64, chunks), the exponent of
    K block g for lane group g. Each 32-element K block (``d = 128c + 32b ..``) of each head is
    quantized with its own power-of-two exponent (:func:`fp8_terms`); ``qmap`` is the lane
    layout the kernel assumes for FP8 (``q_rot`` is in that layout)."""
    chunks = q_rot.shape[1]
    e = torch.arange(32)
    dims = query_dim(qmap, torch.arange(chunks)[None, :, None], _LANES[:, None, None], e[None, None, :])
    rows = torch.zeros(16, chunks * 128)
    rows[_R[:, None, None].expand_as(dims), dims] = q_rot
    return [(q8.reshape(16, chunks * 128)[_R[:, None, None], dims], ex.reshape(16, chunks, 4)[_R, :, _G])
            for q8, ex in fp8_terms(rows.reshape(16, chunks * 4, 32))]


def _slot_bytes(kv_cache: torch.Tensor, block_table: torch.Tensor, b: int, kvh: int,
                tokens: torch.Tensor) -> torch.Tensor:
    """(n, slot) bytes of the given absolute token positions (int64 tensor) of request b, kv head."""
    bs = kv_cache.shape[1]
    blocks = block_table[b, tokens // bs].long()
    return kv_cache[blocks, tokens % bs, kvh].to(torch.int32)


def _query_prescale(q_lanes: torch.Tensor) -> torch.Tensor:
    """fp16 path: per-lane exponent field of the power of two each head's query is multiplied by
    (:func:`query_range_exponent` on the head's absmax over its four lane groups), shape (64,)."""
    amax = q_lanes.abs().reshape(WAVE, -1).amax(dim=1)
    amax = torch.maximum(amax, _xor_shuffle(amax, 16))
    amax = torch.maximum(amax, _xor_shuffle(amax, 32))
    return query_range_exponent(amax.view(torch.int32).to(torch.int64), torch.where)


def emulate_split(cfg: DecodeConfig, query: torch.Tensor, kv_cache: torch.Tensor,
                  block_table: torch.Tensor, seq_lens: torch.Tensor, b: int, kvh: int, split: int,
                  num_splits: int, scale: float, *, window: int | None = None,
                  softcap: float | None = None, exact_operands: bool = False,
                  mx: bool = False, waves: int = 1,
                  mx_query_map: om.OperandMap = om.FP8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One wave's split: unnormalized ``acc`` (16, D), running max ``m`` (16,) (log2 units) and
    denominator ``l`` (16,), rows = the 16 MFMA columns (query heads ``kvh*G + r``; rows >= G junk).

    This is what the kernel writes to the decode workspace (the Triton decode's partial contract).
    Follows the kernel at the level of lane registers. fp16 path (default, gfx942/gfx950): K and V
    code words bit-placed to fp16 (:func:`fp4_bits.fp16_pairs`), fp16 query (prescaled per head by a
    power of two) and P, ``v_mfma_f32_16x16x16_f16``; K's group scale applied to each group's QK
    result, V's folded into P. With ``exact_operands`` the query and P stay float32 instead of being
    rounded for the MFMA: the result then matches float64 attention to ~1e-6, which makes any layout
    slip visible. ``mx``: the gfx950 path (FP8 query groups in a scaled 16x16x128 MFMA; V through the
    FP4 conversion, bf16 P).
    ``waves``: waves per workgroup (tiles dealt round robin, states folded W-1 .. 1 into wave 0).
    Bounds as the kernel's: the length clamped to the block-table row, a tile whose block id is
    outside [0, num_blocks) reads block 0 with every token masked.
    ``mx_query_map``: the FP8 operand layout the kernel packs the query for; the scaled MFMA itself is
    emulated with the layouts of :mod:`operand_maps` (a wrong belief shows as a wrong result).
    """
    d, g_heads = cfg.head_size, cfg.gqa
    if mx and d < 128:
        raise UltraQuantError(f"head_size: the mx path contracts 128 K per scaled MFMA, got {d}")
    groups = d // GROUP
    rnd = (lambda x: x) if exact_operands else (to_bf16 if mx else to_fp16)
    # --- 1. query: load (B layout, rows >= G zero), rotate, round to the operand type
    qh = kvh * g_heads + torch.clamp(_R, max=g_heads - 1)
    valid_q = _R < g_heads
    qmap = mx_query_map if mx else QUERY_MAP
    dims = query_dim(qmap, torch.arange(cfg.chunks)[None, :, None], _LANES[:, None, None],
                     torch.arange(cfg.chunk_elems)[None, None, :])  # (64, chunks, elems)
    q_rows = query[b].float()[qh]  # (64, D)
    q_lanes = torch.gather(q_rows[:, None, :].expand(WAVE, cfg.chunks, d), 2, dims)
    q_lanes = torch.where(valid_q[:, None, None], q_lanes, torch.zeros_like(q_lanes))
    q_rot = rotate_query_lanes(q_lanes, d, qmap)
    if mx:  # gfx950: per (head, K block) FP8 hi and lo terms, each with a power-of-two exponent
        q_terms = fp8_query_operands(q_rot, qmap)
        score_scale = torch.full((WAVE, 1), scale if softcap is not None else scale * LOG2E)
    else:  # fp16: the head times 2**(ef - 127) (range), then 2**(127 - ef) and 2**14 in the scores
        ef = _query_prescale(q_rot)
        q_ops = rnd(q_rot * scale_value(ef)[:, None, None])  # (64, chunks, elems): element 8q + e
        unscale = scale_value(254 - ef) * 2.0 ** -fp4_bits.FP16_OFFSET_LOG2
        score_scale = (unscale * (scale if softcap is not None else scale * LOG2E))[:, None]

    seq_len = min(max(int(seq_lens[b]), 0), block_table.shape[1] * kv_cache.shape[1])
    lo, hi, t_begin, t_end = split_tiles(seq_len, num_splits, split, window)
    page_ok = (block_table >= 0) & (block_table < kv_cache.shape[0])
    block_table = torch.where(page_ok, block_table, torch.zeros_like(block_table))

    def one_wave(tiles):
        m_run = torch.full((WAVE,), float("-inf"))
        l_run = torch.zeros(WAVE)
        o_acc = torch.zeros(WAVE, cfg.pv_mfmas, MFMA_K)  # [nb][i]
        for tile in tiles:
            t0 = tile * TILE
            tok = t0 + 4 * _G[:, None] + _I[None, :]  # (64, 4): the lane's PV tokens = its QK result rows
            visible = (tok >= lo) & (tok < hi) & bool(page_ok[b, t0 // kv_cache.shape[1]])
            # K: lane row r holds token t0 + r; rows past the sequence re-read its last token
            k_tok = torch.clamp(t0 + _R, max=seq_len - 1)
            k_slots = _slot_bytes(kv_cache, block_table, b, kvh, k_tok)  # (64, slot)
            v_tok = torch.clamp(tok, max=seq_len - 1)
            v_slots = _slot_bytes(kv_cache, block_table, b, kvh, v_tok.reshape(-1)).reshape(WAVE, MFMA_K, -1)
            # --- 2. QK
            acc = torch.zeros(WAVE, MFMA_K)
            if mx:  # two scaled MFMAs 16x16x128 (hi, lo): A = the FP4 codes and scale bytes as stored
                for c in range(cfg.chunks):
                    off = k_code_offset(c, _G)  # (64,)
                    codes = torch.gather(k_slots, 1, off[:, None] + torch.arange(16)[None, :])  # (64, 16)
                    sbyte = torch.gather(k_slots, 1, k_scale_offset(d, c, _G)[:, None])  # (64, 1)
                    nibs = torch.stack([codes & 0xF, codes >> 4], dim=2).reshape(WAVE, 32)
                    for vals, ex in q_terms:
                        acc = mfma_scale_16x16x128(_E2M1[nibs], vals[:, c], acc, a_map=om.FP4, b_map=om.FP8,
                                                   a_scale=om.e8m0_value(sbyte[:, 0]),
                                                   b_scale=torch.exp2(ex[:, c].double()))
            else:  # per scale group: two f16 MFMAs over its 32 d, then times each row's K scale
                ksb = v_slots[:, :, k_scales_offset(d) : k_scales_offset(d) + groups]  # (64, 4 tokens, groups)
                for q in range(groups):
                    off = k_word_offset(q, _G)[:, None] + torch.arange(4)[None, :]
                    wb = torch.gather(k_slots, 1, off).to(torch.int64)
                    word = wb[:, 0] | wb[:, 1] << 8 | wb[:, 2] << 16 | wb[:, 3] << 24
                    part = torch.zeros(WAVE, MFMA_K)
                    for step, a_op in enumerate(f16_step_operands(word)):
                        b_op = q_ops[:, q // 4, [8 * (q % 4) + e for e in F16_STEP_CODES[step]]]
                        part = mfma_16x16x16(a_op, b_op, part, "f16")
                    acc = (part.double() * scale_value(ksb[:, :, q]).double() + acc.double()).float()  # fma
            # --- 3. scores S^T[token 4g+i][head r] (log2 units), mask, online softmax
            if softcap is not None:  # c * tanh(s / c) through exp2 and a reciprocal, as the kernel
                cap2 = torch.tensor(2.0 * LOG2E) * (1.0 / torch.tensor(softcap, dtype=torch.float32))
                s = softcap * (1.0 - 2.0 * (1.0 / (torch.exp2(acc * (score_scale * cap2)) + 1.0))) * LOG2E
            else:
                s = acc * score_scale
            s = torch.where(visible, s, torch.full_like(s, float("-inf")))
            if mx:
                mt = s.amax(dim=1)
            else:  # the reference point also bounds P x V scale (V's scale goes into the fp16 P)
                vsb = v_slots[:, :, v_scales_offset(d) : v_scales_offset(d) + groups]
                vsb = torch.where(visible[:, :, None], vsb, torch.zeros_like(vsb))  # masked: P times 0.0
                mt = s.amax(dim=1) + v_scale_headroom(vsb.amax(dim=(1, 2)), torch.maximum).float()
            mt = torch.maximum(mt, _xor_shuffle(mt, 16))
            mt = torch.maximum(mt, _xor_shuffle(mt, 32))
            m_new = torch.maximum(m_run, mt)
            m_use = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
            alpha = torch.exp2(m_run - m_use)
            p = torch.exp2(s - m_use[:, None])
            l_run = l_run * alpha + p.sum(dim=1)
            m_run = m_new
            # --- 4. PV. V: lane (r, g) reads tokens t0 + 4g + i
            if mx:  # rows d = (D/16) m + nb: D/32 contiguous bytes at row r's offset, bf16 P as it is
                p_ops = rnd(p)
                nbytes = d // 32
                voff = v_code_offset(d, _R)[:, None, None] + torch.arange(nbytes)[None, None, :]
                vcodes = torch.gather(v_slots, 2, voff.expand(WAVE, MFMA_K, nbytes))  # (64, 4, D/32)
                vscale = torch.gather(v_slots, 2, v_scale_offset(d, _R)[:, None, None].expand(WAVE, MFMA_K, 1))
                vcodes = torch.where(visible[:, :, None], vcodes, torch.zeros_like(vcodes))
                vscale = torch.where(visible[:, :, None], vscale, torch.zeros_like(vscale))
                vnibs = torch.stack([vcodes & 0xF, vcodes >> 4], dim=3).reshape(WAVE, MFMA_K, cfg.pv_mfmas)
                vv = bf16_from_bits(fp4_bf16_bits_torch(vnibs, vscale))  # (64, i=token, nb)
                for nb in range(cfg.pv_mfmas):
                    o_acc[:, nb] = mfma_16x16x16(vv[:, :, nb], p_ops, o_acc[:, nb] * alpha[:, None])
            else:  # MFMA 2q + h: rows d = 32q + 2m + h; V's group scale folded into P (fp16), per group
                order = list(PV_TOKENS)
                for q in range(groups):
                    vb = torch.gather(v_slots, 2, v_byte_offset(d, q, _R)[:, None, None].expand(WAVE, MFMA_K, 1))
                    vb = vb[..., 0].to(torch.int64)
                    word = vb[:, 0] | vb[:, 1] << 8 | vb[:, 2] << 16 | vb[:, 3] << 24  # byte i = token i
                    p_q = p[:, order] * scale_value(vsb[:, order, q])
                    p_q = p_q if exact_operands else to_fp16_rtz(p_q)
                    for h, a_op in enumerate(f16_step_operands(word)):
                        nb = 2 * q + h
                        o_acc[:, nb] = mfma_16x16x16(a_op, p_q, o_acc[:, nb] * alpha[:, None], "f16")
        # --- 5. per-head denominator over the 4 lane groups
        l_tot = l_run + _xor_shuffle(l_run, 16)
        l_tot = l_tot + _xor_shuffle(l_tot, 32)
        out = torch.zeros(16, d)
        if mx:  # lane (r, g) holds O[r][(D/16)(4g+i) + nb]
            cols = v_dim(d, torch.arange(cfg.pv_mfmas)[None, :, None], (4 * _G[:, None, None] + _I[None, None, :]))
        else:  # lane (r, g) holds O[r][out_dim(q, h, g, i)] in MFMA 2q + h
            nb = torch.arange(cfg.pv_mfmas)[None, :, None]
            cols = out_dim(nb // 2, nb % 2, _G[:, None, None], _I[None, None, :])
        out[_R[:, None, None].expand_as(cols), cols] = o_acc
        return out, m_run[:16], l_tot[:16]

    # the workgroup's `waves` waves take the tiles round robin, then waves W-1 .. 1 fold into wave 0
    states = [one_wave(range(t_begin + w, t_end, waves)) for w in range(waves)]
    acc, m, l_ = states[0]
    for w in range(waves - 1, 0, -1):
        acc, m, l_ = merge_state(acc, m, l_, *states[w])
    if not mx:  # V decoded as code x 2**-14: once, on the split's result
        acc = acc * 2.0 ** -fp4_bits.FP16_OFFSET_LOG2
    return acc, m, l_


def merge_state(acc, m, l_, acc2, m2, l2):
    """Merge two softmax states (log2 domain); a state with m = -inf contributes nothing."""
    m_new = torch.maximum(m, m2)
    m_use = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
    a1, a2 = torch.exp2(m - m_use), torch.exp2(m2 - m_use)
    return acc * a1[..., None] + acc2 * a2[..., None], m_new, l_ * a1 + l2 * a2


def finish(acc, m, l_, sinks: torch.Tensor | None) -> torch.Tensor:
    """Fold the sink logits (natural units) into the denominator and normalize (zeros if l = 0)."""
    if sinks is not None:
        s2 = sinks.float() * LOG2E
        m_new = torch.maximum(m, s2)
        l_ = l_ * torch.exp2(m - m_new) + torch.exp2(s2 - m_new)
        acc = acc * torch.exp2(m - m_new)[..., None]
    return torch.where((l_ > 0)[..., None], acc / torch.where(l_ > 0, l_, 1.0)[..., None],
                       torch.zeros_like(acc))


def emulate_decode(cfg: DecodeConfig, query: torch.Tensor, kv_cache: torch.Tensor,
                   block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                   num_splits: int = 4, sinks: torch.Tensor | None = None, window: int | None = None,
                   softcap: float | None = None, exact_operands: bool = False,
                   mx: bool = False, waves: int = 1, mx_query_map: om.OperandMap = om.FP8) -> torch.Tensor:
    """The whole FlyDSL decode launch: every split of every (request, kv head), then the last
    split's merge (splits in order) and sink fold, as the kernel does. Returns (B, Hq, D) float32."""
    bsz, hq, d = query.shape
    hk = kv_cache.shape[2]
    if d != cfg.head_size or hq != hk * cfg.gqa or kv_cache.shape[1] != cfg.block_size:
        raise UltraQuantError("query/kv_cache: shapes do not match the DecodeConfig")
    if (cfg.has_window != (window is not None) or cfg.has_softcap != (softcap is not None)
            or cfg.has_sinks != (sinks is not None)):
        raise UltraQuantError("sinks/window/softcap: must match the DecodeConfig flags")
    out = torch.zeros(bsz, hq, d)
    for b in range(bsz):
        for kvh in range(hk):
            acc = torch.zeros(16, d)
            m = torch.full((16,), float("-inf"))
            l_ = torch.zeros(16)
            for s in range(num_splits):
                a2, m2, l2 = emulate_split(cfg, query, kv_cache, block_table, seq_lens, b, kvh, s,
                                           num_splits, scale, window=window, softcap=softcap,
                                           exact_operands=exact_operands, mx=mx, waves=waves,
                                           mx_query_map=mx_query_map)
                acc, m, l_ = merge_state(acc, m, l_, a2, m2, l2)
            heads = slice(kvh * cfg.gqa, (kvh + 1) * cfg.gqa)
            sk = None if sinks is None else sinks[heads]
            out[b, heads] = finish(acc[: cfg.gqa], m[: cfg.gqa], l_[: cfg.gqa], sk)
    return out
