"""Dense attention routes for prefill: torch SDPA on raw or dequantized K/V (imports torch only).

Two of the attention layer's three prefill routes run here (the third, small continuation chunks,
is the Triton kernel behind :func:`ultraquant.ops.prefill_attention`):

* **first chunks** (no cached prefix): :func:`first_chunks` runs SDPA per request on the chunk's raw
  K/V, causal, GQA through ``enable_gqa`` (no copy of K/V without sinks or window);
* **large continuations**: :func:`continuation` dequantizes the request's cached prefix once with
  :func:`ultraquant.ops.dequant_kv_packed` (K in the original space, in the query dtype) into a
  :class:`DenseWorkspace` shared by all layers, appends the chunk's raw K/V, and runs SDPA with the
  causal mask aligned bottom-right (query i of the chunk sees the prefix and chunk[0..i]): flash
  attention reaches it without a mask through ``torch.nn.attention.bias.causal_lower_right``.

Why dense: a large chunk is compute bound and flash attention runs its matmuls at tensor-core rate
on bf16 K/V; dequantizing the prefix once costs one read of the cache, which a long chunk amortizes.
Small chunks stay on the kernel, which reads the 4-bit cache directly (``CONTINUATION_THRESHOLD``).

Features:

* **sinks** (one extra logit per query head in the softmax denominator): SDPA has none, so the sink
  is a real key. The head dimension is padded by :data:`SINK_COLUMNS` zero columns; an extra key
  row (first in the key list, so every query sees it under the causal mask) holds ``1, 1`` in the
  first two pad columns and zero values; each query head carries its sink logit divided by the scale
  as ``hi + lo`` (two numbers of the query dtype) in the same columns. The sink key's score is then
  ``scale * (hi + lo) = sink`` to about 2^-16 relative in bf16 (fp32 accumulation) and every other
  score is unchanged (its pad columns are zero). This is exact softmax algebra on any SDPA backend
  and device, with no per-head mask and no private op; the price is a D+8 head dimension (one copy
  of the query and the K/V of a first chunk) on sink layers only. An additive mask carrying the sink
  would differ per head, i.e. an Hq x Lq x Lk tensor; a log-sum-exp correction needs the backend
  ops that return it (device-specific private ops).
* **sliding window** w (a query at p sees p-w+1..p): a boolean mask, built per tile of queries over
  the keys that tile can see, so it stays (tile x (tile + w)) however long the prompt. When the
  window covers every key of the request it is no mask at all.
* **soft cap**: SDPA cannot apply ``c * tanh(s / c)`` to the scores, so soft-capped layers keep the
  kernel route for every chunk (:func:`supported`).

No N x N mask is built when ``is_causal`` or flash's bottom-right causal can serve the request (no
window): a mask is materialized only for a window, or, for bottom-right causal, when flash
attention is unavailable (CPU, float32), as one (Lq, Lk) boolean.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from . import ops
from .errors import UltraQuantError

__all__ = ["SHARED", "SINK_COLUMNS", "DenseWorkspace", "can_dequant", "continuation", "first_chunks", "supported"]

SINK_COLUMNS = 8
"""Zero columns appended to the head dimension on sink layers (two carry the sink; eight keep the
head size a multiple of 8, which the fused SDPA kernels need)."""

WINDOW_TILE_MIN, WINDOW_TILE_MAX = 256, 2048
"""Query tile bounds under a sliding window: a tile of ``clamp(w, min, max)`` queries sees at most
tile + w - 1 keys, so the mask is bounded and at most about half of each tile's scores are masked."""


def supported(softcap: float | None) -> bool:
    """Whether the dense routes can serve a layer: SDPA has no soft cap (``c * tanh(s / c)``)."""
    return softcap is None


def can_dequant(device: torch.device) -> bool:
    """Whether :func:`ultraquant.ops.dequant_kv_packed` runs on ``device``: it launches the Triton
    kernel, which runs CPU tensors only under Triton's interpreter (tests, CI)."""
    return device.type != "cpu" or os.environ.get("TRITON_INTERPRET") == "1"


class DenseWorkspace:
    """Grow-only K/V row buffers for the dense routes: one flat buffer per (device, dtype).

    Every layer of a model uses the same instance (:data:`SHARED`): layers run one after another on
    one stream, so one buffer as large as the longest prefix serves them all, instead of one per
    layer. Flat storage lets layers with different head shapes share it; callers therefore rewrite
    every element they read (pad columns included).
    """

    GRANULE = 1 << 20
    """Elements are allocated in multiples of this, so slowly growing prompts reallocate rarely."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self._offsets: dict[torch.device, torch.Tensor] = {}

    def rows(self, n: int, num_kv_heads: int, width: int, dtype: torch.dtype,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Uninitialized (n, Hk, width) K and V views in ``dtype`` on ``device``."""
        per = n * num_kv_heads * width
        key = (device, dtype)
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < 2 * per:
            self._bufs.pop(key, None)  # free the old buffer before allocating the new one
            buf = torch.empty(-(-2 * per // self.GRANULE) * self.GRANULE, dtype=dtype, device=device)
            self._bufs[key] = buf
        return buf[:per].view(n, num_kv_heads, width), buf[per:2 * per].view(n, num_kv_heads, width)

    def offsets(self, device: torch.device) -> torch.Tensor:
        """A (2,) int32 zero ``cu_seqlens`` for a one-request dequant (row 0 of its output view)."""
        if device not in self._offsets:
            self._offsets[device] = torch.zeros(2, dtype=torch.int32, device=device)
        return self._offsets[device]


SHARED = DenseWorkspace()
"""The workspace every :class:`ultraquant.attention.UltraQuantAttention` layer uses."""


def first_chunks(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, starts: Sequence[int],
                 out: torch.Tensor, scale: float, *, sinks: torch.Tensor | None = None,
                 sliding_window: int | None = None, workspace: DenseWorkspace | None = None) -> int:
    """First chunks (empty prefix) of a run of requests; returns the number of requests served.

    Request i's tokens are rows ``starts[i]:starts[i+1]`` of ``query`` (N, Hq, D), ``key``/``value``
    (N, Hk, D) and ``out`` (N, Hq, D, any float dtype, written row for row); ``starts`` are host
    ints. ``sinks``: (Hq,) float logits on the query's device. ``workspace`` is needed with sinks.
    """
    served = 0
    for a, b in zip(starts[:-1], starts[1:], strict=True):
        if b <= a:
            continue
        keys, values, off = _key_rows(key[a:b], value[a:b], 0, None, query.dtype, sinks, workspace)
        _attend(query[a:b], keys, values, off, out[a:b], scale, sinks, sliding_window, q_pos0=0, k_pos0=0)
        served += 1
    return served


def continuation(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 block_table: torch.Tensor, seq_len: torch.Tensor, prefix: int, out: torch.Tensor,
                 scale: float, *, sinks: torch.Tensor | None = None, sliding_window: int | None = None,
                 workspace: DenseWorkspace) -> None:
    """One request's continuation chunk of n = ``query.shape[0]`` tokens over its cached prefix.

    ``block_table`` (1, W) int32 and ``seq_len`` (1,) int32 (= prefix + n) are the request's rows of
    the batch metadata on the device; ``prefix`` is the same length on the host. Only the blocks a
    query can see are read (with a window, blocks wholly before it may be a shared null block);
    no host sync: the dequant length is computed on the device.
    """
    n = query.shape[0]
    bs = kv_cache.shape[1]
    start = 0 if sliding_window is None else max(0, prefix - sliding_window + 1)
    first_block = start // bs
    k_pos0 = first_block * bs

    def fill(k_out: torch.Tensor, v_out: torch.Tensor) -> None:
        lens = torch.sub(seq_len, n + k_pos0)  # prefix rows from the first visible block on
        ops.dequant_kv_packed(kv_cache, block_table[:, first_block:], lens, workspace.offsets(query.device),
                              k_out, v_out, original_space=True)

    keys, values, off = _key_rows(key, value, prefix - k_pos0, fill, query.dtype, sinks, workspace)
    _attend(query, keys, values, off, out, scale, sinks, sliding_window, q_pos0=prefix, k_pos0=k_pos0)


def _key_rows(k_new: torch.Tensor, v_new: torch.Tensor, prefix_rows: int, fill_prefix, dtype: torch.dtype,
              sinks: torch.Tensor | None, workspace: DenseWorkspace | None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """K and V rows ``[sink key] + prefix + chunk`` in ``dtype`` and the number of sink rows (0/1).

    Without sinks and prefix these are the chunk's own tensors (no copy); otherwise rows of the
    workspace, the prefix written by ``fill_prefix(k_rows, v_rows)``.
    """
    n, hk, d = k_new.shape
    if sinks is None and prefix_rows == 0:
        return k_new.to(dtype), v_new.to(dtype), 0
    if workspace is None:
        raise UltraQuantError("workspace: needed for sinks or a cached prefix")
    off = int(sinks is not None)
    width = d + SINK_COLUMNS if off else d
    keys, values = workspace.rows(off + prefix_rows + n, hk, width, dtype, k_new.device)
    if off:
        keys[:, :, d:].zero_()  # pad columns: zero (scores unchanged) except the sink key's two ones
        values[:, :, d:].zero_()
        keys[0, :, :d].zero_()
        keys[0, :, d:d + 2] = 1
        values[0, :, :d].zero_()
    if prefix_rows:
        fill_prefix(keys[off:off + prefix_rows, :, :d], values[off:off + prefix_rows, :, :d])
    keys[off + prefix_rows:, :, :d].copy_(k_new)
    values[off + prefix_rows:, :, :d].copy_(v_new)
    return keys, values, off


def _sink_query(q: torch.Tensor, sinks: torch.Tensor, scale: float, width: int) -> torch.Tensor:
    """The query padded to ``width`` with each head's ``sink / scale`` as hi + lo in two pad columns."""
    n, hq, d = q.shape
    padded = q.new_zeros(n, hq, width)
    padded[..., :d] = q
    target = sinks.to(torch.float32) / scale
    hi = target.to(q.dtype)
    padded[..., d] = hi
    padded[..., d + 1] = (target - hi.to(torch.float32)).to(q.dtype)
    return padded


def _heads_first(t: torch.Tensor) -> torch.Tensor:
    """(L, H, E) rows -> the (1, H, L, E) view SDPA takes."""
    return t.transpose(0, 1).unsqueeze(0)


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, off: int, out: torch.Tensor, scale: float,
            sinks: torch.Tensor | None, window: int | None, *, q_pos0: int, k_pos0: int) -> None:
    """SDPA of queries at positions q_pos0.. over key rows (``off`` sink rows, then positions k_pos0..).

    The last query and the last key share a position (bottom-right aligned causal mask).
    """
    n, _, d = q.shape
    if sinks is not None:
        q = _sink_query(q, sinks, scale, keys.shape[-1])
    q4, k4, v4 = _heads_first(q), _heads_first(keys), _heads_first(values)
    last = q_pos0 + n - 1
    if window is None or last - window < k_pos0:  # every query sees every key before it
        out.copy_(_causal(q4, k4, v4, scale)[0, :, :, :d].transpose(0, 1))
        return
    tile = min(max(window, WINDOW_TILE_MIN), WINDOW_TILE_MAX)
    for i0 in range(0, n, tile):
        i1 = min(n, i0 + tile)
        lo = max(0, q_pos0 + i0 - window + 1 - k_pos0)
        hi = q_pos0 + i1 - k_pos0
        q_pos = torch.arange(q_pos0 + i0, q_pos0 + i1, device=q.device)[:, None]
        k_pos = torch.arange(k_pos0 + lo, k_pos0 + hi, device=q.device)[None, :]
        mask = (k_pos <= q_pos) & (k_pos > q_pos - window)
        kt, vt = k4[:, :, off + lo:off + hi], v4[:, :, off + lo:off + hi]
        if off:
            kt = torch.cat([k4[:, :, :off], kt], dim=2)
            vt = torch.cat([v4[:, :, :off], vt], dim=2)
            mask = torch.cat([mask.new_ones(i1 - i0, off), mask], dim=1)
        res = F.scaled_dot_product_attention(q4[:, :, i0:i1], kt, vt, attn_mask=mask, scale=scale, enable_gqa=True)
        out[i0:i1].copy_(res[0, :, :, :d].transpose(0, 1))


def _causal(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal SDPA aligned bottom-right (query i sees keys up to i + Lk - Lq), no mask when possible.

    Equal lengths: ``is_causal``. Otherwise flash attention's own causal mode, which is bottom-right
    (``causal_lower_right``), when flash can run these tensors; else one (Lq, Lk) boolean mask.
    """
    nq, nk = q4.shape[2], k4.shape[2]
    if nq == nk:
        return F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale, enable_gqa=True)
    if q4.device.type == "cuda":
        from torch.backends.cuda import SDPAParams, can_use_flash_attention
        from torch.nn.attention.bias import causal_lower_right

        if can_use_flash_attention(SDPAParams(q4, k4, v4, None, 0.0, False, True)):
            return F.scaled_dot_product_attention(q4, k4, v4, attn_mask=causal_lower_right(nq, nk), scale=scale,
                                                  enable_gqa=True)
    mask = torch.ones(nq, nk, dtype=torch.bool, device=q4.device).tril(nk - nq)
    return F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=scale, enable_gqa=True)
