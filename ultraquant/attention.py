"""A framework-neutral UltraQuant attention layer: one object per attention layer of a model.

:class:`UltraQuantAttention` holds the head configuration (Hq, Hk, D, softmax scale, sinks, sliding
window, soft cap), its small device workspace, and orchestrates the public ops for one mixed batch
the way a paged serving engine (vLLM) hands it over:

1. **store**: the new tokens' K/V go into the paged cache (:func:`ultraquant.store_kv`), through
   ``slot_mapping`` (negative = padding, skipped);
2. **decode**: the first ``num_decodes`` requests have one new token each; one
   :func:`ultraquant.decode_attention` call serves them all, writing into the caller's ``out``.
   Under speculative decoding (``metadata.decode_query_len`` > 1) they have 1..``decode_query_len``
   new tokens each (counts read on the device from ``query_start_loc``) and one
   :func:`ultraquant.spec_decode_attention` call (the multi-query decode; their K/V were stored
   first) serves them, or, where no multi-query kernel serves the layer, one
   :func:`ultraquant.prefill_attention` call on their raw K/V;
3. **prefill**: the remaining requests, each a chunk of new tokens at the end of its sequence, are
   split on the host, from the metadata's CPU copies (never from device tensors), into runs of one
   kind, each served by the route that suits it: *first chunks* (empty prefix) by torch SDPA on
   their raw K/V (:func:`ultraquant.dense.first_chunks`); *small continuations* (prefix in the cache,
   at most ``continuation_threshold`` new tokens) by :func:`ultraquant.spec_decode_attention` (the
   multi-query decode, reading the chunk's own K/V from the cache like a decode) where
   :func:`ultraquant.ops.spec_decode_takes_kernel` holds, else by :func:`ultraquant.prefill_attention`,
   the kernel's decode-shaped multi-query path that reads the 4-bit cache directly; *large
   continuations* (one request per run) by dequantizing the prefix once and running SDPA
   (:func:`ultraquant.dense.continuation`). Soft-capped layers (SDPA has no soft cap) and batches
   without host copies send every run to the kernel.

Why: the decode path is what a CUDA graph captures, so it only slices views, launches the ops and
writes into ``out`` (no allocation, ``.item()``, ``.tolist()`` or host sync). The prefill path may
read host metadata because serving engines run prefills eagerly, and splitting it into homogeneous
runs lets each op call take one kernel path without inspecting device values.

:class:`AttentionMetadata` mirrors what vLLM passes per batch (seq_lens, query_start_loc,
block_table, slot_mapping, max lengths, decode count, CPU copies); :meth:`AttentionMetadata.build`
makes one from host lists, which is what tests and simple engines need.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import dense, ops
from .errors import UltraQuantError
from .format import SERVING_ENCODER, check_head_size
from .kernels import heuristics
from .validate import check_attention_options, check_encoder, check_heads, check_scale, check_tensor

__all__ = [
    "AttentionMetadata",
    "UltraQuantAttention",
    "continuation_threshold",
]

def continuation_threshold() -> int:
    """The small/large continuation-chunk boundary: :data:`ultraquant.kernels.heuristics.CONTINUATION_THRESHOLD`
    (its one home, measured on the H200), read at call time."""
    return heuristics.CONTINUATION_THRESHOLD


@dataclass
class AttentionMetadata:
    """One batch's paging and length metadata, laid out as vLLM's ``CommonAttentionMetadata``.

    Requests ``0..num_decodes-1`` are decodes (one new token each, tokens ``0..num_decodes-1``); the
    rest are prefill chunks. ``seq_lens`` counts the new tokens too. The ``*_cpu`` copies are
    optional host tensors with the same values; the prefill path needs them to plan its runs
    without a device sync (without them it serves all prefills in one op call).
    """

    seq_lens: torch.Tensor
    """(B,) int32 on the device: total length of each request including its new tokens."""
    query_start_loc: torch.Tensor
    """(B+1,) int32 on the device: request i's new tokens are ``[qsl[i], qsl[i+1])``."""
    block_table: torch.Tensor
    """(B, max_blocks) int32 on the device: cache block ids of each request."""
    slot_mapping: torch.Tensor
    """(>= num_actual_tokens,) int32/int64: cache slot of each new token, negative = skip."""
    num_actual_tokens: int
    """Tokens of real requests (the query may be padded beyond this for a CUDA graph)."""
    num_decodes: int
    """Leading decode requests: one new token each (1..``decode_query_len`` under speculative decoding)."""
    max_query_len: int
    """Longest chunk in the batch (host int, an upper bound is fine)."""
    max_seq_len: int
    """Longest sequence in the batch (host int, an upper bound is fine)."""
    query_start_loc_cpu: torch.Tensor | None = None
    """Host copy of ``query_start_loc`` (exact)."""
    seq_lens_cpu: torch.Tensor | None = None
    """Host copy of ``seq_lens``; it must be exact for the prefill rows (decode rows are not read)."""
    decode_query_len: int = 1
    """Most new tokens of a decode request: 1, or 1 + the drafted tokens of a speculative-decoding step
    (the bound a CUDA graph is captured with; each request's own count comes from ``query_start_loc``)."""
    decode_tokens: int | None = None
    """Tokens of the decode requests (``query_start_loc[num_decodes]``, a host int); None: one each."""

    @property
    def num_reqs(self) -> int:
        """Requests in the batch (rows of ``seq_lens``)."""
        return int(self.seq_lens.shape[0])

    @property
    def num_decode_tokens(self) -> int:
        """Tokens of the decode requests (one each unless ``decode_tokens`` says otherwise)."""
        return self.num_decodes if self.decode_tokens is None else int(self.decode_tokens)

    @classmethod
    def build(cls, *, query_lens: Sequence[int], seq_lens: Sequence[int],
              block_table: Sequence[Sequence[int]] | torch.Tensor, slot_mapping: Sequence[int] | torch.Tensor,
              device: torch.device | str = "cpu", num_padding_tokens: int = 0,
              decode_query_len: int = 1) -> AttentionMetadata:
        """Metadata from host lists, decodes first, as a scheduler would make it.

        ``block_table`` rows are padded with zeros to the longest row. ``num_padding_tokens`` extra
        slot_mapping entries of -1 are appended (tokens a CUDA graph pads the batch with).
        ``decode_query_len`` > 1 (speculative decoding): leading requests of 1..``decode_query_len``
        new tokens are the decodes.
        """
        q = [int(x) for x in query_lens]
        s = [int(x) for x in seq_lens]
        if len(q) != len(s):
            raise UltraQuantError(f"query_lens: {len(q)} entries but seq_lens has {len(s)}")
        if any(a < 0 or a > b for a, b in zip(q, s, strict=True)):
            raise UltraQuantError("query_lens: each must be in [0, seq_len]")
        if isinstance(decode_query_len, bool) or not isinstance(decode_query_len, int) or decode_query_len < 1:
            raise UltraQuantError(f"decode_query_len: expected a positive int, got {decode_query_len!r}")
        num_decodes = 0
        while num_decodes < len(q) and 1 <= q[num_decodes] <= decode_query_len:
            num_decodes += 1
        qsl = [0]
        for x in q:
            qsl.append(qsl[-1] + x)
        if isinstance(block_table, torch.Tensor):
            bt = block_table.to(device=device, dtype=torch.int32)
        else:
            width = max([len(r) for r in block_table] + [1])
            bt = torch.zeros(len(s), width, dtype=torch.int32)
            for i, row in enumerate(block_table):
                bt[i, : len(row)] = torch.tensor(list(row), dtype=torch.int32)
            bt = bt.to(device)
        sm = torch.as_tensor(slot_mapping, dtype=torch.int64).reshape(-1)
        if sm.numel() != qsl[-1]:
            raise UltraQuantError(f"slot_mapping: expected {qsl[-1]} entries, got {sm.numel()}")
        if num_padding_tokens:
            sm = torch.cat([sm, torch.full((num_padding_tokens,), -1, dtype=torch.int64)])
        qsl_cpu = torch.tensor(qsl, dtype=torch.int32)
        seq_cpu = torch.tensor(s, dtype=torch.int32)
        return cls(
            seq_lens=seq_cpu.to(device), query_start_loc=qsl_cpu.to(device), block_table=bt,
            slot_mapping=sm.to(device), num_actual_tokens=qsl[-1], num_decodes=num_decodes,
            max_query_len=max(q, default=0), max_seq_len=max(s, default=0),
            query_start_loc_cpu=qsl_cpu, seq_lens_cpu=seq_cpu, decode_query_len=decode_query_len,
            decode_tokens=None if decode_query_len == 1 else qsl[num_decodes])


@dataclass(frozen=True)
class PrefillRun:
    """A run of consecutive prefill requests served by one op call (host-side plan)."""

    kind: str
    """``"first"``, ``"small"`` (continuation, <= threshold new tokens) or ``"large"``."""
    req_start: int
    req_end: int
    tok_start: int
    tok_end: int


def prefill_runs(query_start_loc_cpu: torch.Tensor, seq_lens_cpu: torch.Tensor, first_req: int,
                 threshold: int) -> list[PrefillRun]:
    """Split requests ``first_req..B-1`` into runs of one kind, in batch order (host tensors only).

    A large continuation is always a run of its own (its prefix is dequantized once for it alone).
    Requests without new tokens are skipped.
    """
    qsl = query_start_loc_cpu.tolist()
    lens = seq_lens_cpu.tolist()
    runs: list[PrefillRun] = []
    for i in range(first_req, len(lens)):
        a, b = qsl[i], qsl[i + 1]
        n = b - a
        if n <= 0:
            continue
        if lens[i] == n:
            kind = "first"
        elif n <= threshold:
            kind = "small"
        else:
            kind = "large"
        last = runs[-1] if runs else None
        if last is not None and last.kind == kind and kind != "large" and last.req_end == i:
            runs[-1] = PrefillRun(kind, last.req_start, i + 1, last.tok_start, b)
        else:
            runs.append(PrefillRun(kind, i, i + 1, a, b))
    return runs


class UltraQuantAttention:
    """One attention layer over an UltraQuant paged KV cache (framework-neutral).

    Args:
        num_heads: query heads Hq.
        num_kv_heads: kv heads Hk (Hq must be a multiple: GQA).
        head_size: D, a power of two multiple of 32.
        scale: softmax scale applied to q.k.
        sinks: optional (Hq,) per-head sink logits (any float dtype, any device; kept as float32 on
            the query's device after the first call).
        sliding_window: optional window w (a query at position p sees keys p-w+1..p).
        softcap: optional logit soft cap c (c * tanh(s / c)).
        encoder: scale/tie rule for the store ("rne", "upstream", "mse"); default
            ``format.SERVING_ENCODER`` ("mse", the most accurate in docs/accuracy.md).
        continuation_threshold: small/large continuation boundary; default: the kernels' constant
            (:func:`continuation_threshold`).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, scale: float, *,
                 sinks: torch.Tensor | None = None, sliding_window: int | None = None,
                 softcap: float | None = None, encoder: str = SERVING_ENCODER,
                 continuation_threshold: int | None = None) -> None:
        for name, v in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise UltraQuantError(f"{name}: expected a positive int, got {v!r}")
        check_heads(num_heads, num_kv_heads)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = check_head_size(head_size)
        self.scale = check_scale(scale)
        if sinks is not None:
            check_tensor("sinks", sinks, dtypes=(torch.float16, torch.bfloat16, torch.float32), ndim=1)
            if sinks.shape[0] != num_heads:
                raise UltraQuantError(f"sinks: expected shape ({num_heads},), got {tuple(sinks.shape)}")
        check_attention_options(num_heads, torch.device("cpu"), None, sliding_window, softcap)
        check_encoder(encoder)
        if continuation_threshold is not None and (isinstance(continuation_threshold, bool)
                                                   or not isinstance(continuation_threshold, int)
                                                   or continuation_threshold < 1):
            raise UltraQuantError(
                f"continuation_threshold: expected a positive int or None, got {continuation_threshold!r}")
        self._sinks_src = sinks
        self.sinks: torch.Tensor | None = None
        self.sliding_window = sliding_window
        self.softcap = float(softcap) if softcap is not None else None
        self.encoder = encoder
        self._threshold = continuation_threshold
        self._qsl_ws: torch.Tensor | None = None
        self._dense_ws = dense.SHARED
        self._sink_rows: dict[torch.dtype, dense.SinkRows] = {}
        self.route_counts: Counter[str] = Counter()
        """Calls per path: ``store``, ``decode`` (one op call each), and one per prefill run of each
        kind, ``first``, ``small``, ``large`` (or ``prefill``: one unplanned kernel call): for tests
        and logs. :attr:`prefill_routes` says which implementation served the runs."""
        self.prefill_routes: Counter[str] = Counter()
        """Prefill runs per ``kind:route``, route ``sdpa`` (:mod:`ultraquant.dense`), ``kernel``
        (:func:`ultraquant.prefill_attention`) or ``multiquery`` (:func:`ultraquant.spec_decode_attention`),
        e.g. ``first:sdpa``, ``small:kernel``, ``small:multiquery``, ``large:kernel`` (a soft-capped
        layer): the route each run actually took; speculative-decoding decodes count as
        ``spec_decode:multiquery`` or ``spec_decode:kernel``."""

    # ------------------------------------------------------------------ setup

    @property
    def threshold(self) -> int:
        """The continuation threshold in force."""
        return self._threshold if self._threshold is not None else continuation_threshold()

    def setup(self, device: torch.device | str, *, max_num_reqs: int = 256, dtype: torch.dtype | None = None,
              max_model_len: int | None = None) -> None:
        """On-device setup, once before serving (and before any CUDA graph capture).

        Moves the sinks to ``device`` as float32 and reserves the prefill workspace (rebased
        ``query_start_loc`` of up to ``max_num_reqs`` requests). With ``dtype`` (the query dtype) and
        ``max_model_len``, also builds the dense routes' sink constants and reserves the shared dense
        workspace for a ``max_model_len`` request, clipped to its cap (so a serving engine that
        measures free memory after this call sees it). Safe to call again: it only grows.
        """
        device = torch.device(device)
        if self._sinks_src is not None and (self.sinks is None or self.sinks.device != device):
            self.sinks = self._sinks_src.detach().to(device=device, dtype=torch.float32).contiguous()
            self._sink_rows.clear()
        need = max_num_reqs + 1
        if self._qsl_ws is None or self._qsl_ws.device != device or self._qsl_ws.shape[0] < need:
            if _capturing(device):
                raise UltraQuantError(
                    "setup: the workspace must be reserved before CUDA graph capture "
                    f"(needs {need} entries, has {0 if self._qsl_ws is None else self._qsl_ws.shape[0]})")
            self._qsl_ws = torch.zeros(need, dtype=torch.int32, device=device)
        if dtype is not None and dense.supported(self.softcap):
            self._dense_sinks(dtype)
            if max_model_len:
                # The largest need: a continuation whose prefix + chunk is the whole context.
                self._dense_ws.reserve(self._dense_elements(max_model_len - 1, max_model_len), dtype, device)

    def _ready(self, device: torch.device, num_reqs: int) -> bool:
        """Whether :meth:`setup` already covers ``device`` and ``num_reqs`` requests."""
        sinks_ok = self._sinks_src is None or (self.sinks is not None and self.sinks.device == device)
        ws = self._qsl_ws
        return sinks_ok and ws is not None and ws.device == device and ws.shape[0] > num_reqs

    def warmup_decode(self, kv_cache: torch.Tensor, *, max_num_reqs: int, max_seq_len: int,
                      dtype: torch.dtype, skip_cpu: bool = True, decode_query_len: int = 1) -> int:
        """Size the decode ops' workspaces for every batch of 1..``max_num_reqs`` requests, before
        any CUDA graph capture; returns the number of warm-up launches (0 when already done).

        Why every size: the kernels' split-KV workspace is grown on demand and its size is not
        monotonic in the batch (smaller batches get more splits), so capturing a large batch and
        then a smaller one could reallocate it under an earlier graph. One launch per size, largest
        first, on all-empty sequences (seq_lens 0: nothing is read), with a block table twice as
        wide as ``max_seq_len`` needs (the split count grows with the width, so this bounds what a
        real table asks for). Done once per distinct shape per process; skipped on the CPU (the
        reference keeps no workspace) unless ``skip_cpu=False``. ``decode_query_len`` > 1 (speculative
        decoding): also one multi-query decode launch per size (no tokens: nothing is read).
        """
        device = kv_cache.device
        if (skip_cpu and device.type == "cpu") or max_num_reqs <= 0 or _capturing(device):
            return 0
        bs = kv_cache.shape[1]
        width = 2 * max(1, -(-max_seq_len // bs))
        key = (str(device), tuple(kv_cache.shape), tuple(kv_cache.stride()), self.num_heads, self.head_size,
               dtype, width, max_num_reqs, self.sinks is not None or self._sinks_src is not None,
               self.sliding_window is not None, self.softcap is not None, decode_query_len)
        if key in _WARMED:
            return 0
        self.setup(device, max_num_reqs=max_num_reqs)
        q = torch.zeros(max_num_reqs, self.num_heads, self.head_size, dtype=dtype, device=device)
        out = torch.empty_like(q)
        table = torch.zeros(max_num_reqs, width, dtype=torch.int32, device=device)
        lens = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)
        opts = {"sinks": self.sinks, "sliding_window": self.sliding_window, "softcap": self.softcap}
        for b in range(max_num_reqs, 0, -1):
            ops.decode_attention(q[:b], kv_cache, table[:b], lens[:b], self.scale, out=out[:b], **opts)
        if decode_query_len > 1 and ops.spec_decode_takes_kernel(q, kv_cache, decode_query_len):
            qs = torch.zeros(max_num_reqs * decode_query_len, self.num_heads, self.head_size, dtype=dtype,
                             device=device)
            outs = torch.empty_like(qs)
            qsl = torch.zeros(max_num_reqs + 1, dtype=torch.int32, device=device)
            for b in range(max_num_reqs, 0, -1):
                ops.spec_decode_attention(qs[: b * decode_query_len], kv_cache, table[:b], lens[:b], qsl[: b + 1],
                                          self.scale, max_query_len=decode_query_len,
                                          out=outs[: b * decode_query_len], **opts)
        _WARMED.add(key)
        return max_num_reqs

    def reset(self) -> None:
        """Forget the device copy of the sinks (after new weights were loaded into the source)."""
        self.sinks = None
        self._sink_rows.clear()

    # ------------------------------------------------------------------ forward

    def store(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        """Write K/V of ``slot_mapping.shape[0]`` tokens (N, Hk, D) into the cache (negative = skip)."""
        n = slot_mapping.shape[0]
        if n == 0:
            return
        shape = (n, self.num_kv_heads, self.head_size)
        k, v = _rows(key, n), _rows(value, n)
        if k.dim() == 2:
            k, v = k.view(shape), v.view(shape)
        ops.store_kv(k, v, kv_cache, slot_mapping, encoder=self.encoder)
        self.route_counts["store"] += 1

    def forward(self, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
                kv_cache: torch.Tensor, metadata: AttentionMetadata, out: torch.Tensor | None = None, *,
                store: bool = True) -> torch.Tensor:
        """Store the new K/V (if ``store``), then attend: decodes first, then prefill runs.

        ``query`` is (T, Hq, D) or (T, Hq*D) with T >= ``metadata.num_actual_tokens`` (rows past it
        are padding); ``key``/``value`` likewise with Hk heads (needed whenever the batch holds a
        prefill, since chunks attend to their own raw K/V). ``out`` (same leading size, Hq*D
        elements per row, any float dtype) receives the result; padding rows are left untouched.
        Returns ``out`` (allocated like ``query`` when not given).
        """
        hq, d = self.num_heads, self.head_size
        t = query.shape[0]
        n = metadata.num_actual_tokens
        if n > t:
            raise UltraQuantError(f"metadata: num_actual_tokens {n} > query rows {t}")
        q = query if query.dim() == 3 else query.view(t, hq, d)
        if out is None:
            out = torch.empty((t, hq, d), dtype=query.dtype, device=query.device)
        if out.shape[0] < n or out.numel() != out.shape[0] * hq * d:
            raise UltraQuantError(
                f"out: expected ({t}, {hq}, {d}) or ({t}, {hq * d}), got {tuple(out.shape)}")
        o = out if out.dim() == 3 else out.view(out.shape[0], hq, d)
        if not self._ready(query.device, metadata.num_reqs):
            self.setup(query.device, max_num_reqs=max(256, metadata.num_reqs))
        if store and n:
            if key is None or value is None:
                raise UltraQuantError("key/value: required to store the new tokens")
            self.store(key, value, kv_cache, _rows(metadata.slot_mapping, n))
        if n == 0:
            return out
        nd = metadata.num_decodes
        nt = metadata.num_decode_tokens
        opts = {"sinks": self.sinks, "sliding_window": self.sliding_window, "softcap": self.softcap}
        if nd and metadata.decode_query_len == 1:
            ops.decode_attention(_rows(q, nd), kv_cache, _rows(metadata.block_table, nd),
                                 _rows(metadata.seq_lens, nd), self.scale, out=_rows(o, nd), **opts)
            self.route_counts["decode"] += 1
        elif nd:
            self._spec_decode(q, key, value, kv_cache, metadata, o, opts)
        if nd < metadata.num_reqs and nt < n:
            if key is None or value is None:
                raise UltraQuantError("key/value: a prefill chunk attends to its raw K/V; got None")
            k = key.view(key.shape[0], self.num_kv_heads, d)
            v = value.view(value.shape[0], self.num_kv_heads, d)
            self._prefill(q, k, v, kv_cache, metadata, o, opts)
        return out

    __call__ = forward

    def _spec_decode(self, q: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
                     kv_cache: torch.Tensor, md: AttentionMetadata, o: torch.Tensor, opts: dict) -> None:
        """The decode requests of a speculative-decoding step (1..``decode_query_len`` new tokens each,
        their K/V already stored): one :func:`ultraquant.spec_decode_attention` call (the multi-query
        decode, graph-safe: counts from ``query_start_loc`` on the device; the reference on the CPU, which
        reads the new tokens from the cache as a decode does); one prefill-kernel launch on their raw
        K/V on a GPU where no multi-query kernel serves the layer."""
        nd, nt, mq = md.num_decodes, md.num_decode_tokens, md.decode_query_len
        qsl = md.query_start_loc[: nd + 1]
        bt, lens = _rows(md.block_table, nd), _rows(md.seq_lens, nd)
        if ops.spec_decode_served(q, kv_cache, mq):
            ops.spec_decode_attention(_rows(q, nt), kv_cache, bt, lens, qsl, self.scale, max_query_len=mq,
                                      out=_rows(o, nt), **opts)
            self.prefill_routes["spec_decode:multiquery" if ops.spec_decode_takes_kernel(q, kv_cache, mq)
                                else "spec_decode:reference"] += 1
        else:
            if key is None or value is None:
                raise UltraQuantError("key/value: a speculative-decoding step off the multi-query decode "
                                      "attends to its raw K/V; got None")
            k = key.view(key.shape[0], self.num_kv_heads, self.head_size)
            v = value.view(value.shape[0], self.num_kv_heads, self.head_size)
            ops.prefill_attention(_rows(q, nt), _rows(k, nt), _rows(v, nt), kv_cache, bt, lens, qsl, self.scale,
                                  out=_rows(o, nt), **opts)
            self.prefill_routes["spec_decode:kernel"] += 1
        self.route_counts["spec_decode"] += 1

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 md: AttentionMetadata, o: torch.Tensor, opts: dict) -> None:
        """Serve requests ``num_decodes..B-1``, run by run (host plan), each on its route.

        First chunks and large continuations go to :mod:`ultraquant.dense` when the layer's features
        allow it (no soft cap) and the shared dense workspace's cap holds the run, everything else
        to one :func:`ultraquant.prefill_attention` call per run.
        """
        nd, n, b = md.num_decodes, md.num_actual_tokens, md.num_reqs
        if md.query_start_loc_cpu is None or md.seq_lens_cpu is None:
            # No host copies: one call over the whole prefill sub-batch; the ops plan it themselves.
            runs = [PrefillRun("prefill", nd, b, md.num_decode_tokens, n)]
            qsl_cpu: list[int] = []
        else:
            runs = prefill_runs(md.query_start_loc_cpu, md.seq_lens_cpu, nd, self.threshold)
            qsl_cpu = md.query_start_loc_cpu.tolist()
        ws = self._workspace(b - nd + 1, q.device)
        sinks = self._dense_sinks(q.dtype) if dense.supported(self.softcap) else None
        for run in runs:
            r0, r1, a, z = run.req_start, run.req_end, run.tok_start, run.tok_end
            route = self._dense_route(run, qsl_cpu, md, kv_cache.shape[1], q.dtype)
            if route == "first":
                starts = [x - a for x in qsl_cpu[r0 : r1 + 1]]
                dense.first_chunks(q[a:z], k[a:z], v[a:z], starts, o[a:z], self.scale, sinks=sinks,
                                   sliding_window=self.sliding_window, workspace=self._dense_ws)
            elif route == "large":
                prefix = int(md.seq_lens_cpu[r0]) - (z - a)
                dense.continuation(q[a:z], k[a:z], v[a:z], kv_cache, md.block_table[r0:r1], md.seq_lens[r0:r1],
                                   prefix, o[a:z], self.scale, sinks=sinks, sliding_window=self.sliding_window,
                                   workspace=self._dense_ws)
            else:
                qsl = ws[: r1 - r0 + 1]
                torch.sub(md.query_start_loc[r0 : r1 + 1], a, out=qsl)
                longest = _longest(qsl_cpu, r0, r1) if run.kind == "small" else 0
                if longest and ops.spec_decode_takes_kernel(q, kv_cache, longest):
                    # their K/V are in the cache already (stored first): the multi-query decode reads them there
                    ops.spec_decode_attention(q[a:z], kv_cache, md.block_table[r0:r1], md.seq_lens[r0:r1], qsl,
                                              self.scale, max_query_len=longest, out=o[a:z], **opts)
                    route = "multiquery"
                else:
                    ops.prefill_attention(q[a:z], k[a:z], v[a:z], kv_cache, md.block_table[r0:r1],
                                          md.seq_lens[r0:r1], qsl, self.scale, out=o[a:z], **opts)
            self.route_counts[run.kind] += 1
            label = {None: "kernel", "multiquery": "multiquery"}.get(route, "sdpa")
            self.prefill_routes[f"{run.kind}:{label}"] += 1

    def _dense_route(self, run: PrefillRun, qsl_cpu: list[int], md: AttentionMetadata, block_size: int,
                     dtype: torch.dtype) -> str | None:
        """``run.kind`` when :mod:`ultraquant.dense` serves the run, None for the kernel: soft-capped
        layers, unplanned or small runs, and runs whose workspace would exceed the dense cap."""
        if not dense.supported(self.softcap) or run.kind not in ("first", "large"):
            return None
        if run.kind == "first":
            longest = max(y - x for x, y in zip(qsl_cpu[run.req_start:run.req_end],
                                                qsl_cpu[run.req_start + 1:run.req_end + 1], strict=True))
            need = self._dense_elements(longest, longest)
        else:
            assert md.seq_lens_cpu is not None
            n = run.tok_end - run.tok_start
            prefix = int(md.seq_lens_cpu[run.req_start]) - n
            need = self._dense_elements(n, prefix - dense.first_visible(prefix, block_size, self.sliding_window) + n)
        return run.kind if self._dense_ws.fits(need, dtype) else None

    def _dense_elements(self, num_queries: int, key_rows: int) -> int:
        """Dense workspace elements of one request of this layer (:func:`dense.workspace_elements`)."""
        return dense.workspace_elements(num_queries, key_rows, self.num_heads, self.num_kv_heads, self.head_size,
                                        self._sinks_src is not None)

    def _dense_sinks(self, dtype: torch.dtype) -> dense.SinkRows | None:
        """The dense routes' sink constants in ``dtype``, built once (None without sinks)."""
        if self.sinks is None:
            return None
        rows = self._sink_rows.get(dtype)
        if rows is None:
            rows = self._sink_rows[dtype] = dense.SinkRows.build(self.sinks, self.scale, self.num_kv_heads,
                                                                 self.head_size, dtype)
        return rows

    def _workspace(self, entries: int, device: torch.device) -> torch.Tensor:
        """The rebased query_start_loc buffer, grown (outside capture only) to ``entries``."""
        if self._qsl_ws is None or self._qsl_ws.shape[0] < entries or self._qsl_ws.device != device:
            self.setup(device, max_num_reqs=max(entries - 1, 256))
        assert self._qsl_ws is not None
        return self._qsl_ws


def _longest(qsl_cpu: list[int], r0: int, r1: int) -> int:
    """Most new tokens of requests ``r0..r1-1`` (host query_start_loc)."""
    return max(qsl_cpu[i + 1] - qsl_cpu[i] for i in range(r0, r1))


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t[:n]`` without the cost of a new view when ``t`` has exactly ``n`` rows (host time counts
    on the eager decode path)."""
    return t if t.shape[0] == n else t[:n]


_WARMED: set[tuple] = set()
"""Shapes :meth:`UltraQuantAttention.warmup_decode` already covered in this process."""


def _capturing(device: torch.device) -> bool:
    """True while a CUDA graph is being captured on the current stream of ``device``."""
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
