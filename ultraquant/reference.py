"""Plain-PyTorch reference of every UltraQuant op, written from the format spec (docs/format.md).

Slow and simple on purpose: every kernel is tested against these functions, and they are tested
against hand-worked vectors. Attention math runs in float64.
"""

from __future__ import annotations

import torch

from . import validate
from .errors import UltraQuantError
from .format import (
    E2M1_THRESHOLDS,
    E2M1_VALUES,
    GROUP,
    MAX_EXP,
    MIN_EXP,
    RNE_TIES_UP,
    SCALE_BIAS,
    SCALE_FACTOR,
    SQRT2_MANTISSA,
    SlotLayout,
    check_head_size,
    hadamard,
)

# ---------------------------------------------------------------- scale exponents


def upstream_exponent(amax: torch.Tensor) -> torch.Tensor:
    """Upstream's scale exponent ``clamp(floor(log2(0.156 * amax) + 0.5), -126, 127)``, exactly.

    The product is rounded to float32 (as upstream computes it); the log-domain rounding is done on
    the bits: the exponent field plus one when the mantissa is at least sqrt(2). This is exact, so
    every implementation (reference, Triton, FlyDSL) agrees to the bit; a float32 ``log2`` can differ
    from it only when ``t`` lies within an ulp or two of ``2**(k + 1/2)``.
    """
    t = amax.to(torch.float32) * torch.tensor(SCALE_FACTOR, dtype=torch.float32)
    bits = t.view(torch.int32)
    field = (bits >> 23) & 0xFF
    exp = field - 127 + ((bits & 0x7FFFFF) >= SQRT2_MANTISSA).to(torch.int32)
    exp = torch.where(field == 0, torch.full_like(exp, MIN_EXP), exp)
    return exp.clamp(MIN_EXP, MAX_EXP)


def _pow2(exp: torch.Tensor) -> torch.Tensor:
    """``2**exp`` as exact float32 for integer exp in [-126, 127] (built from the bits)."""
    return ((exp.to(torch.int32) + 127) << 23).view(torch.float32)


# ---------------------------------------------------------------- FP4 E2M1 codes


def _magnitude_index(y: torch.Tensor, ties_up: tuple[bool, ...] | torch.Tensor) -> torch.Tensor:
    """Index 0..7 of the E2M1 magnitude nearest |y|; at a decision point, ``ties_up`` decides."""
    a = y.abs()
    idx = torch.zeros(y.shape, dtype=torch.int32, device=y.device)
    for i, th in enumerate(E2M1_THRESHOLDS):
        up = ties_up[i] if isinstance(ties_up, tuple) else ties_up
        above = a > th
        at = a == th
        idx += (above | (at & up)).to(torch.int32)
    return idx


def encode_e2m1(y: torch.Tensor, encoder: str = "rne") -> torch.Tensor:
    """Codes (uint8, 0..15) of ``y`` (already divided by its scale) under a tie rule.

    ``rne``: ties to the even code (mantissa bit 0), symmetric in sign. ``upstream`` (and anything
    else that asks for it): ties to the lower level on the number line, i.e. toward zero for positive
    y and away from zero for negative y. Zero (and anything rounding to it) is code 0, never -0.
    """
    if encoder == "upstream":
        idx = _magnitude_index(y, y < 0)
    else:
        idx = _magnitude_index(y, RNE_TIES_UP)
    sign = ((y < 0) & (idx > 0)).to(torch.int32) << 3
    return (idx | sign).to(torch.uint8)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of E2M1 codes (uint8 0..15)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """(..., D) codes -> (..., D/2) bytes, element 2i in the low nibble, 2i+1 in the high nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """(..., D/2) bytes -> (..., D) codes (inverse of :func:`pack_nibbles`)."""
    lo, hi = packed & 0x0F, packed >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)


# ---------------------------------------------------------------- quantize / dequantize


def _rotate(x: torch.Tensor) -> torch.Tensor:
    """``x @ H`` in float32 (the matmul order upstream uses)."""
    return x.to(torch.float32) @ hadamard(x.shape[-1], device=x.device)


def _quantize_groups(g: torch.Tensor, encoder: str) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 groups (..., 32) -> (codes (..., 32) uint8, scale bytes (...,) uint8)."""
    amax = g.abs().amax(dim=-1)
    zero = ~torch.isfinite(amax) | (amax == 0)
    g = torch.where(zero[..., None], torch.zeros_like(g), g)
    exp = upstream_exponent(torch.where(zero, torch.ones_like(amax), amax))
    if encoder == "mse":
        exp = _best_neighbour_exponent(g, exp)
    codes = encode_e2m1(g * _pow2(-exp)[..., None], encoder)
    scale = torch.where(zero, torch.zeros_like(exp), exp + SCALE_BIAS)
    codes = torch.where(zero[..., None], torch.zeros_like(codes), codes)
    return codes, scale.to(torch.uint8)


def _best_neighbour_exponent(g: torch.Tensor, exp0: torch.Tensor) -> torch.Tensor:
    """Among exp0, exp0-1, exp0+1 (clamped; in that order of preference on equal error) the
    exponent whose rne-rounded group has the least squared error (summed in float64)."""
    best, best_err = exp0, None
    for delta in (0, -1, 1):
        e = (exp0 + delta).clamp(MIN_EXP, MAX_EXP)
        s = _pow2(e)[..., None]
        q = decode_e2m1(encode_e2m1(g * _pow2(-e)[..., None], "rne")) * s
        err = ((g.double() - q.double()) ** 2).sum(dim=-1)
        if best_err is None:
            best_err = err
            continue
        better = err < best_err
        best = torch.where(better, e, best)
        best_err = torch.where(better, err, best_err)
    return best


def quantize(x: torch.Tensor, *, rotate: bool, encoder: str = "rne") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x (..., D)`` to (codes uint8 (..., D/2), scales uint8 (..., D/32)).

    With ``rotate=True`` the input is first multiplied by the normalized Hadamard matrix (K's path).
    ``encoder``: ``"rne"`` (default, round half to even), ``"upstream"`` (upstream vLLM's tie rule,
    bit-exact, biased: for cross-checks), ``"mse"`` (least-error exponent among the neighbours of
    upstream's, rne ties).
    """
    validate.check_encoder(encoder)
    if not isinstance(x, torch.Tensor) or x.dtype not in validate.FLOAT_DTYPES or x.dim() == 0:
        raise UltraQuantError("x: expected a float16/bfloat16/float32 tensor of shape (..., D)")
    d = check_head_size(x.shape[-1], "x.shape[-1]")
    xf = _rotate(x) if rotate else x.to(torch.float32)
    groups = xf.reshape(*xf.shape[:-1], d // GROUP, GROUP)
    codes, scales = _quantize_groups(groups, encoder)
    return pack_nibbles(codes.reshape(*xf.shape[:-1], d)), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, *, rotate: bool,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize` up to rounding: (..., D/2), (..., D/32) -> (..., D) in ``dtype``.

    With ``rotate=True`` the result is returned in the original space (multiplied by H again).
    """
    vals = decode_e2m1(unpack_nibbles(codes))
    d = vals.shape[-1]
    exp = scales.to(torch.int32) - SCALE_BIAS
    s = torch.where(scales == 0, torch.zeros((), dtype=torch.float32, device=scales.device),
                    _pow2(exp.clamp(MIN_EXP, MAX_EXP)))
    x = (vals.reshape(*vals.shape[:-1], d // GROUP, GROUP) * s[..., None]).reshape(vals.shape)
    if rotate:
        x = (x.double() @ hadamard(d, device=x.device, dtype=torch.float64))
    return x.to(dtype)


# ---------------------------------------------------------------- the paged cache


def encode_slots(key: torch.Tensor, value: torch.Tensor, encoder: str = "rne") -> torch.Tensor:
    """(N, Hk, D) K and V -> (N, Hk, slot_size(D)) slot bytes (K rotated)."""
    kc, ks = quantize(key, rotate=True, encoder=encoder)
    vc, vs = quantize(value, rotate=False, encoder=encoder)
    return torch.cat([kc, ks, vc, vs], dim=-1)


def decode_slots(slots: torch.Tensor, head_size: int, *,
                 original_space: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., >= slot_size) slot bytes -> K (original space, or the rotated one the cache holds when
    ``original_space=False``) and V, float64 (..., D)."""
    lay = SlotLayout(head_size)
    k = dequantize(slots[..., lay.k_codes:lay.k_scales], slots[..., lay.k_scales:lay.v_codes],
                   rotate=original_space, dtype=torch.float64)
    v = dequantize(slots[..., lay.v_codes:lay.v_scales], slots[..., lay.v_scales:lay.size],
                   rotate=False, dtype=torch.float64)
    return k, v


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             *, encoder: str = "rne") -> None:
    """Quantize each token's K (rotated) and V and write them to ``kv_cache`` at ``slot_mapping``.

    Negative slots are skipped (their bytes stay untouched); nothing is written if validation fails.
    """
    geo = validate.check_store(key, value, kv_cache, slot_mapping, encoder)
    keep = slot_mapping >= 0
    if not bool(keep.any()):
        return
    slots = encode_slots(key[keep], value[keep], encoder)
    idx = slot_mapping[keep].long()
    kv_cache[idx // geo.block_size, idx % geo.block_size, :, : slots.shape[-1]] = slots


def allocate_blocks(seq_lens: list[int], block_size: int, num_blocks: int,
                    generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A paged layout like a serving engine's: each request's blocks come from a shuffled free list of
    ``num_blocks`` (one ``randperm`` of ``generator``). Returns the (B, max_blocks) int32 block table
    (unused entries 0) and the int64 slot mapping of every token, requests in order. For tests,
    self-tests and benchmarks that need realistic, non-contiguous block tables."""
    need = [-(-n // block_size) for n in seq_lens]
    free = torch.randperm(num_blocks, generator=generator).tolist()
    table = torch.zeros(len(seq_lens), max(need + [1]), dtype=torch.int32)
    slots = []
    for i, n in enumerate(seq_lens):
        table[i, : need[i]] = torch.tensor([free.pop() for _ in range(need[i])], dtype=torch.int32)
        pos = torch.arange(n)
        slots.append(table[i, pos // block_size].long() * block_size + pos % block_size)
    return table, torch.cat(slots) if slots else torch.zeros(0, dtype=torch.int64)


def _request_slots(kv_cache: torch.Tensor, block_table: torch.Tensor, row: int, start: int, stop: int) -> torch.Tensor:
    """(stop - start, Hk, slot_bytes) slots of one request's tokens at positions start..stop-1."""
    bs = kv_cache.shape[1]
    pos = torch.arange(start, stop, device=kv_cache.device)
    blocks = block_table[row, pos // bs].long()
    return kv_cache[blocks, pos % bs]


def _window_start(first_query_pos: int, sliding_window: int | None) -> int:
    """First key position any query at or after ``first_query_pos`` can see. Blocks wholly before it
    are never read: vLLM may point them at a shared null block with arbitrary bytes."""
    return 0 if sliding_window is None else max(0, first_query_pos - sliding_window + 1)


def dequant_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, *,
               head_size: int | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each request's cached K (original space) and V: two lists of float32 (L_i, Hk, D) tensors.

    ``head_size`` defaults to the one whose slot size equals ``kv_cache``'s last dimension.
    """
    geo = validate.check_dequant(kv_cache, block_table, seq_lens, head_size)
    keys, values = [], []
    for i, length in enumerate(seq_lens.tolist()):
        k, v = decode_slots(_request_slots(kv_cache, block_table, i, 0, length), geo.head_size)
        keys.append(k.float())
        values.append(v.float())
    return keys, values


# ---------------------------------------------------------------- attention


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_start: int, scale: float,
            sinks: torch.Tensor | None, sliding_window: int | None, softcap: float | None) -> torch.Tensor:
    """float64 attention of queries (M, Hq, D) at positions ``q_pos`` over keys at k_start, k_start+1...

    Causal (key position <= query position), optional window, soft cap and sinks; GQA by
    repeating kv heads. A query that sees no key (and no sink) gets zeros.
    """
    hq, hk = q.shape[1], k.shape[1]
    k = k.repeat_interleave(hq // hk, dim=1)
    v = v.repeat_interleave(hq // hk, dim=1)
    s = torch.einsum("mhd,lhd->hml", q, k) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    k_pos = torch.arange(k_start, k_start + k.shape[0], device=q.device)
    visible = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        visible &= k_pos[None, :] > q_pos[:, None] - sliding_window
    s = s.masked_fill(~visible[None], float("-inf"))
    if sinks is not None:
        sink = sinks.double()[:, None, None].expand(hq, s.shape[1], 1)
        s = torch.cat([s, sink], dim=-1)
    m = s.amax(dim=-1, keepdim=True).clamp_min(-1e300)  # rows with nothing visible stay finite
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    p = torch.where(denom > 0, p / denom.clamp_min(1e-300), torch.zeros_like(p))
    if sinks is not None:
        p = p[..., :-1]
    return torch.einsum("hml,lhd->mhd", p, v)


def _write(result: torch.Tensor, like: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return result.to(like.dtype)
    out.copy_(result)
    return out


def decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, *, sinks: torch.Tensor | None = None,
                     sliding_window: int | None = None, softcap: float | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """One new query token per request attending to its whole cached sequence: (B, Hq, D).

    The query is request i's token at position ``seq_lens[i] - 1``; ``seq_lens[i] == 0`` gives zeros.
    """
    geo = validate.check_decode(query, kv_cache, block_table, seq_lens, scale, sinks,
                                sliding_window, softcap, out)
    result = torch.zeros(query.shape, dtype=torch.float64, device=query.device)
    for i, length in enumerate(seq_lens.tolist()):
        if length == 0:
            continue
        start = _window_start(length - 1, sliding_window)
        k, v = decode_slots(_request_slots(kv_cache, block_table, i, start, length), geo.head_size)
        q_pos = torch.tensor([length - 1], device=query.device)
        result[i] = _attend(query[i : i + 1].double(), k, v, q_pos, start, scale, sinks, sliding_window, softcap)[0]
    return _write(result, query, out)


def prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                      scale: float, *, sinks: torch.Tensor | None = None, sliding_window: int | None = None,
                      softcap: float | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Varlen prefill chunks: request i's new tokens ``query_start_loc[i]:query_start_loc[i+1]`` sit at
    the end of its ``seq_lens[i]`` tokens; they attend to the cached prefix (read from ``kv_cache``)
    and causally to the chunk's own raw ``key``/``value``. An empty prefix is a first chunk.
    """
    geo = validate.check_prefill(query, key, value, kv_cache, block_table, seq_lens, query_start_loc,
                                 scale, sinks, sliding_window, softcap, out)
    result = _prefill(query, key, value, kv_cache, block_table, seq_lens, query_start_loc, geo.head_size, scale,
                      sinks, sliding_window, softcap)
    return _write(result, query, out)


def _prefill(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, head_size: int,
             scale: float, sinks: torch.Tensor | None, sliding_window: int | None,
             softcap: float | None) -> torch.Tensor:
    """:func:`prefill_attention` on checked arguments, float64 (any float ``key``/``value``)."""
    result = torch.zeros(query.shape, dtype=torch.float64, device=query.device)
    starts = query_start_loc.tolist()
    for i, length in enumerate(seq_lens.tolist()):
        a, b = starts[i], starts[i + 1]
        if a == b:
            continue
        prefix = length - (b - a)
        start = min(prefix, _window_start(prefix, sliding_window))
        k_old, v_old = decode_slots(_request_slots(kv_cache, block_table, i, start, prefix), head_size)
        k = torch.cat([k_old, key[a:b].double()])
        v = torch.cat([v_old, value[a:b].double()])
        q_pos = torch.arange(prefix, length, device=query.device)
        result[a:b] = _attend(query[a:b].double(), k, v, q_pos, start, scale, sinks, sliding_window, softcap)
    return result


def spec_decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                          seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, *,
                          max_query_len: int, sinks: torch.Tensor | None = None,
                          sliding_window: int | None = None, softcap: float | None = None,
                          out: torch.Tensor | None = None) -> torch.Tensor:
    """A speculative-decoding step: request i's new tokens ``query_start_loc[i]:query_start_loc[i+1]``
    (at most ``max_query_len``) sit at the end of its ``seq_lens[i]`` tokens, whose K/V are ALL in the
    cache (the step stored its own first): each attends causally to the cache. It is
    :func:`prefill_attention` with ``key``/``value`` = the cache's rows of the new tokens (float64)."""
    geo = validate.check_spec_decode(query, kv_cache, block_table, seq_lens, query_start_loc, max_query_len,
                                     scale, sinks, sliding_window, softcap, out)
    shape = (query.shape[0], geo.num_kv_heads, geo.head_size)
    key = torch.zeros(shape, dtype=torch.float64, device=query.device)
    value = torch.zeros(shape, dtype=torch.float64, device=query.device)
    starts = query_start_loc.tolist()
    for i, length in enumerate(seq_lens.tolist()):
        a, b = starts[i], starts[i + 1]
        key[a:b], value[a:b] = decode_slots(_request_slots(kv_cache, block_table, i, length - (b - a), length),
                                            geo.head_size)
    result = _prefill(query, key, value, kv_cache, block_table, seq_lens, query_start_loc, geo.head_size, scale,
                      sinks, sliding_window, softcap)
    return _write(result, query, out)
