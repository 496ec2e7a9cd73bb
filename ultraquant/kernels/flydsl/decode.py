"""FlyDSL source of the UltraQuant paged split-KV decode kernel and its split reduce (gfx942/gfx950).

Imports flydsl: only the compile subprocess (:mod:`codegen.flydsl.compile_kernel`) loads this module.
Every address and permutation comes from the formula functions of
:mod:`ultraquant.kernels.flydsl.layout`, the module whose pure-PyTorch emulation of this exact
lane layout is tested against the reference on the CPU (docs/flydsl.md has the derivation).

One wave (64 lanes) computes one split of one (request, kv head): all GQA query heads of the kv head
at once (padded to the 16 columns of the MFMA), 16 tokens per step. The fp16 path (gfx942, gfx950):

1. Q prologue: lane (r, g) loads query head ``kvh*G + r`` in ``layout.QUERY_MAP``, rotates it with a
   fast Walsh-Hadamard transform (in-lane stages + two xor shuffles), multiplies the head by a power
   of two (absmax into [2**14, 2**15)) and keeps it as fp16 B operands in the K words' code order.
2. QK per 32-element scale group: lane row r decodes token ``t0 + r``'s code word of the group by bit
   placement into two fp16 A operands; two ``v_mfma_f32_16x16x16_f16`` give the group's ``S^T``
   (token x head), times each row's K scale (fma), summed over groups.
3. Online softmax in base 2 on the MFMA result layout, window/length mask, optional soft cap; the
   reference point also bounds P x V scale (<= 2**15).
4. PV: P is already in the B layout; times each token's V scale of the group, rounded to fp16 toward
   zero; lane (r, g) decodes the group's V byte ``16q + r`` of its 4 tokens (one code word) into the
   A operands of MFMAs 2q and 2q + 1 (rows d = 32q + 2m + h). At D=512 (``layout.V_STAGE_HEAD_SIZES``)
   those words come through LDS: each lane loads its tokens' 16 contiguous V bytes and stores them as
   words to the lanes that decode them (64 single-byte loads per tile would not fit in registers).
5. Epilogue: normalized partial O (float32) and its LSE (natural log) per (request, head, split).

The gfx950 mx path takes QK through the scaled FP4 x FP8 MFMA (two FP8 query terms) and V through
``v_cvt_scalef32_pk_bf16_fp4`` and the bf16 MFMA (docs/flydsl.md).

The reduce kernel combines the splits (and the optional sink logit) into the output dtype.
"""

from __future__ import annotations

import math

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl._mlir import ir
from flydsl._mlir.dialects import llvm
from flydsl.expr import arith, const_expr, gpu, range_constexpr, rocdl
from flydsl.expr.typing import T

from ultraquant.kernels.flags import KernelError
from ultraquant.kernels.flydsl import fp4_bits
from ultraquant.kernels.flydsl import layout as lay
from ultraquant.kernels.flydsl import operand_maps as om
from ultraquant.kernels.flydsl.layout import LOG2E, MFMA_K, TILE, WAVE, DecodeConfig

F32_NEG_INF = float("-inf")


def _raw(v):
    return arith.unwrap(v) if not isinstance(v, ir.Value) or hasattr(v, "ir_value") else v


def _intrinsic_f32(name: str, x):
    """Call an ``llvm.amdgcn.*`` float intrinsic (no ocml bitcode needed)."""
    return fx.Float32(llvm.call_intrinsic(ir.F32Type.get(), name, [_raw(fx.Float32(x))], [], []))


def exp2(x):
    """v_exp_f32: 2**x (exp2(-inf) = 0)."""
    return _intrinsic_f32("llvm.amdgcn.exp2.f32", x)


def log2(x):
    """v_log_f32: log2(x) for x > 0."""
    return _intrinsic_f32("llvm.amdgcn.log.f32", x)


def grid_dim_y():
    """Number of workgroups along y, read from the HSA dispatch packet (``grid_size_y`` at byte 16;
    the block is 1 high). ``gpu.grid_dim`` would call ockl, which needs ROCm device bitcode."""
    p4 = llvm.PointerType.get(4)
    base = llvm.call_intrinsic(p4, "llvm.amdgcn.dispatch.ptr", [], [], [])
    addr = llvm.PtrToIntOp(T.i64, base).result
    addr = llvm.AddOp(addr, _raw(fx.Int64(16)), llvm.IntegerOverflowFlags(0)).result
    return fx.Int32(llvm.LoadOp(T.i32, llvm.IntToPtrOp(p4, addr).result, alignment=4, invariant=True).result)


def rcp(x):
    """v_rcp_f32: 1/x (1 ulp)."""
    return fx.Float32(rocdl.rcp(T.f32, _raw(fx.Float32(x))))


def _lds_base(storage):
    """Byte pointer (LDS) of a SharedAllocator allocation."""
    ptr = object.__getattribute__(storage, "_ptr")
    return fx.recast_iter(fx.PointerType.get(fx.Uint8.ir_type, fx.AddressSpace.Shared, 1), ptr)


def _lds_ptr(base, byte_offset, elem, align: int):
    ty = fx.PointerType.get(elem.ir_type, fx.AddressSpace.Shared, align)
    return fx.recast_iter(ty, base + byte_offset)


def _select(cond, a, b):
    return arith.select(cond, a, b)


def _global_ptr(base, byte_offset, elem, align: int):
    """Typed global pointer ``base + byte_offset`` with a stated alignment.

    The base is first recast to a byte pointer: ``Pointer + n`` advances by n *elements* of the
    pointer's element type (which comes from the compile placeholders), and every offset here is
    in bytes."""
    u8 = fx.recast_iter(fx.PointerType.get(fx.Uint8.ir_type, fx.AddressSpace.Global, 1), base)
    ty = fx.PointerType.get(elem.ir_type, fx.AddressSpace.Global, align)
    return fx.recast_iter(ty, u8 + byte_offset)


def _load(base, byte_offset, elem, count: int, align: int):
    """``count`` elements (a list, even for one) loaded with one vector load."""
    v = fx.generic_load(_global_ptr(base, byte_offset, elem, align), dtype=elem, count=count)
    return [v] if count == 1 else [v[k] for k in range(count)]


def _xor(x, mask: int):
    return fx.Float32(gpu.shuffle_xor(fx.Float32(x), mask, WAVE))


def _bf16_pack(vals):
    """Four float32 scalars -> vector<4xi16> bf16 operand (round to nearest even)."""
    v = fx.Vector.from_elements([fx.Float32(x) for x in vals], dtype=fx.Float32)
    return v.to(fx.BFloat16).bitcast(fx.Int16)


def _c32(v: int):
    """A 32-bit constant as the signed Int32 with the same bits."""
    return fx.Int32(v - (1 << 32) if v >= 1 << 31 else v)


def _byte_up(x, const):
    """``(x << 8) & 0xFF00FF00`` as one ``v_perm_b32`` (bytes 0, 2 of x into bytes 1, 3; zeros)."""
    return fx.Int32(rocdl.perm_b32(_raw(fx.Int32(x)), _raw(fx.Int32(0)), _raw(fx.Int32(0x060C040C))))


def _f16_operands(word):
    """One 32-bit word of eight FP4 codes -> the two vector<4xf16> MFMA operands of its scale group
    (:func:`fp4_bits.fp16_pairs`, value = code x 2**-14; step p holds codes ``lay.F16_STEP_CODES[p]``)."""
    outs = fp4_bits.fp16_pairs(fx.Int32(word), const=_c32, byte_up=_byte_up)
    return [fx.Vector.from_elements([outs[2 * p], outs[2 * p + 1]], dtype=fx.Int32).bitcast(fx.Float16)
            for p in range(2)]


def _pk_rtz(vals):
    """Four float32 -> vector<4xf16> rounded toward zero, two per ``v_cvt_pkrtz_f16_f32``."""
    words = [fx.Int32(fx.Vector(rocdl.cvt_pkrtz(T.vec(2, T.f16), _raw(fx.Float32(vals[2 * k])),
                                                _raw(fx.Float32(vals[2 * k + 1])))).bitcast(fx.Int32)[0])
             for k in range(2)]
    return fx.Vector.from_elements(words, dtype=fx.Int32).bitcast(fx.Float16)


def _f32_from_bits(bits):
    return fx.Float32(arith.bitcast(T.f32, _raw(fx.Int32(bits))))


def _scale_vec(words4, q):
    """vector<4xf32> of ``2**(b - 127)`` (byte 0: 0.0) for scale byte q of the lane's four tokens' words."""
    return fx.Vector.from_elements([_f32_from_bits(lay.scale_byte(w, q) << 23) for w in words4],
                                   dtype=fx.Float32)


def _i16(x):
    """Low 16 bits of an int32 value as an Int16."""
    return fx.Int16(arith.trunci(T.i16, _raw(fx.Int32(x))))


def _vselect(cond, a, b):
    """Select between two float vectors with a scalar condition."""
    return fx.Vector(arith.select(cond, a, b))


def _f32_bits(x):
    return fx.Int32(arith.bitcast(T.i32, _raw(fx.Float32(x))))


def _pow2(e):
    """2**e as a float32 built from its bits (e in [-126, 127])."""
    return fx.Float32(arith.bitcast(T.f32, _raw((e + 127) << 23)))


def _xor_max(x, masks):
    for m in masks:
        x = arith.maxnumf(x, _xor(x, m))
    return x


def _fp8_query(vals, g, plan):
    """One chunk of the rotated query (32 float32 of this lane, in the FP8 lane layout) -> two
    FP8 e4m3 terms, hi and lo (lo quantizes what hi missed), as (vector<8xi32> B operand, scale byte).

    Every 32-element K block gets its own exponent (:func:`ultraquant.kernels.flydsl.layout.fp8_group_exponent` on
    its absmax: the smallest power of two that brings it to <= 448), shared by the lanes holding its
    halves (``plan``: :func:`ultraquant.kernels.flydsl.layout.fp8_block_plan`); the scale operand of lane group g is
    K block g's E8M0 byte (``e + 127``, byte 0 = opsel 0), fetched from a lane that holds it.
    """
    classes, share, picks = plan
    terms = []
    for _term in range(2):
        exps = []
        for cls in classes:
            amax = fx.Float32(0.0)
            for e in cls:
                amax = arith.maxnumf(amax, fx.Float32(_raw_abs(vals[e])))
            exps.append(lay.fp8_group_exponent(_f32_bits(_xor_max(amax, [m for m in share])), _select))
        q = [None] * 32
        deq = [None] * 32
        for cls, ex in zip(classes, exps, strict=True):
            inv = _pow2(fx.Int32(0) - ex)
            for e in cls:
                q[e] = fx.Float32(vals[e]) * inv
        words = []
        for k in range(8):
            lo = rocdl.cvt_pk_fp8_f32(T.i32, _raw(q[4 * k]), _raw(q[4 * k + 1]), _raw(fx.Int32(0)), False)
            words.append(fx.Int32(rocdl.cvt_pk_fp8_f32(T.i32, _raw(q[4 * k + 2]), _raw(q[4 * k + 3]), lo, True)))
        for cls, ex in zip(classes, exps, strict=True):
            scale = _pow2(ex)
            for e in cls:
                pair = fx.Vector(rocdl.cvt_pk_f32_fp8(T.vec(2, T.f32), _raw(words[e // 4]), (e % 4) >= 2))
                deq[e] = fx.Float32(pair[e % 2]) * scale
        # lane group g's scale operand: K block g's exponent, from the lane (g ^ mask) that holds it
        sbyte = fx.Int32(0)
        for mask, ci, gg in picks:
            f = _pow2(exps[ci]) if mask == 0 else _xor(_pow2(exps[ci]), mask)
            sbyte = _select(g == gg, (_f32_bits(f) >> 23) & 0xFF, sbyte)
        terms.append((fx.Vector.from_elements(words, dtype=fx.Int32), sbyte))
        vals = [fx.Float32(v) - d for v, d in zip(vals, deq, strict=True)]
    return terms


def _raw_abs(v):
    return fx.math.absf(fx.Float32(v))


def _merge_factors(m, m2):
    """Two online-softmax states' common maximum ``m_new`` and rescale factors ``2**(m - m_new)``,
    ``2**(m2 - m_new)`` (also as 4-float vectors); both maxima -inf gives factors 0, not NaN."""
    m_new = arith.maxnumf(m, m2)
    m_use = _select(m_new == F32_NEG_INF, fx.Float32(0.0), m_new)
    a1, a2 = exp2(m - m_use), exp2(m2 - m_use)
    return (m_new, a1, a2, fx.Vector.from_elements([a1] * MFMA_K, dtype=fx.Float32),
            fx.Vector.from_elements([a2] * MFMA_K, dtype=fx.Float32))


def _phase_fence():
    """``s_sched_barrier 0`` (``llvm.amdgcn.sched.barrier``): LLVM's scheduler moves nothing across it.
    The loop without software pipelining (below D=512) has one between the tile's loads and its QK
    and one between QK and the softmax, so every load of a tile issues before the first wait on any
    of them (one memory round trip per tile). Without them LLVM sank some V loads past the softmax
    in some blobs and not in others (a second round trip; docs/flydsl.md)."""
    rocdl.sched_barrier(0)


def _mfma(a, b, c):
    return fx.Vector(rocdl.mfma_f32_16x16x16bf16_1k(T.vec(4, T.f32), [a, b, c, 0, 0, 0]))


def _mfma_f16(a, b, c):
    return fx.Vector(rocdl.mfma_f32_16x16x16f16(T.vec(4, T.f32), [a, b, c, 0, 0, 0]))


PARAMS: tuple[tuple[str, str], ...] = (
    ("q_ptr", "ptr"), ("cache_ptr", "ptr"), ("bt_ptr", "ptr"), ("seqlen_ptr", "ptr"), ("sinks_ptr", "ptr"),
    ("out_ptr", "ptr"), ("part_ptr", "ptr"), ("ml_ptr", "ptr"), ("counter_ptr", "ptr"), ("err_ptr", "ptr"),
    ("scale", "f32"), ("softcap", "f32"), ("window", "i32"), ("num_splits", "i32"),
    ("num_blocks", "i32"), ("bt_cols", "i32"),
    ("stride_qb", "i32"), ("stride_qh", "i32"), ("stride_ob", "i32"), ("stride_oh", "i32"),
    ("stride_cb", "i32"), ("stride_ct", "i32"), ("stride_ch", "i32"), ("stride_btb", "i32"),
)
"""The kernel's parameters, in order: exactly ``ultraquant.kernels.families.decode_splitkv.DECODE_PARAMS`` (the Triton
decode's), so one LaunchPlan launches either blob; no hidden trailing parameters. Bounds as the
Triton decode's: the length clamped to the block-table row, a block id outside [0, num_blocks) an
empty tile, and error words set through ``err_ptr`` (``ultraquant.kernels.flags``)."""

ERR_BLOCK_BYTES = 4 * (KernelError.BLOCK_OUT_OF_RANGE.bit_length() - 1)
ERR_SEQ_LEN_BYTES = 4 * (KernelError.SEQ_LEN_OUT_OF_RANGE.bit_length() - 1)
"""Byte offsets of the error words this kernel stores 1 into."""

ROWS = 16
"""Rows of one (request, kv head) in the decode workspace (the MFMA's 16 columns = padded heads)."""

_DTYPES = {"bf16": (fx.BFloat16, 2), "fp16": (fx.Float16, 2), "fp32": (fx.Float32, 4)}


def build_decode(cfg: DecodeConfig, arch: str, *, name: str, query_dtype: str = "bf16",
                 out_dtype: str = "bf16", mx: bool = False, waves: int = 1, pipelined: bool = True,
                 mx_query_map: om.OperandMap = om.FP8):
    """Return the ``@flyc.jit`` launcher of the decode kernel for ``cfg`` on ``arch``.

    Grid (B, Hk, num_splits), ``waves`` waves per workgroup: they take the split's 16-token tiles round
    robin and fold their (acc, m, l) into wave 0 through one LDS slot (16 x D f32 + 32 f32), in the
    order W-1 .. 1. Workspace contract of the Triton decode: split
    ``sp`` of pair ``b * Hk + kvh`` writes its unnormalized ``acc`` (16 x D f32) at slot
    ``pair * num_splits + sp`` of ``part_ptr`` and its (m, l) (log2 units) at ``ml_ptr + slot * 32``;
    the last split to take a ticket from ``counter_ptr[pair]`` merges the slots in order, folds the
    sinks and writes ``out``, then resets the ticket to 0. One split writes ``out`` directly.

    Default: the fp16 path (module doc). ``mx`` (gfx950 only): QK with
    ``v_mfma_scale_f32_16x16x128_f8f6f4`` (A = the FP4 K codes and their UE8M0 scales as stored; B =
    the rotated query as two FP8 e4m3 terms, hi and lo, each with one power-of-two scale per (head,
    32-group) chosen so nothing exceeds 448: two scaled MFMAs per 128 head-dim elements) and V
    decoded by ``v_cvt_scalef32_pk_bf16_fp4``. ``mx_query_map``: the FP8 operand layout the query is
    packed for (:data:`operand_maps.FP8`; another map builds a kernel with that belief, which the
    interpreter tests use to show what a wrong layout does). ``pipelined``: each step issues the next
    tile's loads before computing the current one (False: a step loads its
    own tile first; fewer registers).
    """
    if mx and arch != "gfx950":
        raise ValueError("the mx decode path needs gfx950 (scaled FP4 MFMA, FP4 conversions)")
    if mx and cfg.head_size < 128:
        raise ValueError("the mx decode path needs head_size >= 128 (128 K per scaled MFMA)")
    W = int(waves)
    if W < 1:
        raise ValueError(f"waves must be >= 1, got {waves}")
    D, G, BS = cfg.head_size, cfg.gqa, cfg.block_size
    CH, NB = cfg.chunks, cfg.pv_mfmas
    NG = D // 32  # scale groups of a head (mx path: also the V code bytes per lane per token)
    EQ = cfg.chunk_elems  # query elements per lane and chunk (16 at D=64)
    # fp16 path: a token's K and V scale bytes as aligned words (offset, words, first byte: lay.scale_words)
    KS_OFF, NW, KS_FIRST = lay.scale_words(D, lay.k_scales_offset(D))
    VS_OFF, NWV, VS_FIRST = lay.scale_words(D, lay.v_scales_offset(D))
    QT, q_bytes = _DTYPES[query_dtype]
    OT, o_bytes = _DTYPES[out_dtype]
    has_sinks, has_window, has_softcap = cfg.has_sinks, cfg.has_window, cfg.has_softcap
    inv_sqrt_d = 1.0 / math.sqrt(D)
    QUARTER = D // 4  # output elements per lane: O[r][QUARTER * g : QUARTER * (g + 1)]
    qmap = mx_query_map if mx else lay.QUERY_MAP
    for part in range(0, EQ, 16 // _DTYPES[query_dtype][1]):  # each vector load reads contiguous d
        run = [qmap.coord(0, part + e, 1) for e in range(16 // _DTYPES[query_dtype][1])]
        if run != list(range(run[0], run[0] + len(run))):
            raise ValueError(f"query map {qmap.fmt}: elements {part}.. are not contiguous in d")
    plan = lay.fp8_block_plan(qmap) if mx else None

    def merge(acc, m, l_, acc2, m2, l2):
        m_new, a1, a2, a1v, a2v = _merge_factors(m, m2)
        return [acc[k] * a1v + acc2[k] * a2v for k in range(len(acc))], m_new, l_ * a1 + l2 * a2

    SLOT_BYTES = ROWS * D * 4 + 2 * ROWS * 4  # one wave's (acc, m, l) in LDS
    stage_v = not mx and D in lay.V_STAGE_HEAD_SIZES  # fp16 path: V code bytes through LDS
    NV = D // 128  # staged V: 32-bit words of the D/32 V code bytes a lane loads per token
    STAGE_BYTES = lay.v_stage_bytes(D)
    # one LDS allocation per kernel (FlyDSL's rule): the staged V regions of the W waves during the
    # loop, then the fold's slot (a barrier separates the two uses)
    LDS_BYTES = max(SLOT_BYTES if W > 1 else 0, W * STAGE_BYTES if stage_v else 0)
    # pipelined loop: also carry the entry of the tile after next (below D=512: at 512 its register
    # makes the mx loop spill)
    ahead = pipelined and D < 512
    # the loop without software pipelining keeps its tile's loads, QK and softmax + PV apart
    # (_phase_fence); at D=512 that loop is only the spill fallback, and fenced it spilled (mx, GQA 16 + sinks)
    fenced = not pipelined and D < 512

    def page_entry(tile, bt_ptr, bt_row, lane_zero=None):
        """The block-table entry of a tile (one load; the software-pipelined loop issues it a tile early).
        ``lane_zero``: a zero LLVM cannot prove uniform, added to the address so the entry stays in a
        VGPR: a uniform load is copied to an SGPR right where it is loaded (``v_readfirstlane``), and that
        copy waits for the load in the step that issued it, which undoes the early issue."""
        col = fx.Int64((tile * TILE) // BS) if lane_zero is None else fx.Int64((tile * TILE) // BS + lane_zero)
        return _load(bt_ptr, (bt_row + col) * 4, fx.Int32, 1, 4)[0]

    def fetch(tile, valid, seq_len, bt_ptr, bt_row, cache_ptr, kv_base, stride_cb, stride_ct, r, g, num_blocks,
              entry=None):
        """Issue every global load of one 16-token tile: its block-table entry (unless ``entry`` is
        given, loaded earlier by :func:`page_entry`), then lane (r, g)'s K
        codes and scale bytes (token t0 + r) and V codes and scale bytes (tokens t0 + 4g + i). Rows past
        the sequence re-read its last token; ``valid`` (True, or a flag that is false for an empty split)
        false reads page 0, row 0, so no address depends on a block-table entry past the sequence.
        A block id outside [0, num_blocks) reads page 0 (an empty tile: the caller masks it).
        Returns the values flat (Int32), the page-inside flag (1/0) last. mx path: K words [c][4], K
        scales [c], V words [i][NG/4], V scales [i]. fp16 path (:func:`fp16_slots`): K words [q]
        (``lay.k_word_offset``), then per token i: its K scale words [NW], V bytes [q]
        (``lay.v_byte_offset``), V scale words [NWV] (lay.scale_words)."""
        t0 = tile * TILE
        page = page_entry(tile, bt_ptr, bt_row) if entry is None else fx.Int32(entry)
        inside = (page >= 0) & (page < num_blocks)
        page = _select(inside, page, fx.Int32(0))
        if valid is not True:
            page = _select(valid, page, fx.Int32(0))
        within = t0 % BS
        last_row = within + (seq_len - 1 - t0)
        page_base = fx.Int64(page) * fx.Int64(stride_cb) + kv_base

        def row_base(row):
            row = _select(row < last_row, row, last_row)
            if valid is not True:
                row = _select(valid, row, fx.Int32(0))
            return page_base + fx.Int64(row) * fx.Int64(stride_ct)

        k_base = row_base(within + r)
        inside_flag = [_select(inside, fx.Int32(1), fx.Int32(0))]
        if not mx:
            out = [fx.Int32(_load(cache_ptr, k_base + fx.Int64(lay.k_word_offset(q, g)), fx.Int32, 1, 4)[0])
                   for q in range(NG)]
            for i in range(MFMA_K):
                v_base = row_base(within + 4 * g + i)
                out += [fx.Int32(w) for w in _load(cache_ptr, v_base + fx.Int64(KS_OFF), fx.Int32, NW, 4)]
                if stage_v:
                    out += [fx.Int32(w) for w in _load(cache_ptr, v_base + fx.Int64(lay.v_code_offset(D, r)),
                                                       fx.Int32, NV, 4)]
                else:
                    out += [fx.Int32(_load(cache_ptr, v_base + fx.Int64(lay.v_byte_offset(D, q, r)), fx.Uint8, 1,
                                           1)[0]) & 0xFF for q in range(NG)]
                out += [fx.Int32(w) for w in _load(cache_ptr, v_base + fx.Int64(VS_OFF), fx.Int32, NWV, 4)]
            return out + inside_flag
        kw, ks, vw, vs = [], [], [], []
        for c in range_constexpr(CH):
            kw += [fx.Int32(w) for w in _load(cache_ptr, k_base + fx.Int64(lay.k_code_offset(c, g)), fx.Int32, 4, 8)]
            ks.append(fx.Int32(_load(cache_ptr, k_base + fx.Int64(lay.k_scale_offset(D, c, g)), fx.Uint8, 1, 1)[0])
                      & 0xFF)
        for i in range_constexpr(MFMA_K):
            v_base = row_base(within + 4 * g + i)
            vw += [fx.Int32(w) for w in _load(cache_ptr, v_base + fx.Int64(lay.v_code_offset(D, r)), fx.Int32,
                                              NG // 4, 4)]
            vs.append(fx.Int32(_load(cache_ptr, v_base + fx.Int64(lay.v_scale_offset(D, r)), fx.Uint8, 1, 1)[0])
                      & 0xFF)
        return kw + ks + vw + vs + inside_flag

    NVAL = NV if stage_v else NG  # fp16 path: V code values fetched per PV token (words or bytes)
    PER_TOKEN = NW + NVAL + NWV  # fp16 path: values fetched per PV token (K scale words, V codes, V scale words)

    def fp16_slots(cur, i):
        """The fp16 path's fetched values of the lane's PV token i: (K scale words, V code bytes [q] or, staged,
        the words of its D/32 V code bytes, V scale words)."""
        base = NG + PER_TOKEN * i
        return cur[base : base + NW], cur[base + NW : base + NW + NVAL], cur[base + NW + NVAL : base + PER_TOKEN]

    def stage_v_words(vlds, tok_vals, r, g):
        """Staged V: the lane's V code byte j of its four tokens (one word, byte i = token i) goes to
        the LDS word of the lane that decodes it (:func:`lay.v_stage_dword`), then the lane reads its NG
        words (word q: byte 16q + r of tokens 0..3). One wave writes and reads its own region; LDS keeps
        a wave's accesses in order, and the barrier keeps LLVM from moving the reads above the writes."""
        for j in range_constexpr(D // 32):
            pos = (D // 32) * r + j
            word = fx.Int32(0)
            for i in range_constexpr(MFMA_K):
                word = word | (((tok_vals[i][1][j // 4] >> (8 * (j % 4))) & 0xFF) << (8 * i))
            fx.generic_store(_lds_ptr(vlds, 4 * lay.v_stage_dword(D, g, pos % 16, pos // 16), fx.Int32, 4), word)
        gpu.barrier()
        staged = []
        for k in range_constexpr(NG // 4):
            v = fx.generic_load(_lds_ptr(vlds, 4 * lay.v_stage_dword(D, g, r, 4 * k), fx.Int32, 16),
                                dtype=fx.Int32, count=4)
            staged += [fx.Int32(v[e]) for e in range(4)]
        return staged

    @flyc.kernel(name=name, known_block_size=(WAVE * W, 1, 1))
    def decode_kernel(
        q_ptr: fx.Pointer, cache_ptr: fx.Pointer, bt_ptr: fx.Pointer, seqlen_ptr: fx.Pointer,
        sinks_ptr: fx.Pointer, out_ptr: fx.Pointer, part_ptr: fx.Pointer, ml_ptr: fx.Pointer,
        counter_ptr: fx.Pointer, err_ptr: fx.Pointer,
        scale: fx.Float32, softcap: fx.Float32, window: fx.Int32, num_splits: fx.Int32,
        num_blocks: fx.Int32, bt_cols: fx.Int32,
        stride_qb: fx.Int32, stride_qh: fx.Int32, stride_ob: fx.Int32, stride_oh: fx.Int32,
        stride_cb: fx.Int32, stride_ct: fx.Int32, stride_ch: fx.Int32, stride_btb: fx.Int32,
    ):
        stage_bytes = STAGE_BYTES  # (referenced here so the AST rewriter keeps it in the closure)
        lds = _lds_base(fx.SharedAllocator().allocate(LDS_BYTES, 16)) if LDS_BYTES else None
        tid = fx.Int32(gpu.thread_id("x"))
        lane = tid % WAVE
        wave = tid // WAVE
        b = fx.Int32(gpu.block_id("x"))
        kvh = fx.Int32(gpu.block_id("y"))
        split = fx.Int32(gpu.block_id("z"))
        num_kv = grid_dim_y()
        r = lane % 16
        g = lane // 16

        seq_raw = _load(seqlen_ptr, b * 4, fx.Int32, 1, 4)[0]
        capacity = bt_cols * BS
        seq_len = fx.Int32(_select(seq_raw < 0, fx.Int32(0), _select(seq_raw > capacity, capacity, seq_raw)))
        if (seq_raw < 0) | (seq_raw > capacity):
            fx.generic_store(_global_ptr(err_ptr, ERR_SEQ_LEN_BYTES, fx.Int32, 4), fx.Int32(1))
        if const_expr(has_window):
            lo, hi, t_begin, t_end = lay.split_tiles(seq_len, num_splits, split, window)
        else:
            lo, hi, t_begin, t_end = lay.split_tiles(seq_len, num_splits, split, None)
        t_end = _select(t_end > t_begin, t_end, t_begin)

        # ---- 1. query prologue: load in the QK B layout (qmap), rotate (FWHT), make the operands
        head_ok = r < G
        qh = kvh * G + _select(head_ok, r, fx.Int32(G - 1))
        q_row = b * stride_qb + qh * stride_qh
        per_load = 16 // q_bytes
        x = []  # x[c][e]: lane holds q[r][lay.query_dim(qmap, c, lane, e)]
        for c in range_constexpr(CH):
            run = []
            for part in range_constexpr(EQ // per_load):
                v = _load(q_ptr, (q_row + lay.query_dim(qmap, c, lane, part * per_load)) * q_bytes, QT, per_load, 16)
                for e in range_constexpr(per_load):
                    run.append(_select(head_ok, fx.Float32(v[e].to(fx.Float32)), fx.Float32(0.0)))
            x.append(run)
        for kind, s in lay.fwht_stages(qmap, D):  # bits 0..6 of d, in order: in the lane or across lanes
            if const_expr(kind == "elem"):
                for c in range_constexpr(CH):
                    for e in range_constexpr(EQ):
                        if const_expr(e & s == 0):
                            a0, b0 = x[c][e], x[c][e + s]
                            x[c][e], x[c][e + s] = a0 + b0, a0 - b0
            else:
                upper = (lane & s) != 0
                for c in range_constexpr(CH):
                    for e in range_constexpr(EQ):
                        o = _xor(x[c][e], s)
                        x[c][e] = _select(upper, o - x[c][e], x[c][e] + o)
        for s in [1 << k for k in range(CH.bit_length() - 1)]:  # bits 7+: across the lane's chunks
            for c in range_constexpr(CH):
                if const_expr(c & s == 0):
                    for e in range_constexpr(EQ):
                        a0, b0 = x[c][e], x[c + s][e]
                        x[c][e], x[c + s][e] = a0 + b0, a0 - b0
        if const_expr(mx):
            q_mx = [_fp8_query([x[c][e] * inv_sqrt_d for e in range(32)], g, plan) for c in range(CH)]
            qk_scale = scale * LOG2E
        else:  # fp16: the head times 2**(ef - 127) so its absmax lands in [2**14, 2**15) (no fp16 overflow)
            vals = [[x[c][e] * inv_sqrt_d for e in range(EQ)] for c in range(CH)]
            amax = fx.Float32(0.0)
            for c in range_constexpr(CH):
                for e in range_constexpr(EQ):
                    amax = arith.maxnumf(amax, fx.Float32(_raw_abs(vals[c][e])))
            ef = lay.query_range_exponent(_f32_bits(_xor_max(amax, [16, 32])), _select)
            pre = _f32_from_bits(ef << 23)
            # operand of step p of group q: the query elements the decoded K word holds (code order)
            q16 = [[[fx.Vector.from_elements([vals[c][8 * qq + e] * pre for e in lay.F16_STEP_CODES[step]],
                                             dtype=fx.Float32).to(fx.Float16) for step in range(2)]
                    for qq in range(EQ // 8)] for c in range(CH)]
            # 2**(127 - ef) undoes the prescale, 2**14 the K decode's code x 2**-14
            unscale = _f32_from_bits((254 - ef) << 23) * float(2.0 ** -fp4_bits.FP16_OFFSET_LOG2)
            qk_scale = unscale * (scale if has_softcap else scale * LOG2E)

        # ---- main loop over this split's 16-token tiles
        if const_expr(has_softcap):
            # c tanh(s / c) = c (1 - 2 / (2^(2 log2(e) s / c) + 1)): the scores' scale folded into the
            # exponent's (one multiply per score); v_rcp_f32, 1 ulp
            cap_in = (scale if mx else qk_scale) * ((2.0 * LOG2E) * rcp(softcap))
        kv_base = fx.Int64(kvh) * fx.Int64(stride_ch)
        bt_row = fx.Int64(b) * fx.Int64(stride_btb)
        zero4 = fx.Vector.filled(MFMA_K, 0.0, fx.Float32)
        # the W waves of the workgroup take the split's tiles round robin (uniform trip count; a
        # wave's surplus last step is fully masked and re-reads the split's first tile). Software
        # pipelined: step s computes the tile fetched by step s - 1 while its own loads (tile s + 1,
        # with the entry step s - 1 loaded, and the entry of tile s + 2) are in flight.
        n_iter = (t_end - t_begin + (W - 1)) // W
        vlds = lds + wave * stage_bytes if stage_v else None
        first_w = t_begin + wave
        first = _select(first_w < t_end, first_w, t_begin)
        fetch_args = (seq_len, bt_ptr, bt_row, cache_ptr, kv_base, stride_cb, stride_ct, r, g, num_blocks)
        # pipelined: the carried values are the next tile's loads and the block-table entry of the tile
        # after it, so no step waits for an entry before issuing its loads
        second = _select(first_w + W < t_end, first_w + W, t_begin)
        lane_zero = fx.Int32(rocdl.mbcnt_lo(T.i32, _raw(fx.Int32(0)), _raw(fx.Int32(0))))  # 0 in every lane
        init = ([fx.Float32(F32_NEG_INF), fx.Float32(0.0)] + [zero4] * NB + [fx.Int32(0)]
                + (fetch(first, n_iter > 0, *fetch_args) + ([page_entry(second, bt_ptr, bt_row, lane_zero)]
                                                            if ahead else []) if pipelined else []))
        for step, st in range(0, n_iter, 1, init=init):
            tile_w = t_begin + fx.Int32(step) * W + wave
            in_split = tile_w < t_end
            tile = _select(in_split, tile_w, t_begin)
            m_run, l_run = fx.Float32(st[0]), fx.Float32(st[1])
            o_acc = [fx.Vector(st[2 + nb]) for nb in range_constexpr(NB)]
            next_w = tile_w + W
            if const_expr(pipelined):
                cur = [fx.Int32(v) for v in st[3 + NB:]]
                # past the split's end a step re-reads the split's first tile (masked), as `tile` does
                tile_next = _select(next_w < t_end, next_w, t_begin)
                if const_expr(ahead):
                    cur, entry = cur[:-1], cur[-1]
                    tile_after = _select(next_w + W < t_end, next_w + W, t_begin)
                    entry_after = page_entry(tile_after, bt_ptr, bt_row, lane_zero)
                    nxt = fetch(tile_next, True, *fetch_args, entry=entry) + [entry_after]
                else:
                    nxt = fetch(tile_next, True, *fetch_args)
            else:
                cur, nxt = fetch(tile, True, *fetch_args), []
                if const_expr(fenced):
                    _phase_fence()
            t0 = tile * TILE
            # a block id outside the cache: an empty tile, counted (error word after the loop)
            page_ok = cur[-1] != 0
            tile_ok = in_split & page_ok
            bad_pages = fx.Int32(st[2 + NB]) | _select(in_split, _select(page_ok, fx.Int32(0), fx.Int32(1)),
                                                        fx.Int32(0))

            # ---- 2. QK: A = K rows (token t0 + r), B = rotated Q
            acc = zero4
            if const_expr(mx):
                for c in range_constexpr(CH):
                    words = cur[4 * c : 4 * c + 4]
                    sbyte = cur[4 * CH + c]
                    # one scaled MFMA: A = 32 FP4 codes (4 dwords) + their scale
                    a_op = fx.Vector.from_elements(words + [fx.Int32(0)] * 4, dtype=fx.Int32)
                    for term in range_constexpr(2):  # hi then lo query term, same K operand
                        acc = fx.Vector(rocdl.mfma_scale_f32_16x16x128_f8f6f4(
                            T.vec(4, T.f32), [a_op, q_mx[c][term][0], acc, 4, 0, 0, sbyte, 0, q_mx[c][term][1]]))
            else:  # per scale group q: two f16 MFMAs over its 32 d, then times each row's K scale
                tok_vals = [fp16_slots(cur, i) for i in range(MFMA_K)]
                staged = stage_v_words(vlds, tok_vals, r, g) if stage_v else None
                for q in range_constexpr(NG):
                    a_ops = _f16_operands(cur[q])
                    part = _mfma_f16(a_ops[0], q16[q // 4][q % 4][0], zero4)
                    part = _mfma_f16(a_ops[1], q16[q // 4][q % 4][1], part)
                    acc = fx.Vector(fx.math.fma(part, _scale_vec([tok_vals[i][0] for i in range(MFMA_K)], KS_FIRST + q),
                                                acc))

            if const_expr(fenced):
                _phase_fence()
            # ---- 3. scores S^T[4g+i][r], mask, online softmax (log2 units)
            sc = []
            for i in range_constexpr(MFMA_K):
                si = fx.Float32(acc[i])
                if const_expr(has_softcap):
                    si = softcap * (1.0 - 2.0 * rcp(exp2(si * cap_in) + 1.0)) * LOG2E
                else:
                    si = si * qk_scale
                tok = t0 + 4 * g + i
                sc.append(_select((tok >= lo) & (tok < hi) & tile_ok, si, fx.Float32(F32_NEG_INF)))
            mt = arith.maxnumf(arith.maxnumf(sc[0], sc[1]), arith.maxnumf(sc[2], sc[3]))
            if const_expr(not mx):
                # V's group scales (masked tokens: 0.0) go into the fp16 P: the reference point also
                # covers score + log2(largest V scale of the lane's tokens) - 15 (lay.v_scale_headroom)
                vis_v = [(t0 + 4 * g + i >= lo) & (t0 + 4 * g + i < hi) & tile_ok for i in range(MFMA_K)]
                vsw = [[_select(vis_v[i], w, fx.Int32(0)) for w in tok_vals[i][2]] for i in range(MFMA_K)]
                svs = [_scale_vec([vsw[t] for t in lay.PV_TOKENS], VS_FIRST + q) for q in range(NG)]
                smax = fx.Float32(svs[0][0])
                for q in range_constexpr(NG):
                    for i in range_constexpr(MFMA_K):
                        if const_expr(q + i > 0):
                            smax = arith.maxnumf(smax, fx.Float32(svs[q][i]))
                head = lay.v_scale_headroom(_f32_bits(smax) >> 23, lambda a, b: _select(a > b, a, b))
                mt = mt + fx.Float32(arith.sitofp(T.f32, _raw(fx.Int32(head))))
            mt = arith.maxnumf(mt, _xor(mt, 16))
            mt = arith.maxnumf(mt, _xor(mt, 32))
            m_new = arith.maxnumf(m_run, mt)
            m_use = _select(m_new == F32_NEG_INF, fx.Float32(0.0), m_new)
            alpha = exp2(m_run - m_use)
            p = [exp2(sc[i] - m_use) for i in range(MFMA_K)]
            l_new = l_run * alpha + ((p[0] + p[1]) + (p[2] + p[3]))

            alpha4 = fx.Vector.from_elements([alpha] * MFMA_K, dtype=fx.Float32)
            new_o = []
            if const_expr(not mx):
                # ---- 4. PV (fp16): MFMA 2q + h, A = V^T rows d = 32q + 2m + h (nibble h of byte 16q + m),
                # B = P^T times V's group-q scale (fp16, at most 2**15); a masked token's V scale is 0.0
                for q in range_constexpr(NG):
                    if const_expr(stage_v):
                        word = staged[q]
                    else:
                        vb = [tok_vals[i][1][q] for i in range(MFMA_K)]
                        word = vb[0] | (vb[1] << 8) | (vb[2] << 16) | (vb[3] << 24)  # byte i = token i
                    pv = [fx.Float32(p[t]) * fx.Float32(svs[q][k]) for k, t in enumerate(lay.PV_TOKENS)]
                    pq = _pk_rtz(pv)
                    for h, a_op in enumerate(_f16_operands(word)):
                        new_o.append(_mfma_f16(a_op, pq, o_acc[2 * q + h] * alpha4))
            else:
                # ---- 4. PV (mx): A = V^T (rows d = (D/16) m + nb), B = P^T (bf16)
                p_ops = _bf16_pack(p)
                vwords = []
                vscales = []
                for i in range_constexpr(MFMA_K):  # V codes and scales of tokens not visible are zeroed
                    tok = t0 + 4 * g + i
                    vis = (tok >= lo) & (tok < hi) & tile_ok
                    base = 5 * CH + (NG // 4) * i
                    vwords.append([_select(vis, w, fx.Int32(0)) for w in cur[base : base + NG // 4]])
                    vscales.append(_select(vis, cur[5 * CH + NG + i], fx.Int32(0)))
                # hardware FP4 -> bf16: one cvt per (token, byte) = d pair (nb, nb+1). The conversion
                # reads only the exponent field of this f32 scale: byte 0 (+0.0) scales by 2**-127, not 0
                # (operand_maps.e8m0_value). Zero only because the codes are zero then: the encoder
                # writes byte 0 for all-zero groups, and masked tokens' codes are zeroed above.
                vsf = [fx.Float32(arith.bitcast(T.f32, _raw(fx.Int32(vs << 23)))) for vs in vscales]
                for nb in range_constexpr(NB):
                    if const_expr(nb % 2 == 0):
                        pairs = [fx.Int32(fx.Vector(rocdl.cvt_scalef32_pk_bf16_fp4(
                            T.vec(2, T.bf16), _raw(vwords[i][nb // 8]), _raw(vsf[i]), (nb % 8) // 2))
                            .bitcast(fx.Int32)[0]) for i in range(MFMA_K)]
                    half = [(pr >> (16 * (nb % 2))) & 0xFFFF for pr in pairs]
                    a_op = fx.Vector.from_elements([_i16(h) for h in half], dtype=fx.Int16)
                    new_o.append(_mfma(a_op, p_ops, o_acc[nb] * alpha4))
            results = yield [m_new, l_new] + new_o + [bad_pages] + nxt

        # ---- 5. epilogue. mx: lane (r, g) holds O[r][QUARTER*g + NB*i + nb] = o[nb][i]; fp16: o[2q + h][i]
        # is O[r][lay.out_dim(q, h, g, i)] (x 2**-14, the V decode's offset, undone here).
        m_fin, l_fin = fx.Float32(results[0]), fx.Float32(results[1])
        o_fin = [fx.Vector(results[2 + nb]) for nb in range_constexpr(NB)]
        if fx.Int32(results[2 + NB]) != 0:
            fx.generic_store(_global_ptr(err_ptr, ERR_BLOCK_BYTES, fx.Int32, 4), fx.Int32(1))
        l_tot = l_fin + _xor(l_fin, 16)
        l_tot = l_tot + _xor(l_tot, 32)
        # registers as QUARTER/4 vectors of 4 floats contiguous in d: vector k starts at d = mine_d[k]
        if const_expr(mx):
            mine = [fx.Vector.from_elements([fx.Float32(o_fin[(4 * k + t) % NB][(4 * k + t) // NB])
                                             for t in range(MFMA_K)], dtype=fx.Float32)
                    for k in range(QUARTER // 4)]
            mine_d = [QUARTER * g + 4 * k for k in range(QUARTER // 4)]
        else:  # d = 32q + 8g + 4 half + t holds o[2q + t % 2][2 half + t // 2]
            unit = fx.Vector.filled(MFMA_K, float(2.0 ** -fp4_bits.FP16_OFFSET_LOG2), fx.Float32)
            mine = [fx.Vector.from_elements([fx.Float32(o_fin[2 * q + t % 2][2 * half + t // 2])
                                             for t in range(MFMA_K)], dtype=fx.Float32) * unit
                    for q in range(NG) for half in range(2)]
            mine_d = [lay.out_dim(q, 0, g, 2 * half) for q in range(NG) for half in range(2)]
        if const_expr(W > 1):
            # fold waves W-1 .. 1 into wave 0 through one LDS slot (every wave merges; only wave 0's
            # result is used); a barrier before each read and before the slot is reused
            if const_expr(stage_v):
                gpu.barrier()  # every wave's last staged-V read is done before the slot is written
            srow = r * D * 4
            # only wave 0's state changes (select), so a wave's state is still its own when it publishes
            is0 = wave == 0
            for src in range_constexpr(W - 1, 0, -1):
                if wave == src:
                    for k in range_constexpr(QUARTER // 4):
                        fx.generic_store(_lds_ptr(lds, srow + 4 * mine_d[k], fx.Float32, 16), mine[k])
                    if g == 0:
                        fx.generic_store(_lds_ptr(lds, ROWS * D * 4 + r * 4, fx.Float32, 4), m_fin)
                        fx.generic_store(_lds_ptr(lds, ROWS * D * 4 + (ROWS + r) * 4, fx.Float32, 4), l_tot)
                gpu.barrier()
                m2 = fx.Float32(fx.generic_load(_lds_ptr(lds, ROWS * D * 4 + r * 4, fx.Float32, 4), dtype=fx.Float32))
                l2 = fx.Float32(fx.generic_load(_lds_ptr(lds, ROWS * D * 4 + (ROWS + r) * 4, fx.Float32, 4),
                                                dtype=fx.Float32))
                # merge()'s arithmetic, 4 floats at a time (keeps the register peak low)
                m_new, a1, a2, a1v, a2v = _merge_factors(m_fin, m2)
                for k in range_constexpr(QUARTER // 4):
                    ld = fx.Vector(fx.generic_load(_lds_ptr(lds, srow + 4 * mine_d[k], fx.Float32, 16),
                                                   dtype=fx.Float32, count=4))
                    mine[k] = _vselect(is0, mine[k] * a1v + ld * a2v, mine[k])
                m_fin, l_tot = _select(is0, m_new, m_fin), _select(is0, l_tot * a1 + l2 * a2, l_tot)
                gpu.barrier()
        pair = b * num_kv + kvh
        multi = num_splits > 1
        if wave == 0:  # the rest is one wave's job: partial, ticket, merge, output
            if multi:
                slot = fx.Int64(pair * num_splits + split)
                prow = (slot * ROWS + fx.Int64(r)) * D
                for k in range_constexpr(QUARTER // 4):
                    fx.generic_store(_global_ptr(part_ptr, (prow + fx.Int64(mine_d[k])) * 4, fx.Float32, 16),
                                     mine[k])
                if g == 0:
                    fx.generic_store(_global_ptr(ml_ptr, (slot * (2 * ROWS) + fx.Int64(r)) * 4, fx.Float32, 4),
                                     m_fin)
                    fx.generic_store(_global_ptr(ml_ptr, (slot * (2 * ROWS) + ROWS + fx.Int64(r)) * 4,
                                                 fx.Float32, 4), l_tot)
            # ticket: lane 0 adds 1 (0 with one split, which leaves the counter at 0); acq_rel at agent
            # scope publishes this wave's partial stores and makes the other splits' visible
            inc = _select((lane == 0) & multi, fx.Int32(1), fx.Int32(0))
            old = fx.atomic_add(_global_ptr(counter_ptr, fx.Int64(pair) * 4, fx.Int32, 4), inc,
                                syncscope="agent", ordering=fx.AtomicOrdering.AcqRel)
            ticket = fx.Int32(rocdl.readfirstlane(T.i32, old))
            if ticket == num_splits - 1:
                # several splits: merge every slot (this one's included) from an empty state; one split:
                # no slot to read, the state is this wave's own
                n_read = _select(multi, num_splits, fx.Int32(0))
                st0 = [_select(multi, fx.Float32(F32_NEG_INF), m_fin), _select(multi, fx.Float32(0.0), l_tot)]
                st0 += [_vselect(multi, zero4, v) for v in mine]
                for sp, ms in range(0, n_read, 1, init=st0):
                    src = fx.Int64(pair * num_splits + fx.Int32(sp))
                    prow = (src * ROWS + fx.Int64(r)) * D
                    acc2 = [fx.Vector(fx.generic_load(_global_ptr(part_ptr, (prow + fx.Int64(mine_d[k])) * 4,
                                                                  fx.Float32, 16), dtype=fx.Float32, count=4))
                            for k in range_constexpr(QUARTER // 4)]
                    m2 = _load(ml_ptr, (src * (2 * ROWS) + fx.Int64(r)) * 4, fx.Float32, 1, 4)[0]
                    l2 = _load(ml_ptr, (src * (2 * ROWS) + ROWS + fx.Int64(r)) * 4, fx.Float32, 1, 4)[0]
                    accm, mm, lm = merge([fx.Vector(v) for v in ms[2:]], fx.Float32(ms[0]), fx.Float32(ms[1]),
                                         acc2, m2, l2)
                    merged = yield [mm, lm] + accm
                m_all, l_all = fx.Float32(merged[0]), fx.Float32(merged[1])
                acc_all = [fx.Vector(v) for v in merged[2:]]
                if const_expr(has_sinks):
                    sink = _load(sinks_ptr, (kvh * G + _select(head_ok, r, fx.Int32(0))) * 4, fx.Float32, 1, 4)[0]
                    s2 = sink * LOG2E
                    m_s = arith.maxnumf(m_all, s2)
                    l_all = l_all * exp2(m_all - m_s) + exp2(s2 - m_s)
                    f = exp2(m_all - m_s)
                    fv = fx.Vector.from_elements([f] * MFMA_K, dtype=fx.Float32)
                    acc_all = [v * fv for v in acc_all]
                pos = l_all > 0.0
                inv = _select(pos, fx.Float32(rocdl.rcp(T.f32, _raw(_select(pos, l_all, fx.Float32(1.0))))),
                              fx.Float32(0.0))
                invv = fx.Vector.from_elements([inv] * MFMA_K, dtype=fx.Float32)
                if head_ok:
                    orow = (fx.Int64(b) * fx.Int64(stride_ob) + fx.Int64(kvh * G + r) * fx.Int64(stride_oh)) * o_bytes
                    for k in range_constexpr(QUARTER // 4):
                        val = (acc_all[k] * invv)
                        if const_expr(out_dtype != "fp32"):
                            val = val.to(OT)
                        fx.generic_store(_global_ptr(out_ptr, orow + fx.Int64(mine_d[k]) * o_bytes, OT,
                                                     4 * o_bytes), val)
                if multi & (lane == 0):
                    fx.atomic_xchg(_global_ptr(counter_ptr, fx.Int64(pair) * 4, fx.Int32, 4), fx.Int32(0),
                                   syncscope="agent", ordering=fx.AtomicOrdering.Monotonic)

    @flyc.jit
    def launch(
        q_ptr: fx.Pointer, cache_ptr: fx.Pointer, bt_ptr: fx.Pointer, seqlen_ptr: fx.Pointer,
        sinks_ptr: fx.Pointer, out_ptr: fx.Pointer, part_ptr: fx.Pointer, ml_ptr: fx.Pointer,
        counter_ptr: fx.Pointer, err_ptr: fx.Pointer,
        scale: fx.Float32, softcap: fx.Float32, window: fx.Int32, num_splits: fx.Int32,
        num_blocks: fx.Int32, bt_cols: fx.Int32,
        stride_qb: fx.Int32, stride_qh: fx.Int32, stride_ob: fx.Int32, stride_oh: fx.Int32,
        stride_cb: fx.Int32, stride_ct: fx.Int32, stride_ch: fx.Int32, stride_btb: fx.Int32,
        stream: fx.Stream = fx.Stream(None),  # noqa: B008 (FlyDSL reads the default at trace time)
    ):
        decode_kernel(q_ptr, cache_ptr, bt_ptr, seqlen_ptr, sinks_ptr, out_ptr, part_ptr, ml_ptr,
                      counter_ptr, err_ptr, scale, softcap, window, num_splits, num_blocks, bt_cols,
                      stride_qb, stride_qh, stride_ob, stride_oh, stride_cb, stride_ct, stride_ch,
                      stride_btb).launch(
            grid=(1, 1, 1), block=(WAVE * W, 1, 1), stream=stream)

    return launch
