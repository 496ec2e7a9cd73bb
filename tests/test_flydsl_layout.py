"""CPU checks of the FlyDSL decode kernels' lane layout (ultraquant.kernels.flydsl.layout).

No AMD GPU exists for this project, so these tests are what stands between the FlyDSL kernels and a
wrong permutation: every formula the kernel builds its addresses from is checked here (bijections,
scale-group alignment, byte offsets against the reference decoder), then the whole kernel is emulated
lane by lane and compared with ultraquant.reference.decode_attention.
"""

from __future__ import annotations

import math

import pytest
import torch

from ultraquant import reference as ref
from ultraquant.errors import UltraQuantError
from ultraquant.format import hadamard, slot_size
from ultraquant.kernels.flydsl import layout as lay
from ultraquant.kernels.flydsl import operand_maps as om

LANES = torch.arange(lay.WAVE)
ELEMS = torch.arange(lay.MFMA_K)


@pytest.mark.parametrize("fmt", ["bf16", "f16"])
def test_mfma_emulation_is_a_matmul(fmt):
    g = torch.Generator().manual_seed(1)
    a, b, c = (torch.randn(16, 16, generator=g) for _ in range(3))
    ma, mb = (om.F16_A, om.F16_B) if fmt == "f16" else (om.BF16_A, om.BF16_B)
    ta, tb, td = ma.table(), mb.table(), om.F32_D.table()
    d = lay.mfma_16x16x16(a[ta[..., 0], ta[..., 1]], b[tb[..., 1], tb[..., 0]], c[td[..., 0], td[..., 1]], fmt)
    expect = (a.double() @ b.double() + c.double()).float()
    torch.testing.assert_close(d, expect[td[..., 0], td[..., 1]], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("d", [64, 128, 256, 512])
def test_fp16_qk_pairs_each_k_code_with_its_query_element(d):
    """fp16 path: lane group g's code word of scale group q covers d = 32q + 8g + e (code e is nibble
    e % 2 of byte e // 2, docs/format.md), and the query element the kernel pairs with code e in MFMA
    step p (:data:`layout.F16_STEP_CODES`) holds that same d in the query layout."""
    seen = []
    for q in range(d // 32):
        for g in range(4):
            dims = [2 * lay.k_word_offset(q, g) + e for e in range(8)]
            assert {x // 32 for x in dims} == {q}  # both MFMAs of a group lie in one K scale group
            for step in range(2):
                for e in lay.F16_STEP_CODES[step]:
                    assert lay.query_dim(lay.QUERY_MAP, q // 4, 16 * g + 5, 8 * (q % 4) + e) == dims[e]
            seen += dims
    assert sorted(seen) == list(range(d))
    assert sorted(e for step in lay.F16_STEP_CODES for e in step) == list(range(8))
    assert lay.k_scales_offset(d) == d // 2


@pytest.mark.parametrize("d", [128, 256, 512])
def test_staged_v_words_are_the_bytes_v_byte_offset_names(d):
    """Staged V: the byte lane row r loads as byte j of its D/32 (v_code_offset) lands in the LDS word
    that lane row m reads for group q exactly when it is byte v_byte_offset(d, q, m); every word of the
    region is written once per token byte, reads are 16-byte aligned runs inside one wave's region."""
    v_codes = d // 2 + d // 32
    ng = d // 32
    written = {}
    for g in range(4):
        for r in range(16):
            for j in range(d // 32):
                byte = lay.v_code_offset(d, r) + j
                pos = (d // 32) * r + j
                w = lay.v_stage_dword(d, g, pos % 16, pos // 16)
                assert w not in written
                written[w] = (g, byte)
    assert max(written) * 4 + 4 <= lay.v_stage_bytes(d)
    for g in range(4):
        for m in range(16):
            start = lay.v_stage_dword(d, g, m, 0)
            assert (4 * start) % 16 == 0
            for q in range(ng):
                assert written[start + q] == (g, lay.v_byte_offset(d, q, m))
    assert all(b >= v_codes for _, b in written.values())


@pytest.mark.parametrize("d", [64, 128, 256, 512])
def test_fp16_pv_rows_lie_in_one_scale_group(d):
    """fp16 path: the 16 rows of PV MFMA 2q + h are d = 32q + 2m + h (one V scale group, so the scale
    folds into P), row m reads nibble h of V byte 16q + m, and a lane row's outputs cover the head once."""
    v_codes = d // 2 + d // 32
    dims = []
    for q in range(d // 32):
        for h in range(2):
            rows = [lay.pv_dim(q, h, m) for m in range(16)]
            assert {x // 32 for x in rows} == {q}
            assert all(2 * (lay.v_byte_offset(d, q, m) - v_codes) + h == rows[m] for m in range(16))
            dims += rows
    assert sorted(dims) == list(range(d))
    assert lay.v_scales_offset(d) == d + d // 32
    outs = sorted(lay.out_dim(q, h, g, i) for q in range(d // 32) for h in range(2) for g in range(4)
                  for i in range(4))
    assert outs == list(range(d))


@pytest.mark.parametrize("d", [64, 128, 256, 512])
def test_scale_words_are_aligned_inside_the_slot_and_hold_the_scale_bytes(d):
    """fp16 path: a token's K and V scale bytes are loaded as aligned 32-bit words that stay inside
    its slot (at D=64 the 2 bytes are half a word, the V scales the slot's last half word), and byte
    ``first + q`` of those words is the field's byte q."""
    size = slot_size(d)
    assert size % 4 == 0
    for field in (lay.k_scales_offset(d), lay.v_scales_offset(d)):
        start, words, first = lay.scale_words(d, field)
        assert start % 4 == 0 and start + 4 * words <= size and start + first == field
        assert first + d // 32 <= 4 * words
        slot = torch.randint(0, 256, (size,), dtype=torch.int64, generator=torch.Generator().manual_seed(d))
        w = [int(sum(int(slot[start + 4 * k + j]) << (8 * j) for j in range(4))) for k in range(words)]
        assert [lay.scale_byte(w, first + q) for q in range(d // 32)] == slot[field : field + d // 32].tolist()


@pytest.mark.parametrize("d", [128, 256, 512])
def test_mx_pv_permutation_is_contiguous_per_lane_row(d):
    nb_count = d // 16
    dims = [lay.v_dim(d, nb, m) for m in range(16) for nb in range(nb_count)]
    assert sorted(dims) == list(range(d))
    lay_d = d // 2 + d // 32  # start of the V codes
    for m in range(16):
        row = [lay.v_dim(d, nb, m) for nb in range(nb_count)]
        assert row == list(range(row[0], row[0] + nb_count))
        assert lay.v_code_offset(d, m) == lay_d + row[0] // 2
        assert lay.v_scale_offset(d, m) == d + d // 32 + row[0] // 32
        assert len({x // 32 for x in row}) == 1
    # output: lane (r, g) holds a contiguous quarter of head r
    for g in range(4):
        got = sorted(lay.v_dim(d, nb, 4 * g + i) for i in range(4) for nb in range(nb_count))
        assert got == list(range(g * d // 4, (g + 1) * d // 4))


def test_fp4_bf16_bits_match_the_reference_decoder():
    codes = torch.arange(16, dtype=torch.int32)[:, None]
    scales = torch.arange(2, 253, dtype=torch.int32)[None, :]
    got = lay.bf16_from_bits(lay.fp4_bf16_bits_torch(codes, scales))
    vals = ref.decode_e2m1(codes.to(torch.uint8)).double() * torch.pow(2.0, (scales - 127).double())
    assert torch.equal(got.double(), vals)
    # zero group: byte 0 decodes every code to 0 (the format writes zero codes there)
    assert torch.all(lay.bf16_from_bits(lay.fp4_bf16_bits_torch(codes, torch.zeros(1, 1, dtype=torch.int32))) == 0)
    # byte 1: exact except 0.5 * 2^-126 (a bf16 subnormal), flushed to zero
    one = lay.bf16_from_bits(lay.fp4_bf16_bits_torch(codes, torch.ones(1, 1, dtype=torch.int32)))[:, 0]
    exact = ref.decode_e2m1(codes[:, 0].to(torch.uint8)).double() * 2.0**-126
    keep = (codes[:, 0] & 7) != 1
    assert torch.equal(one.double()[keep], exact[keep]) and torch.all(one[~keep] == 0)


@pytest.mark.parametrize("qmap, d", [(qmap, d) for qmap in (lay.QUERY_MAP, om.FP8) for d in (128, 256, 512)]
                         + [(lay.QUERY_MAP, 64)], ids=lambda x: x if isinstance(x, int) else x.fmt)
def test_query_rotation_in_lane_layout_is_hadamard(qmap, d):
    """Also D=64 (fp16 path): one half chunk, 16 elements per lane, six butterflies."""
    g = torch.Generator().manual_seed(d)
    q = torch.randn(16, d, generator=g)
    r = LANES % 16
    cfg = lay.DecodeConfig(d)
    dims = lay.query_dim(qmap, torch.arange(cfg.chunks)[None, :, None], LANES[:, None, None],
                         torch.arange(cfg.chunk_elems)[None, None, :])
    assert sorted(dims[0].flatten().tolist() + dims[16].flatten().tolist() + dims[32].flatten().tolist()
                  + dims[48].flatten().tolist()) == list(range(d))  # a lane row's four lanes hold its head once
    lanes = q[r][torch.arange(lay.WAVE)[:, None, None], dims]
    rotated = lay.rotate_query_lanes(lanes, d, qmap)
    expect = (q.double() @ hadamard(d, dtype=torch.float64)).float()
    torch.testing.assert_close(rotated, expect[r][torch.arange(lay.WAVE)[:, None, None], dims],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 1, 17, 100])
@pytest.mark.parametrize("seq_len", [0, 1, 15, 16, 17, 100, 257])
@pytest.mark.parametrize("splits", [1, 3, 8])
def test_split_tiles_cover_the_visible_keys_once(seq_len, splits, window):
    seen = []
    for s in range(splits):
        lo, hi, t0, t1 = lay.split_tiles(seq_len, splits, s, window)
        assert t0 <= t1 or t1 <= t0  # empty splits are allowed
        for t in range(t0, t1):
            seen += [k for k in range(t * lay.TILE, (t + 1) * lay.TILE) if lo <= k < hi]
    lo = 0 if window is None else max(0, seq_len - window)
    assert seen == list(range(lo, seq_len))


def _cache(d, gqa, hk, bs, lens, *, head_major=False, seed=0, encoder="rne"):
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(1, max(math.ceil(n / bs) for n in lens))
    nblk = len(lens) * max_blocks + 2
    shape = (nblk, hk, bs, slot_size(d)) if head_major else (nblk, bs, hk, slot_size(d))
    cache = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)  # stale bytes everywhere
    if head_major:
        cache = cache.permute(0, 2, 1, 3)
    perm = torch.randperm(nblk, generator=g)[: len(lens) * max_blocks]
    bt = perm.reshape(len(lens), max_blocks).to(torch.int32)
    for b, n in enumerate(lens):
        if n == 0:
            continue
        k = torch.randn(n, hk, d, generator=g) * 2
        v = torch.randn(n, hk, d, generator=g)
        pos = torch.arange(n)
        ref.store_kv(k, v, cache, bt[b, pos // bs].long() * bs + pos % bs, encoder=encoder)
    q = torch.randn(len(lens), hk * gqa, d, generator=g).to(torch.bfloat16)
    return q, cache, bt, torch.tensor(lens, dtype=torch.int32)


CASES = [
    # d, gqa, hk, bs, lens, splits, features
    (128, 8, 2, 16, [37, 0, 100], 4, {}),
    (128, 4, 1, 64, [130], 3, {"sinks": True}),
    (128, 6, 2, 32, [70, 1], 2, {"window": 33}),
    (128, 16, 1, 16, [49], 5, {"softcap": 8.0}),
    (256, 8, 1, 16, [45], 2, {"sinks": True, "window": 20, "softcap": 10.0}),
    (256, 16, 1, 128, [140], 1, {}),
    (512, 4, 1, 32, [40], 2, {"sinks": True}),
]

D64_CASES = [
    # head size 64 (gpt-oss: 64 query / 8 kv heads, sinks, a 128-token window; SmolLM2: 9 / 3)
    (64, 8, 2, 16, [300, 0, 45], 4, {"sinks": True, "window": 128}),
    (64, 8, 1, 16, [37, 1], 3, {}),
    (64, 4, 2, 16, [100, 17], 2, {"softcap": 8.0}),
    (64, 1, 3, 16, [49, 130], 5, {"window": 33, "softcap": 10.0}),
    (64, 3, 3, 32, [70], 2, {"sinks": True}),
]


def _run(case, exact, head_major=False):
    d, gqa, hk, bs, lens, splits, feats = case
    q, cache, bt, seq = _cache(d, gqa, hk, bs, lens, head_major=head_major, seed=d + gqa + bs)
    sinks = torch.randn(hk * gqa) if feats.get("sinks") else None
    window, softcap = feats.get("window"), feats.get("softcap")
    cfg = lay.DecodeConfig(d, gqa, bs, has_sinks=sinks is not None, has_window=window is not None,
                           has_softcap=softcap is not None)
    scale = d**-0.5
    got = lay.emulate_decode(cfg, q, cache, bt, seq, scale, num_splits=splits, sinks=sinks, window=window,
                             softcap=softcap, exact_operands=exact)
    expect = ref.decode_attention(q.float(), cache, bt, seq, scale, sinks=sinks, sliding_window=window,
                                  softcap=softcap).float()
    return got, expect


def _ids(cases):
    return [f"d{c[0]}-g{c[1]}-bs{c[3]}-{'+'.join(c[6]) or 'plain'}" for c in cases]


@pytest.mark.parametrize("case", CASES + D64_CASES, ids=_ids(CASES + D64_CASES))
def test_emulated_layout_is_exact_with_float32_operands(case):
    """With the MFMA operands kept in float32, only the layout is left to be wrong: errors ~1e-6."""
    got, expect = _run(case, exact=True)
    torch.testing.assert_close(got, expect, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("case", CASES[:4] + D64_CASES, ids=_ids(CASES[:4] + D64_CASES))
def test_emulated_kernel_with_fp16_operands_is_close(case):
    """What the hardware computes (fp16 query and P operands): within the Triton decode's bar, and
    better than the bf16 operands of the previous kernel (relative error ~2e-4 vs ~1.7e-3)."""
    got, expect = _run(case, exact=False)
    cos = torch.nn.functional.cosine_similarity(got.flatten().double(), expect.flatten().double(), dim=0)
    assert cos > 0.9999
    assert (got - expect).abs().max() <= 1e-2 * max(1.0, expect.abs().max().item())
    assert (got - expect).norm() / expect.norm() < 1e-3


@pytest.mark.parametrize("mult", [1e-6, 1.0, 3e4, 1e8])
def test_fp16_query_prescale_keeps_any_query_in_range(mult):
    """The fp16 path multiplies each head's rotated query by a power of two (absmax into [2^14, 2^15))
    before the cast: huge queries do not overflow, tiny ones keep fp16's precision."""
    d, gqa, hk, bs, lens, splits, _ = CASES[0]
    q, cache, bt, seq = _cache(d, gqa, hk, bs, lens, seed=5)
    qq = q.float() * mult
    cfg = lay.DecodeConfig(d, gqa, bs)
    scale = d**-0.5 / mult if mult > 1 else d**-0.5  # keep the softmax away from one-hot
    got = lay.emulate_decode(cfg, qq, cache, bt, seq, scale, num_splits=splits)
    expect = ref.decode_attention(qq, cache, bt, seq, scale).float()
    assert torch.isfinite(got).all()
    assert (got - expect).norm() / expect.norm() < 1e-3


@pytest.mark.parametrize("waves", [2, 4])
def test_waves_sharing_a_split_give_the_same_result(waves):
    """Tiles dealt round robin to the workgroup's waves, states folded through LDS: exact again."""
    d, gqa, hk, bs, lens, splits, _ = CASES[0]
    q, cache, bt, seq = _cache(d, gqa, hk, bs, lens, seed=11)
    cfg = lay.DecodeConfig(d, gqa, bs)
    got = lay.emulate_decode(cfg, q, cache, bt, seq, 0.1, num_splits=splits, exact_operands=True, waves=waves)
    expect = ref.decode_attention(q.float(), cache, bt, seq, 0.1).float()
    torch.testing.assert_close(got, expect, rtol=2e-5, atol=2e-5)


def test_emulation_reads_a_head_major_cache_view():
    got, expect = _run(CASES[0], exact=True, head_major=True)
    torch.testing.assert_close(got, expect, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("case", [CASES[0], D64_CASES[1]], ids=["d128", "d64"])
def test_a_layout_slip_is_caught(case):
    """The exact-operand comparison can fail: swap two PV output columns and it must."""
    d, gqa, hk, bs, lens, splits, feats = case
    q, cache, bt, seq = _cache(d, gqa, hk, bs, lens)
    cfg = lay.DecodeConfig(d, gqa, bs)
    orig = lay.out_dim
    try:  # the two nibbles of a V byte swapped in the output
        lay.out_dim = lambda q_, h, g, i: orig(q_, 1 - h, g, i)
        got = lay.emulate_decode(cfg, q, cache, bt, seq, 0.1, num_splits=splits, exact_operands=True)
    finally:
        lay.out_dim = orig
    expect = ref.decode_attention(q.float(), cache, bt, seq, 0.1).float()
    assert (got - expect).abs().max() > 1e-2


def test_config_rejects_what_the_kernel_cannot_do():
    with pytest.raises(UltraQuantError, match="gqa"):
        lay.DecodeConfig(128, 17, 16)
    with pytest.raises(UltraQuantError, match="block_size"):
        lay.DecodeConfig(128, 8, 8)
    with pytest.raises(UltraQuantError, match="head_size"):
        lay.DecodeConfig(32, 8, 16)
    q, cache, bt, seq = _cache(64, 8, 1, 16, [20])
    with pytest.raises(UltraQuantError, match="mx path"):  # 128 K per scaled MFMA
        lay.emulate_decode(lay.DecodeConfig(64, 8, 16), q, cache, bt, seq, 0.1, mx=True)


# ---------------------------------------------------------------- gfx950 mx path


def test_scaled_mfma_emulation_applies_block_scales_by_k_block():
    """FP4 keys x FP8 query with a different scale per (row, K block): the emulation equals the
    block-scaled matmul whatever lanes hold a block's elements (FP8 halves live in two lanes)."""
    g = torch.Generator().manual_seed(2)
    A, B = torch.randn(16, 128, generator=g, dtype=torch.float64), torch.randn(16, 128, generator=g,
                                                                              dtype=torch.float64)
    sa, sb = torch.exp2(torch.randint(-4, 5, (16, 4), generator=g).double()), \
        torch.exp2(torch.randint(-4, 5, (16, 4), generator=g).double())
    ta, tb, ts = om.FP4.table(), om.FP8.table(), om.SCALE.table()[:, 0]
    got = lay.mfma_scale_16x16x128(A[ta[..., 0], ta[..., 1]], B[tb[..., 0], tb[..., 1]], torch.zeros(64, 4),
                                   a_map=om.FP4, b_map=om.FP8, a_scale=sa[ts[:, 0], ts[:, 1]],
                                   b_scale=sb[ts[:, 0], ts[:, 1]])
    want = (A * sa.repeat_interleave(32, 1)) @ (B * sb.repeat_interleave(32, 1)).T
    td = om.F32_D.table()
    torch.testing.assert_close(got.double(), want[td[..., 0], td[..., 1]], rtol=1e-5, atol=1e-5)
    # the kernel's K chunk-c load of lane group g is the FP4 map's run (c = 0)
    assert all(lay.k_code_offset(0, grp) * 2 == int(ta[16 * grp, 0, 1]) for grp in range(4))


@pytest.mark.parametrize("qmap", [lay.QUERY_MAP, om.FP8], ids=["fp16", "fp8"])
def test_fp8_block_plan_finds_every_lanes_block(qmap):
    """Each lane group g must end up with K block g's exponent (the scale map), from a lane that
    holds that block, and the lanes sharing a block are exactly those the plan reduces over."""
    classes, share, picks = lay.fp8_block_plan(qmap)
    t = qmap.table()
    for g in range(4):
        found = {(mask, ci) for mask, ci, gg in picks if gg == g}
        assert found
        for mask, ci in found:
            assert {int(t[(16 * g) ^ mask, e, 1]) // 32 for e in classes[ci]} == {g}
    owners = {blk: {lane // 16 for lane in range(64) for e in range(32) if int(t[lane, e, 1]) // 32 == blk}
              for blk in range(4)}
    for lanes in owners.values():
        first = min(lanes)
        assert lanes == {first ^ (m >> 4) for m in [0] + share + [a ^ b for a in share for b in share]}


@pytest.mark.parametrize("amax", [0.0, 1e-30, 0.3, 1.0, 1.75, 1.7500001, 447.9, 448.0, 449.0, 3e5, 3e38])
def test_fp8_group_exponent_keeps_the_group_within_448(amax):
    x = torch.zeros(32)
    x[3] = amax
    x[7] = -amax / 3
    q8, e = lay.fp8_quantize_group(x)
    assert torch.isfinite(q8).all() and q8.abs().max() <= lay.FP8_MAX
    if amax > 1e-30:  # no needless shrinking: one exponent less would overflow
        assert amax * 2.0 ** -(int(e) - 1) > lay.FP8_MAX or int(e) == -126
    back = q8 * 2.0 ** int(e)
    assert torch.allclose(back, x, rtol=2**-4, atol=2.0 ** (int(e) - 9))


def _fp8_reference_query(q: torch.Tensor) -> torch.Tensor:
    """The query the mx path effectively uses, in the original space: rotate, FP8 per 32-group, rotate back."""
    d = q.shape[-1]
    h = hadamard(d, dtype=torch.float64)
    rot = (q.double() @ h).float()
    hi, lo = lay.fp8_two_term(rot.reshape(*rot.shape[:-1], d // 32, 32))
    eff = (hi.double() + lo.double()).reshape(rot.shape)
    return (eff.double() @ h).float()


@pytest.mark.parametrize("case", [CASES[0], CASES[4]], ids=["d128", "d256-all"])
def test_mx_layout_is_exact_against_the_fp8_query(case):
    """gfx950 path with float32 P: equals float64 attention of the FP8-quantized query to ~1e-5."""
    d, gqa, hk, bs, lens, splits, feats = case
    q, cache, bt, seq = _cache(d, gqa, hk, bs, lens, seed=d + gqa + bs)
    sinks = torch.randn(hk * gqa) if feats.get("sinks") else None
    window, softcap = feats.get("window"), feats.get("softcap")
    cfg = lay.DecodeConfig(d, gqa, bs, has_sinks=sinks is not None, has_window=window is not None,
                           has_softcap=softcap is not None)
    got = lay.emulate_decode(cfg, q, cache, bt, seq, d**-0.5, num_splits=splits, sinks=sinks, window=window,
                             softcap=softcap, exact_operands=True, mx=True)
    expect = ref.decode_attention(_fp8_reference_query(q), cache, bt, seq, d**-0.5, sinks=sinks,
                                  sliding_window=window, softcap=softcap).float()
    torch.testing.assert_close(got, expect, rtol=5e-5, atol=5e-5)


def test_mx_path_meets_the_upstream_gfx950_bar_and_never_overflows():
    d, gqa, hk, bs, lens, splits, _ = CASES[0]
    q, cache, bt, seq = _cache(d, gqa, hk, bs, lens, seed=5)
    cfg = lay.DecodeConfig(d, gqa, bs)
    for mult in (1.0, 5000.0):  # rotated queries far above 448 must not turn into NaN
        qq = (q.float() * mult).to(torch.bfloat16)
        got = lay.emulate_decode(cfg, qq, cache, bt, seq, d**-0.5, num_splits=splits, mx=True)
        expect = ref.decode_attention(qq.float(), cache, bt, seq, d**-0.5).float()
        assert torch.isfinite(got).all()
        if mult == 1.0:
            cos = torch.nn.functional.cosine_similarity(got.flatten().double(), expect.flatten().double(), dim=0)
            assert cos > 0.9999 and (got - expect).abs().mean() < 0.005
            assert (got - expect).norm() / expect.norm() < 0.01  # the runtime self-test allows 2e-2


def test_mx_with_the_old_contiguous_fp8_belief_is_wrong():
    """The issue-15 bug in emulation: a kernel that packs the FP8 query like FP4 (contiguous 32-runs)
    pairs 96 of 128 K positions with the wrong query element under the hardware's FP8 layout."""
    d, gqa, hk, bs, lens, splits, _ = CASES[0]
    q, cache, bt, seq = _cache(d, gqa, hk, bs, lens, seed=5)
    cfg = lay.DecodeConfig(d, gqa, bs)
    expect = ref.decode_attention(q.float(), cache, bt, seq, d**-0.5).float()
    errs = {}
    for name, qmap in (("fp8", om.FP8), ("old", om.FP4)):
        got = lay.emulate_decode(cfg, q, cache, bt, seq, d**-0.5, num_splits=splits, mx=True, mx_query_map=qmap)
        errs[name] = float((got - expect).norm() / expect.norm())
    assert errs["fp8"] < 0.01 and errs["old"] > 0.1, errs


def test_v_scale_headroom_keeps_p_times_scale_in_fp16():
    """The fp16 path's reference point: for any V scale byte the encoder writes, P x scale of the
    token that sets the point is 2**15 (< 65504) and P itself stays a finite float32."""
    b = torch.arange(0, 255)
    head = lay.v_scale_headroom(b, torch.maximum)
    scale_log2 = (b - 127).double()
    assert torch.all(scale_log2[b >= lay.V_SCALE_FLOOR] - head[b >= lay.V_SCALE_FLOOR] == lay.P16_MAX_LOG2)
    assert 2.0 ** lay.P16_MAX_LOG2 < 65504
    assert torch.all(-head <= 127 + lay.P16_MAX_LOG2 - lay.V_SCALE_FLOOR) and 127 + 15 - lay.V_SCALE_FLOOR < 127


def test_to_fp16_rtz_truncates():
    """The emulation's ``v_cvt_pkrtz_f16_f32``; the first four values against LLVM's constant folding of
    ``llvm.amdgcn.cvt.pkrtz`` (``opt-22 -passes=instcombine -mcpu=gfx942``: 0x3C00, 0xBC00, 0x0001, 0x7BFF)."""
    x = torch.tensor([1.0 + 2**-11, -(1.0 + 2**-11), 3 * 2.0**-25, 1e6, 0.0, -0.0, 2**-14 * (1 + 2**-10)])
    got = lay.to_fp16_rtz(x)
    assert got[:4].to(torch.float16).view(torch.int16).tolist() == [0x3C00, 0xBC00 - 0x10000, 0x0001, 0x7BFF]
    assert got[4] == 0 and got[6] == 2**-14 * (1 + 2**-10)
    fp16 = got.to(torch.float16).float()
    assert torch.equal(fp16, got)  # every result is an fp16 value
