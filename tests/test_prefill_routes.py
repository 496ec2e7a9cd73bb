"""The dense prefill routes (ultraquant.dense) and the layer's route choice, on the CPU.

The dense routes run torch SDPA (CPU kernels) and, for continuations, the Triton dequant kernel under
the interpreter; they are checked against ``reference.prefill_attention`` (float64) over the same
cache, with outputs poisoned by NaN. Cases cover GQA 1 and 4, sinks, sliding windows (blocks wholly
before the window are poisoned, as vLLM's null block may be), ragged multi-request batches, first
chunks and continuations, and which route the layer takes (and that soft cap keeps the kernel).
"""

from __future__ import annotations

import collections

import pytest
import torch

from tests.helpers import layer_batch
from ultraquant import dense, ops, policy, reference
from ultraquant.attention import AttentionMetadata, UltraQuantAttention
from ultraquant.errors import UltraQuantError
from ultraquant.format import hadamard, slot_size
from ultraquant.kernels.interpret import interpreted_registry


@pytest.fixture(scope="module", autouse=True)
def _interpreted():
    interpreted_registry()


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute error relative to the largest reference magnitude; NaN (unwritten) fails."""
    assert not got.isnan().any(), "unwritten (NaN-poisoned) output elements"
    g, r = got.double(), ref.double()
    return float((g - r).abs().max() / r.abs().max().clamp_min(1e-12))


class Problem:
    """Requests with a cached prefix (stored by the reference) and a chunk of raw K/V each.

    Cache bytes outside the prefixes are random; with ``poison_before`` every block that lies wholly
    before position ``poison_before[i]`` of request i is replaced in its table by a block of 0xFF
    bytes (huge scales: reading it would overflow to inf/NaN).
    """

    def __init__(self, prefixes: list[int], chunks: list[int], hq: int, hk: int, d: int, bs: int, *,
                 dtype: torch.dtype = torch.float32, seed: int = 0, head_major: bool = False,
                 poison_before: list[int] | None = None) -> None:
        g = torch.Generator().manual_seed(seed)
        totals = [p + n for p, n in zip(prefixes, chunks, strict=True)]
        need = [-(-t // bs) for t in totals]
        nb = sum(need) + 3
        shape = (nb, hk, bs, slot_size(d)) if head_major else (nb, bs, hk, slot_size(d))
        raw = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
        self.cache = raw.permute(0, 2, 1, 3) if head_major else raw
        poison_block = nb - 1
        self.cache[poison_block] = 0xFF
        free = torch.randperm(nb - 1, generator=g).tolist()
        self.block_table = torch.zeros(len(totals), max(need), dtype=torch.int32)
        keys, values = [], []
        for i, (p, n) in enumerate(zip(prefixes, chunks, strict=True)):
            ids = [free.pop() for _ in range(need[i])]
            self.block_table[i, : need[i]] = torch.tensor(ids, dtype=torch.int32)
            k = torch.randn(p + n, hk, d, generator=g).to(dtype)
            v = torch.randn(p + n, hk, d, generator=g).to(dtype)
            if p:
                pos = torch.arange(p)
                slots = self.block_table[i, pos // bs].long() * bs + pos % bs
                reference.store_kv(k[:p], v[:p], self.cache, slots)
            if poison_before is not None:
                self.block_table[i, : poison_before[i] // bs] = poison_block
            keys.append(k[p:])
            values.append(v[p:])
        self.prefixes, self.chunks = prefixes, chunks
        self.seq_lens = torch.tensor(totals, dtype=torch.int32)
        self.starts = [0] + torch.tensor(chunks).cumsum(0).tolist()
        self.qsl = torch.tensor(self.starts, dtype=torch.int32)
        self.key, self.value = torch.cat(keys), torch.cat(values)
        self.query = (torch.randn(self.starts[-1], hq, d, generator=g) * 2).to(dtype)

    def to(self, device: str) -> Problem:
        """Move every tensor to ``device`` (same cache bytes); returns self."""
        for name in ("cache", "block_table", "seq_lens", "qsl", "key", "value", "query"):
            setattr(self, name, getattr(self, name).to(device))
        return self

    def expected(self, scale: float, **opts) -> torch.Tensor:
        """The reference over the same cache (float64 inside, rounded to float32)."""
        return reference.prefill_attention(self.query.float(), self.key.float(), self.value.float(), self.cache,
                                           self.block_table, self.seq_lens, self.qsl, scale, **opts)


# (Hq, Hk, D, block, sinks, window)
FEATURES = [
    (4, 4, 64, 16, False, None),
    (8, 2, 64, 16, True, None),
    (8, 2, 32, 8, False, 5),
    (4, 1, 64, 16, True, 12),
]
IDS = ["gqa1", "gqa4-sinks", "gqa4-window", "gqa4-sinks-window"]


def _sinks(hq: int, on: bool) -> torch.Tensor | None:
    """Sink logits large enough to matter (up to a third of the probability mass)."""
    return torch.linspace(-3.0, 4.0, hq) if on else None


@pytest.mark.parametrize("case", FEATURES, ids=IDS)
def test_first_chunks_match_reference(case: tuple) -> None:
    hq, hk, d, bs, sinks_on, window = case
    p = Problem([0, 0, 0, 0], [7, 1, 19, 33], hq, hk, d, bs, seed=hq + d)
    sinks = _sinks(hq, sinks_on)
    out = torch.full(p.query.shape, float("nan"))
    served = dense.first_chunks(p.query, p.key, p.value, p.starts, out, 0.3, sinks=sinks, sliding_window=window,
                                workspace=dense.DenseWorkspace())
    assert served == 4
    assert rel_err(out, p.expected(0.3, sinks=sinks, sliding_window=window)) < 1e-5


def _spy_dequant(monkeypatch: pytest.MonkeyPatch, block_size: int) -> list[list[int]]:
    """Record the block ids each ops.dequant_kv_packed call reads (it still runs)."""
    reads: list[list[int]] = []
    real = ops.dequant_kv_packed

    def spy(kv_cache, block_table, seq_lens, *args, **kwargs):
        for row, n in zip(block_table.tolist(), seq_lens.tolist(), strict=True):
            reads.append(row[: -(-n // block_size)])
        return real(kv_cache, block_table, seq_lens, *args, **kwargs)

    monkeypatch.setattr(ops, "dequant_kv_packed", spy)
    return reads


@pytest.mark.parametrize("head_major", [False, True])
@pytest.mark.parametrize("case", FEATURES, ids=IDS)
def test_continuations_match_reference(monkeypatch: pytest.MonkeyPatch, case: tuple, head_major: bool) -> None:
    hq, hk, d, bs, sinks_on, window = case
    prefixes, chunks = [37, 5, 70, 16], [9, 16, 3, 40]
    poison = None if window is None else [max(0, pre - window + 1) for pre in prefixes]
    p = Problem(prefixes, chunks, hq, hk, d, bs, seed=7 * hq + d, head_major=head_major, poison_before=poison)
    poison_block = p.cache.shape[0] - 1
    if poison is not None:
        assert (p.block_table == poison_block).any(), "the case must poison some blocks"
    reads = _spy_dequant(monkeypatch, bs)
    sinks = _sinks(hq, sinks_on)
    out = torch.full(p.query.shape, float("nan"))
    ws = dense.DenseWorkspace()
    for i, pre in enumerate(prefixes):  # one call per request, sharing one workspace (as the layer does)
        a, b = p.starts[i], p.starts[i + 1]
        dense.continuation(p.query[a:b], p.key[a:b], p.value[a:b], p.cache, p.block_table[i:i + 1],
                           p.seq_lens[i:i + 1], pre, out[a:b], 0.3, sinks=sinks, sliding_window=window, workspace=ws)
    assert rel_err(out, p.expected(0.3, sinks=sinks, sliding_window=window)) < 1e-5
    assert len(reads) == len(prefixes) and all(poison_block not in r for r in reads), reads
    if window is None:  # the whole prefix was read
        assert [len(r) for r in reads] == [-(-pre // bs) for pre in prefixes]


def test_shared_workspace_holds_no_state() -> None:
    """Layers of other shapes share the workspace: NaN left in it by anyone must not leak in."""
    ws = dense.DenseWorkspace()
    for dtype in (torch.float32, torch.bfloat16):
        ws.take(2 * 500 * 3 * 40, dtype, torch.device("cpu")).fill_(float("nan"))
    for sinks_on, window in ((True, None), (True, 6), (False, None)):
        p = Problem([0, 29], [13, 11], 8, 2, 64, 16, seed=11)
        sinks = _sinks(8, sinks_on)
        out = torch.full(p.query.shape, float("nan"))
        dense.first_chunks(p.query[:13], p.key[:13], p.value[:13], [0, 13], out[:13], 0.3, sinks=sinks,
                           sliding_window=window, workspace=ws)
        dense.continuation(p.query[13:], p.key[13:], p.value[13:], p.cache, p.block_table[1:], p.seq_lens[1:], 29,
                           out[13:], 0.3, sinks=sinks, sliding_window=window, workspace=ws)
        assert rel_err(out, p.expected(0.3, sinks=sinks, sliding_window=window)) < 1e-5
    layers = UltraQuantAttention(8, 2, 64, 0.1), UltraQuantAttention(4, 4, 32, 0.1)
    assert layers[0]._dense_ws is layers[1]._dense_ws is dense.SHARED


def test_bf16_out_and_many_window_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 end to end (workspace in the query dtype), window tiles of 4 queries, masks stay small."""
    monkeypatch.setattr(dense, "WINDOW_TILE_MIN", 4)
    monkeypatch.setattr(dense, "WINDOW_TILE_MAX", 4)
    masks = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        masks.append(None if attn_mask is None else tuple(attn_mask.shape))
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(dense.F, "scaled_dot_product_attention", spy)
    window = 6
    p = Problem([50], [30], 8, 2, 64, 16, dtype=torch.bfloat16, seed=3, poison_before=[50 - window + 1])
    sinks = _sinks(8, True)
    out = torch.full(p.query.shape, float("nan"), dtype=torch.bfloat16)
    dense.continuation(p.query, p.key, p.value, p.cache, p.block_table, p.seq_lens, 50, out, 0.125, sinks=sinks,
                       sliding_window=window, workspace=dense.DenseWorkspace())
    assert rel_err(out, p.expected(0.125, sinks=sinks, sliding_window=window)) < 1e-2
    assert len(masks) == 30 // 4 + 1
    assert all(m is not None and m[0] <= 4 and m[1] <= 1 + 4 + window - 1 for m in masks), masks


def test_no_mask_without_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain first chunks run ``is_causal`` without any mask tensor (no N x N mask for long prompts)."""
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, is_causal=False, **kw):
        calls.append((attn_mask, is_causal))
        return sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)

    monkeypatch.setattr(dense.F, "scaled_dot_product_attention", spy)
    p = Problem([0, 0], [300, 40], 4, 2, 32, 16, seed=5)
    out = torch.full(p.query.shape, float("nan"))
    dense.first_chunks(p.query, p.key, p.value, p.starts, out, 0.2)
    assert calls == [(None, True), (None, True)]
    assert rel_err(out, p.expected(0.2)) < 1e-5
    calls.clear()
    # A window wider than the prompt is no window: still no mask.
    dense.first_chunks(p.query, p.key, p.value, p.starts, out, 0.2, sliding_window=300)
    assert calls == [(None, True), (None, True)]


def test_sink_logit_is_carried_to_fp32_precision() -> None:
    """hi + lo in bf16 carries sink / scale far better than one bf16 number would."""
    sinks = torch.tensor([7.3, -5.111, 0.0, 13.77])
    scale = 0.0883883
    rows = dense.SinkRows.build(sinks, scale, 2, 32, torch.bfloat16)
    q = torch.zeros(3, 4, 32, dtype=torch.bfloat16)
    k_new = torch.randn(3, 2, 32, dtype=torch.bfloat16)
    padded, keys, values, off = dense._operands(q, k_new, k_new, 0, None, rows, dense.DenseWorkspace())
    assert padded.shape == (3, 4, 32 + dense.SINK_COLUMNS)
    got = (padded[0, :, 32].double() + padded[0, :, 33].double()) * scale
    assert torch.allclose(got, sinks.double(), rtol=1e-4, atol=1e-6)
    assert not padded[..., 34:].any() and not padded[..., :32].any()
    one_number = padded[0, :, 32].double() * scale
    assert (one_number - sinks.double()).abs().max() > 1e-3  # why the second column exists
    # The sink key: zero head, 1 in both carrying columns, zero value; chunk rows have zero pad columns.
    assert off == 1 and keys.shape == (4, 2, 32 + dense.SINK_COLUMNS)
    assert keys[0, :, 32:34].eq(1).all() and not keys[0, :, :32].any() and not keys[0, :, 34:].any()
    assert not values[0].any() and not keys[1:, :, 32:].any() and torch.equal(keys[1:, :, :32], k_new)


ALLOCATING = {"empty", "empty_like", "zeros", "zeros_like", "new_zeros", "new_empty", "ones", "new_ones", "full",
              "cat", "stack", "arange", "_to_copy", "clone", "tril"}
"""aten ops that make a new tensor (besides SDPA's own output)."""


def _aten_ops(fn) -> collections.Counter:
    """aten ops (by name) one call of ``fn`` dispatches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: collections.Counter = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    with Count() as c:
        fn()
    return c.ops


@pytest.mark.parametrize("window", [None, 8], ids=["causal", "window"])
def test_warm_calls_allocate_nothing(monkeypatch: pytest.MonkeyPatch, window: int | None) -> None:
    """Once the workspace, the sink constants and the window band exist, a dense call makes no new
    tensor (host time per call in eager prefill): only the CPU's bottom-right causal mask remains (the
    sink key makes even a first chunk bottom-right; CUDA runs flash's own causal mode there)."""
    monkeypatch.setattr(dense, "WINDOW_TILE_MIN", 8)
    monkeypatch.setattr(dense, "WINDOW_TILE_MAX", 8)
    monkeypatch.setattr(ops, "dequant_kv_packed", lambda *args, **kwargs: None)  # one launch on a GPU
    p = Problem([0, 40], [24, 24], 8, 2, 64, 16, seed=2)
    rows = dense.SinkRows.build(_sinks(8, True), 0.2, 2, 64, torch.float32)
    ws = dense.DenseWorkspace()
    out = torch.empty_like(p.query)

    def first() -> None:
        dense.first_chunks(p.query[:24], p.key[:24], p.value[:24], [0, 24], out[:24], 0.2, sinks=rows,
                           sliding_window=window, workspace=ws)

    def cont() -> None:
        dense.continuation(p.query[24:], p.key[24:], p.value[24:], p.cache, p.block_table[1:], p.seq_lens[1:], 40,
                           out[24:], 0.2, sinks=rows, sliding_window=window, workspace=ws)

    for fn in (first, cont):
        fn()
        made = {op: n for op, n in _aten_ops(fn).items() if op in ALLOCATING}
        expect = {"ones": 1, "tril": 1} if window is None else {}
        clipped_tile = {"arange": 2} if (fn is first and window) else {}  # the first tile starts at key 0
        assert made == {**expect, **clipped_tile}, (fn.__name__, made)


def test_workspace_cap_and_reserve(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ULTRAQUANT_DENSE_WORKSPACE_MB", "0.5")
    ws = dense.DenseWorkspace()
    assert ws.cap_bytes == 1 << 19
    assert ws.fits(1 << 17, torch.float32) and not ws.fits((1 << 17) + 1, torch.float32)
    assert ws.reserve(1 << 30, torch.bfloat16, "cpu") == 1 << 19  # clipped to the cap
    with pytest.raises(UltraQuantError, match="cap"):
        ws.take((1 << 17) + 1, torch.float32, torch.device("cpu"))
    assert ws.take(1 << 18, torch.bfloat16, torch.device("cpu")).numel() == 1 << 18
    assert dense.workspace_elements(5, 5, 8, 2, 64, False) == 0  # a first chunk without sinks: raw tensors
    assert dense.workspace_elements(5, 12, 8, 2, 64, False) == 2 * 12 * 2 * 64
    assert dense.workspace_elements(5, 12, 8, 2, 64, True) == 2 * 13 * 2 * 72 + 5 * 8 * 72


# ------------------------------------------------------------------ the layer's routes

HQ, HK, D, BS = 8, 2, 64, 8


def _layer_batch(seed: int = 0):
    """decode(1) | first(6) first(3) | small(2) | large(7) | large(5): metadata, q/k/v and cache."""
    return layer_batch([1, 6, 3, 2, 7, 5], [12, 6, 3, 20, 31, 9], num_heads=HQ, num_kv_heads=HK, head_size=D,
                       block_size=BS, num_blocks=40, seed=seed, encoder="mse")


def _expected(md: AttentionMetadata, query, key, value, cache, scale: float, **opts) -> torch.Tensor:
    """The reference ops over the cache as the layer left it (store first)."""
    out = torch.empty(query.shape)
    out[:1] = reference.decode_attention(query[:1], cache, md.block_table[:1], md.seq_lens[:1], scale,
                                         **opts)
    out[1:] = reference.prefill_attention(query[1:], key[1:], value[1:], cache,
                                          md.block_table[1:], md.seq_lens[1:], md.query_start_loc[1:] - 1, scale,
                                          **opts)
    return out


def _count_kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the token count of every ops.prefill_attention call (it still runs)."""
    calls: list[int] = []
    real = ops.prefill_attention

    def spy(query, *args, **kwargs):
        calls.append(query.shape[0])
        return real(query, *args, **kwargs)

    monkeypatch.setattr(ops, "prefill_attention", spy)
    return calls


@pytest.mark.parametrize("opts", [{}, {"sinks": True, "sliding_window": 6}], ids=["plain", "sinks-window"])
def test_layer_routes_first_and_large_to_sdpa(monkeypatch: pytest.MonkeyPatch, opts: dict) -> None:
    md, query, key, value, cache = _layer_batch()
    if opts.get("sinks"):
        opts = {**opts, "sinks": torch.linspace(-1.0, 2.0, HQ)}
    kernel_calls = _count_kernel_calls(monkeypatch)
    layer = UltraQuantAttention(HQ, HK, D, 0.15, continuation_threshold=4, **opts)
    out = torch.full((query.shape[0], HQ * D), float("nan"))
    layer.forward(query, key, value, cache, md, out)
    assert dict(layer.route_counts) == {"store": 1, "decode": 1, "first": 1, "small": 1, "large": 2}
    assert dict(layer.prefill_routes) == {"first:sdpa": 1, "small:kernel": 1, "large:sdpa": 2}
    assert kernel_calls == [2]  # only the small continuation reached the kernel
    expect = _expected(md, query, key, value, cache, 0.15, **opts)
    assert rel_err(out.view(query.shape), expect) < 1e-5


def test_softcap_keeps_the_kernel_route(monkeypatch: pytest.MonkeyPatch) -> None:
    md, query, key, value, cache = _layer_batch(seed=1)
    kernel_calls = _count_kernel_calls(monkeypatch)
    layer = UltraQuantAttention(HQ, HK, D, 0.15, continuation_threshold=4, softcap=6.0)
    out = torch.full(query.shape, float("nan"))
    layer.forward(query, key, value, cache, md, out)
    assert dict(layer.prefill_routes) == {"first:kernel": 1, "small:kernel": 1, "large:kernel": 2}
    assert kernel_calls == [9, 2, 7, 5]
    assert rel_err(out, _expected(md, query, key, value, cache, 0.15, softcap=6.0)) < 1e-5


def test_large_runs_dense_without_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU without Triton's interpreter dequantizes with the reference: every route stays as planned."""
    md, query, key, value, cache = _layer_batch(seed=2)
    monkeypatch.delenv("TRITON_INTERPRET")
    launched = []
    monkeypatch.setattr(policy, "launch", lambda plan: launched.append(plan))
    layer = UltraQuantAttention(HQ, HK, D, 0.15, continuation_threshold=4)
    out = layer.forward(query, key, value, cache, md)
    assert dict(layer.prefill_routes) == {"first:sdpa": 1, "small:kernel": 1, "large:sdpa": 2}
    assert not launched
    assert rel_err(out, _expected(md, query, key, value, cache, 0.15)) < 1e-5


@pytest.mark.parametrize("opts", [{}, {"sinks": True, "sliding_window": 6}], ids=["plain", "sinks-window"])
def test_workspace_cap_routes_runs_to_the_kernel(monkeypatch: pytest.MonkeyPatch, opts: dict) -> None:
    """Runs whose dense workspace would pass the cap take the kernel; the others stay dense."""
    md, query, key, value, cache = _layer_batch(seed=3)
    if opts.get("sinks"):
        opts = {**opts, "sinks": torch.linspace(-1.0, 2.0, HQ)}
    sinks = "sinks" in opts
    # Large runs: prefixes 24 and 4 with chunks 7 and 5 (with the window, from their first visible block).
    window = opts.get("sliding_window")
    need = [dense.workspace_elements(n, pre - dense.first_visible(pre, BS, window) + n, HQ, HK, D, sinks)
            for pre, n in ((24, 7), (4, 5))]
    first_need = dense.workspace_elements(6, 6, HQ, HK, D, sinks)  # the longest first chunk
    cap = (min(need) + max(need)) // 2
    assert min(need) < cap < max(need)
    monkeypatch.setattr(dense, "SHARED", dense.DenseWorkspace(cap_bytes=cap * 4))
    kernel_calls = _count_kernel_calls(monkeypatch)
    layer = UltraQuantAttention(HQ, HK, D, 0.15, continuation_threshold=4, **opts)
    out = layer.forward(query, key, value, cache, md)
    first = "first:sdpa" if first_need <= cap else "first:kernel"
    assert dict(layer.prefill_routes) == {first: 1, "small:kernel": 1, "large:sdpa": 1, "large:kernel": 1}
    big = 7 if need[0] > need[1] else 5
    assert kernel_calls == ([9] if first == "first:kernel" else []) + [2] + [big]
    assert rel_err(out, _expected(md, query, key, value, cache, 0.15, **opts)) < 1e-5
    # A cap of zero sends every large run (and first runs with sinks) to the kernel.
    layer = UltraQuantAttention(HQ, HK, D, 0.15, continuation_threshold=4, **opts)
    layer._dense_ws = dense.DenseWorkspace(cap_bytes=0)
    layer.forward(query, key, value, cache, md, store=False)
    first = "first:kernel" if sinks else "first:sdpa"
    assert dict(layer.prefill_routes) == {first: 1, "small:kernel": 1, "large:kernel": 2}


def test_setup_reserves_the_dense_workspace(monkeypatch: pytest.MonkeyPatch) -> None:
    ws = dense.DenseWorkspace(cap_bytes=1 << 20)
    monkeypatch.setattr(dense, "SHARED", ws)
    layer = UltraQuantAttention(HQ, HK, D, 0.15, sinks=torch.zeros(HQ))
    layer.setup("cpu", dtype=torch.bfloat16, max_model_len=100)
    held = ws.reserve(0, torch.bfloat16, "cpu")
    assert held >= 2 * dense.workspace_elements(100, 100, HQ, HK, D, True)
    assert torch.bfloat16 in layer._sink_rows
    layer.setup("cpu", dtype=torch.bfloat16, max_model_len=10**6)  # clipped to the cap
    assert ws.reserve(0, torch.bfloat16, "cpu") == 1 << 20


@pytest.mark.parametrize("original_space", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequant_packed_reference_fallback(monkeypatch: pytest.MonkeyPatch, original_space: bool,
                                           dtype: torch.dtype) -> None:
    """Without the interpreter, ops.dequant_kv_packed on CPU tensors gives the reference's values at
    cu_seqlens (rows outside them untouched) and agrees with the interpreted kernel."""
    p = Problem([37, 5, 70], [0, 0, 0], 4, 2, 64, 16, seed=4)
    lens = torch.tensor([37, 0, 70], dtype=torch.int32)
    cu = torch.tensor([3, 40, 41, 111], dtype=torch.int32)
    results = []
    for interpret in ("0", "1"):
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
        k = torch.full((115, 2, 64), float("nan"), dtype=dtype)
        v = torch.full_like(k, float("nan"))
        ops.dequant_kv_packed(p.cache, p.block_table, lens, cu, k, v, original_space=original_space)
        results.append((k, v))
    (k, v), (k_kernel, v_kernel) = results
    keys, values = reference.dequant_kv(p.cache, p.block_table, lens)
    for b, (start, n) in ((0, (3, 37)), (2, (41, 70))):  # request 1 is empty
        want_k = keys[b] if original_space else keys[b].double() @ hadamard(64, dtype=torch.float64)
        assert rel_err(k[start:start + n], want_k) < (1e-6 if dtype == torch.float32 else 4e-3)
        assert torch.equal(v[start:start + n], values[b].to(dtype))
    written = torch.zeros(115, dtype=torch.bool)
    written[3:40] = written[41:111] = True
    assert k[~written].isnan().all() and v[~written].isnan().all()
    assert torch.allclose(k[written].float(), k_kernel[written].float(), rtol=1e-2 if dtype != torch.float32 else 1e-5,
                          atol=1e-3)
    assert torch.equal(v[written], v_kernel[written])


def test_bench_suggests_the_measured_crossover() -> None:
    """``ultraquant bench --prefill``'s rule on synthetic timings (the H200 supplies the real ones)."""
    from ultraquant.bench.decode import PREFILL_CHUNKS, PrefillRow, suggest_threshold

    def rows(ctx: int, sdpa_fixed: float, slope: float = 0.5) -> list[PrefillRow]:  # kernel: q us
        return [PrefillRow(ctx, q, float(q), sdpa_fixed + slope * q, 0.0, 0.0, 0.0) for q in PREFILL_CHUNKS]

    assert suggest_threshold(rows(1024, 50.0)) == (64, {1024: 64})  # crossover at q = 100
    both = rows(1024, 50.0) + rows(4096, 200.0)  # crossovers 100 and 400
    threshold, per_ctx = suggest_threshold(both)
    assert per_ctx == {1024: 64, 4096: 256} and threshold in (64, 128, 256)
    assert suggest_threshold(rows(1024, 0.0, 0.25)) == (8, {1024: 0})  # SDPA always faster
    assert suggest_threshold(rows(1024, 1e6)) == (2048, {1024: 2048})  # the kernel always faster


@pytest.mark.parametrize("sinks_on", [False, True], ids=["window", "sinks-window"])
def test_window_tiles_exact_in_float32(monkeypatch: pytest.MonkeyPatch, sinks_on: bool) -> None:
    """Many 4-query tiles (the first clipped at key 0, the rest on the cached band; with sinks the sink key
    moved before each tile's keys) match the reference to float32 precision, first chunks and continuations."""
    monkeypatch.setattr(dense, "WINDOW_TILE_MIN", 4)
    monkeypatch.setattr(dense, "WINDOW_TILE_MAX", 4)
    window = 6
    p = Problem([0, 50], [30, 30], 8, 2, 64, 16, seed=8, poison_before=[0, 50 - window + 1])
    sinks = _sinks(8, sinks_on)
    out = torch.full(p.query.shape, float("nan"))
    ws = dense.DenseWorkspace()
    dense.first_chunks(p.query[:30], p.key[:30], p.value[:30], [0, 30], out[:30], 0.2, sinks=sinks,
                       sliding_window=window, workspace=ws)
    dense.continuation(p.query[30:], p.key[30:], p.value[30:], p.cache, p.block_table[1:], p.seq_lens[1:], 50,
                       out[30:], 0.2, sinks=sinks, sliding_window=window, workspace=ws)
    assert rel_err(out, p.expected(0.2, sinks=sinks, sliding_window=window)) < 1e-5
