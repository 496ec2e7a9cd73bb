"""Host-side input validation shared by the reference, the kernels' ops and the attention layer.

Shapes, dtypes, devices and head sizes are always checked (metadata only, no device work). Checks
that must read tensor *values* (slot_mapping, block_table and seq_lens ranges) run when the tensor
lives on the CPU, or on any device when ``ULTRAQUANT_CHECK_VALUES=1`` (that costs a device sync, so
it is off on the GPU hot path). Unchecked values cannot make a kernel touch memory outside the cache:
the kernels skip slots outside ``[0, num_blocks * block_size)``, read a block id outside
``[0, num_blocks)`` as an empty block and clamp a length to its block-table row, and report each
case in a device error word that :func:`ultraquant.check_errors` reads (docs/kernels.md, "Bounds").
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from . import config
from .errors import UltraQuantError
from .format import check_head_size, slot_size

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SLOT_PAD_ALIGN = 16
"""A slot may be padded up to the next multiple of this many bytes, no further. The vLLM adapter
allocates exactly ``slot_size(D)`` bytes (``ultraquant.vllm``: ``customize_spec``, ``kv_cache_shape``);
16 is the widest slot alignment the kernels exploit (``kernels.specialization.slot_alignment``). A wider slot
is another head size's cache (D=64 -> 68..80 bytes, D=128 -> 136..144, D=256 -> 272, D=512 -> 544)."""
INDEX_DTYPES = (torch.int32, torch.int64)


def _names(dtypes: Iterable[torch.dtype]) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(name: str, t: object, *, dtypes: Iterable[torch.dtype], ndim: int,
                 device: torch.device | None = None) -> torch.Tensor:
    """Raise UltraQuantError unless ``t`` is a tensor of one of ``dtypes`` with ``ndim`` dims."""
    dtypes = tuple(dtypes)
    if not isinstance(t, torch.Tensor):
        raise UltraQuantError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        got = str(t.dtype).replace("torch.", "")
        raise UltraQuantError(f"{name}: expected dtype {_names(dtypes)}, got {got}")
    if t.dim() != ndim:
        raise UltraQuantError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise UltraQuantError(f"{name}: expected a tensor on {device}, got one on {t.device}")
    return t


def check_shape(name: str, t: torch.Tensor, expected: tuple[int | None, ...]) -> None:
    """Raise unless ``t.shape`` matches ``expected`` (None matches any size)."""
    if len(t.shape) != len(expected) or any(
            e is not None and s != e for s, e in zip(t.shape, expected, strict=True)):
        shown = tuple("*" if e is None else e for e in expected)
        raise UltraQuantError(f"{name}: expected shape {shown}, got {tuple(t.shape)}")


def values_checkable(*tensors: torch.Tensor) -> bool:
    """True when reading these tensors' values costs no device sync (or the user asked for it)."""
    return config.get().check_values or all(t.device.type == "cpu" for t in tensors)


@dataclass(frozen=True)
class CacheGeometry:
    """What the cache tensor says about the problem."""

    num_blocks: int
    block_size: int
    num_kv_heads: int
    slot_bytes: int
    head_size: int


def check_cache(kv_cache: object, head_size: int, num_kv_heads: int | None = None) -> CacheGeometry:
    """Validate the paged cache (num_blocks, block_size, Hk, slot_bytes) uint8 for ``head_size``."""
    check_head_size(head_size)
    check_tensor("kv_cache", kv_cache, dtypes=(torch.uint8,), ndim=4)
    nb, bs, hk, sb = kv_cache.shape
    size = slot_size(head_size)
    widest = -(-size // SLOT_PAD_ALIGN) * SLOT_PAD_ALIGN
    if not size <= sb <= widest:
        d = sb * 16 // 17
        other = f" (the slot of head size {d})" if d * 17 == sb * 16 and d % 32 == 0 else ""
        raise UltraQuantError(
            f"kv_cache: slot_bytes (last dim) {sb}{other} does not fit head size {head_size}: expected "
            f"slot_size({head_size}) = {size} bytes, padded at most to the next multiple of {SLOT_PAD_ALIGN} "
            f"({widest})")
    if num_kv_heads is not None and hk != num_kv_heads:
        raise UltraQuantError(f"kv_cache: expected {num_kv_heads} kv heads (dim 2), got {hk}")
    if kv_cache.stride(3) != 1:
        raise UltraQuantError("kv_cache: the slot bytes (last dim) must be contiguous")
    if nb == 0 or bs == 0:
        raise UltraQuantError(f"kv_cache: empty cache of shape {tuple(kv_cache.shape)}")
    return CacheGeometry(nb, bs, hk, sb, head_size)


def check_heads(query_heads: int, kv_heads: int) -> None:
    """GQA needs Hq to be a multiple of Hk."""
    if kv_heads == 0 or query_heads % kv_heads:
        raise UltraQuantError(f"query: Hq={query_heads} is not a multiple of Hk={kv_heads}")


def check_slot_mapping(slot_mapping: object, num_tokens: int, geo: CacheGeometry,
                       device: torch.device) -> torch.Tensor:
    """slot_mapping (N,) int32/int64; values in [0, num_blocks*block_size) or negative (skip)."""
    check_tensor("slot_mapping", slot_mapping, dtypes=INDEX_DTYPES, ndim=1, device=device)
    check_shape("slot_mapping", slot_mapping, (num_tokens,))
    if num_tokens and values_checkable(slot_mapping):
        hi = int(slot_mapping.max())
        if hi >= geo.num_blocks * geo.block_size:
            raise UltraQuantError(
                f"slot_mapping: slot {hi} is out of range for a cache of "
                f"{geo.num_blocks} blocks x {geo.block_size} tokens (negative entries mean skip)")
    return slot_mapping


def check_block_table(block_table: object, seq_lens: object, geo: CacheGeometry,
                      device: torch.device, batch: int | None = None, read_values: bool = False) -> None:
    """block_table (B, max_blocks) int32 and seq_lens (B,) int32, consistent with the cache
    (values too where :func:`values_checkable`, or with ``read_values``: a caller that syncs anyway)."""
    check_tensor("block_table", block_table, dtypes=(torch.int32,), ndim=2, device=device)
    check_tensor("seq_lens", seq_lens, dtypes=(torch.int32,), ndim=1, device=device)
    b = block_table.shape[0] if batch is None else batch
    check_shape("block_table", block_table, (b, None))
    check_shape("seq_lens", seq_lens, (b,))
    if b == 0 or not (read_values or values_checkable(block_table, seq_lens)):
        return
    capacity = block_table.shape[1] * geo.block_size
    lens = seq_lens.to("cpu", torch.int64)
    if int(lens.min()) < 0:
        raise UltraQuantError(f"seq_lens: negative length {int(lens.min())}")
    if int(lens.max()) > capacity:
        raise UltraQuantError(
            f"seq_lens: length {int(lens.max())} exceeds what block_table covers "
            f"({block_table.shape[1]} blocks x {geo.block_size} tokens = {capacity})")
    used_blocks = (lens + geo.block_size - 1) // geo.block_size
    cols = torch.arange(block_table.shape[1])
    used = cols[None, :] < used_blocks[:, None]
    ids = block_table.to("cpu")[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= geo.num_blocks):
        bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
        raise UltraQuantError(f"block_table: block id {bad} is out of range [0, {geo.num_blocks})")


def check_query_start_loc(query_start_loc: object, seq_lens: torch.Tensor, num_tokens: int,
                          device: torch.device) -> None:
    """query_start_loc (B+1,) int32: starts at 0, non-decreasing, ends at N, q_len <= seq_len."""
    check_tensor("query_start_loc", query_start_loc, dtypes=(torch.int32,), ndim=1, device=device)
    check_shape("query_start_loc", query_start_loc, (seq_lens.shape[0] + 1,))
    if not values_checkable(query_start_loc, seq_lens):
        return
    qsl = query_start_loc.to("cpu", torch.int64)
    q_lens = qsl[1:] - qsl[:-1]
    if int(qsl[0]) != 0 or int(qsl[-1]) != num_tokens or bool((q_lens < 0).any()):
        raise UltraQuantError(
            f"query_start_loc: expected 0 = q[0] <= ... <= q[B] = {num_tokens} (tokens), got {qsl.tolist()}")
    if bool((q_lens > seq_lens.to("cpu", torch.int64)).any()):
        raise UltraQuantError("query_start_loc: a request has more new tokens than its seq_len")


def check_attention_options(query_heads: int, device: torch.device, sinks: object,
                            sliding_window: object, softcap: object) -> None:
    """sinks (Hq,) float32 on the query's device; window a positive int; soft cap a positive float."""
    if sinks is not None:
        check_tensor("sinks", sinks, dtypes=(torch.float32,), ndim=1, device=device)
        check_shape("sinks", sinks, (query_heads,))
    if sliding_window is not None and (isinstance(sliding_window, bool)
                                       or not isinstance(sliding_window, int) or sliding_window <= 0):
        raise UltraQuantError(f"sliding_window: expected a positive int or None, got {sliding_window!r}")
    if softcap is not None and (not isinstance(softcap, (int, float)) or isinstance(softcap, bool)
                                or not softcap > 0 or softcap == float("inf")):
        raise UltraQuantError(f"softcap: expected a positive finite number or None, got {softcap!r}")


def check_out(out: object, shape: tuple[int, ...], device: torch.device) -> None:
    """An optional output buffer must have the result's shape, a float dtype and the device."""
    if out is None:
        return
    check_tensor("out", out, dtypes=FLOAT_DTYPES, ndim=len(shape), device=device)
    check_shape("out", out, shape)


def check_scale(scale: object) -> float:
    """The softmax scale: a finite positive number."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < float("inf"):
        raise UltraQuantError(f"scale: expected a positive finite number, got {scale!r}")
    return float(scale)


def check_encoder(encoder: object) -> str:
    """One of the encoders in ultraquant.format.ENCODERS."""
    from .format import ENCODERS

    if encoder not in ENCODERS:
        raise UltraQuantError(f"encoder: expected one of {ENCODERS}, got {encoder!r}")
    return encoder


def head_size_from_slot(slot_bytes: int) -> int:
    """The head size whose slot is exactly ``slot_bytes`` (``slot_bytes = 17 D / 16``)."""
    d = slot_bytes * 16 // 17
    if d * 17 != slot_bytes * 16:
        raise UltraQuantError(
            f"kv_cache: slot_bytes {slot_bytes} is not slot_size(D) of any head size D; pass head_size=")
    return check_head_size(d, "head_size (from kv_cache's slot_bytes)")


def check_store(key: object, value: object, kv_cache: object, slot_mapping: object,
                encoder: object) -> CacheGeometry:
    """All checks of store_kv: key/value (N, Hk, D) float, same shape/dtype/device as each other."""
    check_tensor("key", key, dtypes=FLOAT_DTYPES, ndim=3)
    check_tensor("value", value, dtypes=FLOAT_DTYPES, ndim=3, device=key.device)
    if value.shape != key.shape:
        raise UltraQuantError(f"value: expected key's shape {tuple(key.shape)}, got {tuple(value.shape)}")
    n, hk, d = key.shape
    geo = check_cache(kv_cache, d, hk)
    if kv_cache.device != key.device:
        raise UltraQuantError(f"kv_cache: expected a tensor on {key.device}, got one on {kv_cache.device}")
    check_slot_mapping(slot_mapping, n, geo, key.device)
    check_encoder(encoder)
    return geo


def check_decode(query: object, kv_cache: object, block_table: object, seq_lens: object,
                 scale: object, sinks: object, sliding_window: object, softcap: object,
                 out: object) -> CacheGeometry:
    """All checks of decode_attention: query (B, Hq, D), one new token per request."""
    check_tensor("query", query, dtypes=FLOAT_DTYPES, ndim=3)
    b, hq, d = query.shape
    geo = check_cache(kv_cache, d)
    dev = query.device
    if kv_cache.device != dev:
        raise UltraQuantError(f"kv_cache: expected a tensor on {dev}, got one on {kv_cache.device}")
    check_heads(hq, geo.num_kv_heads)
    check_block_table(block_table, seq_lens, geo, dev, batch=b)
    check_scale(scale)
    check_attention_options(hq, dev, sinks, sliding_window, softcap)
    check_out(out, (b, hq, d), dev)
    return geo


def check_prefill(query: object, key: object, value: object, kv_cache: object, block_table: object,
                  seq_lens: object, query_start_loc: object, scale: object, sinks: object,
                  sliding_window: object, softcap: object, out: object) -> CacheGeometry:
    """All checks of prefill_attention: varlen query (N, Hq, D) with raw key/value (N, Hk, D)."""
    check_tensor("query", query, dtypes=FLOAT_DTYPES, ndim=3)
    n, hq, d = query.shape
    dev = query.device
    check_tensor("key", key, dtypes=FLOAT_DTYPES, ndim=3, device=dev)
    check_tensor("value", value, dtypes=FLOAT_DTYPES, ndim=3, device=dev)
    if key.shape[0] != n or key.shape[2] != d or value.shape != key.shape:
        raise UltraQuantError(
            f"key/value: expected shape ({n}, Hk, {d}) each, got {tuple(key.shape)} and {tuple(value.shape)}")
    geo = check_cache(kv_cache, d, key.shape[1])
    if kv_cache.device != dev:
        raise UltraQuantError(f"kv_cache: expected a tensor on {dev}, got one on {kv_cache.device}")
    check_heads(hq, geo.num_kv_heads)
    check_block_table(block_table, seq_lens, geo, dev)
    check_query_start_loc(query_start_loc, seq_lens, n, dev)
    check_scale(scale)
    check_attention_options(hq, dev, sinks, sliding_window, softcap)
    check_out(out, (n, hq, d), dev)
    return geo


def check_spec_decode(query: object, kv_cache: object, block_table: object, seq_lens: object,
                      query_start_loc: object, max_query_len: object, scale: object, sinks: object,
                      sliding_window: object, softcap: object, out: object) -> CacheGeometry:
    """All checks of spec_decode_attention: varlen query (N, Hq, D), the new tokens' K/V in the cache,
    ``max_query_len`` a positive int bounding every request's new tokens (checked on values where
    they are checkable)."""
    check_tensor("query", query, dtypes=FLOAT_DTYPES, ndim=3)
    n, hq, d = query.shape
    dev = query.device
    geo = check_cache(kv_cache, d)
    if kv_cache.device != dev:
        raise UltraQuantError(f"kv_cache: expected a tensor on {dev}, got one on {kv_cache.device}")
    check_heads(hq, geo.num_kv_heads)
    check_block_table(block_table, seq_lens, geo, dev)
    check_query_start_loc(query_start_loc, seq_lens, n, dev)
    if isinstance(max_query_len, bool) or not isinstance(max_query_len, int) or max_query_len < 1:
        raise UltraQuantError(f"max_query_len: expected a positive int, got {max_query_len!r}")
    if values_checkable(query_start_loc):
        q_lens = query_start_loc.to("cpu", torch.int64).diff()
        if q_lens.numel() and int(q_lens.max()) > max_query_len:
            raise UltraQuantError(f"query_start_loc: a request has more than max_query_len={max_query_len} tokens")
    check_scale(scale)
    check_attention_options(hq, dev, sinks, sliding_window, softcap)
    check_out(out, (n, hq, d), dev)
    return geo


def check_dequant(kv_cache: object, block_table: object, seq_lens: object,
                  head_size: int | None, read_values: bool = False) -> CacheGeometry:
    """All checks of dequant_kv; the head size comes from the slot size unless given
    (``read_values``: see :func:`check_block_table`)."""
    check_tensor("kv_cache", kv_cache, dtypes=(torch.uint8,), ndim=4)
    d = head_size_from_slot(kv_cache.shape[3]) if head_size is None else head_size
    geo = check_cache(kv_cache, d)
    check_block_table(block_table, seq_lens, geo, kv_cache.device, read_values=read_values)
    return geo
