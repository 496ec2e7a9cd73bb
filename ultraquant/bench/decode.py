"""Decode/store timings (``ultraquant bench``) on a GPU against the read ceiling and bf16 SDPA.

Everything is timed as a CUDA-graph replay (``--calls`` launches captured in one graph, median over
``--reps`` replays), on caches larger than the L2 (no flush). Rows:

* ``ceiling``: a Triton streaming read (wide int32 vector loads, a few GB): the bandwidth ceiling;
* ``stream``: a read of exactly the decode's cache pages with no math (the practical floor);
* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` on dense bf16 K/V (default
  dispatch, ``enable_gqa=True``): the baseline;
* ``uq``: ``ultraquant.decode_attention`` (whatever backend the policy picks: Triton JIT or AOT);
* ``jit`` / ``aot``: the same decode through the Triton JIT (``BACKEND=triton``) and through the AOT
  blob (``BACKEND=aot``: the blobs of ``ULTRAQUANT_GENERATED`` or the install; no row when none
  serves the config, the miss reason is printed), the AOT row named with its AOT/JIT time ratio
  (the AOT blob must be within 3% of the JIT).

Effective TB/s counts the bytes actually stored (``B * L * Hk * slot_size``). Also the store kernel's
throughput (N=16384 tokens x 8 heads) and a decode-time store of 64 tokens, and a PNG plot of latency
against context length. ``--json`` writes every number.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ultraquant.kernels.plans import LaunchPlan

SHAPES: dict[str, dict[str, int]] = {
    "A": dict(B=8, L=32768, Hq=32, Hk=8, D=128, block=64),
    "B": dict(B=32, L=8192, Hq=32, Hk=8, D=128, block=64),
    "C": dict(B=8, L=32768, Hq=16, Hk=2, D=256, block=64),
    "D": dict(B=64, L=2048, Hq=32, Hk=8, D=128, block=64),
}
"""The issue's benchmark shapes (block 64 everywhere)."""


@dataclass
class Row:
    """One timed configuration."""

    name: str
    us: float
    bytes: int
    tbps: float
    pct_ceiling: float
    speedup_vs_sdpa: float | None = None


def time_graph(fn: Callable[[], None], calls: int = 10, reps: int = 15) -> float:
    """Median microseconds per call of ``fn`` replayed from one CUDA graph of ``calls`` launches."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()  # warm-up: compile, load modules, size workspaces
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / calls)
    return statistics.median(times)


def _stream_kernels():
    """Triton streaming-read kernels (imported lazily: they need triton and a GPU)."""
    import triton
    import triton.language as tl

    @triton.jit
    def read_all(src, dst, n_vec, VEC: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        acc = tl.zeros([BLOCK, VEC], dtype=tl.int32)
        step = tl.num_programs(0) * BLOCK
        for start in range(pid * BLOCK, n_vec, step):
            rows = start + tl.arange(0, BLOCK)
            ptr = src + rows[:, None].to(tl.int64) * VEC + tl.arange(0, VEC)[None, :]
            acc ^= tl.load(ptr, mask=(rows < n_vec)[:, None], other=0)
        tl.store(dst + pid, tl.sum(tl.sum(acc, axis=1), axis=0))

    @triton.jit
    def read_pages(cache, bt, seq_lens, dst, stride_cb, stride_ct, stride_ch, stride_btb, num_splits,
                   SLOT_WORDS: tl.constexpr, SLOT_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   TILE: tl.constexpr):
        # Same work split as the decode kernel (request, kv head, split), no math: sums int32 words.
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        sp = tl.program_id(2)
        length = tl.load(seq_lens + b)
        per = tl.cdiv(tl.cdiv(length, num_splits), TILE) * TILE
        lo = sp * per
        hi = tl.minimum(lo + per, length)
        acc = tl.zeros([TILE, SLOT_PAD], dtype=tl.int32)
        w = tl.arange(0, SLOT_PAD)
        for t0 in range(lo, hi, TILE):
            toks = t0 + tl.arange(0, TILE)
            tm = toks < hi
            blk = tl.load(bt + b * stride_btb + toks // BLOCK_SIZE, mask=tm, other=0).to(tl.int64)
            base = blk * stride_cb + (toks % BLOCK_SIZE).to(tl.int64) * stride_ct + kvh * stride_ch
            ptr = (cache + base[:, None] + w[None, :])
            acc ^= tl.load(ptr, mask=tm[:, None] & (w[None, :] < SLOT_WORDS), other=0)
        tl.store(dst + (b * tl.num_programs(1) + kvh) * tl.num_programs(2) + sp, tl.sum(tl.sum(acc, 1), 0))

    return read_all, read_pages


def measure_ceiling(gib: float = 4.0) -> float:
    """TB/s of the streaming read over ``gib`` GiB (wide int32 vector loads)."""
    read_all, _ = _stream_kernels()
    vec = 4
    n_vec = int(gib * (1 << 30)) // (4 * vec)
    src = torch.randint(-(2**31), 2**31 - 1, (n_vec * vec,), dtype=torch.int32, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = sms * 8
    dst = torch.empty(grid, dtype=torch.int32, device="cuda")
    us = time_graph(lambda: read_all[(grid,)](src, dst, n_vec, VEC=vec, BLOCK=512, num_warps=8), calls=3)
    return n_vec * vec * 4 / (us * 1e-6) / 1e12


@dataclass
class DecodeProblem:
    """A filled cache (random bytes through the store kernel) and the matching dense bf16 K/V."""

    query: torch.Tensor
    kv_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    out: torch.Tensor
    stored_bytes: int


def make_decode_problem(B: int, L: int, Hq: int, Hk: int, D: int, block: int, head_major: bool = True,
                        seed: int = 0) -> DecodeProblem:
    """Cache of B requests x L tokens with shuffled blocks; K/V written through ultraquant.store_kv."""
    import ultraquant as uq

    gen = torch.Generator(device="cuda").manual_seed(seed)
    nblk = B * (L // block)
    slot = uq.slot_size(D)
    raw = torch.empty((nblk, Hk, block, slot) if head_major else (nblk, block, Hk, slot), dtype=torch.uint8,
                      device="cuda")
    cache = raw.permute(0, 2, 1, 3) if head_major else raw
    perm = torch.randperm(nblk, device="cuda", generator=gen).to(torch.int32)
    bt = perm.view(B, L // block)
    chunk = 16384
    total = B * L
    for s in range(0, total, chunk):
        n = min(chunk, total - s)
        tok = torch.arange(s, s + n, device="cuda")
        b, pos = tok // L, tok % L
        slots = bt[b, pos // block].long() * block + pos % block
        k = torch.randn(n, Hk, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn(n, Hk, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        uq.store_kv(k, v, cache, slots)
    q = torch.randn(B, Hq, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    return DecodeProblem(q, cache, bt, lens, torch.empty_like(q), B * L * Hk * slot)


def bench_decode(p: DecodeProblem, D: int) -> float:
    import ultraquant as uq

    scale = D ** -0.5
    return time_graph(lambda: uq.decode_attention(p.query, p.kv_cache, p.block_table, p.seq_lens, scale,
                                                  out=p.out))


def bench_aot_vs_jit(p: DecodeProblem, D: int) -> tuple[float, float | str]:
    """(JIT us, AOT us) of the same decode; the AOT entry is the miss reason when no blob serves it.
    The backend is overridden for these calls only (:func:`ultraquant.config.overridden`)."""
    from ultraquant import config as uq_config
    from ultraquant.errors import UltraQuantError

    with uq_config.overridden(backend="triton"):
        jit_us = bench_decode(p, D)
    with uq_config.overridden(backend="aot"):
        try:
            aot_us: float | str = bench_decode(p, D)
        except UltraQuantError as exc:
            aot_us = str(exc)
    return jit_us, aot_us


def bench_stream(p: DecodeProblem, block: int, splits: int) -> float:
    _, read_pages = _stream_kernels()
    B, Hk = p.block_table.shape[0], p.kv_cache.shape[2]
    words = p.kv_cache.shape[3] // 4
    # The same bytes seen as int32 words (slot sizes and strides are multiples of 4 bytes).
    base = p.kv_cache
    st = [s // 4 for s in base.stride()[:3]]
    flat = torch.as_strided(base, (base.untyped_storage().nbytes(),), (1,), 0).view(torch.int32)
    dst = torch.empty(B * Hk * splits, dtype=torch.int32, device="cuda")
    return time_graph(lambda: read_pages[(B, Hk, splits)](
        flat, p.block_table, p.seq_lens, dst, st[0], st[1], st[2], p.block_table.stride(0), splits,
        SLOT_WORDS=words, SLOT_PAD=1 << (words - 1).bit_length(), BLOCK_SIZE=block, TILE=32, num_warps=2))


def bench_sdpa(B: int, L: int, Hq: int, Hk: int, D: int) -> float:
    q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, Hk, L, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, Hk, L, D, device="cuda", dtype=torch.bfloat16)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def run() -> None:
        sdpa(q, k, v, enable_gqa=True)

    us = time_graph(run)
    return us


StoreVariant = tuple[int, int, bool, int, int | None]
"""(BLOCK_R, num_warps, WHOLE_ROWS, LANES, maxnreg): a launch shape of the store kernel."""

STORE_VARIANTS: tuple[StoreVariant, ...] = (
    (32, 1, True, 0, 144), (16, 4, False, 0, None), (8, 1, False, 4, None), (32, 4, False, 4, None),
    (64, 4, False, 4, None), (32, 4, False, 8, None), (16, 1, False, 2, None))
"""Launch shapes of the store kernel that ``--store-variants`` times on both stores (whole rows: 32 rows
per warp; LANES 0 and not whole rows: the few-rows layout of a decode step; LANES L > 0: rows over L
lanes, the plan's on NVIDIA
from D=128 on at (32, 4) and (8, 1) for few rows; maxnreg None: ptxas decides). The plain store rows
are the plan's own choice."""


def bench_store(n: int, hk: int, d: int, variant: StoreVariant | None = None) -> tuple[float, int]:
    """(us, bytes read + written) of a store of ``n`` tokens x ``hk`` heads into a shuffled cache:
    ``ultraquant.store_kv``, or with ``variant`` the plan's launch reshaped to that (see
    :data:`STORE_VARIANTS`) through the Triton JIT."""
    import ultraquant as uq

    k = torch.randn(n, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(n, hk, d, device="cuda", dtype=torch.bfloat16)
    block = 64
    nblk = -(-n // block) + 1
    cache = torch.zeros(nblk, block, hk, uq.slot_size(d), dtype=torch.uint8, device="cuda")
    slots = torch.randperm(nblk * block, device="cuda")[:n]
    if variant is None:
        us = time_graph(lambda: uq.store_kv(k, v, cache, slots))
    else:
        from ultraquant.kernels import registry

        launch = store_variant_launch(k, v, cache, slots, variant)
        us = time_graph(lambda: registry.jit_launch(launch))
    return us, n * hk * (4 * d + uq.slot_size(d))


def store_variant_launch(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                         variant: StoreVariant) -> LaunchPlan:
    """The plan's store launch reshaped to ``variant`` (see :data:`STORE_VARIANTS`; WHOLE_ROWS is meant
    for BLOCK_R = 32 x num_warps, correct for any)."""
    from ultraquant.kernels.plans import LaunchPlan, plan_store

    block_r, warps, whole, lanes, maxnreg = variant
    plan = plan_store(key, value, kv_cache, slot_mapping, few_rows=not whole and lanes == 0)
    spec = replace(plan.spec, constexprs={**plan.spec.constexprs, "BLOCK_R": block_r, "WHOLE_ROWS": whole,
                                          "LANES": lanes}, num_warps=warps, maxnreg=maxnreg)
    return LaunchPlan(spec, plan.args, (-(-key.shape[0] * key.shape[1] // block_r), 1, 1))


def store_variant_name(variant: StoreVariant) -> str:
    """How a bench row names a launch shape."""
    block_r, warps, whole, lanes, maxnreg = variant
    return (f"rows/prog {block_r} warps {warps}{' whole rows' if whole else ''}{f' lanes {lanes}' if lanes else ''}"
            f"{f' maxnreg {maxnreg}' if maxnreg else ''}")


def store_rows(ceiling: float, variants: bool) -> list[Row]:
    """The store rows: N=16384 tokens x 8 heads x D=128 and a decode step's 64 tokens, each through
    ``ultraquant.store_kv`` and, with ``variants``, every :data:`STORE_VARIANTS` launch shape."""
    rows = []
    for n, label in ((16384, ""), (64, " (decode step)")):
        us, nbytes = bench_store(n, 8, 128)
        rows.append(_row(f"store N={n} Hk=8 D=128{label}", us, nbytes, ceiling))
        for variant in STORE_VARIANTS if variants else ():
            us, nbytes = bench_store(n, 8, 128, variant)
            rows.append(_row(f"store N={n} {store_variant_name(variant)}", us, nbytes, ceiling))
        for r in rows[-1 - (len(STORE_VARIANTS) if variants else 0):]:
            print(f"  {r.name}: {r.us:.1f} us", flush=True)
    return rows


def _row(name: str, us: float, nbytes: int, ceiling: float, sdpa_us: float | None = None) -> Row:
    tbps = nbytes / (us * 1e-6) / 1e12
    return Row(name, us, nbytes, tbps, 100.0 * tbps / ceiling, None if sdpa_us is None else sdpa_us / us)


SWEEP = [(splits, warps, tile) for tile in (32, 64) for warps in (2, 4) for splits in (8, 16, 32, 64)]
"""(splits, num_warps, TILE) decode variants that ``--sweep`` times on shapes A and D."""


def sweep(rows: list[Row], ceiling: float, names: list[str]) -> None:
    """Time decode variants through the plans' tuning variables (head-major cache)."""
    import dataclasses

    from ultraquant import config as uq_config

    for name in names:
        s = SHAPES[name]
        p = make_decode_problem(s["B"], s["L"], s["Hq"], s["Hk"], s["D"], s["block"])
        for splits, warps, tile in SWEEP:
            tuning = dataclasses.replace(uq_config.get().tuning, decode_splits=splits, decode_warps=warps,
                                         decode_tile=tile)
            try:
                with uq_config.overridden(tuning=tuning):
                    us = bench_decode(p, s["D"])
            except Exception as exc:  # a variant that does not compile is a finding, not a crash
                print(f"sweep {name} {splits}/{warps}/{tile}: {type(exc).__name__}: {exc}"[:300], flush=True)
                continue
            rows.append(_row(f"{name} sweep splits={splits} warps={warps} tile={tile}", us, p.stored_bytes,
                             ceiling))
            print(f"  {rows[-1].name}: {rows[-1].us:.1f} us", flush=True)
        uq_config.reload()
        del p
        torch.cuda.empty_cache()


def run_bench(shapes: list[str], plot: str | None, layouts: list[str], with_stream: bool,
              sweep_shapes: list[str] | None = None, aot_vs_jit: bool = True, store_variants: bool = False) -> dict:
    """Run everything; return a JSON-able dict and print the table."""
    torch.manual_seed(0)
    import ultraquant as uq
    from ultraquant import config
    from ultraquant.kernels import heuristics, plans

    ceiling = measure_ceiling()
    rows: list[Row] = []
    print(f"ceiling (streaming read, int32x4 loads): {ceiling:.2f} TB/s", flush=True)
    for name in shapes:
        s = SHAPES[name]
        sdpa_us = bench_sdpa(s["B"], s["L"], s["Hq"], s["Hk"], s["D"])
        sdpa_bytes = 2 * s["B"] * s["L"] * s["Hk"] * s["D"] * 2
        rows.append(_row(f"{name} sdpa-bf16", sdpa_us, sdpa_bytes, ceiling))
        for layout in layouts:
            p = make_decode_problem(s["B"], s["L"], s["Hq"], s["Hk"], s["D"], s["block"],
                                    head_major=layout == "head")
            splits = heuristics.decode_splits(s["B"], s["Hk"], p.block_table.shape[1] * s["block"], p.query.device,
                                         s["D"])
            plan = plans.plan_decode(p.query, p.kv_cache, p.block_table, p.seq_lens, s["D"] ** -0.5, None, None,
                                     None, p.out, config.get().tuning)
            kind = "whole-page" if plan.spec.kernel == "uq_decode_wholepage" else "split-KV"
            label = f"{kind}, " + ", ".join(f"{k} {v}" for k, v in plan.notes.items())
            if with_stream:
                rows.append(_row(f"{name} stream-{layout}", bench_stream(p, s["block"], splits), p.stored_bytes,
                                 ceiling, sdpa_us))
            rows.append(_row(f"{name} uq-{layout} ({label})", bench_decode(p, s["D"]), p.stored_bytes,
                             ceiling, sdpa_us))
            print(f"  {rows[-1].name}: {rows[-1].us:.1f} us", flush=True)
            if aot_vs_jit:
                jit_us, aot_us = bench_aot_vs_jit(p, s["D"])
                rows.append(_row(f"{name} uq-{layout} jit", jit_us, p.stored_bytes, ceiling, sdpa_us))
                if isinstance(aot_us, str):
                    print(f"  {name} uq-{layout} aot: no blob: {aot_us}"[:400], flush=True)
                else:
                    rows.append(_row(f"{name} uq-{layout} aot ({aot_us / jit_us:.3f}x jit)", aot_us,
                                     p.stored_bytes, ceiling, sdpa_us))
            del p
            torch.cuda.empty_cache()
    if sweep_shapes:
        sweep(rows, ceiling, sweep_shapes)
    rows += store_rows(ceiling, store_variants)
    curve = []
    if plot:
        s = SHAPES["A"]
        for L in (1024, 4096, 16384, 32768, 65536, 131072):
            p = make_decode_problem(s["B"], L, s["Hq"], s["Hk"], s["D"], s["block"])
            curve.append({"L": L, "uq_us": bench_decode(p, s["D"]),
                          "sdpa_us": bench_sdpa(s["B"], L, s["Hq"], s["Hk"], s["D"])})
            del p
            torch.cuda.empty_cache()
        _plot(curve, plot)
    print()
    print(f"{'config':44s} {'us':>9s} {'TB/s':>6s} {'%ceil':>6s} {'vs sdpa':>8s}")
    for r in rows:
        sp = "" if r.speedup_vs_sdpa is None else f"{r.speedup_vs_sdpa:.2f}x"
        print(f"{r.name:44s} {r.us:9.1f} {r.tbps:6.2f} {r.pct_ceiling:6.1f} {sp:>8s}")
    return {"ceiling_tbps": ceiling, "rows": [asdict(r) for r in rows], "curve": curve,
            "device": torch.cuda.get_device_name(0), "version": uq.__version__}


def _plot(curve: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [c["L"] for c in curve]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, [c["sdpa_us"] for c in curve], "o-", label="torch SDPA bf16")
    ax.plot(xs, [c["uq_us"] for c in curve], "s-", label="UltraQuant decode")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens), B=8, Hq/Hk=32/8, D=128")
    ax.set_ylabel("latency (us, CUDA-graph replay)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---------------------------------------------------------------- prefill routes (--prefill)

PREFILL_CHUNKS = (16, 32, 64, 128, 256, 512, 1024, 2048)
"""Continuation chunk lengths (new tokens) ``--prefill`` times."""
PREFILL_CONTEXTS = (1024, 4096, 16384)
"""Cached prefix lengths ``--prefill`` times."""
PREFILL_SHAPE = dict(Hq=32, Hk=8, D=128, block=64)
"""Head configuration of the prefill sweep (bf16)."""
FLUSH_BYTES = 256 << 20
"""Bytes written between timed calls so that each call starts with a cold L2 (the H200 has 50 MB)."""


@dataclass
class PrefillRow:
    """One (prefix, chunk) point: both routes' device time (graph, cold L2), eager time per call of
    back-to-back calls (no flush, no sync: what an eager prefill pays, the larger of host and device
    time) and host time (CPU time to enqueue one call)."""

    ctx: int
    q: int
    kernel_us: float
    sdpa_us: float
    kernel_eager_us: float
    sdpa_eager_us: float
    max_rel_diff: float
    kernel_host_us: float = 0.0
    sdpa_host_us: float = 0.0


def time_eager(fn: Callable[[], None], calls: int = 5, reps: int = 7) -> float:
    """Median microseconds per call of ``calls`` back-to-back eager calls (host work included, as an
    eager prefill sees it: a call costs the larger of its host and device time)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / calls)
    return statistics.median(times)


def time_host(fn: Callable[[], None], calls: int = 5, reps: int = 7) -> float:
    """Median microseconds of CPU time to enqueue one call of ``fn`` (``calls`` back to back after a
    sync, so the launch queue never fills and nothing waits on the GPU): the host cost per call."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) * 1e6 / calls)
    torch.cuda.synchronize()
    return statistics.median(times)


def _time_route(fn: Callable[[], None], flush: Callable[[], None], flush_graph_us: float) -> tuple[float, float, float]:
    """(graph, eager, host) microseconds per call of ``fn``: graph replay with the L2 flushed before
    every call (flush time measured alone and subtracted), eager back-to-back calls without a flush
    (a flush in the eager loop would hide up to its own device time of host work and then be
    subtracted: host-bound routes read too fast), and the host enqueue time alone."""
    def both() -> None:
        flush()
        fn()

    eager_us = time_eager(fn)
    host_us = time_host(fn)
    try:
        graph_us = time_graph(both, calls=5, reps=7) - flush_graph_us
    except RuntimeError as exc:  # a route that cannot be captured is still timed (eagerly)
        print(f"  graph capture failed ({type(exc).__name__}: {exc}"[:200] + "); using eager time", flush=True)
        torch.cuda.synchronize()
        graph_us = eager_us
    return graph_us, eager_us, host_us


def suggest_threshold(rows: list[PrefillRow]) -> tuple[int, dict[int, int]]:
    """The continuation threshold T (chunks <= T on the kernel, larger on dequant + SDPA) that
    minimizes the mean slowdown against the faster route over every timed point, and per prefix the
    largest chunk at which the kernel was still faster (0: SDPA won everywhere).

    Candidates are the timed chunk lengths and half the smallest (SDPA for every timed chunk).
    """
    per_ctx = {}
    for ctx in sorted({r.ctx for r in rows}):
        wins = [r.q for r in rows if r.ctx == ctx and r.kernel_us <= r.sdpa_us]
        per_ctx[ctx] = max(wins, default=0)
    chunks = sorted({r.q for r in rows})
    candidates = [max(1, chunks[0] // 2)] + chunks

    def cost(t: int) -> float:
        return sum((r.kernel_us if r.q <= t else r.sdpa_us) / min(r.kernel_us, r.sdpa_us) for r in rows)

    return min(candidates, key=cost), per_ctx


def run_prefill_bench(chunks: tuple[int, ...] = PREFILL_CHUNKS, contexts: tuple[int, ...] = PREFILL_CONTEXTS) -> dict:
    """Time the kernel route (``ultraquant.prefill_attention``) against dequant + SDPA
    (``ultraquant.dense.continuation``, what the layer runs for a large continuation) for one request
    of each (prefix, chunk) pair, exactly as the attention layer calls them; print the table and the
    suggested ``CONTINUATION_THRESHOLD``; return a JSON-able dict.
    """
    import ultraquant as uq
    from ultraquant import dense
    from ultraquant.kernels import heuristics

    torch.manual_seed(0)
    hq, hk, d, bs = (PREFILL_SHAPE[k] for k in ("Hq", "Hk", "D", "block"))
    scale = d ** -0.5
    q_max, ctx_max = max(chunks), max(contexts)
    p = make_decode_problem(1, -(-(ctx_max + q_max) // bs) * bs, hq, hk, d, bs, head_major=True)
    gen = torch.Generator(device="cuda").manual_seed(1)
    query = torch.randn(q_max, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    key = torch.randn(q_max, hk, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    value = torch.randn(q_max, hk, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    out_k = torch.empty_like(query)
    out_d = torch.empty_like(query)
    ws = dense.DenseWorkspace()
    scratch = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")

    def flush() -> None:
        scratch.fill_(1)

    flush_graph_us = time_graph(flush, calls=5, reps=7)
    rows: list[PrefillRow] = []
    print(f"prefill routes: Hq={hq} Hk={hk} D={d} block={bs} bf16, one request, cold L2; "
          f"CONTINUATION_THRESHOLD now {heuristics.CONTINUATION_THRESHOLD}", flush=True)
    for ctx in contexts:
        for n in chunks:
            seq = torch.tensor([ctx + n], dtype=torch.int32, device="cuda")
            qsl = torch.tensor([0, n], dtype=torch.int32, device="cuda")
            table = p.block_table[:, : -(-(ctx + n) // bs)]  # as wide as the sequence (the kernel's split count)
            q, k, v = query[:n], key[:n], value[:n]

            def kernel(q=q, k=k, v=v, seq=seq, qsl=qsl, table=table, n=n) -> None:
                uq.prefill_attention(q, k, v, p.kv_cache, table, seq, qsl, scale, out=out_k[:n])

            def sdpa(q=q, k=k, v=v, seq=seq, table=table, n=n, ctx=ctx) -> None:
                dense.continuation(q, k, v, p.kv_cache, table, seq, ctx, out_d[:n], scale, workspace=ws)

            kernel()
            sdpa()
            ref = out_k[:n].float()
            diff = float((out_d[:n].float() - ref).abs().max() / ref.abs().max().clamp_min(1e-12))
            k_us, k_eager, k_host = _time_route(kernel, flush, flush_graph_us)
            d_us, d_eager, d_host = _time_route(sdpa, flush, flush_graph_us)
            rows.append(PrefillRow(ctx, n, k_us, d_us, k_eager, d_eager, diff, k_host, d_host))
            print(f"  ctx {ctx:6d} q {n:5d}: kernel {k_us:9.1f} us  sdpa {d_us:9.1f} us  "
                  f"(eager {k_eager:9.1f} / {d_eager:9.1f}, host {k_host:7.1f} / {d_host:7.1f})  diff {diff:.1e}",
                  flush=True)
    suggested, per_ctx = suggest_threshold(rows)
    eager_rows = [PrefillRow(r.ctx, r.q, r.kernel_eager_us, r.sdpa_eager_us, 0.0, 0.0, 0.0) for r in rows]
    suggested_eager, per_ctx_eager = suggest_threshold(eager_rows)
    print()
    print(f"{'ctx':>6s} {'q':>5s} {'kernel us':>10s} {'sdpa us':>10s} {'faster':>7s} {'eager k':>10s} "
          f"{'eager s':>10s} {'host k':>8s} {'host s':>8s} {'diff':>8s}")
    for r in rows:
        faster = "kernel" if r.kernel_us <= r.sdpa_us else "sdpa"
        print(f"{r.ctx:6d} {r.q:5d} {r.kernel_us:10.1f} {r.sdpa_us:10.1f} {faster:>7s} {r.kernel_eager_us:10.1f} "
              f"{r.sdpa_eager_us:10.1f} {r.kernel_host_us:8.1f} {r.sdpa_host_us:8.1f} {r.max_rel_diff:8.1e}")
    for ctx in contexts:
        print(f"crossover ctx {ctx}: kernel faster up to q = {per_ctx[ctx]} (eager: {per_ctx_eager[ctx]})")
    print(f"suggested threshold: {suggested} (device time; eager timing suggests {suggested_eager})")
    return {"shape": dict(PREFILL_SHAPE, dtype="bf16"), "rows": [asdict(r) for r in rows],
            "crossover": {str(c): t for c, t in per_ctx.items()},
            "crossover_eager": {str(c): t for c, t in per_ctx_eager.items()},
            "suggested_threshold": suggested, "suggested_threshold_eager": suggested_eager,
            "current_threshold": heuristics.CONTINUATION_THRESHOLD,
            "device": torch.cuda.get_device_name(0), "version": uq.__version__}


# ---------------------------------------------------------------- the serving suite (--serving)

@dataclass(frozen=True)
class ServingShape:
    """One batch a serving engine runs: ``lens`` (per request), heads, head size, block size, page order."""

    name: str
    lens: tuple[int, ...]
    Hq: int
    Hk: int
    D: int
    block: int = 16
    head_major: bool = True


def ragged_lens(n: int, lo: int, hi: int, seed: int) -> tuple[int, ...]:
    """``n`` lengths log-uniform in ``[lo, hi]`` (a server's mix of short and long requests), shuffled by ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    lens = torch.exp(torch.log(torch.tensor(float(lo))) + u * (torch.log(torch.tensor(float(hi / lo)))))
    out = lens.round().to(torch.int64).clamp(lo, hi)
    out[0], out[1] = lo, hi  # the spread is exactly hi / lo
    return tuple(int(x) for x in out[torch.randperm(n, generator=gen)])


def serving_shapes() -> list[ServingShape]:
    """The ``--serving`` rows: ragged batches (>= 64 requests, lengths spread 64x), GQA 16, one kv head,
    short requests, token-major pages, and the uniform shapes A-D at vLLM's block size 16."""
    shapes = [ServingShape("ragged 96 req 192..12288 (32/8)", ragged_lens(96, 192, 12288, seed=7), 32, 8, 128),
              ServingShape("ragged 64 req 128..16384 (32/8)", ragged_lens(64, 128, 16384, seed=11), 32, 8, 128),
              ServingShape("ragged 80 req 256..16384 (32/4)", ragged_lens(80, 256, 16384, seed=5), 32, 4, 128),
              ServingShape("GQA16 32/2 B8x32k", (32768,) * 8, 32, 2, 128),
              ServingShape("GQA16 16/1 B16x16k", (16384,) * 16, 16, 1, 128),
              ServingShape("one kv head 8/1 B16x32k", (32768,) * 16, 8, 1, 128),
              ServingShape("short 256 req x 1k (32/8)", (1024,) * 256, 32, 8, 128),
              ServingShape("A token-major bs16", (32768,) * 8, 32, 8, 128, head_major=False)]
    for name, s in SHAPES.items():
        shapes.append(ServingShape(f"{name} bs16", (s["L"],) * s["B"], s["Hq"], s["Hk"], s["D"]))
    return shapes


def make_ragged_problem(lens: tuple[int, ...], Hq: int, Hk: int, D: int, block: int, head_major: bool = True,
                        seed: int = 0) -> DecodeProblem:
    """A paged cache of requests of lengths ``lens`` (shuffled blocks, the table padded with valid ids), K/V
    written through ultraquant.store_kv (only the requests' tokens)."""
    import ultraquant as uq

    gen = torch.Generator(device="cuda").manual_seed(seed)
    nb = [-(-n // block) for n in lens]
    nblk, width = sum(nb), max(max(nb), 1)
    slot = uq.slot_size(D)
    raw = torch.empty((nblk, Hk, block, slot) if head_major else (nblk, block, Hk, slot), dtype=torch.uint8,
                      device="cuda")
    cache = raw.permute(0, 2, 1, 3) if head_major else raw
    perm = torch.randperm(nblk, device="cuda", generator=gen).to(torch.int32)
    bt = torch.zeros(len(lens), width, dtype=torch.int32, device="cuda")
    off = 0
    for i, n in enumerate(nb):
        bt[i, :n] = perm[off:off + n]
        off += n
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    starts = torch.cumsum(lens_t.long(), 0) - lens_t.long()
    total = int(lens_t.sum())
    chunk = 16384
    for s in range(0, total, chunk):
        n = min(chunk, total - s)
        tok = torch.arange(s, s + n, device="cuda")
        b = torch.searchsorted(starts, tok, right=True) - 1
        pos = tok - starts[b]
        slots = bt[b, pos // block].long() * block + pos % block
        k = torch.randn(n, Hk, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn(n, Hk, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        uq.store_kv(k, v, cache, slots)
    q = torch.randn(len(lens), Hq, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    return DecodeProblem(q, cache, bt, lens_t, torch.empty_like(q), total * Hk * slot)


def _splitkv_diff(p: DecodeProblem, D: int) -> float:
    """Largest |decode - split-KV decode| over the largest |split-KV decode| (two independent kernels agree)."""
    import ultraquant as uq
    from ultraquant import config as uq_config

    out = uq.decode_attention(p.query, p.kv_cache, p.block_table, p.seq_lens, D ** -0.5)
    tuning = replace(uq_config.get().tuning, decode_wholepage=False)
    with uq_config.overridden(tuning=tuning, backend="triton"):
        ref = uq.decode_attention(p.query, p.kv_cache, p.block_table, p.seq_lens, D ** -0.5).float()
    return float((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


def run_serving_bench(aot_vs_jit: bool = True, names: list[str] | None = None) -> dict:
    """Time every :func:`serving_shapes` batch (decode through the policy and JIT / AOT; without
    ``aot_vs_jit`` one row: the blob where one serves it, else the policy's), each against the
    read ceiling of this run, bf16 SDPA where one dense call covers the batch (uniform lengths), and the
    time a bf16 kernel at the ceiling would take; check each against split-KV decode. Return a JSON-able dict."""
    import ultraquant as uq
    from ultraquant import config
    from ultraquant.kernels import plans

    torch.manual_seed(0)
    ceiling = measure_ceiling()
    print(f"ceiling (streaming read, int32x4 loads): {ceiling:.2f} TB/s", flush=True)
    rows: list[dict] = []
    for s in serving_shapes():
        if names and not any(n in s.name for n in names):
            continue
        p = make_ragged_problem(s.lens, s.Hq, s.Hk, s.D, s.block, s.head_major, seed=len(rows) + 3)
        uniform = len(set(s.lens)) == 1
        sdpa_us = bench_sdpa(len(s.lens), s.lens[0], s.Hq, s.Hk, s.D) if uniform else None
        bf16_bytes = 2 * sum(s.lens) * s.Hk * s.D * 2
        bf16_ceiling_us = bf16_bytes / (ceiling * 1e12) * 1e6
        plan = plans.plan_decode(p.query, p.kv_cache, p.block_table, p.seq_lens, s.D ** -0.5, None, None, None,
                                 p.out, config.get().tuning)
        kind = "whole-page" if plan.spec.kernel == "uq_decode_wholepage" else "split-KV"
        diff = _splitkv_diff(p, s.D)
        timed = {}
        if not aot_vs_jit:  # the blob when one serves the row (named "aot"), else whatever the policy runs
            from ultraquant.errors import UltraQuantError

            try:
                with config.overridden(backend="aot"):
                    timed["aot"] = bench_decode(p, s.D)
            except UltraQuantError as exc:
                print(f"  {s.name}: no blob ({exc})"[:300], flush=True)
        if not timed:
            timed["uq"] = bench_decode(p, s.D)
        if aot_vs_jit:
            jit_us, aot_us = bench_aot_vs_jit(p, s.D)
            timed["jit"] = jit_us
            if isinstance(aot_us, str):
                print(f"  {s.name} aot: no blob: {aot_us}"[:400], flush=True)
            else:
                timed["aot"] = aot_us
        for how, us in timed.items():
            r = _row(f"{s.name} {how} ({kind})", us, p.stored_bytes, ceiling, sdpa_us)
            rows.append({**asdict(r), "shape": s.name, "how": how, "kernel": kind, "notes": plan.notes,
                         "requests": len(s.lens), "tokens": sum(s.lens), "min_len": min(s.lens),
                         "max_len": max(s.lens), "block": s.block, "head_major": s.head_major,
                         "Hq": s.Hq, "Hk": s.Hk, "D": s.D, "sdpa_us": sdpa_us,
                         "vs_bf16_at_ceiling": bf16_ceiling_us / us, "max_rel_diff_vs_splitkv": diff})
            sp = "" if r.speedup_vs_sdpa is None else f"{r.speedup_vs_sdpa:.2f}x sdpa"
            print(f"  {r.name:58s} {us:8.1f} us {r.pct_ceiling:5.1f}% {sp:>11s} "
                  f"{bf16_ceiling_us / us:5.2f}x bf16@ceil diff {diff:.1e}", flush=True)
        del p
        torch.cuda.empty_cache()
    return {"ceiling_tbps": ceiling, "serving": rows, "device": torch.cuda.get_device_name(0),
            "version": uq.__version__}
