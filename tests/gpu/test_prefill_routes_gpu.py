"""The dense prefill routes on a GPU at realistic sizes (bf16): flash/efficient SDPA and the Triton
dequant kernel against the float64 reference over the same cache, the layer's routes on a mixed
batch, and no host sync on either route.

Run on the H200: ``python -m pytest -q -m gpu tests/gpu/test_prefill_routes_gpu.py`` (with the bench:
``python -m pytest -q -m gpu tests/gpu/test_prefill_routes_gpu.py && ultraquant bench --prefill``).
"""

from __future__ import annotations

import pytest
import torch

from tests.test_prefill_routes import Problem
from ultraquant import dense
from ultraquant.attention import AttentionMetadata, UltraQuantAttention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/HIP GPU"),
]

MAX_REL = 1e-2
MIN_COS = 0.9999


def check_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Relative L2 error and cosine of the whole output against the reference; NaN (unwritten) fails."""
    assert not got.isnan().any(), "unwritten (NaN-poisoned) or NaN output elements"
    g, r = got.double().flatten(), ref.double().flatten()
    rel = float((g - r).norm() / r.norm())
    cos = float(torch.nn.functional.cosine_similarity(g, r, dim=0))
    assert rel <= MAX_REL and cos >= MIN_COS, f"rel {rel:.2e} cos {cos:.6f}"


# (name, Hq, Hk, D, block, sinks, window, head_major)
CASES = [
    ("llama-gqa4", 32, 8, 128, 64, False, None, True),
    ("gqa1", 8, 8, 128, 16, False, None, False),
    ("oss-sinks-window", 64, 8, 64, 16, True, 128, True),
    ("d256-gqa2-window", 8, 4, 256, 32, False, 1000, False),
]


def _sinks(hq: int, on: bool) -> torch.Tensor | None:
    return torch.linspace(-2.0, 3.0, hq, device="cuda") if on else None


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_first_chunks_gpu(case: tuple) -> None:
    _, hq, hk, d, bs, sinks_on, window, head_major = case
    p = Problem([0, 0, 0, 0], [1000, 1, 2048, 77], hq, hk, d, bs, dtype=torch.bfloat16, seed=hq + d,
                head_major=head_major).to("cuda")
    sinks = _sinks(hq, sinks_on)
    out = torch.full(p.query.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    dense.first_chunks(p.query, p.key, p.value, p.starts, out, d ** -0.5, sinks=sinks, sliding_window=window,
                       workspace=dense.DenseWorkspace())
    check_close(out, p.expected(d ** -0.5, sinks=sinks, sliding_window=window))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_continuations_gpu(case: tuple) -> None:
    """Long prefixes, chunks of 513..1024; with a window, blocks wholly before it are 0xFF poison."""
    _, hq, hk, d, bs, sinks_on, window, head_major = case
    prefixes, chunks = [4096, 3000, 1500], [1024, 513, 700]
    poison = None if window is None else [max(0, pre - window + 1) for pre in prefixes]
    p = Problem(prefixes, chunks, hq, hk, d, bs, dtype=torch.bfloat16, seed=3 * hq + d, head_major=head_major,
                poison_before=poison).to("cuda")
    sinks = _sinks(hq, sinks_on)
    out = torch.full(p.query.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    ws = dense.DenseWorkspace()
    for i, pre in enumerate(prefixes):
        a, b = p.starts[i], p.starts[i + 1]
        dense.continuation(p.query[a:b], p.key[a:b], p.value[a:b], p.cache, p.block_table[i:i + 1],
                           p.seq_lens[i:i + 1], pre, out[a:b], d ** -0.5, sinks=sinks, sliding_window=window,
                           workspace=ws)
    check_close(out, p.expected(d ** -0.5, sinks=sinks, sliding_window=window))


def run_warm_without_sync(run) -> None:
    """Call ``run`` once to warm up (kernel compiles, workspace), then again with CUDA's sync debug
    mode set to error: the warm call must only enqueue work."""
    run()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run()
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_routes_make_no_host_sync() -> None:
    """Both dense routes enqueue work only (the dequant length is computed on the device)."""
    p = Problem([0, 2000], [300, 600], 32, 8, 128, 64, dtype=torch.bfloat16, seed=9).to("cuda")
    out = torch.empty(p.query.shape, dtype=torch.bfloat16, device="cuda")
    ws = dense.DenseWorkspace()

    def run() -> None:
        dense.first_chunks(p.query[:300], p.key[:300], p.value[:300], [0, 300], out[:300], 0.1, workspace=ws)
        dense.continuation(p.query[300:], p.key[300:], p.value[300:], p.cache, p.block_table[1:],
                           p.seq_lens[1:], 2000, out[300:], 0.1, workspace=ws)

    run_warm_without_sync(run)
    check_close(out, p.expected(0.1))


def test_sinks_window_routes_make_no_host_sync() -> None:
    """Sinks + window (gpt-oss style): per-layer SinkRows, several window tiles, the sink key moved
    before each tile, warm calls enqueue work only."""
    hq, hk, d, window = 64, 8, 64, 128
    p = Problem([0, 2000], [600, 600], hq, hk, d, 16, dtype=torch.bfloat16, seed=12,
                poison_before=[0, 2000 - window + 1]).to("cuda")
    sinks = _sinks(hq, True)
    rows = dense.SinkRows.build(sinks, d ** -0.5, hk, d, torch.bfloat16)
    out = torch.full(p.query.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    ws = dense.DenseWorkspace()

    def run() -> None:
        dense.first_chunks(p.query[:600], p.key[:600], p.value[:600], [0, 600], out[:600], d ** -0.5, sinks=rows,
                           sliding_window=window, workspace=ws)
        dense.continuation(p.query[600:], p.key[600:], p.value[600:], p.cache, p.block_table[1:],
                           p.seq_lens[1:], 2000, out[600:], d ** -0.5, sinks=rows, sliding_window=window,
                           workspace=ws)

    run_warm_without_sync(run)
    check_close(out, p.expected(d ** -0.5, sinks=sinks, sliding_window=window))


def test_layer_routes_gpu() -> None:
    """A mixed batch: decode | first | small | large; the layer serves first and large by SDPA."""
    hq, hk, d, bs = 32, 8, 128, 64
    prefixes, chunks = [700, 0, 900, 5000], [1, 1500, 40, 2000]
    p = Problem(prefixes, chunks, hq, hk, d, bs, dtype=torch.bfloat16, seed=4).to("cuda")
    md = AttentionMetadata.build(query_lens=chunks, seq_lens=p.seq_lens.tolist(), block_table=p.block_table,
                                 slot_mapping=[-1] * sum(chunks), device="cuda")
    layer = UltraQuantAttention(hq, hk, d, d ** -0.5, continuation_threshold=128)
    out = torch.full(p.query.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    layer.forward(p.query, p.key, p.value, p.cache, md, out, store=False)
    assert dict(layer.prefill_routes) == {"first:sdpa": 1, "small:kernel": 1, "large:sdpa": 1}
    # Row 0 is a decode over its 700 cached tokens plus one raw one (not stored): compare prefill rows.
    check_close(out[1:], p.expected(d ** -0.5)[1:])
