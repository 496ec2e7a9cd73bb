"""Token-major pages in the whole-page decode, on the CPU (no GPU: Triton's interpreter does not run Gluon).

A numpy emulation of ``gluon/decode_wholepage.py``'s ring: the copy maps (``_issue_stage``'s warp copies
for head-major pages, ``_issue_stage_tm``/``_pair_chunks`` for token-major ones; their arithmetic is
restated here) fill a ring from a cache, and the math views of ``_serve_piece`` read it, each view's
addresses computed from the kernel's own layout functions (``_slot_layout``, ``_vword_layout``,
``_tm_stage``, ``_pair_pad``, ``_tm_token_bases``) by the PaddedSharedLayout rule (linear bases from
the offset to the logical index, then ``pad`` elements after every ``interval``, counted over the whole
buffer). Checked: every element the loop reads (index 0 of the axes past each ``_piece``) holds, for
token-major pages, the cache byte that it holds for head-major pages (same kv head, same byte of the
slot, the token the kernel's ``ns`` names), and on a random cache the byte of ``reference._request_slots``;
and a bank model of the K, V and scale loads (the MMA accumulator lane map) shows token-major's loads
as conflict-free as head-major's (the padding of ``_pair_pad`` is what makes them so at 4 and 8 kv heads).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

K = pytest.importorskip("ultraquant.kernels.gluon.decode_wholepage")

from ultraquant import reference  # noqa: E402


def view_phys(layout, entries: int) -> np.ndarray:
    """Physical element offsets of a memdesc ``[entries, *layout.shape]`` in ``layout`` (from its base)."""
    shape = list(layout.shape)
    n = int(np.prod(shape))
    bases = [np.array(b) for b in layout.offset_bases]
    assert len(bases) == n.bit_length() - 1
    table = np.full(shape, -1, dtype=np.int64)
    for o in range(n):
        c = np.zeros(len(shape), dtype=np.int64)
        for bit, b in enumerate(bases):
            if o >> bit & 1:
                c ^= b
        table[tuple(c)] = o
    assert (table >= 0).all()
    u = np.arange(entries, dtype=np.int64).reshape([entries] + [1] * len(shape)) * n + table[None]
    phys = u.copy()
    for interval, pad in layout.interval_padding_pairs:
        phys += (u >> (interval.bit_length() - 1)) * pad
    return phys


class Geometry:
    """The constexprs of one whole-page specialization (``_serve_piece``'s names)."""

    def __init__(self, d: int, hk: int, token_major: bool, nw: int = 8, nsub: int | None = None, stages: int = 2,
                 block_size: int = 16, xp: int | None = None):
        self.D, self.HK, self.TM, self.NW, self.STAGES, self.BS = d, hk, token_major, nw, stages, block_size
        self.WT = max(1, nw // hk)
        self.NSUB = nsub or (4 if d == 128 else 2)
        self.TW = 16
        self.TT = self.NSUB * self.WT * self.TW
        self.H, self.G = d // 2, d // 32
        self.SLOT = 2 * (self.H + self.G)
        self.SW2 = 32 * (d // 128)
        self.WPT = d // 64
        self.NR = self.NSUB * nw
        self.XP = K._pair_pad(hk, self.SLOT, token_major) if xp is None else xp
        self.TMK = hk if token_major else 0
        self.E = stages * self.NSUB

    def views(self) -> dict[str, tuple[np.ndarray, tuple[int, ...]]]:
        """name -> (byte offsets in the ring of every element the loop reads, as ``[E, NW, TW, n]`` with
        n the piece's slot elements, flattened; the logical token of axis 2)."""
        H, G, SLOT, SW2, NW, TW, E = self.H, self.G, self.SLOT, self.SW2, self.NW, self.TW, self.E
        TMK, XP = self.TMK, self.XP
        NS, SP = self.NSUB, K._tm_spad(self.HK, SLOT, self.TT, XP, NW, self.TM)
        PB = K._slot_layout(2 * H, SLOT - 2 * H, [NW, TW, 2, H], None, TMK, 4 * XP, SLOT, NS, 4 * SP)
        PV = K._slot_layout(2 * H, SLOT - 2 * H, [NW, TW, 2, H // 8, 8], None, TMK, 4 * XP, SLOT, NS, 4 * SP)
        PWD = K._slot_layout(SW2, SLOT // 4 - SW2, [NW, TW, 2, SW2 // 2], None, TMK, XP, SLOT, NS, SP)
        PKW = K._slot_layout(SW2, SLOT // 4 - SW2, [NW, TW, SW2 // 8, 8], [2, 4, 1], TMK, XP, SLOT, NS, SP)
        PVW = K._vword_layout(NW, self.WPT, SLOT // 4, TMK, XP, NS, SP)
        out = {}

        def words(name, base, layout, pick):
            out[name] = 4 * (base + pick(view_phys(layout, E)))[..., None] + np.arange(4)

        def kpick(p):  # [E, NW, TW, SW2 // 8, 8] -> index 0 of axis 3: [E, NW, TW, 8]
            return p[:, :, :, 0, :]

        for name, base in (("kwa", 0), ("kwb", 8)) + ((("kwc", 16), ("kwd", 24)) if self.D == 256 else ()):
            words(name, base, PKW, kpick)
        scale = (("ks", H // 4), ("vs", (SLOT - G) // 4))
        if self.D == 256:
            scale += (("ks1", H // 4 + 1), ("vs1", (SLOT - G) // 4 + 1))
        for name, base in scale:
            words(name, base, PWD, lambda p: p[:, :, :, 0, :1])
        v0 = (H + G) // 4
        for k in range(self.WPT):  # [E, NW, 16 (i), 8 (j), WPT, 2] -> [E, NW, token j + 8 (i // 8), i % 8]
            p = view_phys(PVW, E)[:, :, :, :, 0, 0]
            tok = p.reshape(E, NW, 2, 8, 8).transpose(0, 1, 2, 4, 3).reshape(E, NW, 16, 8)
            out[f"vw{'abcd'[k]}"] = 4 * (v0 + k + tok)[..., None] + np.arange(4)
        out["kc8"] = view_phys(PB, E)[:, :, :, 0, :]                      # m16 path: K code bytes
        out["vc8"] = (H + G) + view_phys(PV, E)[:, :, :, 0].reshape(E, NW, TW, H)
        return {k: v.reshape(E, NW, TW, -1) for k, v in out.items()}

    def physical_token(self, j: np.ndarray) -> np.ndarray:
        """The kernel's ``ns``: the token (of its 16-token run) that logical token ``j`` reads."""
        if not self.TM:  # D=128: TOKEN_BASES [8, 4, 1, 2]; D=256: the identity (_hm_token_bases)
            if self.SLOT == 272:
                return j.copy()
            return ((j >> 3) & 1) | (((j >> 2) & 1) << 1) | ((j & 1) << 2) | (((j >> 1) & 1) << 3)
        p = np.zeros_like(j)
        for i, t in enumerate(K._tm_token_bases(self.HK, self.SLOT)):
            p |= ((j >> (t.bit_length() - 1)) & 1) << i
        return p

    def ring_bytes(self) -> int:
        if self.TM:
            return 4 * self.STAGES * K._tm_stage(self.HK, self.SLOT, self.TT, self.XP, self.NW, "STW")
        return self.STAGES * self.NR * 16 * self.SLOT

    def copy_stage(self, ring: np.ndarray, stage: int, flat: np.ndarray, strides: tuple[int, int, int],
                   bt: np.ndarray, t0: int, t_hi: int) -> None:
        """One ``_issue_stage`` (head-major) / ``_issue_stage_tm`` (token-major) into ``ring`` (int64 byte
        ids; skipped copies write -1, as the zero fill)."""
        sb, st, sh = strides
        BS, SLOT, HK = self.BS, self.SLOT, self.HK
        if not self.TM:  # warp w copies its runs j: the ring's run j NW + w, 16 whole slots
            for w, j in itertools.product(range(self.NW), range(self.NSUB)):
                tok = t0 + j * (self.WT * 16) + (w % self.WT) * 16
                dst = (stage * self.NR + j * self.NW + w) * 16 * SLOT
                if tok < t_hi:
                    src = bt[tok // BS] * sb + (w // self.WT) * sh + (tok % BS) * SLOT
                    ring[dst:dst + 16 * SLOT] = flat[src:src + 16 * SLOT]
                else:
                    ring[dst:dst + 16 * SLOT] = -1
            return
        g = {k: K._tm_stage(HK, SLOT, self.TT, self.XP, self.NW, k) for k in ("STW", "NCH", "PC", "DC", "N1", "N2",
                                                                                "U")}
        stage_base = 4 * int(view_phys(K._tm_stage(HK, SLOT, self.TT, self.XP, self.NW, "SL"), self.STAGES)
                             [stage, 0])
        assert stage_base == 4 * stage * g["STW"]
        for c in range(g["N1"] + g["N2"]):
            tau, within = (c // g["PC"]) * 2, c % g["PC"]
            dst = stage_base + 16 * c
            if (tau // 16) * 16 < t_hi - t0 and within < g["DC"] and c < g["NCH"]:
                tok = t0 + tau
                src = bt[tok // BS] * sb + (tok % BS) * HK * SLOT + within * 16
                ring[dst:dst + 16] = flat[src:src + 16]
            else:  # masked: cp.async writes zeros (the pair padding, the stage's tail padding)
                ring[dst:dst + 16] = -1
                assert dst + 16 <= stage_base + 4 * g["STW"], "a masked chunk past its stage"


def make_cache(geo: Geometry, blocks: int, values: np.ndarray | None = None):
    """(flat memory, strides, logical ``[blocks, BS, HK, SLOT]`` view) of a cache in the geometry's layout;
    ``values``: its logical contents (default: every byte's id)."""
    shape = (blocks, geo.BS, geo.HK, geo.SLOT)
    if values is None:
        values = np.arange(np.prod(shape), dtype=np.int64).reshape(shape)
    if geo.TM:
        mem = values.copy()
        strides = (geo.BS * geo.HK * geo.SLOT, geo.HK * geo.SLOT, geo.SLOT)
    else:
        mem = np.ascontiguousarray(values.transpose(0, 2, 1, 3))
        strides = (geo.HK * geo.BS * geo.SLOT, geo.SLOT, geo.BS * geo.SLOT)
    return mem.reshape(-1), strides


def read_stage(geo: Geometry, views, ring: np.ndarray, stage: int) -> dict[str, np.ndarray]:
    """Every view's elements of ``stage`` as ``[NSUB, NW, TW, n]`` values of the ring."""
    e0 = stage * geo.NSUB
    return {k: np.where(v[e0:e0 + geo.NSUB] < ring.size, ring[np.minimum(v[e0:e0 + geo.NSUB], ring.size - 1)], -2)
            for k, v in views.items()}


CASES = [(128, 8, 16), (128, 4, 16), (128, 2, 16), (128, 8, 64), (256, 8, 16), (256, 2, 32), (128, 8, 128),
         (128, 1 << 3, 16, {"nw": 16, "nsub": 1, "stages": 4}), (128, 2, 32, {"nsub": 2, "stages": 4})]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_token_major_views_read_the_head_major_bytes(case):
    """For every element the loop reads: token-major pages give the byte head-major pages give (same kv head,
    same slot byte) of the token the kernel's ``ns`` names, over a shuffled block table; tokens past
    ``t_hi`` (whole 16-token runs) are zero-filled in both (a tuning's ring: ``nw`` warps, ``nsub``, ``stages``)."""
    d, hk, bs, *rest = case
    kw = rest[0] if rest else {}
    rng = np.random.default_rng(d * 100 + hk + bs)
    got = {}
    blocks = 3 * Geometry(d, hk, False, block_size=bs, **kw).TT // bs + 4
    bt = rng.permutation(blocks)
    for tm in (False, True):
        geo = Geometry(d, hk, tm, block_size=bs, **kw)
        flat, strides = make_cache(geo, blocks)
        ring = np.full(geo.ring_bytes(), -3, dtype=np.int64)
        views = geo.views()
        t0 = geo.TT  # the request's second stage, in ring stage 1
        t_hi = t0 + geo.TT - 16 - (16 if geo.TT > 32 else 0)  # the last run(s) of the stage past the length
        geo.copy_stage(ring, 1, flat, strides, bt, t0, t_hi)
        vals = read_stage(geo, views, ring, 1)
        inv = np.argsort(bt)
        j = np.arange(geo.TW)
        for name, v in vals.items():
            live = v >= 0
            assert (v[~live] == -1).all(), f"{name}: read outside the copied stage"
            slot = v // geo.SLOT
            byte = v % geo.SLOT
            h = slot % hk
            tok_blk = (slot // hk) % bs
            tok = inv[slot // (hk * bs)] * bs + tok_blk
            sub = np.arange(geo.NSUB)[:, None, None, None]
            w = np.arange(geo.NW)[None, :, None, None]
            want_tok = (t0 + sub * (geo.WT * 16) + (w % geo.WT) * 16 + geo.physical_token(j)[None, None, :, None])
            want_live = np.broadcast_to(want_tok // 16 * 16 < t_hi, v.shape)
            assert (live == want_live).all(), name
            assert (np.where(live, h, w // geo.WT) == w // geo.WT).all(), name
            assert (np.where(live, tok, want_tok) == want_tok).all(), name
            got.setdefault(name, []).append(np.where(live, byte, -1))
    for name, (hm, tm) in got.items():
        assert (hm == tm).all(), f"{name}: token-major reads other slot bytes than head-major"


@pytest.mark.parametrize("d,hk,bs", [(128, 8, 16), (256, 4, 16), (128, 2, 64)])
def test_token_major_ring_against_reference_cache(d, hk, bs):
    """A random uint8 token-major cache (a plain ``torch.zeros((blocks, bs, Hk, slot))``): every byte the views
    read is ``reference._request_slots``' byte of that token, kv head and slot byte."""
    geo = Geometry(d, hk, True, block_size=bs)
    hm = Geometry(d, hk, False, block_size=bs)
    gen = torch.Generator().manual_seed(d + hk)
    blocks = 2 * geo.TT // bs + 3
    cache = torch.randint(0, 256, (blocks, bs, hk, geo.SLOT), dtype=torch.uint8, generator=gen)
    bt = torch.randperm(blocks, generator=gen)[: 2 * geo.TT // bs].to(torch.int32)
    flat, strides = make_cache(geo, blocks, cache.numpy().astype(np.int64))
    assert strides == tuple(torch.zeros_like(cache).stride()[:3])
    ring = np.full(geo.ring_bytes(), -3, dtype=np.int64)
    t0 = geo.TT
    geo.copy_stage(ring, 0, flat, strides, bt.numpy(), t0, 2 * geo.TT)
    vals = read_stage(geo, geo.views(), ring, 0)
    want = reference._request_slots(cache, bt[None], 0, t0, 2 * geo.TT).numpy()  # [TT, Hk, slot]
    # the slot byte of each element, from the head-major emulation (ids)
    hflat, hstrides = make_cache(hm, blocks)
    hring = np.full(hm.ring_bytes(), -3, dtype=np.int64)
    hm.copy_stage(hring, 0, hflat, hstrides, np.arange(blocks), t0, 2 * geo.TT)
    hbyte = {k: v % hm.SLOT for k, v in read_stage(hm, hm.views(), hring, 0).items()}
    sub = np.arange(geo.NSUB)[:, None, None, None]
    w = np.arange(geo.NW)[None, :, None, None]
    tok = sub * (geo.WT * 16) + (w % geo.WT) * 16 + geo.physical_token(np.arange(16))[None, None, :, None]
    for name, v in vals.items():
        ref = want[np.broadcast_to(tok, v.shape), np.broadcast_to(w // geo.WT, v.shape), hbyte[name]]
        assert (v == ref).all(), name


# ---- bank model: one warp's shared loads (32 lanes, 4-byte words, 32 banks), the MMA m16n8 accumulator map:
# lane l holds row l // 4 (+ 8) and columns 2 (l % 4) (+ 1) of a [16, 8] tile


def conflicts(word_addrs) -> int:
    """Wavefronts of one 32-bit shared load: the most distinct words in one bank."""
    banks: dict[int, set[int]] = {}
    for a in set(int(x) for x in word_addrs):
        banks.setdefault(a % 32, set()).add(a)
    return max(len(v) for v in banks.values())


def load_degrees(geo: Geometry, views) -> dict[str, int]:
    """Worst wavefronts per load of one warp's K words (``kwa``: element (token, column)), V words (``vwa``:
    (token j + 8 (i // 8), word group i % 8) as (i, j) of the tile) and scale words (``ks``)."""
    nw = geo.NW
    kwa = views["kwa"][0].reshape(nw, 16, 8, 4)[..., 0] // 4
    vwa = views["vwa"][0].reshape(nw, 16, 8, 4)[..., 0] // 4
    ks = views["ks"][0].reshape(nw, 16, 4)[..., 0] // 4
    lanes = np.arange(32)
    out = {"K": 0, "V": 0, "scales": 0}
    for w in (0, geo.NW - 1):
        for hh, r in itertools.product((0, 1), (0, 1)):
            out["K"] = max(out["K"], conflicts(kwa[w, lanes // 4 + 8 * hh, 2 * (lanes % 4) + r]))
            i, j = lanes // 4 + 8 * hh, 2 * (lanes % 4) + r  # vwa element (i, j): token j + 8 (i // 8), group i % 8
            out["V"] = max(out["V"], conflicts(vwa[w, j + 8 * (i // 8), i % 8]))
        for hh in (0, 1):
            out["scales"] = max(out["scales"], conflicts(ks[w, lanes // 4 + 8 * hh]))
    return out


@pytest.mark.parametrize("d,hk", [(128, 2), (128, 4), (128, 8), (256, 2), (256, 4), (256, 8)])
def test_token_major_loads_conflict_no_more_than_head_major(d, hk):
    hm = load_degrees(Geometry(d, hk, False), Geometry(d, hk, False).views())
    tm = load_degrees(Geometry(d, hk, True), Geometry(d, hk, True).views())
    assert tm["K"] == tm["scales"] == 1, tm
    assert all(tm[k] <= hm[k] for k in tm), (tm, hm)


@pytest.mark.parametrize("d,hk", [(128, 2), (128, 8), (256, 2), (256, 8)])
def test_head_major_token_order_has_conflict_free_k_and_scales(d, hk):
    """Head-major runs: K and scale loads 1-way, V 2-way (D=128) or 4-way (D=256) with ``_hm_token_bases``;
    at D=256 (a 4-bank token stride) D=128's order [8, 4, 1, 2] gives 2-way K and scale loads."""
    geo = Geometry(d, hk, False)
    assert load_degrees(geo, geo.views()) == {"K": 1, "V": 2 if d == 128 else 4, "scales": 1}


def test_unpadded_token_major_conflicts():
    """Why :func:`_pair_pad`: without it, 8 kv heads at D=128 put a head's consecutive tokens 272 words (16
    banks) apart and the K and scale loads are 4-way conflicts whatever the token order (V 2-way with this one,
    4-way in identity order)."""
    geo = Geometry(128, 8, True, xp=0)
    assert load_degrees(geo, geo.views()) == {"K": 4, "V": 2, "scales": 4}
    assert K._pair_pad(8, 136, True) == 4 and K._pair_pad(2, 136, True) == 0


def test_token_major_stage_geometry():
    """The ring stage's 16-byte chunks: two copies of powers of two cover it, the second's masked tail ends
    inside the ring; the stage is the page's bytes plus the pair padding."""
    for d, hk in itertools.product((128, 256), (2, 4, 8)):
        geo = Geometry(d, hk, True)
        g = {k: K._tm_stage(hk, geo.SLOT, geo.TT, geo.XP, geo.NW, k) for k in ("STW", "NCH", "N1", "N2", "U",
                                                                                 "SPAD")}
        assert g["STW"] * 4 == geo.TT * hk * geo.SLOT + geo.TT // 2 * geo.XP * 4 + g["SPAD"] * 4
        assert g["N1"] <= g["NCH"] <= g["N1"] + g["N2"] and g["N2"] in (0,) + tuple(1 << k for k in range(8, 16))
        assert 4 * (g["N1"] + g["N2"]) <= g["STW"]  # the masked tail stays in its stage
        assert g["SPAD"] & (g["SPAD"] - 1) == 0 and g["U"] <= g["STW"] < 2 * g["U"]
