"""Offline alignment and bounds check of the whole-page decode's shared and global accesses (sm_90, no GPU).

Compiles ``uq_decode_wholepage`` for one configuration (as ``tools/wholepage_sass.py`` does) and checks three things:

1. PTX census: every shared/global access instruction and its width in bytes (``ld.shared.v2.b32``: 8,
   ``cp.async ..., 16``: 16, ``ldmatrix``: 16-byte rows, ...).
2. Ring reads (TTGIR emulation): for every ``local_load`` of a ring view, walks its memdesc chain back to
   the allocation (flat byte offsets of ``memdesc_subslice``, ``memdesc_index`` over every ring entry,
   ``memdesc_trans``), evaluates the load's linear layout (register, lane, warp -> element) and the view's
   padded shared layout (element -> offset, ``interval:+pad`` over the whole buffer) for every thread,
   derives the vector width the lowering uses (contiguous registers at consecutive bytes inside one
   padding interval, at most 16 B) and checks that every vector starts at a multiple of its width and
   ends inside the allocation. The widths found must account for the PTX's ``ld.shared`` census.
3. Ring copies (Python re-run of ``_issue_stage``'s warp copies' arithmetic for a shape, default
   shape A: B=8, L=32768, Hq=32, Hk=8, block 64, head-major cache, 132 SMs): for every program, every
   stage issued (prologue and loop, including the ones past the end), every row and copy, that the
   global byte offset is a multiple of the copy width and inside the cache when the copy reads, and that
   the shared destination is aligned and inside the ring's own allocation (its ``local_alloc``;
   other buffers, e.g. layout-conversion scratch, may follow it).

    .venv/bin/python tools/wholepage_align_check.py gqa=4 num_kv_heads=8 block_size=64 [B=8 L=32768]

Prints one line per check and ``ALL OK`` or the first failures; exit status 1 on any failure.
"""

from __future__ import annotations

import collections
import itertools
import math
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools.sass_loop import _value  # noqa: E402
from tools.wholepage_sass import compile_wholepage_kernel  # noqa: E402
from ultraquant.format import slot_size  # noqa: E402

BYTES = {"i8": 1, "i32": 4, "f16": 2, "f32": 4}


def ptx_census(ptx: str) -> collections.Counter:
    """(kind, width in bytes) -> count of the PTX's shared and global accesses."""
    out: collections.Counter = collections.Counter()
    for line in ptx.splitlines():
        t = line.strip()
        m = re.match(r"(@%p\d+ )?(ld|st)\.(shared|global)((?:\.[a-z]+)*?)(?:\.v(\d))?\.(b|f|u|s)(\d+)", t)
        if m:
            out[(f"{m[2]}.{m[3]}", int(m[5] or 1) * int(m[7]) // 8)] += 1
        elif t.startswith("cp.async.c") and "shared.global" in t:
            out[("cp.async", int(re.search(r"\],\s*(0x[0-9a-f]+|\d+)", t)[1], 0))] += 1
        elif t.startswith("ldmatrix"):
            out[("ldmatrix", 16)] += 1
    return out


def _bases(text: str) -> list[list[int]]:
    return [[int(x) for x in b.split(",")] for b in re.findall(r"\[([-\d, ]+)\]", text)] if text.strip() else []


def parse_layouts(ttgir: str) -> tuple[dict, dict]:
    """#linearN -> {register, lane, warp: bases}; #sharedN -> padded (interval, pad, offset bases or None) or None."""
    lin, sh = {}, {}
    for name, body in re.findall(r"^(#linear\d*) = #ttg\.linear<\{(.*)\}>", ttgir, re.M):
        lin[name] = {k: _bases(v) for k, v in re.findall(r"(register|lane|warp) = \[((?:\[[-\d, ]*\],? ?)*)\]", body)}
    for name, body in re.findall(r"^(#shared\d*) = (.*)$", ttgir, re.M):
        m = re.match(r"#ttg\.padded_shared<\[(\d+):\+(\d+)\] \{(?:offset = \[(.*)\], block)?", body)
        sh[name] = (int(m[1]), int(m[2]), _bases(m[3]) if m[3] else None) if m else None
    return lin, sh


def _memdesc(t: str) -> tuple[list[int], str, str, list[int]]:
    """(shape, element type, layout, alloc shape) of a ``!ttg.memdesc<...>`` type string."""
    m = re.search(r"memdesc<([\dx]+)x(i8|i32|f16|f32), (#shared\d*), #smem, mutable(?:, ([\dx]+))?>", t)
    shape = [int(x) for x in m[1].split("x")]
    return shape, m[2], m[3], [int(x) for x in m[4].split("x")] if m[4] else shape


def ring_loads(ttgir: str, ring_bytes: int) -> tuple[list[str], collections.Counter]:
    """Failures and the (width -> loads per thread) census of every ``local_load`` of the ring."""
    lin, sh = parse_layouts(ttgir)
    defs = {}
    for line in ttgir.splitlines():
        m = re.match(r"\s*(%\w+) = (ttg\.\w+) (%\w+)?(.*)$", line)
        if m:
            defs[m[1]] = (m[2], m[3], m[4])
    fails, census = [], collections.Counter()
    for res, (op, src, rest) in defs.items():
        if op != "ttg.local_load":
            continue
        ltype = re.search(r"-> tensor<[\dx]+x\w+, (#linear\d*)>", rest)
        if not ltype:
            continue  # a load in a non-linear layout is not a ring view here
        shape, ety, slay, alloc = _memdesc(rest)
        # walk back: byte offset of flat subslices, entries of memdesc_index (entry size in elements)
        byte_off, entry, node = 0, None, src
        while node in defs and defs[node][0] != "ttg.local_alloc":
            op2, src2, rest2 = defs[node]
            if op2 == "ttg.memdesc_subslice":
                offs = [int(x) for x in re.match(r"\[([\d, ]+)\]", rest2)[1].split(",")]
                s_shape, s_ety, s_lay, _ = _memdesc(rest2.split("->")[0])
                if len(offs) == 1:
                    byte_off += offs[0] * BYTES[s_ety]
                elif any(offs):
                    fails.append(f"{res}: non-zero multi-dim subslice {offs} not modelled")
            elif op2 == "ttg.memdesc_index":
                s_shape, s_ety, s_lay, _ = _memdesc(rest2.split("->")[0])
                entry = (s_shape[0], math.prod(s_shape[1:]), s_lay)
            node = src2
        if sh.get(slay) is None:
            fails.append(f"{res}: load from a view without a padded layout ({slay}) not modelled")
            continue
        interval, pad, obases = sh[slay]
        if obases is None:  # printed without offset bases: the identity (row-major, last axis fastest)
            obases = [[(1 << b) if j == d else 0 for j in range(len(shape))]
                      for d in reversed(range(len(shape))) for b in range(shape[d].bit_length() - 1)]
        L = lin[ltype[1]]
        nreg = 1 << len(L["register"])
        esz = BYTES[ety]

        # the padded layout's bases map offset bit i -> an index vector (one power of two in one axis)
        bit_of = {}
        for i, v in enumerate(obases):
            d = next(j for j, x in enumerate(v) if x)
            bit_of[(d, v[d])] = 1 << i

        rank = len(shape)

        def at(reg: int, lane: int, warp: int, L=L, n=rank, bit_of=bit_of) -> int:
            return _offset(bit_of, _elem(L, n, reg, lane, warp))

        n_entries, entry_elems = (entry[0], entry[1]) if entry else (1, 0)
        # vector width: registers 0..2^k-1 at consecutive elements (checked per thread below)
        vec = 1
        while vec < nreg and vec * esz < 16:
            cand = vec * 2
            ok = all(at(r, 0, 0) == at(0, 0, 0) + r for r in range(cand))
            if not ok:
                break
            vec = cand
        census[vec * esz] += nreg // vec
        for e, warp, lane in itertools.product(range(n_entries), range(1 << len(L["warp"])),
                                               range(32)):
            for r0 in range(0, nreg, vec):
                logical = [e * entry_elems + at(r0 + i, lane, warp) for i in range(vec)]
                phys = [x + (x // interval) * pad for x in logical]
                addr = byte_off + phys[0] * esz
                if phys != list(range(phys[0], phys[0] + vec)):
                    fails.append(f"{res}: entry {e} warp {warp} lane {lane} reg {r0}: vector not contiguous {phys}")
                if addr % (vec * esz):
                    fails.append(f"{res} ({ltype[1]}, {slay}, base +{byte_off} B): entry {e} warp {warp} lane {lane} "
                                 f"reg {r0}: {vec * esz}-byte load at byte {addr} (mod {addr % (vec * esz)})")
                if addr + vec * esz > ring_bytes:
                    fails.append(f"{res}: entry {e} warp {warp} lane {lane}: load past the ring ({addr})")
    return fails, census


def _elem(L: dict, n: int, reg: int, lane: int, warp: int) -> list[int]:
    """Tensor index of (register, lane, warp) under linear layout ``L`` (XOR of the set bits' bases)."""
    idx = [0] * n
    for bases, v in ((L["register"], reg), (L["lane"], lane), (L["warp"], warp)):
        for i, b in enumerate(bases):
            if v >> i & 1:
                idx = [a ^ c for a, c in zip(idx, b, strict=True)]
    return idx


def _offset(bit_of: dict, idx: list[int]) -> int:
    """Element offset (before padding) of a tensor index under a padded layout's bit map."""
    return sum(bit_of[(d, 1 << bit)] for d, x in enumerate(idx) for bit in range(x.bit_length()) if x >> bit & 1)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def ring_allocation(ttgir: str) -> int:
    """Bytes of the ring's ``local_alloc`` as laid out (a padded layout pads after every interval but
    the last: ``n + (n - 1) // interval * pad`` elements)."""
    _, sh = parse_layouts(ttgir)
    m = re.search(r"= ttg\.local_alloc : \(\) -> (!ttg\.memdesc<[^>]*>)", ttgir)
    shape, ety, lay, _ = _memdesc(m[1])
    n = math.prod(shape)
    if sh.get(lay):
        n += (n - 1) // sh[lay][0] * sh[lay][1]
    return n * BYTES[ety]


def ring_copies(c: dict, nw: int, shared_bytes: int, B: int, L: int, hk: int, block: int, sms: int) -> list[str]:
    """Failures of the copies of every program/stage of a full-length batch (head-major cache)."""
    from ultraquant.kernels.families.decode_wholepage import WHOLEPAGE_MIN_SPLIT_TOKENS, WHOLEPAGE_PROGRAMS_PER_SM

    nsub, stages, wt = c["NSUB"], c["STAGES"], c["WT"]
    slot = slot_size(c["D"])
    nr, tt = nsub * nw, nsub * wt * 16
    splits = max(1, min(sms * WHOLEPAGE_PROGRAMS_PER_SM // B, _cdiv(L, WHOLEPAGE_MIN_SPLIT_TOKENS)))
    nblk = B * (L // block)
    s_ch, s_cb = block * slot, hk * block * slot
    cache_bytes = nblk * s_cb
    fails: list[str] = []
    for b, sp in itertools.product(range(B), range(splits)):
        length = L
        per = _cdiv(_cdiv(length, splits), tt) * tt
        t_lo, t_hi = sp * per, min(sp * per + per, length)
        n_it = _cdiv(max(t_hi - t_lo, 0), tt)
        for it in range(n_it + stages - 1):  # stages issued: prologue + one per loop iteration
            stage, t0 = it % stages, t_lo + it * tt
            # warp w copies its runs j NW + w, 16-byte chunk i of run j by lane (j slot + i) % 32
            for w, j, i in itertools.product(range(nw), range(nsub), range(slot)):
                tok = t0 + j * (wt * 16) + (w % wt) * 16
                blk = (b * (L // block) + tok // block) if tok < t_hi else 0  # any block id: the bound matters
                g = blk * s_cb + (w // wt) * s_ch + (tok % block) * slot + 16 * i
                s = (stage * nr + j * nw + w) * 16 * slot + 16 * i
                if tok < t_hi and (g % 16 or g + 16 > cache_bytes):
                    fails.append(f"copy b{b} sp{sp} it{it} warp {w} run {j} chunk {i}: global {g}")
                if s % 16 or s + 16 > shared_bytes:
                    fails.append(f"copy b{b} sp{sp} it{it} warp {w} run {j} chunk {i}: shared {s} of {shared_bytes}")
            if len(fails) > 20:
                return fails
    return fails


def main(argv: list[str]) -> int:
    config = {k: _value(v) for k, v in (p.split("=", 1) for p in argv)}
    shape = {k: config.pop(k) for k in ("B", "L", "sms") if k in config}
    k, spec = compile_wholepage_kernel(dict(config))
    c, nw = spec.constexprs, spec.num_warps
    ring_bytes = c["STAGES"] * c["NSUB"] * nw * 16 * slot_size(c["D"])
    print(f"{spec.kernel} {c} warps={nw} shared={k.metadata.shared} B ring={ring_bytes} B")
    bad = 0
    census = ptx_census(k.asm["ptx"])
    print("PTX accesses (kind, bytes): " + ", ".join(f"{a} {w}: {n}" for (a, w), n in sorted(census.items())))
    alloc = ring_allocation(k.asm["ttgir"])
    print(f"ring allocation {alloc} B (the copies fill {ring_bytes} B)")
    if alloc < ring_bytes:
        print(f"FAIL: ring allocation {alloc} B < the {ring_bytes} B its copies write")
        bad += 1
    fails, loads = ring_loads(k.asm["ttgir"], ring_bytes)
    print("ring loads per thread per view instance (bytes: loads): "
          + ", ".join(f"{w}: {n}" for w, n in sorted(loads.items())))
    wide_ptx = sum(n for (a, w), n in census.items() if a == "ld.shared" and w > 4)
    wide_ring = sum(n for w, n in loads.items() if w > 4)
    print(f"wide (>4 B) ld.shared in the PTX: {wide_ptx}; wide ring loads in the TTGIR: {wide_ring}")
    if wide_ptx < wide_ring:
        print("FAIL: the PTX lacks wide shared loads the emulation found")
        bad += 1
    elif wide_ptx > wide_ring:  # LLVM merged adjacent 4-byte loads it proved 8-byte aligned (D=256 slots)
        print(f"note: {wide_ptx - wide_ring} wide loads merged by LLVM from 4-byte ring loads (alignment proven there)")
    for f in fails[:10]:
        print("FAIL:", f)
    bad += len(fails)
    print(f"ring loads: {len(fails)} failures")
    cf = ring_copies(c, nw, alloc, int(shape.get("B", 8)), int(shape.get("L", 32768)),
                     c["HK"], c["BLOCK_SIZE"], int(shape.get("sms", 132)))
    for f in cf[:10]:
        print("FAIL:", f)
    bad += len(cf)
    print(f"ring copies: {len(cf)}{'+' if len(cf) > 20 else ''} failures")
    print("ALL OK" if not bad else f"{bad} FAILURES")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
