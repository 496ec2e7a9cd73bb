"""Dense prefill routes: torch SDPA on a first chunk's raw K/V, or on a large continuation's
dequantized prefix plus its raw chunk (flash attention's bottom-right causal mode, no mask).

A long chunk is compute bound, so one dequant pass over the 4-bit prefix is amortized by tensor-core
matmuls; small chunks stay on the kernel (``CONTINUATION_THRESHOLD``). Nothing is allocated once the
workspace is warm; sinks ride as an extra key row in padded head columns (exact softmax algebra),
windows use slices of one cached mask band, soft-capped layers stay on the kernel. The design and its
reasons: docs/prefill.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import config, ops
from .errors import UltraQuantError

__all__ = ["DEFAULT_WORKSPACE_MB", "SHARED", "SINK_COLUMNS", "DenseWorkspace", "SinkRows", "continuation",
           "first_chunks", "first_visible", "supported", "workspace_elements"]

SINK_COLUMNS = 8
"""Zero columns appended to the head dimension on sink layers (two carry the sink; eight keep the
head size a multiple of 8, which the fused SDPA kernels need)."""

WINDOW_TILE_MIN, WINDOW_TILE_MAX = 256, 2048
"""Query tile bounds under a sliding window: a tile of ``clamp(w, min, max)`` queries sees at most
tile + w - 1 keys, so the mask is bounded and at most about half of each tile's scores are masked."""

DEFAULT_WORKSPACE_MB = 256
"""Cap of the shared workspace in MiB unless ``ULTRAQUANT_DENSE_WORKSPACE_MB`` says otherwise (read
when a :class:`DenseWorkspace` is made). 256 MiB hold 64k rows of prefix + chunk at Hk=8, D=128 in
bf16; longer requests run on the kernel route."""


def supported(softcap: float | None) -> bool:
    """Whether the dense routes can serve a layer: SDPA has no soft cap (``c * tanh(s / c)``)."""
    return softcap is None


def first_visible(prefix: int, block_size: int, sliding_window: int | None) -> int:
    """Position of the first cached key a continuation dequantizes: 0, or under a window the start of
    the block holding the first key the chunk's first query sees (earlier blocks may be null)."""
    start = 0 if sliding_window is None else max(0, prefix - sliding_window + 1)
    return start // block_size * block_size


def workspace_elements(num_queries: int, key_rows: int, num_heads: int, num_kv_heads: int, head_size: int,
                       sinks: bool) -> int:
    """Workspace elements one dense call takes: K and V rows (``key_rows`` = dequantized prefix +
    chunk, plus the sink row) and, with sinks, the padded query. A first chunk without sinks takes
    none (SDPA reads the raw tensors)."""
    if not sinks and key_rows == num_queries:
        return 0
    width = head_size + SINK_COLUMNS if sinks else head_size
    query = num_queries * num_heads * width if sinks else 0
    return 2 * (key_rows + int(sinks)) * num_kv_heads * width + query


@dataclass(frozen=True)
class SinkRows:
    """A sink layer's constants for the dense routes, built once per (layer, dtype, device).

    ``key_value`` (2, Hk, D + SINK_COLUMNS): the sink key row (zero head, 1 in the two carrying
    columns) and its zero value row; ``query_pad`` (Hq, SINK_COLUMNS): each head's ``sink / scale``
    as hi + lo of the query dtype, then zeros (the query's pad columns).
    """

    key_value: torch.Tensor
    query_pad: torch.Tensor

    @classmethod
    def build(cls, sinks: torch.Tensor, scale: float, num_kv_heads: int, head_size: int,
              dtype: torch.dtype) -> SinkRows:
        """Constants for ``sinks`` ((Hq,) logits) at ``scale`` in ``dtype``, on the sinks' device."""
        kv = torch.zeros(2, num_kv_heads, head_size + SINK_COLUMNS, dtype=dtype, device=sinks.device)
        kv[0, :, head_size:head_size + 2] = 1
        pad = torch.zeros(sinks.shape[0], SINK_COLUMNS, dtype=dtype, device=sinks.device)
        target = sinks.to(torch.float32) / scale
        hi = target.to(dtype)
        pad[:, 0] = hi
        pad[:, 1] = (target - hi.to(torch.float32)).to(dtype)
        return cls(kv, pad)


class DenseWorkspace:
    """Grow-only, capped scratch for the dense routes: one flat buffer per (device, dtype).

    Every layer of a model uses the same instance (:data:`SHARED`): layers run one after another on
    one stream, so one buffer as large as the longest request serves them all, instead of one per
    layer. Flat storage lets layers with different head shapes share it; callers therefore rewrite
    every element they read (pad columns included).

    ``cap_bytes`` bounds each buffer (default: ``ULTRAQUANT_DENSE_WORKSPACE_MB`` or
    :data:`DEFAULT_WORKSPACE_MB`); :meth:`take` refuses more, so callers check :meth:`fits` first.
    """

    GRANULE = 1 << 20
    """Elements are allocated in multiples of this (up to the cap), so slowly growing prompts
    reallocate rarely."""

    def __init__(self, cap_bytes: int | None = None) -> None:
        if cap_bytes is None:
            mb = config.get().dense_workspace_mb
            cap_bytes = int((DEFAULT_WORKSPACE_MB if mb is None else mb) * (1 << 20))
        if cap_bytes < 0:
            raise UltraQuantError(f"cap_bytes: expected >= 0, got {cap_bytes}")
        self.cap_bytes = cap_bytes
        self._bufs: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self._lens: dict[torch.device, torch.Tensor] = {}
        self._band: dict[torch.device, tuple[tuple, torch.Tensor]] = {}

    def fits(self, elements: int, dtype: torch.dtype) -> bool:
        """Whether a call taking ``elements`` of ``dtype`` stays within the cap."""
        return elements * dtype.itemsize <= self.cap_bytes

    def take(self, elements: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The first ``elements`` of the buffer as a flat, uninitialized tensor (grown if needed)."""
        if not self.fits(elements, dtype):
            raise UltraQuantError(f"dense workspace: {elements * dtype.itemsize} bytes exceed the cap of "
                                  f"{self.cap_bytes} (ULTRAQUANT_DENSE_WORKSPACE_MB); route this call to the kernel")
        buf = self._bufs.get((device, dtype))
        if buf is None or buf.numel() < elements:
            self._grow(elements, dtype, device)
            buf = self._bufs[(device, dtype)]
        return buf[:elements]

    def reserve(self, elements: int, dtype: torch.dtype, device: torch.device | str) -> int:
        """Allocate now (e.g. before a serving engine measures free memory) room for ``elements`` of
        ``dtype``, clipped to the cap; returns the bytes the buffer holds."""
        device = torch.device(device)
        elements = min(elements, self.cap_bytes // dtype.itemsize)
        buf = self._bufs.get((device, dtype))
        if elements > 0 and (buf is None or buf.numel() < elements):
            self._grow(elements, dtype, device)
        buf = self._bufs.get((device, dtype))
        return 0 if buf is None else buf.numel() * buf.element_size()

    def _grow(self, elements: int, dtype: torch.dtype, device: torch.device) -> None:
        """Replace the (device, dtype) buffer by one of at least ``elements`` (granule-rounded, capped)."""
        size = min(-(-elements // self.GRANULE) * self.GRANULE, self.cap_bytes // dtype.itemsize)
        self._bufs.pop((device, dtype), None)  # free the old buffer before allocating the new one
        self._bufs[(device, dtype)] = torch.empty(max(size, elements), dtype=dtype, device=device)

    def lengths(self, device: torch.device) -> torch.Tensor:
        """A (3,) int32 buffer: ``[:2]`` stays zero (the ``cu_seqlens`` of a one-request dequant into
        row 0 of its output view), ``[2:]`` receives the dequant length on the device."""
        buf = self._lens.get(device)
        if buf is None:
            buf = self._lens[device] = torch.zeros(3, dtype=torch.int32, device=device)
        return buf

    def band(self, tile: int, window: int, sink: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The (tile, sink + tile + window - 1) additive mask (0 / -inf in ``dtype``: SDPA would convert
        a boolean one on every call) of a query tile whose keys start window - 1 positions before its
        first query: ``sink`` leading visible columns, then query i sees keys i..i + window - 1. The
        latest one per device is kept (layers alternate few windows)."""
        key = (tile, window, sink, dtype)
        hit = self._band.get(device)
        if hit is None or hit[0] != key:
            visible = _band(tile, window, sink, device)
            mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
            hit = self._band[device] = (key, mask)
        return hit[1]


def _window_visible(rows: int, keys: int, last0: int, window: int, sink: int, device: torch.device) -> torch.Tensor:
    """(rows, sink + keys) boolean window mask (True: visible): ``sink`` leading columns every query
    sees, then key j (0-based after them) is visible to query i when ``last0 + i - window < j <=
    last0 + i`` (``last0``: the last key query 0 sees)."""
    last = last0 + torch.arange(rows, device=device)[:, None]
    j = torch.arange(-sink, keys, device=device)[None, :]
    return (j < 0) | ((j <= last) & (j > last - window))


def _band(tile: int, window: int, sink: int, device: torch.device) -> torch.Tensor:
    """The boolean form of :meth:`DenseWorkspace.band` (True: visible)."""
    return _window_visible(tile, tile + window - 1, window - 1, window, sink, device)


SHARED = DenseWorkspace()
"""The workspace every :class:`ultraquant.attention.UltraQuantAttention` layer uses."""


def first_chunks(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, starts: Sequence[int],
                 out: torch.Tensor, scale: float, *, sinks: torch.Tensor | SinkRows | None = None,
                 sliding_window: int | None = None, workspace: DenseWorkspace | None = None) -> int:
    """First chunks (empty prefix) of a run of requests; returns the number of requests served.

    Request i's tokens are rows ``starts[i]:starts[i+1]`` of ``query`` (N, Hq, D), ``key``/``value``
    (N, Hk, D) and ``out`` (N, Hq, D, any float dtype, written row for row); ``starts`` are host
    ints. ``sinks``: (Hq,) float logits on the query's device, or their :class:`SinkRows` (built once
    per layer: cheaper). ``workspace`` is needed with sinks.
    """
    rows = _sink_rows(sinks, scale, key.shape[1], key.shape[2], query.dtype)
    served = 0
    for a, b in zip(starts[:-1], starts[1:], strict=True):
        if b <= a:
            continue
        q, keys, values, off = _operands(query[a:b], key[a:b], value[a:b], 0, None, rows, workspace)
        _attend(q, keys, values, off, out[a:b], scale, rows, sliding_window, workspace, q_pos0=0, k_pos0=0)
        served += 1
    return served


def continuation(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 block_table: torch.Tensor, seq_len: torch.Tensor, prefix: int, out: torch.Tensor,
                 scale: float, *, sinks: torch.Tensor | SinkRows | None = None, sliding_window: int | None = None,
                 workspace: DenseWorkspace) -> None:
    """One request's continuation chunk of n = ``query.shape[0]`` tokens over its cached prefix.

    ``block_table`` (1, W) int32 and ``seq_len`` (1,) int32 (= prefix + n) are the request's rows of
    the batch metadata on the device; ``prefix`` is the same length on the host. Only the blocks a
    query can see are read (with a window, blocks wholly before it may be a shared null block);
    no host sync: the dequant length is computed on the device.
    """
    n = query.shape[0]
    bs = kv_cache.shape[1]
    k_pos0 = first_visible(prefix, bs, sliding_window)
    rows = _sink_rows(sinks, scale, key.shape[1], key.shape[2], query.dtype)

    def fill(k_out: torch.Tensor, v_out: torch.Tensor) -> None:
        lens = workspace.lengths(query.device)
        torch.sub(seq_len, n + k_pos0, out=lens[2:])  # prefix rows from the first visible block on
        ops.dequant_kv_packed(kv_cache, block_table[:, k_pos0 // bs:], lens[2:], lens[:2], k_out, v_out,
                              original_space=True)

    q, keys, values, off = _operands(query, key, value, prefix - k_pos0, fill, rows, workspace)
    _attend(q, keys, values, off, out, scale, rows, sliding_window, workspace, q_pos0=prefix, k_pos0=k_pos0)


def _sink_rows(sinks: torch.Tensor | SinkRows | None, scale: float, num_kv_heads: int, head_size: int,
               dtype: torch.dtype) -> SinkRows | None:
    """``sinks`` as :class:`SinkRows` (built here when the caller passed the raw logits)."""
    if sinks is None or isinstance(sinks, SinkRows):
        return sinks
    return SinkRows.build(sinks, scale, num_kv_heads, head_size, dtype)


def _operands(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, prefix_rows: int, fill_prefix,
              sinks: SinkRows | None, workspace: DenseWorkspace | None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Query, K and V rows ``[sink key] + prefix + chunk`` in the query dtype, and the sink rows (0/1).

    Without sinks and prefix these are the call's own tensors (no copy); otherwise views of the
    workspace: K and V as one (2, rows, Hk, width) block (pad columns zeroed in one op, the sink row
    written in one), the prefix filled by ``fill_prefix(k_rows, v_rows)``, then the chunk's rows;
    with sinks the query padded with the sink columns.
    """
    n, hk, d = k_new.shape
    dtype = q.dtype
    if sinks is None and prefix_rows == 0:
        return q, k_new.to(dtype), v_new.to(dtype), 0
    if workspace is None:
        raise UltraQuantError("workspace: needed for sinks or a cached prefix")
    off = int(sinks is not None)
    width = d + SINK_COLUMNS if off else d
    rows = off + prefix_rows + n
    hq = q.shape[1]
    flat = workspace.take(workspace_elements(n, prefix_rows + n, hq, hk, d, bool(off)), dtype, q.device)
    kv = flat[:2 * rows * hk * width].view(2, rows, hk, width)
    if sinks is not None:
        kv[:, :, :, d:].zero_()  # pad columns of every row: zero (scores unchanged) ...
        kv[:, 0].copy_(sinks.key_value)  # ... except the sink key's two ones (row 0, full width)
        padded = flat[2 * rows * hk * width:].view(n, hq, width)
        padded[..., :d].copy_(q)
        padded[..., d:].copy_(sinks.query_pad)
        q = padded
    if prefix_rows:
        fill_prefix(kv[0, off:off + prefix_rows, :, :d], kv[1, off:off + prefix_rows, :, :d])
    kv[0, off + prefix_rows:, :, :d].copy_(k_new)
    kv[1, off + prefix_rows:, :, :d].copy_(v_new)
    return q, kv[0], kv[1], off


def _heads_first(t: torch.Tensor) -> torch.Tensor:
    """(L, H, E) rows -> the (1, H, L, E) view SDPA takes."""
    return t.transpose(0, 1).unsqueeze(0)


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, off: int, out: torch.Tensor, scale: float,
            sinks: SinkRows | None, window: int | None, workspace: DenseWorkspace | None, *, q_pos0: int,
            k_pos0: int) -> None:
    """SDPA of queries at positions q_pos0.. over key rows (``off`` sink rows, then positions k_pos0..).

    The last query and the last key share a position (bottom-right aligned causal mask). ``q`` is
    already padded on sink layers; ``out`` receives its first D columns.
    """
    n, _, d = out.shape
    q4 = _heads_first(q)
    last = q_pos0 + n - 1
    if window is None or last - window < k_pos0:  # every query sees every key before it
        res = _causal(q4, _heads_first(keys), _heads_first(values), scale)
        out.copy_(res[0, :, :, :d].transpose(0, 1))
        return
    tile = min(max(window, WINDOW_TILE_MIN), WINDOW_TILE_MAX)
    band = workspace.band(tile, window, off, q.dtype, q.device) if workspace else _band(tile, window, off, q.device)
    for i0 in range(0, n, tile):
        i1 = min(n, i0 + tile)
        first = q_pos0 + i0 - window + 1 - k_pos0  # first visible key row (before clipping at 0)
        lo, hi = max(0, first), q_pos0 + i1 - k_pos0
        if lo == first:  # not clipped: the common band
            mask = band[:i1 - i0, :off + hi - lo]
        else:  # the tile's keys start at the sequence start (lo = 0): query i0 + r sees keys up to its position
            mask = _window_visible(i1 - i0, hi - lo, i0 + q_pos0 - k_pos0, window, off, q.device)
        if off and lo:  # the sink key goes into row lo (key lo - 1: no later tile sees it)
            keys[lo].copy_(sinks.key_value[0])
            values[lo].copy_(sinks.key_value[1])
        kt, vt = _heads_first(keys[lo:off + hi]), _heads_first(values[lo:off + hi])  # [sink] + keys lo..hi-1
        res = F.scaled_dot_product_attention(q4[:, :, i0:i1], kt, vt, attn_mask=mask, scale=scale, enable_gqa=True)
        out[i0:i1].copy_(res[0, :, :, :d].transpose(0, 1))


def _causal(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal SDPA aligned bottom-right (query i sees keys up to i + Lk - Lq), no mask when possible.

    Equal lengths: ``is_causal``. Otherwise flash attention's own causal mode, which is bottom-right,
    when flash can run these tensors (the op ``torch.nn.attention.bias.causal_lower_right`` dispatches
    to, called directly: the bias subclass costs host time in Python for the same launch); else one
    (Lq, Lk) boolean mask (CPU, float32).
    """
    nq, nk = q4.shape[2], k4.shape[2]
    if nq == nk:
        return F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale, enable_gqa=True)
    if q4.device.type == "cuda" and _flash_ok(q4, k4, v4):
        return torch.ops.aten._scaled_dot_product_flash_attention(q4, k4, v4, 0.0, is_causal=True, scale=scale)[0]
    mask = torch.ones(nq, nk, dtype=torch.bool, device=q4.device).tril(nk - nq)
    return F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=scale, enable_gqa=True)


def _flash_ok(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor) -> bool:
    """Whether flash attention runs these (1, H, L, E) tensors with GQA (dtype, head size, device)."""
    from torch.backends.cuda import SDPAParams, can_use_flash_attention

    return can_use_flash_attention(SDPAParams(q4, k4, v4, None, 0.0, False, True))
