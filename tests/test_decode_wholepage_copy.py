"""A pure-Python model of the head-major ring copy of ``gluon/decode_wholepage.py`` (``_issue_stage``), old and
new, element by element: for every (warp, lane, register) of each ``cp.async`` copy, the shared word it writes
(the destination view's layout) and the cache byte it reads, or zero (a masked ``cp.async`` zero-fills).

Old (main until the per-thread-rows change): flat stage rows ``[0, NR*RB)`` in ``Blocked([1,4],[4,8],[NW,1])``
then rows ``[NR*RB, NR*RUN)`` in ``Blocked([1,V],[V,32/V],[NW,1])``, each row's block id and address from its
run (``_run_rows``). New (``_copy_rows``): the same rows as ``[C, K, 32]`` in ``Blocked([1,1,4],[4,1,8],[NW,1,1])``
/ ``Blocked([1,1,V],[V,1,32/V],[NW,1,1])``: thread group ``c`` copies rows ``R0 + c*K ..``, at most two runs,
modelled with the kernel's arithmetic (``q0``, ``e0``, the compare with ``RUN - e0``, the ``[lo, hi)`` bitmask).
The test asserts both write every ring word of the stage exactly once, the same words from the same cache
bytes (or both zero), for the routed geometries at blocks 16/32/64. The GPU proves the lowering; this proves
the arithmetic and the layouts' element maps.
"""

from __future__ import annotations

import itertools
import random

import pytest


def blocked_elements(spt, tpw, wpc, shape):
    """(warp, lane, register, coords) of every element a ``BlockedLayout(spt, tpw, wpc, order=[n-1..0])`` holds
    of ``shape`` (the tile divides the shape here, so each element once): lanes and warps fastest along the
    last axis, registers the per-thread elements then the tile repetitions."""
    n = len(shape)
    tile = [spt[d] * tpw[d] * wpc[d] for d in range(n)]
    assert all(shape[d] % tile[d] == 0 for d in range(n))
    reps = [shape[d] // tile[d] for d in range(n)]

    def split(i, sizes):  # index i over axes `sizes`, the last axis fastest
        out = [0] * n
        for d in reversed(range(n)):
            out[d] = i % sizes[d]
            i //= sizes[d]
        return out

    nt, nwp = _prod(tpw), _prod(wpc)
    for warp in range(nwp):
        wd = split(warp, wpc)
        for lane in range(nt):
            ld = split(lane, tpw)
            reg = 0
            for rep in itertools.product(*[range(r) for r in reps]):
                for e in itertools.product(*[range(s) for s in spt]):
                    coords = tuple(rep[d] * tile[d] + wd[d] * spt[d] * tpw[d] + ld[d] * spt[d] + e[d]
                                   for d in range(n))
                    yield warp, lane, reg, coords
                    reg += 1


def _prod(xs):
    n = 1
    for x in xs:
        n *= x
    return n


class Geometry:
    """One ``_issue_stage`` call: constexprs, the page strides and a block table."""

    def __init__(self, d, hk, wt, nsub, bs, t0, t_hi, table, num_blocks, inside):
        self.slot = 136 * d // 128
        self.nw, self.wt, self.nsub, self.bs = hk * wt, wt, nsub, bs
        self.nr = nsub * self.nw
        self.run = self.slot // 8
        self.rb = 16 * (self.slot // 136)
        self.rs = self.run - self.rb
        self.v = 4 if nsub * self.rs >= 4 else nsub * self.rs
        self.stride_ch = bs * self.slot
        self.stride_cb = hk * self.stride_ch
        self.t0, self.t_hi, self.table, self.num_blocks, self.inside = t0, t_hi, table, num_blocks, inside
        tt = nsub * wt * 16
        self.nbl = 1 if bs % tt == 0 else (tt // bs if tt <= 4 * bs and tt % bs == 0 else 0)
        self.ids = [self.load(t0 // bs + j) if t0 + j * bs < t_hi else 0 for j in range(self.nbl)]

    def load(self, i):
        return self.table[i]

    def run_base(self, q):
        """(cache byte of run q's first row, read it?) as ``_run_rows`` computes them (at a run's first row)."""
        w = q % self.nw
        dt = (q // self.nw) * (self.wt * 16) + (w % self.wt) * 16
        tok = self.t0 + dt
        ok = tok < self.t_hi
        if self.nbl == 0:
            blk = self.load(tok // self.bs) if ok else 0
        else:
            jl = dt // self.bs
            blk = self.ids[jl] if 0 < jl < self.nbl else self.ids[0]
        ok = ok and (self.inside or 0 <= blk < self.num_blocks)
        return blk * self.stride_cb + (w // self.wt) * self.stride_ch + (tok % self.bs) * self.slot, ok


def old_copy(g):
    """{shared word: cache byte or None (zero)} of the old ``_issue_stage`` and how often each word is written."""
    out, count = {}, {}

    def put(word, src):
        count[word] = count.get(word, 0) + 1
        out[word] = src

    for _w, _l, _r, (r, x) in blocked_elements([1, 4], [4, 8], [g.nw, 1], [g.nr * g.rb, 32]):
        base, ok = g.run_base(r // g.run)
        put(r * 32 + x, base + (r % g.run) * 128 + 4 * x if ok else None)
    v = g.v
    for _w, _l, _r, (r2, x) in blocked_elements([1, v], [v, 32 // v], [g.nw, 1], [g.nr * g.rs, 32]):
        r = r2 + g.nr * g.rb
        base, ok = g.run_base(r // g.run)
        put(r * 32 + x, base + (r % g.run) * 128 + 4 * x if ok else None)
    return out, count


def new_copy(g):
    """The same for the new ``_issue_stage`` (``_copy_rows``, with its arithmetic)."""
    out, count = {}, {}
    k1 = g.nsub * g.rb // 4
    k2 = g.nsub * g.rs // g.v
    copies = [(0, 4 * g.nw, k1, ([1, 1, 4], [4, 1, 8], [g.nw, 1, 1])),
              (g.nr * g.rb, g.v * g.nw, k2, ([1, 1, g.v], [g.v, 1, 32 // g.v], [g.nw, 1, 1]))]
    for r0_, c_n, k_n, (spt, tpw, wpc) in copies:
        m_runs = 1 if k_n == 1 else (k_n + g.run - 2) // g.run + 1
        assert m_runs <= 2, "the model covers the one- and two-run groups the routed shapes have"
        for _w, _l, _r, (c, k, x) in blocked_elements(spt, tpw, wpc, [c_n, k_n, 32]):
            r0 = r0_ + c * k_n
            q0, e0 = r0 // g.run, r0 % g.run
            base, ok = g.run_base(q0)
            src = base + e0 * 128 + 4 * x                  # p (bytes), before the select
            valid = ok
            if m_runs == 2:
                b = g.run - e0
                bm, okm = g.run_base(q0 + 1)
                if k >= b:
                    src = bm + (e0 - g.run) * 128 + 4 * x
                lo = 0 if ok else min(b, k_n)
                hi = k_n if okm else min(b, k_n)
                vm = (1 << hi) - (1 << lo)
                valid = (vm & (1 << k)) != 0
            src += k * 128                                 # p + k * 32 words
            word = (r0_ + c * k_n + k) * 32 + x          # dst [C, K, 32] row-major at row R0
            count[word] = count.get(word, 0) + 1
            out[word] = src if valid else None
    return out, count


# (D, Hk, WT, NSUB): A (GQA 4 Hk 8), C (D=256 Hk 2), GQA 16 Hk 2, Hk 4, one kv head, and the multi-query
# decode's one-sub-tile stages (NSUB 1)
SHAPES = [(128, 8, 1, 4), (256, 2, 4, 2), (128, 2, 4, 4), (128, 4, 2, 4), (128, 1, 8, 4), (128, 8, 1, 1),
          (128, 1, 8, 1), (128, 8, 2, 1)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bs", [16, 32, 64])
def test_new_copy_writes_the_old_copys_bytes(shape, bs):
    d, hk, wt, nsub = shape
    tt = nsub * wt * 16
    rng = random.Random(hash((shape, bs)) & 0xFFFF)
    nblk = 4 * tt // bs + 4
    num_blocks = 3 * nblk
    for inside in (True, False):
        table = rng.sample(range(num_blocks), nblk)
        if not inside:  # a few ids outside [0, num_blocks): their runs zero-fill
            for i in rng.sample(range(nblk), 3):
                table[i] = rng.choice([-1, num_blocks, num_blocks + 5])
        for s in range(3):
            t0 = s * tt
            for t_hi in (t0 + tt, t0 + 1, t0 + tt // 2 + 3, t0 + 16, t0 + tt - 16, 10 ** 6):
                g = Geometry(d, hk, wt, nsub, bs, t0, min(t_hi, nblk * bs), table, num_blocks, inside)
                old, old_n = old_copy(g)
                new, new_n = new_copy(g)
                words = g.nr * g.run * 32
                assert sorted(old) == list(range(words))
                assert set(old_n.values()) == {1}
                assert set(new_n.values()) == {1}, "a ring word written twice"
                assert new == old


def test_model_layouts_cover_each_element_once():
    seen = [c for *_, c in blocked_elements([1, 1, 4], [4, 1, 8], [8, 1, 1], [32, 16, 32])]
    assert len(seen) == len(set(seen)) == 32 * 16 * 32


@pytest.mark.parametrize("shape", SHAPES + [(128, 2, 2, 8), (256, 2, 2, 4)])
def test_the_kernel_takes_the_per_run_copy_only_where_this_model_covers_it(shape):
    """``_per_run_copy`` (the kernel's rule): the per-run copy at ``WT`` > 1 for every routed geometry above, and
    the flat rows where a thread's rows would span three runs (4 warps x nsub 8) or 32 rows (its bitmask)."""
    from ultraquant.kernels.gluon.decode_wholepage import _per_run_copy

    d, hk, wt, nsub = shape
    g = Geometry(d, hk, wt, nsub, 16, 0, 16, [0], 1, True)
    k1, k2 = nsub * g.rb // 4, nsub * g.rs // g.v
    covered = all((1 if k == 1 else (k + g.run - 2) // g.run + 1) <= 2 and k < 32 for k in (k1, k2))
    assert _per_run_copy(wt, k1, k2, g.run) == (wt > 1 and covered)
    assert covered == (shape in SHAPES)
