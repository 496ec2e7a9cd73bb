"""The whole-page decode's word PTX (``_pv_frags_ptx`` then ``_pv_word_ptx``; ``_qk_ptx``) run by a one-warp PTX
interpreter (tests/ptx_warp.py) on the CPU against a float64 ``V^T P^T`` / ``S^T`` of the same codes: the
``movmatrix`` transposes from the score layout, the operand numbering, the PRMT byte pairing, the nibble-pair
decode and the MMA fragment maps the asm blocks rely on, the K k-order, and the output tiles' dim map that the
epilogue (``_partial_rows``) assumes (tile ``4 w + k``, row r of lane group g: dim ``16 g + 2 (4 w + k) + r // 8``).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests import ptx_warp as W
from ultraquant.format import E2M1_VALUES

K = pytest.importorskip("ultraquant.kernels.gluon.decode_wholepage")

E2M1 = np.array(E2M1_VALUES, dtype=np.float64)
C_MAP = W.mma_layout()


def _problem(seed: int, groups: int):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, size=(16, 64), dtype=np.uint32)            # run token x V code byte (D=128)
    rel_exp = rng.integers(-6, 15, size=(16, 4))                            # token x scale group: 2**e in fp16
    p = rng.random((groups, 16, 8)).astype(np.float16).astype(np.float64)  # row group x token x query row
    return codes, rel_exp, p


def _values(codes: np.ndarray) -> np.ndarray:
    """The decode's fp16 code patterns as float64 ``[token, dim]``: the E2M1 value of dim d (nibble d % 2 of
    byte d // 2) times 2**-14."""
    nibbles = np.stack([codes & 0xF, codes >> 4], axis=-1).reshape(codes.shape[0], -1)
    return E2M1[nibbles] * 2.0 ** -14


def _word(codes: np.ndarray, tok: int, w: int) -> int:
    return int(sum(int(codes[tok, 4 * w + b]) << (8 * b) for b in range(4)))


def _pair(x: float, y: float) -> int:
    return int(W._pack(np.array([x]), np.array([y]))[0])


def _lanes(fn) -> np.ndarray:
    return np.array([fn(lane) for lane in range(W.LANES)], dtype=np.uint32)


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("seed", [0, 1])
def test_pv_word_ptx_against_float64(groups: int, seed: int) -> None:
    codes, rel_exp, p = _problem(seed, groups)
    rel = 2.0 ** rel_exp
    vrel = _values(codes) * np.repeat(rel, 32, axis=1)  # token x dim, times its group's relative scale
    for w in range(2):  # the thread's V word: word 2 g + w of its tokens
        acc = [np.zeros(W.LANES, dtype=np.uint32) for _ in range(16 * groups)]
        vw = _vwords(codes, w)
        operands = [np.zeros(W.LANES, dtype=np.uint32)] * (16 * groups) + acc + vw + _frag_words(rel, p, groups)
        warp = W.Warp(operands)
        warp.run(K._pv_word_ptx(groups))
        for r in range(groups):
            want = vrel.T @ p[r]  # dim x query row
            for k in range(4):
                for e in range(4):
                    got = W._as_f32(warp.regs[f"${16 * r + 4 * k + e}"])
                    for lane in range(W.LANES):
                        row, q = C_MAP[e](lane)
                        dim = 16 * (row % 8) + 2 * (4 * w + k) + row // 8
                        assert got[lane] == pytest.approx(want[dim, q], rel=1e-5, abs=1e-7), (r, k, e, lane)


def _vwords(codes: np.ndarray, w: int) -> list[np.ndarray]:
    """The V word operand (the ``_vword_layout`` view in the MMA layout): element (i, j) is word ``2 (i % 8) + w``
    of run token ``j + 8 (i // 8)``, so lane (g, t) holds tokens 2t, 2t + 1, 2t + 8, 2t + 9."""
    def one(lane: int, e: int) -> int:
        i, j = C_MAP[e](lane)
        return _word(codes, j + 8 * (i // 8), 2 * (i % 8) + w)
    return [_lanes(lambda lane, e=e: one(lane, e)) for e in range(4)]


def _frag_words(rel: np.ndarray, p: np.ndarray, groups: int) -> list[np.ndarray]:
    """The operands after the V words as the kernel makes them: ``_pv_frags_ptx`` (run here too) on the score
    layout (element (i, j): token i, query row j; the relative scales by row = the consumer's lane group,
    group j / 2), per row group: the probability B fragments, then (first group only) the scale pairs."""
    out = []
    for r in range(groups):
        p_bits = W.layout_lanes(p[r].astype(np.float32).view(np.uint32), C_MAP)
        rel_bits = np.array([[int(np.float16(rel[i, j // 2]).view(np.uint16)) for j in range(8)] for i in range(16)],
                            dtype=np.uint32)
        warp = W.Warp([np.zeros(W.LANES, dtype=np.uint32)] * 4 + p_bits + W.layout_lanes(rel_bits, C_MAP))
        warp.run(K._pv_frags_ptx(r == 0))
        words = [warp.regs[f"${e}"] for e in range(4)]
        for lane in range(W.LANES):
            g, t = lane // 4, lane % 4
            for hi in range(2):
                a = 2 * t + 8 * hi
                assert words[hi][lane] == _pair(p[r, a, g], p[r, a + 1, g]), (r, lane, hi)
                want = _pair(rel[a, g // 2], rel[a + 1, g // 2]) if r == 0 else 0
                assert words[2 + hi][lane] == want, (r, lane, hi)
        out += words
    return out


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("seed", [0, 1])
def test_qk_ptx_against_float64(groups: int, seed: int) -> None:
    """``_qk_ptx``: per scale group two ``m16n8k16`` steps of the K words' nibble pairs (nibble j of K word t of a
    group is dim ``8t + j``; step s, fragment half b, pair element h: nibble ``2s + b + 4h``) with the query's
    fragments in that k order, times the group's UE8M0 scale: ``S^T`` (tokens x query rows) in float64."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, size=(16, 64), dtype=np.uint32)     # run token x K code byte (D=128)
    scales = rng.integers(110, 141, size=(16, 4), dtype=np.uint32)   # UE8M0 byte per token and group
    q = rng.standard_normal((groups, 8, 128)).astype(np.float16).astype(np.float64)
    outs = [np.zeros(W.LANES, dtype=np.uint32)] * (4 * groups)

    def k_word(lane: int, e: int, half: int) -> int:  # ka (half 0: groups 0, 1) / kb (groups 2, 3)
        n, col = C_MAP[e](lane)
        return _word(codes, n, 4 * (2 * half + col % 2) + col // 2)

    ka = [_lanes(lambda lane, e=e: k_word(lane, e, 0)) for e in range(4)]
    kb = [_lanes(lambda lane, e=e: k_word(lane, e, 1)) for e in range(4)]
    kw = [_lanes(lambda lane, e=e: int(sum(int(scales[C_MAP[e](lane)[0], g]) << (8 * g) for g in range(4))))
          for e in range(4)]

    def q_word(lane: int, e: int, r: int, g: int) -> int:
        i, j = C_MAP[e](lane)
        s, row, t, b = i // 8, i % 8, j // 2, j % 2
        d = 32 * g + 8 * t + 2 * s + b
        return _pair(q[r, row, d], q[r, row, d + 4])

    qs = [_lanes(lambda lane, e=e, r=r, g=g: q_word(lane, e, r, g)) for r in range(groups) for g in range(4)
          for e in range(4)]
    warp = W.Warp(outs + ka + kb + kw + qs)
    warp.run(K._qk_ptx(groups))
    fac = 2.0 ** (scales.astype(np.float64) - 127)
    kscaled = _values(codes) * np.repeat(fac, 32, axis=1)
    for r in range(groups):
        want = kscaled @ q[r].T
        for e in range(4):
            got = W._as_f32(warp.regs[f"${4 * r + e}"])
            for lane in range(W.LANES):
                assert got[lane] == pytest.approx(want[C_MAP[e](lane)], rel=1e-4, abs=1e-6 * np.abs(want).max())

MQ = pytest.importorskip("ultraquant.kernels.gluon.decode_multiquery")
S_MAP = W.mma_layout(2)  # the multi-query score layout [16 rows, 16 tokens]


@pytest.mark.parametrize("tiles", [1, 2])
@pytest.mark.parametrize("seed", [0, 1])
def test_multiquery_pv_half_ptx_against_float64(tiles: int, seed: int) -> None:
    """The multi-query decode's V words (``_frags_ptx`` then ``_pv_half_ptx``): n-tile ``k = 8 w + 4 h + i`` of M
    tile t, column c is dim ``16 c + k`` of ``P V`` (rows x dims), for both halves of both V words."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, size=(16, 64), dtype=np.uint32)
    rel = 2.0 ** rng.integers(-6, 15, size=(16, 4))
    p = rng.random((tiles, 16, 16)).astype(np.float16).astype(np.float64)  # tile x row x token
    rel_bits = np.array([[int(np.float16(rel[tok, (i % 8) // 2]).view(np.uint16)) for tok in range(16)]
                         for i in range(16)], dtype=np.uint32)
    want = np.einsum("xrt,td->xrd", p, _values(codes) * np.repeat(rel, 32, axis=1))  # tile x row x dim
    frs, rel_words = [], None
    for t in range(tiles):
        warp = W.Warp([np.zeros(W.LANES, dtype=np.uint32)] * 8 + W.layout_lanes(p[t].astype(np.float32).view(
            np.uint32), S_MAP) + W.layout_lanes(rel_bits, S_MAP))
        warp.run(MQ._frags_ptx(t == 0))
        frs.append([warp.regs[f"${e}"] for e in range(4)])
        if t == 0:
            rel_words = [warp.regs[f"${e}"] for e in range(4, 8)]
    for w in range(2):
        for h in range(2):
            n = 4 * tiles
            operands = ([np.zeros(W.LANES, dtype=np.uint32)] * (8 * n)  # the outputs, then zero accumulators
                        + _vwords(codes, w) + [x for f in frs for x in f] + rel_words)
            warp = W.Warp(operands)
            warp.run(MQ._pv_half_ptx(tiles, h))
            for t in range(tiles):
                for i in range(4):
                    k = 8 * w + 4 * h + i
                    for e in range(4):
                        got = W._as_f32(warp.regs[f"${4 * (4 * t + i) + e}"])
                        for lane in range(W.LANES):
                            row, c = C_MAP[e](lane)
                            assert got[lane] == pytest.approx(want[t, row, 16 * c + k], rel=1e-5, abs=1e-7), \
                                (t, w, h, i, e, lane)
